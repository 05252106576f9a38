"""A data-plane node: source (Trainer), relay, or receiver (Actor) of delta checkpoints.

Theory of operation
-------------------
Every node can *serve* (accept authenticated subscribers) and *subscribe* (to an upstream
source, with a list of fallbacks). The Trainer only serves; a relay does both; an Actor only
subscribes. A subscription is ``S`` TCP connections to the source, each authenticated
(:mod:`aurora.transport.wire`), with socket buffers and congestion control set per socket.

* **Trust.** A node believes only the Trainer's signature (:mod:`aurora.delta.announce`): for
  each version the Trainer signs an announcement (``id(D_v)``, ``h(v)``, size, segment grid),
  which travels down the tree ahead of the trailer (ahead of all data when the delta exists
  whole), on every connection, and which the runtime may also hand any node
  (:meth:`Node.announce`). A node verifies it against the job's public key before anything
  depends on it, forwards it to its subscribers, and from then on accepts for ``D_v`` only the
  segments the announcement describes (expected key, not first key; see
  :mod:`aurora.delta.reassembly`) and stages ``D_v`` only if its bytes hash to the announced
  ``id(D_v)``.
* **Before the announcement** (the Trainer streams segments while it is still extracting,
  cut-through) a node takes segments of one version only - the one after the newest announced -
  and at most ``unannounced_bytes`` of them (by default 1.25 x the largest delta announced so
  far, 64 MiB before any), charged in whole pages; no trailer is accepted. Whatever was dropped
  for it is fetched the moment the announcement comes.
  When the announcement comes, whatever it does not describe is dropped.
* **Blame and switch.** A source that sends something the announcement refutes (a segment of
  another delta or off its grid, a trailer with another id, bytes that do not match their
  checksum) is not used again for that version, and the node moves to its next source
  (:mod:`aurora.transport.sources`). A source that makes no verified progress - fewer than
  ``min_rate_bytes_s`` wanted bytes over ``progress_s`` - on an announced version this node still
  needs is left too (a try; ``attempts`` tries per source and version). When no source is left
  the version is refused with a one-line reason naming every source (after the optional
  ``fallback``, e.g. the Checkpoint Store): never a hang. Rounds that reach no source back off
  exponentially.
* **Striping.** A source queues each segment of ``D_v`` once per subscriber, as a reference
  (version, seq) resolved when a connection takes it: each of the subscriber's connections takes
  the next one as soon as it has handed its last to the kernel, so a slow or stalled stream stops
  taking segments once its socket buffer is full. A queue of references pins no memory: a
  version dropped from the cache is skipped, and the subscriber that still had it queued is
  dropped (it fell ``cache_versions`` behind; it re-subscribes). A connection that cannot hand
  its bytes to the kernel for ``send_timeout_s`` drops its subscriber.
* **Receive in place.** Each upstream connection is a :class:`~aurora.transport.framing.
  FrameReader`: the bytes of a wanted segment go from the socket straight into the slot the
  :class:`aurora.delta.Reassembler` gives for them; an unwanted one is read into a small scratch
  buffer and dropped. No byte is copied after the kernel's copy out of the socket.
* **Verify, then forward.** A relay forwards each verified segment the moment it has it
  (cut-through), and caches it to serve catch-up and re-fetches. When it has a whole version it
  serves the trailer first, so its subscribers check every later segment against the trailer's
  leaf hashes on arrival.
* **Nothing lost.** No progress on an incomplete version for ``stall_s``: ``FETCH`` with the
  segments held, the source sends the rest; every connection to the source gone: the next source.
* **Staging.** A complete version is staged only if its base is the receiver's active version
  or a staged one with the same hash; one whose base is not here yet waits for it; one on a
  foreign base is refused with the reason, never half-staged.
* **Commit** travels the same tree after the data: a relay forwards ``COMMIT(v)`` only once it
  holds ``D_v`` whole.
* **Bounded.** Control frames are rate-limited per connection (``control_rate``), handshakes
  have ``connect_timeout_s`` (TLS's too), and one host may hold at most
  ``max_pending_handshakes`` unauthenticated connections.
* **Memory.** An Actor calls :meth:`Node.activate` once it has applied ``D_v``; everything up to
  ``v`` is released and its arena goes back to the pool for the next delta. A source or relay
  keeps the newest ``cache_versions`` versions.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aurora.delta import Delta, Reassembler, Segment
from aurora.delta.announce import (
    AnnouncementError,
    SnapshotAnnouncement,
    VersionAnnouncement,
    describe_parts,
    public_key_of,
    sign,
    verify,
)
from aurora.delta.arena import DEFAULT_CAPACITY
from aurora.delta.errors import DeltaError
from aurora.delta.reader import read_delta, segments_of
from aurora.policy import IllegalTransition
from aurora.policy.staging import ActorVersions
from aurora.transport import wire
from aurora.transport.arenas import ArenaPool
from aurora.transport.framing import FrameReader
from aurora.transport.sources import SourceChoice
from aurora.transport.wire import AuthError, ProtocolError

log = logging.getLogger("aurora.transport")


@dataclass(frozen=True, kw_only=True)
class TransportConfig:
    """Data-plane settings shared by every node of a job."""

    secret: bytes
    """The job's shared secret: admission control (every connection proves knowledge of it,
    HMAC-SHA256). Integrity does not depend on it."""
    job: str
    """The job's id: announcements signed for another job are refused."""
    public_key: bytes
    """The job's Ed25519 public key (32 raw bytes, :func:`aurora.keys.load_public_key`): every
    announcement is verified against it."""
    streams: int = 4
    """Parallel TCP connections per subscription (S)."""
    buffer_bytes: int = 8 << 20
    """SO_SNDBUF / SO_RCVBUF asked for on every socket (bytes)."""
    congestion: str | None = None
    """TCP congestion control per socket (e.g. ``bbr``, ``cubic``); None keeps the default."""
    stall_s: float = 0.5
    """Seconds without progress on an incomplete version before re-fetching what is missing."""
    progress_s: float = 5.0
    """Window (s) in which a source must deliver at least ``min_rate_bytes_s`` x ``progress_s``
    wanted bytes of an announced version this node still needs; otherwise the node switches
    source (a try; see ``attempts``)."""
    min_rate_bytes_s: float = 64 << 10
    """Slowest source kept (bytes/s of wanted segment data, averaged over ``progress_s``): 64 KiB/s
    is 0.5 Mbit/s, far below any link AuroraRL targets and far above a source that drips."""
    attempts: int = 3
    """Tries per source and version (left for no progress, lost, unreachable) before the node
    stops using that source for that version; a version no source can complete is refused."""
    backoff_s: float = 0.5
    """Wait after a round in which no source could be reached, doubled per round."""
    max_backoff_s: float = 8.0
    """Longest wait between rounds of connection attempts (s)."""
    connect_timeout_s: float = 5.0
    """Seconds to connect and authenticate (TLS handshake included) before trying the next
    source; a server gives a connecting peer the same."""
    send_timeout_s: float = 30.0
    """Seconds a connection to a subscriber may go without the kernel taking any of its bytes
    before the subscriber is dropped (it stopped reading; it must re-subscribe)."""
    unannounced_bytes: int | None = None
    """Bytes (whole pages) of one version a node takes before that version's signed
    announcement arrives (segments cut through while the Trainer is still extracting). None:
    1.25 x the largest delta announced so far plus 1 MiB (a delta no larger than that cuts
    through whole), and ``UNANNOUNCED_FIRST`` (64 MiB) before any announcement."""
    control_rate: float = 64.0
    """Control frames per second a connection may send on average (a token bucket)."""
    control_burst: int = 256
    """Control frames a connection may send at once."""
    max_pending_handshakes: int = 64
    """Unauthenticated connections one remote host may hold open at once."""
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
    cut_through: bool = True
    """A relay forwards each segment the moment it is verified; False: only once it holds the
    whole version (store-and-forward, as the PrimeRL baselines' relays do)."""

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"TransportConfig.{name} must be {rule}, got {getattr(self, name)!r}")

        if not isinstance(self.secret, bytes) or len(self.secret) < 16:
            raise ValueError("TransportConfig.secret must be at least 16 bytes")
        if not isinstance(self.job, str) or not self.job or not self.job.isprintable():
            raise bad("job", "a non-empty printable string")
        if not isinstance(self.public_key, bytes) or len(self.public_key) != 32:
            raise ValueError("TransportConfig.public_key must be 32 raw bytes (an Ed25519 key)")
        for name in ("streams", "attempts", "cache_versions", "control_burst"):
            if getattr(self, name) < 1:
                raise bad(name, ">= 1")
        for name in ("stall_s", "progress_s", "min_rate_bytes_s", "backoff_s", "control_rate"):
            if not getattr(self, name) > 0:
                raise bad(name, "> 0")
        for name in ("connect_timeout_s", "send_timeout_s"):
            if not getattr(self, name) > 0:
                raise bad(name, "> 0")
        if self.max_backoff_s < self.backoff_s:
            raise bad("max_backoff_s", ">= backoff_s")
        if self.max_pending_handshakes < 1:
            raise bad("max_pending_handshakes", ">= 1")
        if self.max_delta_bytes < 1024:
            raise bad("max_delta_bytes", ">= 1024")
        if self.unannounced_bytes is not None and not (
            0 <= self.unannounced_bytes <= self.max_delta_bytes
        ):
            raise bad("unannounced_bytes", "None or in 0..max_delta_bytes")
        if not 0 <= self.prefault_bytes <= self.max_delta_bytes:
            raise bad("prefault_bytes", "in 0..max_delta_bytes")


