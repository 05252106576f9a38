"""The receiving side's connections: ``S`` authenticated streams to one source at a time.

Theory of operation
-------------------
A subscription is ``streams`` TCP connections to one source, each authenticated
(:mod:`aurora.transport.wire`; the source proves it knows the job's secret before any frame of
it is believed to come from the job) and tuned (socket buffers, congestion control). Each is a
:class:`~aurora.transport.framing.FrameReader` whose callbacks the node wires to its receive
machine: a segment's bytes go straight into the slot the machine gives. :func:`open_streams`
makes them; :class:`Upstream` is one of them, which this node only ever sends small control
frames on. Which source to connect to, and when to leave it, is the receive machine's
(:class:`~aurora.transport.sources.SourceChoice`); this module knows nothing of versions.

Two per-connection judgments live here, on clocks the node reads: :meth:`Upstream.stuck` (in the
middle of a frame and silent for a limit: close it, which hands its slot back for the re-fetch)
and :func:`delivering` (a byte came within ``DELIVERING_S``: the source is pushing, so asking it
for what is missing now would have it sent twice).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from aurora.transport import wire
from aurora.transport.config import TransportConfig
from aurora.transport.framing import FrameReader, SlotFn

DELIVERING_S = 0.05
"""A connection that received a byte this recently (s) is still delivering (between two
back-to-back frames of one push); also how often a node waiting to fetch looks again."""


class Upstream:
    """One connection to a source: frames arrive through a :class:`FrameReader`; this node
    only ever sends it small control frames."""

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


def delivering(up: Upstream, now: float) -> bool:
    """The source is sending on this connection now: in the middle of a frame, or a byte came
    within the last ``DELIVERING_S``."""
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
