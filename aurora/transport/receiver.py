"""The receive machine of a data-plane node: frames and ``now`` in, actions out.

:class:`Receiver` holds the node's version table (:mod:`aurora.transport.table`), what is staged
and refused, and the source choice (:class:`~aurora.transport.sources.SourceChoice`). The node's
shell (:mod:`aurora.transport.node`) feeds it events - an announcement, the header of an arriving
segment, a verified segment, a watchdog tick, a connection made or lost - and carries out the
actions it returns (:mod:`aurora.transport.actions`: ``Fetch``, ``Switch``, ``Staged``, ...).
Nothing here does I/O or reads a clock: every event that needs the time carries ``now``
(monotonic s), so every rule is tested with exact action traces (``tests/test_receiver.py``).
Only an announcement that verifies under the job's key is believed, and a version is whole only
if it hashes to the announced id; the rules (trust, before the announcement, blame and switch,
stall, staging, bounds) are listed at :class:`Receiver`. An illegal event raises ``ValueError``
and changes nothing.
"""

from __future__ import annotations

from aurora.delta import Delta, Reassembler, Segment
from aurora.delta.announce import AnnouncementError, SnapshotAnnouncement, VersionAnnouncement
from aurora.delta.announce import verify as verify_signed
from aurora.delta.errors import DeltaError
from aurora.delta.reader import segments_of
from aurora.policy.staging import Verdict, judge_staging
from aurora.transport import actions as act
from aurora.transport.actions import NONE, Action
from aurora.transport.arenas import ArenaPool
from aurora.transport.config import NodeMetrics, TransportConfig, one_line
from aurora.transport.sources import SourceChoice
from aurora.transport.table import VersionState, VersionTable


