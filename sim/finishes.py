"""Finishes of a cohort's generations, kept beside SimPy's queue instead of in it.

Theory of operation
-------------------
A cohort of 10^4 Actors (:mod:`sim.cohorts`) starts 10^4 generations at one instant, each
ending at its own time; as 10^4 SimPy timeouts they would swell SimPy's event heap. A
:class:`FinishQueue` keeps the pending finishes in sorted lists and puts only the earliest one
into SimPy's queue, with the time and the event id the member's own timeout would have had, then
reports each following finish in the same callback while it is what SimPy would process next.

Invariant: the order in which finishes and all other events are processed, and the clock at
each, are those of one timeout per finish, and SimPy's event count (``Result.events``) is
unchanged (``tests/test_sim_finishes.py`` holds the two to each other, ties included). This reads
and writes ``Environment._queue`` and ``Environment._eid``, as SimPy's own ``schedule`` and
``step`` do; that test fails if a SimPy release changes them."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Hashable
from heapq import heappop, heappush
from itertools import count
from typing import Any

import simpy
from simpy.events import NORMAL

Finish = tuple[float, int, Any]
"""A pending finish: (time, SimPy event id, what to report)."""


def _desc(finish: Finish) -> tuple[float, int]:
    """Sort key of a lane: latest first."""
    return (-finish[0], -finish[1])


class FinishQueue:
    """Pending finishes in SimPy's order (module docstring), kept in lanes: one per cohort,
    each sorted latest first, merged by a small heap of the lanes' first finishes (so a
    cohort's 10^4 finishes are added without re-sorting those of the others).

    How: the cohorts' pending finishes are kept in lists sorted latest first (one per cohort,
    merged by a heap of their first finishes), and only the earliest one is put into SimPy's
    queue, as an event with the time **and the event id** the member's own timeout would have
    had: the id is taken from SimPy's counter when the finish is added (``Environment.schedule``
    takes it the same way, at the same moment), so SimPy orders it among every other event
    exactly as it would the timeout (by time, priority, id). When it fires, the finishes after
    it are reported in the same callback for as long as each is what SimPy would process next
    anyway (it precedes the head of SimPy's queue by (time, priority, id)); the clock is set to
    its time as ``Environment.step`` sets it. The first that does not precede is put into
    SimPy's queue and waits its turn (an event whose finish a drain reported first, found at the
    head of SimPy's queue, is taken out, as ``step`` would pop it to no effect: otherwise it
    would stop every next drain, and nine in ten finishes would wait in the queue after all). A
    report that raises (``StopSimulation`` too) puts the next finish into SimPy's queue before
    the exception leaves, so a run that goes on after it still reports every finish, as it would
    the timeouts.

    ``Environment._queue`` is SimPy's heap of ``(time, priority, id, event)``, and
    ``Environment._eid`` its id counter; neither is documented.
    """

    def __init__(self, env: simpy.Environment, report: Callable[[Any], None]) -> None:
        self.env = env
        self.report = report
        """Called with a finish's payload at its time (``env.now`` is that time)."""
        self.lanes: dict[Hashable, list[Finish]] = {}
        """Finishes not yet reported, by lane, latest first."""
        self._heads: list[tuple[float, int, int, Hashable]] = []
        """A heap of (time, id, entry number, lane) holding each lane's first finish (and,
        lazily, entries that are no longer their lane's first: dropped when they come up).
        The entry number keeps two entries of one finish from comparing their lanes."""
        self._entries = count()
        self.armed: set[tuple[float, int]] = set()
        """(time, id) of the finishes that have an event in SimPy's queue."""
        self._spent: set[tuple[float, int]] = set()
        """Those of them already reported by a drain (their event, still queued, does nothing:
        a drain that finds one at the head of SimPy's queue takes it out, as ``step`` would
        have popped it, so that it does not stop the drain)."""

    @property
    def pending(self) -> int:
        """Finishes not yet reported."""
        return sum(map(len, self.lanes.values()))

    def add(self, delays: list[tuple[float, Any]], lane: Hashable = None) -> None:
        """For each ``(delay, payload)`` in order: report ``payload`` ``delay`` seconds from
        now, where a timeout made now would fire (at ``now + delay``, with the next event id).
        ``lane``: which lane keeps them (any hashable; a cohort)."""
        if any(delay < 0 for delay, _ in delays):  # as env.timeout, before taking any id
            raise ValueError(f"negative delay in {[d for d, _ in delays]!r}")
        env = self.env
        now = env.now
        eids = env._eid
        finishes = [(now + delay, next(eids), payload) for delay, payload in delays]
        if not finishes:
            return
        pending = self.lanes.get(lane)
        old = pending[-1] if pending else None
        if not pending:
            finishes.sort(key=_desc)  # delays are usually given ascending: a reversal
            self.lanes[lane] = pending = finishes
        elif len(finishes) == 1:
            finish = finishes[0]
            pending.insert(bisect_left(pending, _desc(finish), key=_desc), finish)
        else:
            pending.extend(finishes)
            pending.sort(key=_desc)
        head = pending[-1]
        if head is not old:  # the lane's first finish changed: the heap gets an entry for it
            heappush(self._heads, (head[0], head[1], next(self._entries), lane))
        first = self._first()
        assert first is not None
        self._arm(first[0], first[1])

    def _first(self) -> tuple[float, int, int, Hashable] | None:
        """The earliest pending finish's (time, id, lane), or None: the top of the heap once
        entries that are not their lane's first are dropped."""
        heads, lanes = self._heads, self.lanes
        while heads:
            _, eid, _, lane = heads[0]
            pending = lanes.get(lane)
            if pending:
                head = pending[-1]
                if head[1] == eid:
                    return heads[0]
            heappop(heads)
        return None

    def _arm(self, t: float, eid: int) -> None:
        """Put the finish (t, eid) into SimPy's queue with its own time and id (once)."""
        if (t, eid) in self.armed:
            return
        self.armed.add((t, eid))
        ev = simpy.Event(self.env)
        ev._ok, ev._value = True, None  # triggered, as a timeout is when it is made
        ev.callbacks.append(lambda _e: self._fire(t, eid))
        heappush(self.env._queue, (t, NORMAL, eid, ev))

    def _fire(self, t: float, eid: int) -> None:
        """The armed finish (t, eid) is due: report it, and every next one that SimPy would
        process next anyway (module docstring); arm the first that it would not."""
        armed, spent = self.armed, self._spent
        armed.discard((t, eid))
        spent.discard((t, eid))
        env = self.env
        queue = env._queue
        heads, lanes = self._heads, self.lanes
        report = self.report
        while True:
            first = self._first()
            if first is None:
                return
            t, eid, _, lane = first
            while queue:
                qt, qp, qe, _ = queue[0]
                if (qt, qe) in spent and qp == NORMAL:  # the event of a finish reported
                    heappop(queue)
                    spent.discard((qt, qe))
                    armed.discard((qt, qe))
                    continue
                if (qt, qp, qe) < (t, NORMAL, eid):  # SimPy's order: it comes first
                    self._arm(t, eid)  # wait for it
                    return
                break
            heappop(heads)
            if (t, eid) in armed:
                spent.add((t, eid))  # its event is still queued (a drain got here first)
            pending = lanes[lane]
            payload = pending.pop()[2]
            if pending:
                head = pending[-1]
                heappush(heads, (head[0], head[1], next(self._entries), lane))
            env._now = t
            try:
                report(payload)
            except BaseException:
                # A report that raises (StopSimulation too) ends this drain: the next finish
                # goes into SimPy's queue now, as its own timeout is there already, so a run
                # that goes on after the exception still reports it.
                first = self._first()
                if first is not None:
                    self._arm(first[0], first[1])
                raise
