"""Per-tensor codecs of a sparse bf16 delta. All are bit-exact; the header names the codec.

A tensor's change is ``idx`` (sorted flat int64 indices of the bf16 elements whose 16-bit pattern
changed) and ``new`` (their new bit patterns, uint16). Each codec turns that into a few byte
streams and back: ``leb128`` (the paper's), ``aurora`` (the default: escaped small gaps and split
value bytes, zstd-1), ``aurora-base`` (values as ULP differences from the receiver's base), the
dense encodings of :mod:`aurora.delta.dense`, and the peers' baselines; :data:`CODECS` describes
each. Measurements behind the choices: ``docs/journal/early-measurements.md`` and
``docs/DELTA.md``. Decoding is split in two (:mod:`aurora.delta.changes`): ``parse`` decompresses
and checks the streams (every decoder refuses indices that are not strictly increasing inside the
tensor, as it decodes, with a :class:`~aurora.delta.errors.CorruptError`) and returns a change
that is stored later, once every record of the delta has parsed. :data:`FAMILIES` says which
encodings the writer may choose among for a requested codec: it keeps the smallest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import zstandard

from aurora.delta import leb128
from aurora.delta.changes import (
    SPLIT,
    ULP,
    Change,
    LebChange,
    Materialized,
    SmallGapChange,
    check_numel,
    check_status,
    checked_indices,
    compiled,
    indices_from_gaps,
    readonly,
    ulp_diff,
)
from aurora.delta.errors import CorruptError, TruncatedError, UnknownCodecError

ESCAPE_SHARE_FOR_U16 = 0.03
"""Switch the aurora index stream to uint16 gaps when more than this share of uint8 gaps escape."""
ZSTD_LEVEL = 1
"""zstd level of every zstd stream; levels >= 3 gained nothing on this data
(docs/journal/early-measurements.md)."""
_NO_U8 = np.zeros(0, np.uint8)
_NO_U16 = np.zeros(0, np.uint16)


Stream = bytes | memoryview
"""One of a record's byte streams (a read-only view into the file when parsed from one)."""
FullOld = Callable[[], np.ndarray] | None
"""The whole base tensor's bits, flat, on demand (only the dense encodings call it)."""


def zc(data: bytes | np.ndarray) -> bytes:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(
        data.tobytes() if isinstance(data, np.ndarray) else data
    )


def zd(data: bytes | memoryview, size: int, what: str) -> np.ndarray:
    """Decompress one zstd frame that must give exactly ``size`` bytes (as a uint8 array)."""
    # One decompressor per call: zstandard decompressors are not thread-safe.
    try:
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=max(size, 1))
    except zstandard.ZstdError as exc:
        raise CorruptError(f"{what}: zstd stream does not decode ({exc})") from None
    if len(out) != size:
        raise CorruptError(f"{what}: zstd stream gives {len(out)} bytes, expected {size}")
    return np.frombuffer(out, dtype=np.uint8)


def arr(data: bytes | memoryview, dtype: type | str, count: int, what: str) -> np.ndarray:
    dt = np.dtype(dtype).newbyteorder("<")
    need = count * dt.itemsize
    if len(data) != need:
        raise (TruncatedError if len(data) < need else CorruptError)(
            f"{what}: {len(data)} bytes, expected {need}"
        )
    return np.frombuffer(data, dtype=dt, count=count)


def gaps_of(idx: np.ndarray) -> np.ndarray:
    """First index, then successive differences (int64)."""
    gaps = np.empty_like(idx)
    if idx.size:
        gaps[0] = idx[0]
        np.subtract(idx[1:], idx[:-1], out=gaps[1:])
    return gaps


# ---- aurora index and value streams -----------------------------------------------------


def encode_index(idx: np.ndarray) -> list[bytes]:
    """aurora index streams: [mode(1 B) + escape width(1 B), zstd(gaps), escapes raw]."""
    gaps = gaps_of(idx)
    esc8 = (gaps == 0) | (gaps > 0xFF)
    if idx.size and esc8.sum() > ESCAPE_SHARE_FOR_U16 * idx.size:
        esc = (gaps == 0) | (gaps > 0xFFFF)
        small = np.where(esc, 0, gaps).astype("<u2")
        planes = np.concatenate([(small & 0xFF).astype(np.uint8), (small >> 8).astype(np.uint8)])
        mode = 16
    else:
        esc = esc8
        planes = np.where(esc, 0, gaps).astype(np.uint8)
        mode = 8
    big = gaps[esc]
    edt = np.dtype("<u4") if big.size == 0 or int(big.max()) < 2**32 else np.dtype("<u8")
    return [bytes([mode, edt.itemsize]), zc(planes), big.astype(edt).tobytes()]


