"""Per-tensor codecs of a sparse bf16 delta. All are bit-exact; the header names the codec.

A tensor's change is ``idx`` (sorted flat int64 indices of the bf16 elements whose 16-bit pattern
changed) and ``new`` (their new bit patterns, uint16). Each codec turns that into a few byte
streams and back. Measurements behind the choices: ``shared/notes/codec-measurements.md`` and
``docs/DELTA.md``.

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

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import zstandard

from aurora.delta import leb128
from aurora.delta.errors import CorruptError, TruncatedError, UnknownCodecError

ESCAPE_SHARE_FOR_U16 = 0.03
"""Switch the aurora index stream to uint16 gaps when more than this share of uint8 gaps escape."""
ZSTD_LEVEL = 1
"""zstd level of every zstd stream; levels >= 3 gained nothing on this data (notes)."""


def _zc(data: bytes | np.ndarray) -> bytes:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(
        data.tobytes() if isinstance(data, np.ndarray) else data
    )


def _zd(data: bytes, size: int, what: str) -> bytes:
    # One decompressor per call: zstandard decompressors are not thread-safe.
    try:
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=max(size, 1))
    except zstandard.ZstdError as exc:
        raise CorruptError(f"{what}: zstd stream does not decode ({exc})") from None
    if len(out) != size:
        raise CorruptError(f"{what}: zstd stream gives {len(out)} bytes, expected {size}")
    return out


def _arr(data: bytes, dtype: type, count: int, what: str) -> np.ndarray:
    need = count * np.dtype(dtype).itemsize
    if len(data) != need:
        raise (TruncatedError if len(data) < need else CorruptError)(
            f"{what}: {len(data)} bytes, expected {need}"
        )
    return np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<"), count=count)


def gaps_of(idx: np.ndarray) -> np.ndarray:
    """First index, then successive differences (int64)."""
    gaps = np.empty_like(idx)
    if idx.size:
        gaps[0] = idx[0]
        np.subtract(idx[1:], idx[:-1], out=gaps[1:])
    return gaps


def _indices_from_gaps(gaps: np.ndarray, numel: int, what: str) -> np.ndarray:
    idx = np.cumsum(gaps, dtype=np.int64)
    if idx.size and (idx[-1] >= numel or idx[0] < 0 or (idx.size > 1 and gaps[1:].min() <= 0)):
        raise CorruptError(f"{what}: indices are not strictly increasing within [0, {numel})")
    return idx


# ---- index streams -------------------------------------------------------------------------


def _escape_dtype(big: np.ndarray) -> np.dtype:
    return np.dtype("<u4") if big.size == 0 or int(big.max()) < 2**32 else np.dtype("<u8")


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
    edt = _escape_dtype(big)
    return [bytes([mode, edt.itemsize]), _zc(planes), big.astype(edt).tobytes()]


def decode_index(streams: list[bytes], nnz: int, numel: int, what: str) -> np.ndarray:
    meta, packed, escapes = streams
    if len(meta) != 2 or meta[0] not in (8, 16) or meta[1] not in (4, 8):
        raise CorruptError(f"{what}: bad index stream header {meta!r}")
    mode, width = meta[0], meta[1]
    raw = _zd(packed, nnz * mode // 8, what)
    if mode == 8:
        gaps = np.frombuffer(raw, dtype=np.uint8).astype(np.int64)
    else:
        planes = np.frombuffer(raw, dtype=np.uint8)
        gaps = planes[:nnz].astype(np.int64) | (planes[nnz:].astype(np.int64) << 8)
    esc = gaps == 0
    n_esc = int(esc.sum())
    big = _arr(escapes, np.uint32 if width == 4 else np.uint64, n_esc, what)
    if n_esc and int(big.max()) >= numel:
        raise CorruptError(f"{what}: escaped gap beyond the tensor")
    gaps[esc] = big.astype(np.int64)
    return _indices_from_gaps(gaps, numel, what)


# ---- value streams -------------------------------------------------------------------------


def encode_split_values(new: np.ndarray) -> list[bytes]:
    """[zstd(high bytes), raw low bytes] of bf16 bit patterns."""
    return [_zc((new >> 8).astype(np.uint8)), (new & 0xFF).astype(np.uint8).tobytes()]


def decode_split_values(streams: list[bytes], nnz: int, what: str) -> np.ndarray:
    hi = np.frombuffer(_zd(streams[0], nnz, what), dtype=np.uint8)
    lo = _arr(streams[1], np.uint8, nnz, what)
    return (hi.astype(np.uint16) << 8) | lo


def bf16_key(bits: np.ndarray) -> np.ndarray:
    """Order-preserving uint16 key of bf16 bits (negative: flip all bits; positive: flip sign)."""
    bits = bits.astype(np.uint16, copy=False)
    return np.where(bits & 0x8000, ~bits, bits | 0x8000).astype(np.uint16)


def bf16_from_key(key: np.ndarray) -> np.ndarray:
    key = key.astype(np.uint16, copy=False)
    return np.where(key & 0x8000, key & 0x7FFF, ~key).astype(np.uint16)


def encode_ulp_values(new: np.ndarray, old: np.ndarray) -> list[bytes]:
    """[zstd(uint8 zigzag ULP differences, 0 = escape), escaped differences as uint16]."""
    diff = (bf16_key(new).astype(np.int32) - bf16_key(old).astype(np.int32)).astype(np.int16)
    d = diff.astype(np.int32)
    zz = ((d << 1) ^ (d >> 31)).astype(np.uint32) & 0xFFFF  # zigzag of a 16-bit difference
    esc = zz > 0xFF
    small = np.where(esc, 0, zz).astype(np.uint8)
    return [_zc(small), zz[esc].astype("<u2").tobytes()]


def decode_ulp_values(streams: list[bytes], nnz: int, old: np.ndarray, what: str) -> np.ndarray:
    small = np.frombuffer(_zd(streams[0], nnz, what), dtype=np.uint8)
    zz = small.astype(np.uint32)
    esc = zz == 0
    zz[esc] = _arr(streams[1], np.uint16, int(esc.sum()), what)
    diff = ((zz >> 1).astype(np.int32) ^ -(zz & 1).astype(np.int32)).astype(np.int32)
    key = (bf16_key(old).astype(np.int32) + diff) & 0xFFFF
    return bf16_from_key(key.astype(np.uint16))


# ---- codecs --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Codec:
    name: str
    needs_base: bool
    """True when decoding needs the receiver's current (base) weights."""
    encode: Callable[[np.ndarray, np.ndarray, np.ndarray, int], list[bytes]]
    """(idx, new values, old values at idx, numel) -> streams. Encoders never need the dense
    old tensor, so the writer only gathers the changed positions."""
    decode: Callable[[list[bytes], int, int, np.ndarray | None, str], tuple[np.ndarray, np.ndarray]]
    """(streams, nnz, numel, base dense tensor or None, what) -> (idx, new values)."""
    streams: int
    """Number of streams it writes."""


