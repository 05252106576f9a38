"""The receive side of a data-plane connection: frames read straight into their destination.

``asyncio.BufferedProtocol`` lets a protocol choose the memory the kernel copies received bytes
into. :class:`FrameReader` is a state machine over the frame layout of
:mod:`aurora.transport.wire` that always asks for exactly the rest of the part it is reading, so
it never reads past the frame it is in and no byte is ever moved from one buffer to another. The
data of a segment frame goes where its owner says (``slot``): the arena of the delta it belongs
to, at its offset, so the kernel's copy out of the socket is the only copy those bytes make on
the way to a parsed, verified delta. A segment nobody has a slot for is read into a small scratch
buffer and dropped: what a source sends costs this node memory only where this node chose to put
it. A malformed frame closes the connection with a log line.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Callable
from typing import cast

import msgpack

from aurora.delta import Segment
from aurora.transport.wire import (
    _HEAD,
    CONTROL_MAX_FRAME,
    HANDSHAKE_MAX_FRAME,
    MAX_FRAME,
    SEGMENT,
    ProtocolError,
)

log = logging.getLogger("aurora.transport")

HEAD, SEG_LEN, SEG_HEAD, SEG_BODY, BODY = "HEAD", "SEG_LEN", "SEG_HEAD", "SEG_BODY", "BODY"
SKIP = "SKIP"
"""Reading the body of a segment nobody wants into the scratch buffer."""
_U16 = struct.Struct("<H")
_SCRATCH = 64 << 10
"""Bytes of the buffer an unwanted segment body is read into and dropped (per connection)."""

SlotFn = Callable[[int, str, int, int, int, bool], "memoryview | None"]
"""(version, key, seq, offset, length, trailer) -> where to receive the data, or None."""


class FrameReader(asyncio.BufferedProtocol):
    """Reads frames from one connection, always asking for exactly the rest of the current part::

        HEAD (u32 length, u8 kind) --SEGMENT--> SEG_LEN (u16 n) -> SEG_HEAD (n bytes of msgpack)
             |                                                    -> SEG_BODY (the data) -> HEAD
             +--any other kind--> BODY (length bytes) -> HEAD

    The data of a segment frame goes into the owner's ``slot`` (the arena of its delta, at its
    offset: :meth:`aurora.delta.Reassembler.slot`). A segment nobody has a slot for (a duplicate,
    one another stream is filling, a segment of a delta nobody announced, one off the announced
    grid) is read into a small scratch buffer, 64 KiB at a time, and dropped. Frames before the
    handshake completes are queued in order for :meth:`recv`; after it, other frames (control,
    at most ``CONTROL_MAX_FRAME`` bytes) go to the owner's ``control`` callback in the order they
    arrive, between the segments around them, so an announcement is acted on before the next
    segment on the same connection. When the connection ends in the middle of a segment, its
    slot is handed back (``abandon``), so that the re-fetched copy can fill it. ``slot_bytes``
    counts the bytes written into slots (bytes this node wanted): the progress the owner
    measures a source by.
    """

    def __init__(
        self,
        *,
        slot: SlotFn,
        received: Callable[[int, Segment], None],
        abandon: Callable[[int, memoryview], None],
        name: str = "",
    ) -> None:
        self._slot, self._received, self._abandon = slot, received, abandon
        self.name = name
        self.control: Callable[[int, bytes], None] | None = None
        """Set by the owner after the handshake: called with each non-segment frame (kind,
        body) as it completes. Until then such frames queue for :meth:`recv`."""
        self.slot_bytes = 0
        """Bytes received into slots (segment data this node asked to have)."""
        self.skipped_bytes = 0
        """Bytes of segment data nobody wanted, read and dropped."""
        self._scratch: memoryview | None = None
        self._skip_left = 0
        self.authenticated = False
        """Set by the owner once the other end has proved it knows the secret: before, frames
        are at most ``HANDSHAKE_MAX_FRAME`` bytes and segments are refused."""
        self.transport: asyncio.Transport | None = None
        self.state = HEAD
        self.frame_since: float | None = None
        """When the frame now arriving began (monotonic s); None between frames."""
        self.last_byte = time.monotonic()
        """When the last bytes arrived (monotonic s)."""
        self.closed = False
        self.stopped = False
        """Set by :meth:`stop`: nothing more is parsed or handed over."""
        self._frames: asyncio.Queue[tuple[int, bytes] | None] = asyncio.Queue()
        self._head = bytearray(_HEAD.size)
        self._target = memoryview(self._head)
        self._pos = 0
        self._length = self._kind = 0
        self._meta: tuple[int, str, int, int, str, bool] | None = None
        self._slotted: memoryview | None = None
        """The owner's slot the current segment body is being written into."""

    # -- asyncio.BufferedProtocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream connection's transport (TCP or TLS) is a full Transport: it can abort
        self.transport = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._target[self._pos :]

    def buffer_updated(self, nbytes: int) -> None:
        self._pos += nbytes
        self.last_byte = time.monotonic()
        if self.state == SEG_BODY and self._slotted is not None:
            self.slot_bytes += nbytes
        try:
            while self._pos == len(self._target) and not (self.closed or self.stopped):
                self._advance()
        except ProtocolError as exc:
            log.warning("%s: closing the connection: %s", self.name, exc)
            assert self.transport is not None
            self.transport.abort()
        except Exception as exc:  # a bug in an owner's callback: one line, this connection only
            log.error("%s: closing the connection: %s: %s", self.name, type(exc).__name__, exc)
            assert self.transport is not None
            self.transport.abort()

    def eof_received(self) -> bool:
        return False  # close

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._slotted is not None and self._meta is not None:
            self._abandon(self._meta[0], self._slotted)
            self._slotted = None
        self._frames.put_nowait(None)

    # -- the state machine ------------------------------------------------------------------

    def _expect(self, state: str, target: memoryview) -> None:
        self.state, self._target, self._pos = state, target, 0

    def _advance(self) -> None:
        """The current part is complete: act on it and move to the next state."""
        if self.state == HEAD:
            self._length, self._kind = _HEAD.unpack(self._head)
            if not self.authenticated:
                limit = HANDSHAKE_MAX_FRAME
            else:
                limit = MAX_FRAME if self._kind == SEGMENT else CONTROL_MAX_FRAME
            if self._length > limit:
                raise ProtocolError(f"frame of {self._length} bytes exceeds {limit}")
            self.frame_since = time.monotonic()
            if self._kind == SEGMENT:
                if not self.authenticated:
                    raise ProtocolError("a segment before the source has authenticated")
                if self._length < _U16.size:
                    raise ProtocolError("segment frame shorter than its header")
                self._expect(SEG_LEN, memoryview(bytearray(_U16.size)))
            else:
                self._expect(BODY, memoryview(bytearray(self._length)))
        elif self.state == SEG_LEN:
            (n,) = _U16.unpack(self._target)
            if _U16.size + n > self._length:
                raise ProtocolError("segment header runs past its frame")
            self._expect(SEG_HEAD, memoryview(bytearray(n)))
        elif self.state == SEG_HEAD:
            self._meta = _segment_meta(self._target)
            version, key, seq, offset, _, trailer = self._meta
            length = self._length - _U16.size - len(self._target)
            self._slotted = self._slot(version, key, seq, offset, length, trailer)
            if self._slotted is not None:
                assert len(self._slotted) == length, "a slot must be the segment's length"
                self._expect(SEG_BODY, self._slotted)
            else:
                self._meta = None
                self._skip(length)
        elif self.state == SEG_BODY:
            assert self._meta is not None
            version, key, seq, offset, checksum, trailer = self._meta
            data = self._target
            self._slotted = self._meta = None
            self._expect(HEAD, memoryview(self._head))
            self.frame_since = None
            self._received(version, Segment(key, seq, offset, data, checksum, trailer))
        elif self.state == SKIP:
            self.skipped_bytes += len(self._target)
            self._skip(self._skip_left)
        else:
            assert self.state == BODY, self.state
            body = bytes(self._target)
            self._expect(HEAD, memoryview(self._head))
            self.frame_since = None
            if self.control is not None:
                self.control(self._kind, body)
            else:
                self._frames.put_nowait((self._kind, body))

    def _skip(self, left: int) -> None:
        """Read the next (at most 64 KiB) of ``left`` unwanted bytes, or the next frame."""
        if left == 0:
            self._expect(HEAD, memoryview(self._head))
            self.frame_since = None
            return
        if self._scratch is None:
            self._scratch = memoryview(bytearray(_SCRATCH))
        n = min(left, _SCRATCH)
        self._skip_left = left - n
        self._expect(SKIP, self._scratch[:n])

    # -- for the owner -------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop handing anything to the owner (it is aborting this connection)."""
        self.stopped = True

    def deliver_queued(self) -> None:
        """Hand frames queued before ``control`` was set to it (they arrived right after the
        handshake, before the owner took over)."""
        assert self.control is not None
        while not self._frames.empty():
            item = self._frames.get_nowait()
            if item is None:
                self._frames.put_nowait(None)
                return
            self.control(*item)

    async def recv(self) -> tuple[int, bytes]:
        """The next non-segment frame; ConnectionResetError once the connection is gone."""
        item = await self._frames.get()
        if item is None:
            self._frames.put_nowait(None)  # every later call fails the same way
            raise ConnectionResetError(f"{self.name}: connection closed")
        return item


def _segment_meta(raw: memoryview) -> tuple[int, str, int, int, str, bool]:
    try:
        version, key, seq, offset, checksum, trailer = msgpack.unpackb(raw)
        meta = (int(version), str(key), int(seq), int(offset), str(checksum), bool(trailer))
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        why = "nested too deeply" if isinstance(exc, msgpack.StackError) else str(exc)
        raise ProtocolError(f"malformed segment header: {why or type(exc).__name__}") from None
    if meta[2] < 0 or meta[3] < 0:
        raise ProtocolError(f"segment header with a negative seq or offset: {meta[:4]}")
    return meta
