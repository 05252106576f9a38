"""The Job Ledger core: ``decide(state, event, *, now) -> (state, actions)``.

Theory of operation
-------------------
Everything AuroraRL decides about scheduling, leases and versions happens in :func:`decide`. The
simulator calls it with ``env.now``; the runtime calls it with its wall clock; neither makes a
decision of its own. An event says what happened (an Actor joined, a delta was published or
staged, a result arrived, time passed); the returned actions say what the drivers must do
(commit a version on an Actor, hand it leases, exclude it, make it catch up, re-route it, fan a
delta out). ``state`` is owned by the caller and updated in place; :func:`decide` validates an
event completely before it changes anything, so an event that raises ``ValueError`` (or its
subclass ``IllegalTransition``) leaves the state exactly as it was.

A step, as in algorithm 1 of the paper:

1. ``DeltaPublished(v)``: the Trainer published D_v (and maybe a snapshot). The Ledger records
   h(v) and sizes, and emits a :class:`Fanout` tree: Trainer -> one relay per remote region ->
   that region's Actors.
2. ``DeltaStaged(a, v)`` as Actors verify D_v while still generating on v-1.
3. ``BatchRequested(v, prompts)``: for each live Actor, the version predicate
   (:func:`aurora.policy.versions.eligibility`). Eligible Actors (and those needing
   :class:`Commit`) share the batch by :func:`aurora.policy.allocation.split`; excluded Actors
   get :class:`Exclude`, their estimate decays by alpha, and a :class:`CatchUp` plan.
4. ``ResultArrived``: the acceptance predicate settles the lease (:class:`Accepted` or
   :class:`Refused`); ``ResultsArrived`` is the same for several leases at one instant (their
   actions concatenated); ``ThroughputObserved`` feeds the EMA estimate.
5. ``Tick``: leases past expiry return their prompts to the pool. Whenever the pool is not empty
   and some Actor is eligible for the current target, the pool is dispatched again, so survivors
   pick up the prompts of a preempted Actor without anyone pausing.

The events and actions themselves, and their JSON records, are :mod:`aurora.policy.events`;
the pacer that requests batches and counts them complete is :mod:`aurora.policy.pacer`, and
:class:`aurora.policy.core.LedgerCore` holds both with this machine for the drivers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from aurora.policy import allocation
from aurora.policy._fsm import IllegalTransition
from aurora.policy.events import (
    Accepted,
    Action,
    ActorJoined,
    ActorLeft,
    ActorLost,
    Assign,
    BatchRequested,
    CatchUp,
    CaughtUp,
    Commit,
    DeltaPublished,
    DeltaStaged,
    Event,
    Evicted,
    Exclude,
    Expired,
    FallBack,
    Fanout,
    PreemptionNotice,
    Refused,
    RelayAssigned,
    RelayJoined,
    RelayLost,
    Released,
    ResultArrived,
    ResultMalformed,
    ResultRefused,
    ResultsArrived,
    ResultVerified,
    Route,
    ThroughputObserved,
    Tick,
    VersionActivated,
)
from aurora.policy.leases import Claim, LeaseBook, LeaseConfig, Refusal
from aurora.policy.membership import TRAINER, ActorLife, advance, elect_relay, source_for
from aurora.policy.refusals import DEFAULT_MAX_REFUSALS, StrikeBook
from aurora.policy.sampling import RankStats
from aurora.policy.staging import ActorVersions
from aurora.policy.verification import Measures, TrustBook, VerificationConfig
from aurora.policy.versions import Eligibility, eligibility, plan_catch_up

# ------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LedgerConfig:
    """Policy parameters of one job's Ledger."""

    trainer_region: str
    """Region of the Trainer: its Actors fetch directly, other regions through a relay."""
    lease: LeaseConfig = field(default_factory=LeaseConfig)
    """Lease length policy."""
    ema_beta: float = allocation.DEFAULT_EMA_BETA
    """EMA weight of a new throughput observation."""
    exclusion_alpha: float = allocation.DEFAULT_EXCLUSION_ALPHA
    """Estimate multiplier for an Actor excluded from a step."""
    prior_tokens_per_s: float = allocation.DEFAULT_PRIOR_TOKENS_PER_S
    """Estimate for new Actors when no live Actor has one."""
    max_lag: int = 1
    """Lag bound: batch k is generated on version k-1-max_lag or newer. 1 is AuroraRL's one-step
    async; 2 and 4 model PrimeRL-Async2/4, whose Actors keep generating on older weights while a
    dense broadcast runs."""
    relays: bool = True
    """Route remote regions through one relay each; ``False`` makes every Actor fetch from the
    Trainer (the no-relay ablation and the PrimeRL baselines)."""
    peer_relay_fallback: bool = False
    """When a region loses its relay and none can be elected, fetch from another region's
    standalone relay instead of the Trainer (saves Trainer egress, costs a second WAN hop)."""
    verification: VerificationConfig | None = None
    """Verified rollouts (:mod:`aurora.policy.verification`): which admitted results the
    Trainer recomputes and what a failure does. None: off (results are admitted on the
    acceptance predicate alone)."""
    max_refusals: int = DEFAULT_MAX_REFUSALS
    """Refused results (a payload refused before admission, or an admitted result the Trainer
    refused) that exclude an Actor for good (:mod:`aurora.policy.refusals`)."""

    def __post_init__(self) -> None:
        if not self.trainer_region:
            raise ValueError("LedgerConfig.trainer_region must be a non-empty region name")
        if not (0 < self.ema_beta <= 1):
            raise ValueError(f"LedgerConfig.ema_beta must be in (0, 1], got {self.ema_beta!r}")
        if not (0 < self.exclusion_alpha <= 1):
            raise ValueError(
                f"LedgerConfig.exclusion_alpha must be in (0, 1], got {self.exclusion_alpha!r}"
            )
        if isinstance(self.max_lag, bool) or not isinstance(self.max_lag, int) or self.max_lag < 1:
            raise ValueError(f"LedgerConfig.max_lag must be an int >= 1, got {self.max_lag!r}")
        if (
            isinstance(self.max_refusals, bool)
            or not isinstance(self.max_refusals, int)
            or self.max_refusals < 1
        ):
            raise ValueError(
                f"LedgerConfig.max_refusals must be an int >= 1, got {self.max_refusals!r}"
            )
        if not (math.isfinite(self.prior_tokens_per_s) and self.prior_tokens_per_s > 0):
            raise ValueError(
                f"LedgerConfig.prior_tokens_per_s must be > 0, got {self.prior_tokens_per_s!r}"
            )


