"""When to request the next batch, and on which version (the Trainer's side of algorithm 1).

Theory of operation
-------------------
One-step asynchronous RL: the Actors generate batch ``k`` on an older policy while the Trainer
trains on batch ``k-1``. With a lag bound ``ell`` (``LedgerConfig.max_lag``; 1 for AuroraRL),
batch ``k`` may be generated on any version ``w`` with ``k-1-ell <= w <= latest``: the Trainer
must have published ``k-1-ell`` before batch ``k`` can start. Within that range the batch goes to
the newest version every current Actor already holds (active, or staged on the one before), so a
dense broadcast still in flight does not hold work back when the bound allows older weights
(PrimeRL-Async2/4), nor does a version the Trainer published while the previous one was still
on its way.

A batch requested the instant a version is published would find every Actor still receiving it:
the version predicate would exclude them all and the first Actor to finish staging would take the
whole batch. So the request waits until every Actor one version behind has staged ``w``, or until
``grace_s`` has passed since the batch could first have started; Actors that are later than that
are excluded for this step, as the paper's predicate says, and catch up. AuroraRL stages during
generation, so normally nobody is waited for; a dense baseline waits for its broadcast (grace is
infinite for PrimeRL, whose orchestrator waits for the weights).
"""

from __future__ import annotations

from aurora.policy.ledger import LedgerState


def lowest_allowed(step: int, max_lag: int) -> int:
    """Oldest version batch ``step`` (1-based) may be generated on."""
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    return max(0, step - 1 - max_lag)


def _held(active: int, staged: list[int]) -> int:
    """Newest version reachable by activating staged deltas in order from ``active``."""
    held = active
    for v in sorted(staged):
        if v == held + 1:
            held = v
    return held


def batch_version(state: LedgerState, step: int) -> int | None:
    """Version for batch ``step``, or None while the Trainer has not published one allowed."""
    lag = state.config.max_lag
    lowest = lowest_allowed(step, lag)
    latest = state.latest
    if latest is None or latest < lowest:
        return None
    floor = max(lowest, latest - lag)
    held = [
        _held(rec.versions.active, rec.versions.staged_versions())
        for rec in state.actors.values()
        if rec.schedulable and rec.versions.active is not None and rec.versions.active >= lowest - 1
    ]
    newest_all_hold = min(held) if held else latest
    return min(max(newest_all_hold, floor), latest)


def waiting_on(state: LedgerState, version: int) -> list[str]:
    """Schedulable Actors one version behind ``version`` that have not staged it yet."""
    return sorted(
        rec.id
        for rec in state.actors.values()
        if rec.schedulable
        and rec.versions.active == version - 1
        and version not in rec.versions.staged_versions()
    )


def request_at(*, ready_since: float, waiting: list[str], grace_s: float, now: float) -> bool:
    """Request now? Yes when nobody is waited for, or the grace period has run out."""
    if grace_s < 0:
        raise ValueError(f"grace_s must be >= 0, got {grace_s}")
    return not waiting or now >= ready_since + grace_s
