"""The versions a node holds, as its receive machine and its server see them.

One table per node: :class:`VersionState` per version (its verified announcement, the
reassembler its bytes land in, the verified segments, the whole delta), which the receive machine
(:mod:`aurora.transport.receiver`) fills and the server (:mod:`aurora.transport.server`) serves
from. A source's own versions (the Trainer's) go in the same table: it publishes announcements
it is given, signed by the Trainer role, and signs nothing itself. A source or relay keeps the
newest ``cache_versions`` whole versions. Before a version's announcement only one version is
taken, within ``unannounced_bytes`` (:meth:`VersionTable.unannounced_slot`). No I/O, no clock:
``now`` is passed in.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field

from aurora.delta import Delta, Reassembler, Segment
from aurora.delta.announce import AnnouncementError, VersionAnnouncement
from aurora.delta.reader import parse_header, read_delta
from aurora.transport.actions import NONE, Action, Announce, Dropped, Fetch, Forward
from aurora.transport.arenas import ArenaPool
from aurora.transport.config import UNANNOUNCED_FIRST, TransportConfig


@dataclass
class VersionState:
    """What this node holds of one version."""

    progress: float
    """When a verified segment of it last arrived, or it was (re)asked for (monotonic s)."""
    ann: VersionAnnouncement | None = None
    """The verified announcement of this version (None until one arrives)."""
    signed: bytes | None = None
    """Its signed bytes, to forward."""
    reassembler: Reassembler | None = None
    """Set on receivers when the first wanted segment arrives (a source has its own segments)."""
    segments: dict[int, Segment] = field(default_factory=dict)
    """Verified segments by seq (the trailer under its seq too), to forward and serve."""
    origin: dict[int, int] = field(default_factory=dict)
    """Which source each held segment came from (blamed if the trailer refutes it)."""
    delta: Delta | None = None
    published: bool = False
    """A source's own version, whole."""
    missed: bool = False
    """Something of this version was dropped before its announcement (the trailer, segments
    over the budget): fetch what is missing as soon as it is announced."""
    received_at: float | None = None
    """When the last segment arrived verified (monotonic s), before the whole-file parse."""
    fallback_tried: bool = False

    @property
    def whole(self) -> bool:
        return self.delta is not None or self.published


def is_whole(segments: Iterable[Segment]) -> bool:
    """``segments`` is a sequence from segment 0 to the trailer: the delta exists whole."""
    return (
        isinstance(segments, Sequence)
        and len(segments) > 0
        and segments[0].seq == 0
        and segments[-1].trailer
        and segments[-1].seq == len(segments) - 1
    )


