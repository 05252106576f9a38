"""Signed announcements: the one thing a node believes about a version (docs/ARCHITECTURE.md,
"Trust").

Relays, peers, the Checkpoint Store and the network are untrusted; only the Trainer's Ed25519
signing key is. The Trainer signs a :class:`VersionAnnouncement` for every version it publishes and
a :class:`SnapshotAnnouncement` for every snapshot; anyone may carry the signed bytes, anyone with
the job's public key verifies them (:func:`verify`). A node stages ``D_v`` only if the bytes it
reassembled hash to the announced ``id(D_v)`` (the Merkle root over the segments' BLAKE3 leaves,
:mod:`aurora.delta.hashing`), so forging a delta means forging an Ed25519 signature or a BLAKE3
collision, whoever relayed the bytes. Each record has one canonical encoding (little-endian, fixed
layout, ``MAGIC`` first; the ``canonical`` methods give it), followed on the wire by the 64-byte
signature. Ed25519 comes from ``cryptography`` (OpenSSL; never hand-rolled). This module is pure:
bytes and raw 32-byte keys in, records and bytes out; key files live in :mod:`aurora.keys`.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from aurora.delta.errors import DeltaError
from aurora.delta.hashing import HASH_BYTES, H, chain_hash
from aurora.delta.reader import _trailer_fields, parse_header
from aurora.delta.records import TRAILER_MAGIC

__all__ = [
    "KEY_HEX",
    "SIGNATURE_BYTES",
    "Announcement",
    "AnnouncementError",
    "BadSignatureError",
    "MalformedAnnouncementError",
    "SnapshotAnnouncement",
    "VersionAnnouncement",
    "WrongJobError",
    "delta_key",
    "describe_delta",
    "describe_parts",
    "public_key_of",
    "sign",
    "sign_bytes",
    "trailer_bytes",
    "verify",
    "verify_bytes",
]

MAGIC = b"AURANN01"
KIND_DELTA, KIND_SNAPSHOT = 1, 2
SIGNATURE_BYTES = 64
"""An Ed25519 signature."""
KEY_BYTES = 32
"""An Ed25519 private key (its seed) or public key, raw."""
KEY_HEX = 32
"""Hex characters of a delta's transfer key (the first 16 bytes of H(header))."""
MAX_JOB_CHARS = 128
_JOB = re.compile(r"^[\x21-\x7e]{1,128}$")
"""A job id: 1-128 printable ASCII characters, no spaces."""
MAX_ANNOUNCEMENT_BYTES = 512
"""No valid announcement is longer (bytes): a parser refuses longer input before reading it."""
_TRAILER_FIXED = len(TRAILER_MAGIC) + 16 + 2 * HASH_BYTES + 8
_U64 = 1 << 64
_DELTA_TAIL = struct.Struct(f"<QQ{HASH_BYTES}s16s{HASH_BYTES}s{HASH_BYTES}sQII")
_SNAPSHOT_TAIL = struct.Struct(f"<Q{HASH_BYTES}s{HASH_BYTES}sQ{HASH_BYTES}s")


class AnnouncementError(DeltaError):
    """An announcement that is not believed; the message says why, in one line."""


class MalformedAnnouncementError(AnnouncementError):
    """Bytes that are not an announcement (wrong magic, kind, length or field)."""


class BadSignatureError(AnnouncementError):
    """Not signed by the job's Trainer key (another key, or altered after signing)."""


class WrongJobError(AnnouncementError):
    """Validly signed, but for another job."""


def _hex(value: object, nbytes: int, what: str) -> bytes:
    if not isinstance(value, str) or len(value) != 2 * nbytes:
        raise MalformedAnnouncementError(f"{what} must be {2 * nbytes} hex characters")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise MalformedAnnouncementError(f"{what} is not hex: {value[:20]!r}") from None


