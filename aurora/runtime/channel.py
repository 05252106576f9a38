"""The control plane: authenticated, integrity-protected, framed msgpack messages between roles.

Theory of operation
-------------------
Actors, relays and the Trainer each keep one TCP connection to the Ledger, on the data plane's
framing and handshake (:mod:`aurora.transport.wire`): one authentication scheme, one set of frame
limits and one hardened parser for every connection of a job (``docs/RUNTIME.md`` says why not
gRPC or ZeroMQ). Every frame after the handshake is sealed with an HMAC under a per-direction
key and an implicit sequence number, so a frame altered, injected, replayed, reordered or cut
out fails its MAC and the connection closes (:class:`_Sealer`). Given the job's public key, both
ends then prove who they are with certificates the job key issued and re-key over an ephemeral
X25519 exchange (:func:`_client_identify`). A server bounds what its peers may hold
(:class:`ChannelLimits`); a :class:`Channel` is one connection after the handshake.
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
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

import msgpack
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from aurora.delta.announce import sign_bytes, verify_bytes
from aurora.keys import (
    CLIENT_ROLES,
    CLOCK_SKEW_S,
    Certificate,
    Identity,
    check_identity,
)
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


class IdentityRefused(ConnectionError):
    """An identity did not hold at connect: the server refused ours (revoked, expired, another
    job's, excluded), or the server could not prove it is the job's Ledger. Trying again
    changes nothing, so a role stops with this one line."""


class Dismissed(IdentityRefused):
    """The job's Ledger refused our identity because the job decided against this id: it
    excluded it (a failed check) or revoked it (``aurora keys revoke``). The job working as
    designed, not a fault of the role's setup: a role exits with :attr:`EXIT_CODE` for it, so
    whoever started it can tell this from a role that could not start."""

    EXIT_CODE = 4
    """The exit status of a role process the job dismissed (1: a failure, 2: bad input)."""


class _Refused(AuthError):
    """The server refuses an identity whose key the client proved it holds: it is told why."""


IDENTIFY_LABEL = b"aurora control identify v1"
"""Domain separation of the client's signature over the handshake (never a certificate's)."""
IDENTITY_INFO = b"aurora control identity keys v1"
"""HKDF info label of the session keys after the identity step."""
LEDGER_LABEL = b"aurora control ledger proof v1"
"""Domain separation of the Ledger's signature over the handshake (never a client's)."""


def _digest(transcript: wire.Transcript) -> bytes:
    parts = (transcript.binding, transcript.hello, transcript.nonce_s)
    return hashlib.sha256(b"".join(struct.pack("<I", len(p)) + p for p in parts)).digest()


def identify_proof(transcript: wire.Transcript, eph_c: bytes, eph_s: bytes) -> bytes:
    """What a client signs with its role key: the handshake (both nonces, the HELLO, the TLS
    binding) and both ephemeral keys, so the proof is good for this connection only and
    neither ephemeral key can be swapped on the way."""
    return IDENTIFY_LABEL + _digest(transcript) + eph_c + eph_s


def ledger_proof(transcript: wire.Transcript, eph_s: bytes) -> bytes:
    """What the Ledger signs with its certified key: the handshake (both nonces, the HELLO, the
    TLS binding) and its ephemeral key, so the proof holds for this connection only (the
    client's nonce is in the HELLO) and its ephemeral key cannot be swapped on the way."""
    return LEDGER_LABEL + _digest(transcript) + eph_s


def identity_keys(
    secret_keys: tuple[bytes, bytes],
    shared: bytes,
    transcript: wire.Transcript,
    eph_c: bytes,
    eph_s: bytes,
) -> tuple[bytes, bytes]:
    """(client-to-server, server-to-client) keys after the identity step: HKDF-SHA256 over the
    X25519 shared secret, salted with the secret-derived keys of the handshake."""
    okm = HKDF(
        algorithm=SHA256(),
        length=64,
        salt=secret_keys[0] + secret_keys[1],
        info=IDENTITY_INFO + _digest(transcript) + eph_c + eph_s,
    ).derive(shared)
    return okm[:32], okm[32:]


def _raw(key: X25519PrivateKey) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def _ledger_refusal(
    msg: dict[str, Any],
    transcript: wire.Transcript,
    eph_s: bytes,
    *,
    job_key: bytes,
    job: str | None,
    revoked: Collection[str],
    now: float,
) -> tuple[str | None, Certificate | None]:
    """(why the server is not the job's Ledger or None, its certificate) from its ``kx``."""
    if msg.get("cert") is None:
        return "it proved no identity (a server without the Ledger's certificate)", None
    try:
        cert = Certificate.from_wire(msg)
    except ValueError as exc:
        return str(exc), None
    if cert.role != "ledger":
        return (
            f"it showed the certificate of {cert.role[:20]} {cert.id[:40]!r}, not a Ledger's",
            cert,
        )
    why = check_identity(
        "ledger", cert.id, cert.public_key, cert, job_key, job=job, now=now, revoked=revoked
    )
    if why is not None:
        return why, cert
    sig = msg.get("sig")
    if not isinstance(sig, bytes) or not verify_bytes(
        ledger_proof(transcript, eph_s), sig, cert.public_key
    ):
        return "its signature does not verify for this connection", cert
    return None, cert


async def _client_identify(
    ch: Channel,
    ident: Identity,
    transcript: wire.Transcript,
    keys: tuple[bytes, bytes],
    *,
    job_key: bytes,
    job: str | None,
    revoked: Collection[str],
    clock: Callable[[], float],
) -> None:
    """The identity step, client side; :func:`_server_identify` is the server's.

    Both ends prove who they are when the server is given the job's public key (the Ledger
    always is). Right after the secret handshake, under the sealed keys, the server sends
    ``kx``: an ephemeral X25519 key, its certificate (role ``ledger``, issued by the job key for
    this job, :class:`aurora.keys.Certificate`) and a signature with the certified key over the
    handshake's transcript and that ephemeral key (:func:`ledger_proof`). The client checks all
    of it first (role, job, validity, the job key's signature, not revoked for the Trainer) and
    goes no further with a server that cannot prove it (:class:`IdentityRefused`): a secret
    holder, or an Actor with its own certificate, cannot pose as the Ledger. The client then
    answers ``identify``: its role, id, Ed25519 public key, its certificate
    (:func:`aurora.keys.check_identity`; the Trainer's key is the job key itself), its own
    ephemeral key and a signature with its role key over the transcript and both ephemeral
    keys. The server checks the signature, then both ends re-key: HKDF over the X25519 shared
    secret, salted with the secret-derived keys, bound to the transcript and both ephemeral keys
    (:func:`identity_keys`), sequence numbers from 0. The server then checks the certificate
    (this job, valid now within :data:`aurora.keys.CLOCK_SKEW_S`, the HELLO's role and id) and
    asks ``admit`` (the Ledger: revoked? excluded?); its first frame under the new keys is
    ``identified``, or ``refused`` with the reason (and whether ``admit`` gave it: the job
    dismissed that id, :class:`Dismissed`), then the connection closes: a refused identity is
    one error at connect, with no session, however often it returns (refusals are logged once
    per 5 s). A session ends when the client's certificate expires (:meth:`Channel.close_at`).
    So an id is bound to a key for one job and a limited time, and a secret holder on the path
    cannot derive the session's keys: it would need an ephemeral private key, and it cannot
    swap either ephemeral key since the two signatures cover them."""
    msg = await ch.recv()
    eph_s = msg.get("eph")
    if msg.get("op") != "kx" or not isinstance(eph_s, bytes) or len(eph_s) != 32:
        # The job's Ledger always starts it: a server that does not is something else.
        raise IdentityRefused(
            f"not this job's Ledger: it started no identity step ({str(msg.get('op'))[:40]!r})"
        )
    # The Ledger proves itself first: a server that cannot is told nothing about us.
    why, cert = _ledger_refusal(
        msg, transcript, eph_s, job_key=job_key, job=job, revoked=revoked, now=clock()
    )
    if why is not None:
        raise IdentityRefused(f"not this job's Ledger: {why}")
    ch.cert = cert
    mine = X25519PrivateKey.generate()
    eph_c = _raw(mine)
    ident_msg: dict[str, Any] = {"role": ident.role, "id": ident.id, "key": ident.public_key}
    if ident.cert is not None:
        ident_msg.update(ident.cert.to_wire())
    ident_msg.update(
        op="identify",
        eph=eph_c,
        sig=sign_bytes(identify_proof(transcript, eph_c, eph_s), ident.private_key),
    )
    ch.send_nowait(ident_msg)
    shared = mine.exchange(X25519PublicKey.from_public_bytes(eph_s))
    c2s, s2c = identity_keys(keys, shared, transcript, eph_c, eph_s)
    ch.rekey(send=c2s, recv=s2c)
    # The server's word that it accepted us, already under the new keys: a refused identity
    # is an error here, once, not a connection that fails at its first message over and over.
    answer = await ch.recv()
    if answer.get("op") == "refused":
        # Said by the Ledger already proved above, under the session's new keys.
        refused = Dismissed if answer.get("dismissed") is True else IdentityRefused
        raise refused(f"refused: {str(answer.get('why'))[:300]}")
    if answer.get("op") != "identified":
        raise ProtocolError("the server did not confirm our identity")


async def _server_identify(
    ch: Channel,
    job_key: bytes,
    transcript: wire.Transcript,
    keys: tuple[bytes, bytes],
    *,
    identity: Identity,
    admit: Callable[[str, str], str | None] | None,
    clock: Callable[[], float],
) -> None:
    """The identity step, server side (the protocol: :func:`_client_identify`)."""
    mine = X25519PrivateKey.generate()
    eph_s = _raw(mine)
    assert identity.cert is not None
    ch.send_nowait(
        {
            **identity.cert.to_wire(),
            "op": "kx",
            "eph": eph_s,
            "sig": sign_bytes(ledger_proof(transcript, eph_s), identity.private_key),
        }
    )
    msg = await ch.recv()
    if msg.get("op") != "identify":
        raise AuthError("no identity (expected identify)")
    role, peer, key = msg.get("role"), msg.get("id"), msg.get("key")
    eph_c, sig = msg.get("eph"), msg.get("sig")
    if not (isinstance(role, str) and isinstance(peer, str) and isinstance(key, bytes)):
        raise AuthError("identify without a role, id and key")
    if not (isinstance(eph_c, bytes) and len(eph_c) == 32 and isinstance(sig, bytes)):
        raise AuthError("identify without an ephemeral key and a signature")
    if peer != ch.hello.get("id") or role != ch.hello.get("role"):
        raise AuthError(f"identify names {role[:20]} {peer[:40]!r}, the HELLO another")
    if not verify_bytes(identify_proof(transcript, eph_c, eph_s), sig, key):
        raise AuthError(f"{peer[:40]!r}: the identity signature does not verify for this session")
    # It holds the key it names: the session keys can be derived, and it may be told why its
    # certificate is refused (expired, revoked, another job's: only news to its holder).
    shared = mine.exchange(X25519PublicKey.from_public_bytes(eph_c))
    c2s, s2c = identity_keys(keys, shared, transcript, eph_c, eph_s)
    ch.rekey(send=s2c, recv=c2s)
    cert = None
    if msg.get("cert") is not None:
        try:
            cert = Certificate.from_wire(msg)
        except ValueError as exc:
            why: str | None = str(exc)
        else:
            why = None
    else:
        why = None
    if why is None and role not in CLIENT_ROLES:
        why = f"the {role[:20]} role does not connect to the Ledger"
    if why is None:
        why = check_identity(role, peer, key, cert, job_key, job=identity.job, now=clock())
    dismissed = False
    if why is None and admit is not None:
        why = admit(role, peer)
        dismissed = why is not None  # the job's own decision on this id (revoked, excluded)
    if why is not None:
        ch.send_nowait({"op": "refused", "why": why[:300], "dismissed": dismissed})
        raise _Refused(f"{role[:20]} {peer[:40]!r}: {why}")
    ch.send_nowait({"op": "identified"})
    ch.role, ch.verified, ch.key, ch.cert = role, True, key, cert
    if cert is not None:
        # A certificate ends its sessions too, not only new ones.
        ch.close_at(cert.expires + CLOCK_SKEW_S - clock(), "its certificate expired")


@dataclass(frozen=True, kw_only=True)
class ChannelLimits:
    """What one control server (the Ledger) lets its peers hold.

    A server holds at most ``max_pending_per_host`` unauthenticated connections from one remote
    host and ``max_pending`` in all (each gets ``timeout_s`` to finish its handshake), and at
    most ``max_connections`` authenticated ones; beyond these a new connection is closed at
    once. A frame's body is read only once its length is reserved from the server-wide
    ``buffer_budget`` (bytes of message bodies held at once, all connections together), and
    must then arrive at ``min_rate_bytes_s`` or better; a connection waiting for the budget
    reads nothing (TCP backpressure holds the rest in the kernel), so six connections each
    sending part of a 64 MiB frame hold at most the budget, not 6 x 64 MiB. Each connection may
    deliver ``rate`` messages a second (``burst`` at once): beyond that the server stops reading
    from it (it is slowed, not disconnected: an honest Actor's burst of results waits, a flooder
    gets its rate and no more). A peer that stops reading while more than ``max_send_buffer``
    bytes wait for it is disconnected."""

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
    """One direction of a sealed channel: a key and the next sequence number.

    Every frame after the handshake is sealed (``wire.SEALED``): ``tag || msgpack`` where
    ``tag = HMAC-SHA256(k, seq || msgpack)``. ``k`` is one of two per-connection keys derived by
    HKDF from the job secret, the server's nonce and the HELLO (which holds the client's nonce)
    (:func:`aurora.transport.wire.session_keys`), one per direction; ``seq`` counts the frames
    sent in that direction from 0 and is not sent: each end knows which one comes next. So an
    on-path party without the secret can read the traffic and drop it, but any frame it alters,
    injects, replays, reorders, reflects or cuts out makes the next frame fail its MAC, and the
    receiver closes the connection (both ends then reconnect and resynchronise through the
    protocol, as after any broken connection). Why a MAC and not TLS: TLS would need X.509
    certificates per role and a way to pin them; a MAC keyed from the handshake every
    connection already runs (and re-keyed by the identity step, whose certificates the job key
    issues) adds ``TAG_BYTES`` per frame. What it does not give: confidentiality (results travel
    readable; TLS is for that); against a party that holds the job secret and sits on the path,
    the identity step (:func:`_client_identify`) re-keys each connection."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.seq = 0

    def tag(self, body: bytes | memoryview) -> bytes:
        mac = hmac.new(self.key, _SEQ.pack(self.seq), hashlib.sha256)
        mac.update(body)
        self.seq += 1
        return mac.digest()


class Channel:
    """One authenticated control connection, after the handshake.

    :meth:`send` queues a message and waits for the socket to drain (backpressure),
    :meth:`recv` returns the next message or raises :class:`ChannelClosed`. The peer's
    ``hello`` is kept on the channel; its proved ``role`` and ``peer`` id are :attr:`role` and
    :attr:`peer` (``verified`` says whether they were proved: a server without the job's public
    key takes the HELLO's word)."""

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
        self.role = str(hello.get("role", "?"))
        """The peer's role: proved when ``verified``, else what its HELLO said."""
        self.verified = False
        """Whether the peer proved its role and id with a key (the identity step)."""
        self.key: bytes | None = None
        """The peer's proved Ed25519 public key (None when not ``verified``)."""
        self.cert: Certificate | None = None
        """The other end's certificate, as proved: a client's (on the server's side; None for
        the Trainer, whose key is the job key) or the Ledger's (on a client's side)."""
        self.ended: str | None = None
        """Why this end closed the connection on its own (:meth:`close_at`), if it did."""
        self._timer: asyncio.TimerHandle | None = None
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

    def close_at(self, delay_s: float, why: str) -> None:
        """Close the connection in ``delay_s`` seconds (at once when <= 0), saying ``why`` (one
        line in the log, and in the :class:`ChannelClosed` of a pending recv)."""

        def end() -> None:
            if not self.closed:
                log.warning("%s: %s; connection closed", self.peer, why)
                self.ended = why
                self.close()

        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(max(0.0, delay_s), end)

    def rekey(self, *, send: bytes, recv: bytes) -> None:
        """New keys for both directions, sequence numbers from 0 (after the identity step)."""
        self._out, self._in = _Sealer(send), _Sealer(recv)

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
                    return wire.parse_control(msg)
            finally:
                if isinstance(body, mmap.mmap):
                    body.close()
        except (asyncio.IncompleteReadError, ConnectionError, OSError, TimeoutError) as exc:
            self.close()
            if self.ended is not None:
                raise ChannelClosed(f"{self.peer}: {self.ended}") from None
            if isinstance(exc, ProtocolError):
                raise ChannelClosed(f"{self.peer}: {exc}") from None
            if isinstance(exc, TimeoutError):
                raise ChannelClosed(f"{self.peer}: a frame arrived too slowly") from None
            raise ChannelClosed(f"{self.peer} closed the connection") from None

    async def recv_checked(
        self, direction: messages.Direction, *, allowed: frozenset[str] | None = None
    ) -> dict[str, Any]:
        """The next message that decodes in ``direction`` (:func:`aurora.runtime.messages.
        decode`: every field within its bounds; ``allowed``: only these ops); one that does
        not is dropped with a log line naming op, field and reason, never raised into the
        caller."""
        while True:
            msg = await self.recv()
            try:
                messages.decode(msg, direction, allowed=allowed)
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
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
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
    identity: Identity | None = None,
    job_key: bytes | None = None,
    job: str | None = None,
    revoked: Collection[str] = (),
    clock: Callable[[], float] = time.time,
) -> Channel:
    """Connect to a control server and authenticate; one-line errors for what goes wrong.
    With ``unix_path`` the connection is made to that Unix socket instead (a local observer
    reaching a Ledger inside another network namespace: the file system is shared). With
    ``identity`` the server must first prove it is the Ledger of job ``job`` (default: the
    one ``identity``'s certificate names) under the job key ``job_key``, its id not in
    ``revoked``; then this end proves its role and id. :class:`IdentityRefused` when either
    proof does not hold."""
    if identity is not None:
        job = job or identity.job
        if job_key is None or job is None:
            raise ValueError(
                "a peer that proves its identity checks the Ledger's: give job_key, job"
            )
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
    channel = Channel(reader, writer, hello, keys=(c2s, s2c))
    if identity is not None:
        assert job_key is not None
        try:
            await asyncio.wait_for(
                _client_identify(
                    channel,
                    identity,
                    transcript,
                    (c2s, s2c),
                    job_key=job_key,
                    job=job,
                    revoked=revoked,
                    clock=clock,
                ),
                timeout_s,
            )
        except IdentityRefused as exc:
            channel.close()
            if str(exc).startswith("not this job's Ledger"):
                raise IdentityRefused(f"{where} is {exc}") from None
            raise type(exc)(
                f"{where} refused us: identity of {identity.role} {identity.id!r} {exc}"
            ) from None
        except (ConnectionError, TimeoutError) as exc:
            channel.close()
            raise ConnectionError(
                f"{where} refused us: identity of {identity.role} {identity.id!r} not accepted "
                f"({str(exc) or type(exc).__name__}; check its identity file)"
            ) from None
    return channel


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

    def _refuse(
        self, writer: asyncio.StreamWriter, why: str, host: str, detail: str = "", *, abort=True
    ) -> None:
        self.refused[why] += 1
        now = time.monotonic()
        if now - self._warned.get(why, -60.0) >= 5.0:  # one line per reason per 5 s, not per flood
            self._warned[why] = now
            log.warning(
                "refused control connections (%s; latest from %s%s; %d so far)",
                why,
                host,
                f": {detail[:300]}" if detail else "",
                self.refused[why],
            )
        if abort:
            writer.transport.abort()
        else:  # what was written (a refusal's reason) goes out first
            writer.close()


async def serve(
    host: str,
    port: int,
    *,
    secret: bytes,
    handler: Handler,
    timeout_s: float = 5.0,
    unix_path: str | None = None,
    limits: ChannelLimits | None = None,
    public_key: bytes | None = None,
    identity: Identity | Callable[[], Identity] | None = None,
    admit: Callable[[str, str], str | None] | None = None,
    clock: Callable[[], float] = time.time,
) -> ControlServer:
    """Accept control connections; ``handler`` runs once per authenticated channel. With
    ``unix_path`` the server listens on that Unix socket instead of ``host:port``. With the
    job's ``public_key`` the server proves itself with ``identity`` (the Ledger's; a callable
    is asked at every connection, so a renewed one is used at once) and every peer must prove
    its role and id for the job that identity names (:func:`_client_identify`); ``admit(role, id)``
    then says why a proved peer may not connect (revoked, excluded), or None."""
    limits = limits or ChannelLimits(timeout_s=timeout_s)
    if public_key is not None and identity is None:
        raise ValueError("a server that checks identities proves its own: give its identity")
    if public_key is None and identity is not None:
        raise ValueError("a server with an identity checks its peers': give the job's public key")
    current = identity if callable(identity) else (lambda: identity)
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
            c2s, s2c = wire.session_keys(secret, transcript)
            channel = Channel(
                reader,
                writer,
                hello,
                keys=(s2c, c2s),
                max_message=min(limits.max_message, wire.HANDSHAKE_MAX_FRAME),
                budget=ctl.budget,
                limits=limits,
            )
            if public_key is not None:
                # Still counted as pending: nobody holds more than the cap of these either.
                mine = current()
                assert mine is not None
                await asyncio.wait_for(
                    _server_identify(
                        channel,
                        public_key,
                        transcript,
                        (c2s, s2c),
                        identity=mine,
                        admit=admit,
                        clock=clock,
                    ),
                    limits.timeout_s,
                )
            channel.max_message = limits.max_message
        except _Refused as exc:
            # Told why, then closed: no welcome, nothing decided or logged, one line per 5 s
            # however often it comes back.
            ctl._refuse(writer, "identity refused", host, str(exc), abort=False)
            return
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
            ctl._refuse(writer, "authentication failed", host, str(exc) or type(exc).__name__)
            return
        finally:
            ctl.pending[host] -= 1
            if ctl.pending[host] <= 0:
                del ctl.pending[host]
        if ctl.connections >= limits.max_connections:
            ctl._refuse(writer, "too many connections", host)
            return
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
