"""Applying deltas to weights: transactional, onto the declared base only.

Apply is transactional: every record is decoded and checked against the target layout, and the
base version and h(base) are checked, before the first byte of the weights is written. A chain
``D_{va+1..v}`` is checked link by link first and applied with an undo log.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence

import numpy as np

from aurora.delta import codecs
from aurora.delta.errors import BaseMismatchError, CorruptError, DeltaError, LayoutError
from aurora.delta.extract import FusedTensor, fused_layout, gather_fused, scatter_fused
from aurora.delta.records import Delta, TensorDelta


def _targets(
    delta: Delta, state: Mapping[str, np.ndarray]
) -> list[tuple[TensorDelta, FusedTensor]]:
    engine = {
        t.name: t for t in fused_layout({k: tuple(v.shape) for k, v in state.items()}, fuse=False)
    }
    fused = {
        t.name: t for t in fused_layout({k: tuple(v.shape) for k, v in state.items()}, fuse=True)
    }
    out = []
    for td in delta.tensors:
        target = engine.get(td.name) or fused.get(td.name)
        if target is None:
            raise LayoutError(f"tensor {td.name} of the delta is not in the target weights")
        if target.numel != td.numel or target.shape != td.shape:
            raise LayoutError(f"tensor {td.name}: delta shape {td.shape}, target {target.shape}")
        for p in target.parts:
            arr = state[p.name]
            if arr.dtype.itemsize != 2:
                raise LayoutError(
                    f"tensor {p.name}: target is {arr.dtype}, not 16-bit (bf16) storage"
                )
        out.append((td, target))
    return out


class _BaseGather:
    """``base[idx]`` of a (possibly fused) tensor straight from the split state: base-relative
    codecs only read the changed positions, so the fused tensor is never materialised."""

    def __init__(self, target: FusedTensor, state: Mapping[str, np.ndarray]) -> None:
        self.target, self.state = target, state

    def __getitem__(self, idx: np.ndarray) -> np.ndarray:
        return gather_fused(self.target, self.state, idx)


def decode_delta(
    delta: Delta, state: Mapping[str, np.ndarray]
) -> list[tuple[FusedTensor, np.ndarray, np.ndarray]]:
    """Decode every tensor of ``delta`` against ``state`` (read only): [(target, idx, bits)]."""
    out = []
    for td, target in _targets(delta, state):
        c = codecs.get(td.codec)
        base = _BaseGather(target, state) if c.needs_base else None
        idx, bits = c.decode(list(td.streams), td.nnz, td.numel, base, td.name)  # type: ignore[arg-type]
        if idx.size != td.nnz or bits.size != td.nnz:
            raise CorruptError(
                f"tensor {td.name}: decoded {idx.size} changes, header says {td.nnz}"
            )
        out.append((target, idx, bits))
    return out


def apply_delta(
    delta: Delta, state: MutableMapping[str, np.ndarray], *, active_version: int, active_hash: str
) -> str:
    """Apply ``delta`` in place to ``state`` (uint16 views of bf16 weights); return h(v).

    Checks the base version and hash and decodes everything before writing anything.
    """
    if delta.base != active_version:
        raise BaseMismatchError(
            f"D_{delta.version} is based on v{delta.base}; the target is on v{active_version}"
        )
    if delta.base_hash != active_hash:
        raise BaseMismatchError(
            f"D_{delta.version} is based on h={delta.base_hash[:16]}..; "
            f"the target has h={active_hash[:16]}.."
        )
    decoded = decode_delta(delta, state)
    for target, idx, bits in decoded:
        scatter_fused(target, state, idx, bits)
    return delta.weights_hash


def apply_chain(
    deltas: Sequence[Delta],
    state: MutableMapping[str, np.ndarray],
    *,
    active_version: int,
    active_hash: str,
) -> str:
    """Apply ``D_{va+1..v}`` in order; all links are checked first, and an undo log restores the
    weights if any step fails, so the chain applies whole or not at all. Returns h(v)."""
    version, h = active_version, active_hash
    for d in deltas:
        if d.base != version or d.base_hash != h:
            raise BaseMismatchError(
                f"chain broken at D_{d.version}: based on v{d.base}, previous is v{version}"
            )
        _targets(d, state)
        version, h = d.version, d.weights_hash
    undo: list[tuple[FusedTensor, np.ndarray, np.ndarray]] = []
    version, h = active_version, active_hash
    try:
        for d in deltas:
            decoded = decode_delta(d, state)
            for target, idx, _ in decoded:
                undo.append((target, idx, gather_fused(target, state, idx)))
            h = apply_delta(d, state, active_version=version, active_hash=h)
            version = d.version
    except DeltaError:
        for target, idx, old in reversed(undo):
            scatter_fused(target, state, idx, old)
        raise
    return h
