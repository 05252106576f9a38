"""Reassembly of a delta from segments that arrive in any order, twice, or forged.

See :class:`Reassembler`: segments land in one contiguous arena at their offsets and are verified
there; the finished delta is parsed in place.

Expected key, not first key. Given the Trainer's signed announcement of ``D_v``
(:class:`aurora.delta.announce.VersionAnnouncement`, at construction or later with
:meth:`Reassembler.expect`), a reassembler knows every segment that exists before any arrives:
the transfer key, each seq's (offset, length) from the segment size, the trailer's length and
place. Anything else - another key, an offset off that grid, a trailer of another length, a
trailer whose ``id(D_v)`` is not the announced one - is refused before it is hashed or stored
(:meth:`Reassembler.refutes` names why), so the bytes held never exceed the announced size, and
no trailer makes it hash more leaves than the Trainer signed. Before an announcement the bytes a
reassembler takes are capped by ``budget`` (charged in whole 4 KiB pages, the memory they
commit), so a source cannot make it hold more than that either.
"""

from __future__ import annotations

import bisect
import contextlib
import struct
from typing import TYPE_CHECKING

from aurora.delta import arena as arena_mod
from aurora.delta.errors import CorruptError, DeltaError, ForeignSegmentError, TruncatedError
from aurora.delta.hashing import H, leaf_hash, merkle_root
from aurora.delta.reader import _read_delta
from aurora.delta.records import HASH_BYTES, MAGIC, TRAILER_MAGIC, Delta, Segment

if TYPE_CHECKING:
    from aurora.delta.announce import VersionAnnouncement

PAGE = 4096
"""Bytes the kernel commits per touched page: what a slot of the arena costs at least."""


class BudgetError(DeltaError):
    """More bytes than a reassembler may hold before its delta is announced."""


