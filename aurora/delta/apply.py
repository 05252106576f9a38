"""Applying deltas to weights: transactional, onto the declared base only.

Apply is all or nothing. :func:`prepare_delta` matches every record against the target (name,
shape, 16-bit storage, and for a fused tensor the names and row counts of its parts, since q/k/v
split 64/16/16 and 48/24/24 have the same fused shape) and parses it: decompresses its streams
and checks them whole (indices strictly increasing inside the tensor, :mod:`aurora.delta.changes`)
-- except the compiled ``leb128`` path, whose loop (:mod:`aurora.delta.kernels`) checks each index
just before storing it. Only then does :func:`apply_delta` write, with an undo log, so whatever
raises while writing the writes are undone before it propagates (:func:`store_prepared`).
Deltas of fewer than :data:`COMPILED_MIN_CHANGES` changes are checked and stored with numpy
instead (the same checks); an engine that applies large deltas calls :func:`warm_up` when it
loads. A chain ``D_{va+1..v}`` is checked link by link (base version and hash) and every record
of every link is parsed before the first write; it is then applied with the same undo log.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence

import numpy as np

from aurora.delta import codecs
from aurora.delta.changes import (
    Change,
    CheckedAsStored,
    Materialized,
    Parts,
    SmallGapChange,
    Undoable,
    check_numel,
)
from aurora.delta.errors import BaseMismatchError, CorruptError, LayoutError
from aurora.delta.extract import FusedTensor, fused_layout
from aurora.delta.records import Delta, TensorDelta
from aurora.delta.writer import part_label

Prepared = list[tuple[FusedTensor, Change]]
"""Every record of a delta, matched to its target and parsed: ready to store."""
COMPILED_MIN_CHANGES = 1 << 20
"""Deltas with at least this many changes (all records) take the compiled path: from ~1M
changes (30-60 ms in numpy here, 1.6-4.6x less compiled) a process's one-time ~1 s of starting
the compiled loops is repaid within tens of deltas; below, numpy costs less than that start."""


def use_compiled(deltas: Sequence[Delta]) -> bool:
    return sum(t.nnz for d in deltas for t in d.tensors) >= COMPILED_MIN_CHANGES


def warm_up() -> None:
    """Load (or compile, the first time on a machine) every compiled loop now, so the first
    large delta applies at full speed: an engine calls this once when it loads its weights.

    The compiled loops are slow to start the first time a process runs them (numba starts LLVM
    and loads or compiles them, holding the GIL, so an Actor's event loop stalls and its leases
    expire), while numpy applies a small delta in milliseconds: hence
    :data:`COMPILED_MIN_CHANGES`, and this call at load, so the first delta is not the one that
    pays.
    """
    old = np.arange(64, dtype=np.uint16)
    idx = np.arange(0, 64, 3, dtype=np.int64)
    new = old[idx] ^ np.uint16(3)
    for name in ("aurora", "aurora-base", "leb128"):
        streams = codecs.get(name).encode(idx, new, old[idx], old.size)
        td = TensorDelta("warm-up", old.shape, old.size, idx.size, name, tuple(streams))
        change = parse_record(td, fast=True)
        change.materialize()
        parts = [(old.copy(), 0, old.size)]
        change.store(parts)
        if isinstance(change, Undoable):
            change.unstore(parts)  # the rollback's loops too


def match_target(td: TensorDelta, target: FusedTensor | None) -> FusedTensor:
    """``target`` if it is what the record was computed against, else a LayoutError."""
    if target is None:
        raise LayoutError(f"tensor {td.name} of the delta is not in the target weights")
    if target.numel != td.numel or tuple(target.shape) != tuple(td.shape):
        raise LayoutError(f"tensor {td.name}: delta shape {td.shape}, target {target.shape}")
    if td.parts and len(target.parts) > 1:
        have = tuple((part_label(p.name), p.shape[0]) for p in target.parts)
        if have != td.parts:
            raise LayoutError(
                f"tensor {td.name}: delta parts {list(td.parts)}, target parts {list(have)}"
            )
    return target


def _targets(
    delta: Delta, state: Mapping[str, np.ndarray]
) -> list[tuple[TensorDelta, FusedTensor]]:
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    engine = {t.name: t for t in fused_layout(shapes, fuse=False)}
    fused = {t.name: t for t in fused_layout(shapes, fuse=True)}
    out = []
    for td in delta.tensors:
        target = match_target(td, engine.get(td.name) or fused.get(td.name))
        for p in target.parts:
            arr = state[p.name]
            if arr.dtype.itemsize != 2:
                raise LayoutError(
                    f"tensor {p.name}: target is {arr.dtype}, not 16-bit (bf16) storage"
                )
            if not arr.flags.c_contiguous or not arr.flags.writeable:
                raise LayoutError(f"tensor {p.name}: target is not a contiguous writable array")
        out.append((td, target))
    return out


def parse_record(td: TensorDelta, fast: bool) -> Change:
    """Decompress and check one record's streams (nothing is written); ``fast``: with the
    compiled loops (see :data:`COMPILED_MIN_CHANGES`)."""
    check_numel(td.numel, td.name)
    if not 0 < td.nnz <= td.numel:
        raise CorruptError(f"tensor {td.name}: {td.nnz} changes in {td.numel} elements")
    return codecs.get(td.codec).parse(list(td.streams), td.nnz, td.numel, td.name, fast)


def parts_of(target: FusedTensor, state: Mapping[str, np.ndarray]) -> Parts:
    """(flat uint16 view, fused offset, numel) of each part of ``target`` in ``state``."""
    return [(state[p.name].reshape(-1).view(np.uint16), p.offset, p.numel) for p in target.parts]


def prepare_delta(
    delta: Delta, state: Mapping[str, np.ndarray], fast: bool | None = None
) -> Prepared:
    """Match and parse every record of ``delta`` against ``state`` (read only); ``fast``: force
    the compiled path on or off (default: by :func:`use_compiled`)."""
    fast = use_compiled([delta]) if fast is None else fast
    return [(target, parse_record(td, fast)) for td, target in _targets(delta, state)]


def decode_delta(
    delta: Delta, state: Mapping[str, np.ndarray]
) -> list[tuple[FusedTensor, np.ndarray, np.ndarray]]:
    """Every tensor of ``delta`` as (target, changed fused indices, their new bits), decoded
    against ``state`` (read only). For inspection and tests; apply does not materialise this."""
    out = []
    for target, change in prepare_delta(delta, state):
        m = change.materialize()
        flat = np.concatenate([a for a, _, _ in parts_of(target, state)])
        if m.idx is None:
            new = m.new_bits(flat)
            idx = np.flatnonzero(new != flat)
            out.append((target, idx, new[idx]))
        else:
            out.append((target, m.idx, m.new_bits(flat[m.idx])))
    return out


def check_base(delta: Delta, version: int, h: str) -> None:
    if delta.base != version:
        raise BaseMismatchError(
            f"D_{delta.version} is based on v{delta.base}; the target is on v{version}"
        )
    if delta.base_hash != h:
        raise BaseMismatchError(
            f"D_{delta.version} is based on h={delta.base_hash[:16]}..; the target has h={h[:16]}.."
        )


def store_prepared(
    prepared: Prepared, state: MutableMapping[str, np.ndarray], *, interruptible: bool = True
) -> None:
    """Store every parsed record, all or nothing. The changes checked as they store go first:
    one may refuse its stream part-way; the rest were checked whole when parsed. Whatever
    raises (a refused stream, a ``KeyboardInterrupt``, a ``MemoryError``), every write made
    until then is undone before it propagates (:func:`_store_all`).

    ``interruptible=False``: the caller runs where no signal can interrupt it (any thread but
    the main one: Python raises a signal's exception in the main thread only). The stores
    checked whole at parse raise nothing, so there nothing can stop them part-way and they skip
    the undo log, which costs ~30% of the ``aurora`` store loop; the stores checked as they go
    keep theirs (they refuse a bad stream part-way), as does the numpy path (it allocates).

    The compiled loops keep the old bits of every element they overwrite as they store; the numpy
    path gathers them first.
    """
    first = [(t, c) for t, c in prepared if isinstance(c, CheckedAsStored)]
    rest = [(t, c) for t, c in prepared if not isinstance(c, CheckedAsStored)]
    if not interruptible:
        for _, change in rest:
            if isinstance(change, SmallGapChange):
                change.log = False
    _store_all([*first, *rest], state)


def _store_all(
    changes: Sequence[tuple[FusedTensor, Change]], state: MutableMapping[str, np.ndarray]
) -> None:
    """Store ``changes`` in order, with an undo log: a compiled change keeps the old bits it
    overwrites as it stores (:class:`Undoable`: no extra pass); any other change's old bits are
    gathered just before its store (:func:`_undo_of`; the numpy path, small deltas). The entry
    goes into the log before the store starts, so a store cut short is covered too. On any
    exception (``BaseException``: a SIGINT arrives as a ``KeyboardInterrupt`` between two
    writes) the log is replayed backwards, which also undoes a tensor written twice in a chain,
    and the exception propagates: the weights are on the version they were on, never on none."""
    log: list[tuple[FusedTensor, Undoable | Materialized]] = []
    try:
        for target, change in changes:
            if isinstance(change, Undoable):
                log.append((target, change))
            else:
                log.append((target, _undo_of(target, change, state)))
            change.store(parts_of(target, state))
    except BaseException:
        for target, undo in reversed(log):
            if isinstance(undo, Undoable):
                undo.unstore(parts_of(target, state))
            else:
                undo.store(parts_of(target, state))
        raise
    finally:
        for _, undo in log:
            if isinstance(undo, Undoable):
                undo.release()


def apply_delta(
    delta: Delta,
    state: MutableMapping[str, np.ndarray],
    *,
    active_version: int,
    active_hash: str,
    interruptible: bool = True,
) -> str:
    """Apply ``delta`` in place to ``state`` (uint16 views of bf16 weights); return h(v).

    Checks the base version and hash and parses every record before writing anything; all or
    nothing under any exception (``interruptible``: see :func:`store_prepared`).
    """
    check_base(delta, active_version, active_hash)
    store_prepared(prepare_delta(delta, state), state, interruptible=interruptible)
    return delta.weights_hash


def _undo_of(target: FusedTensor, change: Change, state: Mapping[str, np.ndarray]) -> Materialized:
    """What restores the elements ``change`` will write: their current bits."""
    parts = parts_of(target, state)
    m = change.materialize()
    if m.idx is None:
        flat_old = np.concatenate([a for a, _, _ in parts])
        return Materialized(None, flat_old, "set", m.numel, m.nnz)
    old = np.empty(m.idx.size, dtype=np.uint16)
    cuts = np.searchsorted(m.idx, [off for _, off, _ in parts[1:]])
    for (a, off, _), lo, hi in zip(parts, [0, *cuts], [*cuts, m.idx.size], strict=True):
        old[lo:hi] = a[m.idx[lo:hi] - off]
    return Materialized(m.idx, old, "set", m.numel, m.nnz)


def apply_chain(
    deltas: Sequence[Delta],
    state: MutableMapping[str, np.ndarray],
    *,
    active_version: int,
    active_hash: str,
) -> str:
    """Apply ``D_{va+1..v}`` in order; every link and every record is checked first, and an
    undo log restores the weights if anything raises while writing (``BaseException``: a
    ``KeyboardInterrupt`` too), so the chain applies whole or not at all. Returns h(v)."""
    version, h = active_version, active_hash
    for d in deltas:
        if d.base != version or d.base_hash != h:
            raise BaseMismatchError(
                f"chain broken at D_{d.version}: based on v{d.base}, previous is v{version}"
            )
        version, h = d.version, d.weights_hash
    fast = use_compiled(deltas)
    prepared = [prepare_delta(d, state, fast) for d in deltas]
    _store_all([pair for links in prepared for pair in links], state)
    return h
