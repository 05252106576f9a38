"""A data-plane node: source (Trainer), relay, or receiver (Actor) of delta checkpoints.

Every node can *serve* (accept authenticated subscribers) and *subscribe* (to an upstream
source, with a list of fallbacks). The Trainer only serves; a relay does both; an Actor only
subscribes. :class:`Node` is the asyncio shell around three parts that do not know of one
another, so none imports another (the receive rules call no socket, the server calls no rule):
the **receive machine** (:class:`~aurora.transport.receiver.Receiver`: no I/O, no clock; the
shell feeds it events with ``now`` and carries out the actions it returns), the **server**
(:class:`~aurora.transport.server.Server`) and the **upstream connections**
(:mod:`aurora.transport.upstream`). The transport signs nothing: every node verifies every
announcement against the job's public key before anything depends on it. See
``docs/TRANSPORT.md`` for the rules in full.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

from aurora.delta import Delta, Segment
from aurora.delta.announce import AnnouncementError, VersionAnnouncement
from aurora.transport import actions as act
from aurora.transport.arenas import ArenaPool
from aurora.transport.config import (
    SILENT_LIMIT_STALLS,
    NodeMetrics,
    RateLimitedLog,
    TransportConfig,
    VersionRefused,
    one_line,
)
from aurora.transport.receiver import Receiver
from aurora.transport.server import Server, Subscriber
from aurora.transport.table import VersionState
from aurora.transport.upstream import Connector, Upstream, announcement_in, open_streams
from aurora.transport.wire import ProtocolError

log = logging.getLogger("aurora.transport")
T = TypeVar("T")

__all__ = ["Node", "NodeMetrics", "TransportConfig", "VersionRefused", "run"]


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run a data-plane coroutine on uvloop when it is installed (faster sockets), else on the
    standard asyncio loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    result: T = uvloop.run(main)
    return result


StagedCallback = Callable[[Delta, VersionAnnouncement], None]
"""Called with a verified, staged delta and the Trainer's announcement it matched."""
RefusedCallback = Callable[[int, str], None]
"""Called with a version this node will not stage and the one-line reason."""
FallbackFn = Callable[[int], Awaitable[bytes]]
"""Returns the whole file of ``D_v`` from somewhere else (the Checkpoint Store)."""


