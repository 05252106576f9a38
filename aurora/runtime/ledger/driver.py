"""Driving the policy core: each event logged, decided at one ``now``, and its actions carried out.

Theory of operation
-------------------
:meth:`LedgerDriver.feed` is the one path every event takes, live: appended to the SQLite log
(with the result payload it carries, if admitted) and committed, decided by the policy core
(:class:`aurora.policy.core.LedgerCore`) at ``now`` (the wall clock, read in one place), then
carried out: sent to the Actor an action names (``Assign``, ``Commit``, ``CatchUp``, ``Route``
...), counted, or recorded. After every event the pacer is polled with that event's time, and
the timers it asks for (the next batch, lease expiries) are set here; when one fires it feeds
the event it stands for. A result that changes nothing is decided but, past a small allowance
per Actor (:data:`QUIET_ROWS`), not logged, so a flood cannot fill the disk. The connections it
sends on, the job and the announced versions belong to the layers above
(:mod:`~aurora.runtime.ledger.durable`, :mod:`~aurora.runtime.ledger.service`).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from aurora.observe.ledger import LedgerMetrics
from aurora.policy.core import LedgerCore
from aurora.policy.events import (
    Accepted,
    Action,
    Assign,
    BatchCompleted,
    CatchUp,
    Commit,
    Event,
    Evicted,
    Exclude,
    Expired,
    FallBack,
    Refused,
    Released,
    ResultVerified,
    Route,
    Tick,
    to_record,
)
from aurora.policy.ledger import LedgerState, changes_nothing
from aurora.policy.membership import TRAINER
from aurora.policy.pacer import Pacer, WakeAt
from aurora.policy.timers import TickTimers
from aurora.runtime.channel import Channel
from aurora.runtime.ledger.config import Job, LedgerServiceConfig
from aurora.runtime.ledger.counts import Counters, LatencyHistogram
from aurora.store.ledgerlog import LedgerLog

log = logging.getLogger("aurora.runtime.ledger")

TICK_SLACK_S = 0.05
"""A lease is checked this long after its expiry (s), so the check never runs just before it."""


QUIET_ROWS = 16
"""Rows of one Actor's results that change nothing (:func:`aurora.policy.ledger.changes_nothing`:
for a lease it does not hold or that has ended, or from an id the Ledger does not know) the log
takes in any case; beyond them, one per :data:`QUIET_ROWS_PER_ADMITTED` of its admitted
results. Past that such results are still decided and answered, not logged. An honest Actor
sends a few (a result re-sent after a reconnect is a DUPLICATE); a flood of them wrote ~1.1 KB
of log each, 2.2 MB/s at the per-connection message rate, without end: now it adds at most a
quarter of the rows the flooder's own admitted work added, plus 16 (~18 KB)."""

QUIET_ROWS_PER_ADMITTED = 4
"""One more logged row of results that change nothing per this many admitted results."""


