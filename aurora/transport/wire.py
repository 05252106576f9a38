"""Frames, messages and the authentication handshake of the data plane.

Every TCP connection carries length-prefixed frames ``[u32 length][u8 type][body]``. Control
messages are msgpack maps; a segment frame is ``[u16 n][msgpack header of n bytes][raw data]``
so that the megabytes of a segment are never re-encoded. Before any other frame, both ends prove
they know the job's shared secret (HMAC-SHA256 challenge-response, mutual; the connecting side
first, so a server is never an oracle: :func:`client_handshake`); a peer that cannot is
disconnected with a log line and no data moves in either direction. Only admission rests on the
secret: the integrity of every delta rests on the Trainer's signature (``docs/TRANSPORT.md``,
"Trust"). The control plane (:mod:`aurora.runtime.channel`) also derives a key per connection and
direction from the handshake's transcript (:func:`session_keys`) and seals every later frame with
it (``SEALED`` frames), so that a party on the path without the secret cannot change what a
handshake admitted.
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
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgpack
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from aurora.delta import Segment

log = logging.getLogger("aurora.transport")

HELLO, CHALLENGE, AUTH, OK, CONTROL, SEGMENT, SEALED = 1, 2, 3, 4, 5, 6, 7
"""Frame types. ``SEALED``: a control message with a MAC under the session key (the control
plane after its handshake, :mod:`aurora.runtime.channel`)."""
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
) -> dict[str, Any]:
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


def parse_control(body: bytes | memoryview) -> dict[str, Any]:
    try:
        msg = msgpack.unpackb(body)
    except (ValueError, msgpack.UnpackException) as exc:
        why = "nested too deeply" if isinstance(exc, msgpack.StackError) else str(exc)
        raise ProtocolError(f"malformed control frame: {why or type(exc).__name__}") from None
    if not isinstance(msg, dict) or "op" not in msg:
        raise ProtocolError(f"control frame without an op: {msg!r}"[:200])
    return msg


def _mac(secret: bytes, *parts: bytes) -> bytes:
    # Length-prefixed, so that no two different part lists give the same MAC input.
    data = b"".join(struct.pack("<I", len(p)) + p for p in parts)
    return hmac.new(secret, data, hashlib.sha256).digest()


Recv = Callable[[], Awaitable[tuple[int, bytes]]]
"""Returns the next frame (kind, body) of a connection."""
Send = Callable[[bytes], object]
"""Queues bytes on a connection (a transport's or a stream writer's ``write``)."""

NONCE_BYTES = 32
MAX_PEER_ID = 128
"""Longest peer id accepted in a HELLO (characters)."""


def channel_binding(conn: asyncio.StreamWriter | asyncio.BaseTransport) -> bytes:
    """What ties a handshake to its TLS session: ``tls-unique`` (the first Finished message of
    the handshake; each TLS session has its own), or nothing on plain TCP. A man in the middle
    has two TLS sessions, one with each end, so proofs made on one fail on the other."""
    ssl_object = conn.get_extra_info("ssl_object")
    if ssl_object is None:
        return b""
    return bytes(ssl_object.get_channel_binding("tls-unique") or b"")


def _unpack(body: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(body)
    except (ValueError, msgpack.UnpackException) as exc:
        why = "nested too deeply" if isinstance(exc, msgpack.StackError) else str(exc)
        raise AuthError(f"malformed {what} ({why or type(exc).__name__})") from None


def _peer_id(hello: object) -> str:
    if not isinstance(hello, dict):
        raise AuthError("HELLO is not a map")
    peer = hello.get("id")
    if not isinstance(peer, str) or not 0 < len(peer) <= MAX_PEER_ID or not peer.isprintable():
        raise AuthError(f"HELLO without a printable peer id of at most {MAX_PEER_ID} characters")
    nonce = hello.get("nonce")
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise AuthError(f"HELLO from {peer!r} without a {NONCE_BYTES}-byte nonce")
    return peer


def _hello_bytes(hello: dict[str, Any]) -> bytes:
    """The HELLO as proved: its canonical msgpack, so every field (the peer id, a session id)
    is bound to the proof and cannot be swapped by whoever relays it."""
    packed: bytes = msgpack.packb(hello)
    return packed


@dataclass(frozen=True)
class Transcript:
    """What both ends of a completed handshake share: the HELLO as proved (its canonical bytes,
    the client's nonce inside) and the server's nonce. Keys for the session are derived from
    it (:func:`session_keys`)."""

    hello: bytes
    nonce_s: bytes
    binding: bytes


SESSION_INFO = b"aurora control session v1"
"""HKDF info label of the control plane's per-session keys (a new label for a new use)."""


def session_keys(secret: bytes, transcript: Transcript) -> tuple[bytes, bytes]:
    """(client-to-server key, server-to-client key), 32 bytes each: HKDF-SHA256 over the job
    secret, salted with the server's nonce, bound to the HELLO (the client's nonce, its id) and
    the TLS binding. Fresh per connection since both nonces are; one key per direction, so a
    frame reflected back to its sender never verifies."""
    info = SESSION_INFO + b"".join(
        struct.pack("<I", len(p)) + p for p in (transcript.binding, transcript.hello)
    )
    okm = HKDF(algorithm=SHA256(), length=64, salt=transcript.nonce_s, info=info).derive(secret)
    return okm[:32], okm[32:]


async def client_handshake(
    recv: Recv, send: Send, *, secret: bytes, hello: dict[str, Any], binding: bytes = b""
) -> Transcript:
    """Prove we know ``secret``, then check that the server does too; returns the transcript
    (for :func:`session_keys`).

    The connecting side proves itself first, so the server is never an oracle: it answers
    with its own proof only to a peer that has already proved it knows the secret, for this
    HELLO and this server nonce. ``binding`` (:func:`channel_binding`) ties both proofs to the
    TLS session when there is one::

        client -> HELLO {id, nonce_c, ...}      server -> CHALLENGE {nonce_s}
        client -> AUTH  MAC(client, b, nonce_s, HELLO)
        server -> OK    MAC(server, b, nonce_s, HELLO)      (only after checking AUTH)

    Every field of the HELLO (the peer id, its session id) is inside both proofs. ``b`` is the
    TLS channel binding (``tls-unique``) on TLS and empty on plain TCP: on TLS, a handshake
    relayed between two sessions fails. On plain TCP a man in the middle can still relay a live
    handshake, which is why nothing but admission rests on the secret.
    """
    nonce_c = os.urandom(NONCE_BYTES)
    hello = hello | {"nonce": nonce_c}
    send(frame(HELLO, _hello_bytes(hello)))
    kind, body = await recv()
    if kind != CHALLENGE:
        raise AuthError(f"expected a challenge, got frame type {kind}")
    msg = _unpack(body, "CHALLENGE")
    nonce_s = msg.get("nonce") if isinstance(msg, dict) else None
    if not isinstance(nonce_s, bytes) or len(nonce_s) != NONCE_BYTES:
        raise AuthError(f"CHALLENGE without a {NONCE_BYTES}-byte nonce")
    send(frame(AUTH, _mac(secret, b"client", binding, nonce_s, _hello_bytes(hello))))
    try:
        kind, body = await recv()
    except (ConnectionError, asyncio.IncompleteReadError):
        raise AuthError("the server refused our proof (is the job secret right?)") from None
    if kind != OK:
        raise AuthError("the server refused our proof (is the job secret right?)")
    if not hmac.compare_digest(
        body, _mac(secret, b"server", binding, nonce_s, _hello_bytes(hello))
    ):
        raise AuthError("the server does not know the job's secret")
    return Transcript(hello=_hello_bytes(hello), nonce_s=nonce_s, binding=binding)


async def server_handshake(
    recv: Recv, send: Send, *, secret: bytes, binding: bytes = b""
) -> dict[str, Any]:
    """Check that the client knows ``secret``, then prove we do too; return its HELLO."""
    hello, _ = await server_handshake_transcript(recv, send, secret=secret, binding=binding)
    return hello


async def server_handshake_transcript(
    recv: Recv, send: Send, *, secret: bytes, binding: bytes = b""
) -> tuple[dict[str, Any], Transcript]:
    """:func:`server_handshake`, also returning the transcript (for :func:`session_keys`)."""
    kind, body = await recv()
    if kind != HELLO:
        raise AuthError(f"expected HELLO, got frame type {kind}")
    hello = _unpack(body, "HELLO")
    peer = _peer_id(hello)
    nonce_s = os.urandom(NONCE_BYTES)
    send(frame(CHALLENGE, msgpack.packb({"nonce": nonce_s})))
    kind, body = await recv()
    want = _mac(secret, b"client", binding, nonce_s, _hello_bytes(hello))
    if kind != AUTH or not hmac.compare_digest(body, want):
        raise AuthError(f"peer {peer!r} failed authentication (wrong secret)")
    send(frame(OK, _mac(secret, b"server", binding, nonce_s, _hello_bytes(hello))))
    return dict(hello), Transcript(hello=_hello_bytes(hello), nonce_s=nonce_s, binding=binding)


class TokenBucket:
    """At most ``burst`` events at once and ``rate`` per second on average (a per-connection
    limit on control frames)."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = burst
        self.at = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True
