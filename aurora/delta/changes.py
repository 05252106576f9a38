"""A tensor's change once its streams are decompressed and checked: ready to store, twice over.

A codec's ``parse`` (:mod:`aurora.delta.codecs`, :mod:`aurora.delta.dense`) turns a record's byte
streams into one of these, after checking its lengths and headers and, except for the compiled
``leb128`` change (:class:`CheckedAsStored`, which checks its indices as it stores them and keeps
an undo log), its indices (strictly increasing inside the tensor). Nothing is written yet: apply
parses every record of a delta first. Each change is stored in one of two ways:
:meth:`~Change.store` into numpy ``uint16`` arrays (the CPU path: the fused compiled loops of
:mod:`aurora.delta.kernels` for a large delta, :class:`Materialized` for the rest), or
:meth:`~Change.materialize` into a :class:`Materialized` change, the device-neutral form that the
torch path (:mod:`aurora.delta.torch_apply`) and the tensor-parallel remap
(:mod:`aurora.delta.tp`) work on. A fused tensor (``qkv_proj``: q, k, v) is stored part by part:
``parts`` lists, in fused order, (flat array, fused offset, numel) of each part.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from aurora.delta.errors import CorruptError


def compiled() -> ModuleType:
    """:mod:`aurora.delta.kernels`, imported on first use: importing numba costs 0.3-1 s, which
    every process that imports ``aurora.delta`` without applying a delta would pay."""
    from aurora.delta import kernels

    return kernels


SPLIT, ULP = 0, 1
"""Value streams of a :class:`SmallGapChange` (``kernels.SPLIT``, ``kernels.ULP``)."""

Parts = Sequence[tuple[np.ndarray, int, int]]
"""(flat uint16 array, offset in the fused tensor, numel) of each part, in fused order."""

OPS = ("set", "ulp", "xor")


def bf16_key(bits: np.ndarray) -> np.ndarray:
    """Order-preserving uint16 key of bf16 bits (negative: flip all bits; positive: flip sign)."""
    bits = bits.astype(np.uint16, copy=False)
    return np.where(bits & 0x8000, ~bits, bits | 0x8000).astype(np.uint16)


def bf16_from_key(key: np.ndarray) -> np.ndarray:
    key = key.astype(np.uint16, copy=False)
    return np.where(key & 0x8000, key & 0x7FFF, ~key).astype(np.uint16)


def zigzag16(diff: np.ndarray) -> np.ndarray:
    """uint16 zigzag of int16 differences (0, -1, 1, -2, ... -> 0, 1, 2, 3, ...)."""
    d = diff.astype(np.int16).astype(np.int32)
    return (((d << 1) ^ (d >> 31)) & 0xFFFF).astype(np.uint16)


def ulp_diff(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """zigzag((key(new) - key(old)) mod 2^16): 0 where unchanged, small for a few ULPs."""
    return zigzag16(bf16_key(new).astype(np.int32) - bf16_key(old).astype(np.int32))


def ulp_add(old: np.ndarray, zz: np.ndarray) -> np.ndarray:
    """The inverse of :func:`ulp_diff`: new bits from the old bits and the zigzagged difference."""
    z = zz.astype(np.int32)
    key = (bf16_key(old).astype(np.int32) + ((z >> 1) ^ -(z & 1))) & 0xFFFF
    return bf16_from_key(key.astype(np.uint16))


def readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view: the compiled loops then see one array type, so they compile once."""
    v = a.view()
    v.flags.writeable = False
    return v


class Change(Protocol):
    """A parsed, checked change of one tensor, stored in one of two ways.

    * :meth:`store` into numpy ``uint16`` arrays (the CPU path, the transformers model's own storage
      through zero-copy views): the ``aurora``, ``aurora-base`` and ``leb128`` changes of a large
      delta run the fused compiled loops of :mod:`aurora.delta.kernels`; the rest, and small deltas
      (:data:`aurora.delta.apply.COMPILED_MIN_CHANGES`), go through :class:`Materialized`.
    * :meth:`materialize` into a :class:`Materialized` change, the device-neutral form: int64
      indices (or none: every element), uint16 values and what to do with them (``set`` the
      bits, add a ``ulp`` difference to the old bits, ``xor`` them).
    """

    nnz: int
    numel: int

    def store(self, parts: Parts) -> None: ...

    def materialize(self) -> Materialized: ...


