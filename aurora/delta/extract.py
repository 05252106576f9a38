"""Exact extraction of the changed bf16 elements, and the fused engine names.

Extraction compares 16-bit patterns (``uint16`` views), never floats: ``+0.0 == -0.0`` and
``NaN != NaN`` would make a float comparison drop or invent changes, and the receiver would
diverge from the Trainer. Tensors are handed in as flat ``uint16`` numpy views of the bf16
storage (zero-copy from torch with ``t.view(torch.int16).numpy().view(np.uint16)``).

Fused names (paper, "Sparse encoding"): inference engines store q, k, v as one ``qkv_proj``
matrix and gate, up as one ``gate_up_proj`` matrix. vLLM's ``QKVParallelLinear.weight_loader``
places the shards along the output dimension at row offsets q: 0, k: ``num_heads*head_dim``,
v: ``(num_heads + num_kv_heads)*head_dim``; ``MergedColumnParallelLinear.weight_loader`` places
gate at 0 and up at ``intermediate_size`` (vllm/model_executor/layers/linear.py). With row-major
``[out, in]`` weights that is a flat offset of ``rows_before * in``: the fused index space is the
concatenation of the parts in that order. The transformers (split) side maps indices back by
these block boundaries.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

FUSED_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("gate_up_proj", ("gate_proj", "up_proj")),
)
"""Fused module name and its parts, in vLLM's stacking order."""

_PART = re.compile(
    r"^(?P<prefix>.*\.)(?P<part>q_proj|k_proj|v_proj|gate_proj|up_proj)\.(?P<kind>weight|bias)$"
)


def changed(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted flat int64 indices where the 16-bit patterns differ, and the new patterns there."""
    if old.shape != new.shape:
        raise ValueError(f"shape changed from {old.shape} to {new.shape}")
    o = old.reshape(-1).view(np.uint16)
    n = new.reshape(-1).view(np.uint16)
    idx = np.flatnonzero(o != n)
    return idx, n[idx]


@dataclass(frozen=True)
class Part:
    name: str
    """Split (transformers) tensor name."""
    offset: int
    """Flat offset of this part inside the fused tensor."""
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class FusedTensor:
    name: str
    """Engine (fused) tensor name; equal to the split name for tensors that are not fused."""
    shape: tuple[int, ...]
    parts: tuple[Part, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.parts)


def fused_layout(shapes: Mapping[str, tuple[int, ...]], fuse: bool = True) -> list[FusedTensor]:
    """Engine tensors for a split state dict's ``{name: shape}``, in the state dict's order.

    A fused tensor appears where its first part appears. Parts of a group that are not all present
    (or whose trailing dims differ) are left unfused.
    """
    out: list[FusedTensor] = []
    taken: set[str] = set()
    for name, shape in shapes.items():
        if name in taken:
            continue
        m = _PART.match(name) if fuse else None
        group = None
        if m:
            for fused, members in FUSED_GROUPS:
                if m["part"] == members[0]:
                    names = [f"{m['prefix']}{p}.{m['kind']}" for p in members]
                    if (
                        all(n in shapes for n in names)
                        and len({tuple(shapes[n][1:]) for n in names}) == 1
                    ):
                        group = (f"{m['prefix']}{fused}.{m['kind']}", names)
                    break
        if group is None:
            shape = tuple(shape)
            numel = int(np.prod(shape, dtype=np.int64))
            out.append(FusedTensor(name, shape, (Part(name, 0, numel, shape),)))
            taken.add(name)
            continue
        fused_name, names = group
        parts: list[Part] = []
        offset = 0
        for n in names:
            numel = int(np.prod(shapes[n], dtype=np.int64))
            parts.append(Part(n, offset, numel, tuple(shapes[n])))
            offset += numel
            taken.add(n)
        rows = sum(shapes[n][0] for n in names)
        out.append(FusedTensor(fused_name, (rows, *shapes[names[0]][1:]), tuple(parts)))
    return out


def changed_fused(
    tensor: FusedTensor, old: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Changes of a (possibly fused) tensor in its engine index space."""
    idxs, vals = [], []
    for p in tensor.parts:
        i, v = changed(old[p.name], new[p.name])
        idxs.append(i + p.offset)
        vals.append(v)
    if len(idxs) == 1:
        return idxs[0], vals[0]
    return np.concatenate(idxs), np.concatenate(vals)


def gather_fused(
    tensor: FusedTensor, state: Mapping[str, np.ndarray], idx: np.ndarray
) -> np.ndarray:
    """Current bits at engine indices ``idx`` of ``tensor`` from a split state."""
    return (
        np.concatenate(list(_by_part(tensor, state, idx, lambda flat, local: flat[local])))
        if idx.size
        else np.zeros(0, np.uint16)
    )


def _by_part(
    tensor: FusedTensor,
    state: Mapping[str, np.ndarray],
    idx: np.ndarray,
    fn: Callable[[np.ndarray, np.ndarray], np.ndarray],
) -> Iterator[np.ndarray]:
    """``fn(flat uint16 part, local indices)`` for each part, with the engine indices ``idx``
    (sorted) cut at the part boundaries."""
    bounds = np.array([p.offset for p in tensor.parts[1:]], dtype=np.int64)
    cuts = np.searchsorted(idx, bounds)
    for p, i in zip(tensor.parts, np.split(idx, cuts), strict=True):
        yield fn(state[p.name].reshape(-1).view(np.uint16), i - p.offset)
