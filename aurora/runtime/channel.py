"""The control plane: authenticated, framed msgpack messages between the roles.

Theory of operation
-------------------
Actors, relays and the Trainer each keep one TCP connection to the Ledger. It uses the data
plane's own framing and handshake (:mod:`aurora.transport.wire`): length-prefixed frames, a
mutual proof of the job secret before any message, msgpack maps with an ``op`` key after it.
Reusing it instead of adding an RPC library keeps one authentication scheme, one set of frame
limits and one hardened parser for every connection of a job (``docs/RUNTIME.md`` says why not
gRPC or ZeroMQ).

A :class:`Channel` is one such connection after the handshake: :meth:`Channel.send` queues a
message and waits for the socket to drain (backpressure), :meth:`Channel.recv` returns the next
message or raises :class:`ChannelClosed`. The peer's ``hello`` (its id and role) is kept on the
channel: ids are bound to the authenticated connection, so no other peer can speak for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aurora.transport import wire
from aurora.transport.wire import AuthError, ProtocolError

log = logging.getLogger("aurora.runtime")

MAX_MESSAGE = 64 << 20
"""Largest control message accepted from an authenticated peer (bytes): a batch of results of a
large model is a few MB (token ids and log-probs); anything larger is a bug or an attack."""


class ChannelClosed(ConnectionError):
    """The other end closed the connection or sent something the protocol does not allow."""


class Channel:
    """One authenticated control connection (see the module docstring)."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hello: dict[str, Any]
    ) -> None:
        self.reader, self.writer, self.hello = reader, writer, hello
        self.peer = str(hello.get("id", "?"))
        self._lock = asyncio.Lock()
        self.closed = False

    async def send(self, msg: dict[str, Any]) -> None:
        """Send one message; raises :class:`ChannelClosed` if the connection is gone."""
        if self.closed:
            raise ChannelClosed(f"connection to {self.peer} is closed")
        async with self._lock:
            try:
                self.writer.write(wire.control(msg))
                await self.writer.drain()
            except (ConnectionError, OSError, RuntimeError) as exc:
                self.close()
                raise ChannelClosed(f"connection to {self.peer} broke: {exc}") from None

    def send_nowait(self, msg: dict[str, Any]) -> None:
        """Queue a message without waiting for the socket (small messages from callbacks)."""
        if self.closed:
            return
        try:
            self.writer.write(wire.control(msg))
        except (ConnectionError, OSError, RuntimeError):
            self.close()

    async def recv(self) -> dict[str, Any]:
        """The next message; raises :class:`ChannelClosed` at the end of the connection."""
        try:
            kind, body = await wire.read_frame(self.reader, MAX_MESSAGE)
            if kind != wire.CONTROL:
                raise ProtocolError(f"expected a control frame, got type {kind}")
            return wire.parse_control(body)
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            self.close()
            if isinstance(exc, ProtocolError):
                raise ChannelClosed(f"{self.peer}: {exc}") from None
            raise ChannelClosed(f"{self.peer} closed the connection") from None

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
            opened = asyncio.open_unix_connection(unix_path, limit=wire.CONTROL_MAX_FRAME)
        else:
            opened = asyncio.open_connection(host, port, limit=wire.CONTROL_MAX_FRAME)
        reader, writer = await asyncio.wait_for(opened, timeout_s)
    except (OSError, TimeoutError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "timed out"
        raise ConnectionError(f"cannot reach the Ledger at {where}: {reason}") from None
    try:
        await asyncio.wait_for(
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
    return Channel(reader, writer, hello)


Handler = Callable[[Channel], Awaitable[None]]


async def serve(
    host: str,
    port: int,
    *,
    secret: bytes,
    handler: Handler,
    timeout_s: float = 5.0,
    unix_path: str | None = None,
) -> asyncio.base_events.Server:
    """Accept control connections; ``handler`` runs once per authenticated channel. With
    ``unix_path`` the server listens on that Unix socket instead of ``host:port``."""

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            hello = await asyncio.wait_for(
                wire.server_handshake(
                    lambda: wire.read_frame(reader, wire.HANDSHAKE_MAX_FRAME),
                    writer.write,
                    secret=secret,
                ),
                timeout_s,
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
        channel = Channel(reader, writer, hello)
        try:
            await handler(channel)
        except ChannelClosed:
            pass
        finally:
            channel.close()

    if unix_path is not None:
        return await asyncio.start_unix_server(accept, unix_path, limit=wire.CONTROL_MAX_FRAME)
    return await asyncio.start_server(accept, host, port, limit=wire.CONTROL_MAX_FRAME)