def run(main):  # type: ignore[no-untyped-def]
    """Run a data-plane coroutine on uvloop when it is installed (faster sockets), else on the
    standard asyncio loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


class VersionRefused(Exception):
    """A version this node will not stage; ``reason`` says why in one line."""

    def __init__(self, version: int, reason: str) -> None:
        super().__init__(f"D_{version} refused: {reason}")
        self.version, self.reason = version, reason


@dataclass
class NodeMetrics:
    """Counters a runtime can log (monotonic over the node's life)."""

    bytes_verified: int = 0
    """Segment bytes received, verified and kept."""
    segments_discarded: int = 0
    """Segment frames read into scratch and dropped (duplicates, unwanted, refuted)."""
    refused: collections.Counter[str] = field(default_factory=collections.Counter)
    """Things refused, by kind: segment, trailer, announcement, version, control, connection,
    subscriber."""
    source_switches: int = 0
    """Times this node left a source and went to another."""
    announcements: int = 0
    """Announcements verified."""
    hops: collections.OrderedDict[int, dict[str, float]] = field(
        default_factory=collections.OrderedDict
    )
    """Wall-clock times (``time.time()``, s) on each version's path through this node, for the
    newest ``_HOP_VERSIONS`` versions: ``in_first`` (a wanted segment's bytes start arriving),
    ``in_last`` (the version is whole and verified), ``staged``, ``out_first`` / ``out_last``
    (a segment of it first taken for sending / most recently written out with the transport's
    buffer drained to its low-water mark, any subscriber). Read by the runtime to time the
    delta path hop by hop (``aurora.runtime.hopreport``)."""

    def hop(self, version: int, name: str, *, latest: bool = False) -> None:
        """Note that ``version`` passed ``name`` now: the first time only, or every time
        (``latest``: the last byte out is the last of many sends)."""
        times = self.hops.get(version)
        if times is None:
            times = self.hops[version] = {}
            while len(self.hops) > _HOP_VERSIONS:
                self.hops.popitem(last=False)
        if latest or name not in times:
            times[name] = time.time()


UNANNOUNCED_FIRST = 64 << 20
"""Bytes of a version a node takes before its announcement while it has seen none (bytes)."""
_SILENT_LIMIT_STALLS = 10
"""A stream in the middle of a frame that has received no byte for this many ``stall_s`` is
stuck (5 s by default: longer than TCP's retransmission backoff after three losses in a row)
and is closed, which hands its slot back for the re-fetch. Judged only on a watchdog tick that
comes on time: after a pause of this process, what arrived meanwhile is read first."""
_WRITE_CHUNK = 1 << 20
"""Bytes handed to a socket per write (1 MiB: below the send buffer, so most go straight in)."""
_OWN_LIMIT = 4096
"""Control frames queued on one connection to a subscriber before it counts as not reading."""
_MAX_LIST = 1 << 17
"""Longest list of segment numbers a request may carry (131,072: a 512 GiB delta's)."""
_HOP_VERSIONS = 64
"""Versions whose hop times a node keeps (a few hundred bytes each)."""
_LOG_EVERY_S = 5.0
_LOG_BURST = 3
"""Warnings with the same key: at most this many per ``_LOG_EVERY_S`` seconds."""


class _RateLimitedLog:
    """At most ``_LOG_BURST`` lines per key per ``_LOG_EVERY_S``, then the count of lines held
    back: a flood of bad input cannot flood the log."""

    def __init__(self) -> None:
        self._windows: dict[str, tuple[float, int]] = {}

    def warning(self, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        start, count = self._windows.get(key, (-1e9, 0))
        if now - start >= _LOG_EVERY_S:
            if count > _LOG_BURST:
                msg += f" ({count - _LOG_BURST} more like it in the last {now - start:.0f} s)"
            start, count = now, 0
        if len(self._windows) > 4096:
            self._windows.clear()
        self._windows[key] = (start, count + 1)
        if count < _LOG_BURST:
            log.warning(msg, *args)


def _reason(exc: BaseException) -> str:
    """A one-line reason for an exception, never empty."""
    text = str(exc).split("\n")[0].strip()
    if isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror
    return text or type(exc).__name__


class _Stream:
    """One connection to a subscriber. It sends its own frames first (control), then takes the
    next segment from the subscriber's queue whenever it has handed the last one to the kernel
    (striping that is round-robin while streams are equal)."""

    def __init__(self, writer: asyncio.StreamWriter, sub: _Subscriber, node: Node) -> None:
        self.writer = writer
        self.sub, self.node = sub, node
        self.own: collections.deque[list[bytes]] = collections.deque()
        self.wake = asyncio.Event()
        self.alive = True
        self.segments_sent = 0
        """Segment frames this connection has taken from the subscriber's queue."""
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        timeout = self.node.config.send_timeout_s
        transport = self.writer.transport
        low = transport.get_write_buffer_limits()[0]
        taken: tuple[int, list[bytes]] | None = None
        try:
            while True:
                if self.own:
                    pieces = self.own.popleft()
                else:
                    taken = self.sub.take(self.node)
                    if taken is None:
                        self.wake.clear()
                        await self.wake.wait()
                        continue
                    version, pieces = taken
                    self.segments_sent += 1
                    self.node.metrics.hop(version, "out_first")
                # A piece at a time, in chunks, draining in between: each chunk goes from the
                # segment to the kernel as it is (writelines would join the data with its header
                # first, and a write the socket cannot take is copied into the transport's buffer
                # on Python < 3.12).
                for piece in pieces:
                    view = memoryview(piece)
                    for at in range(0, len(view), _WRITE_CHUNK):
                        self.writer.write(view[at : at + _WRITE_CHUNK])
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
                    self.node.metrics.hop(taken[0], "out_last", latest=True)
                    taken = None
        except TimeoutError:
            self.node._drop_subscriber(
                self.sub, f"it took no byte for {timeout:g} s (stopped reading)"
            )
        except (ConnectionError, OSError, RuntimeError):
            pass  # the connection is gone (RuntimeError: written after the transport closed)
        finally:
            self.alive = False

    def send(self, pieces: list[bytes]) -> None:
        """Send ``pieces`` on this connection, ahead of any segment not yet taken."""
        if not self.alive:
            return
        if len(self.own) >= _OWN_LIMIT:
            self.node._drop_subscriber(self.sub, f"{_OWN_LIMIT} control frames queued unread")
            return
        self.own.append(pieces)
        self.wake.set()

    def abort(self) -> None:
        self.alive = False
        self.writer.transport.abort()
        if self.task is not asyncio.current_task():
            self.task.cancel()


@dataclass(eq=False)
class _Subscriber:
    id: str
    session: bytes
    streams: list[_Stream] = field(default_factory=list)
    subscribed: bool = False
    pending: dict[tuple[int, int], None] = field(default_factory=dict)
    """Segments (version, seq) to send, in order, each once: references, resolved when a stream
    takes one, so a queue pins no segment's memory."""
    dropped: bool = False

    @property
    def key(self) -> tuple[str, bytes]:
        return (self.id, self.session)

    def live(self) -> list[_Stream]:
        return [s for s in self.streams if s.alive]

    def queue(self, version: int, seqs: Iterable[int]) -> None:
        if self.dropped:
            return
        for seq in seqs:
            self.pending[(version, seq)] = None
        for s in self.live():
            s.wake.set()

    def take(self, node: Node) -> tuple[int, list[bytes]] | None:
        """The version and frame of the next queued segment still cached (skipping any that is
        not)."""
        while self.pending:
            version, seq = next(iter(self.pending))
            del self.pending[(version, seq)]
            seg = node._cached(version, seq)
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


@dataclass
class _Version:
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
    commit_pending: bool = False
    missed: bool = False
    """Something of this version was dropped before its announcement (the trailer, segments
    over the budget): fetch what is missing as soon as it is announced."""
    progress: float = field(default_factory=time.monotonic)
    received_at: float | None = None
    """When the last segment arrived verified (monotonic s), before the whole-file parse."""
    fallback_tried: bool = False

    @property
    def whole(self) -> bool:
        return self.delta is not None or self.published


def _delivering(up: _Upstream) -> bool:
    """The source is sending on this connection now: in the middle of a frame, or a byte came
    within the last ``_DELIVERING_S``."""
    r = up.reader
    return r is not None and (
        r.frame_since is not None or time.monotonic() - r.last_byte < _DELIVERING_S
    )


_DELIVERING_S = 0.05
"""A connection that received a byte this recently (s) is still delivering (between two
back-to-back frames of one push); also how often a node waiting to fetch looks again."""


class _Upstream:
    """One connection to a source: frames arrive through a :class:`FrameReader`; this node
    only ever sends it small control frames."""

    def __init__(self, source: int, where: str, bucket: wire.TokenBucket) -> None:
        self.source, self.where = source, where
        self.transport: asyncio.Transport | None = None
        self.reader: FrameReader | None = None
        self.aborted = False
        self.bucket = bucket

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


StagedCallback = Callable[[Delta, VersionAnnouncement], None]
"""Called with a verified, staged delta and the Trainer's announcement it matched."""
RefusedCallback = Callable[[int, str], None]
"""Called with a version this node will not stage and the one-line reason."""
Fallback = Callable[[int], Awaitable[bytes]]
"""Returns the whole file of ``D_v`` from somewhere else (the Checkpoint Store)."""


class Node:
    """One participant of the data plane (see the module docstring)."""

    def __init__(
        self,
        node_id: str,
        config: TransportConfig,
        *,
        sources: Iterable[tuple[str, int]] = (),
        active: tuple[int, str] | None = None,
        on_staged: StagedCallback | None = None,
        on_refused: RefusedCallback | None = None,
        signing_key: bytes | None = None,
        fallback: Fallback | None = None,
    ) -> None:
        self.id = node_id
        self.config = config
        self.sources = list(sources)
        self.active = active
        """(version, weights hash) of the weights this node runs; None for a pure relay."""
        self._staging = ActorVersions(active[0] if active is not None else None)
        """The staging rules of :mod:`aurora.policy.staging` (a newer version only; activate
        only onto the base); ``active`` adds the weights hash the data plane checks."""
        self.on_staged = on_staged
        self.on_refused = on_refused
        self.fallback = fallback
        if signing_key is not None and public_key_of(signing_key) != config.public_key:
            raise ValueError(
                f"node {node_id}: the signing key does not match TransportConfig.public_key"
            )
        self._signing_key = signing_key
        self.versions: dict[int, _Version] = {}
        self.staged: dict[int, Delta] = {}
        self.refused: dict[int, str] = {}
        self.announcements: dict[int, VersionAnnouncement] = {}
        """Verified announcements by version (kept as long as the version is)."""
        self.committed: set[int] = set()
        self.metrics = NodeMetrics()
        self.subscribers: dict[tuple[str, bytes], _Subscriber] = {}
        self._server: asyncio.base_events.Server | None = None
        self._upstream: list[_Upstream] = []
        self._choice = SourceChoice(
            [f"{h}:{p}" for h, p in self.sources],
            attempts=config.attempts,
            backoff_s=config.backoff_s,
            max_backoff_s=config.max_backoff_s,
        )
        self._arenas = ArenaPool(config.max_delta_bytes)
        if config.prefault_bytes:
            self._arenas.prefault(config.prefault_bytes)
        self._tasks: set[asyncio.Task] = set()
        self._changed = asyncio.Event()
        self._reconnecting = False
        self._sources_gen = 0
        """Bumped by :meth:`set_sources` (see :meth:`_connect_round`)."""
        self._progress_mark: tuple[float, int] = (time.monotonic(), 0)
        self._progress_bytes = 0
        """Wanted bytes received from the current source (into slots), for the progress rule."""
        self._last_tick = time.monotonic()
        self._newest_announced: int | None = None
        self._largest_announced = 0
        """Size of the largest delta announced to this node (bytes)."""
        self._seen_signed: dict[bytes, VersionAnnouncement] = {}
        self._pending_handshakes: collections.Counter[str] = collections.Counter()
        self._log = _RateLimitedLog()
        self._in_fallback: set[int] = set()
        """Versions the fallback is fetching now (not refused meanwhile)."""
        self._watching = False

    @property
    def corrupt_segments(self) -> int:
        """Segments refused as corrupt or refuted (a counter for tests and logs)."""
        return self.metrics.refused["segment"]

    # -- lifecycle -----------------------------------------------------------------------------

    async def serve(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Accept subscribers; returns the port."""
        self._server = await asyncio.start_server(
            self._handle,
            host,
            port,
            ssl=self.config.ssl_server,
            ssl_handshake_timeout=self.config.connect_timeout_s if self.config.ssl_server else None,
            limit=wire.CONTROL_MAX_FRAME,
        )
        return int(self._server.sockets[0].getsockname()[1])

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
        self._sources_gen += 1
        self._choice = SourceChoice(
            [f"{h}:{p}" for h, p in self.sources],
            attempts=self.config.attempts,
            backoff_s=self.config.backoff_s,
            max_backoff_s=self.config.max_backoff_s,
        )
        for s in self._upstream:
            s.abort()
        self._upstream = []
        if self._watching and self.sources:
            self._spawn(self._reconnect())

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for s in self._upstream:
            s.abort()
        for sub in list(self.subscribers.values()):
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

    # -- announcements -------------------------------------------------------------------------

    def announce(self, signed: bytes) -> VersionAnnouncement:
        """Hand this node a signed version announcement (from the Ledger, the Checkpoint Store,
        anyone): verified against the job's key, then acted on and forwarded. Raises an
        :class:`~aurora.delta.announce.AnnouncementError` with the one-line reason."""
        ann = self._verify(signed)
        self._on_announcement(ann, bytes(signed), via=None)
        return ann

    def _verify(self, signed: bytes) -> VersionAnnouncement:
        signed = bytes(signed)
        ann = self._seen_signed.get(signed)
        if ann is not None:
            return ann
        got = verify(signed, self.config.public_key, job=self.config.job)
        if isinstance(got, SnapshotAnnouncement):
            raise AnnouncementError(f"{got.describe()}: a snapshot, not a version announcement")
        if len(self._seen_signed) > 4 * self.config.cache_versions + 64:
            self._seen_signed.clear()
        self._seen_signed[signed] = got
        self.metrics.announcements += 1
        return got

    def _on_announcement(self, ann: VersionAnnouncement, signed: bytes, via: int | None) -> None:
        v = ann.version
        if (self.active is not None and v <= self.active[0]) or v in self.refused:
            return
        whole = [u for u, st in self.versions.items() if st.whole]
        if self.active is None and whole and v <= max(whole) - self.config.cache_versions:
            return  # a relay would drop it from its cache at once
        st = self.versions.get(v)
        if st is not None and st.ann is not None:
            if st.ann != ann:
                self._log.warning(
                    f"conflict:{v}",
                    "%s: a second, different announcement of D_%d (id %s.., first %s..) is "
                    "ignored: the Trainer signed two deltas for one version",
                    self.id,
                    v,
                    ann.delta_id[:12],
                    st.ann.delta_id[:12],
                )
                self.metrics.refused["announcement"] += 1
            return
        if ann.payload_bytes > self.config.max_delta_bytes:
            self._refuse(
                v,
                f"{ann.describe()} is larger than this node's max_delta_bytes "
                f"({self.config.max_delta_bytes})",
            )
            return
        if not self._waiting():
            # Nothing was owed before: the progress window starts now, not at the last tick.
            self._progress_mark = (time.monotonic(), self._progress_bytes)
        st = self.versions.setdefault(v, _Version())
        st.ann, st.signed = ann, signed
        self.announcements[v] = ann
        self._largest_announced = max(self._largest_announced, ann.size)
        st.progress = time.monotonic()
        if self._newest_announced is None or v > self._newest_announced:
            self._newest_announced = v
        self._drop_stray_provisional()
        if st.reassembler is not None:
            try:
                dropped = st.reassembler.expect(ann)
            except DeltaError as exc:
                log.info(
                    "%s: dropping what arrived for v%d before its announcement: %s",
                    self.id,
                    v,
                    _reason(exc),
                )
                st.reassembler = None
                st.segments.clear()
                st.origin.clear()
            else:
                for seq in dropped:
                    st.segments.pop(seq, None)
                    st.origin.pop(seq, None)
        for sub in self.subscribers.values():
            if sub.subscribed:
                sub.send_control({"op": "announce", "a": signed}, every_stream=True)
        if st.whole:
            return
        live = self._live()
        if live and st.missed:
            # Something came before it and was dropped: ask for what is missing now.
            st.missed = False
            live[0].send([self._fetch_msg(v, st)])
        elif live and (via is None or via != live[0].source):
            # Learned elsewhere: ask for what is missing rather than wait for a stall - once the
            # source is not sending. The Ledger's copy of an announcement can beat the source's
            # own push (a store-and-forward source sends a whole version at once), and asking
            # then had every dense version sent twice (sim_vs_real over the emulated WAN: 2.2 MB
            # on the link for 1.4 MB of versions).
            self._fetch_when_idle(v)
        self._changed.set()

    def _fetch_when_idle(self, v: int) -> None:
        st = self.versions.get(v)
        live = self._live()
        if st is None or st.whole or v in self.refused or not live:
            return
        if any(_delivering(u) for u in live if u.source == live[0].source):
            asyncio.get_running_loop().call_later(_DELIVERING_S, self._fetch_when_idle, v)
            return
        receiving = st.reassembler.receiving() if st.reassembler is not None else set()
        live[0].send([self._fetch_msg(v, st, also_have=receiving)])

    def _drop_stray_provisional(self) -> None:
        """Unannounced data of any version but the one after the newest announced is dropped."""
        for v, st in list(self.versions.items()):
            if st.ann is None and st.reassembler is not None and v != self._provisional_version():
                del self.versions[v]

    def _provisional_version(self) -> int | None:
        """The one version whose segments are taken before its announcement (None: any one)."""
        known = [v for v in (self._newest_announced,) if v is not None]
        if self.active is not None:
            known.append(self.active[0])
        return max(known) + 1 if known else None

    # -- source side -----------------------------------------------------------------------------

    async def publish(
        self,
        version: int,
        segments: Iterable[Segment],
        *,
        announcement: bytes | None = None,
    ) -> bytes | None:
        """Publish ``D_version`` segment by segment as they are produced (cut-through), in one
        call or several; returns its signed announcement once every segment is published.

        ``announcement`` (signed bytes, e.g. from the Checkpoint Store) is verified and sent
        first. Without it the node signs one with its signing key: before any segment when
        ``segments`` is a sequence ending with the trailer (the delta exists whole: the
        announcement and the trailer go first, so every hop verifies each segment on arrival),
        else when the trailer is produced (ahead of the trailer)."""
        st = self.versions.setdefault(version, _Version())
        if announcement is not None:
            ann = self._verify(announcement)
            if ann.version != version:
                raise ValueError(f"publish v{version} with the announcement of v{ann.version}")
            self._set_own_announcement(st, ann, bytes(announcement))
        whole = (
            isinstance(segments, Sequence)
            and len(segments) > 0
            and segments[0].seq == 0
            and segments[-1].trailer
            and segments[-1].seq == len(segments) - 1
        )
        if st.signed is None and whole:
            assert isinstance(segments, Sequence)
            self._sign_own(st, version, segments[0], segments[-1])
        if st.signed is not None and whole:
            assert isinstance(segments, Sequence)
            segments = [segments[-1], *segments[:-1]]  # the trailer first
        for seg in segments:
            if seg.trailer and st.signed is None:
                first = st.segments.get(0)
                if first is None:
                    raise ValueError(f"publish v{version}: the trailer came before segment 0")
                self._sign_own(st, version, first, seg)
            st.segments[seg.seq] = seg
            for sub in self.subscribers.values():
                if sub.subscribed:
                    sub.queue(version, (seg.seq,))
            await asyncio.sleep(0)  # let the writers run while the producer works
        if st.ann is None or len(st.segments) < st.ann.segments + 1:
            return None  # more segments of this version are still to come
        st.published = True
        self._trim_cache()
        return st.signed

    def _sign_own(self, st: _Version, version: int, first: Segment, trailer: Segment) -> None:
        if self._signing_key is None:
            raise ValueError(
                f"node {self.id}: publishing D_{version} needs its signed announcement or the "
                "Trainer's signing key"
            )
        ann = describe_parts(self.config.job, first.data, trailer.data)
        if ann.version != version:
            raise ValueError(f"publish v{version}: the segments are of D_{ann.version}")
        self._set_own_announcement(st, ann, sign(ann, self._signing_key))

    def _set_own_announcement(self, st: _Version, ann: VersionAnnouncement, signed: bytes) -> None:
        if st.ann is not None and st.ann != ann:
            raise ValueError(
                f"node {self.id}: D_{ann.version} is announced already with id "
                f"{st.ann.delta_id[:12]}..; publish the same bytes again, not other ones"
            )
        st.ann, st.signed = ann, signed
        self._largest_announced = max(self._largest_announced, ann.size)
        self.announcements[ann.version] = ann
        if self._newest_announced is None or ann.version > self._newest_announced:
            self._newest_announced = ann.version
        for sub in self.subscribers.values():
            if sub.subscribed:
                sub.send_control({"op": "announce", "a": signed}, every_stream=True)

    async def commit(self, version: int) -> None:
        """Send ``COMMIT(version)`` down the tree (after the data)."""
        self.committed.add(version)
        for sub in self.subscribers.values():
            if sub.subscribed:
                sub.send_control({"op": "commit", "version": version})

    def _cached(self, version: int, seq: int) -> Segment | None:
        st = self.versions.get(version)
        return None if st is None else st.segments.get(seq)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        if self._pending_handshakes[host] >= self.config.max_pending_handshakes:
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
        self._pending_handshakes[host] += 1
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
                else _reason(exc)
            )
            self._log.warning(
                f"auth:{host}", "%s: refused connection from %s: %s", self.id, peer, reason
            )
            self.metrics.refused["connection"] += 1
            writer.transport.abort()
            return
        finally:
            self._pending_handshakes[host] -= 1
            if self._pending_handshakes[host] <= 0:
                del self._pending_handshakes[host]
        wire.tune_socket(
            writer, buffer_bytes=self.config.buffer_bytes, congestion=self.config.congestion
        )
        # Subscriber ids are bound to the authenticated session: another peer that says it is
        # "ca-0" gets a subscriber of its own and can take nothing queued for ca-0.
        key = (hello["id"], session)
        sub = self.subscribers.get(key)
        if sub is None:
            sub = self.subscribers[key] = _Subscriber(hello["id"], session)
        stream = _Stream(writer, sub, self)
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
                self._on_request(sub, wire.parse_control(body))
        except ProtocolError as exc:
            self._log.warning(
                f"proto:{hello['id']}",
                "%s: closing subscriber %r: %s",
                self.id,
                hello["id"],
                _reason(exc),
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

    def _drop_subscriber(self, sub: _Subscriber, why: str) -> None:
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

    def _on_request(self, sub: _Subscriber, msg: dict[str, Any]) -> None:
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
            for v in sorted(self.versions):
                if v >= first and v not in done:
                    self._send_version(sub, v, have.get(v, set()))
                    if v in self.committed:
                        sub.send_control({"op": "commit", "version": v})
        elif op == "fetch":
            v = _int(msg.get("version"), "version")
            want = msg.get("want")
            self._send_version(
                sub,
                v,
                set(_ints(msg.get("have", ()), "have")),
                None if want is None else set(_ints(want, "want")),
            )
        else:
            raise ProtocolError(f"unknown request {str(op)[:40]!r}")

    def _send_version(
        self, sub: _Subscriber, version: int, have: set[int], want: set[int] | None = None
    ) -> None:
        """The announcement (on every connection), then the trailer, then the segments not
        held (or only those in ``want``)."""
        st = self.versions.get(version)
        if st is None:
            return
        if st.signed is not None:
            sub.send_control({"op": "announce", "a": st.signed}, every_stream=True)
        seqs = sorted(st.segments, key=lambda s: (not st.segments[s].trailer, s))
        sub.queue(version, (s for s in seqs if s not in have and (want is None or s in want)))

    # -- receiver side ---------------------------------------------------------------------------

    def _live(self) -> list[_Upstream]:
        return [s for s in self._upstream if s.alive]

    def _waiting(self) -> list[int]:
        """Announced versions this node still needs and has not given up."""
        return [
            v
            for v, st in self.versions.items()
            if st.ann is not None and not st.whole and v not in self.refused
        ]

    async def _connect_round(self) -> list[str]:
        """Connect to the next usable source (then the ones after it) until one answers;
        returns why each one tried failed. A round that :meth:`set_sources` overtakes (the
        Ledger re-routed this node while it was connecting: set_sources cannot start its own
        round while this one runs) drops what it reached and starts over on the new list."""
        errors: list[str] = []
        if self._reconnecting:
            return errors
        self._reconnecting = True
        try:
            while True:
                gen = self._sources_gen
                await self._try_sources(gen, errors)
                if gen == self._sources_gen:
                    return errors
                self._log.warning("rerouted", "%s: re-routed while connecting", self.id)
        finally:
            self._reconnecting = False

    async def _try_sources(self, gen: int, errors: list[str]) -> None:
        """One pass of :meth:`_connect_round` over the sources of generation ``gen``; it
        returns early, keeping nothing, once they have been replaced."""
        for _ in range(len(self.sources)):
            source = self._choice.next(self._waiting())
            if source is None:
                return
            host, port = self.sources[source]
            where = f"{host}:{port}"
            try:
                streams = await asyncio.wait_for(
                    self._connect(source, host, port), self.config.connect_timeout_s
                )
            except (OSError, asyncio.IncompleteReadError, TimeoutError, ConnectionError) as exc:
                if gen != self._sources_gen:
                    return  # ``source`` indexes the old list: nothing to record against it
                reason = (
                    f"no answer within {self.config.connect_timeout_s:g} s"
                    if isinstance(exc, TimeoutError)
                    else _reason(exc)
                )
                errors.append(f"{where}: {reason}")
                self._log.warning(
                    f"connect:{source}", "%s: cannot use %s: %s", self.id, where, reason
                )
                self._choice.connected(source)  # so that next() moves past it
                self._choice.unreachable(source, self._waiting(), reason, time.monotonic())
                continue
            if gen != self._sources_gen:
                for up in streams:
                    up.abort()
                return
            self._choice.connected(source)
            self._upstream = streams
            self._progress_mark = (time.monotonic(), self._progress_bytes)
            log.info("%s: subscribed to %s with %d streams", self.id, where, len(streams))
            streams[0].send([self._subscribe_msg()])
            return

    def _subscribe_msg(self) -> bytes:
        have = [
            [v, sorted(st.segments)]
            for v, st in self.versions.items()
            if not st.whole and v not in self.refused and st.segments
        ]
        incomplete = [
            v for v, st in self.versions.items() if not st.whole and v not in self.refused
        ]
        start = self.active[0] + 1 if self.active is not None else 0
        done = [v for v, st in self.versions.items() if st.whole]
        first = min(incomplete) if incomplete else max([start, *(v + 1 for v in done)])
        return wire.control(
            {
                "op": "subscribe",
                "from": first,
                "have": have,
                "done": [v for v in done if v >= first],
            }
        )

    def _fetch_msg(self, version: int, st: _Version, also_have: Iterable[int] = ()) -> bytes:
        have = sorted(set(st.segments).union(also_have))
        return wire.control({"op": "fetch", "version": version, "have": have})

    async def _connect(self, source: int, host: str, port: int) -> list[_Upstream]:
        loop = asyncio.get_running_loop()
        session = os.urandom(16)  # a new subscription: the source keys it by (id, session)
        streams: list[_Upstream] = []
        try:
            for i in range(self.config.streams):
                up = _Upstream(
                    source,
                    f"{host}:{port}",
                    wire.TokenBucket(self.config.control_rate, self.config.control_burst),
                )
                streams.append(up)
                transport, reader = await loop.create_connection(
                    lambda up=up: FrameReader(
                        slot=lambda *a: self._slot(up, *a),
                        received=lambda v, seg: self._accept(up, v, seg),
                        abandon=self._abandon,
                        name=f"{self.id}<-{host}:{port}",
                    ),
                    host,
                    port,
                    ssl=self.config.ssl_client,
                    ssl_handshake_timeout=(
                        self.config.connect_timeout_s if self.config.ssl_client else None
                    ),
                )
                up.transport, up.reader = transport, reader
                await wire.client_handshake(
                    reader.recv,
                    transport.write,
                    secret=self.config.secret,
                    hello={
                        "id": self.id,
                        "session": session,
                        "stream": i,
                        "streams": self.config.streams,
                    },
                    binding=wire.channel_binding(transport),
                )
                reader.authenticated = True  # the source proved it knows the secret
                reader.control = lambda kind, body, up=up: self._on_upstream_frame(up, kind, body)
                reader.deliver_queued()
                wire.tune_socket(
                    transport,
                    buffer_bytes=self.config.buffer_bytes,
                    congestion=self.config.congestion,
                )
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams

    def _switch(self, why: str) -> None:
        """Leave the current source (a try for every version still waiting) and connect to the
        next one."""
        live = self._upstream
        if not live:
            return
        source = live[0].source
        self.metrics.source_switches += 1
        self._log.warning(f"switch:{source}", "%s: leaving %s: %s", self.id, live[0].where, why)
        self._choice.left(source, self._waiting(), why, now=time.monotonic())
        for s in live:
            s.abort()
        self._upstream = []
        self._spawn(self._reconnect())

    async def _reconnect(self) -> None:
        if not self._choice.ready(time.monotonic()):
            return  # the watchdog connects once the backoff is over
        with contextlib.suppress(Exception):
            await self._connect_round()
        self._check_refusals()

    def _blame(self, up: _Upstream, version: int, what: str, kind: str) -> None:
        """``up``'s source sent something for ``version`` that is refuted: never again for it."""
        self.metrics.refused[kind] += 1
        if self._choice.refute(version, up.source, what):
            self._log.warning(
                f"blame:{up.source}:{version}",
                "%s: %s sent %s for v%d; not using it again for that version",
                self.id,
                up.where,
                what,
                version,
            )
        live = self._upstream
        if live and live[0].source == up.source and not up.aborted:
            self._switch(f"it sent {what} for v{version}")
        self._check_refusals()

    def _on_upstream_frame(self, up: _Upstream, kind: int, body: bytes) -> None:
        """A control frame from a source, acted on as it arrives (between segments)."""
        if up.aborted:
            return
        if not up.bucket.take():
            self.metrics.refused["control"] += 1
            self._switch(f"control frames faster than {self.config.control_rate:g}/s")
            return
        try:
            if kind != wire.CONTROL:
                raise ProtocolError(f"unexpected frame type {kind} from the source")
            msg = wire.parse_control(body)
            op = msg["op"]
            if op == "announce":
                signed = msg.get("a")
                if not isinstance(signed, bytes):
                    raise ProtocolError("announce without the signed bytes")
                try:
                    ann = self._verify(signed)
                except AnnouncementError as exc:
                    self.metrics.refused["announcement"] += 1
                    self._switch(f"it sent an announcement that does not verify: {_reason(exc)}")
                    return
                self._on_announcement(ann, signed, via=up.source)
            elif op == "commit":
                self._on_commit(_int(msg.get("version"), "version"))
            else:
                raise ProtocolError(f"unknown message {str(op)[:40]!r}")
        except ProtocolError as exc:
            # One bad message is dropped, not the connection: a flood of them is what the rate
            # limit is for.
            self.metrics.refused["control"] += 1
            self._log.warning(
                f"ctl:{up.source}",
                "%s: ignored a message from %s: %s",
                self.id,
                up.where,
                _reason(exc),
            )

    def _slot(
        self,
        up: _Upstream,
        version: int,
        key: str,
        seq: int,
        offset: int,
        length: int,
        trailer: bool,
    ) -> memoryview | None:
        """Where a segment's bytes go as they arrive (its place in the version's arena), or None
        to read them into scratch and drop them."""
        view = self._slot_for(up, version, key, seq, offset, length, trailer)
        if view is None:
            self.metrics.segments_discarded += 1
        else:
            self.metrics.hop(version, "in_first")
        return view

    def _slot_for(
        self,
        up: _Upstream,
        version: int,
        key: str,
        seq: int,
        offset: int,
        length: int,
        trailer: bool,
    ) -> memoryview | None:
        if up.aborted or version in self.refused:
            return None
        if self.active is not None and version <= self.active[0]:
            return None
        st = self.versions.get(version)
        if st is not None and st.whole:
            return None
        if st is None or st.ann is None:
            # Not announced yet: the one provisional version, within the budget, no trailer.
            provisional = self._provisional_version()
            if provisional is not None and version != provisional:
                return None
            if provisional is None and any(
                s.ann is None and s.reassembler is not None and v != version
                for v, s in self.versions.items()
            ):
                return None
            if offset + length > self.config.max_delta_bytes:
                return None
            if st is None:
                st = self.versions[version] = _Version()
            if trailer:
                st.missed = True
                return None
            if st.reassembler is None:
                st.reassembler = Reassembler(
                    key=key, arena=self._arenas.take(), budget=self._unannounced_budget()
                )
            view = st.reassembler.slot(key, seq, offset, length, trailer)
            if view is None and key == st.reassembler.key and seq not in st.segments:
                st.missed = True  # over the budget, most likely: fetch it once announced
            return view
        if st.reassembler is None:  # the first wanted byte of an announced version
            st.reassembler = Reassembler(arena=self._arenas.take(), expected=st.ann)
        refuted = st.reassembler.refutes(key, seq, offset, length, trailer)
        if refuted is not None:
            self._blame(up, version, refuted, "segment")
            return None
        return st.reassembler.slot(key, seq, offset, length, trailer)

    def _unannounced_budget(self) -> int:
        if self.config.unannounced_bytes is not None:
            return self.config.unannounced_bytes
        if self._largest_announced == 0:
            return UNANNOUNCED_FIRST
        return min(self.config.max_delta_bytes, self._largest_announced * 5 // 4 + (1 << 20))

    def _abandon(self, version: int, view: memoryview) -> None:
        st = self.versions.get(version)
        if st is not None and st.reassembler is not None:
            st.reassembler.abandon(view)

    def _accept(self, up: _Upstream, version: int, seg: Segment) -> None:
        st = self.versions.get(version)
        if st is None or st.reassembler is None or not st.reassembler.issued(seg):
            return  # the version was dropped, refused or started afresh while this arrived
        ra = st.reassembler
        self._progress_bytes += len(seg.data)
        try:
            complete = ra.add(seg)
        except DeltaError as exc:
            if not (seg.trailer and ra.holds(seg.seq, trailer=True)):
                what = "a trailer" if seg.trailer else f"segment {seg.seq}"
                self._blame(up, version, f"{what} that is refused ({_reason(exc)})", "segment")
                self._refuted_by_trailer(version, st)
                return
            complete = ra.complete  # the trailer is in; it refuted segments others sent
        self._refuted_by_trailer(version, st)
        if not ra.holds(seg.seq, trailer=seg.trailer):
            return
        st.segments[seg.seq] = seg
        st.origin[seg.seq] = up.source
        st.progress = time.monotonic()
        self.metrics.bytes_verified += len(seg.data)
        self._choice.progressed()
        if self.config.cut_through:
            for sub in self.subscribers.values():
                if sub.subscribed:
                    sub.queue(version, (seg.seq,))  # cut-through: forward once verified
        if complete:
            st.received_at = time.monotonic()
            if not self.config.cut_through:
                # Store-and-forward (the PrimeRL baselines' relays): the whole version, now.
                for sub in self.subscribers.values():
                    if sub.subscribed:
                        sub.queue(version, sorted(st.segments))
            self._complete(version, st)

    def _refuted_by_trailer(self, version: int, st: _Version) -> None:
        """Segments the trailer just refuted: drop them, blame whoever sent them."""
        assert st.reassembler is not None
        refuted = st.reassembler.take_refuted()
        for seq in refuted:
            st.segments.pop(seq, None)
            source = st.origin.pop(seq, None)
            if source is not None:
                self.metrics.refused["segment"] += 1
                if self._choice.refute(version, source, f"segment {seq} that the trailer refutes"):
                    self._log.warning(
                        f"blame:{source}:{version}",
                        "%s: %s:%d sent segment %d of v%d that the trailer refutes; not using it "
                        "again for that version",
                        self.id,
                        *self.sources[source],
                        seq,
                        version,
                    )
                live = self._upstream
                if live and live[0].source == source:
                    self._switch(f"it sent segment {seq} of v{version} that the trailer refutes")
        if refuted:
            live = self._live()
            if live:
                live[0].send([self._fetch_msg(version, st)])
            self._check_refusals()

    def _complete(self, version: int, st: _Version) -> None:
        assert st.reassembler is not None and st.ann is not None
        try:
            delta = st.reassembler.result()
        except DeltaError as exc:
            self._refuse(version, f"D_{version} does not verify: {_reason(exc)}")
            return
        st.delta = delta
        st.reassembler = None
        self.metrics.hop(version, "in_last")
        live = self._upstream
        self._choice.done(version, live[0].source if live else None)
        if st.commit_pending:
            self._on_commit(version)
        if self.active is None:
            self._trim_cache()
        else:
            self._try_stage(version)
        self._changed.set()

    def _try_stage(self, version: int) -> None:
        """Stage complete ``D_version`` if its base is here; wait if its base may still come;
        refuse it if its base can never be here."""
        assert self.active is not None
        st = self.versions[version]
        delta = st.delta
        if delta is None or version in self.staged or version in self.refused:
            return
        known = {self.active[0]: self.active[1]} | {
            d.version: d.weights_hash for d in self.staged.values()
        }
        if delta.base not in known:
            if delta.base > self.active[0]:
                return  # its base is on its way: staged when that one is
            self._refuse(
                version,
                f"D_{version} is based on v{delta.base}, older than the active v{self.active[0]}",
            )
            return
        if known[delta.base] != delta.base_hash:
            self._refuse(
                version,
                f"D_{version} is based on v{delta.base} (h={delta.base_hash[:12]}..), which this "
                f"node does not hold (it has h={known[delta.base][:12]}..); not staged",
            )
            return
        try:
            self._staging.stage(version)
        except IllegalTransition as exc:  # not newer than the active version
            self._refuse(version, f"D_{version} not staged: {exc}")
            return
        self.staged[version] = delta
        self.metrics.hop(version, "staged")
        assert st.ann is not None
        if self.on_staged is not None:
            self._call_back("on_staged", self.on_staged, delta, st.ann)
        nxt = self.versions.get(version + 1)
        if nxt is not None and nxt.delta is not None:
            self._try_stage(version + 1)

    def _refuse(self, version: int, reason: str) -> None:
        if version in self.refused:
            return
        self.refused[version] = reason
        self.metrics.refused["version"] += 1
        log.warning(
            "%s: %s", self.id, reason if reason.startswith("D_") else f"D_{version}: {reason}"
        )
        st = self.versions.get(version)
        if st is not None and not st.whole:
            st.reassembler = None  # its memory goes back as soon as nothing else holds it
            st.segments.clear()
            st.origin.clear()
        self._choice.done(version)
        if self.on_refused is not None:
            self._call_back("on_refused", self.on_refused, version, reason)
        self._changed.set()

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
                _reason(exc),
            )

    def _check_refusals(self) -> None:
        """Refuse every waiting version that no source can complete (after the fallback)."""
        if not self.sources:
            return
        for v in self._waiting():
            reason = self._choice.refusal(v)
            if reason is None:
                continue
            st = self.versions[v]
            if self.fallback is not None and not st.fallback_tried:
                st.fallback_tried = True
                self._spawn(self._from_fallback(v, reason))
                continue
            if v not in self._in_fallback:
                self._refuse(v, reason)

    async def _from_fallback(self, version: int, why: str) -> None:
        assert self.fallback is not None
        self._in_fallback.add(version)
        try:
            data = await self.fallback(version)
            self.add_file(data)
        except Exception as exc:  # anything the fallback raises is its one-line reason
            self._refuse(version, f"{why}; the fallback failed too: {_reason(exc)}")
        finally:
            self._in_fallback.discard(version)

    def add_file(self, data: bytes | bytearray | memoryview) -> Delta:
        """Take ``D_v`` as a whole file (the Checkpoint Store, a fallback): verified against its
        announcement (which this node must have), then served and staged like a received one.
        Raises a DeltaError (AnnouncementError when the version is not announced)."""
        from aurora.delta.reader import parse_header

        head, _ = parse_header(data)
        v = head["version"]
        st = self.versions.get(v)
        if st is None or st.ann is None:
            raise AnnouncementError(f"D_{v} is not announced here: hand its announcement first")
        ann = st.ann
        delta = read_delta(data, expected_id=ann.delta_id, expected_hash=ann.weights_hash)
        if delta.size != ann.size:
            raise AnnouncementError(f"D_{v} is {delta.size} bytes, announced {ann.size}")
        if st.whole:
            return st.delta if st.delta is not None else delta
        st.reassembler = None
        st.segments = {s.seq: s for s in segments_of(bytes(data))}
        st.origin.clear()
        st.delta = delta
        st.received_at = time.monotonic()
        self._choice.done(v)
        self.refused.pop(v, None)
        for sub in self.subscribers.values():
            if sub.subscribed:
                self._send_version(sub, v, set())
        if st.commit_pending:
            self._on_commit(v)
        if self.active is None:
            self._trim_cache()
        else:
            self._try_stage(v)
        self._changed.set()
        return delta

    def request(self, first: int, last: int) -> None:
        """Ask for ``D_first .. D_last`` again (catch-up, or a retry after a refusal): their
        refusals and source history are forgotten and the current source is asked for what is
        missing (the next source on connecting)."""
        live = self._live()
        if not self._waiting():
            self._progress_mark = (time.monotonic(), self._progress_bytes)
        for v in range(first, last + 1):
            if self.active is not None and v <= self.active[0]:
                continue
            if self.refused.pop(v, None) is not None:
                self._choice.forget(v)
                old = self.versions.pop(v, None)
                if old is not None and old.ann is not None:
                    self.versions[v] = _Version(ann=old.ann, signed=old.signed)
            st = self.versions.get(v)
            if live and (st is None or not st.whole):
                msg = (
                    self._fetch_msg(v, st)
                    if st is not None
                    else wire.control({"op": "fetch", "version": v, "have": []})
                )
                live[0].send([msg])

    async def delta(self, version: int, timeout: float) -> tuple[Delta, VersionAnnouncement]:
        """Wait until ``D_version`` is staged: (the verified delta, the announcement it matched).
        Raises :class:`VersionRefused` with the reason if it is refused, TimeoutError after
        ``timeout`` s."""
        await self.wait_for(lambda: version in self.staged or version in self.refused, timeout)
        if version in self.refused:
            raise VersionRefused(version, self.refused[version])
        return self.staged[version], self.announcements[version]

    def _on_commit(self, version: int) -> None:
        st = self.versions.get(version)
        if st is None or not st.whole:
            if (self.active is None or version > self.active[0]) and version not in self.refused:
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
            try:
                await self._tick(time.monotonic())
            except Exception as exc:  # a bug here must not end the node's recovery
                log.error("%s: watchdog: %s: %s", self.id, type(exc).__name__, _reason(exc))

    def _is_late(self, now: float) -> bool:
        """Whether a watchdog tick at ``now`` comes late: more than 2 x ``stall_s`` after the
        last one that judged (every stall_s / 2 when on time)."""
        return now - self._last_tick > 2 * self.config.stall_s

    async def _tick(self, now: float) -> None:
        live = self._live()
        if not live:
            if self._upstream:
                self._log.warning("lost", "%s: lost every stream to its source", self.id)
                self._choice.left(
                    self._upstream[0].source, self._waiting(), "connection lost", now=now
                )
                self._upstream = []
                self.metrics.source_switches += 1
            if self._choice.ready(now) and not self._reconnecting:
                await self._connect_round()
            self._check_refusals()
            return
        # A tick that comes late (more than 2 x stall_s after the last: this process's loop was
        # busy, or the OS paused it) judges no source. Bytes may be waiting unread in the
        # kernel, and a peer paused with this process (same host, same process in tests) may
        # not have had its turn to send: the silence is this node's, not the source's.
        late = self._is_late(now)
        self._last_tick = now
        # The stuck rule. Skipped on a late tick, not restarted: the first tick on time after a
        # pause (stall_s / 2 later) closes a stream that was already silent for the limit.
        for s in [] if late else live:
            if s.stuck(now, _SILENT_LIMIT_STALLS * self.config.stall_s):
                # Stuck, not slow: close it, which hands its slot back for the re-fetch.
                self._log.warning(
                    "silent", "%s: an upstream stream is silent mid-frame; closing it", self.id
                )
                s.abort()
        live = [s for s in live if s.alive]
        waiting = self._waiting()
        # The progress rule: an announced version is incomplete, and the source delivered fewer
        # than min_rate x progress_s wanted bytes over the last progress_s. A late tick judges
        # nothing here either, and the window starts again.
        mark_t, mark_b = self._progress_mark
        if not waiting or late:
            self._progress_mark = (now, self._progress_bytes)
        elif now - mark_t >= self.config.progress_s:
            got = self._progress_bytes - mark_b
            if got < self.config.min_rate_bytes_s * (now - mark_t):
                self._switch(
                    f"{got} wanted bytes in {now - mark_t:.1f} s while v{min(waiting)} is "
                    f"incomplete (slower than {self.config.min_rate_bytes_s:g} B/s)"
                )
                return
            self._progress_mark = (now, self._progress_bytes)
        if not live:
            return
        stalled = [
            v
            for v, st in self.versions.items()
            if not st.whole
            and v not in self.refused
            and (st.ann is not None or st.reassembler is not None)
            and now - st.progress > self.config.stall_s
        ]
        if not stalled or any(s.reader is not None and s.reader.frame_since for s in live):
            # A segment is still arriving: slow streams (many of them sharing a thin link)
            # are not stalled, and fetching now would send in-flight segments twice.
            return
        for v in stalled:
            st = self.versions[v]
            st.progress = now
            live[0].send([self._fetch_msg(v, st)])

    def _trim_cache(self) -> None:
        """A source or relay keeps the newest ``cache_versions`` whole versions (bounded memory
        over thousands of steps); an incomplete one is never dropped here. A subscriber that
        still had segments of a dropped version queued fell that far behind: it is dropped."""
        done = sorted(v for v, st in self.versions.items() if st.whole)
        for v in done[: -self.config.cache_versions]:
            del self.versions[v]
            self.announcements.pop(v, None)
            self.committed.discard(v)
            for sub in list(self.subscribers.values()):
                if any(key[0] == v for key in sub.pending):
                    self._drop_subscriber(
                        sub,
                        f"it still had v{v} queued when v{v} left the cache "
                        f"({self.config.cache_versions} versions)",
                    )

    def release(self, upto: int) -> None:
        """Forget every version up to ``upto`` (this node has applied them, or no longer serves
        them): the segments, the staged delta and the refusals. Each version's arena goes back to
        the pool as soon as the caller, too, holds no ``Delta`` of it, so a node that releases
        each version after applying it receives the next one into memory already committed."""
        for v in [v for v in self.versions if v <= upto]:
            del self.versions[v]
            self._choice.done(v)
        for table in (self.staged, self.refused, self.announcements):
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

    def caught_up(self, version: int, weights_hash: str) -> None:
        """The weights jumped to ``version`` (a verified snapshot and/or chain applied by the
        caller, or this node had no weights yet): it becomes the base later deltas are checked
        against, everything up to it is released, and complete versions above it that build on
        it are staged (a catch-up planned while they arrived)."""
        if self.active is not None and version < self.active[0]:
            raise ValueError(
                f"node {self.id}: cannot catch up backwards from v{self.active[0]} to v{version}"
            )
        if self._staging.active is None or version > self._staging.active:
            self._staging.catch_up(version)
        self.active = (version, weights_hash)
        self.staged = {v: d for v, d in self.staged.items() if v > version}
        self.release(version)
        for v in sorted(x for x in self.versions if x > version):
            if self.versions[v].delta is not None and v not in self.staged:
                self._try_stage(v)
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


def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
        raise ProtocolError(f"{what} must be a non-negative integer")
    return value


def _ints(value: object, what: str) -> list[int]:
    if not isinstance(value, list | tuple) or len(value) > _MAX_LIST:
        raise ProtocolError(f"{what} must be a list of at most {_MAX_LIST} integers")
    return [_int(x, what) for x in value]
