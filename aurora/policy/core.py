"""The Job Ledger's whole decision: ``decide``, the pacer and the staged-report buffer as one
object that both drivers hold.

Theory of operation
-------------------
:class:`LedgerCore` is what the simulator's :mod:`sim.ledger_driver` and the runtime's Ledger
service each keep instead of rules of their own. :meth:`LedgerCore.feed` decides one event at
``now``: a ``BatchRequested`` is checked against the pacer before ``decide`` sees it and recorded
by it after; ``decide``'s actions come back with a
:class:`~aurora.policy.events.BatchCompleted` right after the ``Accepted`` that completed a batch
(so completion is in every recorded trace, and a replay checks it); a ``DeltaPublished`` lets
the pacer forget the batches trained into it. :meth:`LedgerCore.poll` asks the pacer whether to
request the next batch, :meth:`LedgerCore.check_fraction` what share of an Actor's admitted
results the Trainer recomputes before it trains on them (:mod:`aurora.policy.verification`),
:meth:`LedgerCore.staged` and :meth:`LedgerCore.early` pass an Actor's staged report through
:class:`~aurora.policy.reports.StagedReports`. The drivers own the clock, the timers and the
messages; they choose when to poll, never what the answer is.

Without a pacer (``pacing=None``: the golden scenario, a Ledger whose Trainer has not yet
registered the job) it is ``decide`` alone. Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

from aurora.policy.events import (
    Accepted,
    Action,
    BatchCompleted,
    BatchRequested,
    DeltaPublished,
    DeltaStaged,
    Event,
    ResultArrived,
    ResultsArrived,
)
from aurora.policy.ledger import LedgerConfig, LedgerState, decide, initial_state
from aurora.policy.pacer import Pacer, PacerConfig, WakeAt
from aurora.policy.reports import StagedReports


class LedgerCore:
    """``decide`` + :class:`~aurora.policy.pacer.Pacer` + staged reports (module docstring)."""

    def __init__(self, config: LedgerConfig, pacing: PacerConfig | None = None) -> None:
        self.state: LedgerState = initial_state(config)
        self.pacer: Pacer | None = None if pacing is None else Pacer(pacing)
        self.reports = StagedReports()

    def start_pacing(self, pacing: PacerConfig) -> Pacer:
        """Start pacing batches (the runtime: when the Trainer registers the job)."""
        if self.pacer is not None:
            raise ValueError("the core already paces batches")
        self.pacer = Pacer(pacing)
        return self.pacer

    def feed(self, event: Event, *, now: float) -> list[Action]:
        """Decide ``event`` at ``now`` (s). A ``ValueError`` leaves everything unchanged."""
        pacer = self.pacer
        if pacer is None:
            return decide(self.state, event, now=now)[1]
        if isinstance(event, BatchRequested):
            pacer.check_request(event)
        actions = decide(self.state, event, now=now)[1]
        if isinstance(event, ResultArrived | ResultsArrived):
            accepted = [a for a in actions if isinstance(a, Accepted)]
            completed = pacer.settle(accepted, now)
            if completed:
                return self._completed(actions, accepted, completed, now)
        elif isinstance(event, BatchRequested):
            pacer.requested(event)
        elif isinstance(event, DeltaPublished):
            pacer.published(event.version)
            pacer.observe(self.state, now)  # a version the next batch may use
        return actions

    def _completed(
        self,
        actions: list[Action],
        accepted: list[Accepted],
        completed: list[tuple[int, int]],
        now: float,
    ) -> list[Action]:
        """``actions`` of a result event at ``now``, whose ``accepted`` (those of them that are
        ``Accepted``, in order) completed batches (:meth:`Pacer.settle`'s ``completed``): with
        a ``BatchCompleted`` after each one that completed its batch."""
        pacer = self.pacer
        assert pacer is not None
        pacer.observe(self.state, now)  # the batch before the next one complete
        # Each BatchCompleted right after the Accepted that completed its batch.
        after = {id(accepted[i]): k for i, k in completed}
        out: list[Action] = []
        for a in actions:
            out.append(a)
            k = after.get(id(a))
            if k is not None:
                out.append(BatchCompleted(batch=k))
        return out

    def poll(self, now: float) -> BatchRequested | WakeAt | None:
        """Request the next batch at ``now``? (None without a pacer.)"""
        return None if self.pacer is None else self.pacer.poll(self.state, now)

    def check_fraction(self, actor: str) -> float | None:
        """The fraction of ``actor``'s admitted results the Trainer recomputes before it trains
        on them, or None: drop them, its Actor is excluded (:mod:`aurora.policy.verification`;
        the Trainer's keyed coin picks which)."""
        return self.state.check_fraction(actor)

    def staged(self, actor: str, version: int) -> DeltaStaged | None:
        """``actor`` reports D_``version`` staged: the event to feed now, or None."""
        return self.reports.staged(self.state, actor, version)

    def early(self, version: int) -> list[DeltaStaged]:
        """After ``DeltaPublished(version)``: the staged reports that waited for it."""
        return self.reports.published(self.state, version)