class LedgerDriver(abc.ABC):
    """Feeds one job's events to the policy core and carries out its actions (module
    docstring). The attributes below are what it reads and changes; the Ledger's
    ``__init__`` sets them all (:class:`~aurora.runtime.ledger.service.LedgerService`)."""

    config: LedgerServiceConfig
    clock: Callable[[], float]
    core: LedgerCore
    state: LedgerState
    log: LedgerLog
    job: Job | None
    finished: bool
    counters: Counters
    channels: dict[str, Channel]
    roles: dict[str, dict[str, Any]]
    trainer: Channel | None
    observers: set[Channel]
    metrics: LedgerMetrics
    timings: dict[str, LatencyHistogram]
    unlogged: int
    _quiet: dict[str, int]
    _admitted: dict[str, int]
    _pacer_timers: list[asyncio.TimerHandle]
    _tick_timers: TickTimers
    _ticks: dict[float, asyncio.TimerHandle]

    @abc.abstractmethod
    def _announced(self, v: int) -> dict[str, Any] | None:
        """What the Trainer announced for version ``v`` (the durable log's)."""

    @property
    def pacer(self) -> Pacer | None:
        """The core's pacer: None until the Trainer registers the job."""
        return self.core.pacer

    @property
    def next_batch(self) -> int:
        return 1 if self.core.pacer is None else self.core.pacer.next_batch

    @property
    def batch_done(self) -> set[int]:
        return set() if self.core.pacer is None else set(self.core.pacer.done)

    # -- events ------------------------------------------------------------------------------

    def feed(
        self,
        event: Event,
        *,
        payload: tuple[str, str, bytes] | None = None,
        now: float | None = None,
    ) -> list[Action]:
        """Log ``event``, decide, carry out the actions, poll the pacer (all at one ``now``:
        the clock, unless the pacer's request was made at ``now``). An event the policy
        refuses as impossible (a ``ValueError``: e.g. a result from an unknown Actor) is
        logged and dropped without changing the state."""
        if now is None:
            now = self.clock()
        record = to_record(event)
        # A result that changes nothing (a lease the sender does not hold or that has ended)
        # is the one thing a peer can send without end, at ~1.1 KB of log a row: past its
        # allowance (QUIET_ROWS), such events are decided but not logged (replay without them
        # reaches the same state) and counted in ``unlogged``.
        logged = True
        if changes_nothing(self.core.state, event):
            who = event.actor  # type: ignore[union-attr]
            n = self._quiet.get(who, 0) + 1
            self._quiet[who] = n  # one entry per identity the job certified
            if n > self._quiet_allowed(who):
                logged = False
                self.unlogged += 1
        t0 = time.perf_counter()
        try:
            actions = self.core.feed(event, now=now)
        except ValueError as exc:
            # Kept for the record as an invalid row (replay skips it: it changed nothing).
            if logged:
                log.warning("ledger: %s refused: %s", type(event).__name__, exc)
                self.log.append(
                    now, "invalid", record, actions=[{"type": "Invalid", "reason": str(exc)[:300]}]
                )
            return []
        t1 = time.perf_counter()
        # The payload is kept only when its result was admitted (plain INSERT: never over an
        # admitted one), in the transaction that logs the event and what was decided.
        admitted = payload is not None and any(type(a) is Accepted for a in actions)
        if logged:
            self.log.append(
                now,
                "policy",
                record,
                payload=payload if admitted else None,
                actions=[to_record(a) for a in actions],
            )
        self.timings["decide"].add(t1 - t0)
        self.timings["log"].add(time.perf_counter() - t1)
        self._after(event, actions, replaying=False)
        self.metrics.after(event, actions, now)
        for action in actions:
            self._carry_out(action, now)
        self._try_request(now)
        return actions

    def _after(self, event: Event, actions: list[Action], *, replaying: bool) -> None:
        """Counting shared by live events and replay (never sends anything but the news of a
        completed batch, live)."""
        for action in actions:
            if isinstance(action, Accepted):
                self.counters.accepted += 1
                self._admitted[action.actor] = self._admitted.get(action.actor, 0) + 1
            elif isinstance(action, BatchCompleted):
                if not replaying:
                    self._tell_trainer({"op": "batch_done", "batch": action.batch})
                    self._tell_observers({"op": "batch_done", "batch": action.batch})
            elif isinstance(action, Refused):
                name = action.reason.name
                self.counters.refused[name] = self.counters.refused.get(name, 0) + 1
            elif isinstance(action, Expired):
                self.counters.expired += 1
            elif isinstance(action, Released):
                self.counters.released += 1
            elif isinstance(action, Evicted):
                self.counters.evicted[action.actor] = action.reason
        if isinstance(event, ResultVerified):
            self.counters.verified += 1

    def _quiet_allowed(self, actor: str) -> int:
        """How many of ``actor``'s results that change nothing the log takes (QUIET_ROWS)."""
        return QUIET_ROWS + self._admitted.get(actor, 0) // QUIET_ROWS_PER_ADMITTED

    def _carry_out(self, action: Action, now: float) -> None:
        if isinstance(action, Assign):
            self._send(
                action.actor,
                {
                    "op": "assign",
                    "version": action.version,
                    "leases": [list(p) for p in zip(action.leases, action.prompts, strict=True)],
                    "expiry_in": max(0.0, action.expiry - now),
                },
            )
            self._schedule_tick(action.expiry)
        elif isinstance(action, Commit):
            self._send(action.actor, {"op": "commit", "version": action.version})
        elif isinstance(action, Exclude):
            self._send(action.actor, {"op": "exclude", "version": action.version})
        elif isinstance(action, CatchUp):
            plan = action.plan
            msg: dict[str, Any] = {
                "op": "catch_up",
                "target": plan.target,
                "snapshot": plan.snapshot,
                "deltas": list(plan.deltas),
            }
            if plan.snapshot is not None:
                # A snapshot's file names its content hash; the chain hash h(v) the deltas after
                # it build on (and leases check) comes from what the Trainer published.
                info = self.state.versions[plan.snapshot]
                msg["snapshot_hash"] = info.weights_hash
                msg["snapshot_digest"] = (self._announced(plan.snapshot) or {}).get("digest")
            self._send(action.actor, msg)
        elif isinstance(action, Route | FallBack):
            self._send_route(action.actor, action.source)
        elif isinstance(action, Evicted):
            # Excluded for good: told to stop, and disconnected (a reconnect's join is refused
            # by the policy, and its results are refused as from an Actor no longer counted).
            why = "refused results" if action.reason == "REFUSED" else "failed verification"
            log.warning("ledger: %s excluded for good (%s: %s)", action.actor, why, action.reason)
            channel = self.channels.pop(action.actor, None)
            if channel is not None:
                channel.send_nowait({"op": "stop"})
                asyncio.get_running_loop().call_later(0.5, channel.close)

    def _send_route(self, actor: str, source: str) -> None:
        self._send(actor, {"op": "route", "source": source, "addr": self._address(source)})

    def _address(self, peer: str) -> str | None:
        if peer == TRAINER:
            return self.job.spec.trainer_data if self.job is not None else None
        hello = self.roles.get(peer)
        return None if hello is None else hello.get("data")

    def _send(self, peer: str, msg: dict[str, Any]) -> None:
        channel = self.channels.get(peer)
        if channel is not None:
            channel.send_nowait(msg)

    def _tell_trainer(self, msg: dict[str, Any]) -> None:
        if self.trainer is not None:
            self.trainer.send_nowait(msg)

    def _tell_observers(self, msg: dict[str, Any]) -> None:
        for obs in list(self.observers):
            obs.send_nowait(msg)

    # -- leases and time ---------------------------------------------------------------------

    def _schedule_tick(self, expiry: float) -> None:
        delay = self._tick_timers.arm(expiry, self.clock())
        if delay is None:
            return

        def tick() -> None:
            self._tick_timers.fired(expiry)
            self._ticks.pop(expiry, None)
            if not self.finished:
                self.feed(Tick())

        self._ticks[expiry] = asyncio.get_running_loop().call_later(delay, tick)

    def _schedule_next_expiry(self) -> None:
        """After a replay: a tick for every lease still live (their timers died with the
        previous process)."""
        with contextlib.suppress(RuntimeError):  # no running loop: replay outside a server
            asyncio.get_running_loop()
            for actor in list(self.state.book.by_actor):
                for lease in self.state.book.live(actor):
                    self._schedule_tick(lease.expiry)

    # -- the orchestrator: when each batch starts --------------------------------------------

    def _try_request(self, now: float | None = None) -> None:
        """Ask the pacer whether to request the next batch (at ``now``, the time of the event
        just decided, or the clock); request it, or set the timer it asks for."""
        if self.job is None or self.finished:
            return
        if now is None:
            now = self.clock()
        got = self.core.poll(now)
        if got is None:
            return
        if isinstance(got, WakeAt):
            pacer = self.core.pacer
            assert pacer is not None

            def wake() -> None:
                pacer.woke(got)
                self._try_request()

            self._pacer_timers.append(
                asyncio.get_running_loop().call_later(max(0.0, got.at - now), wake)
            )
            return
        k = self.next_batch
        self.feed(got, now=now)
        self._tell_observers({"op": "batch_requested", "batch": k, "version": got.version})
