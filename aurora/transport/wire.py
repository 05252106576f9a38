"""Frames, messages and the authentication handshake of the data plane.

Every TCP connection carries length-prefixed frames ``[u32 length][u8 type][body]``. Control
messages are msgpack maps; a segment frame is ``[u16 n][msgpack header of n bytes][raw data]``
so that the megabytes of a segment are never re-encoded. Before any other frame, both ends prove
they know the job's shared secret (HMAC-SHA256 challenge-response, mutual): a peer that cannot is
disconnected with a log line and no data moves in either direction.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack

from aurora.delta import Segment

log = logging.getLogger("aurora.transport")

HELLO, CHALLENGE, AUTH, OK, CONTROL, SEGMENT = 1, 2, 3, 4, 5, 6
MAX_FRAME = 256 << 20
"""Largest frame accepted from an authenticated source (bytes): a segment is a few MiB; anything
larger is an attack or a bug."""
HANDSHAKE_MAX_FRAME = 4 << 10
"""Largest frame accepted before the other end has proved it knows the secret (bytes): the
handshake's frames are under 200 bytes, so an unauthenticated peer cannot make us buffer more."""
CONTROL_MAX_FRAME = 1 << 20
"""Largest frame a subscriber may send (bytes): control messages, the longest a FETCH listing the
segments it holds (a few bytes each)."""
_HEAD = struct.Struct("<IB")


class AuthError(ConnectionError):
    """The other end does not know the job's secret (or broke the handshake)."""


class ProtocolError(ConnectionError):
    """A frame that is not what the protocol allows here."""


def tune_socket(
    conn: asyncio.StreamWriter | asyncio.BaseTransport, *, buffer_bytes: int, congestion: str | None
) -> dict:
    """Set socket buffers and congestion control explicitly; return what the kernel granted.

    Linux doubles what it is asked for and caps it at ``net.core.{w,r}mem_max``; a grant below
    the request is logged as a warning, since it caps a stream at buffer / RTT (4 MiB over
    100 ms is 335 Mbit/s)."""
    sock = conn.get_extra_info("socket")
    if sock is None:
        return {}
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
    if congestion:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
    granted = {
        "sndbuf": sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
        "rcvbuf": sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF),
        "congestion": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
        .rstrip(b"\0")
        .decode(),
    }
    log.debug("socket %s: %s", conn.get_extra_info("peername"), granted)
    short = tuple((k, granted[k]) for k in ("sndbuf", "rcvbuf") if granted[k] < buffer_bytes)
    if short:
        _warn_short_buffers(buffer_bytes, short)
    return granted


@functools.cache
def _warn_short_buffers(asked: int, short: tuple[tuple[str, int], ...]) -> None:
    """Once per process and outcome, not once per socket."""
    log.warning(
        "asked for %d-byte socket buffers, the kernel granted %s: raise net.core.wmem_max / "
        "net.core.rmem_max, or streams are capped at buffer / RTT",
        asked,
        dict(short),
    )


async def read_frame(reader: asyncio.StreamReader, limit: int = MAX_FRAME) -> tuple[int, bytes]:
    """Read one frame of at most ``limit`` bytes."""
    head = await reader.readexactly(_HEAD.size)
    length, kind = _HEAD.unpack(head)
    if length > limit:
        raise ProtocolError(f"frame of {length} bytes exceeds the {limit}-byte limit")
    return kind, await reader.readexactly(length)


def frame(kind: int, body: bytes) -> bytes:
    return _HEAD.pack(len(body), kind) + body


def control(msg: dict[str, Any]) -> bytes:
    return frame(CONTROL, msgpack.packb(msg))


def segment_frame(version: int, seg: Segment) -> list[bytes]:
    """A segment as frame pieces (header, then the data itself, not copied)."""
    head = msgpack.packb([version, seg.key, seg.seq, seg.offset, seg.checksum, seg.trailer])
    body_len = 2 + len(head) + len(seg.data)
    return [_HEAD.pack(body_len, SEGMENT), struct.pack("<H", len(head)), head, seg.data]


def parse_control(body: bytes) -> dict[str, Any]:
    try:
        msg = msgpack.unpackb(body)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"malformed control frame: {exc}") from None
    if not isinstance(msg, dict) or "op" not in msg:
        raise ProtocolError(f"control frame without an op: {msg!r}"[:200])
    return msg


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"\x00".join(parts), hashlib.sha256).digest()


Recv = Callable[[], Awaitable[tuple[int, bytes]]]
"""Returns the next frame (kind, body) of a connection."""
Send = Callable[[bytes], object]
"""Queues bytes on a connection (a transport's or a stream writer's ``write``)."""


async def client_handshake(recv: Recv, send: Send, *, secret: bytes, hello: dict) -> None:
    """Prove we know ``secret`` and check that the server does too."""
    nonce_c = os.urandom(32)
    send(frame(HELLO, msgpack.packb(hello | {"nonce": nonce_c})))
    kind, body = await recv()
    if kind != CHALLENGE:
        raise AuthError(f"expected a challenge, got frame type {kind}")
    msg = msgpack.unpackb(body)
    nonce_s, proof_s = msg["nonce"], msg["proof"]
    if not hmac.compare_digest(proof_s, _mac(secret, b"server", nonce_c, nonce_s)):
        raise AuthError("the server does not know the job's secret")
    send(frame(AUTH, _mac(secret, b"client", nonce_s, nonce_c, hello["id"].encode())))
    kind, _ = await recv()
    if kind != OK:
        raise AuthError("the server refused our proof")


async def server_handshake(recv: Recv, send: Send, *, secret: bytes) -> dict:
    """Check that the client knows ``secret`` (proving we do too); return its HELLO."""
    kind, body = await recv()
    if kind != HELLO:
        raise AuthError(f"expected HELLO, got frame type {kind}")
    hello = msgpack.unpackb(body)
    if not isinstance(hello, dict) or not isinstance(hello.get("id"), str):
        raise AuthError("HELLO without a peer id")
    nonce_s = os.urandom(32)
    proof = _mac(secret, b"server", hello["nonce"], nonce_s)
    send(frame(CHALLENGE, msgpack.packb({"nonce": nonce_s, "proof": proof})))
    kind, body = await recv()
    want = _mac(secret, b"client", nonce_s, hello["nonce"], hello["id"].encode())
    if kind != AUTH or not hmac.compare_digest(body, want):
        raise AuthError(f"peer {hello['id']!r} failed authentication (wrong secret)")
    send(frame(OK, b""))
    return hello
