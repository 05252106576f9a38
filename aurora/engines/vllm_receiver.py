"""The worker side of the ``aurora_delta`` weight-transfer backend: deltas applied in place.

Theory of operation
-------------------
vLLM builds a weight-transfer engine in every worker (one per tensor-parallel rank) beside the
model; :mod:`aurora.engines.vllm_plugin` adapts vLLM's interface to :class:`DeltaReceiver`,
which needs no vLLM (the tests drive it with parameter dicts shaped like vLLM's). ``init_info``
declares the version and h(v) of the weights loaded; each ``update_info`` carries one delta file
or one snapshot (:mod:`aurora.engines.vllm_messages`). A delta is verified whole (every segment
hash, the Merkle root, h(v)) and its base checked before anything is written; each record is
then decoded on the CPU, cut to this rank's slice (:mod:`aurora.engines.vllm_layout`), moved to
the device once per tensor and written with one ``index_copy_`` into the parameter's own
storage: the bytes moved are the delta's. A snapshot replaces every weight, each rank taking its
slice by the same layout. The dicts, and why vLLM's resident layout is the delta's: docs/VLLM.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from aurora.delta import read_delta
from aurora.delta.tp import TPRank, local_shape, local_to_global
from aurora.engines.base import EngineError, canonical_state
from aurora.engines.vllm_layout import ModelShape, rank_layout
from aurora.engines.vllm_messages import bytes_of

BACKEND = "aurora_delta"
"""The name the weight-transfer engine is registered under in vLLM's factory."""
WORKER_EXTENSION = "aurora.engines.vllm_plugin.AuroraWorkerExtension"
"""vLLM ``worker_extension_cls`` that lets the driver read every rank's weights back."""