def _enc_leb128(idx, new, old, numel):  # type: ignore[no-untyped-def]
    return [leb128.encode(gaps_of(idx)), new.astype("<u2").tobytes()]


def _dec_leb128(streams, nnz, numel, base, what):  # type: ignore[no-untyped-def]
    try:
        gaps = leb128.decode(streams[0], nnz).astype(np.int64)
    except (TruncatedError, CorruptError) as exc:
        raise type(exc)(f"{what}: {exc}") from None
    return _indices_from_gaps(gaps, numel, what), _arr(streams[1], np.uint16, nnz, what).copy()


def _enc_aurora(idx, new, old, numel):  # type: ignore[no-untyped-def]
    return encode_index(idx) + encode_split_values(new)


def _dec_aurora(streams, nnz, numel, base, what):  # type: ignore[no-untyped-def]
    return decode_index(streams[:3], nnz, numel, what), decode_split_values(streams[3:], nnz, what)


def _enc_aurora_base(idx, new, old, numel):  # type: ignore[no-untyped-def]
    return encode_index(idx) + encode_ulp_values(new, old)


def _dec_aurora_base(streams, nnz, numel, base, what):  # type: ignore[no-untyped-def]
    idx = decode_index(streams[:3], nnz, numel, what)
    assert base is not None
    return idx, decode_ulp_values(streams[3:], nnz, base[idx], what)


