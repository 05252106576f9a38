"""Data-plane settings, counters and the small pieces every part of a node shares.

Theory of operation
-------------------
A node (:mod:`aurora.transport.node`) is a shell around three parts: the receive machine
(:mod:`aurora.transport.receiver`), the server of subscribers (:mod:`aurora.transport.server`)
and the connections to sources (:mod:`aurora.transport.upstream`). They read one
:class:`TransportConfig` (every node of a job has the same), count into one :class:`NodeMetrics`
and log through one :class:`RateLimitedLog`, so a flood of bad input cannot flood the log. This
module imports none of them: each of them imports it.
"""

from __future__ import annotations

import collections
import logging
import ssl
import time
from dataclasses import dataclass, field

from aurora.delta.arena import DEFAULT_CAPACITY

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
    it has not yet activated (:meth:`Node.set_active`)."""
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
SILENT_LIMIT_STALLS = 10
"""A stream in the middle of a frame that has received no byte for this many ``stall_s`` is
stuck (5 s by default: longer than TCP's retransmission backoff after three losses in a row)
and is closed, which hands its slot back for the re-fetch. Judged only on a watchdog tick that
comes on time: after a pause of this process, what arrived meanwhile is read first."""
WRITE_CHUNK = 1 << 20
"""Bytes handed to a socket per write (1 MiB: below the send buffer, so most go straight in)."""
OWN_LIMIT = 4096
"""Control frames queued on one connection to a subscriber before it counts as not reading."""
MAX_LIST = 1 << 17
"""Longest list of segment numbers a request may carry (131,072: a 512 GiB delta's)."""
_HOP_VERSIONS = 64
"""Versions whose hop times a node keeps (a few hundred bytes each)."""
_LOG_EVERY_S = 5.0
_LOG_BURST = 3
"""Warnings with the same key: at most this many per ``_LOG_EVERY_S`` seconds."""


class RateLimitedLog:
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


def one_line(exc: BaseException) -> str:
    """A one-line reason for an exception, never empty."""
    text = str(exc).split("\n")[0].strip()
    if isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror
    return text or type(exc).__name__