def _pages(offset: int, length: int) -> int:
    """Bytes of whole pages that ``length`` bytes at ``offset`` touch."""
    return (-(-(offset + length) // PAGE) - offset // PAGE) * PAGE


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

    ``expected`` (the Trainer's signed announcement; or ``expected_id`` / ``expected_hash``
    alone) makes segments from untrusted relays safe: every segment off the announced grid is
    refused, once the trailer is in every segment is checked against the trailer's leaf hashes,
    and the trailer against ``id(D_v)`` / ``h(v)``. A segment that fails is dropped and reported
    by the exception; :meth:`missing` lists what to fetch again. ``budget`` caps the bytes taken
    while nothing is expected (see the module docstring).
    """

    def __init__(
        self,
        *,
        key: str | None = None,
        expected_id: str | None = None,
        expected_hash: str | None = None,
        arena: memoryview | None = None,
        expected: VersionAnnouncement | None = None,
        budget: int | None = None,
    ) -> None:
        self.key = key
        self.expected_id, self.expected_hash = expected_id, expected_hash
        self.expected: VersionAnnouncement | None = None
        self.budget = budget
        """Bytes (in whole pages) payload segments may take while nothing is expected."""
        self.charged = 0
        """Bytes (in whole pages) held or handed out as slots."""
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
        self._trailer_slot: memoryview | None = None
        """The buffer handed out for the trailer and not yet added or abandoned."""
        self._refuted: list[int] = []
        """Held segments the trailer refuted since :meth:`take_refuted` was last called."""
        if expected is not None:
            self.expect(expected)

    # -- what is expected ----------------------------------------------------------------

    def expect(self, ann: VersionAnnouncement) -> list[int]:
        """From now on accept only what ``ann`` announces. Held segments off its grid are
        dropped (their seqs are returned, to fetch again); ForeignSegmentError when the
        segments held so far are of another delta (the caller starts afresh)."""
        if self.key is not None and self.key != ann.key:
            raise ForeignSegmentError(
                f"holds segments of delta {self.key[:12]}.., the announced one is {ann.key[:12]}.."
            )
        if self.expected_id not in (None, ann.delta_id) or self.expected_hash not in (
            None,
            ann.weights_hash,
        ):
            raise CorruptError(f"{ann.describe()} contradicts what this reassembler expects")
        if len(self._buffer()) < ann.payload_bytes:
            raise CorruptError(
                f"{ann.describe()} does not fit the {len(self._buffer())}-byte receive arena"
            )
        if self._trailer_bytes is not None:
            delta_id = self._trailer_bytes[-HASH_BYTES * 2 - len(MAGIC) : -HASH_BYTES - len(MAGIC)]
            if delta_id.hex() != ann.delta_id:
                raise ForeignSegmentError(
                    f"holds the trailer of another delta than {ann.describe()}"
                )
        self.key, self.expected = ann.key, ann
        self.expected_id, self.expected_hash = ann.delta_id, ann.weights_hash
        dropped = []
        for seq, (off, n) in list(self._held.items()):
            if seq >= ann.segments or (off, n) != ann.segment_range(seq):
                del self._held[seq], self._leaf[seq]
                self._release(off)
                dropped.append(seq)
        return dropped

    def refutes(self, key: str, seq: int, offset: int, length: int, trailer: bool) -> str | None:
        """Why a segment announced as (key, seq, offset, length) cannot belong to the expected
        delta (one line), or None when it may (or nothing is expected yet)."""
        ann = self.expected
        if ann is None:
            return None
        if key != ann.key:
            return f"a segment of delta {key[:12]}.., not of the announced {ann.describe()}"
        want = (
            ann.segment_range(ann.segments)
            if trailer
            else ann.segment_range(seq)
            if 0 <= seq < ann.segments
            else None
        )
        if want is None or (trailer and seq != ann.segments) or want != (offset, length):
            what = "trailer" if trailer else f"segment {seq}"
            return (
                f"{what} at bytes {offset}..{offset + length} is not where {ann.describe()} has it"
            )
        return None

    def issued(self, seg: Segment) -> bool:
        """Whether ``seg.data`` is a slot this reassembler handed out and still expects."""
        if seg.trailer:
            return self._trailer_slot is not None and seg.data is self._trailer_slot
        filling = self._slots.get(seg.offset)
        return filling is not None and filling[0] is seg.data

    def take_refuted(self) -> list[int]:
        """Held segments the trailer refuted (and dropped) since the last call: whoever sent
        them is to blame."""
        out, self._refuted = self._refuted, []
        return out

    @property
    def held_bytes(self) -> int:
        """Bytes of verified payload held."""
        return sum(n for _, n in self._held.values())

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
        self.charged += _pages(start, end - start)

    def _release(self, start: int) -> None:
        end = self._regions.pop(start)
        self._starts.remove(start)
        self.charged -= _pages(start, end - start)

    def _affordable(self, offset: int, length: int) -> bool:
        return (
            self.expected is not None
            or self.budget is None
            or self.charged + _pages(offset, length) <= self.budget
        )

    def slot(
        self, key: str, seq: int, offset: int, length: int, trailer: bool
    ) -> memoryview | None:
        """Where to receive a segment announced as (key, seq, offset, length): a writable view
        of the arena that is this caller's until :meth:`add` or :meth:`abandon`; None when the
        segment is held already, its range is taken (another receiver is filling it, or it
        overlaps held bytes) or it is foreign: receive it elsewhere and :meth:`add` it (it will be
        dropped as a duplicate or refused). Once a delta is expected the trailer has a slot too
        (a buffer of its announced length), and nothing off the announced grid gets one; before,
        nothing beyond ``budget`` does."""
        if self.refutes(key, seq, offset, length, trailer) is not None:
            return None
        if trailer:
            if self.expected is None or self._trailer is not None or self._trailer_slot is not None:
                return None
            self._trailer_slot = memoryview(bytearray(length))
            return self._trailer_slot
        if (self.key is not None and key != self.key) or seq in self._held:
            return None
        if not self._affordable(offset, length):
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
        if self._trailer_slot is not None and view is self._trailer_slot:
            self._trailer_slot = None
            return
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
        reason = self.refutes(seg.key, seg.seq, seg.offset, len(seg.data), seg.trailer)
        if seg.trailer:
            if self._trailer_slot is not None and seg.data is self._trailer_slot:
                self._trailer_slot = None
            if reason is not None:
                raise CorruptError(reason)
            with contextlib.suppress(_Duplicate):
                self._add_trailer(seg)
            return self.complete
        if reason is not None:
            if seg.offset in self._slots and self._slots[seg.offset][0] is seg.data:
                del self._slots[seg.offset]
                self._release(seg.offset)
            raise CorruptError(reason)
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
        if not self._affordable(seg.offset, len(seg.data)):
            raise BudgetError(
                f"segment {seg.seq} would take the bytes held for an unannounced delta past "
                f"{self.budget}"
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
            raise CorruptError("trailer: id(D_v) is not the announced one")
        if self.expected_hash is not None:
            h_v = bytes(mv[24 + (n + 1) * HASH_BYTES : 24 + (n + 2) * HASH_BYTES])
            if h_v.hex() != self.expected_hash:
                raise CorruptError("trailer: h(v) is not the announced one")
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
            self._refuted.extend(bad)
            raise CorruptError(f"segments {bad} do not match the trailer; fetch them again")

    def _check_against_trailer(self, seq: int, offset: int, leaf: bytes) -> None:
        assert self._trailer is not None
        plen, seg_size, leaves = self._trailer
        if not (0 <= seq < len(leaves)) or offset != seq * seg_size or leaf != leaves[seq]:
            raise CorruptError(f"segment {seq} does not match the trailer's hash for it")

    def receiving(self) -> set[int]:
        """Segments a receiver is filling right now (a slot handed out, not yet added)."""
        return {seq for _, seq in self._slots.values()}

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
