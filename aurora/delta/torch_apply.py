"""Apply a delta into torch tensors by index: a transformers model on CPU, or GPU-resident
weights of an engine (vLLM), whole or one tensor-parallel rank's slice.

The same path serves every device: each record is parsed and checked on the host like the numpy
path does (:func:`aurora.delta.apply.prepare_delta`: every record before the first write), then
materialised into int64 indices and uint16 values (:mod:`aurora.delta.changes`), remapped to the
rank's slice when tensor-parallel (:mod:`aurora.delta.tp`), moved to the parameter's device once
per tensor part, and written with one ``index_copy_`` into the parameter's own storage viewed as
``int16`` (bf16 bits, no float conversion: +0/-0 and NaN payloads survive). Base-relative values
read the old bits with ``index_select`` on the device and add the ULP difference in int32 there.
Dense changes are one ``copy_`` (or ``bitwise_xor_``). No Python runs per element.

torch is imported lazily: the rest of :mod:`aurora.delta` needs only numpy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from aurora.delta.apply import check_base, match_target, parse_record, use_compiled
from aurora.delta.changes import Materialized
from aurora.delta.errors import LayoutError
from aurora.delta.extract import FusedTensor, fused_layout
from aurora.delta.records import Delta, TensorDelta
from aurora.delta.tp import TPRank, local_shape, to_rank

if TYPE_CHECKING:
    import torch


def bits16(t: torch.Tensor, name: str) -> torch.Tensor:
    """Flat ``int16`` view of a contiguous 16-bit tensor's own storage (any device)."""
    import torch

    if t.element_size() != 2 or t.is_complex():
        raise LayoutError(f"tensor {name}: target is {t.dtype}, not 16-bit (bf16) storage")
    if not t.is_contiguous():
        raise LayoutError(f"tensor {name}: target is not contiguous")
    return t.detach().view(torch.int16).view(-1)


def _ulp_add(old: torch.Tensor, zz: torch.Tensor) -> torch.Tensor:
    """:func:`aurora.delta.changes.ulp_add` on int16 tensors, in int32 on their device, without
    branches: the order-preserving key flips the sign bit of a positive value and every bit of a
    negative one, i.e. XOR with 0x8000 | sign * 0x7FFF (and back with the key's own top bit)."""
    import torch

    b = old.to(torch.int32) & 0xFFFF
    key = b ^ (((b >> 15) * 0x7FFF) | 0x8000)
    z = zz.to(torch.int32) & 0xFFFF
    key = (key + ((z >> 1) ^ -(z & 1))) & 0xFFFF
    return (key ^ (0xFFFF - (key >> 15) * 0x7FFF)).to(torch.int16)  # int32 -> int16 wraps


def _write(flat: torch.Tensor, m: Materialized, idx: torch.Tensor | None = None) -> None:
    """Write change ``m`` (indices local to ``flat``) into ``flat`` (int16, any device);
    ``idx``: ``m.idx`` already on ``flat``'s device."""
    import torch

    host = np.ascontiguousarray(m.vals)
    if not host.flags.writeable:  # a view into the file: torch only wraps writable memory
        host = host.copy()
    vals = torch.from_numpy(host.view(np.int16)).to(flat.device)
    if m.idx is None:
        if m.op == "set":
            flat.copy_(vals)
        elif m.op == "xor":
            flat.bitwise_xor_(vals)
        else:
            flat.copy_(_ulp_add(flat, vals))
        return
    if idx is None:
        idx = torch.from_numpy(m.idx).to(flat.device)
    if m.op == "set":
        flat.index_copy_(0, idx, vals)
        return
    old = flat.index_select(0, idx)
    flat.index_copy_(0, idx, _ulp_add(old, vals) if m.op == "ulp" else old ^ vals)


def _split(m: Materialized, target: FusedTensor) -> list[tuple[str, Materialized]]:
    """A fused change cut into the parts of a split target (transformers names)."""
    if len(target.parts) == 1:
        return [(target.parts[0].name, m)]
    out = []
    if m.idx is None:
        for p in target.parts:
            seg = m.vals[p.offset : p.offset + p.numel]
            out.append((p.name, Materialized(None, seg, m.op, p.numel, p.numel)))
        return out
    cuts = np.searchsorted(m.idx, [p.offset for p in target.parts[1:]]).tolist()
    for p, a, b in zip(target.parts, [0, *cuts], [*cuts, m.idx.size], strict=True):
        if a < b:
            local = m.idx[a:b] - p.offset
            out.append((p.name, Materialized(local, m.vals[a:b], m.op, p.numel, b - a)))
    return out


