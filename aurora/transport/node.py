"""A data-plane node: source (Trainer), relay, or receiver (Actor) of delta checkpoints.

Theory of operation
-------------------
Every node can *serve* (accept authenticated subscribers) and *subscribe* (to an upstream
source, with a list of fallbacks). The Trainer only serves; a relay does both; an Actor only
subscribes. A subscription is ``S`` TCP connections to the source, each authenticated
(:mod:`aurora.transport.wire`), with socket buffers and congestion control set per socket.

* **Striping.** A source queues each segment of ``D_v`` once per subscriber, and each of the
  subscriber's connections takes the next one as soon as it has handed its last to the kernel:
  round-robin while the streams are equal, and a slow or stalled stream stops taking segments
  once its socket buffer is full, so it delays only the few it holds.
* **Receive in place.** Each upstream connection is a :class:`~aurora.transport.framing.
  FrameReader`: the bytes of a segment go from the socket straight into the slot the
  :class:`aurora.delta.Reassembler` gives for them, in one arena per delta
  (:mod:`aurora.delta.arena`, pooled by :mod:`aurora.transport.arenas`), and the complete file is
  parsed where it lies. No byte is copied after the kernel's copy out of the socket.
* **Verify, then forward.** A receiver checks every segment (its leaf hash; once the trailer is
  in, the trailer's hash list and Merkle root) with the reassembler before doing anything with
  it. A relay forwards each verified segment to its own subscribers
  the moment it has it (cut-through), and caches it to serve catch-up and re-fetches.
* **Nothing lost.** A receiver that makes no progress on an incomplete version for ``stall_s``
  (a stream broke, a segment was refused as corrupt, the relay vanished) sends ``FETCH`` with the
  segments it holds, and the source sends the rest; if every connection to the source is gone it
  subscribes to the next source in its list (a peer relay, or the Trainer) and fetches there.
* **Staging.** A complete version is verified whole (``Reassembler.result``) and then staged
  only if its base is the receiver's active version or a version it has staged (same hash); a
  delta on a foreign base is refused with the reason, never half-staged.
* **Commit** travels the same tree after the data: a relay forwards ``COMMIT(v)`` only once it
  holds ``D_v`` whole.
* **Memory.** An Actor calls :meth:`Node.activate` once it has applied ``D_v``; everything up to
  ``v`` is released and its arena goes back to the pool for the next delta. A source or relay
  keeps the newest ``cache_versions`` versions.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import ssl
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from aurora.delta import Delta, Reassembler, Segment
from aurora.delta.arena import DEFAULT_CAPACITY
from aurora.delta.errors import DeltaError
from aurora.policy._fsm import IllegalTransition
from aurora.policy.staging import ActorVersions
from aurora.transport import wire
from aurora.transport.arenas import ArenaPool
from aurora.transport.framing import FrameReader
from aurora.transport.wire import AuthError, ProtocolError

log = logging.getLogger("aurora.transport")


@dataclass(frozen=True, kw_only=True)
class TransportConfig:
    """Data-plane settings shared by every node of a job."""

    secret: bytes
    """The job's shared secret; every connection proves knowledge of it (HMAC-SHA256)."""
    streams: int = 4
    """Parallel TCP connections per subscription (S)."""
    buffer_bytes: int = 8 << 20
    """SO_SNDBUF / SO_RCVBUF asked for on every socket (bytes)."""
    congestion: str | None = None
    """TCP congestion control per socket (e.g. ``bbr``, ``cubic``); None keeps the default."""
    stall_s: float = 0.5
    """Seconds without progress on an incomplete version before re-fetching what is missing."""
    connect_timeout_s: float = 5.0
    """Seconds to connect and authenticate before trying the next source."""
    ssl_server: ssl.SSLContext | None = None
    """TLS for served connections (optional; authentication does not depend on it)."""
    ssl_client: ssl.SSLContext | None = None
    """TLS for outgoing connections."""
    max_delta_bytes: int = DEFAULT_CAPACITY
    """Largest delta a receiver accepts (bytes): the address space reserved for each one it
    reassembles (committed only as bytes arrive; :mod:`aurora.delta.arena`)."""
    cache_versions: int = 8
    """Versions a source or relay keeps in memory to serve late subscribers and re-fetches; older
    ones are dropped (catch-up further back comes from the Checkpoint Store). An Actor keeps what
    it has not yet activated (:meth:`Node.activate`)."""
    prefault_bytes: int = 0
    """Receive memory committed when the node is made, before the first delta (bytes): set it to
    the expected delta size so that the first one, too, arrives into committed pages."""

    def __post_init__(self) -> None:
        if len(self.secret) < 16:
            raise ValueError("TransportConfig.secret must be at least 16 bytes")
        if self.streams < 1:
            raise ValueError(f"TransportConfig.streams must be >= 1, got {self.streams}")
        if not self.stall_s > 0:
            raise ValueError(f"TransportConfig.stall_s must be > 0, got {self.stall_s}")
        if self.cache_versions < 1:
            raise ValueError(
                f"TransportConfig.cache_versions must be >= 1, got {self.cache_versions}"
            )
        if self.max_delta_bytes < 1024:
            raise ValueError(
                f"TransportConfig.max_delta_bytes must be >= 1024, got {self.max_delta_bytes}"
            )
        if not 0 <= self.prefault_bytes <= self.max_delta_bytes:
            raise ValueError(
                f"TransportConfig.prefault_bytes must be in 0..max_delta_bytes, "
                f"got {self.prefault_bytes}"
            )


