"""The serving side of a node: authenticated subscribers, striped sends, requests.

A :class:`Server` accepts connections, authenticates each (:mod:`aurora.transport.wire`) and
groups them into subscribers keyed by (peer id, session): another peer that says it is "ca-0"
gets a subscriber of its own and can take nothing queued for ca-0. What it serves it does not
own: the node hands it three look-ups (:class:`Catalog`) over the versions the receive machine
holds, so this module imports neither the receiver nor the node (no import cycle) and a version
dropped from the node's cache is simply not found. Each segment is queued once per subscriber as
a reference, taken by whichever of its connections the kernel drains first (striping); a
subscriber may only send rate-limited control requests; slow connections, floods and
handshakes are bounded (the rules in full at :class:`Server`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from aurora.delta import Segment
from aurora.delta.announce import VersionAnnouncement
from aurora.transport import wire
from aurora.transport.actions import Action, Announce, Dropped, Forward
from aurora.transport.config import (
    MAX_LIST,
    OWN_LIMIT,
    WRITE_CHUNK,
    NodeMetrics,
    RateLimitedLog,
    TransportConfig,
    one_line,
)
from aurora.transport.table import VersionTable, is_whole
from aurora.transport.wire import AuthError, ProtocolError

log = logging.getLogger("aurora.transport")


class Catalog(Protocol):
    """What a server serves from (the node's versions: :class:`~aurora.transport.table.
    VersionTable` is one)."""

    def serving(self, version: int) -> tuple[bytes | None, list[int]] | None:
        """(signed announcement or None, held seqs in serving order: the trailer first) of
        ``version``, None when it is not held."""
        ...

    def held(self) -> list[int]:
        """Every version held, ascending."""
        ...


class Stream:
    """One connection to a subscriber. It sends its own frames first (control), then takes the
    next segment from the subscriber's queue whenever it has handed the last one to the kernel
    (striping that is round-robin while streams are equal)."""

    def __init__(self, writer: asyncio.StreamWriter, sub: Subscriber, server: Server) -> None:
        self.writer = writer
        self.sub, self.server = sub, server
        self.own: collections.deque[list[bytes]] = collections.deque()
        self.wake = asyncio.Event()
        self.alive = True
        self.segments_sent = 0
        """Segment frames this connection has taken from the subscriber's queue."""
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        timeout = self.server.config.send_timeout_s
        metrics = self.server.metrics
        transport = self.writer.transport
        low = transport.get_write_buffer_limits()[0]
        taken: tuple[int, list[bytes]] | None = None
        try:
            while True:
                if self.own:
                    pieces = self.own.popleft()
                else:
                    taken = self.sub.take(self.server.cached)
                    if taken is None:
                        self.wake.clear()
                        await self.wake.wait()
                        continue
                    version, pieces = taken
                    self.segments_sent += 1
                    metrics.hop(version, "out_first")
                # A piece at a time, in chunks, draining in between: each chunk goes from the
                # segment to the kernel as it is (writelines would join the data with its header
                # first, and a write the socket cannot take is copied into the transport's buffer
                # on Python < 3.12).
                for piece in pieces:
                    view = memoryview(piece)
                    for at in range(0, len(view), WRITE_CHUNK):
                        self.writer.write(view[at : at + WRITE_CHUNK])
                        if transport.get_write_buffer_size() <= low:
                            await self.writer.drain()  # not paused: returns at once
                        else:
                            # A timer only when the kernel did not take the chunk: the send
                            # path costs what it did when the socket keeps up.
                            async with asyncio.timeout(timeout):
                                await self.writer.drain()
                    del view
                del pieces
                if taken is not None:  # a segment, not a control frame: its last byte is out
                    metrics.hop(taken[0], "out_last", latest=True)
                    taken = None
        except TimeoutError:
            self.server.drop(self.sub, f"it took no byte for {timeout:g} s (stopped reading)")
        except (ConnectionError, OSError, RuntimeError):
            pass  # the connection is gone (RuntimeError: written after the transport closed)
        finally:
            self.alive = False

    def send(self, pieces: list[bytes]) -> None:
        """Send ``pieces`` on this connection, ahead of any segment not yet taken."""
        if not self.alive:
            return
        if len(self.own) >= OWN_LIMIT:
            self.server.drop(self.sub, f"{OWN_LIMIT} control frames queued unread")
            return
        self.own.append(pieces)
        self.wake.set()

    def abort(self) -> None:
        self.alive = False
        self.writer.transport.abort()
        if self.task is not asyncio.current_task():
            self.task.cancel()


@dataclass(eq=False)
class Subscriber:
    """One authenticated subscription: its connections and its queue of references."""

    id: str
    session: bytes
    streams: list[Stream] = field(default_factory=list)
    subscribed: bool = False
    pending: dict[tuple[int, int], None] = field(default_factory=dict)
    """Segments (version, seq) to send, in order, each once: references, resolved when a stream
    takes one, so a queue pins no segment's memory."""
    dropped: bool = False

    @property
    def key(self) -> tuple[str, bytes]:
        return (self.id, self.session)

    def live(self) -> list[Stream]:
        return [s for s in self.streams if s.alive]

    def queue(self, version: int, seqs: Iterable[int]) -> None:
        if self.dropped:
            return
        for seq in seqs:
            self.pending[(version, seq)] = None
        for s in self.live():
            s.wake.set()

    def take(self, cached: Callable[[int, int], Segment | None]) -> tuple[int, list[bytes]] | None:
        """The version and frame of the next queued segment still cached (skipping any that is
        not)."""
        while self.pending:
            version, seq = next(iter(self.pending))
            del self.pending[(version, seq)]
            seg = cached(version, seq)
            if seg is not None:
                return version, wire.segment_frame(version, seg)
        return None

    def send_control(self, msg: dict[str, Any], *, every_stream: bool = False) -> None:
        """A control frame on the first live connection, or on every one (an announcement must
        precede, on each connection, the segments it describes)."""
        live = self.live()
        frame = wire.control(msg)
        for s in live if every_stream else live[:1]:
            s.send([frame])


class Server:
    """The subscribers of one node.

    * **Striping.** Each segment is queued once per subscriber, as a reference (version, seq)
      resolved when a connection takes it: each of the subscriber's connections takes the next
      one as soon as it has handed its last to the kernel, so a slow or stalled stream stops
      taking segments once its socket buffer is full. A queue of references pins no memory. A
      subscriber that still had a dropped version queued fell ``cache_versions`` behind and is
      dropped (:meth:`forget`); it re-subscribes. A connection whose kernel takes no byte for
      ``send_timeout_s``, or that lets ``OWN_LIMIT`` control frames pile up, drops its
      subscriber.
    * **Requests.** A subscriber may only send control frames, at most ``control_rate`` per
      second on average (a token bucket); ``subscribe`` (from a version on, with what it holds)
      and ``fetch`` (what is missing of one version) queue the announcement (on every
      connection: it must precede the segments it describes), then the trailer, then the
      segments asked for. A malformed request closes that subscriber's connection, nobody
      else's.
    * **Bounded.** A handshake has ``connect_timeout_s``; one host may hold at most
      ``max_pending_handshakes`` unauthenticated connections.
    """

    def __init__(
        self,
        node_id: str,
        config: TransportConfig,
        catalog: Catalog,
        *,
        cached: Callable[[int, int], Segment | None],
        metrics: NodeMetrics,
        log: RateLimitedLog,
    ) -> None:
        self.id = node_id
        self.config = config
        self.catalog = catalog
        self.cached = cached
        """Segment ``seq`` of ``version`` if held, else None (resolved when a stream takes it)."""
        self.metrics = metrics
        self._log = log
        self.subscribers: dict[tuple[str, bytes], Subscriber] = {}
        self.pending_handshakes: collections.Counter[str] = collections.Counter()
        """Unauthenticated connections per remote host, now."""
        self.listener: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Accept subscribers on ``host:port``; returns the port."""
        self.listener = await asyncio.start_server(
            self.handle,
            host,
            port,
            ssl=self.config.ssl_server,
            ssl_handshake_timeout=self.config.connect_timeout_s if self.config.ssl_server else None,
            limit=wire.CONTROL_MAX_FRAME,
        )
        return int(self.listener.sockets[0].getsockname()[1])

    async def close(self) -> None:
        for sub in list(self.subscribers.values()):
            for s in sub.streams:
                s.abort()
        if self.listener is not None:
            self.listener.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.listener.wait_closed(), 1.0)

    # -- what the node tells every subscriber ----------------------------------------------------

    def _subscribed(self) -> list[Subscriber]:
        return [sub for sub in self.subscribers.values() if sub.subscribed]

    def announce(self, signed: bytes) -> None:
        """Forward a verified announcement, on every connection of every subscriber."""
        for sub in self._subscribed():
            sub.send_control({"op": "announce", "a": signed}, every_stream=True)

    def queue(self, version: int, seqs: Iterable[int]) -> None:
        """Queue segments of ``version`` to every subscriber (references, each once)."""
        seqs = tuple(seqs)
        for sub in self._subscribed():
            sub.queue(version, seqs)

    def send_whole(self, version: int) -> None:
        """Serve all of ``version`` to every subscriber (it arrived whole from elsewhere)."""
        for sub in self._subscribed():
            self.send_version(sub, version, set())

    def forget(self, versions: Iterable[int]) -> None:
        """``versions`` left the node's cache: a subscriber that still had one queued fell that
        far behind, and is dropped."""
        for v in versions:
            for sub in list(self.subscribers.values()):
                if any(key[0] == v for key in sub.pending):
                    self.drop(
                        sub,
                        f"it still had v{v} queued when v{v} left the cache "
                        f"({self.config.cache_versions} versions)",
                    )

    async def publish(
        self,
        table: VersionTable,
        version: int,
        segments: Iterable[Segment],
        ann: VersionAnnouncement | None,
        signed: bytes | None,
    ) -> bytes | None:
        """Serve this node's own ``D_version`` segment by segment as it is produced, in one call
        or several, under ``ann`` (verified, its ``signed`` bytes sent first; it must come no
        later than the trailer); returns the signed bytes once every segment is published. A
        whole delta (a sequence from segment 0 to the trailer) is served trailer first, so every
        hop verifies each segment on arrival."""
        now = time.monotonic()
        if ann is not None and signed is not None:
            if ann.version != version:
                raise ValueError(f"publish v{version} with the announcement of v{ann.version}")
            self._carry(table.own_announcement(ann, bytes(signed), now))
        if is_whole(segments):
            st = table.versions.get(version)
            if st is None or st.signed is None:
                raise ValueError(
                    f"node {self.id}: publishing D_{version} needs its signed announcement (the "
                    "Trainer role signs: aurora.runtime.publisher)"
                )
            assert isinstance(segments, Sequence)
            segments = [segments[-1], *segments[:-1]]  # the trailer first
        for seg in segments:
            self._carry(table.own_segment(version, seg, now))
            await asyncio.sleep(0)  # let the writers run while the producer works
        out, actions = table.own_done(version)
        self._carry(actions)
        return out

    def _carry(self, actions: Iterable[Action]) -> None:
        for a in actions:
            if isinstance(a, Forward):
                self.queue(a.version, a.seqs)
            elif isinstance(a, Announce):
                self.announce(a.signed)
            elif isinstance(a, Dropped):
                self.forget(a.versions)

    # -- connections -------------------------------------------------------------------------------

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        if self.pending_handshakes[host] >= self.config.max_pending_handshakes:
            self._log.warning(
                f"pending:{host}",
                "%s: refused a connection from %s: %d unauthenticated connections from that "
                "host already",
                self.id,
                host,
                self.config.max_pending_handshakes,
            )
            self.metrics.refused["connection"] += 1
            writer.transport.abort()
            return
        self.pending_handshakes[host] += 1
        try:
            hello = await asyncio.wait_for(
                wire.server_handshake(
                    lambda: wire.read_frame(reader, wire.HANDSHAKE_MAX_FRAME),
                    writer.write,
                    secret=self.config.secret,
                    binding=wire.channel_binding(writer),
                ),
                self.config.connect_timeout_s,
            )
            session = hello.get("session")
            if not isinstance(session, bytes) or not 8 <= len(session) <= 64:
                raise AuthError(f"peer {hello['id']!r} sent no session id")
        except (
            AuthError,
            ProtocolError,
            asyncio.IncompleteReadError,
            TimeoutError,
            OSError,
        ) as exc:
            reason = (
                f"no handshake within {self.config.connect_timeout_s:g} s"
                if isinstance(exc, TimeoutError)
                else one_line(exc)
            )
            self._log.warning(
                f"auth:{host}", "%s: refused connection from %s: %s", self.id, peer, reason
            )
            self.metrics.refused["connection"] += 1
            writer.transport.abort()
            return
        finally:
            self.pending_handshakes[host] -= 1
            if self.pending_handshakes[host] <= 0:
                del self.pending_handshakes[host]
        wire.tune_socket(
            writer, buffer_bytes=self.config.buffer_bytes, congestion=self.config.congestion
        )
        # Subscriber ids are bound to the authenticated session: another peer that says it is
        # "ca-0" gets a subscriber of its own and can take nothing queued for ca-0.
        key = (hello["id"], session)
        sub = self.subscribers.get(key)
        if sub is None:
            sub = self.subscribers[key] = Subscriber(hello["id"], session)
        stream = Stream(writer, sub, self)
        sub.streams = [*sub.live(), stream]
        bucket = wire.TokenBucket(self.config.control_rate, self.config.control_burst)
        try:
            while not sub.dropped:
                kind, body = await wire.read_frame(reader, wire.CONTROL_MAX_FRAME)
                if kind != wire.CONTROL:
                    raise ProtocolError(f"a subscriber may only send control frames, got {kind}")
                if not bucket.take():
                    raise ProtocolError(
                        f"control frames faster than {self.config.control_rate:g}/s"
                    )
                self.on_request(sub, wire.parse_control(body))
        except ProtocolError as exc:
            self._log.warning(
                f"proto:{hello['id']}",
                "%s: closing subscriber %r: %s",
                self.id,
                hello["id"],
                one_line(exc),
            )
            self.metrics.refused["control"] += 1
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        except Exception as exc:  # a bug: one line, this subscriber only
            log.error("%s: subscriber %r: %s: %s", self.id, hello["id"], type(exc).__name__, exc)
        finally:
            stream.abort()
            if not sub.live() and self.subscribers.get(key) is sub:
                del self.subscribers[key]

    def drop(self, sub: Subscriber, why: str) -> None:
        """Drop ``sub`` (it must re-subscribe), with the one-line reason."""
        if sub.dropped:
            return
        sub.dropped = True
        sub.pending.clear()
        self.metrics.refused["subscriber"] += 1
        self._log.warning(
            f"drop:{sub.id}",
            "%s: dropped subscriber %r: %s; it must re-subscribe",
            self.id,
            sub.id,
            why,
        )
        for s in sub.streams:
            s.abort()
        if self.subscribers.get(sub.key) is sub:
            del self.subscribers[sub.key]

    # -- requests ----------------------------------------------------------------------------------

    def on_request(self, sub: Subscriber, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if op == "subscribe":
            first = _int(msg.get("from", 0), "from")
            done = set(_ints(msg.get("done", ()), "done"))
            have_raw = msg.get("have", [])
            if not isinstance(have_raw, list) or len(have_raw) > 4 * self.config.cache_versions:
                raise ProtocolError("subscribe: 'have' must be a short list of [version, seqs]")
            have = {}
            for pair in have_raw:
                if not isinstance(pair, list | tuple) or len(pair) != 2:
                    raise ProtocolError("subscribe: 'have' must be a short list of [version, seqs]")
                have[_int(pair[0], "have")] = set(_ints(pair[1], "have"))
            sub.subscribed = True
            for v in self.catalog.held():
                if v >= first and v not in done:
                    self.send_version(sub, v, have.get(v, set()))
        elif op == "fetch":
            v = _int(msg.get("version"), "version")
            want = msg.get("want")
            self.send_version(
                sub,
                v,
                set(_ints(msg.get("have", ()), "have")),
                None if want is None else set(_ints(want, "want")),
            )
        else:
            raise ProtocolError(f"unknown request {str(op)[:40]!r}")

    def send_version(
        self, sub: Subscriber, version: int, have: set[int], want: set[int] | None = None
    ) -> None:
        """The announcement (on every connection), then the trailer, then the segments not
        held (or only those in ``want``)."""
        got = self.catalog.serving(version)
        if got is None:
            return
        signed, seqs = got
        if signed is not None:
            sub.send_control({"op": "announce", "a": signed}, every_stream=True)
        sub.queue(version, (s for s in seqs if s not in have and (want is None or s in want)))


def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
        raise ProtocolError(f"{what} must be a non-negative integer")
    return value


def _ints(value: object, what: str) -> list[int]:
    if not isinstance(value, list | tuple) or len(value) > MAX_LIST:
        raise ProtocolError(f"{what} must be a list of at most {MAX_LIST} integers")
    return [_int(x, what) for x in value]