def _enc_naive(idx, new, old, numel):  # type: ignore[no-untyped-def]
    wide = numel >= 2**31
    return [idx.astype("<i8" if wide else "<i4").tobytes(), new.astype("<u2").tobytes()]


def _dec_naive(streams, nnz, numel, base, what):  # type: ignore[no-untyped-def]
    idx = _arr(streams[0], np.int64 if numel >= 2**31 else np.int32, nnz, what).astype(np.int64)
    if nnz and (idx[0] < 0 or idx[-1] >= numel or (nnz > 1 and np.diff(idx).min() <= 0)):
        raise CorruptError(f"{what}: indices are not strictly increasing within [0, {numel})")
    return idx, _arr(streams[1], np.uint16, nnz, what).copy()


def _enc_downcast(idx, new, old, numel):  # type: ignore[no-untyped-def]
    gaps = gaps_of(idx)
    top = int(gaps.max()) if gaps.size else 0
    dt = next(d for d in ("<u1", "<u2", "<u4", "<u8") if top < 2 ** (8 * np.dtype(d).itemsize))
    return [bytes([np.dtype(dt).itemsize]), _zc(gaps.astype(dt)), _zc(new.astype("<u2"))]


def _dec_downcast(streams, nnz, numel, base, what):  # type: ignore[no-untyped-def]
    if len(streams[0]) != 1 or streams[0][0] not in (1, 2, 4, 8):
        raise CorruptError(f"{what}: bad gap width {streams[0]!r}")
    width = streams[0][0]
    dt = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
    gaps = np.frombuffer(_zd(streams[1], nnz * width, what), dtype=np.dtype(dt).newbyteorder("<"))
    vals = np.frombuffer(_zd(streams[2], nnz * 2, what), dtype="<u2").copy()
    return _indices_from_gaps(gaps.astype(np.int64), numel, what), vals


def _enc_xor(idx, new, old, numel):  # type: ignore[no-untyped-def]
    x = np.zeros(numel, dtype="<u2")
    x[idx] = new ^ old
    return [_zc(x)]


def _dec_xor(streams, nnz, numel, base, what):  # type: ignore[no-untyped-def]
    x = np.frombuffer(_zd(streams[0], numel * 2, what), dtype="<u2")
    idx = np.flatnonzero(x)
    if idx.size != nnz:
        raise CorruptError(f"{what}: xor stream changes {idx.size} elements, header says {nnz}")
    assert base is not None
    return idx, base[idx] ^ x[idx]


CODECS: dict[str, Codec] = {
    c.name: c
    for c in (
        Codec("leb128", False, _enc_leb128, _dec_leb128, 2),
        Codec("aurora", False, _enc_aurora, _dec_aurora, 5),
        Codec("aurora-base", True, _enc_aurora_base, _dec_aurora_base, 5),
        Codec("naive", False, _enc_naive, _dec_naive, 2),
        Codec("downcast-zstd", False, _enc_downcast, _dec_downcast, 3),
        Codec("xor-zstd", True, _enc_xor, _dec_xor, 1),
    )
}
"""Every codec by the name written in the header."""

DEFAULT_CODEC = "aurora"


def get(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise UnknownCodecError(f"unknown codec {name!r} (known: {', '.join(CODECS)})") from None
