"""Tensor parallelism: the part of a fused delta that one rank of a vLLM engine holds, rebased.

With tensor parallelism of size n, every vLLM rank holds a slice of each weight, laid out by the
layer's weight loader (``vllm/model_executor/layers/linear.py``,
``vocab_parallel_embedding.py``); a delta is computed on the full fused tensor, so each rank must
keep only the changes inside its slice and rebase their indices onto its local storage. The
slicings (:data:`KINDS`, described at :class:`Sharding`) are row ranges of the flat row-major
tensor except ``row``, so a sorted index stays sorted after the remap and each rank's indices
come out in local order. :func:`to_rank` remaps a :class:`~aurora.delta.changes.Materialized`
change (sparse: select and rebase; dense: gather the rank's elements); :func:`local_to_global`
gives every local element's global index, the inverse map. The engine adapter builds a
:class:`TPRank` once (:func:`vllm_shardings`) and passes it to
:func:`aurora.delta.torch_apply.apply_delta_torch`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from aurora.delta.changes import Materialized
from aurora.delta.errors import LayoutError

KINDS = ("replicated", "column", "merged", "qkv", "row", "vocab")
VOCAB_PADDING = 64
"""vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``: vocabularies are padded to a multiple of this."""


@dataclass(frozen=True)
class Sharding:
    """How vLLM splits one engine tensor over the ranks.

    ``column`` (``ColumnParallelLinear``)
        rank r holds output rows [r*R/n, (r+1)*R/n).
    ``merged`` (``MergedColumnParallelLinear``, ``gate_up_proj``)
        each part (gate, up) is split like a column layer; rank r stacks its slice of every part:
        [gate rows r*I/n.., up rows r*I/n..].
    ``qkv`` (``QKVParallelLinear``)
        q is split by heads (H/n each); k and v by kv heads, K/n each when n <= K, else each rank
        holds one kv head, that of ``rank // (n/K)`` (kv heads replicated n/K times); rank r stacks
        [q slice, k slice, v slice].
    ``row`` (``RowParallelLinear``, ``o_proj``/``down_proj`` weights)
        rank r holds input columns [r*C/n, (r+1)*C/n) of every row (its bias is not split).
    ``vocab`` (``VocabParallelEmbedding``/``ParallelLMHead``)
        the vocabulary is padded to a multiple of 64, each rank holds padded/n rows, of which those
        below the vocabulary size are real (the padding rows are never written).
    ``replicated``
        every rank holds the whole tensor (norms, row-parallel biases).
    """

    kind: str
    """One of :data:`KINDS`."""
    sizes: tuple[int, ...] = ()
    """``merged``: global rows of each part; ``qkv``: (heads, kv heads, head dim, v head dim)."""

    def part_rows(self) -> tuple[int, ...]:
        """Global rows of each fused part (``qkv``, ``merged``); () for unfused kinds."""
        if self.kind == "merged":
            return self.sizes
        if self.kind == "qkv":
            h, k, d, dv = self.sizes
            return (h * d, k * d, k * dv)
        return ()


@dataclass(frozen=True)
class TPRank:
    """Rank ``rank`` of a tensor-parallel group of ``size``, and how each engine tensor is split."""

    rank: int
    size: int
    shardings: Mapping[str, Sharding]
    """Engine (fused) tensor name -> its sharding."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TP rank {self.rank} is not in [0, {self.size})")


def _div(a: int, b: int, what: str) -> int:
    if b <= 0 or a % b:
        raise LayoutError(f"{what}: {a} does not split evenly over {b}")
    return a // b


