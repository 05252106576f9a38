"""What the receive machine asks its node to do (:mod:`aurora.transport.receiver`).

Theory of operation
-------------------
The receive machine does no I/O: each event it is fed returns a tuple of these, and the node's
shell (:mod:`aurora.transport.node`) carries them out in order - a request on the current
source's connection, a switch of source, segments queued to subscribers, a callback to the
runtime, a log line. They are plain frozen values, so a test compares a whole trace with ``==``.
"""

from __future__ import annotations

from dataclasses import dataclass

from aurora.delta import Delta
from aurora.delta.announce import VersionAnnouncement


@dataclass(frozen=True, slots=True)
class Fetch:
    """Ask the current source for the segments of ``version`` not in ``have``."""

    version: int
    have: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FetchWhenIdle:
    """Ask for what is missing of ``version`` once the current source is not sending
    (:meth:`Receiver.missing`): asking while it pushes would have it sent twice."""

    version: int


@dataclass(frozen=True, slots=True)
class Announce:
    """Forward a verified announcement to every subscriber."""

    signed: bytes


@dataclass(frozen=True, slots=True)
class Forward:
    """Queue verified segments of ``version`` to every subscriber."""

    version: int
    seqs: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Switch:
    """Leave ``source`` (its try is recorded) and connect to the next one."""

    source: int
    why: str


@dataclass(frozen=True, slots=True)
class Blame:
    """``source`` sent ``what`` for ``version``, refuted: not used again for it (a log line)."""

    source: int
    version: int
    what: str


@dataclass(frozen=True, slots=True)
class Complete:
    """``version`` is whole and verified."""

    version: int


@dataclass(frozen=True, slots=True)
class Staged:
    """``delta`` is staged; ``ann`` is the Trainer's announcement it matched."""

    delta: Delta
    ann: VersionAnnouncement


@dataclass(frozen=True, slots=True)
class Refused:
    """``version`` will not be staged; ``reason`` says why in one line."""

    version: int
    reason: str


@dataclass(frozen=True, slots=True)
class Fallback:
    """No source can complete ``version`` (``reason``): fetch it whole from the fallback, then
    hand it to :meth:`Receiver.add_file`, or :meth:`Receiver.fallback_failed`."""

    version: int
    reason: str


@dataclass(frozen=True, slots=True)
class Dropped:
    """``versions`` left the cache (a subscriber that still has one queued fell behind)."""

    versions: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Note:
    """A warning for the log, at most a few per ``key`` (rate-limited by the shell)."""

    key: str
    message: str
    info: bool = False
    """Worth an info line only (not a warning)."""


Action = (
    Fetch
    | FetchWhenIdle
    | Announce
    | Forward
    | Switch
    | Blame
    | Complete
    | Staged
    | Refused
    | Fallback
    | Dropped
    | Note
)
NONE: tuple[Action, ...] = ()
