"""The ``aurora_delta`` backend of a running ``vllm serve``, driven over its RL routes.

Theory of operation
-------------------
:class:`HTTPWeightClient` posts what :class:`aurora.engines.vllm.VLLMEngine` calls in process to
``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights`` and
``/finish_weight_update``, inside ``/pause?mode=wait`` ... ``/resume`` so that no request
straddles two versions, and resets the prefix cache before resuming. vLLM mounts those routes
only with :data:`DEV_MODE_ENV` set to ``1`` in the server's environment (a 404 says so). Every
rank's weights come back through ``/collective_rpc`` for the content digest.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

import numpy as np

from aurora.delta import Delta
from aurora.delta.apply import check_base
from aurora.engines.base import EngineError
from aurora.engines.vllm_messages import delta_bytes, ranks_from_messages, snapshot_bytes

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
"""``vllm serve`` mounts the RL routes (``/pause``, ``/init_weight_transfer_engine``, ...,
``/reset_prefix_cache``) only when this environment variable is ``1``."""


class HTTPWeightClient:
    """Drives the ``aurora_delta`` backend of a running ``vllm serve`` over its RL routes. The
    server must run with ``VLLM_SERVER_DEV_MODE=1`` in its environment (vLLM mounts those
    routes only then) and ``--worker-extension-cls
    aurora.engines.vllm_plugin.AuroraWorkerExtension --weight-transfer-config
    '{"backend": "aurora_delta"}'`` on its command line (:func:`serve_command`)."""

    def __init__(self, base_url: str, *, timeout: float = 300.0) -> None:
        self.base_url, self.timeout = base_url.rstrip("/"), timeout
        self.version: int | None = None
        self.weights_hash: str | None = None

    def _post(self, route: str, body: Mapping[str, Any] | None = None) -> Any:
        url = f"{self.base_url}{route}"
        req = urllib.request.Request(
            url,
            data=json.dumps(body or {}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            if exc.code == 404:
                detail += (
                    f" (vllm serve mounts its RL routes only with {DEV_MODE_ENV}=1 in its "
                    "environment)"
                )
            raise EngineError(f"POST {url}: HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise EngineError(f"POST {url}: {exc}") from None

    def init(self, *, version: int, weights_hash: str) -> None:
        """Declare the version and h(v) of the weights the server loaded."""
        self._post(
            "/init_weight_transfer_engine",
            {"init_info": {"version": version, "weights_hash": weights_hash}},
        )
        self.version, self.weights_hash = version, weights_hash

    def _update(self, info: Mapping[str, Any], version: int) -> None:
        """One update between requests: pause (letting running requests finish), update,
        reset the prefix cache, resume."""
        self._post("/pause?mode=wait")
        try:
            self._post("/start_weight_update")
            self._post("/update_weights", {"update_info": dict(info)})
            self._post("/finish_weight_update", {"weight_version": str(version)})
            self._updated(info, version)
            # no KV computed under the old weights may serve a request after /resume (see
            # VLLMEngine._drop_stale_kv); paused, no request holds a block, so it succeeds
            reset = self._post("/reset_prefix_cache")
            if not (isinstance(reset, Mapping) and reset.get("success") is True):
                raise EngineError(
                    f"{self.base_url}: vllm serve refused to reset its prefix cache after the "
                    f"update to v{version} ({reset!r}): KV of the old weights may remain"
                )
        finally:
            self._post("/resume")

    def _updated(self, info: Mapping[str, Any], version: int) -> None:
        self.version = version
        self.weights_hash = str(info.get("expected_hash") or info.get("weights_hash"))

    def apply(self, delta: Delta) -> str:
        """Apply the verified ``D_{v+1}`` between requests."""
        if self.version is None or self.weights_hash is None:
            raise EngineError("call init() with the served weights' version and hash first")
        check_base(delta, self.version, self.weights_hash)
        data = base64.b64encode(delta_bytes(delta)).decode()
        self._update({"delta": data, "expected_hash": delta.weights_hash}, delta.version)
        return delta.weights_hash

    def load(self, state: Mapping[str, np.ndarray], *, version: int, weights_hash: str) -> None:
        """Replace every served weight with a snapshot (split bf16 bits) of ``version``."""
        data = base64.b64encode(snapshot_bytes(state)).decode()
        self._update({"snapshot": data, "version": version, "weights_hash": weights_hash}, version)

    def rank_states(self) -> list[dict[str, np.ndarray]]:
        """Every rank's weights, read back through ``/collective_rpc`` (the worker extension's
        ``aurora_rank_state_text``), in rank order."""
        got = self._post("/collective_rpc", {"method": "aurora_rank_state_text"})
        messages = got.get("results") if isinstance(got, Mapping) else None
        if not messages:
            raise EngineError(f"{self.base_url}: /collective_rpc returned no rank state")
        for m in messages:
            if m["weights_hash"] != self.weights_hash:
                raise EngineError(
                    f"{self.base_url}: rank {m['rank']} is at h={str(m['weights_hash'])[:16]}.., "
                    f"the client at h={str(self.weights_hash)[:16]}.."
                )
        return ranks_from_messages(messages)
