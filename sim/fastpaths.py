"""The simulator's fast paths: cheaper ways to do what calling the policy core does, for the
per-Actor work of a run (cohort mode, :mod:`sim.cohorts`, at 10^4-10^5 Actors above all).

The policy core (``aurora.policy``) is the specification: one entry point per operation,
frozen events, each rule written once. What the simulator needs faster than that lives here,
and ``tests/test_sim_fastpaths.py`` holds each path to the core's own operation on randomized
inputs (same inputs, same objects or decisions); nothing in the core depends on this module.

Three kinds: builders of the frozen events cohort mode makes per Actor per step
(:func:`_setters`), :func:`decide_reports` for the reports the pacer does not read, and
:func:`feed_results` for an Actor's results when the pool is empty. Each depends on the
core's layout, which is why the oracle test compares the whole state after each call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

from aurora.policy.actor import Work
from aurora.policy.core import LedgerCore
from aurora.policy.events import (
    Accepted,
    Action,
    DeltaStaged,
    ResultsArrived,
    ThroughputObserved,
    VersionActivated,
)
from aurora.policy.leases import TRANSITIONS, Lease, LeaseState, admits
from aurora.policy.ledger import decide

_new = object.__new__

PASSED_THROUGH = (DeltaStaged, VersionActivated)
"""Events :meth:`LedgerCore.feed` passes to ``decide`` with nothing of the pacer's."""


def _setters(cls: type, *names: str) -> tuple[Callable[[Any, Any], None], ...]:
    """Each named slot's setter of ``cls``; ``names`` must be its fields, in order.

    The builders below make the objects cohort mode makes per Actor per step (a member's
    ``ResultsArrived``, ``ThroughputObserved`` and ``VersionActivated``, and the ``Work`` an
    ``Assign`` queues). A frozen dataclass's ``__init__`` sets each field through
    ``object.__setattr__`` after a keyword-argument call; a builder makes the same object (equal,
    same hash, same slots) by ``object.__new__`` and each slot's own setter, about a third of the
    cost. Only for slotted dataclasses without ``__post_init__`` (refused here otherwise), and
    the field names must be the class's own in order."""
    if "__slots__" not in cls.__dict__ or hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__}: a builder needs a slotted dataclass, no __post_init__")
    if tuple(f.name for f in fields(cls)) != names:
        raise TypeError(f"{cls.__name__}'s fields are not {names}")
    return tuple(cls.__dict__[name].__set__ for name in names)


_ra_actor, _ra_leases, _ra_version, _ra_hash = _setters(
    ResultsArrived, "actor", "leases", "version", "weights_hash"
)
_to_actor, _to_tokens, _to_seconds = _setters(ThroughputObserved, "actor", "tokens", "seconds")
_va_actor, _va_version = _setters(VersionActivated, "actor", "version")
_w_version, _w_leases, _w_expiry = _setters(Work, "version", "leases", "expiry")
_a_lease, _a_actor, _a_prompt, _a_version = _setters(
    Accepted, "lease", "actor", "prompt", "version"
)
_SETTLED = TRANSITIONS[LeaseState.CLAIMED]["settle"]


def results_arrived(
    actor: str, leases: tuple[str, ...], version: int, weights_hash: str
) -> ResultsArrived:
    """``ResultsArrived(actor=actor, leases=leases, version=version, weights_hash=...)``."""
    event: ResultsArrived = _new(ResultsArrived)
    _ra_actor(event, actor)
    _ra_leases(event, leases)
    _ra_version(event, version)
    _ra_hash(event, weights_hash)
    return event


def throughput_observed(actor: str, tokens: int, seconds: float) -> ThroughputObserved:
    """``ThroughputObserved(actor=actor, tokens=tokens, seconds=seconds)``."""
    event: ThroughputObserved = _new(ThroughputObserved)
    _to_actor(event, actor)
    _to_tokens(event, tokens)
    _to_seconds(event, seconds)
    return event


def version_activated(actor: str, version: int) -> VersionActivated:
    """``VersionActivated(actor=actor, version=version)``."""
    event: VersionActivated = _new(VersionActivated)
    _va_actor(event, actor)
    _va_version(event, version)
    return event


