"""Every control-plane message as a typed, bounded dataclass, and one decode for all of them.

Theory of operation
-------------------
A control frame is a msgpack map with an ``op`` (:mod:`aurora.runtime.channel`). Each message is
a frozen dataclass whose fields carry their bounds (:class:`Int`, :class:`Float`, :class:`Str`,
:class:`Blob`, :class:`Seq`, :class:`Map`), and :func:`decode` turns a map into exactly one of
them or raises :class:`MessageError` naming the op, the field and the reason (:class:`Why`),
before anything is logged or decided. Fields a message does not define are dropped (older and
newer peers may send more); every field it defines is checked, optional ones when present. The
bounds are the protocol's, stated once here: versions and batch numbers in ``[0, 2^53)``, token
counts up to ``MAX_TOKENS``, seconds finite and at most ``MAX_SECONDS``, ids and hashes short
printable strings, lists no longer than their use needs. A result's payload has its own decode,
checked against the lease and the job (:func:`decode_result_payload`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

import msgpack

from aurora.policy.refusals import completion_fault, logprob_floor

MAX_VERSION = 2**53 - 1
"""Largest policy version or batch number (exact as a JSON number and as a float)."""
MAX_TOKENS = 2**40
"""Largest token count one message may report (10^12: years of generation on one Actor)."""
MAX_SECONDS = 7 * 86400.0
"""Longest duration one message may report (s)."""
MAX_TIME = 2.0**40
"""Largest wall-clock time stamp (s since the epoch: year ~36,800)."""
MAX_ID = 128
"""Longest peer, lease or prompt id (characters; the handshake's limit on peer ids)."""
MAX_HASH = 128
"""Longest weights hash or digest (characters: a 256-bit hash is 64 hex digits)."""
MAX_TEXT = 1024
"""Longest free-text field (a fault spec, an address, a span's activity)."""
MAX_LEASES = 1 << 20
"""Most leases one assignment may carry (a batch of a million prompts)."""
MAX_ANNOUNCEMENT = 4096
"""Largest signed announcement (bytes; one is ~300)."""
MAX_PAYLOAD = 16 << 20
"""Largest result payload (bytes; the control server's message limit)."""
MAX_MAP_BYTES = 1 << 20
"""Largest free-form map (a job spec, stats) once packed (bytes)."""


class Why(Enum):
    """Why a message was refused (the named reason in every :class:`MessageError`)."""

    NOT_A_MAP = "not a map"
    UNKNOWN_OP = "unknown op"
    MISSING = "missing field"
    WRONG_TYPE = "wrong type"
    OUT_OF_RANGE = "out of range"
    NOT_FINITE = "not finite"
    TOO_LONG = "too long"
    NOT_PRINTABLE = "not printable"
    MISMATCH = "does not match its lease or job"
    IMPLAUSIBLE = "not what an honest sampler returns"


class MessageError(ValueError):
    """A refused message: ``why`` (a :class:`Why`) and a one-line message naming op and field."""

    def __init__(self, why: Why, where: str, detail: str) -> None:
        super().__init__(f"{where}: {why.value}: {detail}"[:300])
        self.why = why
        self.where = where


# ---- field bounds ------------------------------------------------------------------------


@dataclass(frozen=True)
class Int:
    """An integer in ``[lo, hi]`` (never a bool)."""

    lo: int = 0
    hi: int = MAX_VERSION

    def check(self, value: object, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise MessageError(Why.WRONG_TYPE, where, f"expected an integer, got {_kind(value)}")
        if not self.lo <= value <= self.hi:
            shown = str(value) if len(str(value)) <= 30 else f"{str(value)[:12]}... (long)"
            raise MessageError(Why.OUT_OF_RANGE, where, f"{shown} not in [{self.lo}, {self.hi}]")
        return value


@dataclass(frozen=True)
class Float:
    """A finite number in ``[lo, hi]`` (an integer is taken as one)."""

    lo: float = 0.0
    hi: float = MAX_SECONDS

    def check(self, value: object, where: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise MessageError(Why.WRONG_TYPE, where, f"expected a number, got {_kind(value)}")
        if isinstance(value, int) and abs(value) > 2**63:
            raise MessageError(Why.OUT_OF_RANGE, where, "an integer too large for a number")
        number = float(value)
        if not math.isfinite(number):
            raise MessageError(Why.NOT_FINITE, where, repr(number))
        if not self.lo <= number <= self.hi:
            raise MessageError(Why.OUT_OF_RANGE, where, f"{number!r} not in [{self.lo}, {self.hi}]")
        return number


@dataclass(frozen=True)
class Str:
    """A printable string of 1..``max_len`` characters (``empty``: 0 allowed)."""

    max_len: int = MAX_ID
    empty: bool = False

    def check(self, value: object, where: str) -> str:
        if not isinstance(value, str):
            raise MessageError(Why.WRONG_TYPE, where, f"expected a string, got {_kind(value)}")
        if len(value) > self.max_len:
            raise MessageError(Why.TOO_LONG, where, f"{len(value)} > {self.max_len} characters")
        if not value and not self.empty:
            raise MessageError(Why.OUT_OF_RANGE, where, "empty")
        if not value.isprintable():
            raise MessageError(Why.NOT_PRINTABLE, where, repr(value[:40]))
        return value


@dataclass(frozen=True)
class Blob:
    """Bytes, at most ``max_len``."""

    max_len: int

    def check(self, value: object, where: str) -> bytes:
        if not isinstance(value, bytes):
            raise MessageError(Why.WRONG_TYPE, where, f"expected bytes, got {_kind(value)}")
        if len(value) > self.max_len:
            raise MessageError(Why.TOO_LONG, where, f"{len(value)} > {self.max_len} bytes")
        return value


@dataclass(frozen=True)
class Seq:
    """A list of at most ``max_len`` items, each checked by ``item`` (a tuple comes back)."""

    item: Any
    max_len: int

    def check(self, value: object, where: str) -> tuple[Any, ...]:
        if not isinstance(value, list | tuple):
            raise MessageError(Why.WRONG_TYPE, where, f"expected a list, got {_kind(value)}")
        if len(value) > self.max_len:
            raise MessageError(Why.TOO_LONG, where, f"{len(value)} > {self.max_len} items")
        return tuple(self.item.check(v, f"{where}[{i}]") for i, v in enumerate(value))


@dataclass(frozen=True)
class Pair:
    """A two-item list, each checked by its own bound (a lease id and its prompt)."""

    first: Any
    second: Any

    def check(self, value: object, where: str) -> tuple[Any, Any]:
        if not isinstance(value, list | tuple) or len(value) != 2:
            raise MessageError(Why.WRONG_TYPE, where, f"expected a pair, got {_kind(value)}")
        return (
            self.first.check(value[0], f"{where}[0]"),
            self.second.check(value[1], f"{where}[1]"),
        )


@dataclass(frozen=True)
class Map:
    """A map with string keys whose packed size is at most ``max_bytes`` (a job spec, stats:
    free-form, read by code that checks what it uses)."""

    max_bytes: int = MAX_MAP_BYTES

    def check(self, value: object, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise MessageError(Why.WRONG_TYPE, where, f"expected a map, got {_kind(value)}")
        if not all(isinstance(k, str) for k in value):
            raise MessageError(Why.WRONG_TYPE, where, "a key that is not a string")
        size = len(msgpack.packb(value))
        if size > self.max_bytes:
            raise MessageError(Why.TOO_LONG, where, f"{size} > {self.max_bytes} bytes packed")
        return dict(value)


@dataclass(frozen=True)
class Bool:
    """True or False."""

    def check(self, value: object, where: str) -> bool:
        if not isinstance(value, bool):
            raise MessageError(Why.WRONG_TYPE, where, f"expected a bool, got {_kind(value)}")
        return value


@dataclass(frozen=True)
class _MapItem:
    """Any map (checked field by field where it is used)."""

    def check(self, value: object, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise MessageError(Why.NOT_A_MAP, where, f"got {_kind(value)}")
        return value


def _kind(value: object) -> str:
    return type(value).__name__


def bound(spec: Any, *, optional: bool = False) -> Any:
    """A dataclass field with its bound (``optional``: may be absent or None)."""
    meta = {"bound": spec, "optional": optional}
    return field(default=None, metadata=meta) if optional else field(metadata=meta)


VERSION = Int(0, MAX_VERSION)
HASH = Str(MAX_HASH)
LEASE = Str(MAX_ID)


class Message:
    """Base of every control message; ``OP`` is its ``op``."""

    OP: ClassVar[str]
    REST: ClassVar[str | None] = None
    """A field that collects every field of the map the message does not define (or None:
    they are dropped)."""

    def to_wire(self) -> dict[str, Any]:
        """The map to send (None fields left out)."""
        out: dict[str, Any] = {"op": self.OP}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name == self.REST:
                out.update(value)
            else:
                out[f.name] = (
                    [list(v) if isinstance(v, tuple) else v for v in value]
                    if (isinstance(value, tuple))
                    else value
                )
        return out


def _message(op: str) -> Any:
    def wrap(cls: type) -> type:
        cls.OP = op  # type: ignore[attr-defined]
        return dataclass(frozen=True, kw_only=True, slots=True)(cls)

    return wrap


# ---- Actors and relays -> Ledger ---------------------------------------------------------


@_message("staged")
class Staged(Message):
    """The Actor holds D_v verified and staged."""

    version: int = bound(VERSION)


@_message("activated")
class Activated(Message):
    """The Actor activated ``version`` at a safe point."""

    version: int = bound(VERSION)
    weights_hash: str | None = bound(HASH, optional=True)
    digest: str | None = bound(HASH, optional=True)
    pause_ms: float | None = bound(Float(0.0, MAX_SECONDS * 1e3), optional=True)


@_message("caught_up")
class CaughtUp(Message):
    """The Actor caught up to ``version`` (snapshot and/or replayed deltas)."""

    version: int = bound(VERSION)
    weights_hash: str | None = bound(HASH, optional=True)
    digest: str | None = bound(HASH, optional=True)
    pause_ms: float | None = bound(Float(0.0, MAX_SECONDS * 1e3), optional=True)


@_message("result")
class Result(Message):
    """One prompt's rollouts under ``lease``, generated on ``version`` with weights hash
    ``weights_hash``; ``payload`` is checked by :func:`decode_result_payload`."""

    lease: str = bound(LEASE)
    version: int = bound(VERSION)
    weights_hash: str = bound(HASH)
    payload: bytes = bound(Blob(MAX_PAYLOAD))
    tokens: int | None = bound(Int(0, MAX_TOKENS), optional=True)


@_message("throughput")
class Throughput(Message):
    """``tokens`` generated in ``seconds`` (the allocation's estimate)."""

    tokens: int = bound(Int(1, MAX_TOKENS))
    seconds: float = bound(Float(1e-9, MAX_SECONDS))


@_message("notice")
class Notice(Message):
    """A preemption notice: the Actor leaves within ``seconds``."""

    seconds: float = bound(Float(0.0, MAX_SECONDS))


@_message("leave")
class Leave(Message):
    """The Actor leaves now (gracefully)."""


@_message("heartbeat")
class Heartbeat(Message):
    """Nothing but proof of life."""


@_message("span")
class Span(Message):
    """A timeline span (generate, apply, catch-up) for the run's trace; the hop reports'
    ``delta-path`` spans (a version's wall-clock times through the node) and ``loop-lag`` spans
    (the event loop's wake-up lateness), :mod:`aurora.runtime.hopreport`."""

    activity: str = bound(Str(64))
    version: int | None = bound(VERSION, optional=True)
    start: float = bound(Float(0.0, MAX_TIME))
    end: float = bound(Float(0.0, MAX_TIME))
    tokens: int | None = bound(Int(0, MAX_TOKENS), optional=True)
    in_first: float | None = bound(Float(0.0, MAX_TIME), optional=True)
    in_last: float | None = bound(Float(0.0, MAX_TIME), optional=True)
    staged: float | None = bound(Float(0.0, MAX_TIME), optional=True)
    out_first: float | None = bound(Float(0.0, MAX_TIME), optional=True)
    out_last: float | None = bound(Float(0.0, MAX_TIME), optional=True)
    samples: int | None = bound(Int(0, MAX_TOKENS), optional=True)
    max_s: float | None = bound(Float(0.0, MAX_SECONDS), optional=True)
    p50_s: float | None = bound(Float(0.0, MAX_SECONDS), optional=True)
    p99_s: float | None = bound(Float(0.0, MAX_SECONDS), optional=True)


@_message("data")
class Data(Message):
    """Where the peer serves the data plane (``host:port``)."""

    addr: str = bound(Str(MAX_TEXT))


# ---- Trainer -> Ledger -------------------------------------------------------------------


@_message("job")
class Job(Message):
    """The job: steps, prompts per batch and the spec every peer reads."""

    job: dict[str, Any] = bound(Map())

    def __post_init__(self) -> None:
        Int(1, MAX_VERSION).check(self.job.get("steps"), "job.job.steps")
        Int(1, MAX_LEASES).check(self.job.get("prompts_per_batch"), "job.job.prompts_per_batch")


@_message("published")
class Published(Message):
    """The Trainer published ``version`` (its signed announcement, the hash, sizes). The
    Ledger takes h(v) from the signed announcement (``snapshot_announcement`` for v0), never
    from ``weights_hash``."""

    version: int = bound(VERSION)
    weights_hash: str = bound(HASH)
    announcement: bytes | None = bound(Blob(MAX_ANNOUNCEMENT), optional=True)
    snapshot_announcement: bytes | None = bound(Blob(MAX_ANNOUNCEMENT), optional=True)
    digest: str | None = bound(HASH, optional=True)
    delta_bytes: int | None = bound(Int(0, 2**53), optional=True)
    snapshot_bytes: int | None = bound(Int(0, 2**53), optional=True)
    stats: dict[str, Any] | None = bound(Map(64 << 10), optional=True)


@_message("get_batch")
class GetBatch(Message):
    """The Trainer asks for batch ``batch``'s admitted results."""

    batch: int = bound(Int(1, MAX_VERSION))


@_message("verified")
class Verified(Message):
    """The Trainer recomputed ``actor``'s admitted result for ``lease`` under ``version``'s
    weights and measured this (nats; :class:`aurora.policy.verification.Measures`). Only the
    Trainer's session may send it: the Ledger feeds it to the policy as ``ResultVerified``,
    which may exclude the Actor."""

    actor: str = bound(Str(MAX_ID))
    lease: str = bound(LEASE)
    version: int = bound(VERSION)
    max_delta: float = bound(Float(0.0, 1e12))
    mean_delta: float = bound(Float(0.0, 1e12))
    min_logprob: float = bound(Float(-1e12, 1.0))
    tokens: int = bound(Int(1, MAX_TOKENS))
    rank_tokens: int | None = bound(Int(0, MAX_TOKENS), optional=True)
    """Tokens whose rank under pi_v was computed (:mod:`aurora.policy.sampling`)."""
    rank_shift: float | None = bound(Float(-MAX_TOKENS, MAX_TOKENS), optional=True)
    """Their ``sum (u - 1/2)``."""
    rank_spread: float | None = bound(Float(-MAX_TOKENS, MAX_TOKENS), optional=True)
    """Their ``sum ((u - 1/2)^2 - 1/12)``."""


@_message("refused")
class RefusedResult(Message):
    """The Trainer refused ``actor``'s admitted result for ``lease`` (``why``: its payload
    failed the Trainer's check, or the step it would have made was not finite or an outlier).
    Only the Trainer's session may send it: the Ledger feeds it to the policy as
    ``ResultRefused``, one strike against the Actor."""

    actor: str = bound(Str(MAX_ID))
    lease: str = bound(LEASE)
    why: str = bound(Str(MAX_TEXT, empty=True))


@_message("stats")
class Stats(Message):
    """A step's training statistics for observers: every other field of the map, each a
    number, a bool, a short string or a short list of numbers, goes into ``values``."""

    REST: ClassVar[str] = "values"
    version: int = bound(VERSION)
    values: dict[str, Any] | None = bound(Map(64 << 10), optional=True)

    def __post_init__(self) -> None:
        for key, value in (self.values or {}).items():
            where = f"stats.{key}"[:80]
            Str(64).check(key, where)
            if isinstance(value, str):
                Str(MAX_TEXT, empty=True).check(value, where)
            elif isinstance(value, list | tuple):  # e.g. the versions a batch was generated on
                Seq(Float(-(2.0**63), 2.0**63), 64).check(value, where)
            elif not isinstance(value, bool) and value is not None:
                Float(-(2.0**63), 2.0**63).check(value, where)


@_message("finished")
class Finished(Message):
    """The job is done."""


MAX_REVOCATIONS = 1 << 20
"""Largest revocation list (bytes: ~7,000 revoked ids of the longest kind)."""


@_message("revocations")
class RevocationsMsg(Message):
    """The job's revocation list as the job key signed it (:class:`aurora.keys.Revocations`):
    the Ledger verifies it before it believes, logs or enforces any of it."""

    data: bytes = bound(Blob(MAX_REVOCATIONS))


# ---- Ledger -> peers ---------------------------------------------------------------------


@_message("welcome")
class Welcome(Message):
    """The job spec (None before the Trainer registered it) and the data-plane sources."""

    job: dict[str, Any] | None = bound(Map(), optional=True)
    sources: dict[str, Any] | None = bound(Map(64 << 10), optional=True)


@_message("announce")
class Announce(Message):
    """A signed announcement (verified by the receiver against the job's key)."""

    data: bytes = bound(Blob(MAX_ANNOUNCEMENT))


@_message("assign")
class Assign(Message):
    """Leases (id, prompt) to generate on ``version`` within ``expiry_in`` seconds."""

    version: int = bound(VERSION)
    leases: tuple[tuple[str, str], ...] = bound(Seq(Pair(LEASE, Str(MAX_ID)), MAX_LEASES))
    expiry_in: float = bound(Float(0.0, MAX_SECONDS))


@_message("commit")
class Commit(Message):
    """Activate ``version`` at the next safe point."""

    version: int = bound(VERSION)


@_message("exclude")
class Exclude(Message):
    """No work for step ``version`` (too far behind)."""

    version: int = bound(VERSION)


@_message("catch_up")
class CatchUpMsg(Message):
    """Catch up to ``target``: a snapshot (with its hashes) and/or deltas."""

    target: int = bound(VERSION)
    deltas: tuple[int, ...] = bound(Seq(VERSION, 1 << 16))
    snapshot: int | None = bound(VERSION, optional=True)
    snapshot_hash: str | None = bound(HASH, optional=True)
    snapshot_digest: str | None = bound(HASH, optional=True)


@_message("route")
class Route(Message):
    """Fetch deltas from ``source`` (at ``addr`` when known)."""

    source: str = bound(Str(MAX_ID))
    addr: str | None = bound(Str(MAX_TEXT), optional=True)


@_message("stop")
class Stop(Message):
    """The job is over: leave."""


@_message("resume")
class Resume(Message):
    """To the Trainer: the newest published version the Ledger knows and the done batches."""

    latest: int | None = bound(VERSION, optional=True)
    done: tuple[int, ...] = bound(Seq(Int(1, MAX_VERSION), 1 << 20))


@_message("batch_done")
class BatchDone(Message):
    """To the Trainer: batch ``batch`` has every prompt admitted."""

    batch: int = bound(Int(1, MAX_VERSION))


@_message("batch")
class Batch(Message):
    """To the Trainer: batch ``batch``'s admitted results (each checked again, payload and
    all, by the Trainer: :func:`decode_result_payload`)."""

    batch: int = bound(Int(1, MAX_VERSION))
    complete: bool = bound(Bool())
    results: tuple[dict[str, Any], ...] = bound(Seq(_MapItem(), MAX_LEASES))
    """Each a map (actor, lease, prompt, version, payload, and ``check``: the fraction of that
    Actor's results the Trainer checks, or None to drop it: its Actor is excluded;
    :func:`aurora.policy.verification.plan`), checked one by one by the Trainer (a bad one is a
    refused result, not a refused batch)."""


# ---- Ledger -> observers -----------------------------------------------------------------


@_message("progress")
class Progress(Message):
    """The numbers of the live line (sent to an observer when it connects)."""

    latest: int | None = bound(VERSION, optional=True)
    batch: int = bound(Int(0, MAX_VERSION))
    done: tuple[int, ...] = bound(Seq(VERSION, 1 << 20))
    actors: tuple[str, ...] = bound(Seq(Str(MAX_ID), 1 << 16))
    refused: dict[str, Any] = bound(Map(64 << 10))
    expired: int = bound(Int(0, MAX_TOKENS))


@_message("batch_requested")
class BatchRequested(Message):
    """Batch ``batch`` was requested on ``version``."""

    batch: int = bound(Int(1, MAX_VERSION))
    version: int = bound(VERSION)


@_message("published")
class PublishedNote(Message):
    """Version ``version`` is published (the observers' note of :class:`Published`)."""

    version: int = bound(VERSION)


@_message("status")
class StatusQuery(Message):
    """An observer asks for the job's status (``aurora status``): answered, never decided."""


@_message("status")
class StatusReply(Message):
    """The job's status (:func:`aurora.observe.status.snapshot`: bounded by the metrics' cap on
    Actors shown)."""

    snapshot: dict[str, Any] = bound(Map(1 << 20))


class Direction(Enum):
    """Who sends to whom: each direction has its own set of messages (an op means one thing
    per direction; ``published`` from the Trainer is not ``published`` to an observer)."""

    PEER_TO_LEDGER = "Actor or relay -> Ledger"
    TRAINER_TO_LEDGER = "Trainer -> Ledger"
    OBSERVER_TO_LEDGER = "observer -> Ledger"
    LEDGER_TO_PEER = "Ledger -> Actor or relay"
    LEDGER_TO_TRAINER = "Ledger -> Trainer"
    LEDGER_TO_OBSERVER = "Ledger -> observer"


def _table(*classes: type[Message]) -> dict[str, type[Message]]:
    return {cls.OP: cls for cls in classes}


MESSAGES: dict[Direction, dict[str, type[Message]]] = {
    Direction.PEER_TO_LEDGER: _table(
        Staged, Activated, CaughtUp, Result, Throughput, Notice, Leave, Heartbeat, Span, Data
    ),
    Direction.TRAINER_TO_LEDGER: _table(
        Job,
        Published,
        GetBatch,
        Verified,
        RefusedResult,
        Stats,
        Finished,
        Heartbeat,
        RevocationsMsg,
    ),
    Direction.OBSERVER_TO_LEDGER: _table(Heartbeat, StatusQuery),  # observers only read
    Direction.LEDGER_TO_PEER: _table(
        Welcome, Announce, Assign, Commit, Exclude, CatchUpMsg, Route, Stop
    ),
    Direction.LEDGER_TO_TRAINER: _table(Resume, Batch, BatchDone),
    Direction.LEDGER_TO_OBSERVER: _table(
        Progress, BatchRequested, BatchDone, Stats, PublishedNote, Finished, StatusReply
    ),
}
"""Every control message, by direction and ``op``."""


def decode(msg: object, direction: Direction, *, allowed: frozenset[str] | None = None) -> Message:
    """The typed message for ``msg`` (a map from the channel) sent in ``direction``, or
    :class:`MessageError` naming op, field and reason. ``allowed``: a subset of the
    direction's ops this receiver takes from this sender (a relay sends only some)."""
    if not isinstance(msg, dict):
        raise MessageError(Why.NOT_A_MAP, "message", f"got {_kind(msg)}")
    op = msg.get("op")
    cls = MESSAGES[direction].get(op) if isinstance(op, str) else None
    if cls is None or (allowed is not None and op not in allowed):
        shown = repr(op)[:40]
        raise MessageError(
            Why.UNKNOWN_OP, "message", f"{shown} is not a message {direction.value} takes"
        )
    values: dict[str, Any] = {}
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    if cls.REST is not None:
        known = {"op", *(f.name for f in fields)}
        msg = {**msg, cls.REST: {k: v for k, v in msg.items() if k not in known} or None}
    for f in fields:
        where = f"{op}.{f.name}"
        value = msg.get(f.name)
        if value is None:
            if not f.metadata["optional"]:
                raise MessageError(Why.MISSING, where, "required")
            continue
        values[f.name] = f.metadata["bound"].check(value, where)
    return cls(**values)


# ---- the payload of a result -------------------------------------------------------------

_PROMPT_ID = re.compile(r"b([1-9][0-9]{0,15})-(0|[1-9][0-9]{0,6})")


def task_index(prompt: str, prompts_per_step: int) -> int:
    """Index into the task's training prompts of prompt id ``b{k}-{i}`` (batch ``k`` from 1,
    ``i`` below ``prompts_per_step``); ValueError for anything else."""
    m = _PROMPT_ID.fullmatch(prompt)
    if m is None or int(m[2]) >= prompts_per_step:
        raise ValueError(f"not a prompt id of this job: {prompt[:40]!r}")
    return (int(m[1]) - 1) * prompts_per_step + int(m[2])


@dataclass(frozen=True, kw_only=True, slots=True)
class Completion:
    """One sampled completion: token ids and their log-probabilities."""

    ids: tuple[int, ...]
    lp: tuple[float, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class ResultPayload:
    """One prompt's completions, as the Trainer trains on them."""

    prompt: str
    index: int
    completions: tuple[Completion, ...]

    @property
    def tokens(self) -> int:
        return sum(len(c.ids) for c in self.completions)


LOGPROB_MIN = -1e4
"""Lowest log-probability accepted (a token of probability e^-10000 is never sampled)."""
LOGPROB_MAX = 1e-3
"""Highest log-probability accepted: 0 in exact arithmetic, a little above in floating point."""


def decode_result_payload(
    payload: bytes,
    *,
    prompt: str,
    index: int,
    group_size: int | None,
    max_new_tokens: int | None,
    vocab_size: int | None,
    eos_ids: Collection[int] | None = None,
) -> ResultPayload:
    """The completions in ``payload``, checked against the lease's ``prompt`` and task
    ``index`` and the job's ``group_size`` completions of at most ``max_new_tokens`` ids in
    ``[0, vocab_size)``, each ending at its first of ``eos_ids`` (or at ``max_new_tokens``) with
    every log-probability at least the plausible floor of ``vocab_size``
    (:func:`aurora.policy.refusals.completion_fault`; None: that bound is not known here);
    :class:`MessageError` otherwise. The Ledger applies it before it settles a lease, the
    Trainer again on what it trains: a payload that fails is a refused result, never an
    exception in the Trainer."""
    try:
        body = msgpack.unpackb(payload)
    except (ValueError, msgpack.UnpackException) as exc:
        why = "nested too deeply" if isinstance(exc, msgpack.StackError) else type(exc).__name__
        raise MessageError(Why.WRONG_TYPE, "payload", f"not msgpack ({why})") from None
    if not isinstance(body, dict):
        raise MessageError(Why.NOT_A_MAP, "payload", f"got {_kind(body)}")
    for name in ("prompt", "index", "completions"):
        if name not in body:
            raise MessageError(Why.MISSING, f"payload.{name}", "required")
    got_prompt = Str(MAX_ID).check(body["prompt"], "payload.prompt")
    got_index = Int(0, MAX_LEASES * MAX_VERSION).check(body["index"], "payload.index")
    if got_prompt != prompt or got_index != index:
        raise MessageError(
            Why.MISMATCH,
            "payload",
            f"prompt {got_prompt!r} index {got_index} for lease prompt {prompt!r} index {index}",
        )
    most = group_size if group_size is not None else 1 << 12
    comps = Seq(_COMPLETION, most).check(body["completions"], "payload.completions")
    if group_size is not None and len(comps) != group_size:
        raise MessageError(
            Why.MISMATCH,
            "payload.completions",
            f"{len(comps)} completions, the job samples {group_size}",
        )
    out = []
    floor = logprob_floor(vocab_size) if vocab_size is not None else None
    for i, c in enumerate(comps):
        where = f"payload.completions[{i}]"
        ids = Seq(Int(0, (vocab_size or 2**31) - 1), max_new_tokens or 1 << 20).check(
            c["ids"], f"{where}.ids"
        )
        lp = Seq(Float(LOGPROB_MIN, LOGPROB_MAX), len(ids)).check(c["lp"], f"{where}.lp")
        if len(lp) != len(ids):
            raise MessageError(Why.MISMATCH, where, f"{len(ids)} ids but {len(lp)} log-probs")
        fault = completion_fault(
            ids, lp, eos_ids=eos_ids, max_new_tokens=max_new_tokens, floor=floor
        )
        if fault is not None:
            raise MessageError(Why.IMPLAUSIBLE, where, fault)
        out.append(Completion(ids=ids, lp=lp))
    return ResultPayload(prompt=got_prompt, index=got_index, completions=tuple(out))


@dataclass(frozen=True)
class _CompletionMap:
    def check(self, value: object, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise MessageError(Why.NOT_A_MAP, where, f"got {_kind(value)}")
        for name in ("ids", "lp"):
            if name not in value:
                raise MessageError(Why.MISSING, f"{where}.{name}", "required")
        return value


_COMPLETION = _CompletionMap()