class VersionTable:
    """Every version one node holds.

    The server reads it through :meth:`cached`, :meth:`serving` and :meth:`held`; a source's own
    versions go in through :meth:`own_segment`; :meth:`trim` keeps the newest
    ``cache_versions`` whole versions. Before a version's announcement only one version is taken
    - the one after the newest announced (or active) - and at most ``unannounced_bytes`` of it,
    no trailer (:meth:`unannounced_slot`); what was dropped for it is fetched the moment the
    announcement comes, and data of any other unannounced version is dropped.
    """

    def __init__(self, node_id: str, config: TransportConfig, arenas: ArenaPool) -> None:
        self.id, self.config, self.arenas = node_id, config, arenas
        self.cache_versions = config.cache_versions
        self.versions: dict[int, VersionState] = {}
        self.announcements: dict[int, VersionAnnouncement] = {}
        """Verified announcements by version (kept as long as the version is)."""
        self.newest_announced: int | None = None
        self.largest_announced = 0
        """Size of the largest delta announced to this node (bytes)."""

    def learn(self, ann: VersionAnnouncement, signed: bytes, st: VersionState) -> None:
        """``st`` is announced by ``ann`` (verified)."""
        st.ann, st.signed = ann, signed
        self.announcements[ann.version] = ann
        self.largest_announced = max(self.largest_announced, ann.size)
        if self.newest_announced is None or ann.version > self.newest_announced:
            self.newest_announced = ann.version

    # -- before the announcement ---------------------------------------------------------------

    def provisional_version(self, active: int | None) -> int | None:
        """The one version whose segments are taken before its announcement: the one after the
        newest announced or active (None: any one, while neither is known)."""
        known = [v for v in (self.newest_announced, active) if v is not None]
        return max(known) + 1 if known else None

    def drop_stray_provisional(self, active: int | None) -> None:
        """Unannounced data of any version but the provisional one is dropped."""
        keep = self.provisional_version(active)
        for v, st in list(self.versions.items()):
            if st.ann is None and st.reassembler is not None and v != keep:
                del self.versions[v]

    def unannounced_budget(self) -> int:
        """Bytes of the provisional version taken (``unannounced_bytes``; by default 1.25 x the
        largest delta announced + 1 MiB, ``UNANNOUNCED_FIRST`` before any)."""
        if self.config.unannounced_bytes is not None:
            return self.config.unannounced_bytes
        if self.largest_announced == 0:
            return UNANNOUNCED_FIRST
        return min(self.config.max_delta_bytes, self.largest_announced * 5 // 4 + (1 << 20))

    def unannounced_slot(
        self,
        version: int,
        key: str,
        seq: int,
        offset: int,
        length: int,
        trailer: bool,
        *,
        active: int | None,
        now: float,
    ) -> memoryview | None:
        """Where a segment of a version not announced yet goes: only the provisional version,
        within the budget, no trailer (what is dropped for it is noted: fetched once announced)."""
        provisional = self.provisional_version(active)
        if provisional is not None and version != provisional:
            return None
        if provisional is None and any(
            s.ann is None and s.reassembler is not None and v != version
            for v, s in self.versions.items()
        ):
            return None
        if offset + length > self.config.max_delta_bytes:
            return None
        st = self.versions.get(version)
        if st is None:
            st = self.versions[version] = VersionState(progress=now)
        if trailer:
            st.missed = True
            return None
        if st.reassembler is None:
            st.reassembler = Reassembler(
                key=key, arena=self.arenas.take(), budget=self.unannounced_budget()
            )
        view = st.reassembler.slot(key, seq, offset, length, trailer)
        if view is None and key == st.reassembler.key and seq not in st.segments:
            st.missed = True  # over the budget, most likely: fetch it once announced
        return view

    # -- what to ask a source for ----------------------------------------------------------------

    def subscription(
        self, refused: Container[int], active: tuple[int, str] | None
    ) -> dict[str, object]:
        """The ``subscribe`` request for a new source: from the oldest incomplete version on,
        with what is held of each."""
        open_ = {v: st for v, st in self.versions.items() if not st.whole and v not in refused}
        have = [[v, sorted(st.segments)] for v, st in open_.items() if st.segments]
        start = active[0] + 1 if active is not None else 0
        done = [v for v, st in self.versions.items() if st.whole]
        first = min(open_) if open_ else max([start, *(v + 1 for v in done)])
        return {
            "op": "subscribe",
            "from": first,
            "have": have,
            "done": [v for v in done if v >= first],
        }

    def missing(self, version: int, refused: Container[int]) -> Fetch | None:
        """What to ask for of ``version`` now that the source is idle (nothing when it is whole
        or refused): everything not held, nor arriving."""
        st = self.versions.get(version)
        if st is None or st.whole or version in refused:
            return None
        receiving = st.reassembler.receiving() if st.reassembler is not None else set()
        return Fetch(version, tuple(sorted(set(st.segments) | receiving)))

    def checked_file(self, data: bytes | bytearray | memoryview) -> tuple[int, VersionState, Delta]:
        """(v, its state, the delta) of ``D_v`` given as a whole file, verified against its
        announcement (which must be here); raises a DeltaError (AnnouncementError when the
        version is not announced). Changes nothing."""
        head, _ = parse_header(data)
        v = head["version"]
        st = self.versions.get(v)
        if st is None or st.ann is None:
            raise AnnouncementError(f"D_{v} is not announced here: hand its announcement first")
        ann = st.ann
        delta = read_delta(data, expected_id=ann.delta_id, expected_hash=ann.weights_hash)
        if delta.size != ann.size:
            raise AnnouncementError(f"D_{v} is {delta.size} bytes, announced {ann.size}")
        return v, st, delta

    # -- what a server serves ------------------------------------------------------------------

    def cached(self, version: int, seq: int) -> Segment | None:
        st = self.versions.get(version)
        return None if st is None else st.segments.get(seq)

    def serving(self, version: int) -> tuple[bytes | None, list[int]] | None:
        st = self.versions.get(version)
        if st is None:
            return None
        return st.signed, sorted(st.segments, key=lambda s: (not st.segments[s].trailer, s))

    def held(self) -> list[int]:
        return sorted(self.versions)

    # -- a source's own versions -------------------------------------------------------------------

    def own_announcement(
        self, ann: VersionAnnouncement, signed: bytes, now: float
    ) -> tuple[Action, ...]:
        """This node publishes ``D_v`` under ``ann`` (verified by the caller). Raises ValueError,
        changing nothing, if ``D_v`` is announced already with other bytes."""
        st = self.versions.get(ann.version)
        if st is not None and st.ann is not None and st.ann != ann:
            raise ValueError(
                f"node {self.id}: D_{ann.version} is announced already with id "
                f"{st.ann.delta_id[:12]}..; publish the same bytes again, not other ones"
            )
        st = self.versions.setdefault(ann.version, VersionState(progress=now))
        self.learn(ann, signed, st)
        return (Announce(signed),)

    def own_segment(self, version: int, seg: Segment, now: float) -> tuple[Action, ...]:
        """A segment of this node's own ``D_version``. Raises ValueError, changing nothing, for
        a trailer before the version is announced."""
        st = self.versions.get(version)
        if seg.trailer and (st is None or st.signed is None):
            raise ValueError(
                f"node {self.id}: the trailer of D_{version} before its signed announcement "
                "(the Trainer signs it: aurora.runtime.publisher)"
            )
        if st is None:
            st = self.versions[version] = VersionState(progress=now)
        st.segments[seg.seq] = seg
        return (Forward(version, (seg.seq,)),)

    def own_done(self, version: int) -> tuple[bytes | None, tuple[Action, ...]]:
        """(its signed announcement, what to do) once every segment of this node's own
        ``D_version`` is published; (None, nothing) while some are still to come."""
        st = self.versions.get(version)
        if st is None or st.ann is None or len(st.segments) < st.ann.segments + 1:
            return None, NONE
        st.published = True
        return st.signed, tuple(self.trim())

    def trim(self) -> list[Action]:
        """A source or relay keeps the newest ``cache_versions`` whole versions (bounded memory
        over thousands of steps); an incomplete one is never dropped here."""
        done = sorted(v for v, st in self.versions.items() if st.whole)
        gone = done[: -self.cache_versions]
        for v in gone:
            del self.versions[v]
            self.announcements.pop(v, None)
        return [Dropped(tuple(gone))] if gone else []
