"""The delta checkpoint file: one immutable, self-verifying file per policy version.

Layout (all integers little-endian)::

    payload  = MAGIC "AURDELTA" | u16 format version | u32 n | header JSON (n bytes)
               then per changed tensor: "T" | u32 n | record JSON | codec streams
               then the table: "E" | u32 n | table JSON (name, offset, length, nnz, codec)
    trailer  = "AURTRAIL" | u64 payload length | u32 segment size | u32 segment count
               | segment count x 32-byte leaf hashes | 32-byte id(D_v) | 32-byte h(v) | "AURDELTA"

The header (model id, v, base v-1, h(v-1), segment size) is known before extraction starts, so
the payload is produced tensor by tensor and cut into fixed-size **segments** while extraction
is still running (cut-through, paper Figure 7). Each segment carries the delta key (a hash of the
header, known from the first byte), its sequence number, offset, length and checksum, the
BLAKE3 leaf hash of its bytes. The trailer lists all leaf hashes; their Merkle root *is* the
content id, ``id(D_v)``, and the weights hash chains: ``h(v) = H(h(v-1) || id(D_v))``. A receiver
that knows ``h(v)`` or ``id(D_v)`` from the Ledger can verify any segment from any untrusted
relay or peer; the whole delta is verified before it can be staged.

Apply is transactional: every record is decoded and checked against the target layout, and the
base version and h(base) are checked, before the first byte of the weights is written. A chain
``D_{va+1..v}`` is checked link by link first and applied with an undo log.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import struct
import tempfile
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import blake3
import numpy as np

from aurora.delta import arena as arena_mod
from aurora.delta import codecs
from aurora.delta.errors import (
    BadMagicError,
    BaseMismatchError,
    CorruptError,
    DeltaError,
    ForeignSegmentError,
    LayoutError,
    TruncatedError,
    UnsupportedFormatError,
)
from aurora.delta.extract import (
    FusedTensor,
    changed_fused,
    fused_layout,
    gather_fused,
    scatter_fused,
)

MAGIC = b"AURDELTA"
TRAILER_MAGIC = b"AURTRAIL"
FORMAT_VERSION = 2
"""2: every hash is BLAKE3-256 (1: BLAKE2b-256, which verified at 0.87 GB/s on one core here against
BLAKE3's 4.3 GB/s, too slow for a receiver to keep up with a 10 Gbps link)."""
DEFAULT_SEGMENT_SIZE = 4 << 20
"""4 MiB: small enough to cut through a relay within ~30 ms at 1 Gbps, large enough that per-segment
overhead (a 32-byte hash and a frame header) is negligible."""
HASH_BYTES = 32
SMALL_TENSOR_NNZ = 4096
"""Below this many changes the writer also tries ``leb128`` and keeps the smaller encoding: zstd
frames cost ~10 bytes each, which dominates tiny tensors (norms, biases)."""


def H(*parts: bytes | memoryview) -> bytes:
    """BLAKE3-256 of the concatenated parts (a cryptographic hash, so a segment that matches the
    trailer of a delta whose id(D_v) the Ledger published is the one the Trainer wrote)."""
    h = blake3.blake3()
    for p in parts:
        h.update(p)
    return h.digest(HASH_BYTES)


def leaf_hash(data: bytes | memoryview) -> bytes:
    return H(b"\x00", data)


def merkle_root(leaves: Sequence[bytes]) -> bytes:
    """Root over leaf hashes (an odd node is promoted); the root of no leaves is H(b"")."""
    level = list(leaves)
    if not level:
        return H(b"")
    while len(level) > 1:
        nxt = [H(b"\x01", level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def chain_hash(base_hash: str, delta_id: str) -> str:
    """h(v) = H(h(v-1) || id(D_v)), as hex."""
    return H(bytes.fromhex(base_hash), bytes.fromhex(delta_id)).hex()


def weights_hash(state: Mapping[str, np.ndarray]) -> str:
    """h of a snapshot: the hash of its canonical bytes (names sorted; name, shape, bits)."""
    # AUTO: a multi-GB snapshot is hashed on every core (the Trainer hashes each one it writes).
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for name in sorted(state):
        arr = np.ascontiguousarray(state[name]).view(np.uint16)
        h.update(json.dumps([name, list(state[name].shape)]).encode())
        h.update(arr.reshape(-1).view(np.uint8))
    return h.hexdigest(HASH_BYTES)


# ------------------------------------------------------------------------------------------
# Records
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """One independently verifiable piece of a delta in flight."""

    key: str
    """Hash of the delta's header: the same for every segment of one delta."""
    seq: int
    """0..n-1 for payload segments; n for the trailer."""
    offset: int
    """Byte offset of ``data`` in the payload (the payload length for the trailer)."""
    data: bytes | bytearray | memoryview
    """The bytes (a view into the receiver's arena when received in place)."""
    checksum: str
    """Leaf hash of ``data`` (payload segments; for the trailer, H(trailer bytes))."""
    trailer: bool = False

    @property
    def length(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class TensorDelta:
    name: str
    """Engine (fused) name."""
    shape: tuple[int, ...]
    numel: int
    nnz: int
    codec: str
    streams: tuple[bytes | memoryview, ...]
    """The codec's byte streams (read-only views into the file when parsed from one)."""

    @property
    def nbytes(self) -> int:
        return sum(len(s) for s in self.streams)


@dataclass(frozen=True)
class Delta:
    """A parsed, fully verified delta checkpoint."""

    model: str
    version: int
    base: int
    base_hash: str
    weights_hash: str
    """h(version)."""
    id: str
    """id(D_v): Merkle root of the payload segments."""
    segment_size: int
    tensors: tuple[TensorDelta, ...]
    size: int
    """Bytes of the whole file."""
    leaves: tuple[bytes, ...] = field(repr=False)


# ------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------


def _frame(tag: bytes, obj: object) -> bytes:
    body = json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()
    return tag + struct.pack("<I", len(body)) + body


def header_bytes(
    *, model: str, version: int, base: int, base_hash: str, segment_size: int
) -> bytes:
    if version != base + 1:
        raise ValueError(f"a delta goes from v-1 to v: version {version} with base {base}")
    if len(bytes.fromhex(base_hash)) != HASH_BYTES:
        raise ValueError(f"base_hash must be {HASH_BYTES} bytes of hex, got {base_hash!r}")
    if segment_size < 1024:
        raise ValueError(f"segment_size must be >= 1024 bytes, got {segment_size}")
    head = {
        "model": model,
        "version": version,
        "base": base,
        "base_hash": base_hash,
        "segment_size": segment_size,
    }
    body = json.dumps(head, separators=(",", ":"), sort_keys=True).encode()
    return MAGIC + struct.pack("<HI", FORMAT_VERSION, len(body)) + body


def encode_tensor(
    tensor: FusedTensor,
    idx: np.ndarray,
    new: np.ndarray,
    old: np.ndarray,
    codec: str,
) -> TensorDelta:
    """Encode one tensor's change (``old``: the base bits at ``idx``); tiny ones fall back to
    ``leb128`` when that is smaller."""
    chosen = codecs.get(codec)
    streams = chosen.encode(idx, new, old, tensor.numel)
    if idx.size < SMALL_TENSOR_NNZ and chosen.name in ("aurora", "aurora-base"):
        alt = codecs.CODECS["leb128"].encode(idx, new, old, tensor.numel)
        if sum(map(len, alt)) < sum(map(len, streams)):
            chosen, streams = codecs.CODECS["leb128"], alt
    return TensorDelta(
        tensor.name, tensor.shape, tensor.numel, int(idx.size), chosen.name, tuple(streams)
    )


def _record_bytes(t: TensorDelta) -> bytes:
    rec = {
        "name": t.name,
        "shape": list(t.shape),
        "dtype": "bf16",
        "numel": t.numel,
        "nnz": t.nnz,
        "codec": t.codec,
        "streams": [len(s) for s in t.streams],
    }
    return _frame(b"T", rec) + b"".join(t.streams)


class DeltaEncoder:
    """Produces ``D_v`` as segments while it extracts, tensor by tensor (cut-through).

    ``old`` and ``new`` map split (transformers) names to bf16 tensors as uint16 arrays. Iterate
    :meth:`segments` to stream; the last segment is the trailer. Afterwards :attr:`delta_id`
    and :attr:`weights_hash` hold id(D_v) and h(v).
    """

    def __init__(
        self,
        old: Mapping[str, np.ndarray],
        new: Mapping[str, np.ndarray],
        *,
        model: str,
        version: int,
        base_hash: str,
        codec: str = codecs.DEFAULT_CODEC,
        fuse: bool = True,
        segment_size: int = DEFAULT_SEGMENT_SIZE,
    ) -> None:
        codecs.get(codec)  # unknown codec: fail before any work
        if set(old) != set(new):
            raise ValueError(f"old and new weights differ in names: {sorted(set(old) ^ set(new))}")
        self.old, self.new, self.codec = old, new, codec
        self.layout = fused_layout({k: tuple(v.shape) for k, v in new.items()}, fuse=fuse)
        self.header = header_bytes(
            model=model,
            version=version,
            base=version - 1,
            base_hash=base_hash,
            segment_size=segment_size,
        )
        self.key = H(self.header).hex()[:32]
        self.segment_size = segment_size
        self.base_hash = base_hash
        self.delta_id: str | None = None
        self.weights_hash: str | None = None
        self.tensors: list[TensorDelta] = []

    def _payload_pieces(self) -> Iterator[bytes]:
        yield self.header
        offset = len(self.header)
        table = []
        for t in self.layout:
            idx, new = changed_fused(t, self.old, self.new)
            if idx.size == 0:
                continue
            td = encode_tensor(t, idx, new, gather_fused(t, self.old, idx), self.codec)
            self.tensors.append(td)
            rec = _record_bytes(td)
            table.append(
                {
                    "name": td.name,
                    "offset": offset,
                    "length": len(rec),
                    "nnz": td.nnz,
                    "codec": td.codec,
                }
            )
            offset += len(rec)
            yield rec
        yield _frame(b"E", {"tensors": table})

    def segments(self) -> Iterator[Segment]:
        buf = bytearray()
        seq = offset = 0
        leaves: list[bytes] = []

        def cut(data: bytes) -> Segment:
            nonlocal seq, offset
            leaf = leaf_hash(data)
            leaves.append(leaf)
            seg = Segment(self.key, seq, offset, data, leaf.hex())
            seq += 1
            offset += len(data)
            return seg

        for piece in self._payload_pieces():
            buf += piece
            while len(buf) >= self.segment_size:
                yield cut(bytes(buf[: self.segment_size]))
                del buf[: self.segment_size]
        if buf:
            yield cut(bytes(buf))
        delta_id = merkle_root(leaves)
        h_v = H(bytes.fromhex(self.base_hash), delta_id)
        trailer = (
            TRAILER_MAGIC
            + struct.pack("<QII", offset, self.segment_size, len(leaves))
            + b"".join(leaves)
            + delta_id
            + h_v
            + MAGIC
        )
        self.delta_id, self.weights_hash = delta_id.hex(), h_v.hex()
        yield Segment(self.key, seq, offset, trailer, H(trailer).hex(), trailer=True)


def encode_delta(
    old: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray], **kw: object
) -> bytes:
    """The whole delta file as bytes (see :class:`DeltaEncoder` for the arguments)."""
    enc = DeltaEncoder(old, new, **kw)  # type: ignore[arg-type]
    return b"".join(s.data for s in enc.segments())


def write_atomic(path: str | os.PathLike[str], chunks: Iterable[bytes]) -> None:
    """Write to a temporary file beside ``path``, fsync, rename: readers see all or nothing."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_delta(
    path: str | os.PathLike[str],
    old: Mapping[str, np.ndarray],
    new: Mapping[str, np.ndarray],
    **kw: object,
) -> DeltaEncoder:
    """Encode and write ``D_v`` atomically; returns the encoder (ids, hashes, tensors)."""
    enc = DeltaEncoder(old, new, **kw)  # type: ignore[arg-type]
    write_atomic(path, (s.data for s in enc.segments()))
    return enc


# ------------------------------------------------------------------------------------------
# Reading and verifying
# ------------------------------------------------------------------------------------------


def _read_frame(buf: memoryview, pos: int, tag: bytes, what: str) -> tuple[dict, int]:  # type: ignore[type-arg]
    if pos + 5 > len(buf):
        raise TruncatedError(f"{what}: ends at byte {len(buf)}, frame needs {pos + 5}")
    if bytes(buf[pos : pos + 1]) != tag:
        raise CorruptError(f"{what}: expected frame {tag!r} at byte {pos}")
    (n,) = struct.unpack_from("<I", buf, pos + 1)
    end = pos + 5 + n
    if end > len(buf):
        raise TruncatedError(f"{what}: frame of {n} bytes at {pos} runs past the end")
    try:
        obj = json.loads(bytes(buf[pos + 5 : end]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptError(f"{what}: frame at byte {pos} is not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise CorruptError(f"{what}: frame at byte {pos} is not an object")
    return obj, end


def parse_header(buf: bytes | memoryview) -> tuple[dict, int]:  # type: ignore[type-arg]
    mv = memoryview(buf)
    if len(mv) < len(MAGIC) or bytes(mv[: len(MAGIC)]) != MAGIC:
        raise BadMagicError(f"not a delta checkpoint: starts with {bytes(mv[:8])!r}, not {MAGIC!r}")
    if len(mv) < 14:
        raise TruncatedError(f"header: {len(mv)} bytes, the fixed part needs 14")
    fmt, n = struct.unpack_from("<HI", mv, 8)
    if fmt != FORMAT_VERSION:
        raise UnsupportedFormatError(f"format version {fmt}; this code reads {FORMAT_VERSION}")
    if 14 + n > len(mv):
        raise TruncatedError(f"header of {n} bytes runs past the end ({len(mv)} bytes)")
    try:
        head = json.loads(bytes(mv[14 : 14 + n]))
        head = {k: head[k] for k in ("model", "version", "base", "base_hash", "segment_size")}
        if not (
            isinstance(head["version"], int)
            and isinstance(head["base"], int)
            and isinstance(head["segment_size"], int)
            and head["segment_size"] >= 1024
            and isinstance(head["base_hash"], str)
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
        rec, pos = _read_frame(payload, pos, b"T", "tensor record")
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
        tensors.append(TensorDelta(name, shape, numel, nnz, codec, tuple(streams)))
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


def read_delta_file(path: str | os.PathLike[str], **kw: str) -> Delta:
    return read_delta(Path(path).read_bytes(), **kw)


# ------------------------------------------------------------------------------------------
# Reassembly of segments (any order, duplicates, untrusted sources)
# ------------------------------------------------------------------------------------------


class Reassembler:
    """Collects the segments of one delta in any order and yields it only when verified.

    Payload segments are placed at their offsets in one contiguous arena
    (:mod:`aurora.delta.arena`), so :meth:`result` parses the payload where it lies; the trailer
    (32 bytes a segment) is kept apart. A receiver that asks :meth:`slot` for the view a segment
    belongs in can have the socket write the bytes straight there; :meth:`add` then verifies them
    in place. Bytes that arrive elsewhere (a test, a store) are verified first and then copied in.
    A slot is exclusively its receiver's until it is added or :meth:`abandon`-ed, verified bytes
    are never written again, and once the trailer is in only the slots it lists are handed out,
    so a duplicate, a re-fetch racing the original or a forged offset can never change what was
    verified, nor keep the delta from completing once the forged bytes are refused.

    ``expected_id`` / ``expected_hash`` (from the Ledger) make segments from untrusted relays
    safe: once the trailer is in, every segment is checked against the trailer's leaf hashes,
    and the trailer against ``id(D_v)`` / ``h(v)``. A segment that fails is dropped and reported
    by the exception; :meth:`missing` lists what to fetch again.
    """

    def __init__(
        self,
        *,
        key: str | None = None,
        expected_id: str | None = None,
        expected_hash: str | None = None,
        arena: memoryview | None = None,
    ) -> None:
        self.key = key
        self.expected_id, self.expected_hash = expected_id, expected_hash
        self._arena = arena
        """Writable bytes the file is assembled in (reserved on first use when not given)."""
        self._held: dict[int, tuple[int, int]] = {}
        """Verified payload segments: seq -> (offset, length) in the arena."""
        self._leaf: dict[int, bytes] = {}
        """Leaf hash of each held segment, computed once on arrival."""
        self._regions: dict[int, int] = {}
        """Arena ranges held or handed out as slots: start -> end (never overlapping)."""
        self._starts: list[int] = []
        """Sorted keys of ``_regions``."""
        self._slots: dict[int, tuple[memoryview, int]] = {}
        """Slots handed out and not yet added or abandoned: offset -> (view, seq)."""
        self._trailer: tuple[int, int, list[bytes]] | None = None
        """(payload length, segment size, leaf hashes) from the verified trailer."""
        self._trailer_bytes: bytes | None = None

    # -- arena bookkeeping -----------------------------------------------------------------

    def _buffer(self) -> memoryview:
        if self._arena is None:
            self._arena = arena_mod.arena()
        return self._arena

    def _free(self, start: int, end: int) -> bool:
        if start < 0 or end > len(self._buffer()) or end <= start:
            return False
        i = bisect.bisect_right(self._starts, start)
        if i > 0 and self._regions[self._starts[i - 1]] > start:
            return False
        return not (i < len(self._starts) and self._starts[i] < end)

    def _claim(self, start: int, end: int) -> None:
        bisect.insort(self._starts, start)
        self._regions[start] = end

    def _release(self, start: int) -> None:
        del self._regions[start]
        self._starts.remove(start)

    def slot(
        self, key: str, seq: int, offset: int, length: int, trailer: bool
    ) -> memoryview | None:
        """Where to receive a segment announced as (key, seq, offset, length): a writable view
        of the arena that is this caller's until :meth:`add` or :meth:`abandon`; None when the
        segment is held already, its range is taken (another receiver is filling it, or it
        overlaps held bytes) or it is foreign: receive it elsewhere and :meth:`add` it (it will be
        dropped as a duplicate or refused)."""
        if trailer or (self.key is not None and key != self.key) or seq in self._held:
            return None
        if self._trailer is not None:
            plen, seg_size, leaves = self._trailer
            if not 0 <= seq < len(leaves) or (offset, length) != (
                seq * seg_size,
                min(seg_size, plen - seq * seg_size),
            ):
                return None  # not a segment of this delta: receive it elsewhere, to be refused
        if not self._free(offset, offset + length):
            return None
        self._claim(offset, offset + length)
        view = self._buffer()[offset : offset + length]
        self._slots[offset] = (view, seq)
        return view

    def abandon(self, view: memoryview) -> None:
        """Give back a slot whose segment will not be added (its connection broke)."""
        for offset, (v, _) in list(self._slots.items()):
            if v is view:
                del self._slots[offset]
                self._release(offset)

    # -- adding ------------------------------------------------------------------------------

    def add(self, seg: Segment) -> bool:
        """Add a segment; returns True when the delta is complete. Raises on a bad segment."""
        if self.key is None:
            self.key = seg.key
        if seg.key != self.key:
            raise ForeignSegmentError(
                f"segment {seg.seq} belongs to delta {seg.key[:12]}.., not {self.key[:12]}.."
            )
        if seg.trailer:
            with contextlib.suppress(_Duplicate):
                self._add_trailer(seg)
            return self.complete
        end = seg.offset + len(seg.data)
        in_place = seg.offset in self._slots and self._slots[seg.offset][0] is seg.data
        if in_place:
            del self._slots[seg.offset]
        try:
            self._add_payload(seg, in_place)
        except _Duplicate:
            return self.complete
        except DeltaError:
            if in_place:
                self._release(seg.offset)  # its bytes are garbage: the slot can be filled again
            raise
        if not in_place:
            self._claim(seg.offset, end)
            self._buffer()[seg.offset : end] = seg.data
        return self.complete

    def _check_place(self, seg: Segment) -> None:
        """A segment received elsewhere may be copied in only where nothing else is; a copy of
        one that another receiver is filling right now is a duplicate."""
        filling = self._slots.get(seg.offset)
        if filling is not None and filling[1] == seg.seq and len(filling[0]) == len(seg.data):
            raise _Duplicate
        if not self._free(seg.offset, seg.offset + len(seg.data)):
            raise CorruptError(
                f"segment {seg.seq} (bytes {seg.offset}..{seg.offset + len(seg.data)}) overlaps "
                "bytes held or being received, or lies outside the arena"
            )

    def _add_payload(self, seg: Segment, in_place: bool) -> None:
        if not in_place and seg.seq in self._held:
            off, n = self._held[seg.seq]
            if (off, n) != (seg.offset, len(seg.data)) or self._buffer()[off : off + n] != seg.data:
                raise CorruptError(f"segment {seg.seq}: a second, different copy")
            raise _Duplicate
        if not in_place:
            self._check_place(seg)  # before hashing: a copy of one being received is dropped
        leaf = leaf_hash(seg.data)  # once: the dominant cost of receiving
        if leaf.hex() != seg.checksum:
            raise CorruptError(f"segment {seg.seq}: data does not match its checksum")
        if self._trailer is not None:
            self._check_against_trailer(seg.seq, seg.offset, leaf)
        self._held[seg.seq] = (seg.offset, len(seg.data))
        self._leaf[seg.seq] = leaf

    def _add_trailer(self, seg: Segment) -> None:
        """Verify and take the trailer, and drop the held segments it refutes."""
        if self._trailer_bytes is not None:
            if self._trailer_bytes != seg.data:
                raise CorruptError("trailer: a second, different copy")
            raise _Duplicate
        if H(seg.data).hex() != seg.checksum:
            raise CorruptError("trailer: data does not match its checksum")
        mv = memoryview(seg.data)
        fixed = len(TRAILER_MAGIC) + 16 + 2 * HASH_BYTES + len(MAGIC)
        if len(mv) < fixed or bytes(mv[:8]) != TRAILER_MAGIC or bytes(mv[-8:]) != MAGIC:
            raise CorruptError("trailer: bad magic or too short")
        plen, seg_size, n = struct.unpack_from("<QII", mv, 8)
        if (
            len(mv) != fixed + n * HASH_BYTES
            or plen != seg.offset
            or seg_size < 1024
            or n != -(-plen // seg_size)
            or n != seg.seq
        ):
            raise CorruptError("trailer: lengths do not add up")
        leaves = [bytes(mv[24 + i * HASH_BYTES : 24 + (i + 1) * HASH_BYTES]) for i in range(n)]
        delta_id = bytes(mv[24 + n * HASH_BYTES : 24 + (n + 1) * HASH_BYTES])
        if merkle_root(leaves) != delta_id:
            raise CorruptError("trailer: id(D_v) is not the Merkle root of its segment hashes")
        if self.expected_id is not None and delta_id.hex() != self.expected_id:
            raise CorruptError("trailer: id(D_v) is not the one the Ledger published")
        if self.expected_hash is not None:
            h_v = bytes(mv[24 + (n + 1) * HASH_BYTES : 24 + (n + 2) * HASH_BYTES])
            if h_v.hex() != self.expected_hash:
                raise CorruptError("trailer: h(v) is not the one the Ledger published")
        self._trailer = (plen, seg_size, leaves)
        self._trailer_bytes = bytes(seg.data)
        bad = []
        for seq, (off, _) in list(self._held.items()):
            try:
                self._check_against_trailer(seq, off, self._leaf[seq])
            except CorruptError:
                del self._held[seq], self._leaf[seq]
                self._release(off)
                bad.append(seq)
        if bad:
            raise CorruptError(f"segments {bad} do not match the trailer; fetch them again")

    def _check_against_trailer(self, seq: int, offset: int, leaf: bytes) -> None:
        assert self._trailer is not None
        plen, seg_size, leaves = self._trailer
        if not (0 <= seq < len(leaves)) or offset != seq * seg_size or leaf != leaves[seq]:
            raise CorruptError(f"segment {seq} does not match the trailer's hash for it")

    def holds(self, seq: int, *, trailer: bool = False) -> bool:
        """Whether segment ``seq`` (or the trailer) is verified and held."""
        if trailer:
            return self._trailer is not None and seq == len(self._trailer[2])
        return seq in self._held

    @property
    def complete(self) -> bool:
        return self._trailer is not None and len(self._held) == len(self._trailer[2])

    def missing(self) -> list[int]:
        """Sequence numbers still needed (the trailer is ``-1`` while it is unknown)."""
        if self._trailer is None:
            return [-1]
        return [i for i in range(len(self._trailer[2])) if i not in self._held]

    def result(self) -> Delta:
        """The verified delta, parsed in place: its streams are views into the arena."""
        if not self.complete:
            raise TruncatedError(f"delta incomplete: missing segments {self.missing()[:10]}")
        assert self._trailer is not None and self._trailer_bytes is not None
        # Every part was checked against the trailer's leaf hashes as it came in (and the
        # trailer against its Merkle root): only the structure is left to verify.
        return _read_delta(
            self._buffer()[: self._trailer[0]],
            expected_id=self.expected_id,
            expected_hash=self.expected_hash,
            leaves_checked=True,
            trailer=self._trailer_bytes,
        )


class _Duplicate(Exception):
    """A copy of a segment already held (internal: :meth:`Reassembler.add` ignores it)."""


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


# ------------------------------------------------------------------------------------------
# Apply
# ------------------------------------------------------------------------------------------


def _targets(
    delta: Delta, state: Mapping[str, np.ndarray]
) -> list[tuple[TensorDelta, FusedTensor]]:
    engine = {
        t.name: t for t in fused_layout({k: tuple(v.shape) for k, v in state.items()}, fuse=False)
    }
    fused = {
        t.name: t for t in fused_layout({k: tuple(v.shape) for k, v in state.items()}, fuse=True)
    }
    out = []
    for td in delta.tensors:
        target = engine.get(td.name) or fused.get(td.name)
        if target is None:
            raise LayoutError(f"tensor {td.name} of the delta is not in the target weights")
        if target.numel != td.numel or target.shape != td.shape:
            raise LayoutError(f"tensor {td.name}: delta shape {td.shape}, target {target.shape}")
        for p in target.parts:
            arr = state[p.name]
            if arr.dtype.itemsize != 2:
                raise LayoutError(
                    f"tensor {p.name}: target is {arr.dtype}, not 16-bit (bf16) storage"
                )
        out.append((td, target))
    return out


class _BaseGather:
    """``base[idx]`` of a (possibly fused) tensor straight from the split state: base-relative
    codecs only read the changed positions, so the fused tensor is never materialised."""

    def __init__(self, target: FusedTensor, state: Mapping[str, np.ndarray]) -> None:
        self.target, self.state = target, state

    def __getitem__(self, idx: np.ndarray) -> np.ndarray:
        return gather_fused(self.target, self.state, idx)


def decode_delta(
    delta: Delta, state: Mapping[str, np.ndarray]
) -> list[tuple[FusedTensor, np.ndarray, np.ndarray]]:
    """Decode every tensor of ``delta`` against ``state`` (read only): [(target, idx, bits)]."""
    out = []
    for td, target in _targets(delta, state):
        c = codecs.get(td.codec)
        base = _BaseGather(target, state) if c.needs_base else None
        idx, bits = c.decode(list(td.streams), td.nnz, td.numel, base, td.name)  # type: ignore[arg-type]
        if idx.size != td.nnz or bits.size != td.nnz:
            raise CorruptError(
                f"tensor {td.name}: decoded {idx.size} changes, header says {td.nnz}"
            )
        out.append((target, idx, bits))
    return out


def apply_delta(
    delta: Delta, state: MutableMapping[str, np.ndarray], *, active_version: int, active_hash: str
) -> str:
    """Apply ``delta`` in place to ``state`` (uint16 views of bf16 weights); return h(v).

    Checks the base version and hash and decodes everything before writing anything.
    """
    if delta.base != active_version:
        raise BaseMismatchError(
            f"D_{delta.version} is based on v{delta.base}; the target is on v{active_version}"
        )
    if delta.base_hash != active_hash:
        raise BaseMismatchError(
            f"D_{delta.version} is based on h={delta.base_hash[:16]}..; "
            f"the target has h={active_hash[:16]}.."
        )
    decoded = decode_delta(delta, state)
    for target, idx, bits in decoded:
        scatter_fused(target, state, idx, bits)
    return delta.weights_hash


def apply_chain(
    deltas: Sequence[Delta],
    state: MutableMapping[str, np.ndarray],
    *,
    active_version: int,
    active_hash: str,
) -> str:
    """Apply ``D_{va+1..v}`` in order; all links are checked first, and an undo log restores the
    weights if any step fails, so the chain applies whole or not at all. Returns h(v)."""
    version, h = active_version, active_hash
    for d in deltas:
        if d.base != version or d.base_hash != h:
            raise BaseMismatchError(
                f"chain broken at D_{d.version}: based on v{d.base}, previous is v{version}"
            )
        _targets(d, state)
        version, h = d.version, d.weights_hash
    undo: list[tuple[FusedTensor, np.ndarray, np.ndarray]] = []
    version, h = active_version, active_hash
    try:
        for d in deltas:
            decoded = decode_delta(d, state)
            for target, idx, _ in decoded:
                undo.append((target, idx, gather_fused(target, state, idx)))
            h = apply_delta(d, state, active_version=version, active_hash=h)
            version = d.version
    except DeltaError:
        for target, idx, old in reversed(undo):
            scatter_fused(target, state, idx, old)
        raise
    return h