# ------------------------------------------------------------------------------------------
# State
# ------------------------------------------------------------------------------------------


LIVE = (ActorLife.CATCHING_UP, ActorLife.READY, ActorLife.DRAINING)
"""Lives of a live Actor (:attr:`ActorRecord.live`)."""
SCHEDULABLE = (ActorLife.CATCHING_UP, ActorLife.READY)
"""Lives of an Actor that may be given work (:attr:`ActorRecord.schedulable`)."""


@dataclass(slots=True)
class ActorRecord:
    id: str
    region: str
    life: ActorLife
    versions: ActorVersions
    source: str = TRAINER
    estimate: float | None = None
    commit_sent: int | None = None
    catching_up_to: int | None = None
    stalled: bool = False
    """A lease of this Actor expired, or it returned a result on the wrong version or weights,
    and none of its results has been admitted since: dispatch gives it no new prompts while
    another eligible Actor can take them. Found by the reliability matrix: a straggler was
    re-leased the very prompts it let expire (the batch waited another lease length each time),
    and an Actor with wrong weights was handed back each prompt it had just spoiled, 170 times in
    11 s."""

    @property
    def live(self) -> bool:
        return self.life in LIVE

    @property
    def schedulable(self) -> bool:
        return self.life in SCHEDULABLE


@dataclass(frozen=True, slots=True)
class VersionInfo:
    weights_hash: str
    delta_bytes: int | None
    snapshot_bytes: int | None


@dataclass
class LedgerState:
    """Everything the Ledger knows. Create with :func:`initial_state`."""

    config: LedgerConfig
    actors: dict[str, ActorRecord] = field(default_factory=dict)
    relays: dict[str, str] = field(default_factory=dict)
    """Live standalone relays: relay id -> region."""
    region_relay: dict[str, str] = field(default_factory=dict)
    """Region -> its current relay (standalone relay or seed Actor)."""
    versions: dict[int, VersionInfo] = field(default_factory=dict)
    latest: int | None = None
    target: int | None = None
    """Version the current batch is generated on."""
    hold_until: float | None = None
    """Until when dispatch keeps the shares of Actors still staging the target (s)."""
    book: LeaseBook = field(init=False)
    trust: TrustBook | None = field(init=False)
    """Every Actor's verification record (None: verification off)."""
    strikes: StrikeBook = field(init=False)
    """Every Actor's refused results (:mod:`aurora.policy.refusals`)."""
    _ids: list[str] = field(default_factory=list, init=False, repr=False, compare=False)
    """``actors``' ids in sorted order (see :func:`_by_id`)."""

    def __post_init__(self) -> None:
        self.book = LeaseBook(self.config.lease)
        v = self.config.verification
        self.trust = None if v is None else TrustBook(v)
        self.strikes = StrikeBook(self.config.max_refusals)

    def check_fraction(self, actor: str) -> float | None:
        """The fraction of ``actor``'s admitted results the Trainer checks now (its
        verification record's, :meth:`~aurora.policy.verification.TrustBook.fraction`; 0 when
        verification is off), or None when it is excluded (by verification or for its refused
        results: none of its results is trained on). Which results: the Trainer's keyed coin
        (:func:`aurora.policy.verification.plan`), never the Ledger's."""
        if self.excluded(actor):
            return None
        return 0.0 if self.trust is None else self.trust.fraction(actor)

    def excluded(self, actor: str) -> bool:
        """Whether ``actor`` is excluded from the job for good."""
        return self.strikes.excluded(actor) or (
            self.trust is not None and self.trust.excluded(actor)
        )


RETAIN_BATCHES = 4
"""Versions of settled batches kept in the lease book beyond the lag bound (see ``_on_batch``)."""


def initial_state(config: LedgerConfig) -> LedgerState:
    return LedgerState(config=config)


# ------------------------------------------------------------------------------------------
# decide
# ------------------------------------------------------------------------------------------


