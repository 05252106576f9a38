"""The versions a node holds, as its receive machine and its server see them.

Theory of operation
-------------------
One table per node: :class:`VersionState` per version (its verified announcement, the
reassembler its bytes land in, the verified segments, the whole delta), which the receive machine
(:mod:`aurora.transport.receiver`) fills and the server (:mod:`aurora.transport.server`) serves
from through :meth:`VersionTable.cached`, :meth:`~VersionTable.serving` and
:meth:`~VersionTable.held`. A source's own versions (the Trainer's) go in the same table
(:meth:`VersionTable.own_segment`): it publishes announcements it is given, signed by the
Trainer role, and signs nothing itself. A source or relay keeps the newest ``cache_versions``
whole versions (:meth:`VersionTable.trim`). No I/O, no clock: ``now`` is passed in.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from aurora.delta import Delta, Reassembler, Segment
from aurora.delta.announce import VersionAnnouncement
from aurora.transport.actions import NONE, Action, Announce, Dropped, Forward


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
    """Every version one node holds (see the module docstring)."""

    def __init__(self, node_id: str, cache_versions: int) -> None:
        self.id = node_id
        self.cache_versions = cache_versions
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