class Node:
    """One participant of the data plane: the asyncio shell around the receive machine, the
    server and the upstream connections.

    * the **receive machine** (:class:`~aurora.transport.receiver.Receiver`): announcements,
      reassembly, verification, blame, the stall and progress rules, staging. The shell feeds it
      events with ``now`` and carries out the actions it returns
      (:mod:`aurora.transport.actions`): a ``Fetch`` on the current source's first connection, a
      ``Switch`` of source, segments ``Forward``-ed to subscribers, a ``Staged`` callback, a log
      line;
    * the **server** (:class:`~aurora.transport.server.Server`): subscribers, striping,
      requests, serving from the machine's version table through the node (:meth:`_cached`,
      which fault injection and the hostile relays of the tests override);
    * the **upstream connections** (:mod:`aurora.transport.upstream`): ``S`` authenticated
      streams to the source the machine chose, whose frame readers put segment bytes straight
      into the slots the machine gives (no copy after the kernel's).

    The shell itself reads the clock, runs the watchdog (every ``stall_s / 2``: the
    stuck-stream rule on each connection, then the machine's tick), connects rounds of sources
    (backing off as the machine says), runs the fallback (the Checkpoint Store) when the machine
    gives a version up, and wakes whoever waits (:meth:`wait_for`).

    Who signs, who stages. A source publishes the announcement it is given (the Trainer role
    signs, :mod:`aurora.runtime.publisher`). The receive machine is the one place that knows what
    the data plane has staged (:attr:`staged`); the Actor role owns what its weights run and
    tells the node (:meth:`set_active`), which releases everything up to it. Memory: a relay
    keeps the newest ``cache_versions`` versions; an Actor what it has not activated.
    """

    def __init__(
        self,
        node_id: str,
        config: TransportConfig,
        *,
        sources: Iterable[tuple[str, int]] = (),
        active: tuple[int, str] | None = None,
        on_staged: StagedCallback | None = None,
        on_refused: RefusedCallback | None = None,
        fallback: FallbackFn | None = None,
    ) -> None:
        self.id = node_id
        self.config = config
        self.sources = list(sources)
        self.on_staged, self.on_refused = on_staged, on_refused
        self._fallback = fallback
        self.metrics = NodeMetrics()
        self._log = RateLimitedLog()
        self._arenas = ArenaPool(config.max_delta_bytes)
        if config.prefault_bytes:
            self._arenas.prefault(config.prefault_bytes)
        self.receiver = Receiver(
            node_id,
            config,
            sources=self._names(),
            active=active,
            arenas=self._arenas,
            metrics=self.metrics,
            now=time.monotonic(),
            fallback=fallback is not None,
        )
        self.server = Server(
            node_id,
            config,
            self.receiver.table,
            cached=lambda version, seq: self._cached(version, seq),
            metrics=self.metrics,
            log=self._log,
        )
        self.up = Connector(
            node_id,
            config,
            self.receiver,
            lambda source, host, port: self._connect(source, host, port),
            log=self._log,
            sources=self.sources,
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self._changed = asyncio.Event()
        self._watching = False

    def _names(self) -> list[str]:
        return [f"{h}:{p}" for h, p in self.sources]

    # -- what the machines hold, as the runtime and the tests read it --------------------------

    @property
    def fallback(self) -> FallbackFn | None:
        """Where a version no source can complete comes from, whole (None: it is refused)."""
        return self._fallback

    @fallback.setter
    def fallback(self, fn: FallbackFn | None) -> None:
        self._fallback = fn
        self.receiver.fallback = fn is not None

    @property
    def versions(self) -> dict[int, VersionState]:
        return self.receiver.versions

    @property
    def staged(self) -> dict[int, Delta]:
        """Staged deltas by version: the one place the data plane keeps them."""
        return self.receiver.staged

    @property
    def refused(self) -> dict[int, str]:
        return self.receiver.refused

    @property
    def announcements(self) -> dict[int, VersionAnnouncement]:
        return self.receiver.announcements

    @property
    def active(self) -> tuple[int, str] | None:
        """(version, weights hash) the weights run (:meth:`set_active`); None for a relay."""
        return self.receiver.active

    @property
    def subscribers(self) -> dict[tuple[str, bytes], Subscriber]:
        """Connected subscribers by (peer id, session)."""
        return self.server.subscribers

    @property
    def corrupt_segments(self) -> int:
        """Segments refused as corrupt or refuted (a counter for tests and logs)."""
        return self.metrics.refused["segment"]

    def _cached(self, version: int, seq: int) -> Segment | None:
        """What the server sends for a queued (version, seq): fault injection overrides it."""
        return self.receiver.table.cached(version, seq)

    # -- lifecycle -----------------------------------------------------------------------------

    async def serve(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Accept subscribers; returns the port."""
        return await self.server.start(host, port)

    async def subscribe(self) -> None:
        """Subscribe to the first source that answers (trying the next ones in turn); the node
        keeps (re)connecting in the background from then on. Raises ConnectionError naming every
        source when none could be reached this time."""
        if not self.sources:
            raise ValueError(f"node {self.id}: no source to subscribe to")
        if not self._watching:
            self._watching = True
            self._spawn(self._watchdog())
        errors = await self._connect_round()
        if not self._live():
            raise ConnectionError(f"node {self.id}: no source reachable ({'; '.join(errors)})")

    def set_sources(self, sources: Iterable[tuple[str, int]]) -> None:
        """Replace the list of sources (the Ledger re-routed this node: a new relay, a
        fallback). A node subscribed elsewhere leaves its source and connects to the first of the
        new list; what each source was blamed for is forgotten with the old list."""
        new = list(sources)
        if new == self.sources:
            return
        self.sources = new
        self.receiver.set_sources(self._names())
        self.up.replace(new)
        if self._watching and self.sources:
            self._spawn(self._reconnect())

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for s in self._upstream:
            s.abort()
        await self.server.close()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- carrying out the machine's actions ------------------------------------------------------

    def _carry(self, actions: Iterable[act.Action]) -> None:
        any_ = False
        for a in actions:
            any_ = True
            if isinstance(a, act.Forward):
                self.server.queue(a.version, a.seqs)
            elif isinstance(a, act.Fetch):
                self.up.fetch(a)
            elif isinstance(a, act.FetchWhenIdle):
                self.up.fetch_when_idle(a.version)
            elif isinstance(a, act.Announce):
                self.server.announce(a.signed)
            elif isinstance(a, act.Switch):
                self._leave(a.source, a.why)
            elif isinstance(a, act.Blame):
                self._log.warning(
                    f"blame:{a.source}:{a.version}",
                    "%s: %s sent %s for v%d; not using it again for that version",
                    self.id,
                    self._where(a.source),
                    a.what,
                    a.version,
                )
            elif isinstance(a, act.Complete):
                self.metrics.hop(a.version, "in_last")
            elif isinstance(a, act.Staged):
                self.metrics.hop(a.delta.version, "staged")
                if self.on_staged is not None:
                    self._call_back("on_staged", self.on_staged, a.delta, a.ann)
            elif isinstance(a, act.Refused):
                r = a.reason
                log.warning("%s: %s", self.id, r if r.startswith("D_") else f"D_{a.version}: {r}")
                if self.on_refused is not None:
                    self._call_back("on_refused", self.on_refused, a.version, a.reason)
            elif isinstance(a, act.Fallback):
                self._spawn(self._from_fallback(a.version, a.reason))
            elif isinstance(a, act.Dropped):
                self.server.forget(a.versions)
            elif isinstance(a, act.Note):
                if a.info:
                    log.info("%s: %s", self.id, a.message)
                else:
                    self._log.warning(a.key, "%s: %s", self.id, a.message)
        if any_:
            self._changed.set()

    def _where(self, source: int) -> str:
        return self._names()[source] if source < len(self.sources) else f"source {source}"

    def _call_back(self, name: str, fn: Callable[..., object], *args: object) -> None:
        """Run the runtime's callback; what it raises is its bug, logged in one line, and does
        not break this node's receive path."""
        try:
            fn(*args)
        except Exception as exc:
            log.error(
                "%s: the %s callback failed: %s: %s",
                self.id,
                name,
                type(exc).__name__,
                one_line(exc),
            )

    # -- announcements and publishing ----------------------------------------------------------

    def announce(self, signed: bytes) -> VersionAnnouncement:
        """Hand this node a signed version announcement (from the Ledger, the Checkpoint Store,
        anyone): verified against the job's key, then acted on and forwarded. Raises an
        :class:`~aurora.delta.announce.AnnouncementError` with the one-line reason."""
        ann = self.receiver.verify(signed)
        self._on_announcement(ann, bytes(signed), None)
        return ann

    def _on_announcement(self, ann: VersionAnnouncement, signed: bytes, via: int | None) -> None:
        """A verified announcement, from source ``via`` (None: handed by the runtime)."""
        self._carry(self.receiver.announcement(ann, signed, via, time.monotonic()))

    async def publish(
        self,
        version: int,
        segments: Iterable[Segment],
        *,
        announcement: bytes | None = None,
    ) -> bytes | None:
        """Publish ``D_version`` segment by segment as they are produced (cut-through), in one
        call or several; returns its signed announcement once every segment is published.

        ``announcement`` (signed bytes: the Trainer role signs, :mod:`aurora.runtime.publisher`,
        or the Checkpoint Store kept it) is verified and sent first; it must come no later than
        the trailer. Given with a whole delta (a sequence from segment 0 to the trailer), the
        trailer goes first, so every hop verifies each segment on arrival."""
        ann = None if announcement is None else self.receiver.verify(announcement)
        return await self.server.publish(self.receiver.table, version, segments, ann, announcement)

    def segment(self, version: int, seq: int) -> Segment | None:
        """Segment ``seq`` of ``version`` as this node holds it (None if it does not)."""
        return self.receiver.table.cached(version, seq)

    # -- upstream --------------------------------------------------------------------------------

    @property
    def _upstream(self) -> list[Upstream]:
        """The connections to the current source (some may have died since)."""
        return self.up.streams

    @_upstream.setter
    def _upstream(self, streams: list[Upstream]) -> None:
        self.up.streams = streams

    def _live(self) -> list[Upstream]:
        return self.up.live()

    async def _connect_round(self) -> list[str]:
        return await self.up.round()

    async def _connect(self, source: int, host: str, port: int) -> list[Upstream]:
        return await open_streams(
            self.id,
            self.config,
            source,
            host,
            port,
            slot=lambda up: lambda *a: self._slot(up, *a),
            received=lambda up: lambda v, seg: self._accept(up, v, seg),
            abandon=self.receiver.abandon,
            control=lambda up: lambda kind, body: self._on_upstream_frame(up, kind, body),
        )

    def _leave(self, source: int, why: str) -> None:
        """The machine left ``source``: close its connections and connect to the next one."""
        self.metrics.source_switches += 1
        self._log.warning(
            f"switch:{source}", "%s: leaving %s: %s", self.id, self._where(source), why
        )
        self.up.drop()
        self._spawn(self._reconnect())

    async def _reconnect(self) -> None:
        if not self.receiver.choice.ready(time.monotonic()):
            return  # the watchdog connects once the backoff is over
        with contextlib.suppress(Exception):
            await self._connect_round()
        self._carry(self.receiver.check_refusals())

    def _on_upstream_frame(self, up: Upstream, kind: int, body: bytes) -> None:
        """A control frame from a source, acted on as it arrives (between segments)."""
        if up.aborted:
            return
        if not up.bucket.take():
            self.metrics.refused["control"] += 1
            why = f"control frames faster than {self.config.control_rate:g}/s"
            self._carry(self.receiver.switch(why, time.monotonic()))
            return
        try:
            signed = announcement_in(kind, body)
            try:
                ann = self.receiver.verify(signed)
            except AnnouncementError as exc:
                self.metrics.refused["announcement"] += 1
                why = f"it sent an announcement that does not verify: {one_line(exc)}"
                self._carry(self.receiver.switch(why, time.monotonic()))
                return
            self._on_announcement(ann, signed, up.source)
        except ProtocolError as exc:
            # One bad message is dropped, not the connection: a flood of them is what the rate
            # limit is for.
            self.metrics.refused["control"] += 1
            self._log.warning(
                f"ctl:{up.source}",
                "%s: ignored a message from %s: %s",
                self.id,
                up.where,
                one_line(exc),
            )

    def _slot(
        self,
        up: Upstream,
        version: int,
        key: str,
        seq: int,
        offset: int,
        length: int,
        trailer: bool,
    ) -> memoryview | None:
        """Where a segment's bytes go as they arrive, or None to read them into scratch."""
        view = None
        if not up.aborted:
            view, actions = self.receiver.slot(
                up.source, version, key, seq, offset, length, trailer, time.monotonic()
            )
            if actions:
                self._carry(actions)
        if view is None:
            self.metrics.segments_discarded += 1
        else:
            self.metrics.hop(version, "in_first")
        return view

    def _accept(self, up: Upstream, version: int, seg: Segment) -> None:
        self._carry(self.receiver.segment(up.source, version, seg, time.monotonic()))

    # -- the watchdog ----------------------------------------------------------------------------

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(self.config.stall_s / 2)
            try:
                await self._tick(time.monotonic())
            except Exception as exc:  # a bug here must not end the node's recovery
                log.error("%s: watchdog: %s: %s", self.id, type(exc).__name__, one_line(exc))

    async def _tick(self, now: float) -> None:
        live = self._live()
        if not live:
            if self._upstream:
                self._log.warning("lost", "%s: lost every stream to its source", self.id)
                self.receiver.lost(now)
                self._upstream = []
                self.metrics.source_switches += 1
            if self.receiver.choice.ready(now) and not self.up.running:
                await self._connect_round()
            self._carry(self.receiver.check_refusals())
            return
        # The stuck rule, skipped on a late tick (the machine's rule: what arrived while this
        # process was paused is read first), not restarted: the first tick on time after a
        # pause (stall_s / 2 later) closes a stream that was already silent for the limit.
        if not self.receiver.is_late(now):
            self.up.close_stuck(now, SILENT_LIMIT_STALLS * self.config.stall_s)
        live = [s for s in live if s.alive]
        arriving = any(s.reader is not None and s.reader.frame_since for s in live)
        self._carry(self.receiver.tick(now, connected=bool(live), arriving=arriving))

    # -- whole files, requests, the active version -----------------------------------------------

    async def _from_fallback(self, version: int, why: str) -> None:
        try:  # whatever happens, the version leaves in_fallback (else it is never refused)
            if self.fallback is None:
                raise RuntimeError("no fallback is set")
            data = await self.fallback(version)
            self.add_file(data)
        except Exception as exc:  # anything the fallback raises is its one-line reason
            why = f"{why}; the fallback failed too: {one_line(exc)}"
            self._carry(self.receiver.fallback_failed(version, why))
        finally:
            self.receiver.in_fallback.discard(version)

    def add_file(self, data: bytes | bytearray | memoryview) -> Delta:
        """Take ``D_v`` as a whole file (the Checkpoint Store, a fallback): verified against its
        announcement (which this node must have), then served and staged like a received one.
        Raises a DeltaError (AnnouncementError when the version is not announced)."""
        delta, actions = self.receiver.add_file(data, time.monotonic())
        self._carry(actions)
        return delta

    def request(self, first: int, last: int) -> None:
        """Ask for ``D_first .. D_last`` again (catch-up, or a retry after a refusal): their
        refusals and source history are forgotten and the current source is asked for what is
        missing (the next source on connecting)."""
        self._carry(self.receiver.request(first, last, time.monotonic()))

    async def delta(self, version: int, timeout: float) -> tuple[Delta, VersionAnnouncement]:
        """Wait until ``D_version`` is staged: (the verified delta, the announcement it matched).
        Raises :class:`VersionRefused` with the reason if it is refused, TimeoutError after
        ``timeout`` s."""
        await self.wait_for(lambda: version in self.staged or version in self.refused, timeout)
        if version in self.refused:
            raise VersionRefused(version, self.refused[version])
        return self.staged[version], self.announcements[version]

    def release(self, upto: int) -> None:
        """Forget every version up to ``upto`` (this node has applied them, or no longer serves
        them): the segments, the staged delta and the refusals. Each version's arena goes back to
        the pool as soon as the caller, too, holds no ``Delta`` of it, so a node that releases
        each version after applying it receives the next one into memory already committed."""
        self.receiver.release(upto)

    def set_active(self, version: int, weights_hash: str) -> None:
        """The weights now run ``version`` (the Actor role decided it may: an activated delta, a
        catch-up): later deltas are checked against it, everything up to it is released, and
        complete versions above it that build on it are staged. ValueError backwards."""
        self._carry(self.receiver.set_active(version, weights_hash))
        self._changed.set()

    # -- waiting (tests, runtime) -------------------------------------------------------------

    async def wait_for(self, predicate: Callable[[], bool], timeout: float) -> None:
        """Wait until ``predicate()`` holds (checked whenever a version completes)."""
        deadline = time.monotonic() + timeout
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"node {self.id}: condition not met within {timeout} s")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 0.1))
