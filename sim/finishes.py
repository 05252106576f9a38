"""Finishes of a cohort's generations, kept beside SimPy's queue instead of in it.

Theory of operation
-------------------
A cohort of 10^4 Actors (:mod:`sim.cohorts`) starts 10^4 generations at one instant, each
ending at its own time (every member draws its own throughput noise). As 10^4 SimPy timeouts
they sit in SimPy's event heap, which then holds ~10^5 entries at 10^5 Actors: each push and
pop walks ~17 levels of tuples scattered in memory (~3 us a member per step at 10^5 Actors).

A :class:`FinishQueue` keeps a cohort's pending finishes in a list sorted latest first, and
puts only the earliest one into SimPy's queue, as an event with the time **and the event id**
the member's own timeout would have had: the id is taken from SimPy's counter when the finish
is added (``Environment.schedule`` takes it the same way, at the same moment), so SimPy orders
it among every other event exactly as it would the timeout (by time, priority, id). When it
fires, the finishes after it are reported in the same callback for as long as each is what
SimPy would process next anyway (it precedes the head of SimPy's queue by (time, priority,
id)); the clock is set to its time as ``Environment.step`` sets it. The first that does not
precede is put into SimPy's queue and waits its turn. So the order in which finishes and all
other events are processed, and the clock at each, are those of one timeout per finish
(``tests/test_sim_finishes.py`` holds the two to each other, ties included), and SimPy's
event count (``Result.events``) is unchanged.

This reads and writes two attributes SimPy does not document (``Environment._queue``, the
heap of ``(time, priority, id, event)``, and ``Environment._eid``, its id counter), as its own
``schedule`` and ``step`` do; the test above fails if a SimPy release changes them.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from heapq import heappush
from typing import Any

import simpy
from simpy.events import NORMAL

Finish = tuple[float, int, Any]
"""A pending finish: (time, SimPy event id, what to report)."""


def _desc(finish: Finish) -> tuple[float, int]:
    """Sort key of :attr:`FinishQueue.pending`: latest first."""
    return (-finish[0], -finish[1])


class FinishQueue:
    """Pending finishes of one cohort in SimPy's order (module docstring)."""

    def __init__(self, env: simpy.Environment, report: Callable[[Any], None]) -> None:
        self.env = env
        self.report = report
        """Called with a finish's payload at its time (``env.now`` is that time)."""
        self.pending: list[Finish] = []
        """Finishes not yet reported, latest first."""
        self.armed: set[tuple[float, int]] = set()
        """(time, id) of the pending finishes that have an event in SimPy's queue."""

    def add(self, delays: list[tuple[float, Any]]) -> None:
        """For each ``(delay, payload)`` in order: report ``payload`` ``delay`` seconds from
        now, where a timeout made now would fire (at ``now + delay``, with the next event id)."""
        env = self.env
        now = env.now
        eids = env._eid
        finishes = [(now + delay, next(eids), payload) for delay, payload in delays]
        if not finishes:
            return
        pending = self.pending
        if not pending:
            finishes.sort(key=_desc)  # delays are usually given ascending: a reversal
            self.pending = finishes
        elif len(finishes) == 1:
            finish = finishes[0]
            pending.insert(bisect_left(pending, _desc(finish), key=_desc), finish)
        else:
            pending.extend(finishes)
            pending.sort(key=_desc)
        self._arm(self.pending[-1])

    def _arm(self, finish: Finish) -> None:
        """Put ``finish`` into SimPy's queue with its own time and id (once)."""
        t, eid = finish[0], finish[1]
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
        self.armed.discard((t, eid))
        env = self.env
        queue = env._queue
        report = self.report
        while True:
            pending = self.pending  # (a report may add finishes: add() can replace the list)
            if not pending:
                return
            t, eid, payload = pending[-1]
            if queue:
                qt, qp, qe, _ = queue[0]
                if qt < t or (qt == t and (qp < NORMAL or (qp == NORMAL and qe < eid))):
                    self._arm(pending[-1])  # something comes first: wait for it
                    return
            pending.pop()
            env._now = t
            report(payload)
