"""What an Actor does next at a safe point: the Actor-side decisions, written once.

Theory of operation
-------------------
The Ledger (:mod:`aurora.policy.ledger`) decides *what* an Actor should do: it leases work on a
version (``Assign``), tells it to switch versions (``Commit``) or to catch up (``CatchUp``). The
Actor itself still has choices to make, and the simulator and the real Actor process must make
them the same way, so they live here and both call them:

* :func:`next_action` - at every safe point (idle, or a batch just finished), in this order:

  1. a catch-up plan whose pieces are all held is applied first (:class:`ApplyPlan`): the Actor
     is behind and nothing else it could do would be admitted;
  2. the oldest queued work runs if it is on the active version (:class:`Generate`);
  3. work on ``active + 1`` whose delta is staged first activates that delta (:class:`Activate`):
     the end-of-batch safe point of the paper (§5.2), so no rollout ever sees a partly applied
     policy;
  4. work on any other version cannot run here (its delta is not staged, or it is older than
     the active version): it is dropped (:class:`Drop`) and its leases expire back to the pool,
     where the Ledger re-leases them to Actors that can run them;
  5. a pending ``Commit(active + 1)`` with the delta staged activates it (:class:`Activate`);
  6. otherwise :class:`Wait`.

  The caller carries out the decision (popping the queue on ``Generate`` and ``Drop``) and asks
  again at its next safe point.
* :func:`to_fetch` - after a ``CatchUp`` plan arrives: which snapshot and deltas the Actor must
  still fetch (those neither held nor already on their way), in the order they are applied.
* :func:`after_catch_up` - once a plan is applied: the work that is still worth keeping (on the
  plan's target or newer) and the deltas staged above the target that must be reported staged
  again, since the Ledger forgets staged versions across a catch-up.
* :func:`takes_catch_up` - whether a ``CatchUp`` plan may be taken at all: only one that moves
  the Actor forwards. A plan to an older (or the same) version would load a signed but stale
  snapshot over newer weights (an injected ``catch_up`` to v0 was loaded by an Actor at v2,
  issue 26); ``Commit`` cannot move it backwards either, since only ``active + 1`` activates.

Nothing here reads a clock or does I/O; versions are plain ints and work items plain tuples.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from aurora.policy.makers import maker
from aurora.policy.versions import CatchUpPlan


@dataclass(frozen=True, slots=True)
class Work:
    """Leases handed to this Actor on one version (one ``Assign``)."""

    version: int
    """The version the results must be generated on."""
    leases: tuple[str, ...]
    """Lease ids (one prompt and its group of completions each)."""


@dataclass(frozen=True, slots=True)
class ApplyPlan:
    """Apply the held catch-up plan (snapshot then deltas, or deltas only)."""

    plan: CatchUpPlan


@dataclass(frozen=True, slots=True)
class Generate:
    """Run the head of the queue on the active version; the caller pops it."""

    work: Work


@dataclass(frozen=True, slots=True)
class Activate:
    """Apply the staged delta of ``version`` (its base is the active version)."""

    version: int


@dataclass(frozen=True, slots=True)
class Drop:
    """The head of the queue cannot run on this Actor; the caller pops it and lets its leases
    expire (they return to the pool)."""

    work: Work
    reason: str
    """``stale`` (older than the active version) or ``unreachable`` (newer, delta not staged)."""


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to do until something arrives (work, a delta, a snapshot, a commit)."""


Decision = ApplyPlan | Generate | Activate | Drop | Wait


_generate = maker(Generate)
"""``Generate(work)``, positionally (:mod:`aurora.policy.makers`): asked per Actor per step."""
_WAIT = Wait()
"""The one ``Wait``: it has no fields, so every ``Wait()`` is equal to it."""


def plan_ready(plan: CatchUpPlan, *, staged: Collection[int], snapshots: Collection[int]) -> bool:
    """Whether every piece of ``plan`` is held (verified) by the Actor."""
    return all(v in staged for v in plan.deltas) and (
        plan.snapshot is None or plan.snapshot in snapshots
    )


def next_action(
    *,
    active: int | None,
    staged: Collection[int],
    queue: Sequence[Work],
    plan: CatchUpPlan | None = None,
    pending_commit: int | None = None,
    snapshots: Collection[int] = (),
) -> Decision:
    """The Actor's next step at a safe point (the order is in the module docstring).

    ``active`` is the active version (None before any weights are loaded), ``staged`` the
    versions whose deltas are held verified, ``queue`` the work in arrival order, ``plan`` the
    catch-up plan in force, ``pending_commit`` the version of an unserved ``Commit`` and
    ``snapshots`` the snapshot versions held verified.
    """
    if plan is not None and plan_ready(plan, staged=staged, snapshots=snapshots):
        return ApplyPlan(plan)
    if queue:
        work = queue[0]
        if active is not None and work.version == active:
            return _generate(work)
        if active is not None and work.version == active + 1 and work.version in staged:
            return Activate(work.version)
        stale = active is not None and work.version < active
        return Drop(work, "stale" if stale else "unreachable")
    if (
        pending_commit is not None
        and active is not None
        and pending_commit == active + 1
        and pending_commit in staged
    ):
        return Activate(pending_commit)
    return _WAIT


def to_fetch(
    plan: CatchUpPlan,
    *,
    staged: Collection[int],
    snapshots: Collection[int] = (),
    in_flight: Collection[int] = (),
) -> tuple[int | None, tuple[int, ...]]:
    """``(snapshot or None, deltas)`` of ``plan`` still to fetch: neither held nor already on
    their way (``in_flight`` holds versions of either kind being fetched or received)."""
    snapshot = plan.snapshot
    if snapshot is not None and (snapshot in snapshots or snapshot in in_flight):
        snapshot = None
    deltas = tuple(v for v in plan.deltas if v not in staged and v not in in_flight)
    return snapshot, deltas


def after_catch_up(
    plan: CatchUpPlan, *, queue: Iterable[Work], staged: Iterable[int]
) -> tuple[list[Work], list[int]]:
    """``(work to keep, versions to report staged again)`` once ``plan`` is applied: work older
    than the target can no longer be admitted; deltas above the target are staged on top of it."""
    keep = [w for w in queue if w.version >= plan.target]
    restage = sorted(v for v in staged if v > plan.target)
    return keep, restage


def takes_catch_up(plan: CatchUpPlan, *, active: int | None) -> bool:
    """Whether an Actor on ``active`` (None: no weights yet) takes ``plan``: only when its
    target is ahead of the active version."""
    return active is None or plan.target > active