@dataclass
class Materialized:
    """A change in plain arrays: ``idx`` (sorted int64, or None for every element), ``vals``
    (uint16, one per index or per element) and ``op`` (``set``, ``ulp`` or ``xor``); ``nnz`` is
    the record's change count (after a TP remap: the elements written)."""

    idx: np.ndarray | None
    vals: np.ndarray
    op: str
    numel: int
    nnz: int

    def new_bits(self, old: np.ndarray | None) -> np.ndarray:
        """New bits from the old bits at ``idx`` (or of every element); ``set`` reads none."""
        if self.op == "set":
            return self.vals
        if old is None:
            raise ValueError(f"a {self.op} change needs the old bits")
        if self.op == "ulp":
            return ulp_add(old, self.vals)
        flipped: np.ndarray = old ^ self.vals
        return flipped

    def store(self, parts: Parts) -> None:
        if self.idx is None:
            for arr, off, n in parts:
                seg = self.vals[off : off + n]
                if self.op == "set":
                    arr[:] = seg
                elif self.op == "xor":
                    np.bitwise_xor(arr, seg, out=arr)
                else:
                    arr[:] = ulp_add(arr, seg)
            return
        cuts = np.searchsorted(self.idx, [off for _, off, _ in parts[1:]])
        bounds = [0, *cuts.tolist(), self.idx.size]
        for (arr, off, _), a, b in zip(parts, bounds[:-1], bounds[1:], strict=True):
            if a == b:
                continue
            local = self.idx[a:b] - off
            vals = self.vals[a:b]
            arr[local] = vals if self.op == "set" else self.new_bits_at(arr[local], vals)

    def new_bits_at(self, old: np.ndarray, vals: np.ndarray) -> np.ndarray:
        return ulp_add(old, vals) if self.op == "ulp" else old ^ vals

    def materialize(self) -> Materialized:
        return self


class Undoable:
    """A change whose compiled store keeps the old bits of every element it writes (``undo``, one
    per change in stream order) and its progress (``progress[0]``: changes stored so far, which
    the loop updates each time it returns): :meth:`unstore` puts back what the last store wrote,
    whole or cut short (by an index refused part-way, or by a ``KeyboardInterrupt`` between two
    parts: Python delivers a signal between calls into a loop, never inside one)."""

    undo: np.ndarray | None
    progress: np.ndarray | None

    def _prefix(self, count: int) -> np.ndarray:
        """The indices of the first ``count`` changes (int64)."""
        raise NotImplementedError

    def unstore(self, parts: Parts) -> None:
        """Restore the bits the last :meth:`store` overwrote; then there is nothing to undo."""
        undo, progress = self.undo, self.progress
        if undo is not None and progress is not None and (count := int(progress[0])):
            idx = self._prefix(count)
            cuts = np.searchsorted(idx, [off for _, off, _ in parts[1:]])
            bounds = [0, *cuts.tolist(), idx.size]
            for (arr, off, _), a, b in zip(parts, bounds[:-1], bounds[1:], strict=True):
                compiled().restore(arr, off, idx[a:b], undo[a:b])
        self.release()

    def release(self) -> None:
        """Drop the undo log (the whole delta is stored, or it has been rolled back)."""
        self.undo = self.progress = None


class CheckedAsStored(Undoable):
    """Store by a fused compiled loop that checks each index just before writing it, keeping
    the old bits of every element it writes (``undo``): a bad stream is refused part-way, and
    the writes made until then are restored (:meth:`unstore`) before the CorruptError is raised.
    :meth:`materialize` (the torch path, the TP remap, the chain's undo log) checks the whole
    stream first, with the separate ``check_*`` loop."""

    nnz: int
    numel: int
    what: str
    checked: bool

    def _check(self) -> None:  # the whole stream, before any use of materialize
        raise NotImplementedError

    def _run(self, k: Any, arr: np.ndarray, off: int, n: int, st: np.ndarray, ring: np.ndarray,
             undo: np.ndarray) -> None:  # fmt: skip
        raise NotImplementedError

    def store(self, parts: Parts) -> None:
        k = compiled()
        st = np.zeros(k.STATE, dtype=np.int64)
        ring = np.empty(k.RING, dtype=np.int64)
        undo = np.empty(self.nnz, dtype=np.uint16)
        self.progress = st  # before the log: an interrupt between the two finds nothing written
        self.undo = undo
        for arr, off, n in parts:
            self._run(k, arr, off, n, st, ring, undo)
            if st[5] != k.OK:
                break
        if st[5] != k.OK:
            self.unstore(parts)
            check_status(int(st[5]), self.what)
        if int(st[0]) != self.nnz:  # a checked stream always ends inside the tensor
            stored = int(st[0])
            self.unstore(parts)
            raise CorruptError(f"{self.what}: stored {stored} of {self.nnz} changes")
        self.checked = True