class DeltaReceiver:
    """One vLLM rank's side of the ``aurora_delta`` backend: verifies and applies deltas and
    snapshots in place into the rank's resident parameters (no vLLM needed; the dicts it takes
    are in docs/VLLM.md)."""

    def __init__(
        self,
        params: Callable[[], Mapping[str, Any]] | Mapping[str, Any],
        shape: ModelShape,
        *,
        rank: int = 0,
        size: int = 1,
    ) -> None:
        """``params`` maps vLLM's (fused) names to the rank's parameters, or is a function that
        returns that mapping (called at each update: vLLM may re-create parameters)."""
        self._params = params
        self.shape, self.rank, self.size = shape, rank, size
        self.version: int | None = None
        self.weights_hash: str | None = None
        self._lock = threading.Lock()

    def params(self) -> dict[str, Any]:
        p = self._params() if callable(self._params) else self._params
        return dict(p)

    def layout(self, params: Mapping[str, Any]) -> TPRank:
        return rank_layout(list(params), self.shape, self.rank, self.size)

    def init(self, info: Mapping[str, Any]) -> None:
        """``init_info``: the version and h(v) of the weights held now."""
        try:
            version, h = int(info["version"]), str(info["weights_hash"])
        except (KeyError, TypeError, ValueError):
            raise EngineError(
                f"init_info needs version (int) and weights_hash (hex), got {sorted(info)}"
            ) from None
        with self._lock:
            self.version, self.weights_hash = version, h

    def update(self, info: Mapping[str, Any]) -> str:
        """``update_info``: apply one delta or load one snapshot; returns the new h(v)."""
        kinds = [k for k in ("delta", "path", "snapshot", "snapshot_path") if info.get(k)]
        if len(kinds) != 1:
            raise EngineError(
                "update_info needs exactly one of delta, path, snapshot, snapshot_path; "
                f"got {sorted(k for k in info if info.get(k) is not None)}"
            )
        with self._lock:
            if kinds[0] in ("delta", "path"):
                return self._apply(info)
            return self._load(info)

    def _apply(self, info: Mapping[str, Any]) -> str:
        import torch

        from aurora.delta import apply_delta_torch

        if self.version is None or self.weights_hash is None:
            raise EngineError("no weights declared: call init_weight_transfer_engine first")
        data = (
            bytes_of(info["delta"], "delta")
            if info.get("delta")
            else Path(str(info["path"])).read_bytes()
        )
        expected = info.get("expected_hash")
        delta = read_delta(data, expected_hash=str(expected) if expected else None)
        params = {k: v.data for k, v in self.params().items()}
        h = apply_delta_torch(
            delta,
            params,
            active_version=self.version,
            active_hash=self.weights_hash,
            tp=self.layout(params),
        )
        if any(t.is_cuda for t in params.values()):
            torch.cuda.synchronize()  # the next forward must see the new bits
        self.version, self.weights_hash = delta.version, h
        return h

    def _load(self, info: Mapping[str, Any]) -> str:
        import torch

        from aurora.delta.torch_apply import bits16

        try:
            version, h = int(info["version"]), str(info["weights_hash"])
        except (KeyError, TypeError, ValueError):
            raise EngineError("a snapshot update needs version and weights_hash") from None
        canon = canonical_state(in_model_order(_read_snapshot(info)))
        params = {k: v.data for k, v in self.params().items()}
        if set(canon) != set(params):
            diff = sorted(set(canon) ^ set(params))[:5]
            raise EngineError(f"snapshot tensors differ from the engine's: {diff}")
        tp = self.layout(params)
        writes = []
        for name, full in canon.items():  # check everything before the first write
            sh = tp.shardings[name]
            want = local_shape(sh, tuple(full.shape), self.rank, self.size)
            if tuple(params[name].shape) != want:
                raise EngineError(
                    f"snapshot tensor {name}: slice {want} of {tuple(full.shape)}, rank "
                    f"{self.rank} holds {tuple(params[name].shape)}"
                )
            writes.append((name, full, sh, bits16(params[name], name)))
        for _name, full, sh, flat in writes:
            g = local_to_global(sh, tuple(full.shape), self.rank, self.size)
            valid = g >= 0
            vals = np.ascontiguousarray(full.reshape(-1)[g[valid]]).view(np.int16)
            src = torch.from_numpy(vals).to(flat.device)
            if valid.all():
                flat.copy_(src)
            else:  # vocabulary padding rows stay as they are
                idx = torch.from_numpy(np.flatnonzero(valid)).to(flat.device)
                flat.index_copy_(0, idx, src)
        if any(t.is_cuda for t in params.values()):
            torch.cuda.synchronize()
        self.version, self.weights_hash = version, h
        return h

    def local_state(self) -> dict[str, np.ndarray]:
        """Copies of this rank's 16-bit parameters as ``{fused name: uint16}`` (local shapes)."""
        import torch

        out = {}
        with self._lock:
            for name, p in self.params().items():
                t = p.detach()
                if t.element_size() != 2:
                    continue
                out[name] = t.contiguous().view(torch.int16).cpu().numpy().view(np.uint16).copy()
        return out


_PART_ORDER = {"q_proj": "0", "k_proj": "1", "v_proj": "2", "gate_proj": "0", "up_proj": "1"}


def in_model_order(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``state`` reordered so each fused group's parts come in stacking order (q, k, v; gate,
    up): :func:`~aurora.engines.base.canonical_state` fuses a group where its first part comes
    first, and a safetensors file lists its tensors sorted by name (k before q)."""

    def key(name: str) -> str:
        parts = name.split(".")
        return ".".join(_PART_ORDER.get(p, "") + p for p in parts)

    return {k: state[k] for k in sorted(state, key=key)}


def _read_snapshot(info: Mapping[str, Any]) -> dict[str, np.ndarray]:
    import torch
    from safetensors.torch import load, load_file

    if info.get("snapshot"):
        tensors = load(bytes_of(info["snapshot"], "snapshot"))
    else:
        tensors = load_file(str(info["snapshot_path"]))
    out = {}
    for name, t in tensors.items():
        if t.dtype != torch.bfloat16:
            raise EngineError(f"snapshot tensor {name} is {t.dtype}, expected bfloat16")
        out[name] = t.contiguous().view(torch.int16).numpy().view(np.uint16)
    return out