def decide(state: LedgerState, event: Event, *, now: float) -> tuple[LedgerState, list[Action]]:
    """Apply one event at time ``now`` (seconds); return the state and the actions to carry out."""
    if not isinstance(now, (int, float)) or not math.isfinite(now):
        raise ValueError(f"now must be a finite number of seconds, got {now!r}")
    handler = _HANDLERS.get(type(event))
    if handler is None:
        raise ValueError(f"unknown event type {type(event).__name__}")
    actions: list[Action] = []
    handler(state, event, now, actions)
    return state, actions


def _by_id(state: LedgerState) -> list[ActorRecord]:
    """Every Actor record in id order (the order dispatch and exclusion visit them). The sorted
    ids are kept while no id is added: an id never leaves ``actors`` (a departed Actor's record
    stays, not live), so an unchanged count means unchanged ids; the records are looked up
    fresh, since a rejoin replaces its id's record."""
    actors = state.actors
    ids = state._ids
    if len(ids) != len(actors):
        ids = state._ids = sorted(actors)
    return list(map(actors.__getitem__, ids))


def _actor(state: LedgerState, actor: str) -> ActorRecord:
    rec = state.actors.get(actor)
    if rec is None:
        raise ValueError(f"unknown Actor id {actor!r}")
    return rec