def run(main):  # type: ignore[no-untyped-def]
    """Run a data-plane coroutine on uvloop when it is installed (faster sockets), else on the
    standard asyncio loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


_SILENT_LIMIT_STALLS = 10
"""A stream in the middle of a frame that has received no byte for this many ``stall_s`` is
stuck (5 s by default: longer than TCP's retransmission backoff after three losses in a row)
and is closed. A slow stream that keeps receiving is never closed, however long a frame takes."""


_WRITE_CHUNK = 1 << 20
"""Bytes handed to a socket per write (1 MiB: below the send buffer, so most go straight in)."""


class _Stream:
    """One connection to a subscriber. It sends its own frames first (control), then pulls the
    next segment from the subscriber's shared queue whenever it has handed the last one to the
    kernel, so a slow or stalled stream stops taking segments once its socket buffer is full
    and the others carry the rest (striping that is round-robin while streams are equal)."""

    def __init__(
        self, writer: asyncio.StreamWriter, shared: collections.deque[list[bytes]]
    ) -> None:
        self.writer = writer
        self.own: collections.deque[list[bytes]] = collections.deque()
        self.shared = shared
        self.wake = asyncio.Event()
        self.alive = True
        self.segments_sent = 0
        """Segment frames this connection has taken from the shared queue."""
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            while True:
                if self.own:
                    pieces = self.own.popleft()
                elif self.shared:
                    pieces = self.shared.popleft()
                    self.segments_sent += 1
                else:
                    self.wake.clear()
                    await self.wake.wait()
                    continue
                # A piece at a time, in chunks, draining in between: each chunk goes from the
                # segment to the kernel as it is. writelines would first join the data with its
                # header, and a 4 MiB write the socket cannot take at once leaves the rest to be
                # copied into the transport's buffer (Python < 3.12): a copy of every byte sent.
                for piece in pieces:
                    view = memoryview(piece)
                    for at in range(0, len(view), _WRITE_CHUNK):
                        self.writer.write(view[at : at + _WRITE_CHUNK])
                        await self.writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self.alive = False

    def send(self, pieces: list[bytes]) -> None:
        """Send ``pieces`` on this connection, ahead of any segment not yet taken."""
        if self.alive:
            self.own.append(pieces)
            self.wake.set()

    def abort(self) -> None:
        self.alive = False
        self.writer.transport.abort()
        self.task.cancel()


class _Upstream:
    """One connection to the source: frames arrive through a :class:`FrameReader`; this node
    only ever sends it small control frames."""

    def __init__(self, transport: asyncio.Transport, reader: FrameReader) -> None:
        self.transport = transport
        self.reader = reader
        self.aborted = False

    @property
    def alive(self) -> bool:
        return not (self.reader.closed or self.aborted)

    def stuck(self, now: float, limit_s: float) -> bool:
        """In the middle of a frame and silent for ``limit_s``."""
        return self.reader.frame_since is not None and now - self.reader.last_byte >= limit_s

    def send(self, pieces: list[bytes]) -> None:
        if self.alive:
            self.transport.writelines(pieces)

    def abort(self) -> None:
        self.aborted = True  # at once: the transport reports the loss on the next loop turn
        self.transport.abort()


@dataclass
class _Subscriber:
    id: str
    streams: list[_Stream] = field(default_factory=list)
    subscribed: bool = False
    pending: collections.deque[list[bytes]] = field(default_factory=collections.deque)
    """Segment frames not yet taken by a stream (each live stream pulls from here)."""

    def live(self) -> list[_Stream]:
        return [s for s in self.streams if s.alive]

    def add_stream(self, writer: asyncio.StreamWriter) -> _Stream:
        if not self.live():
            self.pending.clear()  # left from connections that died: it re-subscribes or fetches
        stream = _Stream(writer, self.pending)
        self.streams = [*self.live(), stream]
        return stream

    def send_segment(self, version: int, seg: Segment) -> None:
        live = self.live()
        if not live:
            # Nobody to take it: the subscriber re-subscribes or fetches what it misses.
            self.pending.clear()
            return
        self.pending.append(wire.segment_frame(version, seg))
        for s in live:
            s.wake.set()

    def send_control(self, msg: dict) -> None:
        live = self.live()
        if live:
            live[0].send([wire.control(msg)])


@dataclass
class _Version:
    reassembler: Reassembler | None = None
    """Set on receivers when the first segment arrives (a source has its own segments)."""
    segments: dict[int, Segment] = field(default_factory=dict)
    """Verified segments by seq (the trailer under its seq too)."""
    delta: Delta | None = None
    commit_pending: bool = False
    progress: float = field(default_factory=time.monotonic)
    received_at: float | None = None
    """When the last segment arrived verified (monotonic s), before the whole-file parse."""


class Node:
    """One participant of the data plane (see the module docstring)."""

    def __init__(
        self,
        node_id: str,
        config: TransportConfig,
        *,
        sources: Iterable[tuple[str, int]] = (),
        active: tuple[int, str] | None = None,
        on_staged: Callable[[Delta], None] | None = None,
    ) -> None:
        self.id = node_id
        self.config = config
        self.sources = list(sources)
        self.active = active
        self._staging = ActorVersions(active[0] if active is not None else None)
        """The staging rules of :mod:`aurora.policy.staging` (a newer version only; activate
        only onto the base); ``active`` adds the weights hash the data plane checks."""
        """(version, weights hash) of the weights this node runs; None for a pure relay."""
        self.on_staged = on_staged
        self.versions: dict[int, _Version] = {}
        self.staged: dict[int, Delta] = {}
        self.refused: dict[int, str] = {}
        self.committed: set[int] = set()
        self.corrupt_segments = 0
        self.subscribers: dict[str, _Subscriber] = {}
        self._server: asyncio.base_events.Server | None = None
        self._upstream: list[_Upstream] = []
        self._arenas = ArenaPool(config.max_delta_bytes)
        if config.prefault_bytes:
            self._arenas.prefault(config.prefault_bytes)
        self._tasks: set[asyncio.Task] = set()
        self._source_index = -1
        self._changed = asyncio.Event()

    # -- lifecycle -----------------------------------------------------------------------------

    async def serve(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Accept subscribers; returns the port."""
        self._server = await asyncio.start_server(
            self._handle, host, port, ssl=self.config.ssl_server, limit=wire.CONTROL_MAX_FRAME
        )
        return int(self._server.sockets[0].getsockname()[1])

    async def subscribe(self) -> None:
        """Subscribe to the first reachable source (then the next ones on failure)."""
        if not self.sources:
            raise ValueError(f"node {self.id}: no source to subscribe to")
        await self._fall_back()
        self._spawn(self._watchdog())

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for s in self._upstream:
            s.abort()
        for sub in self.subscribers.values():
            for s in sub.streams:
                s.abort()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)

    def _spawn(self, coro) -> asyncio.Task:  # type: ignore[no-untyped-def]
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- source side -----------------------------------------------------------------------------

    async def publish(self, version: int, segments: Iterable[Segment]) -> None:
        """Publish ``D_version`` segment by segment as they are produced (cut-through)."""
        st = self.versions.setdefault(version, _Version())
        for seg in segments:
            # Our own segments: cache and send, no need to verify what we just produced.
            st.segments[seg.seq] = seg
            for sub in self.subscribers.values():
                if sub.subscribed:
                    sub.send_segment(version, seg)
            await asyncio.sleep(0)  # let the writers run while the producer works
        self._trim_cache()

    async def commit(self, version: int) -> None:
        """Send ``COMMIT(version)`` down the tree (after the data)."""
        self.committed.add(version)
        for sub in self.subscribers.values():
            if sub.subscribed:
                sub.send_control({"op": "commit", "version": version})

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            hello = await asyncio.wait_for(
                wire.server_handshake(
                    lambda: wire.read_frame(reader, wire.HANDSHAKE_MAX_FRAME),
                    writer.write,
                    secret=self.config.secret,
                ),
                self.config.connect_timeout_s,
            )
        except (
            AuthError,
            ProtocolError,
            asyncio.IncompleteReadError,
            TimeoutError,
            KeyError,
            TypeError,
            ValueError,
        ) as exc:
            reason = exc if str(exc) else type(exc).__name__
            log.warning("%s: refused connection from %s: %s", self.id, peer, reason)
            writer.transport.abort()
            return
        wire.tune_socket(
            writer, buffer_bytes=self.config.buffer_bytes, congestion=self.config.congestion
        )
        sub = self.subscribers.setdefault(hello["id"], _Subscriber(hello["id"]))
        stream = sub.add_stream(writer)
        try:
            while True:
                kind, body = await wire.read_frame(reader, wire.CONTROL_MAX_FRAME)
                if kind != wire.CONTROL:
                    raise ProtocolError(f"a subscriber may only send control frames, got {kind}")
                self._on_request(sub, wire.parse_control(body))
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            stream.abort()

    def _on_request(self, sub: _Subscriber, msg: dict) -> None:
        op = msg["op"]
        if op == "subscribe":
            sub.subscribed = True
            for v in sorted(self.versions):
                if v >= int(msg.get("from", 0)):
                    self._send_missing(sub, v, ())
                    if v in self.committed:
                        sub.send_control({"op": "commit", "version": v})
        elif op == "fetch":
            self._send_missing(sub, int(msg["version"]), msg.get("have", ()))
        else:
            raise ProtocolError(f"unknown request {op!r}")

    def _send_missing(self, sub: _Subscriber, version: int, have: Iterable[int]) -> None:
        st = self.versions.get(version)
        if st is None:
            return
        held = set(have)
        for seq in sorted(st.segments):
            if seq not in held:
                sub.send_segment(version, st.segments[seq])

    # -- receiver side ---------------------------------------------------------------------------

    async def _fall_back(self) -> None:
        """Connect to the next source that answers, subscribe, and fetch what is missing."""
        for s in self._upstream:
            s.abort()
        self._upstream = []
        errors = []
        for _ in range(len(self.sources)):
            self._source_index = (self._source_index + 1) % len(self.sources)
            host, port = self.sources[self._source_index]
            try:
                streams = await asyncio.wait_for(
                    self._connect(host, port), self.config.connect_timeout_s
                )
            except AuthError:
                raise
            except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
                errors.append(f"{host}:{port}: {exc or type(exc).__name__}")
                continue
            self._upstream = streams
            log.info("%s: subscribed to %s:%d with %d streams", self.id, host, port, len(streams))
            incomplete = [v for v, st in self.versions.items() if st.delta is None]
            start = self.active[0] + 1 if self.active is not None else 0
            first = min(incomplete) if incomplete else max([start, *(v + 1 for v in self.versions)])
            streams[0].send([wire.control({"op": "subscribe", "from": first})])
            for v, st in self.versions.items():
                if st.delta is None:
                    streams[0].send(
                        [wire.control({"op": "fetch", "version": v, "have": sorted(st.segments)})]
                    )
            return
        raise ConnectionError(f"node {self.id}: no source reachable ({'; '.join(errors)})")

    async def _connect(self, host: str, port: int) -> list[_Upstream]:
        loop = asyncio.get_running_loop()
        streams: list[_Upstream] = []
        for i in range(self.config.streams):
            transport, reader = await loop.create_connection(
                lambda: FrameReader(
                    slot=self._slot,
                    received=self._accept,
                    abandon=self._abandon,
                    name=f"{self.id}<-{host}:{port}",
                ),
                host,
                port,
                ssl=self.config.ssl_client,
            )
            try:
                await wire.client_handshake(
                    reader.recv,
                    transport.write,
                    secret=self.config.secret,
                    hello={"id": self.id, "stream": i, "streams": self.config.streams},
                )
            except BaseException:
                transport.abort()
                for s in streams:
                    s.abort()
                raise
            reader.authenticated = True  # the source proved it knows the secret
            wire.tune_socket(
                transport, buffer_bytes=self.config.buffer_bytes, congestion=self.config.congestion
            )
            stream = _Upstream(transport, reader)
            streams.append(stream)
            self._spawn(self._read_control(stream))
        return streams

    def _slot(
        self, version: int, key: str, seq: int, offset: int, length: int, trailer: bool
    ) -> memoryview | None:
        """Where a segment's bytes go as they arrive: its place in the version's arena."""
        st = self._receiving(version, key)
        if st.delta is not None or offset + length > self.config.max_delta_bytes:
            return None
        assert st.reassembler is not None
        return st.reassembler.slot(key, seq, offset, length, trailer)

    def _abandon(self, version: int, view: memoryview) -> None:
        st = self.versions.get(version)
        if st is not None and st.reassembler is not None:
            st.reassembler.abandon(view)

    def _receiving(self, version: int, key: str) -> _Version:
        st = self.versions.setdefault(version, _Version())
        if st.reassembler is None:
            st.reassembler = Reassembler(key=key, arena=self._arenas.take())
        return st

    async def _read_control(self, stream: _Upstream) -> None:
        """Control frames from the source (segments go straight to :meth:`_accept`)."""
        try:
            while True:
                kind, body = await stream.reader.recv()
                if kind != wire.CONTROL:
                    raise ProtocolError(f"unexpected frame type {kind} from the source")
                msg = wire.parse_control(body)
                if msg["op"] == "commit":
                    self._on_commit(int(msg["version"]))
        except ProtocolError as exc:
            log.warning("%s: closing an upstream stream: %s", self.id, exc)
            stream.abort()
        except ConnectionError as exc:
            log.info("%s: upstream stream closed (%s)", self.id, type(exc).__name__)

    def _accept(self, version: int, seg: Segment) -> None:
        st = self._receiving(version, seg.key)
        assert st.reassembler is not None
        if st.delta is not None or seg.seq in st.segments:
            return  # complete already, or a duplicate
        try:
            complete = st.reassembler.add(seg)
        except DeltaError as exc:
            # Refused before anyone sees it; the watchdog fetches it again.
            self.corrupt_segments += 1
            log.warning("%s: refused segment %d of v%d: %s", self.id, seg.seq, version, exc)
            st.segments = {
                s: x for s, x in st.segments.items() if s not in st.reassembler.missing()
            }
            return
        if not st.reassembler.holds(seg.seq, trailer=seg.trailer):
            return  # a copy of one another stream is still receiving: that one counts
        st.segments[seg.seq] = seg
        st.progress = time.monotonic()
        for sub in self.subscribers.values():
            if sub.subscribed:
                sub.send_segment(version, seg)  # cut-through: forward the moment it is verified
        if complete:
            st.received_at = time.monotonic()
            self._complete(version, st)

    def _complete(self, version: int, st: _Version) -> None:
        assert st.reassembler is not None
        try:
            delta = st.reassembler.result()
        except DeltaError as exc:
            self.refused[version] = f"D_{version} does not verify: {exc}"
            log.warning("%s: %s", self.id, self.refused[version])
            return
        if delta.version != version:
            self.refused[version] = f"announced as v{version} but the file says v{delta.version}"
            return
        st.delta = delta
        if st.commit_pending:
            self._on_commit(version)
        if self.active is None:
            self._trim_cache()
        if self.active is not None:
            known = {self.active[0]: self.active[1]} | {
                d.version: d.weights_hash for d in self.staged.values()
            }
            if known.get(delta.base) != delta.base_hash:
                self.refused[version] = (
                    f"D_{version} is based on v{delta.base} (h={delta.base_hash[:12]}..), which "
                    f"this node does not hold (active v{self.active[0]}); not staged"
                )
                log.warning("%s: %s", self.id, self.refused[version])
                self._changed.set()
                return
            try:
                self._staging.stage(version)
            except IllegalTransition as exc:  # not newer than the active version
                self.refused[version] = f"D_{version} not staged: {exc}"
                self._changed.set()
                return
            self.staged[version] = delta
            if self.on_staged is not None:
                self.on_staged(delta)
        self._changed.set()

    def _on_commit(self, version: int) -> None:
        st = self.versions.get(version)
        if st is None or st.delta is None:
            self.versions.setdefault(version, _Version()).commit_pending = True
            return
        self.committed.add(version)
        for sub in self.subscribers.values():
            if sub.subscribed:
                sub.send_control({"op": "commit", "version": version})
        self._changed.set()

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(self.config.stall_s / 2)
            now = time.monotonic()
            stalled = [
                v
                for v, st in self.versions.items()
                if st.delta is None
                and now - st.progress > self.config.stall_s
                and v not in self.refused
            ]
            if not stalled:
                continue
            live = [s for s in self._upstream if s.alive]
            for s in live:
                if s.stuck(now, _SILENT_LIMIT_STALLS * self.config.stall_s):
                    # Stuck, not slow: close it, which hands its slot back for the re-fetch.
                    log.warning("%s: an upstream stream is silent mid-frame; closing it", self.id)
                    s.abort()
            live = [s for s in live if s.alive]
            if any(s.reader.frame_since is not None for s in live):
                # A segment is still arriving: slow streams (many of them sharing a thin link)
                # are not stalled, and fetching now would send in-flight segments twice.
                continue
            if not live:
                log.warning("%s: lost every stream to its source; falling back", self.id)
                try:
                    await self._fall_back()
                except ConnectionError as exc:
                    log.warning("%s: %s", self.id, exc)
                continue
            for v in stalled:
                st = self.versions[v]
                st.progress = now
                live[0].send(
                    [wire.control({"op": "fetch", "version": v, "have": sorted(st.segments)})]
                )

    def _trim_cache(self) -> None:
        """A source or relay keeps the newest ``cache_versions`` complete versions (bounded
        memory over thousands of steps); an incomplete one is never dropped here."""
        done = sorted(
            v
            for v, st in self.versions.items()
            if st.delta is not None or (st.reassembler is None and st.segments)
        )
        for v in done[: -self.config.cache_versions]:
            del self.versions[v]
            self.committed.discard(v)

    def release(self, upto: int) -> None:
        """Forget every version up to ``upto`` (this node has applied them, or no longer serves
        them): the segments, the staged delta and the refusals. Each version's arena goes back to
        the pool as soon as the caller, too, holds no ``Delta`` of it, so a node that releases
        each version after applying it receives the next one into memory already committed."""
        for v in [v for v in self.versions if v <= upto]:
            del self.versions[v]
        for table in (self.staged, self.refused):
            for v in [v for v in table if v <= upto]:
                del table[v]
        self.committed = {v for v in self.committed if v > upto}

    def activate(self, version: int) -> None:
        """The weights now run ``version`` (a staged delta, applied by the caller): it becomes the
        base later deltas are checked against, and it and everything older are released."""
        if version not in self.staged:
            raise ValueError(
                f"node {self.id}: v{version} is not staged (staged: {sorted(self.staged)})"
            )
        self._staging.activate(version)  # the version rule: only onto its base v-1
        self.active = (version, self.staged[version].weights_hash)
        self.release(version)

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
