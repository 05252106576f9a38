"""The control plane: authenticated, integrity-protected, framed msgpack messages between roles.

Theory of operation
-------------------
Actors, relays and the Trainer each keep one TCP connection to the Ledger. It uses the data
plane's own framing and handshake (:mod:`aurora.transport.wire`): length-prefixed frames, a
mutual proof of the job secret before any message, msgpack maps with an ``op`` key after it.
Reusing it instead of adding an RPC library keeps one authentication scheme, one set of frame
limits and one hardened parser for every connection of a job (``docs/RUNTIME.md`` says why not
gRPC or ZeroMQ).

**Every frame after the handshake is sealed** (``wire.SEALED``): ``tag || msgpack`` where
``tag = HMAC-SHA256(k, seq || msgpack)``. ``k`` is one of two per-connection keys derived by
HKDF from the job secret, the server's nonce and the HELLO (which holds the client's nonce)
(:func:`aurora.transport.wire.session_keys`), one per direction; ``seq`` counts the frames sent
in that direction from 0 and is not sent: each end knows which one comes next. So an on-path
party without the secret can read the traffic and drop it, but any frame it alters, injects,
replays, reorders, reflects or cuts out makes the next frame fail its MAC, and the receiver
closes the connection (both ends then reconnect and resynchronise through the protocol, as after
any broken connection). The plain data-plane handshake alone left every later frame open to
rewriting (16 of 16 rewritten results were admitted, and an injected ``catch_up`` moved an Actor
back to v0). Why a MAC and not TLS: TLS needs a certificate per role and a way to issue and pin
them, which the job does not have yet (the job's only key pair is the Trainer's Ed25519 key, and
only the Trainer holds the private half); a MAC keyed from the handshake every connection
already runs adds no key to distribute and 32 bytes per frame. What it does not give:
confidentiality (results travel readable; TLS is for that), and protection from a party that
holds the job secret and sits on the path (it can derive the keys): that needs each role's own
key pair, the second half of issue 26 (``docs/TRANSPORT.md``, "The control plane").

**Bounded resources** (:class:`ChannelLimits`, one per server): a server holds at most
``max_pending_per_host`` unauthenticated connections from one remote host and
``max_pending`` in all (each gets ``timeout_s`` to finish its handshake), and at most
``max_connections`` authenticated ones; beyond these a new connection is closed at once, so
its descriptor is held for microseconds (~1,100 idle connections exhausted the Ledger's 1,024
descriptors before). A frame's body is read only once its length is reserved from the
server-wide ``buffer_budget`` (bytes of message bodies held at once, all connections together),
and must then arrive at ``min_rate_bytes_s`` or better; a connection waiting for the budget
reads nothing (TCP backpressure holds the rest in the kernel), so six connections each sending
part of a 64 MiB frame hold at most the budget, not 6 x 64 MiB. Each connection may deliver
``rate`` messages a second (``burst`` at once): beyond that the server stops reading from it
(it is slowed, not disconnected: an honest Actor's burst of results waits, a flooder gets its
rate and no more). A peer that stops reading while more than ``max_send_buffer`` bytes wait
for it is disconnected.

A :class:`Channel` is one connection after the handshake: :meth:`Channel.send` queues a
message and waits for the socket to drain (backpressure), :meth:`Channel.recv` returns the next
message or raises :class:`ChannelClosed`. The peer's ``hello`` (its id and role) is kept on the
channel. It is authenticated only as far as the job secret goes: every secret holder can say
any id and role (per-role identity is the second half of issue 26).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import hmac
import logging
import mmap
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from aurora.runtime import messages
from aurora.transport import wire
from aurora.transport.wire import AuthError, ProtocolError

log = logging.getLogger("aurora.runtime")

MAX_MESSAGE = 64 << 20
"""Largest control message a client accepts from the Ledger (bytes): the batch of results the
Trainer fetches is the largest (token ids and log-probs of a whole step); anything larger is a
bug or an attack."""
TAG_BYTES = 32
"""Bytes of the HMAC-SHA256 tag in front of every sealed frame's message."""
_SEQ = struct.Struct("<Q")
STREAM_LIMIT = 64 << 10
"""Read-ahead of a connection's stream reader (bytes): it stops reading from the socket past
2 x this, so a connection waiting for the buffer budget holds at most 128 KiB in this process."""


