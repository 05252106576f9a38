"""Dense encodings: every element of the tensor, for changes too dense for a sparse codec.

When most of a tensor's bf16 elements change in a step (a tiny model learning on a CPU, the first
steps after a warm start: ``docs/journal/early-measurements.md``), a sparse codec spends an index
on most elements and costs more than the tensor. Three encodings of the whole tensor, each
bit-exact and chosen per tensor by the writer when smallest
(:data:`aurora.delta.codecs.FAMILIES`; sizes against density in
``docs/journal/delta-measurements.md``): ``dense`` (the new bits: :func:`encode_dense`),
``dense-base`` (the ULP difference from the receiver's base: :func:`encode_dense_ulp`) and
``xor-zstd`` (the XOR of old and new bits: :func:`encode_xor`).

The record's ``nnz`` still counts the changed elements; the receiver checks it against the
decoded stream where that is free (the non-zero differences), so a record cannot claim one count
and carry another.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from aurora.delta.changes import Materialized, ulp_diff
from aurora.delta.codecs import FullOld, Stream, zc, zd
from aurora.delta.errors import CorruptError


def _planes(x: np.ndarray) -> list[bytes]:
    x = x.astype("<u2", copy=False)
    return [zc((x & 0xFF).astype(np.uint8)), zc((x >> 8).astype(np.uint8))]


def _unplanes(streams: Sequence[Stream], numel: int, what: str) -> np.ndarray:
    lo = zd(streams[0], numel, what)
    hi = zd(streams[1], numel, what)
    bits: np.ndarray = (hi.astype(np.uint16) << 8) | lo
    return bits


def _count(x: np.ndarray, nnz: int, what: str) -> None:
    got = int(np.count_nonzero(x))
    if got != nnz:
        raise CorruptError(f"{what}: the stream changes {got} elements, the record says {nnz}")


def _sparse_to_dense(idx: np.ndarray, vals: np.ndarray, numel: int) -> np.ndarray:
    x = np.zeros(numel, dtype=np.uint16)
    x[idx] = vals
    return x


def encode_dense(
    idx: np.ndarray, new: np.ndarray, old: np.ndarray, numel: int, full_old: FullOld = None
) -> list[bytes]:
    """``dense``: the new bits of every element, as a high-byte plane and a low-byte plane, each
    zstd-1. Needs nothing from the receiver (it is a snapshot of the tensor); the floor is about
    1.4 B/element (the low byte is incompressible mantissa).
    """
    if full_old is None:
        raise ValueError("the dense encoding needs the whole base tensor (full_old)")
    bits = np.array(full_old(), dtype=np.uint16).reshape(-1)
    bits[idx] = new
    return _planes(bits)


def parse_dense(
    streams: Sequence[Stream], nnz: int, numel: int, what: str, fast: bool = True
) -> Materialized:
    return Materialized(None, _unplanes(streams, numel, what), "set", numel, nnz)


def encode_dense_ulp(
    idx: np.ndarray, new: np.ndarray, old: np.ndarray, numel: int, full_old: FullOld = None
) -> list[bytes]:
    """``dense-base``: the ULP difference of every element from the receiver's base (zigzag of the
    difference of the order-preserving keys; 0 where unchanged), low-byte and high-byte planes, each
    zstd-1. Most changes are +-1 or 2 ULPs, so the low plane is a few bits per element and the high
    plane nearly all zeros.
    """
    return _planes(_sparse_to_dense(idx, ulp_diff(new, old), numel))


def parse_dense_ulp(
    streams: Sequence[Stream], nnz: int, numel: int, what: str, fast: bool = True
) -> Materialized:
    zz = _unplanes(streams, numel, what)
    _count(zz, nnz, what)
    return Materialized(None, zz, "ulp", numel, nnz)


def encode_xor(
    idx: np.ndarray, new: np.ndarray, old: np.ndarray, numel: int, full_old: FullOld = None
) -> list[bytes]:
    """``xor-zstd``: the XOR of old and new bits of every element, zstd-1, as slime ships it (kept
    as the peers' baseline, and a candidate for the writer).
    """
    return [zc(_sparse_to_dense(idx, new ^ old, numel).astype("<u2"))]


def parse_xor(
    streams: Sequence[Stream], nnz: int, numel: int, what: str, fast: bool = True
) -> Materialized:
    x = zd(streams[0], numel * 2, what).view("<u2")
    _count(x, nnz, what)
    return Materialized(None, x, "xor", numel, nnz)