def work(version: int, leases: tuple[str, ...], expiry: float | None) -> Work:
    """``Work(version, leases, expiry)``."""
    made: Work = _new(Work)
    _w_version(made, version)
    _w_leases(made, leases)
    _w_expiry(made, expiry)
    return made


def accepted(lease: str, actor: str, prompt: str, version: int) -> Accepted:
    """``Accepted(lease=lease, actor=actor, prompt=prompt, version=version)``."""
    action: Accepted = _new(Accepted)
    _a_lease(action, lease)
    _a_actor(action, actor)
    _a_prompt(action, prompt)
    _a_version(action, version)
    return action


def feed_results(core: LedgerCore, event: ResultsArrived, *, now: float) -> list[Action]:
    """``core.feed(event, now=now)``: the same actions and the same state after it.

    For the usual case of an Actor's ``ResultsArrived`` (a cohort member's, or an exact
    process's when nothing records, holds or delays it): the pool is empty (the batch is all
    leased) and the acceptance predicate admits the leases from the first on. The core settles
    them one after another, each through :meth:`LeaseBook.settle
    <aurora.policy.leases.LeaseBook.settle>` (a ``Verdict``, the lease machine's step, the
    Actor's completion times) and the Ledger (an ``Accepted``, a dispatch that an empty pool
    makes a no-op); here the run the predicate admits is settled in one pass over the book's
    records, and whatever follows the first lease it does not admit is fed to the core. It
    writes the book's and the pacer's state as the core does, so it depends on their layout."""
    state, pacer = core.state, core.pacer
    book = state.book
    rec = state.actors.get(event.actor)
    if pacer is None or rec is None or book.pool_size or not math.isfinite(now):
        return core.feed(event, now=now)
    actor, version, weights_hash = event.actor, event.version, event.weights_hash
    leases, states, leased, done = book.leases, book.states, book.leased, book.done
    run: list[Lease] = []
    for lease_id in event.leases:
        lease = leases.get(lease_id)
        if (
            lease is None  # what LeaseBook.changes_nothing finds: not the Actor's claimed lease
            or lease.actor != actor
            or states[lease_id] is not LeaseState.CLAIMED
            or admits(lease, t_r=now, v_r=version, h_r=weights_hash) is not None
        ):
            break
        # What LeaseBook.settle does for an admitted result (the lease machine's step).
        states[lease_id] = _SETTLED
        del leased[lease.prompt]
        done[lease.prompt] = lease_id
        run.append(lease)
    if not run:
        return core.feed(event, now=now)
    book.by_actor[actor].difference_update([lease.id for lease in run])
    took = [now - lease.claimed_at for lease in run]
    book._completions.extend(took)
    book._length = None
    book._admitted(actor, took)
    rec.stalled = False
    actions: list[Action] = [accepted(lease.id, actor, lease.prompt, version) for lease in run]
    completed = pacer.settle(actions, now)  # type: ignore[arg-type]
    if completed:
        actions = core._completed(actions, actions, completed, now)  # type: ignore[arg-type]
    if len(run) < len(event.leases):
        rest = results_arrived(actor, event.leases[len(run) :], version, weights_hash)
        actions += core.feed(rest, now=now)
    return actions


def decide_reports(
    core: LedgerCore, events: Sequence[DeltaStaged | VersionActivated], *, now: float
) -> list[list[Action]]:
    """The actions of ``core.feed(event, now=now)`` for each of ``events`` in order (each a
    :data:`PASSED_THROUGH` event), decided by ``decide`` itself. A ``ValueError`` leaves the
    events before it decided and it and those after it not, as the loop of ``feed`` would.

    These are the reports :class:`~aurora.policy.core.LedgerCore`'s pacer does not read
    (staged, activated): :meth:`LedgerCore.feed` passes them to
    :func:`aurora.policy.ledger.decide` and returns its actions unchanged, so that layer is
    skipped."""
    state = core.state
    out: list[list[Action]] = []
    for event in events:
        if type(event) not in PASSED_THROUGH:
            raise TypeError(f"{type(event).__name__} is read by the pacer: feed it to the core")
        out.append(decide(state, event, now=now)[1])
    return out