Writes = list[tuple[Any, Any]]
"""(change, how to turn its materialised form into (param name, local change) pairs)."""


def _checked_split(delta: Delta, params: Mapping[str, torch.Tensor]) -> Writes:
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    engine = {t.name: t for t in fused_layout(shapes, fuse=False)}
    fused = {t.name: t for t in fused_layout(shapes, fuse=True)}
    out: Writes = []
    for td in delta.tensors:
        target = match_target(td, engine.get(td.name) or fused.get(td.name))
        for p in target.parts:
            bits16(params[p.name], p.name)
        out.append((parse_record(td, use_compiled([delta])), lambda m, t=target: _split(m, t)))
    return out


def _check_tp(td: TensorDelta, params: Mapping[str, torch.Tensor], tp: TPRank) -> None:
    if td.name not in params:
        raise LayoutError(f"tensor {td.name} of the delta is not in the target weights")
    sh = tp.shardings.get(td.name)
    if sh is None:
        raise LayoutError(f"tensor {td.name}: no tensor-parallel sharding known for it")
    want = local_shape(sh, tuple(td.shape), tp.rank, tp.size)
    have = tuple(params[td.name].shape)
    if have != want:
        raise LayoutError(
            f"tensor {td.name}: rank {tp.rank}/{tp.size} holds {have}, the delta's slice is {want}"
        )
    rows = tuple(r for _, r in td.parts)
    if rows and sh.part_rows() and rows != sh.part_rows():
        raise LayoutError(f"tensor {td.name}: delta part rows {rows}, target {sh.part_rows()}")
    bits16(params[td.name], td.name)


def _checked_tp(delta: Delta, params: Mapping[str, torch.Tensor], tp: TPRank) -> Writes:
    out: Writes = []
    for td in delta.tensors:
        _check_tp(td, params, tp)
        sh = tp.shardings[td.name]
        out.append(
            (
                parse_record(td, use_compiled([delta])),
                lambda m, td=td, sh=sh: [(td.name, to_rank(m, sh, td.shape, tp.rank, tp.size))],
            )
        )
    return out


def apply_delta_torch(
    delta: Delta,
    params: Mapping[str, Any],
    *,
    active_version: int,
    active_hash: str,
    tp: TPRank | None = None,
) -> str:
    """Apply ``delta`` in place into torch tensors; return h(v).

    ``params`` maps names to tensors (parameters or their ``.data``) of 16-bit storage:
    split transformers names (``model.named_parameters()``), or fused engine names. With ``tp``,
    ``params`` are rank ``tp.rank``'s slices under vLLM's fused names, and each record is
    remapped to that rank. Every record is checked (base, names, shapes, part rows, indices)
    before anything is written.
    """
    check_base(delta, active_version, active_hash)
    checked = _checked_split(delta, params) if tp is None else _checked_tp(delta, params, tp)
    # Every record has parsed: now write, one tensor at a time, logging the old bits of each
    # before it is written (a gather of the changed elements; a copy for a dense record) so that
    # whatever raises between two writes (a KeyboardInterrupt, a device out of memory) is undone
    # before it propagates: the weights are never left on no version.
    undo: list[tuple[Any, Any, Any]] = []  # (flat int16 tensor, indices or None, old bits)
    try:
        for change, route in checked:
            for name, m in route(change.materialize()):
                flat = bits16(params[name], name)
                undo.append(_old_bits(flat, m))
                _write(flat, m, undo[-1][1])
    except BaseException:
        for flat, idx, old in reversed(undo):
            if idx is None:
                flat.copy_(old)
            else:
                flat.index_copy_(0, idx, old)
        raise
    return delta.weights_hash


def _old_bits(flat: torch.Tensor, m: Materialized) -> tuple[Any, Any, Any]:
    """What restores the elements ``m`` will write in ``flat``: (flat, indices, their bits)."""
    import torch

    if m.idx is None:
        return flat, None, flat.clone()
    idx = torch.from_numpy(m.idx).to(flat.device)
    return flat, idx, flat.index_select(0, idx)
