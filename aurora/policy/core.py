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

from collections.abc import Sequence

from aurora.policy.events import (
    Accepted,
    Action,
    BatchCompleted,
    BatchRequested,
    CaughtUp,
    DeltaPublished,
    DeltaStaged,
    Event,
    ResultArrived,
    ResultsArrived,
    ThroughputObserved,
    VersionActivated,
)
from aurora.policy.ledger import LedgerConfig, LedgerState, decide, decide_each, initial_state
from aurora.policy.pacer import Pacer, PacerConfig, WakeAt
from aurora.policy.reports import StagedReports

_RESULTS = (ResultArrived, ResultsArrived)
"""The events whose actions may admit a result (the only way a batch completes)."""
_UNPACED = frozenset((DeltaStaged, VersionActivated, CaughtUp, ThroughputObserved))
"""Events :meth:`LedgerCore.feed` passes to ``decide`` and back with nothing of the pacer's
(neither a request, a publication nor a result): :meth:`LedgerCore.feed_each` decides their
runs with :func:`~aurora.policy.ledger.decide_each`."""


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
        kind = type(event)
        if pacer is None:
            return decide(self.state, event, now=now)[1]
        if kind in _RESULTS:  # first: one or two per Actor per step
            actions = decide(self.state, event, now=now)[1]
            if len(actions) == 1 and type(actions[0]) is Accepted:
                accepted: list[Accepted] = actions  # type: ignore[assignment]
                # (the usual answer: the one result admitted)
            else:
                accepted = [a for a in actions if type(a) is Accepted]
                if not accepted:
                    return actions
            completed = pacer.settle(accepted, now)
            return self._completed(actions, accepted, completed, now) if completed else actions
        if kind is BatchRequested:
            pacer.check_request(event)  # type: ignore[arg-type]
        actions = decide(self.state, event, now=now)[1]
        if kind is BatchRequested:
            pacer.requested(event)  # type: ignore[arg-type]
            return actions
        if kind is DeltaPublished:
            pacer.published(event.version)  # type: ignore[union-attr]
            pacer.observe(self.state, now)  # a version the next batch may use
        return actions  # only a result is admitted (Accepted)

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

    def feed_each(self, events: Sequence[Event], *, now: float) -> list[list[Action]]:
        """:meth:`feed` for each of ``events`` in order at ``now``: the same state and actions
        as those calls one after another. Reports the pacer does not see (``DeltaStaged``,
        ``VersionActivated``, ``CaughtUp``, ``ThroughputObserved``: :meth:`feed` returns what
        ``decide`` returns for them) are decided by :func:`~aurora.policy.ledger.decide_each`
        in runs; any other event goes through :meth:`feed`. For many Actors' reports at one
        instant (the simulator's cohorts: 10^5 Actors stage and activate each version)."""
        out: list[list[Action]] = []
        run: list[Event] = []
        for event in events:
            if type(event) in _UNPACED:
                run.append(event)
                continue
            if run:
                out.extend(decide_each(self.state, run, now=now))
                run = []
            out.append(self.feed(event, now=now))
        if run:
            out.extend(decide_each(self.state, run, now=now))
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