def row_ranges(
    sh: Sharding, rows: int, rank: int, size: int
) -> tuple[list[tuple[int, int, int]], int]:
    """([(global first row, rows, local first row)], local rows) of a row-split kind."""
    if sh.kind == "replicated":
        return [(0, rows, 0)], rows
    if sh.kind == "column":
        per = _div(rows, size, "column-parallel rows")
        return [(rank * per, per, 0)], per
    if sh.kind == "vocab":
        padded = -(-rows // VOCAB_PADDING) * VOCAB_PADDING
        per = _div(padded, size, "padded vocabulary")
        start, end = min(rank * per, rows), min((rank + 1) * per, rows)
        return [(start, end - start, 0)], per
    parts = sh.part_rows()
    if sum(parts) != rows:
        raise LayoutError(f"{sh.kind} parts {parts} do not add up to {rows} rows")
    if sh.kind == "merged":
        shard = [(_div(p, size, "merged part rows"), rank) for p in parts]
    else:
        h, k, d, dv = sh.sizes
        _div(h, size, "query heads")
        if size >= k:
            kv, kv_rank = 1, rank // _div(size, k, "kv head replicas")
        else:
            kv, kv_rank = _div(k, size, "kv heads"), rank
        shard = [(h // size * d, rank), (kv * d, kv_rank), (kv * dv, kv_rank)]
    out, g_off, local = [], 0, 0
    for p, (per, r) in zip(parts, shard, strict=True):
        out.append((g_off + r * per, per, local))
        g_off += p
        local += per
    return out, local


def _rows_cols(shape: tuple[int, ...]) -> tuple[int, int]:
    return shape[0], int(np.prod(shape[1:], dtype=np.int64))


def local_shape(sh: Sharding, shape: tuple[int, ...], rank: int, size: int) -> tuple[int, ...]:
    """Shape of the rank's slice of a tensor of global ``shape``."""
    if sh.kind not in KINDS:
        raise LayoutError(f"unknown sharding kind {sh.kind!r}")
    if sh.kind == "row":
        if len(shape) < 2:
            return tuple(shape)
        return (shape[0], _div(shape[1], size, "row-parallel columns"), *shape[2:])
    return (row_ranges(sh, shape[0], rank, size)[1], *shape[1:])


def to_rank(
    m: Materialized, sh: Sharding, shape: tuple[int, ...], rank: int, size: int
) -> Materialized:
    """The part of change ``m`` (of a tensor of global ``shape``) that ``rank`` holds, indexed in
    the rank's local storage."""
    if m.idx is None:
        g = local_to_global(sh, shape, rank, size)
        valid = g >= 0
        if valid.all():
            return Materialized(None, m.vals[g], m.op, g.size, g.size)
        local = np.flatnonzero(valid)
        return Materialized(local, m.vals[g[local]], m.op, g.size, int(local.size))
    rows, cols = _rows_cols(shape)
    numel = int(np.prod(local_shape(sh, shape, rank, size), dtype=np.int64))
    if sh.kind == "row" and len(shape) >= 2:
        per = cols // size
        c = m.idx % cols
        sel = (c >= rank * per) & (c < (rank + 1) * per)
        idx = m.idx[sel]
        local = (idx // cols) * per + (idx % cols) - rank * per
        return Materialized(local, m.vals[sel], m.op, numel, int(local.size))
    ranges, _ = row_ranges(sh, rows, rank, size) if sh.kind != "row" else ([(0, rows, 0)], rows)
    idxs, vals = [], []
    for g0, n, l0 in ranges:
        a, b = np.searchsorted(m.idx, [g0 * cols, (g0 + n) * cols])
        idxs.append(m.idx[a:b] - (g0 - l0) * cols)
        vals.append(m.vals[a:b])
    idx = idxs[0] if len(idxs) == 1 else np.concatenate(idxs)
    val = vals[0] if len(vals) == 1 else np.concatenate(vals)
    return Materialized(idx, val, m.op, numel, int(idx.size))


def local_to_global(sh: Sharding, shape: tuple[int, ...], rank: int, size: int) -> np.ndarray:
    """Global flat index of every element of the rank's slice (int64; -1 for padding rows)."""
    rows, cols = _rows_cols(shape)
    if sh.kind == "row" and len(shape) >= 2:
        per = cols // size
        r = np.arange(rows, dtype=np.int64)[:, None] * cols
        return (r + rank * per + np.arange(per, dtype=np.int64)[None, :]).reshape(-1)
    ranges, local_rows = (
        row_ranges(sh, rows, rank, size) if sh.kind != "row" else ([(0, rows, 0)], rows)
    )
    out = np.full(local_rows * cols, -1, dtype=np.int64)
    for g0, n, l0 in ranges:
        out[l0 * cols : (l0 + n) * cols] = np.arange(g0 * cols, (g0 + n) * cols, dtype=np.int64)
    return out


def vllm_shardings(
    names: Iterable[str],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    v_head_dim: int | None = None,
) -> dict[str, Sharding]:
    """Shardings of the engine tensors of a Llama/Qwen-style decoder in vLLM, by name.

    ``qkv_proj`` -> qkv, ``gate_up_proj`` -> merged, ``o_proj``/``down_proj`` weights -> row,
    ``embed_tokens``/``lm_head`` -> vocab, everything else (norms, row-parallel biases) ->
    replicated. Pass the model's ``named_parameters()`` names (fused, as vLLM names them).
    """
    qkv = Sharding("qkv", (num_heads, num_kv_heads, head_dim, v_head_dim or head_dim))
    merged = Sharding("merged", (intermediate_size, intermediate_size))
    out = {}
    for name in names:
        if ".qkv_proj." in name:
            out[name] = qkv
        elif ".gate_up_proj." in name:
            out[name] = merged
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name] = Sharding("row")
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            out[name] = Sharding("vocab")
        else:
            out[name] = Sharding("replicated")
    return out