def _uint(value: object, limit: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
        raise MalformedAnnouncementError(
            f"{what} must be an integer in [0, {limit}), got {value!r}"
        )
    return value


def _job(value: object) -> bytes:
    if not isinstance(value, str) or not _JOB.match(value):
        raise MalformedAnnouncementError(
            f"job id must be 1-{MAX_JOB_CHARS} printable ASCII characters, got {str(value)[:40]!r}"
        )
    return value.encode("ascii")


def trailer_bytes(segments: int) -> int:
    """Length of the trailer of a delta with ``segments`` payload segments (bytes)."""
    return _TRAILER_FIXED + segments * HASH_BYTES


@dataclass(frozen=True, kw_only=True)
class VersionAnnouncement:
    """What the Trainer says ``D_version`` is: job id, ``v``, base ``v-1``, ``h(v-1)``, the transfer
    key its segments carry, ``id(D_v)``, ``h(v)``, the file's size, segment count and segment size.

    Beyond the fields the design lists (docs/ARCHITECTURE.md), it carries the *transfer key* (the
    hash of the delta's header that every segment is tagged with) and the *segment size*: with
    them a receiver knows, before any byte of ``D_v`` arrives, which segments exist (seq, offset,
    length) and can drop anything else on sight, so a source can neither make it hold more than
    the announced size nor make it hash a trailer that claims a terabyte."""

    job: str
    """The job's id: an announcement of another job is refused."""
    version: int
    """v."""
    base: int
    """v-1: the version the delta applies to."""
    base_hash: str
    """h(v-1), hex."""
    key: str
    """The transfer key every segment of ``D_v`` carries (H(header), first 16 bytes, hex)."""
    delta_id: str
    """id(D_v): the Merkle root over the segments' leaf hashes, hex."""
    weights_hash: str
    """h(v) = H(h(v-1) || id(D_v)), hex."""
    size: int
    """Bytes of the whole file (payload and trailer)."""
    segments: int
    """Payload segments (the trailer is one more, with seq = ``segments``)."""
    segment_size: int
    """Bytes of every payload segment but the last."""

    def __post_init__(self) -> None:
        _job(self.job)
        _uint(self.version, _U64, "version")
        _uint(self.base, _U64, "base")
        if self.version != self.base + 1:
            raise MalformedAnnouncementError(
                f"a delta goes from v-1 to v: version {self.version} with base {self.base}"
            )
        _hex(self.base_hash, HASH_BYTES, "base_hash")
        _hex(self.key, KEY_HEX // 2, "key")
        _hex(self.delta_id, HASH_BYTES, "delta_id")
        _hex(self.weights_hash, HASH_BYTES, "weights_hash")
        _uint(self.size, _U64, "size")
        _uint(self.segments, 1 << 32, "segments")
        _uint(self.segment_size, 1 << 32, "segment_size")
        if self.weights_hash != chain_hash(self.base_hash, self.delta_id):
            raise MalformedAnnouncementError("weights_hash is not H(base_hash || delta_id)")
        payload = self.size - trailer_bytes(self.segments)
        if (
            self.segment_size < 1024
            or payload < 1
            or self.segments != -(-payload // self.segment_size)
        ):
            raise MalformedAnnouncementError(
                f"size {self.size}, {self.segments} segments of {self.segment_size} bytes "
                "do not describe a delta file"
            )

    @property
    def payload_bytes(self) -> int:
        """Bytes before the trailer (the header, tensor records and table)."""
        return self.size - trailer_bytes(self.segments)

    def segment_range(self, seq: int) -> tuple[int, int]:
        """(offset, length) of payload segment ``seq``, or of the trailer for ``seq ==
        segments``; ValueError for any other seq."""
        if 0 <= seq < self.segments:
            offset = seq * self.segment_size
            return offset, min(self.segment_size, self.payload_bytes - offset)
        if seq == self.segments:
            return self.payload_bytes, trailer_bytes(self.segments)
        raise ValueError(f"D_{self.version} has no segment {seq} (it has {self.segments})")

    def canonical(self) -> bytes:
        """The bytes that are signed (little-endian, fixed layout, one encoding per record)::

            "AURANN01" | u8 kind (1 delta, 2 snapshot) | u8 n | job id (n ASCII bytes) | u64 v
            delta:     | u64 base | 32 h(v-1) | 16 key | 32 id(D_v) | 32 h(v) | u64 size
                       | u32 segments | u32 segment size
            snapshot:  | 32 h(snapshot) | 32 h(v) | u64 size | 32 h(manifest)

        and on the wire the 64-byte Ed25519 signature follows."""
        job = _job(self.job)
        return (
            MAGIC
            + bytes((KIND_DELTA, len(job)))
            + job
            + _DELTA_TAIL.pack(
                self.version,
                self.base,
                bytes.fromhex(self.base_hash),
                bytes.fromhex(self.key),
                bytes.fromhex(self.delta_id),
                bytes.fromhex(self.weights_hash),
                self.size,
                self.segments,
                self.segment_size,
            )
        )

    def describe(self) -> str:
        return f"D_{self.version} (id {self.delta_id[:12]}.., {self.size} bytes)"


@dataclass(frozen=True, kw_only=True)
class SnapshotAnnouncement:
    """What the Trainer says the snapshot of ``version`` is: job id, ``v``, ``h(snapshot)`` (the
    hash of the weights' canonical bytes), the chain hash ``h(v)`` that the deltas after the
    snapshot are based on, the file's size and ``h(manifest)``.

    It carries the chain hash because ``h(snapshot)`` (a hash of the weights) and ``h(v)`` (a hash
    chain over the deltas) are different values: a joiner needs the second to check the base of
    ``D_{v+1}``. It signs ``h(manifest)``, the hash of the model's other files (config, tokenizer,
    chat template: :mod:`aurora.store.manifest`), so the whole model is pinned, not only its
    weights. Its canonical layout is in :meth:`VersionAnnouncement.canonical`."""

    job: str
    """The job's id."""
    version: int
    """v: the version whose weights the snapshot holds."""
    weights_hash: str
    """h(snapshot): :func:`aurora.delta.hashing.weights_hash` of the weights, hex."""
    chain_hash: str
    """h(v) of the delta chain at ``version``: the base hash ``D_{version+1}`` names."""
    size: int
    """Bytes of the snapshot file."""
    model_hash: str
    """h(manifest): the hash of the canonical bytes of the manifest of the model's files other
    than its weights (:func:`aurora.store.manifest.digest`), hex."""

    def __post_init__(self) -> None:
        _job(self.job)
        _uint(self.version, _U64, "version")
        _hex(self.weights_hash, HASH_BYTES, "weights_hash")
        _hex(self.chain_hash, HASH_BYTES, "chain_hash")
        _uint(self.size, _U64, "size")
        _hex(self.model_hash, HASH_BYTES, "model_hash")

    def canonical(self) -> bytes:
        job = _job(self.job)
        return (
            MAGIC
            + bytes((KIND_SNAPSHOT, len(job)))
            + job
            + _SNAPSHOT_TAIL.pack(
                self.version,
                bytes.fromhex(self.weights_hash),
                bytes.fromhex(self.chain_hash),
                self.size,
                bytes.fromhex(self.model_hash),
            )
        )

    def describe(self) -> str:
        return f"snapshot v{self.version} (h {self.weights_hash[:12]}.., {self.size} bytes)"


Announcement = VersionAnnouncement | SnapshotAnnouncement


def _private(key: bytes) -> Ed25519PrivateKey:
    if not isinstance(key, bytes | bytearray) or len(key) != KEY_BYTES:
        raise ValueError(f"an Ed25519 private key is {KEY_BYTES} raw bytes")
    return Ed25519PrivateKey.from_private_bytes(bytes(key))


def public_key_of(private_key: bytes) -> bytes:
    """The raw 32-byte public key of a raw 32-byte Ed25519 private key."""
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return _private(private_key).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def sign(announcement: Announcement, private_key: bytes) -> bytes:
    """The announcement as signed bytes: canonical bytes then the Ed25519 signature."""
    body = announcement.canonical()
    return body + _private(private_key).sign(body)


def sign_bytes(data: bytes, private_key: bytes) -> bytes:
    """The Ed25519 signature of ``data`` (a role certificate, a handshake transcript: callers
    put a label of their own in ``data``, so that no signature serves two purposes)."""
    return _private(private_key).sign(data)


def verify_bytes(data: bytes, signature: bytes, public_key: bytes) -> bool:
    """Whether ``signature`` is ``public_key``'s Ed25519 signature of ``data``."""
    if len(public_key) != KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(bytes(public_key)).verify(bytes(signature), data)
    except (InvalidSignature, ValueError):
        return False
    return True


def _parse(body: bytes) -> Announcement:
    if len(body) < len(MAGIC) + 2 or body[: len(MAGIC)] != MAGIC:
        raise MalformedAnnouncementError("not an announcement (bad magic)")
    kind, n = body[len(MAGIC)], body[len(MAGIC) + 1]
    pos = len(MAGIC) + 2
    try:
        job = body[pos : pos + n].decode("ascii")
    except UnicodeDecodeError:
        raise MalformedAnnouncementError("job id is not ASCII") from None
    pos += n
    tail = body[pos:]
    ann: Announcement
    try:
        if kind == KIND_DELTA:
            if len(tail) != _DELTA_TAIL.size:
                raise MalformedAnnouncementError(f"delta announcement of {len(body)} bytes")
            v, base, bh, key, did, wh, size, segs, seg_size = _DELTA_TAIL.unpack(tail)
            ann = VersionAnnouncement(
                job=job,
                version=v,
                base=base,
                base_hash=bh.hex(),
                key=key.hex(),
                delta_id=did.hex(),
                weights_hash=wh.hex(),
                size=size,
                segments=segs,
                segment_size=seg_size,
            )
        elif kind == KIND_SNAPSHOT:
            if len(tail) != _SNAPSHOT_TAIL.size:
                raise MalformedAnnouncementError(f"snapshot announcement of {len(body)} bytes")
            v, wh, ch, size, mh = _SNAPSHOT_TAIL.unpack(tail)
            ann = SnapshotAnnouncement(
                job=job,
                version=v,
                weights_hash=wh.hex(),
                chain_hash=ch.hex(),
                size=size,
                model_hash=mh.hex(),
            )
        else:
            raise MalformedAnnouncementError(f"unknown announcement kind {kind}")
    except struct.error as exc:  # cannot happen after the length checks; kept one-line anyway
        raise MalformedAnnouncementError(f"announcement fields: {exc}") from None
    if ann.canonical() != body:
        raise MalformedAnnouncementError("announcement bytes are not in canonical form")
    return ann


def verify(data: bytes | bytearray | memoryview, public_key: bytes, *, job: str) -> Announcement:
    """The announcement in ``data`` if the job's key signed it for ``job``; otherwise raise a
    :class:`AnnouncementError` subclass whose message says why in one line."""
    data = bytes(data)
    if not SIGNATURE_BYTES < len(data) <= MAX_ANNOUNCEMENT_BYTES:
        raise MalformedAnnouncementError(f"an announcement of {len(data)} bytes")
    if not isinstance(public_key, bytes | bytearray) or len(public_key) != KEY_BYTES:
        raise ValueError(f"an Ed25519 public key is {KEY_BYTES} raw bytes")
    body, sig = data[:-SIGNATURE_BYTES], data[-SIGNATURE_BYTES:]
    ann = _parse(body)
    try:
        Ed25519PublicKey.from_public_bytes(bytes(public_key)).verify(sig, body)
    except InvalidSignature:
        raise BadSignatureError(
            f"{ann.describe()} is not signed by this job's Trainer key"
        ) from None
    if ann.job != job:
        raise WrongJobError(f"{ann.describe()} is signed for job {ann.job!r}, not {job!r}")
    return ann


def delta_key(header: bytes | memoryview) -> str:
    """The transfer key of a delta whose header (the payload's first bytes) is ``header``."""
    return H(header).hex()[:KEY_HEX]


def describe_parts(
    job: str, first_segment: bytes | bytearray | memoryview, trailer: bytes | bytearray | memoryview
) -> VersionAnnouncement:
    """The announcement of a delta from its first payload segment (which holds the header) and
    its trailer: what the Trainer signs for a delta it produced itself. Nothing is verified
    beyond the structure (the producer knows its own bytes); receivers verify against it."""
    head, end = parse_header(first_segment)
    tv = memoryview(trailer)
    if len(tv) < _TRAILER_FIXED:
        raise MalformedAnnouncementError("the trailer is shorter than its fixed part")
    (plen,) = struct.unpack_from("<Q", tv, len(TRAILER_MAGIC))
    plen, seg_size, leaves, delta_id, h_v = _trailer_fields(tv, plen)
    return VersionAnnouncement(
        job=job,
        version=head["version"],
        base=head["base"],
        base_hash=head["base_hash"],
        key=delta_key(memoryview(first_segment)[:end]),
        delta_id=delta_id.hex(),
        weights_hash=h_v.hex(),
        size=plen + len(tv),
        segments=len(leaves),
        segment_size=seg_size,
    )


def describe_delta(job: str, data: bytes | memoryview) -> VersionAnnouncement:
    """The announcement of a whole delta file, verified first (``read_delta``): what a Trainer
    re-serving ``D_v`` from the Checkpoint Store signs again, or a test builds."""
    from aurora.delta.reader import read_delta

    d = read_delta(data)
    mv = memoryview(data)
    _, end = parse_header(mv)
    return VersionAnnouncement(
        job=job,
        version=d.version,
        base=d.base,
        base_hash=d.base_hash,
        key=delta_key(mv[:end]),
        delta_id=d.id,
        weights_hash=d.weights_hash,
        size=d.size,
        segments=len(d.leaves),
        segment_size=d.segment_size,
    )