SMALL_BODY = 256 << 10
"""Bodies up to this (bytes) are read whole by the stream reader (nearly every message: a
result of a small model, a heartbeat); larger ones into their own mapping (one system call
each, worth it only where a copy or a stuck heap block would cost more)."""


class ChannelClosed(ConnectionError):
    """The other end closed the connection or sent something the protocol does not allow."""


@dataclass(frozen=True, kw_only=True)
class ChannelLimits:
    """What one control server (the Ledger) lets its peers hold (module docstring)."""

    max_message: int = 16 << 20
    """Largest message a peer may send the server (bytes). A result is one prompt's
    completions (group x tokens x ~14 bytes: 16 x 4,096 tokens is ~1 MB); 16 MiB leaves room
    for long generations. The server's replies (a batch, up to ``MAX_MESSAGE``) are not
    bounded by it."""
    buffer_budget: int = 16 << 20
    """Bytes of message bodies the server reads into memory at once, all connections
    together: a frame waits (unread, in the kernel) until its length fits."""
    min_rate_bytes_s: float = 64 << 10
    """A frame's body, once its reading has begun, must arrive at least this fast (bytes/s),
    after ``timeout_s`` of grace: otherwise the connection is closed and its budget freed."""
    max_pending_per_host: int = 64
    """Unauthenticated connections one remote host may hold at once (as ``Node``'s data plane)."""
    max_pending: int = 256
    """Unauthenticated connections all hosts together may hold at once."""
    max_connections: int = 512
    """Authenticated connections at once (Actors, relays, the Trainer, observers)."""
    rate: float = 2000.0
    """Messages a second one connection may deliver on average (the server reads no faster)."""
    burst: int = 8192
    """Messages one connection may deliver at once (an Actor returns a whole assignment's
    results together)."""
    max_send_buffer: int = 64 << 20
    """Bytes queued for one peer that has stopped reading before it is disconnected."""
    timeout_s: float = 5.0
    """Seconds to finish the handshake; also the grace before a frame's rate is judged."""

    def __post_init__(self) -> None:
        for name in (
            "max_message",
            "buffer_budget",
            "max_pending_per_host",
            "max_pending",
            "max_connections",
            "burst",
            "max_send_buffer",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ChannelLimits.{name} must be an int >= 1, got {value!r}")
        for name in ("min_rate_bytes_s", "rate", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ChannelLimits.{name} must be > 0, got {getattr(self, name)!r}")
        if self.buffer_budget < self.max_message:
            raise ValueError("ChannelLimits.buffer_budget must hold at least one max_message")


class ByteBudget:
    """Bytes that may be held at once, shared by the connections of one server; a reservation
    that does not fit waits until enough is released."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.held = 0
        self.peak = 0
        self._freed = asyncio.Event()

    async def acquire(self, n: int) -> None:
        while self.held + n > self.total:
            self._freed.clear()
            await self._freed.wait()
        self.held += n
        self.peak = max(self.peak, self.held)

    def release(self, n: int) -> None:
        # Synchronous, so that it also runs whole in a ``finally`` of a cancelled reader.
        self.held -= n
        self._freed.set()


class _Sealer:
    """One direction of a sealed channel: a key and the next sequence number."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.seq = 0

    def tag(self, body: bytes | memoryview) -> bytes:
        mac = hmac.new(self.key, _SEQ.pack(self.seq), hashlib.sha256)
        mac.update(body)
        self.seq += 1
        return mac.digest()


class Channel:
    """One authenticated control connection (see the module docstring)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        hello: dict[str, Any],
        *,
        keys: tuple[bytes, bytes],
        max_message: int = MAX_MESSAGE,
        budget: ByteBudget | None = None,
        limits: ChannelLimits | None = None,
    ) -> None:
        """``keys``: (this end's sending key, this end's receiving key)."""
        self.reader, self.writer, self.hello = reader, writer, hello
        self.peer = str(hello.get("id", "?"))
        self._lock = asyncio.Lock()
        self.closed = False
        self._out, self._in = _Sealer(keys[0]), _Sealer(keys[1])
        self.max_message = max_message
        self._budget = budget
        self._limits = limits
        self._bucket = wire.TokenBucket(limits.rate, limits.burst) if limits else None
        self.refused = 0
        """Messages :meth:`recv_checked` dropped."""
        self._head: bytes | None = None
        """The header of a frame whose body a cancelled :meth:`recv` had not read yet (a
        caller may wrap recv in ``wait_for``): the next recv goes on with that frame."""

    def _write(self, msg: dict[str, Any]) -> None:
        body = msgpack.packb(msg)
        tag = self._out.tag(body)
        # Two writes, not one concatenation: a batch message is tens of MB.
        self.writer.write(wire._HEAD.pack(TAG_BYTES + len(body), wire.SEALED) + tag)
        self.writer.write(body)
        limits = self._limits
        if limits is not None and self.writer.transport.get_write_buffer_size() > (
            limits.max_send_buffer
        ):
            self.close()
            raise ChannelClosed(
                f"{self.peer} stopped reading ({limits.max_send_buffer} bytes queued for it)"
            )

    async def send(self, msg: dict[str, Any]) -> None:
        """Send one message; raises :class:`ChannelClosed` if the connection is gone."""
        if self.closed:
            raise ChannelClosed(f"connection to {self.peer} is closed")
        async with self._lock:
            try:
                self._write(msg)
                await self.writer.drain()
            except (ConnectionError, OSError, RuntimeError) as exc:
                self.close()
                raise ChannelClosed(f"connection to {self.peer} broke: {exc}") from None

    def send_nowait(self, msg: dict[str, Any]) -> None:
        """Queue a message without waiting for the socket (small messages from callbacks)."""
        if self.closed:
            return
        try:
            self._write(msg)
        except (ConnectionError, OSError, RuntimeError):
            self.close()

    async def recv(self) -> dict[str, Any]:
        """The next message; raises :class:`ChannelClosed` at the end of the connection, or
        when a frame fails its MAC (altered, injected, replayed, reordered, or one was cut)."""
        if self._bucket is not None:
            while not self._bucket.take():  # a flooder is slowed to its rate, not read ahead
                await asyncio.sleep(1.0 / self._bucket.rate)
        try:
            if self._head is None:
                self._head = await self.reader.readexactly(wire._HEAD.size)
            length, kind = wire._HEAD.unpack(self._head)
            if kind != wire.SEALED:
                raise ProtocolError(f"expected a sealed control frame, got type {kind}")
            if not TAG_BYTES <= length <= TAG_BYTES + self.max_message:
                raise ProtocolError(
                    f"frame of {length} bytes outside the {self.max_message}-byte limit"
                )
            body = await self._read_body(length)
            self._head = None
            try:
                with memoryview(body) as view, view[:TAG_BYTES] as tag, view[TAG_BYTES:] as msg:
                    if not hmac.compare_digest(tag, self._in.tag(msg)):
                        raise ProtocolError(
                            "a frame failed authentication (altered, injected, replayed or "
                            "reordered on the way, or one was dropped)"
                        )
                    return wire.parse_control(msg)  # type: ignore[arg-type]
            finally:
                if isinstance(body, mmap.mmap):
                    body.close()
        except (asyncio.IncompleteReadError, ConnectionError, OSError, TimeoutError) as exc:
            self.close()
            if isinstance(exc, ProtocolError):
                raise ChannelClosed(f"{self.peer}: {exc}") from None
            if isinstance(exc, TimeoutError):
                raise ChannelClosed(f"{self.peer}: a frame arrived too slowly") from None
            raise ChannelClosed(f"{self.peer} closed the connection") from None

    async def recv_checked(self, direction: messages.Direction) -> dict[str, Any]:
        """The next message that decodes in ``direction`` (:func:`aurora.runtime.messages.
        decode`: every field within its bounds); one that does not is dropped with a log line
        naming op, field and reason, never raised into the caller."""
        while True:
            msg = await self.recv()
            try:
                messages.decode(msg, direction)
            except messages.MessageError as exc:
                self.refused += 1
                log.warning("dropped a message from %s: %s", self.peer, exc)
                continue
            return msg

    async def _read_body(self, length: int) -> bytes | mmap.mmap:
        budget, limits = self._budget, self._limits
        if budget is None or limits is None:
            return await self.reader.readexactly(length)
        await budget.acquire(length)
        try:
            read = (
                self.reader.readexactly(length) if length <= SMALL_BODY else self._read_into(length)
            )
            return await asyncio.wait_for(read, limits.timeout_s + length / limits.min_rate_bytes_s)
        finally:
            # The caller parses the body and closes it before it next awaits anything, so no
            # other connection's frame is read in between: the budget bounds what is held.
            budget.release(length)

    async def _read_into(self, length: int) -> mmap.mmap:
        """``length`` bytes into an anonymous mapping of exactly that size, a chunk at a time.
        ``readexactly`` grows the stream's own buffer to the frame's size and copies it out (up
        to twice the frame at its peak); a mapping commits only the pages bytes arrived in, and
        its close returns them to the system (freed heap blocks of this size stayed with the
        allocator, so each stalled frame in turn raised the process's peak)."""
        buf = mmap.mmap(-1, length)
        try:
            with memoryview(buf) as view:
                pos = 0
                while pos < length:
                    chunk = await self.reader.read(min(length - pos, 1 << 20))
                    if not chunk:
                        raise asyncio.IncompleteReadError(b"", length)
                    view[pos : pos + len(chunk)] = chunk
                    pos += len(chunk)
        except BaseException:
            buf.close()
            # Bytes of this frame were consumed: the stream cannot resume at a frame boundary.
            self.close()
            raise
        return buf

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(Exception):
                self.writer.transport.abort()


async def connect(
    host: str,
    port: int,
    *,
    secret: bytes,
    hello: dict[str, Any],
    timeout_s: float = 5.0,
    unix_path: str | None = None,
) -> Channel:
    """Connect to a control server and authenticate; one-line errors for what goes wrong.
    With ``unix_path`` the connection is made to that Unix socket instead (a local observer
    reaching a Ledger inside another network namespace: the file system is shared)."""
    where = unix_path or f"{host}:{port}"
    try:
        if unix_path is not None:
            opened = asyncio.open_unix_connection(unix_path, limit=STREAM_LIMIT)
        else:
            opened = asyncio.open_connection(host, port, limit=STREAM_LIMIT)
        reader, writer = await asyncio.wait_for(opened, timeout_s)
    except (OSError, TimeoutError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "timed out"
        raise ConnectionError(f"cannot reach the Ledger at {where}: {reason}") from None
    try:
        transcript = await asyncio.wait_for(
            wire.client_handshake(
                lambda: wire.read_frame(reader, wire.HANDSHAKE_MAX_FRAME),
                writer.write,
                secret=secret,
                hello=hello,
            ),
            timeout_s,
        )
    except (AuthError, ProtocolError, asyncio.IncompleteReadError, TimeoutError, OSError) as exc:
        writer.transport.abort()
        if isinstance(exc, AuthError):
            raise ConnectionError(f"{where} refused us: {exc} (check the job secret)") from None
        reason = str(exc) or type(exc).__name__
        raise ConnectionError(
            f"{where} closed the connection during authentication ({reason}); "
            "is the job secret right?"
        ) from None
    c2s, s2c = wire.session_keys(secret, transcript)
    return Channel(reader, writer, hello, keys=(c2s, s2c))


Handler = Callable[[Channel], Awaitable[None]]


class ControlServer:
    """A listening control server and what it holds (counts for tests and stats)."""

    def __init__(self, limits: ChannelLimits) -> None:
        self.limits = limits
        self.budget = ByteBudget(limits.buffer_budget)
        self.pending: collections.Counter[str] = collections.Counter()
        self.connections = 0
        self.refused: collections.Counter[str] = collections.Counter()
        self.server: asyncio.base_events.Server | None = None
        self._warned: dict[str, float] = {}

    @property
    def sockets(self) -> Any:
        assert self.server is not None
        return self.server.sockets

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def wait_closed(self) -> None:
        if self.server is not None:
            await self.server.wait_closed()

    def _refuse(self, writer: asyncio.StreamWriter, why: str, host: str) -> None:
        self.refused[why] += 1
        now = time.monotonic()
        if now - self._warned.get(why, -60.0) >= 5.0:  # one line per reason per 5 s, not per flood
            self._warned[why] = now
            log.warning(
                "refused control connections (%s; latest from %s; %d so far)",
                why,
                host,
                self.refused[why],
            )
        writer.transport.abort()


async def serve(
    host: str,
    port: int,
    *,
    secret: bytes,
    handler: Handler,
    timeout_s: float = 5.0,
    unix_path: str | None = None,
    limits: ChannelLimits | None = None,
) -> ControlServer:
    """Accept control connections; ``handler`` runs once per authenticated channel. With
    ``unix_path`` the server listens on that Unix socket instead of ``host:port``."""
    limits = limits or ChannelLimits(timeout_s=timeout_s)
    ctl = ControlServer(limits)

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) else "unix"
        if ctl.pending[host] >= limits.max_pending_per_host:
            ctl._refuse(writer, "too many unauthenticated connections from one host", host)
            return
        if sum(ctl.pending.values()) >= limits.max_pending:
            ctl._refuse(writer, "too many unauthenticated connections", host)
            return
        if ctl.connections >= limits.max_connections:
            ctl._refuse(writer, "too many connections", host)
            return
        ctl.pending[host] += 1
        try:
            hello, transcript = await asyncio.wait_for(
                wire.server_handshake_transcript(
                    lambda: wire.read_frame(reader, wire.HANDSHAKE_MAX_FRAME),
                    writer.write,
                    secret=secret,
                ),
                limits.timeout_s,
            )
        except (
            AuthError,
            ProtocolError,
            asyncio.IncompleteReadError,
            TimeoutError,
            OSError,
            KeyError,
            TypeError,
            ValueError,
        ) as exc:
            log.warning("refused a control connection from %s: %s", peer, exc or type(exc).__name__)
            writer.transport.abort()
            return
        finally:
            ctl.pending[host] -= 1
            if ctl.pending[host] <= 0:
                del ctl.pending[host]
        if ctl.connections >= limits.max_connections:
            ctl._refuse(writer, "too many connections", host)
            return
        c2s, s2c = wire.session_keys(secret, transcript)
        channel = Channel(
            reader,
            writer,
            hello,
            keys=(s2c, c2s),
            max_message=limits.max_message,
            budget=ctl.budget,
            limits=limits,
        )
        ctl.connections += 1
        try:
            await handler(channel)
        except ChannelClosed:
            pass
        finally:
            ctl.connections -= 1
            channel.close()

    if unix_path is not None:
        ctl.server = await asyncio.start_unix_server(accept, unix_path, limit=STREAM_LIMIT)
    else:
        ctl.server = await asyncio.start_server(accept, host, port, limit=STREAM_LIMIT)
    return ctl