@dataclass
class SmallGapChange(Undoable):
    """An ``aurora``/``aurora-base`` change: uint8/uint16 gaps with escapes, and either split
    values (``va`` high bytes, ``vb`` low bytes) or ULP differences (``va``, escapes ``vesc``).
    Its streams are checked whole when parsed (``check_small_gaps``: vectorised sums and counts,
    cheaper than checking as it stores) and stored by ``store_small_gaps`` without checks,
    keeping the old bits (:class:`Undoable`) so an interrupted apply rolls back."""

    lo: np.ndarray
    hi: np.ndarray
    esc: np.ndarray
    va: np.ndarray
    vb: np.ndarray
    vesc: np.ndarray
    vmode: int
    numel: int
    nnz: int
    what: str = "tensor"
    undo: np.ndarray | None = None
    progress: np.ndarray | None = None
    log: bool = True
    """Keep the undo log as it stores; :func:`aurora.delta.apply.store_prepared` turns it off
    where nothing can interrupt the store (see there)."""

    def __post_init__(self) -> None:
        for f in ("lo", "hi", "esc", "va", "vb", "vesc"):
            setattr(self, f, readonly(getattr(self, f)))

    def store(self, parts: Parts) -> None:
        st = np.zeros(7, dtype=np.int64)
        undo = np.empty(self.nnz if self.log else 0, dtype=np.uint16)
        self.progress = st  # before the log: an interrupt between the two finds nothing written
        self.undo = undo if self.log else None
        for arr, off, n in parts:
            compiled().store_small_gaps(
                arr, off, off + n, st, self.lo, self.hi, self.esc, self.va, self.vb,
                self.vesc, self.vmode, self.log, undo,
            )  # fmt: skip
        if st[0] != self.nnz:  # checked streams always end inside the tensor
            stored = int(st[0])
            self.unstore(parts)
            raise CorruptError(f"{self.what}: stored {stored} of {self.nnz} changes")

    def _prefix(self, count: int) -> np.ndarray:
        idx = np.empty(count, dtype=np.int64)
        compiled().expand_small_gaps(self.lo, self.hi, self.esc, idx)
        return idx

    def materialize(self) -> Materialized:
        idx = np.empty(self.nnz, dtype=np.int64)
        compiled().expand_small_gaps(self.lo, self.hi, self.esc, idx)
        if self.vmode == SPLIT:
            vals = (self.va.astype(np.uint16) << 8) | self.vb
            return Materialized(idx, vals, "set", self.numel, self.nnz)
        zz = self.va.astype(np.uint16)
        zz[zz == 0] = self.vesc
        return Materialized(idx, zz, "ulp", self.numel, self.nnz)


@dataclass
class LebChange(CheckedAsStored):
    """A ``leb128`` change: LEB128 gaps and raw uint16 values, checked as stored."""

    buf: np.ndarray
    vals: np.ndarray
    numel: int
    nnz: int
    what: str = "tensor"
    checked: bool = False
    undo: np.ndarray | None = None
    progress: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.buf, self.vals = readonly(self.buf), readonly(self.vals)

    def _check(self) -> None:
        if not self.checked:
            check_status(compiled().check_leb128(self.buf, self.nnz, self.numel), self.what)
            self.checked = True

    def _run(self, k: Any, arr: np.ndarray, off: int, n: int, st: np.ndarray, ring: np.ndarray,
             undo: np.ndarray) -> None:  # fmt: skip
        k.apply_leb128(arr, off, off + n, st, ring, undo, self.buf, self.vals, self.numel)

    def _prefix(self, count: int) -> np.ndarray:
        idx = np.empty(count, dtype=np.int64)
        compiled().expand_leb128(self.buf, idx)
        return idx

    def materialize(self) -> Materialized:
        self._check()
        return Materialized(self._prefix(self.nnz), self.vals, "set", self.numel, self.nnz)


def check_status(code: int, what: str) -> None:
    """Raise the :class:`CorruptError` a ``kernels.check_*`` status code stands for."""
    if code != 0:
        raise CorruptError(f"{what}: {compiled().MESSAGES[code]}")


def check_numel(numel: int, what: str) -> None:
    if not 0 <= numel < 1 << 62:  # kernels.MAX_NUMEL
        raise CorruptError(f"{what}: {numel} elements is not a tensor size this code applies")


def checked_indices(idx: np.ndarray, numel: int, what: str) -> np.ndarray:
    """Absolute int64 indices, refused unless strictly increasing inside [0, numel)."""
    if idx.size and (
        idx[0] < 0 or idx[-1] >= numel or (idx.size > 1 and not (idx[1:] > idx[:-1]).all())
    ):
        raise CorruptError(f"{what}: indices are not strictly increasing within [0, {numel})")
    return idx


def indices_from_gaps(gaps: np.ndarray, numel: int, what: str) -> np.ndarray:
    """Indices from unsigned gaps (any width), refused unless every gap after the first is >= 1,
    no gap reaches ``numel`` and the sum stays below it (checked before anything can wrap)."""
    g = gaps.astype(np.uint64, copy=False)
    if g.size and (int(g.max()) >= numel or (g.size > 1 and int(g[1:].min()) == 0)):
        raise CorruptError(f"{what}: indices are not strictly increasing within [0, {numel})")
    # every gap < numel < 2^62, so a cumulative sum that wraps uint64 decreases where it wraps
    idx = np.cumsum(g, dtype=np.uint64)
    if idx.size and (int(idx[-1]) >= numel or (idx.size > 1 and not (idx[1:] > idx[:-1]).all())):
        raise CorruptError(f"{what}: indices are not strictly increasing within [0, {numel})")
    return idx.astype(np.int64)
