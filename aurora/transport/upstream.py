"""The receiving side's connections: ``S`` authenticated streams to one source at a time.

A subscription is ``streams`` TCP connections to one source, each authenticated
(:mod:`aurora.transport.wire`; the source proves it knows the job's secret before any frame of
it is believed to come from the job) and tuned (socket buffers, congestion control). Each is a
:class:`~aurora.transport.framing.FrameReader` whose callbacks the node wires to its receive
machine: a segment's bytes go straight into the slot the machine gives. :func:`open_streams`
makes them; :class:`Upstream` is one of them; :class:`Connector` runs the rounds of connection
attempts. Which source to connect to, and when to leave it, is the receive machine's (asked
through :class:`Chooser`); this module knows nothing of versions. Two per-connection judgments
live here, on clocks the node reads: :meth:`Upstream.stuck` and :func:`delivering`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from aurora.transport import wire
from aurora.transport.actions import Fetch
from aurora.transport.config import RateLimitedLog, TransportConfig, one_line
from aurora.transport.framing import FrameReader, SlotFn
from aurora.transport.wire import ProtocolError

log = logging.getLogger("aurora.transport")

DELIVERING_S = 0.05
"""A connection that received a byte this recently (s) is still delivering (between two
back-to-back frames of one push); also how often a node waiting to fetch looks again."""


class Upstream:
    """One connection to a source: frames arrive through a :class:`FrameReader`; this node
    only ever sends it small control frames.

    :meth:`stuck`: in the middle of a frame and silent for a limit, so close it, which hands its
    slot back for the re-fetch.
    """

    def __init__(self, source: int, where: str, bucket: wire.TokenBucket) -> None:
        self.source, self.where = source, where
        self.transport: asyncio.Transport | None = None
        self.reader: FrameReader | None = None
        self.aborted = False
        self.bucket = bucket
        """Control frames this source may send (a token bucket)."""

    @property
    def alive(self) -> bool:
        return self.reader is not None and not (self.reader.closed or self.aborted)

    def stuck(self, now: float, limit_s: float) -> bool:
        """In the middle of a frame and silent for ``limit_s``."""
        assert self.reader is not None
        return self.reader.frame_since is not None and now - self.reader.last_byte >= limit_s

    def send(self, pieces: list[bytes]) -> None:
        if self.alive and self.transport is not None:
            self.transport.writelines(pieces)

    def abort(self) -> None:
        self.aborted = True  # at once: the transport reports the loss on the next loop turn
        if self.reader is not None:
            self.reader.stop()
        if self.transport is not None:
            self.transport.abort()


def announcement_in(kind: int, body: bytes) -> bytes:
    """The signed bytes of the announcement a source's control frame carries (the only message
    a source sends); ProtocolError for anything else."""
    if kind != wire.CONTROL:
        raise ProtocolError(f"unexpected frame type {kind} from the source")
    msg = wire.parse_control(body)
    op = msg["op"]
    if op != "announce":
        raise ProtocolError(f"unknown message {str(op)[:40]!r}")
    signed = msg.get("a")
    if not isinstance(signed, bytes):
        raise ProtocolError("announce without the signed bytes")
    return signed


def delivering(up: Upstream, now: float) -> bool:
    """The source is sending on this connection now: in the middle of a frame, or a byte came
    within the last ``DELIVERING_S``. The source is pushing then, so asking it for what is
    missing now would have it sent twice."""
    r = up.reader
    return r is not None and (r.frame_since is not None or now - r.last_byte < DELIVERING_S)


async def open_streams(
    node_id: str,
    config: TransportConfig,
    source: int,
    host: str,
    port: int,
    *,
    slot: Callable[[Upstream], SlotFn],
    received: Callable[[Upstream], Callable[..., None]],
    abandon: Callable[[int, memoryview], None],
    control: Callable[[Upstream], Callable[[int, bytes], None]],
) -> list[Upstream]:
    """``config.streams`` authenticated connections to ``host:port`` (source index ``source``),
    one subscription (a fresh session id); each reader's callbacks are made per connection by
    ``slot``, ``received`` and ``control``. Raises what connecting raised, leaving nothing open."""
    loop = asyncio.get_running_loop()
    session = os.urandom(16)  # a new subscription: the source keys it by (id, session)
    streams: list[Upstream] = []
    try:
        for i in range(config.streams):
            up = Upstream(
                source,
                f"{host}:{port}",
                wire.TokenBucket(config.control_rate, config.control_burst),
            )
            streams.append(up)
            transport, reader = await loop.create_connection(
                lambda up=up: FrameReader(
                    slot=slot(up),
                    received=received(up),
                    abandon=abandon,
                    name=f"{node_id}<-{host}:{port}",
                ),
                host,
                port,
                ssl=config.ssl_client,
                ssl_handshake_timeout=config.connect_timeout_s if config.ssl_client else None,
            )
            up.transport, up.reader = transport, reader
            await wire.client_handshake(
                reader.recv,
                transport.write,
                secret=config.secret,
                hello={"id": node_id, "session": session, "stream": i, "streams": config.streams},
                binding=wire.channel_binding(transport),
            )
            reader.authenticated = True  # the source proved it knows the secret
            reader.control = control(up)
            reader.deliver_queued()
            wire.tune_socket(
                transport, buffer_bytes=config.buffer_bytes, congestion=config.congestion
            )
    except BaseException:
        for s in streams:
            s.abort()
        raise
    return streams


class Chooser(Protocol):
    """What a connection round asks the receive machine (:class:`~aurora.transport.receiver.
    Receiver` is one)."""

    def next_source(self) -> int | None: ...

    def unreachable(self, source: int, reason: str, now: float) -> None: ...

    def connected(self, source: int, now: float) -> None: ...

    def subscription(self) -> dict[str, object]: ...

    def missing(self, version: int) -> Fetch | None: ...


class Connector:
    """The connections of one node to its current source, and the rounds that make them: the
    source the machine chooses, then the next, until one answers (it is sent the machine's
    ``subscribe``). One round at a time; a round that :meth:`replace` overtakes (the Ledger
    re-routed this node while it was connecting) drops what it reached and starts over on the
    new list."""

    def __init__(
        self,
        node_id: str,
        config: TransportConfig,
        machine: Chooser,
        connect: Callable[[int, str, int], Awaitable[list[Upstream]]],
        *,
        log: RateLimitedLog,
        sources: list[tuple[str, int]],
    ) -> None:
        self.id, self.config, self.machine, self.connect = node_id, config, machine, connect
        self._log = log
        self.sources = sources
        self.streams: list[Upstream] = []
        """The connections to the current source (some may have died since)."""
        self.running = False
        """A round is under way."""
        self.gen = 0
        """Bumped by :meth:`replace`: a round of an older generation keeps nothing."""

    def live(self) -> list[Upstream]:
        return [s for s in self.streams if s.alive]

    def drop(self) -> None:
        """Close every connection to the current source."""
        for s in self.streams:
            s.abort()
        self.streams = []

    def fetch(self, fetch: Fetch) -> None:
        """Ask the current source for what ``fetch`` does not hold (nothing without one)."""
        live = self.live()
        if live:
            live[0].send([self.fetch_msg(fetch)])

    def fetch_msg(self, fetch: Fetch) -> bytes:
        return wire.control({"op": "fetch", "version": fetch.version, "have": list(fetch.have)})

    def fetch_when_idle(self, version: int) -> None:
        """Ask for what is missing of ``version`` once the current source is not sending
        (asking while it pushes would have it sent twice): looked at again every
        ``DELIVERING_S``."""
        live = self.live()
        if not live or self.machine.missing(version) is None:
            return
        now = time.monotonic()
        if any(delivering(u, now) for u in live if u.source == live[0].source):
            asyncio.get_running_loop().call_later(DELIVERING_S, self.fetch_when_idle, version)
            return
        fetch = self.machine.missing(version)
        assert fetch is not None
        live[0].send([self.fetch_msg(fetch)])

    def close_stuck(self, now: float, limit_s: float) -> None:
        """Close every connection silent mid-frame for ``limit_s``: stuck, not slow (closing it
        hands its slot back for the re-fetch)."""
        for s in self.live():
            if s.stuck(now, limit_s):
                self._log.warning(
                    "silent", "%s: an upstream stream is silent mid-frame; closing it", self.id
                )
                s.abort()

    def replace(self, sources: list[tuple[str, int]]) -> None:
        """A new list of sources: the current connections go."""
        self.sources = sources
        self.gen += 1
        self.drop()

    async def round(self) -> list[str]:
        """Connect to the next usable source (then the ones after it) until one answers;
        returns why each one tried failed."""
        errors: list[str] = []
        if self.running:
            return errors
        self.running = True
        try:
            while True:
                gen = self.gen
                await self._try_sources(gen, errors)
                if gen == self.gen:
                    return errors
                self._log.warning("rerouted", "%s: re-routed while connecting", self.id)
        finally:
            self.running = False

    async def _try_sources(self, gen: int, errors: list[str]) -> None:
        """One pass over the sources of generation ``gen``; it returns early, keeping nothing,
        once they have been replaced."""
        for _ in range(len(self.sources)):
            source = self.machine.next_source()
            if source is None:
                return
            host, port = self.sources[source]
            where = f"{host}:{port}"
            try:
                streams = await asyncio.wait_for(
                    self.connect(source, host, port), self.config.connect_timeout_s
                )
            except (OSError, asyncio.IncompleteReadError, TimeoutError, ConnectionError) as exc:
                if gen != self.gen:
                    return  # ``source`` indexes the old list: nothing to record against it
                reason = (
                    f"no answer within {self.config.connect_timeout_s:g} s"
                    if isinstance(exc, TimeoutError)
                    else one_line(exc)
                )
                errors.append(f"{where}: {reason}")
                self._log.warning(
                    f"connect:{source}", "%s: cannot use %s: %s", self.id, where, reason
                )
                self.machine.unreachable(source, reason, time.monotonic())
                continue
            if gen != self.gen:
                for up in streams:
                    up.abort()
                return
            self.machine.connected(source, time.monotonic())
            self.streams = streams
            log.info("%s: subscribed to %s with %d streams", self.id, where, len(streams))
            streams[0].send([wire.control(self.machine.subscription())])
            return
