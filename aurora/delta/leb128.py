"""Unsigned LEB128 varints, vectorised with numpy (the paper's index encoding, Figure 6).

Each integer is cut into 7-bit groups, least significant first; every byte but the last has its
high bit set. 198 = 0b1_1000110 becomes ``C6 01``: payload 70 with continuation, then payload 1,
and 70 + (1 << 7) = 198. Encoding loops over byte *positions* (at most 10 for 64-bit values),
never over elements; decoding finds the terminal bytes with one vector compare and sums the
shifted payloads per value with ``np.add.reduceat``.
"""

from __future__ import annotations

import numpy as np

from aurora.delta.errors import CorruptError, TruncatedError

MAX_BYTES = 10
"""A 64-bit value needs at most ceil(64 / 7) = 10 bytes."""


def encode(values: np.ndarray) -> bytes:
    """LEB128 encoding of non-negative integers (any integer dtype, 1-D)."""
    v = np.asarray(values)
    if v.ndim != 1:
        raise ValueError(f"leb128.encode expects a 1-D array, got shape {v.shape}")
    if v.size == 0:
        return b""
    if v.dtype.kind == "i" and v.min() < 0:
        raise ValueError("leb128.encode needs non-negative values")
    v = v.astype(np.uint64, copy=False)
    # bytes per value: 1 + floor(log2(v) / 7) for v > 0, 1 for 0
    nbytes = np.ones(v.size, dtype=np.int64)
    for k in range(1, MAX_BYTES):
        nbytes += v >= np.uint64(1) << np.uint64(7 * k)
    ends = np.cumsum(nbytes)
    starts = ends - nbytes
    out = np.empty(int(ends[-1]), dtype=np.uint8)
    for k in range(int(nbytes.max())):
        has = nbytes > k
        group = ((v[has] >> np.uint64(7 * k)) & np.uint64(0x7F)).astype(np.uint8)
        group |= np.where(nbytes[has] > k + 1, 0x80, 0).astype(np.uint8)
        out[starts[has] + k] = group
    return out.tobytes()


def encoded_size(values: np.ndarray) -> int:
    """Bytes :func:`encode` would write for these non-negative integers (without writing them)."""
    v = np.asarray(values).astype(np.uint64, copy=False)
    total = v.size
    for k in range(1, MAX_BYTES):
        total += int(np.count_nonzero(v >= np.uint64(1) << np.uint64(7 * k)))
    return total


def decode(buf: bytes | bytearray | memoryview | np.ndarray, count: int) -> np.ndarray:
    """The first ``count`` LEB128 values of ``buf`` as uint64.

    Raises :class:`TruncatedError` if ``buf`` holds fewer than ``count`` values and
    :class:`CorruptError` if a value is longer than 10 bytes, does not fit in 64 bits (a 10th
    byte above 1 would be silently shifted out), or bytes are left over.
    """
    b = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    if count == 0:
        if b.size:
            raise CorruptError(f"leb128: {b.size} bytes left over after 0 values")
        return np.zeros(0, dtype=np.uint64)
    ends = np.flatnonzero(b < 0x80)
    if ends.size < count:
        raise TruncatedError(f"leb128: {count} values expected, {ends.size} found")
    if ends.size > count or ends[count - 1] != b.size - 1:
        raise CorruptError(f"leb128: bytes left over after {count} values")
    starts = np.empty(count, dtype=np.int64)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if lengths.max() > MAX_BYTES:
        raise CorruptError(f"leb128: a value is longer than {MAX_BYTES} bytes")
    if lengths.max() == MAX_BYTES and (b[ends[lengths == MAX_BYTES]] > 1).any():
        raise CorruptError("leb128: a value does not fit in 64 bits")
    if int(lengths.max()) == 1:
        return b.astype(np.uint64)
    # position of every byte inside its value: 0, 1, ... (7 bits of shift each)
    within = np.arange(b.size, dtype=np.int64) - np.repeat(starts, lengths)
    payload = (b & np.uint8(0x7F)).astype(np.uint64) << (within * 7).astype(np.uint64)
    return np.add.reduceat(payload, starts)
