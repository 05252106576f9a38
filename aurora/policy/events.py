"""The Job Ledger's vocabulary: every event (what happened) and action (what a driver must do),
and their JSON records.

Theory of operation
-------------------
Events go into :func:`aurora.policy.ledger.decide` (and :class:`aurora.policy.core.LedgerCore`);
actions come out. Both are frozen data with no behaviour, so a driver, a log or a test can hold
them without the machine: the runtime writes each event and its actions to its log as
:func:`to_record` dicts, and a replay reads events back with :func:`event_from_record` (the
golden traces, the sim/runtime parity checks, a restarted Ledger). Kept apart from the machine
that interprets them, as h11 keeps ``_events.py`` apart from ``_state.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from aurora.policy.leases import Refusal
from aurora.policy.versions import CatchUpPlan

# ------------------------------------------------------------------------------------------
# Events (what happened)
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ActorJoined:
    """An Actor registered (new, or returning under the same id)."""

    actor: str
    region: str
    active: int | None = None
    """Version it already holds (None: no weights loaded)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ActorLeft:
    """Graceful leave: its live leases return to the pool at once."""

    actor: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ActorLost:
    """Involuntary loss (preempted without notice, crashed, partitioned): leases expire."""

    actor: str


@dataclass(frozen=True, kw_only=True, slots=True)
class PreemptionNotice:
    """The cloud announced a preemption at ``deadline`` (seconds): drain now."""

    actor: str
    deadline: float


@dataclass(frozen=True, kw_only=True, slots=True)
class RelayJoined:
    """A standalone relay process serves ``region``."""

    relay: str
    region: str


@dataclass(frozen=True, kw_only=True, slots=True)
class RelayLost:
    """A standalone relay disappeared."""

    relay: str


@dataclass(frozen=True, kw_only=True, slots=True)
class DeltaPublished:
    """The Trainer published version ``version`` in the Checkpoint Store."""

    version: int
    weights_hash: str
    """h(version)."""
    delta_bytes: int | None
    """Size of D_version (None only for a first, snapshot-only version)."""
    snapshot_bytes: int | None = None
    """Size of a full snapshot of this version, if one was written."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DeltaStaged:
    """``actor`` received and verified D_version."""

    actor: str
    version: int


@dataclass(frozen=True, kw_only=True, slots=True)
class VersionActivated:
    """``actor`` applied its staged D_version onto version-1 at a safe point."""

    actor: str
    version: int


@dataclass(frozen=True, kw_only=True, slots=True)
class CaughtUp:
    """``actor`` finished a catch-up plan (verified snapshot and/or chain) up to ``version``."""

    actor: str
    version: int


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchRequested:
    """The Trainer wants rollouts of ``prompts`` on policy ``version`` (the latest)."""

    version: int
    prompts: tuple[str, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class ResultArrived:
    """A rollout for ``lease`` arrived, generated on ``version`` with hash ``weights_hash``."""

    actor: str
    lease: str
    version: int
    weights_hash: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ResultMalformed:
    """A result for ``lease`` arrived whose payload is not what the lease asked for (the
    runtime decoded it against the lease's prompt and the job: wrong prompt, group size, token
    ids or log-probabilities). Refused with ``BAD_PAYLOAD``; the holder's lease is released."""

    actor: str
    lease: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ResultsArrived:
    """The rollouts for ``leases`` arrived together, in that order (one finished assignment),
    all from ``actor``, generated on ``version`` with hash ``weights_hash``.

    Decided exactly as one :class:`ResultArrived` per lease, in that order, at the same time:
    the actions are theirs, concatenated (both go through one function, ``_settle_results``).
    A driver that has a whole assignment's results at one instant (the simulator) may feed
    this; the runtime, whose results arrive one message each, feeds :class:`ResultArrived`."""

    actor: str
    leases: tuple[str, ...]
    version: int
    weights_hash: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ResultVerified:
    """The Trainer recomputed ``actor``'s admitted result for ``lease`` (generated on
    ``version``) under that version's weights and measured this (nats; see
    :class:`aurora.policy.verification.Measures`). The policy judges it
    (:func:`aurora.policy.verification.judge`): a failure refuses the result
    (``Refusal.UNVERIFIED``) and excludes the Actor for good."""

    actor: str
    lease: str
    version: int
    max_delta: float
    """Largest |reported - recomputed| log-prob of a token."""
    mean_delta: float
    """Mean |reported - recomputed| log-prob over the result's tokens."""
    min_logprob: float
    """Smallest recomputed log-prob of a sampled token."""
    tokens: int
    """Tokens compared."""
    rank_tokens: int = 0
    """Tokens whose rank ``u`` under pi_v was computed (0: none; :mod:`aurora.policy.sampling`,
    and the two sums below)."""
    rank_shift: float = 0.0
    """``sum (u - 1/2)`` over them."""
    rank_spread: float = 0.0
    """``sum ((u - 1/2)^2 - 1/12)`` over them."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ResultRefused:
    """The Trainer refused ``actor``'s admitted result for ``lease`` (its payload failed the
    Trainer's check, or the step it would have made was not finite or an outlier: ``why``).
    One strike against the Actor (:class:`aurora.policy.refusals.StrikeBook`)."""

    actor: str
    lease: str
    why: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ThroughputObserved:
    """``actor`` generated ``tokens`` in ``seconds`` of its last batch."""

    actor: str
    tokens: int
    seconds: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Tick:
    """Time passed: expire due leases."""


Event = (
    ActorJoined
    | ActorLeft
    | ActorLost
    | PreemptionNotice
    | RelayJoined
    | RelayLost
    | DeltaPublished
    | DeltaStaged
    | VersionActivated
    | CaughtUp
    | BatchRequested
    | ResultArrived
    | ResultMalformed
    | ResultsArrived
    | ResultVerified
    | ResultRefused
    | ThroughputObserved
    | Tick
)

# ------------------------------------------------------------------------------------------
# Actions (what the drivers must do)
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Commit:
    """Activate staged D_version at the next end-of-batch safe point (sent via the relay tree)."""

    actor: str
    version: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Assign:
    """Generate rollouts for ``prompts`` under ``leases`` on ``version`` before ``expiry``."""

    actor: str
    version: int
    leases: tuple[str, ...]
    prompts: tuple[str, ...]
    expiry: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Exclude:
    """``actor`` (active on ``active``) gets no work for step ``version``."""

    actor: str
    version: int
    active: int | None


@dataclass(frozen=True, kw_only=True, slots=True)
class CatchUp:
    """Fetch and apply ``plan`` (snapshot and/or deltas) from the Store or a relay cache."""

    actor: str
    plan: CatchUpPlan


@dataclass(frozen=True, kw_only=True, slots=True)
class Route:
    """``actor`` now receives deltas from ``source`` (a relay id or ``"trainer"``)."""

    actor: str
    source: str


@dataclass(frozen=True, kw_only=True, slots=True)
class FallBack:
    """``actor``'s relay ``lost`` is gone: fetch from ``source`` (resume what is missing)."""

    actor: str
    source: str
    lost: str


