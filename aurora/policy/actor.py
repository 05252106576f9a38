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
  2. the oldest queued work is dropped if it is no longer worth starting
     (:func:`not_worth_starting`: its lease has expired, or would before the Actor could finish
     it at its best recent pace), so an Actor behind its leases never spends a generation on a
     result that can only be refused late while the prompt's next lease waits behind it;
  3. the oldest queued work runs if it is on the active version (:class:`Generate`);
  4. work on ``active + 1`` whose delta is staged first activates that delta (:class:`Activate`):
     the end-of-batch safe point of the paper (§5.2), so no rollout ever sees a partly applied
     policy;
  5. work on any other version cannot run here (its delta is not staged, or it is older than
     the active version): it is dropped (:class:`Drop`) and its leases expire back to the pool,
     where the Ledger re-leases them to Actors that can run them;
  6. a pending ``Commit(active + 1)`` with the delta staged activates it (:class:`Activate`);
  7. otherwise :class:`Wait`.

  The caller carries out the decision (popping the queue on ``Generate`` and ``Drop``) and asks
  again at its next safe point.
* :func:`assigned` - the work of an ``Assign``: only the leases the Actor does not hold already.
  The Ledger re-sends an Actor's live leases when it reconnects (a blip, a restarted Ledger),
  and the Actor may be generating one of them right then: a lease is taken once.
* :func:`least_seconds` - the least time a piece of work can be expected to take, from the
  Actor's recent generations: what decides that work would finish too late (rule 2).
* :func:`to_fetch` - after a ``CatchUp`` plan arrives: which snapshot and deltas the Actor must
  still fetch (those neither held nor already on their way), in the order they are applied.
* :func:`after_catch_up` - once a plan is applied: the work that is still worth keeping (on the
  plan's target or newer) and the deltas staged above the target that must be reported staged
  again, since the Ledger forgets staged versions across a catch-up.
* :func:`takes_catch_up` - whether a ``CatchUp`` plan may be taken at all: only one that moves
  the Actor forwards. A plan to an older (or the same) version would load a signed but stale
  snapshot over newer weights (an injected ``catch_up`` to v0 was loaded by an Actor at v2);
  ``Commit`` cannot move it backwards either, since only ``active + 1`` activates.

Nothing here reads a clock or does I/O: the caller passes ``now`` (seconds, on the clock the
work's expiries are on); versions are plain ints and work items plain tuples.
"""

from __future__ import annotations

from collections.abc import Collection, Container, Iterable, Sequence
from dataclasses import dataclass

from aurora.policy.versions import CatchUpPlan


@dataclass(frozen=True, slots=True)
class Work:
    """Leases handed to this Actor on one version (one ``Assign``)."""

    version: int
    """The version the results must be generated on."""
    leases: tuple[str, ...]
    """Lease ids (one prompt and its group of completions each)."""
    expiry: float | None = None
    """When the leases expire (s, on the caller's clock; one ``Assign`` has one expiry): a
    result after it is refused. None: not known (never dropped for lateness)."""


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
    """``expired`` (its lease has expired), ``late`` (it would expire before the Actor could
    finish it), ``stale`` (older than the active version) or ``unreachable`` (newer, delta not
    staged)."""


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to do until something arrives (work, a delta, a snapshot, a commit)."""


Decision = ApplyPlan | Generate | Activate | Drop | Wait


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
    now: float | None = None,
    recent: Iterable[tuple[int, float]] = (),
) -> Decision:
    """The Actor's next step at a safe point (the order is in the module docstring).

    ``active`` is the active version (None before any weights are loaded), ``staged`` the
    versions whose deltas are held verified, ``queue`` the work in arrival order, ``plan`` the
    catch-up plan in force, ``pending_commit`` the version of an unserved ``Commit`` and
    ``snapshots`` the snapshot versions held verified. ``now`` (None: expiries are not looked
    at) is the time on the clock of the work's expiries, and ``recent`` the Actor's recent
    generations as ``(leases, seconds)`` (:func:`least_seconds`; none: only a lease that has
    expired is dropped).
    """
    if plan is not None and plan_ready(plan, staged=staged, snapshots=snapshots):
        return ApplyPlan(plan)
    if queue:
        work = queue[0]
        if now is not None and work.expiry is not None:
            why = not_worth_starting(work, now=now, recent=recent)
            if why is not None:
                return Drop(work, why)
        if active is not None and work.version == active:
            return Generate(work)
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
    return Wait()


def not_worth_starting(
    work: Work, *, now: float, recent: Iterable[tuple[int, float]] = ()
) -> str | None:
    """Why ``work`` is no longer worth starting at ``now``, or None when it is: ``expired``
    (its lease has expired) or ``late`` (it would take at least :func:`least_seconds`, and its
    results would come after the expiry). Either way its results could only be refused as late;
    dropped, its leases expire back to the pool, the Ledger lengthens this Actor's next leases
    (:mod:`aurora.policy.leases`), and the Actor is free when they come."""
    expiry = work.expiry
    if expiry is None:
        return None
    if now >= expiry:
        return "expired"
    if recent and now + least_seconds(len(work.leases), recent) >= expiry:
        return "late"
    return None


def least_seconds(leases: int, recent: Iterable[tuple[int, float]]) -> float:
    """The least time (s) work of ``leases`` leases can be expected to take: the shortest of the
    Actor's ``recent`` generations (``(leases, seconds)`` each) of no more leases, since more
    leases never take less time; 0.0 when there is none. The shortest and never scaled up, so
    that work is dropped as ``late`` only when even the Actor's best comparable pace misses the
    expiry (an engine that batches runs 16 leases in about the time of one)."""
    best = 0.0
    for count, seconds in recent:
        if count <= leases and seconds > 0 and (best == 0.0 or seconds < best):
            best = seconds
    return best


def assigned(
    version: int, leases: Iterable[str], expiry: float | None, *, held: Container[str]
) -> Work | None:
    """The work an ``Assign`` of ``leases`` on ``version`` gives an Actor that already holds
    ``held`` (queued, being generated, or generated): only the leases it does not hold, None if
    none is new. The Ledger re-sends every live lease to an Actor that reconnects, some of them
    possibly in the middle of their generation; each lease is generated once."""
    new = tuple(lease for lease in dict.fromkeys(leases) if lease not in held)
    return Work(version, new, expiry) if new else None


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