def _index_planes(
    streams: Sequence[Stream], nnz: int, what: str
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """(gap width in bits, low-byte plane, high-byte plane, escapes) of aurora index streams,
    decompressed and sized, not yet checked."""
    meta, packed, escapes = streams
    if len(meta) != 2 or meta[0] not in (8, 16) or meta[1] not in (4, 8):
        raise CorruptError(f"{what}: bad index stream header {bytes(meta)!r}")
    mode, width = meta[0], meta[1]
    planes = zd(packed, nnz * mode // 8, what)
    lo, hi = (planes, _NO_U8) if mode == 8 else (planes[:nnz], planes[nnz:])
    n_esc = len(escapes) // width
    esc = readonly(arr(escapes, f"u{width}", n_esc, what).astype(np.uint64))
    return mode, readonly(lo), readonly(hi), esc


def parse_index(
    streams: Sequence[Stream], nnz: int, numel: int, what: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lo, hi, escapes) of aurora index streams checked as increasing inside the tensor by the
    compiled check, for the compiled store."""
    _, lo, hi, esc = _index_planes(streams, nnz, what)
    check_status(compiled().check_small_gaps(lo, hi, esc, numel), what)
    return lo, hi, esc


def parse_index_numpy(streams: Sequence[Stream], nnz: int, numel: int, what: str) -> np.ndarray:
    """The int64 indices of aurora index streams, checked alike with numpy."""
    mode, lo, hi, esc = _index_planes(streams, nnz, what)
    gaps = lo.astype(np.uint64) if mode == 8 else lo | (hi.astype(np.uint64) << 8)
    zero = gaps == 0
    if int(np.count_nonzero(zero)) != esc.size:
        raise CorruptError(f"{what}: the escape count does not match the escape side array")
    gaps[zero] = esc
    return indices_from_gaps(gaps, numel, what)


def encode_split_values(new: np.ndarray) -> list[bytes]:
    """[zstd(high bytes), raw low bytes] of bf16 bit patterns."""
    return [zc((new >> 8).astype(np.uint8)), (new & 0xFF).astype(np.uint8).tobytes()]


def encode_ulp_values(new: np.ndarray, old: np.ndarray) -> list[bytes]:
    """[zstd(uint8 zigzag ULP differences, 0 = escape), escaped differences as uint16]."""
    zz = ulp_diff(new, old)
    esc = zz > 0xFF
    return [zc(np.where(esc, 0, zz).astype(np.uint8)), zz[esc].astype("<u2").tobytes()]


# ---- codecs --------------------------------------------------------------------------------


class Encoder(Protocol):
    """(idx, new values, old values at idx, numel, full_old=None) -> streams. Only the dense
    encodings call ``full_old()`` (the whole base tensor, flat); the rest read changed
    positions."""

    def __call__(
        self,
        idx: np.ndarray,
        new: np.ndarray,
        old: np.ndarray,
        numel: int,
        full_old: FullOld = None,
        /,
    ) -> list[bytes]: ...


class Parser(Protocol):
    """(streams, nnz, numel, what, fast=True) -> a checked change (:mod:`aurora.delta.changes`).
    ``fast``: the compiled check and store of :mod:`aurora.delta.kernels` where the codec has
    them (``aurora``, ``aurora-base``, ``leb128``); else numpy, checked alike, into a
    ``Materialized``."""

    def __call__(
        self, streams: Sequence[Stream], nnz: int, numel: int, what: str, fast: bool = True, /
    ) -> Change: ...


@dataclass(frozen=True)
class Codec:
    name: str
    needs_base: bool
    """True when decoding needs the receiver's current (base) weights."""
    encode: Encoder
    parse: Parser
    streams: int
    """Number of streams it writes."""

    def decode(
        self,
        streams: Sequence[Stream],
        nnz: int,
        numel: int,
        base: np.ndarray,
        what: str,
        fast: bool = True,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(changed indices, their new bits) against ``base`` (anything indexable by an index
        array, e.g. the flat base tensor; only read by codecs that need it); ``fast``: through
        the compiled check (else numpy)."""
        check_numel(numel, what)
        m = self.parse(list(streams), nnz, numel, what, fast).materialize()
        if m.idx is None:
            old = base[np.arange(numel)]
            new = m.new_bits(old)
            idx = np.flatnonzero(new != old)
            return idx, new[idx]
        old = base[m.idx] if m.op != "set" else None
        return m.idx, m.new_bits(old)


def _enc_leb128(
    idx: np.ndarray, new: np.ndarray, old: np.ndarray, numel: int, full_old: FullOld = None
) -> list[bytes]:
    return [leb128.encode(gaps_of(idx)), new.astype("<u2").tobytes()]


def _parse_leb128(
    streams: Sequence[Stream], nnz: int, numel: int, what: str, fast: bool = True
) -> Change:
    buf = readonly(np.frombuffer(streams[0], dtype=np.uint8))
    vals = arr(streams[1], np.uint16, nnz, what)
    if not fast:
        try:
            gaps = leb128.decode(buf, nnz)
        except (TruncatedError, CorruptError) as exc:
            raise type(exc)(f"{what}: {exc}") from None
        return Materialized(indices_from_gaps(gaps, numel, what), vals, "set", numel, nnz)
    return LebChange(buf, vals, numel, nnz, what)


def _enc_aurora(
    idx: np.ndarray, new: np.ndarray, old: np.ndarray, numel: int, full_old: FullOld = None
) -> list[bytes]:
    return encode_index(idx) + encode_split_values(new)


def _parse_aurora(
    streams: Sequence[Stream], nnz: int, numel: int, what: str, fast: bool = True
) -> Change:
    if not fast:
        idx = parse_index_numpy(streams[:3], nnz, numel, what)
        va, vb = _split_streams(streams, nnz, what)
        return Materialized(idx, (va.astype(np.uint16) << 8) | vb, "set", numel, nnz)
    index = parse_index(streams[:3], nnz, numel, what)
    va, vb = _split_streams(streams, nnz, what)
    return SmallGapChange(*index, va, vb, _NO_U16, SPLIT, numel, nnz, what)


def _split_streams(streams: Sequence[Stream], nnz: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(high bytes, low bytes) of ``aurora`` split values."""
    return zd(streams[3], nnz, what), arr(streams[4], np.uint8, nnz, what)


def _enc_aurora_base(
    idx: np.ndarray, new: np.ndarray, old: np.ndarray, numel: int, full_old: FullOld = None
) -> list[bytes]:
    return encode_index(idx) + encode_ulp_values(new, old)


def _parse_aurora_base(
    streams: Sequence[Stream], nnz: int, numel: int, what: str, fast: bool = True
) -> Change:
    if fast:
        index = parse_index(streams[:3], nnz, numel, what)
        va, vesc = _ulp_streams(streams, nnz, what)
        return SmallGapChange(*index, va, _NO_U8, vesc, ULP, numel, nnz, what)
    idx = parse_index_numpy(streams[:3], nnz, numel, what)
    va, vesc = _ulp_streams(streams, nnz, what)
    zz = va.astype(np.uint16)
    zz[zz == 0] = vesc
    return Materialized(idx, zz, "ulp", numel, nnz)


def _ulp_streams(streams: Sequence[Stream], nnz: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 zigzag ULP differences, 0 = escape; the escaped differences) of ``aurora-base``."""
    va = zd(streams[3], nnz, what)
    n_esc = int(nnz - np.count_nonzero(va))
    return va, arr(streams[4], np.uint16, n_esc, what)


def _enc_naive(
    idx: np.ndarray, new: np.ndarray, old: np.ndarray, numel: int, full_old: FullOld = None
) -> list[bytes]:
    wide = numel >= 2**31
    return [idx.astype("<i8" if wide else "<i4").tobytes(), new.astype("<u2").tobytes()]


def _parse_naive(
    streams: Sequence[Stream], nnz: int, numel: int, what: str, fast: bool = True
) -> Change:
    idx = arr(streams[0], np.int64 if numel >= 2**31 else np.int32, nnz, what).astype(np.int64)
    vals = arr(streams[1], np.uint16, nnz, what)
    return Materialized(checked_indices(idx, numel, what), vals, "set", numel, nnz)


def _enc_downcast(
    idx: np.ndarray, new: np.ndarray, old: np.ndarray, numel: int, full_old: FullOld = None
) -> list[bytes]:
    gaps = gaps_of(idx)
    top = int(gaps.max()) if gaps.size else 0
    dt = next(d for d in ("<u1", "<u2", "<u4", "<u8") if top < 2 ** (8 * np.dtype(d).itemsize))
    return [bytes([np.dtype(dt).itemsize]), zc(gaps.astype(dt)), zc(new.astype("<u2"))]


def _parse_downcast(
    streams: Sequence[Stream], nnz: int, numel: int, what: str, fast: bool = True
) -> Change:
    if len(streams[0]) != 1 or streams[0][0] not in (1, 2, 4, 8):
        raise CorruptError(f"{what}: bad gap width {bytes(streams[0])!r}")
    width = streams[0][0]
    gaps = zd(streams[1], nnz * width, what).view(np.dtype(f"u{width}").newbyteorder("<"))
    vals = zd(streams[2], nnz * 2, what).view("<u2")
    return Materialized(indices_from_gaps(gaps, numel, what), vals, "set", numel, nnz)


def _codecs() -> dict[str, Codec]:
    from aurora.delta import dense

    return {
        c.name: c
        for c in (
            Codec("leb128", False, _enc_leb128, _parse_leb128, 2),
            Codec("aurora", False, _enc_aurora, _parse_aurora, 5),
            Codec("aurora-base", True, _enc_aurora_base, _parse_aurora_base, 5),
            Codec("naive", False, _enc_naive, _parse_naive, 2),
            Codec("downcast-zstd", False, _enc_downcast, _parse_downcast, 3),
            Codec("xor-zstd", True, dense.encode_xor, dense.parse_xor, 1),
            Codec("dense", False, dense.encode_dense, dense.parse_dense, 2),
            Codec("dense-base", True, dense.encode_dense_ulp, dense.parse_dense_ulp, 2),
        )
    }


CODECS: dict[str, Codec] = _codecs()
"""Every codec by the name written in the header.

``leb128`` (the paper)
    index gaps (first index, then differences) as unsigned LEB128; values raw bf16 (2 B each).
``aurora`` (default)
    index gaps as uint8 with 0 as escape (escaped gaps, i.e. 0 or > 255, go in order to a
    uint32/uint64 side array), zstd level 1; when more than 3% of gaps escape (density below about
    1.3%) uint16 gaps with 0 as escape, stored as a low-byte plane then a high-byte plane, zstd-1.
    Values split into the high byte (sign + 7 exponent bits: low entropy, zstd-1) and the low byte
    (last exponent bit + mantissa: incompressible, raw).
``aurora-base``
    ``aurora`` indices; values as the zigzagged difference, in ULPs of the order-preserving key of
    bf16, between new and old value, uint8 with 0 as escape (escaped as uint16), zstd-1. Needs
    the receiver's base to be bit-identical: the hash chain proves it before apply.
Dense encodings (:mod:`aurora.delta.dense`), for tensors where most elements change:
``dense`` the new bits of every element; ``dense-base`` the ULP difference of every element.
Baselines of today's peers, for the encoding experiment:
``naive``
    absolute int32 (int64 for tensors of 2^31 elements or more) index + raw bf16 (the paper's
    baseline; verl ``delta_sharded``).
``downcast-zstd``
    gaps downcast to the smallest unsigned dtype that holds the largest (PULSE/grail), zstd-1 on
    indices and on raw values.
``xor-zstd``
    the dense XOR of old and new bits over the whole tensor, zstd-1 (slime); needs the base.
"""

DEFAULT_CODEC = "aurora"

FAMILIES: dict[str, tuple[str, ...]] = {
    "aurora": ("aurora", "leb128", "dense"),
    "aurora-base": ("aurora-base", "aurora", "leb128", "dense-base", "xor-zstd", "dense"),
}
"""The encodings the writer chooses among, per tensor, when asked for this codec; it keeps the
smallest (first listed on a tie). ``aurora`` never needs the receiver's base values; the
``aurora-base`` family may. Every other codec is written as asked: they are the baselines the
encoding experiment measures."""


def get(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise UnknownCodecError(f"unknown codec {name!r} (known: {', '.join(CODECS)})") from None
