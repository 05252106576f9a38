"""The receive side of a data-plane connection: frames read straight into their destination.

Theory of operation
-------------------
``asyncio.BufferedProtocol`` lets a protocol choose the memory the kernel copies received bytes
into. :class:`FrameReader` is a state machine over the frame layout of
:mod:`aurora.transport.wire` that always asks for exactly the rest of the part it is reading::

    HEAD (u32 length, u8 kind) --SEGMENT--> SEG_LEN (u16 n) -> SEG_HEAD (n bytes of msgpack)
         |                                                        -> SEG_BODY (the data) -> HEAD
         +--any other kind--> BODY (length bytes) -> HEAD

The data of a segment frame goes where its owner says (``slot``): the arena of the delta it
belongs to, at its offset (:meth:`aurora.delta.Reassembler.slot`), so the kernel's copy out
of the socket is the only copy those bytes make on the way to a parsed, verified delta. A segment
nobody has a slot for (a duplicate, one another stream is filling) is read into a buffer of its
own and handed over all the same. Other frames (handshake, control) are small and are queued in
order for :meth:`recv`. Because the reader never reads past the frame it is in, no byte is ever
moved from one buffer to another.

A malformed frame closes the connection with a log line. When the connection ends in the middle
of a segment, its slot is handed back (``abandon``), so that the re-fetched copy can fill it.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Callable

import msgpack

from aurora.delta import Segment
from aurora.transport.wire import _HEAD, HANDSHAKE_MAX_FRAME, MAX_FRAME, SEGMENT, ProtocolError

log = logging.getLogger("aurora.transport")

HEAD, SEG_LEN, SEG_HEAD, SEG_BODY, BODY = "HEAD", "SEG_LEN", "SEG_HEAD", "SEG_BODY", "BODY"
_U16 = struct.Struct("<H")

SlotFn = Callable[[int, str, int, int, int, bool], "memoryview | None"]
"""(version, key, seq, offset, length, trailer) -> where to receive the data, or None."""


class FrameReader(asyncio.BufferedProtocol):
    """Reads frames from one connection (see the module docstring)."""

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
        self.authenticated = False
        """Set by the owner once the other end has proved it knows the secret: before, frames
        are at most ``HANDSHAKE_MAX_FRAME`` bytes and segments are refused."""
        self.transport: asyncio.BaseTransport | None = None
        self.state = HEAD
        self.frame_since: float | None = None
        """When the frame now arriving began (monotonic s); None between frames."""
        self.last_byte = time.monotonic()
        """When the last bytes arrived (monotonic s)."""
        self.closed = False
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
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._target[self._pos :]

    def buffer_updated(self, nbytes: int) -> None:
        self._pos += nbytes
        self.last_byte = time.monotonic()
        try:
            while self._pos == len(self._target) and not self.closed:
                self._advance()
        except ProtocolError as exc:
            log.warning("%s: closing the connection: %s", self.name, exc)
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
            limit = MAX_FRAME if self.authenticated else HANDSHAKE_MAX_FRAME
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
                self._expect(SEG_BODY, memoryview(bytearray(length)))
        elif self.state == SEG_BODY:
            assert self._meta is not None
            version, key, seq, offset, checksum, trailer = self._meta
            data = self._target if self._slotted is not None else self._target.obj
            self._slotted = self._meta = None
            self._expect(HEAD, memoryview(self._head))
            self.frame_since = None
            self._received(version, Segment(key, seq, offset, data, checksum, trailer))
        else:
            assert self.state == BODY, self.state
            body = bytes(self._target)
            self._expect(HEAD, memoryview(self._head))
            self.frame_since = None
            self._frames.put_nowait((self._kind, body))

    # -- for the owner -------------------------------------------------------------------------

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
        raise ProtocolError(f"malformed segment header: {exc}") from None
    if meta[2] < 0 or meta[3] < 0:
        raise ProtocolError(f"segment header with a negative seq or offset: {meta[:4]}")
    return meta