@dataclass(frozen=True, kw_only=True, slots=True)
class RelayAssigned:
    """``relay`` serves ``region`` from now on."""

    region: str
    relay: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Fanout:
    """Push D_version along ``edges`` (source, destination), cut-through."""

    version: int
    edges: tuple[tuple[str, str], ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Accepted:
    """The result for ``lease`` was admitted into training."""

    lease: str
    actor: str
    prompt: str
    version: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Refused:
    """The result for ``lease`` was refused for ``reason``."""

    lease: str
    actor: str
    reason: Refusal


@dataclass(frozen=True, kw_only=True, slots=True)
class Expired:
    """``lease`` expired; ``prompt`` is back in the pool."""

    lease: str
    actor: str
    prompt: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Released:
    """``lease`` was released (graceful leave); ``prompt`` is back in the pool."""

    lease: str
    actor: str
    prompt: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Evicted:
    """``actor`` is excluded from the job for good: it failed verification (``reason``: a
    :class:`~aurora.policy.verification.CheckFailure` name) or had ``max_refusals`` results
    refused (``reason``: ``REFUSED``); its live leases were released (``Released`` actions
    before this one), and the driver disconnects it."""

    actor: str
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchCompleted:
    """Every prompt of batch ``batch`` has an admitted result: the Trainer may train on it.
    Emitted by :class:`aurora.policy.core.LedgerCore` (the pacer's count), right after the
    ``Accepted`` that completed the batch."""

    batch: int


Action = (
    Commit
    | Assign
    | Exclude
    | CatchUp
    | Route
    | FallBack
    | RelayAssigned
    | Fanout
    | Accepted
    | Refused
    | Expired
    | Released
    | Evicted
    | BatchCompleted
)

# ------------------------------------------------------------------------------------------
# Trace records (golden traces, sim/runtime parity)
# ------------------------------------------------------------------------------------------

_EVENT_TYPES = {
    t.__name__: t
    for t in (
        ActorJoined,
        ActorLeft,
        ActorLost,
        PreemptionNotice,
        RelayJoined,
        RelayLost,
        DeltaPublished,
        DeltaStaged,
        VersionActivated,
        CaughtUp,
        BatchRequested,
        ResultArrived,
        ResultMalformed,
        ResultsArrived,
        ResultVerified,
        ResultRefused,
        ThroughputObserved,
        Tick,
    )
}
_ACTION_TYPES = {
    t.__name__: t
    for t in (
        Commit,
        Assign,
        Exclude,
        CatchUp,
        Route,
        FallBack,
        RelayAssigned,
        Fanout,
        Accepted,
        Refused,
        Expired,
        Released,
        Evicted,
        BatchCompleted,
    )
}


def _plain(value: Any) -> Any:
    if isinstance(value, CatchUpPlan):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Refusal):
        return value.name
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def to_record(obj: Event | Action) -> dict[str, Any]:
    """A JSON-ready dict of an event or action: ``{"type": name, field: value, ...}``."""
    rec: dict[str, Any] = {"type": type(obj).__name__}
    for f in fields(obj):
        rec[f.name] = _plain(getattr(obj, f.name))
    return rec


def event_from_record(rec: dict[str, Any]) -> Event:
    """Inverse of :func:`to_record` for events; raises ValueError for an unknown type or field."""
    rec = dict(rec)
    name = rec.pop("type", None)
    cls = _EVENT_TYPES.get(name)
    if cls is None:
        raise ValueError(f"unknown event type {name!r}")
    if cls is BatchRequested:
        rec["prompts"] = tuple(rec.get("prompts", ()))
    if cls is ResultsArrived:
        rec["leases"] = tuple(rec.get("leases", ()))
    try:
        return cls(**rec)
    except TypeError as exc:
        raise ValueError(f"bad {name} record: {exc}") from None
