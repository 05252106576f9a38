"""Reading a delta checkpoint: parse and verify a whole file, or cut one back into segments.

A file is verified before anything in it is believed: every segment against its leaf hash, the
leaves against ``id(D_v)`` (their Merkle root), ``h(v)`` against ``H(h(v-1) || id(D_v))``, and,
when the caller knows them (from the Trainer's signed announcement), ``id(D_v)`` and ``h(v)``
against the expected values. The codec streams of the result are read-only views into the
buffer: nothing is copied.

Parsing is bounded: the header JSON may be at most ``MAX_HEADER_BYTES`` and a tensor record's at
most ``MAX_RECORD_BYTES``, and JSON nested too deeply to parse is a :class:`CorruptError` like
any other defect (never a ``RecursionError`` escaping to the caller).
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

from aurora.delta import codecs
from aurora.delta.errors import BadMagicError, CorruptError, TruncatedError, UnsupportedFormatError
from aurora.delta.hashing import H, leaf_hash, merkle_root
from aurora.delta.records import (
    FORMAT_VERSION,
    HASH_BYTES,
    MAGIC,
    TRAILER_MAGIC,
    Delta,
    Segment,
    TensorDelta,
    parts_of,
)

MAX_HEADER_BYTES = 64 << 10
"""Largest header JSON read (bytes): a real one is ~250 bytes (model id, versions, a hash)."""
MAX_RECORD_BYTES = 1 << 20
"""Largest tensor record JSON read (bytes): a real one is ~150 bytes (name, shape, lengths)."""


def _json(raw: bytes, what: str) -> object:
    """``json.loads`` whose every failure, nesting too deep included, is a CorruptError."""
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise CorruptError(f"{what} is not valid JSON ({reason})") from None


def _read_frame(
    buf: memoryview, pos: int, tag: bytes, what: str, limit: int | None = None
) -> tuple[dict[str, Any], int]:
    if pos + 5 > len(buf):
        raise TruncatedError(f"{what}: ends at byte {len(buf)}, frame needs {pos + 5}")
    if bytes(buf[pos : pos + 1]) != tag:
        raise CorruptError(f"{what}: expected frame {tag!r} at byte {pos}")
    (n,) = struct.unpack_from("<I", buf, pos + 1)
    if limit is not None and n > limit:
        raise CorruptError(f"{what}: frame of {n} bytes at {pos} exceeds {limit}")
    end = pos + 5 + n
    if end > len(buf):
        raise TruncatedError(f"{what}: frame of {n} bytes at {pos} runs past the end")
    obj = _json(bytes(buf[pos + 5 : end]), f"{what}: frame at byte {pos}")
    if not isinstance(obj, dict):
        raise CorruptError(f"{what}: frame at byte {pos} is not an object")
    return obj, end


def parse_header(buf: bytes | bytearray | memoryview) -> tuple[dict[str, Any], int]:
    mv = memoryview(buf)
    if len(mv) < len(MAGIC) or bytes(mv[: len(MAGIC)]) != MAGIC:
        raise BadMagicError(f"not a delta checkpoint: starts with {bytes(mv[:8])!r}, not {MAGIC!r}")
    if len(mv) < 14:
        raise TruncatedError(f"header: {len(mv)} bytes, the fixed part needs 14")
    fmt, n = struct.unpack_from("<HI", mv, 8)
    if fmt != FORMAT_VERSION:
        raise UnsupportedFormatError(f"format version {fmt}; this code reads {FORMAT_VERSION}")
    if n > MAX_HEADER_BYTES:
        raise CorruptError(f"header of {n} bytes exceeds {MAX_HEADER_BYTES}")
    if 14 + n > len(mv):
        raise TruncatedError(f"header of {n} bytes runs past the end ({len(mv)} bytes)")
    head = _json(bytes(mv[14 : 14 + n]), "header")
    try:
        if not isinstance(head, dict):
            raise TypeError("not an object")
        head = {k: head[k] for k in ("model", "version", "base", "base_hash", "segment_size")}
        if not (
            isinstance(head["version"], int)
            and isinstance(head["base"], int)
            and isinstance(head["segment_size"], int)
            and head["segment_size"] >= 1024
            and isinstance(head["base_hash"], str)
            and len(head["base_hash"]) == 2 * HASH_BYTES
            and isinstance(head["model"], str)
        ):
            raise TypeError("field types")
        bytes.fromhex(head["base_hash"])
    except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
        raise CorruptError(f"header is malformed ({exc!r})") from None
    return head, 14 + n


def _parse_trailer(mv: memoryview, segment_size: int) -> tuple[int, int, list[bytes], bytes, bytes]:
    end = len(mv)
    if end < len(MAGIC) or bytes(mv[end - len(MAGIC) :]) != MAGIC:
        raise TruncatedError("the file does not end with the trailer magic (truncated or corrupt)")
    start = _find_trailer(mv, segment_size)
    return _trailer_fields(mv[start:], start)


_TRAILER_FIXED = len(TRAILER_MAGIC) + 16 + 2 * HASH_BYTES + len(MAGIC)


def _trailer_fields(tv: memoryview, payload_len: int) -> tuple[int, int, list[bytes], bytes, bytes]:
    """(payload length, segment size, leaf hashes, id(D_v), h(v)) of the trailer bytes ``tv``,
    which must follow a payload of ``payload_len`` bytes."""
    if len(tv) < _TRAILER_FIXED:
        raise TruncatedError("the trailer is shorter than its fixed part")
    if bytes(tv[: len(TRAILER_MAGIC)]) != TRAILER_MAGIC or bytes(tv[-len(MAGIC) :]) != MAGIC:
        raise CorruptError("trailer: bad magic")
    plen, seg_size, n = struct.unpack_from("<QII", tv, len(TRAILER_MAGIC))
    if plen != payload_len or _TRAILER_FIXED + n * HASH_BYTES != len(tv):
        raise CorruptError(f"trailer: payload length {plen} / {n} segments do not fit the file")
    pos = len(TRAILER_MAGIC) + 16
    leaves = [bytes(tv[pos + i * HASH_BYTES : pos + (i + 1) * HASH_BYTES]) for i in range(n)]
    pos += n * HASH_BYTES
    return (
        plen,
        seg_size,
        leaves,
        bytes(tv[pos : pos + HASH_BYTES]),
        bytes(tv[pos + HASH_BYTES : pos + 2 * HASH_BYTES]),
    )


def _find_trailer(mv: memoryview, segment_size: int) -> int:
    """Trailer start: the last TRAILER_MAGIC whose declared payload length equals its position.

    Only the tail that could hold a trailer is searched (and copied): a file of ``len`` bytes has
    at most ``ceil(len / segment_size)`` segments, each listed with a 32-byte hash.
    """
    fixed = len(TRAILER_MAGIC) + 16 + 2 * HASH_BYTES + len(MAGIC)
    lo = max(0, len(mv) - fixed - HASH_BYTES * (len(mv) // segment_size + 1))
    tail = bytes(mv[lo:])
    pos = tail.rfind(TRAILER_MAGIC)
    while pos >= 0:
        if pos + len(TRAILER_MAGIC) + 8 <= len(tail):
            (plen,) = struct.unpack_from("<Q", tail, pos + len(TRAILER_MAGIC))
            if plen == lo + pos:
                return lo + pos
        pos = tail.rfind(TRAILER_MAGIC, 0, pos)
    raise CorruptError("no trailer found (truncated or corrupt)")


def read_delta(
    data: bytes | bytearray | memoryview,
    *,
    expected_id: str | None = None,
    expected_hash: str | None = None,
) -> Delta:
    """Parse and verify a whole delta file; raise a :class:`DeltaError` subclass on any defect."""
    return _read_delta(data, expected_id=expected_id, expected_hash=expected_hash)


def _read_delta(
    data: bytes | bytearray | memoryview,
    *,
    expected_id: str | None = None,
    expected_hash: str | None = None,
    leaves_checked: bool = False,
    trailer: bytes | None = None,
) -> Delta:
    """:func:`read_delta`; ``leaves_checked`` skips re-hashing segments that the caller (the
    :class:`Reassembler`) already checked one by one against this trailer's leaf hashes; with
    ``trailer``, ``data`` is the payload alone. The codec streams of the result are read-only
    views into ``data``."""
    mv = memoryview(data).toreadonly()
    head, pos = parse_header(mv)
    if trailer is None:
        payload_len, seg_size, leaves, delta_id, h_v = _parse_trailer(mv, head["segment_size"])
    else:
        payload_len, seg_size, leaves, delta_id, h_v = _trailer_fields(memoryview(trailer), len(mv))
    if seg_size != head["segment_size"]:
        raise CorruptError(f"trailer segment size {seg_size} != header {head['segment_size']}")
    expect_n = -(-payload_len // seg_size)
    if len(leaves) != expect_n:
        raise CorruptError(f"trailer lists {len(leaves)} segments, payload needs {expect_n}")
    for i, leaf in enumerate(() if leaves_checked else leaves):
        if leaf_hash(mv[i * seg_size : min((i + 1) * seg_size, payload_len)]) != leaf:
            raise CorruptError(f"segment {i} (bytes {i * seg_size}..) does not match its hash")
    if merkle_root(leaves) != delta_id:
        raise CorruptError("id(D_v) is not the Merkle root of the segment hashes")
    if H(bytes.fromhex(head["base_hash"]), delta_id) != h_v:
        raise CorruptError("h(v) != H(h(v-1) || id(D_v))")
    if expected_id is not None and delta_id.hex() != expected_id:
        raise CorruptError(
            f"id(D_v) {delta_id.hex()[:16]}.. is not the expected {expected_id[:16]}.."
        )
    if expected_hash is not None and h_v.hex() != expected_hash:
        raise CorruptError(f"h(v) {h_v.hex()[:16]}.. is not the expected {expected_hash[:16]}..")
    tensors = []
    payload = mv[:payload_len]
    while pos < payload_len and bytes(payload[pos : pos + 1]) == b"T":
        rec, pos = _read_frame(payload, pos, b"T", "tensor record", MAX_RECORD_BYTES)
        try:
            lens = [int(n) for n in rec["streams"]]
            shape = tuple(int(d) for d in rec["shape"])
            numel, nnz, name, codec = (
                int(rec["numel"]),
                int(rec["nnz"]),
                str(rec["name"]),
                str(rec["codec"]),
            )
            if rec.get("dtype") != "bf16" or min(lens, default=0) < 0 or not 0 < nnz <= numel:
                raise ValueError("dtype, stream length or nnz")
            if int(np.prod(shape, dtype=np.int64)) != numel:
                raise ValueError("shape does not match numel")
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptError(f"tensor record at byte {pos} is malformed ({exc!r})") from None
        c = codecs.get(codec)
        if len(lens) != c.streams:
            raise CorruptError(
                f"tensor {name}: codec {codec} has {c.streams} streams, record says {len(lens)}"
            )
        streams = []
        for n in lens:
            if pos + n > payload_len:
                raise TruncatedError(f"tensor {name}: streams run past the payload")
            streams.append(payload[pos : pos + n])  # a view: the file is not copied
            pos += n
        tensors.append(
            TensorDelta(name, shape, numel, nnz, codec, tuple(streams), parts=parts_of(rec))
        )
    table, pos = _read_frame(payload, pos, b"E", "tensor table")
    if pos != payload_len:
        raise CorruptError(f"{payload_len - pos} bytes after the tensor table")
    try:
        names = [t["name"] for t in table["tensors"]]
    except (KeyError, TypeError) as exc:
        raise CorruptError(f"tensor table is malformed ({exc!r})") from None
    if names != [t.name for t in tensors]:
        raise CorruptError("tensor table does not list the records")
    return Delta(
        head["model"],
        head["version"],
        head["base"],
        head["base_hash"],
        h_v.hex(),
        delta_id.hex(),
        seg_size,
        tuple(tensors),
        len(mv) + (len(trailer) if trailer is not None else 0),
        tuple(leaves),
    )


def segments_of(data: bytes) -> list[Segment]:
    """Cut a verified delta file back into its segments (a relay cache or the store serving)."""
    d = read_delta(data)
    key = H(data[: parse_header(data)[1]]).hex()[:32]
    payload_len = _find_trailer(memoryview(data), d.segment_size)
    out = []
    for i in range(len(d.leaves)):
        chunk = data[i * d.segment_size : min((i + 1) * d.segment_size, payload_len)]
        out.append(Segment(key, i, i * d.segment_size, chunk, d.leaves[i].hex()))
    trailer = data[payload_len:]
    out.append(Segment(key, len(d.leaves), payload_len, trailer, H(trailer).hex(), trailer=True))
    return out