def _check_version_arg(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int version, got {value!r}")


def _on_joined(state: LedgerState, ev: ActorJoined, now: float, out: list[Action]) -> None:
    if not ev.actor or ev.actor == TRAINER or ev.actor in state.relays:
        raise ValueError(f"Actor id {ev.actor!r} is empty or taken by the Trainer or a relay")
    if not ev.region:
        raise ValueError(f"Actor {ev.actor!r}: region must be a non-empty name")
    if ev.active is not None:
        _check_version_arg("ActorJoined.active", ev.active)
        if ev.active not in state.versions:
            raise ValueError(
                f"Actor {ev.actor!r} claims version {ev.active}, which was never published "
                f"(latest is {state.latest})"
            )
    if state.trust is not None and state.trust.excluded(ev.actor):
        raise ValueError(f"Actor {ev.actor!r} was excluded for failing verification")
    if state.strikes.excluded(ev.actor):
        raise ValueError(f"Actor {ev.actor!r} was excluded for its refused results")
    old = state.actors.get(ev.actor)
    life = advance(old.life if old else ActorLife.NEW, "join")
    rec = ActorRecord(
        id=ev.actor,
        region=ev.region,
        life=life,
        versions=ActorVersions(ev.active),
        # A returning Actor keeps its (decayed) estimate: it earns its share back.
        estimate=old.estimate if old else None,
    )
    state.actors[ev.actor] = rec
    if old is not None and old.region != rec.region:
        _reroute(state, old.region, out, lost=None)  # it no longer relays for its old region
    if not _route_joiner(state, rec, out):
        _reroute(state, rec.region, out, lost=None, announce=(rec.id,))
    _plan_or_ready(state, rec, out)
    _dispatch(state, now, out)


def _route_joiner(state: LedgerState, rec: ActorRecord, out: list[Action]) -> bool:
    """Route a joining Actor when its region's relay stays the same, without visiting the
    region's other Actors (a join costs the same however many Actors the region has). False
    when a re-election may be needed; :func:`_reroute` then decides."""
    cfg = state.config
    region = rec.region
    if region == cfg.trainer_region or not cfg.relays:
        relay = None
    elif any(reg == region for reg in state.relays.values()):
        relay = state.region_relay.get(region)  # a standalone relay outranks every Actor
        if relay is None or relay not in state.relays:
            return False
    else:
        relay = state.region_relay.get(region)
        current = state.actors.get(relay) if relay is not None else None
        if current is None or not current.schedulable or current.id == rec.id:
            return False
        # The current relay won the election among the others: it stays unless it loses to
        # the joiner.
        pair = [(current.id, current.versions.active), (rec.id, rec.versions.active)]
        if elect_relay((), pair) != current.id:
            return False
    peers = (
        [rid for rid, reg in state.relays.items() if reg != region]
        if cfg.peer_relay_fallback
        else []
    )
    rec.source = source_for(
        rec.id, region, trainer_region=cfg.trainer_region, region_relay=relay, peer_relays=peers
    )
    out.append(Route(actor=rec.id, source=rec.source))
    return True


def _plan_or_ready(state: LedgerState, rec: ActorRecord, out: list[Action]) -> None:
    """Make a CATCHING_UP Actor READY when current, else send it a catch-up plan."""
    latest = state.latest
    active = rec.versions.active
    if (
        latest is None
        or active == latest
        or (active == latest - 1 and rec.versions.staged == latest)
    ):
        rec.catching_up_to = None
        if rec.life is ActorLife.CATCHING_UP:
            rec.life = advance(rec.life, "caught_up")
        return
    if rec.catching_up_to == latest:
        return  # a plan to latest is already under way
    plan = plan_catch_up(
        active,
        latest,
        {v: i.delta_bytes for v, i in state.versions.items() if i.delta_bytes is not None},
        {v: i.snapshot_bytes for v, i in state.versions.items() if i.snapshot_bytes is not None},
    )
    rec.catching_up_to = latest
    out.append(CatchUp(actor=rec.id, plan=plan))


def _leave(state: LedgerState, ev: ActorLeft | ActorLost, now: float, out: list[Action]) -> None:
    rec = _actor(state, ev.actor)
    life = advance(rec.life, "leave" if isinstance(ev, ActorLeft) else "lose")
    if isinstance(ev, ActorLeft):
        for lease in state.book.release_actor(rec.id):
            out.append(Released(lease=lease.id, actor=rec.id, prompt=lease.prompt))
    rec.life = life
    rec.commit_sent = None
    rec.catching_up_to = None
    if state.region_relay.get(rec.region) == rec.id:
        _reroute(state, rec.region, out, lost=rec.id)
    _dispatch(state, now, out)


def _on_notice(state: LedgerState, ev: PreemptionNotice, now: float, out: list[Action]) -> None:
    rec = _actor(state, ev.actor)
    if not math.isfinite(ev.deadline):
        raise ValueError(f"PreemptionNotice.deadline must be finite seconds, got {ev.deadline!r}")
    rec.life = advance(rec.life, "notice")
    for lease in state.book.release_actor(rec.id):
        out.append(Released(lease=lease.id, actor=rec.id, prompt=lease.prompt))
    if state.region_relay.get(rec.region) == rec.id:
        # Hand off relay duty inside the warning window, before the machine disappears.
        _reroute(state, rec.region, out, lost=rec.id)
    _dispatch(state, now, out)


def _on_relay_joined(state: LedgerState, ev: RelayJoined, now: float, out: list[Action]) -> None:
    if not ev.relay or ev.relay == TRAINER or ev.relay in state.actors or ev.relay in state.relays:
        raise ValueError(f"relay id {ev.relay!r} is empty or already in use")
    if not ev.region:
        raise ValueError(f"relay {ev.relay!r}: region must be a non-empty name")
    state.relays[ev.relay] = ev.region
    _reroute(state, ev.region, out, lost=None)


def _on_relay_lost(state: LedgerState, ev: RelayLost, now: float, out: list[Action]) -> None:
    if ev.relay not in state.relays:
        raise ValueError(f"unknown relay id {ev.relay!r}")
    region = state.relays.pop(ev.relay)
    _reroute(
        state, region, out, lost=ev.relay if state.region_relay.get(region) == ev.relay else None
    )


def _reroute(
    state: LedgerState,
    region: str,
    out: list[Action],
    *,
    lost: str | None,
    announce: tuple[str, ...] = (),
) -> None:
    """Re-elect ``region``'s relay and re-route its Actors, emitting what changed."""
    cfg = state.config
    members = sorted(
        (r for r in state.actors.values() if r.region == region and r.schedulable),
        key=lambda r: r.id,
    )
    if region == cfg.trainer_region or not cfg.relays:
        relay = None
    else:
        relay = elect_relay(
            (rid for rid, reg in state.relays.items() if reg == region),
            ((r.id, r.versions.active) for r in members),
        )
    old = state.region_relay.get(region)
    if relay != old:
        if relay is None:
            del state.region_relay[region]
        else:
            state.region_relay[region] = relay
            out.append(RelayAssigned(region=region, relay=relay))
    peers = (
        [rid for rid, reg in state.relays.items() if reg != region]
        if cfg.peer_relay_fallback
        else []
    )
    for rec in members:
        src = source_for(
            rec.id, region, trainer_region=cfg.trainer_region, region_relay=relay, peer_relays=peers
        )
        if src != rec.source or rec.id in announce:
            rec.source = src
            if lost is not None:
                out.append(FallBack(actor=rec.id, source=src, lost=lost))
            else:
                out.append(Route(actor=rec.id, source=src))


def _on_published(state: LedgerState, ev: DeltaPublished, now: float, out: list[Action]) -> None:
    _check_version_arg("DeltaPublished.version", ev.version)
    if not ev.weights_hash:
        raise ValueError(f"DeltaPublished({ev.version}).weights_hash must be non-empty")
    for name in ("delta_bytes", "snapshot_bytes"):
        size = getattr(ev, name)
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            raise ValueError(
                f"DeltaPublished({ev.version}).{name} must be >= 0 bytes, got {size!r}"
            )
    if state.latest is None:
        if ev.snapshot_bytes is None:
            raise ValueError(f"the first published version ({ev.version}) needs a snapshot")
    elif ev.version != state.latest + 1:
        raise ValueError(
            f"published version {ev.version} does not follow latest {state.latest}"
            + (" (version going backwards)" if ev.version <= state.latest else " (gap)")
        )
    elif ev.delta_bytes is None:
        raise ValueError(f"version {ev.version} after {state.latest} needs its delta (delta_bytes)")
    state.versions[ev.version] = VersionInfo(ev.weights_hash, ev.delta_bytes, ev.snapshot_bytes)
    state.latest = ev.version
    if ev.delta_bytes is not None:
        out.append(Fanout(version=ev.version, edges=_fanout_edges(state)))


def _fanout_edges(state: LedgerState) -> tuple[tuple[str, str], ...]:
    """Every edge ``(source, node)`` of a delta's fanout, sorted: the Trainer to each standalone
    relay (with relays on), and each schedulable Actor's source to it. Built by source from the
    Actors in id order (no edge repeats: relay and Actor ids are disjoint), so only the sources
    and the Trainer's few relays are sorted, not every edge."""
    by_source: dict[str, list[str]] = {}
    for rec in _by_id(state):
        if rec.schedulable:
            nodes = by_source.get(rec.source)
            if nodes is None:
                by_source[rec.source] = [rec.id]
            else:
                nodes.append(rec.id)
    if state.config.relays and state.relays:
        nodes = by_source.setdefault(TRAINER, [])
        nodes.extend(state.relays)
        nodes.sort()
    return tuple([(source, node) for source in sorted(by_source) for node in by_source[source]])


def _on_staged(state: LedgerState, ev: DeltaStaged, now: float, out: list[Action]) -> None:
    rec = _actor(state, ev.actor)
    _check_version_arg("DeltaStaged.version", ev.version)
    if ev.version not in state.versions:
        raise ValueError(f"Actor {ev.actor!r} staged unknown version {ev.version}")
    if not rec.live:
        raise IllegalTransition("actor lifecycle", rec.life, "stage")
    rec.versions.stage(ev.version)
    _dispatch_if_eligible(state, rec, now, out)


def _dispatch_if_eligible(
    state: LedgerState, rec: ActorRecord, now: float, out: list[Action]
) -> None:
    """Dispatch after ``rec`` changed version: only ``rec``'s eligibility changed, so only when
    it can now take work (Actors staging one after another do not each dispatch the pool)."""
    target = state.target
    if (
        target is not None
        and state.book.pool_size
        and rec.schedulable
        and _eligibility(rec, target, state.latest) is not Eligibility.EXCLUDED
    ):
        _dispatch(state, now, out)


def _on_activated(state: LedgerState, ev: VersionActivated, now: float, out: list[Action]) -> None:
    rec = _actor(state, ev.actor)
    _check_version_arg("VersionActivated.version", ev.version)
    if not rec.live:
        raise IllegalTransition("actor lifecycle", rec.life, "activate")
    rec.versions.activate(ev.version)
    _after_version_change(state, rec, now, out)


def _on_caught_up(state: LedgerState, ev: CaughtUp, now: float, out: list[Action]) -> None:
    rec = _actor(state, ev.actor)
    _check_version_arg("CaughtUp.version", ev.version)
    if ev.version not in state.versions:
        raise ValueError(f"Actor {ev.actor!r} caught up to unknown version {ev.version}")
    if not rec.live:
        raise IllegalTransition("actor lifecycle", rec.life, "catch_up")
    rec.versions.catch_up(ev.version)
    if rec.catching_up_to is not None and ev.version >= rec.catching_up_to:
        rec.catching_up_to = None
    _after_version_change(state, rec, now, out)


def _after_version_change(
    state: LedgerState, rec: ActorRecord, now: float, out: list[Action]
) -> None:
    if (
        rec.commit_sent is not None
        and rec.versions.active is not None
        and rec.commit_sent <= rec.versions.active
    ):
        rec.commit_sent = None
    if rec.life is ActorLife.CATCHING_UP:
        _plan_or_ready(state, rec, out)
    _dispatch_if_eligible(state, rec, now, out)


def _on_batch(state: LedgerState, ev: BatchRequested, now: float, out: list[Action]) -> None:
    _check_version_arg("BatchRequested.version", ev.version)
    # Batch k may be generated on k-1-max_lag or newer, and the Trainer cannot have published
    # beyond k-1 when batch k is requested, so a valid batch is never older than latest-max_lag.
    # Which version within that range is the orchestrator's choice (aurora.policy.pacer).
    lag = state.config.max_lag
    latest = state.latest
    if latest is None or not (latest - lag <= ev.version <= latest):
        allowed = f" (max_lag {lag} allows {latest - lag}..{latest})" if latest is not None else ""
        raise ValueError(
            f"batch requested on version {ev.version}, latest published is {latest}{allowed}"
        )
    if state.target is not None and ev.version < state.target:
        raise ValueError(f"batch version {ev.version} goes backwards from {state.target}")
    state.book.add(ev.prompts, ev.version)  # validates prompt ids before any change
    # Batches older than any a result can still be admitted for (and RETAIN_BATCHES more, so a
    # straggler's late or duplicate result still gets its exact refusal) leave the book.
    state.book.forget_settled(ev.version - lag - RETAIN_BATCHES)
    state.target = ev.version
    state.hold_until = now + state.book.lease_length()
    # Excluding an Actor changes its estimate and life, never what the predicate says of it:
    # the Actors are classified once, excluded, then leased to.
    candidates = _candidates(state, ev.version)
    for rec in candidates.excluded:
        out.append(Exclude(actor=rec.id, version=ev.version, active=rec.versions.active))
        if rec.estimate is not None:
            rec.estimate = allocation.exclusion_decay(rec.estimate, state.config.exclusion_alpha)
        if rec.life is ActorLife.READY:
            rec.life = advance(rec.life, "fall_behind")
        _plan_or_ready(state, rec, out)
    _lease_out(state, candidates, now, out)


def _eligibility(rec: ActorRecord, target: int, latest: int | None) -> Eligibility:
    """The version predicate (:func:`aurora.policy.versions.eligibility`) for ``rec``'s Actor."""
    return eligibility(rec.versions.active, rec.versions.staged, target, latest)


def _dispatch(state: LedgerState, now: float, out: list[Action]) -> None:
    """Lease the pool to the Actors eligible for the current target, committing where needed.

    Shares are computed over every *expected* Actor (eligible, or one version behind with the
    delta presumably on its way), and an eligible Actor takes only its share less what it
    already holds. While the batch is young (``now <= hold_until``) the shares of Actors still
    staging or catching up stay in the pool for them, so the first Actor to finish staging does
    not take the whole batch; after that, or when nobody is behind, dispatch is
    work-conserving and empties the pool.
    """
    if state.target is not None and state.book.pool_size:
        _lease_out(state, _candidates(state, state.target), now, out)


@dataclass(frozen=True, slots=True)
class _Candidates:
    """The schedulable Actors as the version predicate classes them for one target, each list
    in id order (:func:`_candidates`)."""

    eligible: list[ActorRecord]
    """May work on the target (less the stalled ones, while another eligible one is not)."""
    expected: list[ActorRecord]
    """Have a share of the batch: the eligible ones, and those one version behind (their
    delta is on the way, worth holding a share for; Actors further behind, a long catch-up or
    a fresh join, are not waited for)."""
    needs_commit: set[str]
    """Those of the eligible ones that need a ``Commit`` to the target first."""
    excluded: list[ActorRecord]
    """Get no work on the target."""


def _candidates(state: LedgerState, target: int) -> _Candidates:
    """The schedulable Actors classed by the version predicate for ``target``. Stragglers whose
    leases expired (:attr:`ActorRecord.stalled`) take nothing new and are not expected while
    another eligible Actor can take the work."""
    eligible: list[ActorRecord] = []
    expected: list[ActorRecord] = []
    needs_commit: set[str] = set()
    excluded: list[ActorRecord] = []
    for rec in _by_id(state):
        if not rec.schedulable:
            continue
        verdict = _eligibility(rec, target, state.latest)
        if verdict is Eligibility.EXCLUDED:
            excluded.append(rec)
            if rec.versions.active == target - 1:
                expected.append(rec)
            continue
        eligible.append(rec)
        expected.append(rec)
        if verdict is Eligibility.NEEDS_COMMIT:
            needs_commit.add(rec.id)
    if any(rec.stalled for rec in eligible) and not all(rec.stalled for rec in eligible):
        eligible = [rec for rec in eligible if not rec.stalled]
        expected = [rec for rec in expected if not rec.stalled]
    return _Candidates(eligible, expected, needs_commit, excluded)


def _lease_out(state: LedgerState, candidates: _Candidates, now: float, out: list[Action]) -> None:
    """:func:`_dispatch` once the Actors are classed: the shares, then the leases."""
    eligible, expected = candidates.eligible, candidates.expected
    if not eligible or not state.book.pool_size:
        return
    estimates = _estimates(state, expected)
    holding = (
        len(expected) > len(eligible) and state.hold_until is not None and now <= state.hold_until
    )
    wants = _wants(state.book, eligible, expected, estimates, holding=holding)
    leased = [rec for rec in eligible if wants[rec.id] > 0]
    _assign(state, leased, wants, candidates.needs_commit, now, out)
    assert holding or state.book.pool_size == 0


def _estimates(state: LedgerState, actors: list[ActorRecord]) -> dict[str, float]:
    """Each of ``actors``' throughput estimate (tokens/s): its own, or the prior
    (:func:`aurora.policy.allocation.prior` over every live Actor's estimate) if it has none."""
    prior = 0.0  # unused when every one of them has an estimate
    if any(rec.estimate is None for rec in actors):
        known = {
            rec.id: rec.estimate
            for rec in state.actors.values()
            if rec.live and rec.estimate is not None
        }
        prior = allocation.prior(known, state.config.prior_tokens_per_s)
    return {rec.id: rec.estimate if rec.estimate is not None else prior for rec in actors}


def _wants(
    book: LeaseBook,
    eligible: list[ActorRecord],
    expected: list[ActorRecord],
    estimates: dict[str, float],
    *,
    holding: bool,
) -> dict[str, int]:
    """How many prompts of the pool each eligible Actor takes now: the pool and every expected
    Actor's live leases split in proportion to ``estimates``, less what each holds already, in
    id order while the pool lasts; unless ``holding`` (for Actors still staging), what is left
    (shares of Actors that hold more than their share, or of Actors too late to wait for) is
    split again over the eligible Actors alone."""
    left = book.pool_size
    held = {rec.id: len(book.by_actor.get(rec.id, ())) for rec in expected}
    shares = allocation.split(left + sum(held.values()), estimates, held.keys())
    wants: dict[str, int] = {}
    for rec in eligible:
        wants[rec.id] = n = min(max(shares[rec.id] - held[rec.id], 0), left)
        left -= n
    if left and not holding:
        rest = allocation.split(left, estimates, [rec.id for rec in eligible])
        for actor, n in rest.items():
            wants[actor] += n
    return wants


def _assign(
    state: LedgerState,
    actors: list[ActorRecord],
    wants: dict[str, int],
    needs_commit: set[str],
    now: float,
    out: list[Action],
) -> None:
    """Lease each of ``actors``' Actors the prompts it ``wants``, in order, each after a
    ``Commit(target)`` if it must switch to the target first (once per target). An Actor
    already past the target works on its own, newer version; any other on the target."""
    target = state.target
    assert target is not None
    versions = [
        rec.versions.active
        if rec.versions.active is not None and rec.versions.active > target
        else target
        for rec in actors
    ]
    claims = [
        Claim(rec.id, wants[rec.id], version, state.versions[version].weights_hash)
        for rec, version in zip(actors, versions, strict=True)
    ]
    claimed = state.book.claim(claims, now=now)
    for rec, version, leases in zip(actors, versions, claimed, strict=True):
        if rec.id in needs_commit and rec.commit_sent != target:
            out.append(Commit(actor=rec.id, version=target))
            rec.commit_sent = target
        out.append(
            Assign(
                actor=rec.id,
                version=version,
                leases=tuple([lease.id for lease in leases]),
                prompts=tuple([lease.prompt for lease in leases]),
                expiry=leases[0].expiry,
            )
        )


def changes_nothing(state: LedgerState, event: Event) -> bool:
    """Would ``event`` leave ``state`` as it is, whatever it decides? True for a result (alone,
    in a run, or malformed) from an Actor the Ledger does not know (refused as impossible) or
    whose every lease is refused without a change (:meth:`LeaseBook.changes_nothing`): the
    results a sender can repeat without end. Asked before :func:`decide`; the runtime's Ledger
    bounds how many such events of one Actor it logs, since replaying them changes nothing."""
    kind = type(event)
    if kind is ResultArrived or kind is ResultMalformed:
        leases: tuple[str, ...] = (event.lease,)  # type: ignore[union-attr]
    elif kind is ResultsArrived:
        leases = event.leases  # type: ignore[union-attr]
    else:
        return False
    actor = event.actor  # type: ignore[union-attr]
    if actor not in state.actors:
        return True
    book = state.book
    return all(book.changes_nothing(lease, actor) for lease in leases)


def _on_result(state: LedgerState, ev: ResultArrived, now: float, out: list[Action]) -> None:
    rec = _actor(state, ev.actor)
    _settle_results(state, rec, (ev.lease,), ev.version, ev.weights_hash, now, out)


def _on_malformed(state: LedgerState, ev: ResultMalformed, now: float, out: list[Action]) -> None:
    rec = _actor(state, ev.actor)
    if state.strikes.excluded(ev.actor):  # a refusal it cannot be counted for: nothing changes
        raise ValueError(f"Actor {ev.actor!r} was excluded for its refused results")
    verdict = state.book.refuse_malformed(ev.lease, ev.actor)
    refusal = verdict.refusal
    assert refusal is not None
    if refusal is Refusal.BAD_PAYLOAD:
        rec.stalled = True  # its results are spoiled: others take the prompt back first
    out.append(Refused(lease=ev.lease, actor=ev.actor, reason=refusal))
    if refusal is Refusal.BAD_PAYLOAD and state.strikes.strike(ev.actor, ev.lease):
        _evict(state, rec, "REFUSED", now, out)  # dispatches the pool, the prompt included
    elif verdict.returned_to_pool:
        _dispatch(state, now, out)


def _on_refused(state: LedgerState, ev: ResultRefused, now: float, out: list[Action]) -> None:
    """The Trainer refused an admitted result: one strike; at ``max_refusals`` the Actor is
    excluded for good. (The lease is settled and its batch trained without it: nothing to
    lease again.)"""
    rec = _actor(state, ev.actor)
    lease = state.book.leases.get(ev.lease)
    if lease is not None and lease.actor != ev.actor:
        raise ValueError(f"ResultRefused: lease {ev.lease!r} is not {ev.actor!r}'s")
    if state.excluded(ev.actor):
        raise ValueError(f"ResultRefused: Actor {ev.actor!r} is excluded already")
    evict = state.strikes.strike(ev.actor, ev.lease)  # ValueError for a lease counted before
    out.append(Refused(lease=ev.lease, actor=ev.actor, reason=Refusal.TRAINER_REFUSED))
    if evict:
        _evict(state, rec, "REFUSED", now, out)


def _on_results(state: LedgerState, ev: ResultsArrived, now: float, out: list[Action]) -> None:
    rec = _actor(state, ev.actor)  # the one check that raises: before any lease is settled
    _settle_results(state, rec, ev.leases, ev.version, ev.weights_hash, now, out)


def _settle_results(
    state: LedgerState,
    rec: ActorRecord,
    leases: tuple[str, ...],
    version: int,
    weights_hash: str,
    now: float,
    out: list[Action],
) -> None:
    """Results of ``rec``'s Actor for ``leases``, one after another: the acceptance predicate
    settles each lease (the one place a result is judged, whether it came alone or with
    others)."""
    book = state.book
    for lease in leases:
        verdict = book.settle(
            lease, actor=rec.id, version=version, weights_hash=weights_hash, now=now
        )
        if verdict.refusal is None:
            rec.stalled = False  # it works: an admitted result shows it
            assert verdict.prompt is not None
            out.append(Accepted(lease=lease, actor=rec.id, prompt=verdict.prompt, version=version))
            if book.pool_size and not book.by_actor.get(rec.id):
                _dispatch(state, now, out)  # an idle Actor takes more of a held-back pool
            continue
        if verdict.refusal in (Refusal.WRONG_VERSION, Refusal.WRONG_HASH):
            rec.stalled = True  # its results are spoiled: others take the prompt back first
        out.append(Refused(lease=lease, actor=rec.id, reason=verdict.refusal))
        if verdict.returned_to_pool:
            _dispatch(state, now, out)


def _on_verified(state: LedgerState, ev: ResultVerified, now: float, out: list[Action]) -> None:
    """A recompute's measures (:mod:`aurora.policy.verification`): passed, the Actor's record
    moves on; failed, the result is refused, the Actor excluded for good (its live leases
    released to the pool, its membership ended) and the pool dispatched to the others."""
    rec = _actor(state, ev.actor)
    trust = state.trust
    if trust is None:
        raise ValueError("ResultVerified: verification is off for this job")
    _check_version_arg("ResultVerified.version", ev.version)
    for name in ("max_delta", "mean_delta", "min_logprob"):
        value = getattr(ev, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise ValueError(f"ResultVerified.{name} must be a number, got {value!r}")
    if isinstance(ev.tokens, bool) or not isinstance(ev.tokens, int) or ev.tokens < 1:
        raise ValueError(f"ResultVerified.tokens must be a positive int, got {ev.tokens!r}")
    lease = state.book.leases.get(ev.lease)
    if lease is not None and lease.actor != ev.actor:
        raise ValueError(f"ResultVerified: lease {ev.lease!r} is not {ev.actor!r}'s")
    if isinstance(ev.rank_tokens, bool) or not isinstance(ev.rank_tokens, int):
        raise ValueError(f"ResultVerified.rank_tokens must be an int, got {ev.rank_tokens!r}")
    for name in ("rank_shift", "rank_spread"):
        if isinstance(getattr(ev, name), bool) or not isinstance(getattr(ev, name), int | float):
            raise ValueError(f"ResultVerified.{name} must be a number, got {getattr(ev, name)!r}")
    measures = Measures(
        max_delta=float(ev.max_delta),
        mean_delta=float(ev.mean_delta),
        min_logprob=float(ev.min_logprob),
        tokens=ev.tokens,
        # ValueError for sums that no ranks in [0, 1] give (RankStats checks them).
        ranks=RankStats(
            tokens=ev.rank_tokens, shift=float(ev.rank_shift), spread=float(ev.rank_spread)
        ),
    )
    # IllegalTransition (no change) if the Actor is excluded already.
    failure = trust.observe(ev.actor, measures, ev.version)
    if failure is None:
        return
    out.append(Refused(lease=ev.lease, actor=ev.actor, reason=Refusal.UNVERIFIED))
    _evict(state, rec, failure.name, now, out)


def _evict(
    state: LedgerState, rec: ActorRecord, reason: str, now: float, out: list[Action]
) -> None:
    """Exclude ``rec``'s Actor for good (its record in the book that excluded it says so):
    its live leases go back to the pool, its membership ends, its region re-routes, and the
    pool is dispatched to the others."""
    for held in state.book.release_actor(rec.id):
        out.append(Released(lease=held.id, actor=rec.id, prompt=held.prompt))
    out.append(Evicted(actor=rec.id, reason=reason))
    if rec.live:
        rec.life = advance(rec.life, "leave")
    rec.commit_sent = None
    rec.catching_up_to = None
    if state.region_relay.get(rec.region) == rec.id:
        _reroute(state, rec.region, out, lost=rec.id)
    _dispatch(state, now, out)


def _on_throughput(
    state: LedgerState, ev: ThroughputObserved, now: float, out: list[Action]
) -> None:
    rec = _actor(state, ev.actor)
    tokens, seconds = ev.tokens, ev.seconds
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
        raise ValueError(f"ThroughputObserved.tokens must be a positive int, got {tokens!r}")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"ThroughputObserved.seconds must be > 0, got {seconds!r}")
    rec.estimate = allocation.ema_update(rec.estimate, tokens / seconds, state.config.ema_beta)


def _on_tick(state: LedgerState, ev: Tick, now: float, out: list[Action]) -> None:
    for lease in state.book.expire_due(now):
        out.append(Expired(lease=lease.id, actor=lease.actor, prompt=lease.prompt))
        rec = state.actors.get(lease.actor)
        if rec is not None:
            rec.stalled = True
    _dispatch(state, now, out)


_HANDLERS: dict[type, Any] = {
    ActorJoined: _on_joined,
    ActorLeft: _leave,
    ActorLost: _leave,
    PreemptionNotice: _on_notice,
    RelayJoined: _on_relay_joined,
    RelayLost: _on_relay_lost,
    DeltaPublished: _on_published,
    DeltaStaged: _on_staged,
    VersionActivated: _on_activated,
    CaughtUp: _on_caught_up,
    BatchRequested: _on_batch,
    ResultArrived: _on_result,
    ResultMalformed: _on_malformed,
    ResultsArrived: _on_results,
    ResultVerified: _on_verified,
    ResultRefused: _on_refused,
    ThroughputObserved: _on_throughput,
    Tick: _on_tick,
}