class Receiver:
    """The receive machine of one node.

    * **Trust.** Only an announcement that verifies under the job's key is believed
      (:meth:`verify`); from then on only segments on its grid are taken for that version
      (expected key, not first key) and the version is whole only if it hashes to the announced
      id.
    * **Before the announcement** one version only is taken, within a budget, no trailer
      (:meth:`~aurora.transport.table.VersionTable.unannounced_slot`); what was dropped for it is
      fetched the moment the announcement comes, and what the announcement does not describe
      dropped.
    * **Blame and switch.** A source that sends what the announcement refutes is not used again
      for that version and, if it is the current one, is left (``Switch``). So is one that makes
      no verified progress (fewer than ``min_rate_bytes_s`` x ``progress_s`` wanted bytes over
      ``progress_s``) while an announced version is incomplete. When no source is left for a
      version it goes to the fallback once (``Fallback``), then is refused (``Refused``).
    * **Stall.** No progress on an incomplete version for ``stall_s`` while no segment is
      arriving: ``Fetch`` what is missing. A tick that comes late (more than 2 x ``stall_s``
      after the last: the process was paused) judges no source: the progress window starts
      again (and the node's stuck-connection rule waits for the next tick).
    * **Staging** (a node with weights: ``active`` set) asks
      :func:`aurora.policy.staging.judge_staging`: stage, wait for the base, or refuse. This is
      the one place that knows what the data plane has staged (:attr:`staged`); the Actor tells
      it what its weights run (:meth:`set_active`), which releases everything up to it.
    * **Bounded.** A relay (no weights) keeps the newest ``cache_versions`` whole versions
      (``Dropped`` names those that left); an Actor what it has not activated.

    A source's own versions live in the same table, so one catalog serves subscribers. An
    illegal event (a catch-up backwards here; a conflicting own announcement or a trailer
    published before its announcement in the table) raises ``ValueError`` and changes nothing.
    """

    def __init__(
        self,
        node_id: str,
        config: TransportConfig,
        *,
        sources: list[str],
        active: tuple[int, str] | None,
        arenas: ArenaPool,
        metrics: NodeMetrics,
        now: float,
        fallback: bool = False,
    ) -> None:
        self.id, self.config, self.metrics, self.arenas = node_id, config, metrics, arenas
        self.fallback = fallback
        """Whether the node has a fallback to carry out :class:`Fallback` (else: refuse)."""
        self.active = active
        """(version, weights hash) the weights run, the base deltas are checked against; None
        for a pure relay (it stages nothing)."""
        self.table = VersionTable(node_id, config, arenas)
        self.versions = self.table.versions
        """The table's versions (the same dict)."""
        self.staged: dict[int, Delta] = {}
        self.refused: dict[int, str] = {}
        self.announcements = self.table.announcements
        self.choice = self._new_choice(sources)
        self.current: int | None = None
        """The source connected now (its index), None between sources."""
        self.progress_bytes = 0
        """Wanted bytes received into slots, for the progress rule."""
        self.progress_mark: tuple[float, int] = (now, 0)
        """(when, progress_bytes then): the start of the progress window."""
        self.last_tick = now
        self.in_fallback: set[int] = set()
        """Versions the fallback is fetching now (not refused meanwhile)."""
        self._seen_signed: dict[bytes, VersionAnnouncement] = {}

    def _new_choice(self, names: list[str]) -> SourceChoice:
        c = self.config
        return SourceChoice(
            names, attempts=c.attempts, backoff_s=c.backoff_s, max_backoff_s=c.max_backoff_s
        )

    # -- what the node asks ------------------------------------------------------------------------

    def waiting(self) -> list[int]:
        """Announced versions this node still needs and has not given up."""
        return [
            v
            for v, st in self.versions.items()
            if st.ann is not None and not st.whole and v not in self.refused
        ]

    def is_late(self, now: float) -> bool:
        """Whether a watchdog tick at ``now`` comes late: more than 2 x ``stall_s`` after the
        last one that judged (every stall_s / 2 when on time)."""
        return now - self.last_tick > 2 * self.config.stall_s

    def subscription(self) -> dict[str, object]:
        """The ``subscribe`` request for a new source (:meth:`VersionTable.subscription`)."""
        return self.table.subscription(self.refused, self.active)

    def missing(self, version: int) -> act.Fetch | None:
        """What to ask for of ``version`` once the source is idle: everything not held, nor
        arriving (None when it is whole or refused)."""
        return self.table.missing(version, self.refused)

    # -- sources -----------------------------------------------------------------------------------

    def set_sources(self, names: list[str]) -> None:
        """A new list of sources: what each old one was blamed for is forgotten."""
        self.choice = self._new_choice(names)
        self.current = None

    def next_source(self) -> int | None:
        return self.choice.next(self.waiting())

    def connected(self, source: int, now: float) -> None:
        self.choice.connected(source)
        self.current = source
        self.progress_mark = (now, self.progress_bytes)

    def unreachable(self, source: int, reason: str, now: float) -> None:
        self.choice.connected(source)  # so that next() moves past it
        self.choice.unreachable(source, self.waiting(), reason, now)

    def switch(self, why: str, now: float) -> tuple[Action, ...]:
        """Leave the current source (a try for every version still waiting)."""
        if self.current is None:
            return NONE
        source, self.current = self.current, None
        self.choice.left(source, self.waiting(), why, now=now)
        return (act.Switch(source, why),)

    def lost(self, now: float) -> bool:
        """Every connection to the current source is gone; True if there was one."""
        if self.current is None:
            return False
        self.choice.left(self.current, self.waiting(), "connection lost", now=now)
        self.current = None
        return True

    # -- announcements -----------------------------------------------------------------------------

    def verify(self, signed: bytes) -> VersionAnnouncement:
        """The announcement ``signed`` carries, verified against the job's key; raises an
        AnnouncementError with the one-line reason."""
        signed = bytes(signed)
        ann = self._seen_signed.get(signed)
        if ann is not None:
            return ann
        got = verify_signed(signed, self.config.public_key, job=self.config.job)
        if isinstance(got, SnapshotAnnouncement):
            raise AnnouncementError(f"{got.describe()}: a snapshot, not a version announcement")
        if len(self._seen_signed) > 4 * self.config.cache_versions + 64:
            self._seen_signed.clear()
        self._seen_signed[signed] = got
        self.metrics.announcements += 1
        return got

    def announcement(
        self, ann: VersionAnnouncement, signed: bytes, via: int | None, now: float
    ) -> tuple[Action, ...]:
        """A verified announcement, from source ``via`` (None: handed by the runtime)."""
        v = ann.version
        if (self.active is not None and v <= self.active[0]) or v in self.refused:
            return NONE
        whole = [u for u, st in self.versions.items() if st.whole]
        if self.active is None and whole and v <= max(whole) - self.config.cache_versions:
            return NONE  # a relay would drop it from its cache at once
        st = self.versions.get(v)
        if st is not None and st.ann is not None:
            if st.ann == ann:
                return NONE
            self.metrics.refused["announcement"] += 1
            return (
                act.Note(
                    f"conflict:{v}",
                    f"a second, different announcement of D_{v} (id {ann.delta_id[:12]}.., first "
                    f"{st.ann.delta_id[:12]}..) is ignored: the Trainer signed two deltas for one "
                    "version",
                ),
            )
        if ann.payload_bytes > self.config.max_delta_bytes:
            return tuple(
                self._refuse(
                    v,
                    f"{ann.describe()} is larger than this node's max_delta_bytes "
                    f"({self.config.max_delta_bytes})",
                )
            )
        if not self.waiting():
            # Nothing was owed before: the progress window starts now, not at the last tick.
            self.progress_mark = (now, self.progress_bytes)
        st = self.versions.setdefault(v, VersionState(progress=now))
        st.progress = now
        out: list[Action] = []
        self.table.learn(ann, signed, st)
        self.table.drop_stray_provisional(self.active[0] if self.active is not None else None)
        if st.reassembler is not None:
            try:
                dropped = st.reassembler.expect(ann)
            except DeltaError as exc:
                why = f"dropping what arrived for v{v} before its announcement: {one_line(exc)}"
                out.append(act.Note(f"early:{v}", why, info=True))
                st.reassembler = None
                st.segments.clear()
                st.origin.clear()
            else:
                for seq in dropped:
                    st.segments.pop(seq, None)
                    st.origin.pop(seq, None)
        out.append(act.Announce(signed))
        if st.whole:
            return tuple(out)
        if st.missed:
            # Something came before it and was dropped: ask for what is missing now.
            st.missed = False
            out.append(act.Fetch(v, tuple(sorted(st.segments))))
        elif via is None or via != self.current:
            # Learned elsewhere: ask for what is missing rather than wait for a stall - once the
            # source is not sending. The Ledger's copy of an announcement can beat the source's
            # own push (a store-and-forward source sends a whole version at once), and asking
            # then had every dense version sent twice (sim_vs_real over the emulated WAN: 2.2 MB
            # on the link for 1.4 MB of versions).
            out.append(act.FetchWhenIdle(v))
        return tuple(out)

    # -- segments ----------------------------------------------------------------------------------

    def slot(
        self,
        source: int,
        version: int,
        key: str,
        seq: int,
        offset: int,
        length: int,
        trailer: bool,
        now: float,
    ) -> tuple[memoryview | None, tuple[Action, ...]]:
        """Where a segment's bytes go as they arrive (its place in the version's arena), or None
        to read them into scratch and drop them; with what to do about ``source``."""
        if version in self.refused or (self.active is not None and version <= self.active[0]):
            return None, NONE
        st = self.versions.get(version)
        if st is not None and st.whole:
            return None, NONE
        if st is None or st.ann is None:
            active = self.active[0] if self.active is not None else None
            where = (version, key, seq, offset, length, trailer)
            return self.table.unannounced_slot(*where, active=active, now=now), NONE
        if st.reassembler is None:  # the first wanted byte of an announced version
            st.reassembler = Reassembler(arena=self.arenas.take(), expected=st.ann)
        refuted = st.reassembler.refutes(key, seq, offset, length, trailer)
        if refuted is not None:
            return None, tuple(self._blame(source, version, refuted, "segment", now))
        return st.reassembler.slot(key, seq, offset, length, trailer), NONE

    def abandon(self, version: int, view: memoryview) -> None:
        """A slot's bytes will not come (its connection ended mid-segment)."""
        st = self.versions.get(version)
        if st is not None and st.reassembler is not None:
            st.reassembler.abandon(view)

    def segment(self, source: int, version: int, seg: Segment, now: float) -> tuple[Action, ...]:
        """A segment whose bytes are all in their slot, from ``source``."""
        st = self.versions.get(version)
        if st is None or st.reassembler is None or not st.reassembler.issued(seg):
            return NONE  # the version was dropped, refused or started afresh while this arrived
        ra = st.reassembler
        self.progress_bytes += len(seg.data)
        out: list[Action] = []
        try:
            complete = ra.add(seg)
        except DeltaError as exc:
            if not (seg.trailer and ra.holds(seg.seq, trailer=True)):
                what = "a trailer" if seg.trailer else f"segment {seg.seq}"
                out += self._blame(
                    source, version, f"{what} that is refused ({one_line(exc)})", "segment", now
                )
                out += self._refuted_by_trailer(version, st, now)
                return tuple(out)
            complete = ra.complete  # the trailer is in; it refuted segments others sent
        out += self._refuted_by_trailer(version, st, now)
        if st.reassembler is not ra or not ra.holds(seg.seq, trailer=seg.trailer):
            return tuple(out)  # refused meanwhile, or not this segment: nothing to keep
        st.segments[seg.seq] = seg
        st.origin[seg.seq] = source
        st.progress = now
        self.metrics.bytes_verified += len(seg.data)
        self.choice.progressed()
        if self.config.cut_through:
            out.append(act.Forward(version, (seg.seq,)))  # cut-through: forward once verified
        if complete:
            st.received_at = now
            if not self.config.cut_through:
                # Store-and-forward (the PrimeRL baselines' relays): the whole version, now.
                out.append(act.Forward(version, tuple(sorted(st.segments))))
            out += self._complete(version, st)
        return tuple(out)

    def _blame(self, source: int, version: int, what: str, kind: str, now: float) -> list[Action]:
        """``source`` sent something for ``version`` that is refuted: never again for it."""
        self.metrics.refused[kind] += 1
        out: list[Action] = []
        if self.choice.refute(version, source, what):
            out.append(act.Blame(source, version, what))
        if self.current == source:
            out += self.switch(f"it sent {what} for v{version}", now)
        out += self.check_refusals()
        return out

    def _refuted_by_trailer(self, version: int, st: VersionState, now: float) -> list[Action]:
        """Segments the trailer just refuted: drop them, blame whoever sent them."""
        if st.reassembler is None:
            return []  # refused meanwhile (its last source was just blamed): nothing to refute
        refuted = st.reassembler.take_refuted()
        out: list[Action] = []
        for seq in refuted:
            st.segments.pop(seq, None)
            source = st.origin.pop(seq, None)
            if source is None:
                continue
            self.metrics.refused["segment"] += 1
            what = f"segment {seq} that the trailer refutes"
            if self.choice.refute(version, source, what):
                out.append(act.Blame(source, version, what))
            if self.current == source:
                out += self.switch(
                    f"it sent segment {seq} of v{version} that the trailer refutes", now
                )
        if refuted:
            out.append(act.Fetch(version, tuple(sorted(st.segments))))
            out += self.check_refusals()
        return out

    def _complete(self, version: int, st: VersionState) -> list[Action]:
        assert st.reassembler is not None and st.ann is not None
        try:
            delta = st.reassembler.result()
        except DeltaError as exc:
            return self._refuse(version, f"D_{version} does not verify: {one_line(exc)}")
        st.delta = delta
        st.reassembler = None
        self.choice.done(version, self.current)
        return [act.Complete(version), *self._settle(version)]

    def _settle(self, version: int) -> list[Action]:
        """A version just became whole: a relay trims its cache, a node with weights stages."""
        if self.active is None:
            return list(self.table.trim())
        return self._try_stage(version)

    # -- staging -----------------------------------------------------------------------------------

    def _try_stage(self, version: int) -> list[Action]:
        """Stage whole ``D_version`` if :func:`~aurora.policy.staging.judge_staging` says so,
        then whatever was waiting for it as its base."""
        assert self.active is not None
        out: list[Action] = []
        while True:
            st = self.versions.get(version)
            delta = st.delta if st is not None else None
            if delta is None or version in self.staged or version in self.refused:
                return out
            held = {self.active[0]: self.active[1]} | {
                d.version: d.weights_hash for d in self.staged.values()
            }
            verdict, reason = judge_staging(
                version,
                base=delta.base,
                base_hash=delta.base_hash,
                active=self.active[0],
                held=held,
            )
            if verdict is Verdict.WAIT:
                return out
            if verdict is Verdict.REFUSE:
                return out + self._refuse(version, reason)
            assert st is not None and st.ann is not None
            self.staged[version] = delta
            out.append(act.Staged(delta, st.ann))
            version += 1

    def set_active(self, version: int, weights_hash: str) -> tuple[Action, ...]:
        """The weights now run ``version`` (an activated delta, a catch-up): it becomes the base
        later deltas are checked against, everything up to it is released, and whole versions
        above it that build on it are staged. Raises ValueError, changing nothing, backwards."""
        if self.active is not None and version < self.active[0]:
            raise ValueError(
                f"node {self.id}: cannot move the active version back from v{self.active[0]} "
                f"to v{version}"
            )
        self.active = (version, weights_hash)
        self.release(version)
        out: list[Action] = []
        for v in sorted(x for x, st in self.versions.items() if st.delta is not None):
            out += self._try_stage(v)
        return tuple(out)

    def release(self, upto: int) -> None:
        """Forget every version up to ``upto``: segments, staged delta, refusal. Each version's
        arena goes back to the pool once nobody holds a ``Delta`` of it."""
        for v in [v for v in self.versions if v <= upto]:
            del self.versions[v]
            self.choice.done(v)
        for table in (self.staged, self.refused, self.announcements):
            for v in [v for v in table if v <= upto]:
                del table[v]

    # -- refusal, fallback -------------------------------------------------------------------------

    def _refuse(self, version: int, reason: str) -> list[Action]:
        if version in self.refused:
            return []
        self.refused[version] = reason
        self.metrics.refused["version"] += 1
        st = self.versions.get(version)
        if st is not None and not st.whole:
            st.reassembler = None  # its memory goes back as soon as nothing else holds it
            st.segments.clear()
            st.origin.clear()
        self.choice.done(version)
        return [act.Refused(version, reason)]

    def check_refusals(self) -> tuple[Action, ...]:
        """Every waiting version that no source can complete goes to the fallback once, then
        is refused."""
        if not self.choice.names:
            return NONE
        out: list[Action] = []
        for v in self.waiting():
            reason = self.choice.refusal(v)
            if reason is None:
                continue
            st = self.versions[v]
            if self.fallback and not st.fallback_tried:
                st.fallback_tried = True
                self.in_fallback.add(v)
                out.append(act.Fallback(v, reason))
            elif v not in self.in_fallback:
                out += self._refuse(v, reason)
        return tuple(out)

    def fallback_failed(self, version: int, why: str) -> tuple[Action, ...]:
        self.in_fallback.discard(version)
        return tuple(self._refuse(version, why))

    def add_file(
        self, data: bytes | bytearray | memoryview, now: float
    ) -> tuple[Delta, tuple[Action, ...]]:
        """``D_v`` as a whole file, verified against its announcement (which this node must
        have); raises a DeltaError (AnnouncementError when the version is not announced)."""
        v, st, delta = self.table.checked_file(data)
        self.in_fallback.discard(v)
        if st.whole:
            return (st.delta if st.delta is not None else delta), NONE
        st.reassembler = None
        st.segments = {s.seq: s for s in segments_of(bytes(data))}
        st.origin.clear()
        st.delta = delta
        st.received_at = now
        self.choice.done(v)
        self.refused.pop(v, None)
        served = self.table.serving(v)
        assert served is not None and st.signed is not None
        return delta, (act.Announce(st.signed), act.Forward(v, tuple(served[1])), *self._settle(v))

    def request(self, first: int, last: int, now: float) -> tuple[Action, ...]:
        """Ask for ``D_first .. D_last`` again: their refusals and source history are forgotten
        and what is missing is fetched."""
        if not self.waiting():
            self.progress_mark = (now, self.progress_bytes)
        out: list[Action] = []
        for v in range(first, last + 1):
            if self.active is not None and v <= self.active[0]:
                continue
            if self.refused.pop(v, None) is not None:
                self.choice.forget(v)
                old = self.versions.pop(v, None)
                if old is not None and old.ann is not None:
                    self.versions[v] = VersionState(progress=now, ann=old.ann, signed=old.signed)
            st = self.versions.get(v)
            if st is None or not st.whole:
                out.append(act.Fetch(v, tuple(sorted(st.segments)) if st is not None else ()))
        return tuple(out)

    # -- the watchdog ------------------------------------------------------------------------------

    def tick(self, now: float, *, connected: bool, arriving: bool) -> tuple[Action, ...]:
        """A watchdog tick while connected to a source: the progress rule, then the stall rule.
        ``connected``: a live connection is left; ``arriving``: a segment is mid-frame on one."""
        # A tick that comes late (more than 2 x stall_s after the last: this process's loop was
        # busy, or the OS paused it) judges no source. Bytes may be waiting unread in the
        # kernel, and a peer paused with this process may not have had its turn to send.
        late = self.is_late(now)
        self.last_tick = now
        waiting = self.waiting()
        # The progress rule: an announced version is incomplete, and the source delivered fewer
        # than min_rate x progress_s wanted bytes over the last progress_s.
        mark_t, mark_b = self.progress_mark
        if not waiting or late:
            self.progress_mark = (now, self.progress_bytes)
        elif now - mark_t >= self.config.progress_s:
            got = self.progress_bytes - mark_b
            if got < self.config.min_rate_bytes_s * (now - mark_t):
                return self.switch(
                    f"{got} wanted bytes in {now - mark_t:.1f} s while v{min(waiting)} is "
                    f"incomplete (slower than {self.config.min_rate_bytes_s:g} B/s)",
                    now,
                )
            self.progress_mark = (now, self.progress_bytes)
        if not connected or arriving:
            # A segment is still arriving: slow streams (many of them sharing a thin link)
            # are not stalled, and fetching now would send in-flight segments twice.
            return NONE
        out: list[Action] = []
        for v, st in self.versions.items():
            if (
                not st.whole
                and v not in self.refused
                and (st.ann is not None or st.reassembler is not None)
                and now - st.progress > self.config.stall_s
            ):
                st.progress = now
                out.append(act.Fetch(v, tuple(sorted(st.segments))))
        return tuple(out)
