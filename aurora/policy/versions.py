"""The version predicate and the catch-up planner (paper, "Version-aware scheduling",
"Version-predicate join and delta catch-up").

Theory of operation
-------------------
Rollouts for step ``target`` must be generated on policy version ``target`` (one-step async: the
Trainer computes ``target+1`` meanwhile). An Actor is

* **eligible** when its active version is ``target``;
* **needs commit** when it is active on ``target-1`` and has ``D_target`` staged (downloaded and
  verified): it receives ``Commit(target)``, activates at its end-of-batch safe point, then works;
* **excluded** otherwise (no weights yet, more than one version behind, or on ``target-1``
  without the delta).

An excluded Actor catches up by replaying missed deltas, or, when fewer bytes, a full snapshot
plus the tail of the chain. :func:`plan_catch_up` picks the cheapest plan in bytes, given what
the Checkpoint Store still holds (retention may have pruned old deltas).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum


class Eligibility(Enum):
    """Outcome of the version predicate for one Actor and one target version."""

    ELIGIBLE = "eligible"
    """Already active on the target version."""
    NEEDS_COMMIT = "needs_commit"
    """Active on target-1 with D_target staged: send Commit(target) before dispatch."""
    EXCLUDED = "excluded"
    """Anything else: no work this step."""


def _check_version(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int version, got {value!r}")


def eligibility(
    active: int | None, staged: int | None, target: int, latest: int | None = None
) -> Eligibility:
    """The version predicate: may an Actor on ``active`` (None: no weights loaded yet), whose
    next staged delta is ``staged`` (None: none), work on ``target``?

    With a lag bound above one, a batch's target can trail the latest version; an Actor that
    already holds a newer published version (``target < active <= latest``, e.g. after catching
    up) is eligible and generates on its own version, which is fresher and so within the bound.
    The versions are the Ledger's own, each checked when the event that brought it was decided.
    """
    if active is None:
        return Eligibility.EXCLUDED
    if active == target or (latest is not None and target < active <= latest):
        return Eligibility.ELIGIBLE
    if active == target - 1 and staged == target:
        return Eligibility.NEEDS_COMMIT
    return Eligibility.EXCLUDED


@dataclass(frozen=True, kw_only=True)
class CatchUpPlan:
    """How an Actor gets from its active version to ``target``."""

    target: int
    """The version the Actor is active on after the plan."""
    snapshot: int | None
    """Snapshot version to load first, or None to replay from the active version."""
    deltas: tuple[int, ...]
    """Versions whose deltas are applied in order after the snapshot (or the active version)."""
    bytes: int
    """Total bytes to fetch (snapshot plus deltas)."""


def plan_catch_up(
    active: int | None,
    latest: int,
    delta_bytes: Mapping[int, int],
    snapshots: Mapping[int, int],
) -> CatchUpPlan:
    """Cheapest way (in bytes) from ``active`` (None: nothing loaded) to ``latest``.

    ``delta_bytes[v]`` is the size of D_v (from v-1 to v) for every delta the store still holds;
    ``snapshots[s]`` the size of the snapshot of version s. Candidates are the replay
    ``D_{active+1..latest}`` and every ``snapshot s + D_{s+1..latest}`` whose chain is complete.
    Ties go to fewer fetched artifacts, then to replay, then to the newest snapshot. Raises
    ``ValueError`` when ``active > latest`` or no complete chain exists.
    """
    _check_version("latest", latest)
    if active is not None:
        _check_version("active", active)
        if active > latest:
            raise ValueError(f"active version {active} is ahead of latest {latest}")
        if active == latest:
            return CatchUpPlan(target=latest, snapshot=None, deltas=(), bytes=0)
    for name, table in (("delta_bytes", delta_bytes), ("snapshots", snapshots)):
        for v, size in table.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ValueError(f"{name}[{v}] must be a non-negative int size, got {size!r}")

    def chain(start: int) -> tuple[tuple[int, ...], int] | None:
        versions = tuple(range(start + 1, latest + 1))
        if any(v not in delta_bytes for v in versions):
            return None
        return versions, sum(delta_bytes[v] for v in versions)

    # (bytes, artifacts, kind, -snapshot) orders candidates; kind 0 = replay, 1 = snapshot.
    best: tuple[tuple[int, int, int, int], CatchUpPlan] | None = None
    if active is not None and (tail := chain(active)) is not None:
        versions, size = tail
        plan = CatchUpPlan(target=latest, snapshot=None, deltas=versions, bytes=size)
        best = ((size, len(versions), 0, 0), plan)
    for s, snap_size in snapshots.items():
        if s > latest or (active is not None and s <= active):
            continue
        if (tail := chain(s)) is None:
            continue
        versions, size = tail
        plan = CatchUpPlan(target=latest, snapshot=s, deltas=versions, bytes=snap_size + size)
        key = (plan.bytes, 1 + len(versions), 1, -s)
        if best is None or key < best[0]:
            best = (key, plan)
    if best is None:
        raise ValueError(
            f"no complete chain to version {latest} from active={active} "
            f"(deltas held: {sorted(delta_bytes)}, snapshots held: {sorted(snapshots)})"
        )
    return best[1]
