"""FinishQueue (sim/finishes.py) against plain SimPy timeouts: the same callbacks in the same
order at the same times, ties included, and the same number of SimPy event ids."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st
from simpy.core import StopSimulation
from simpy.events import URGENT

from sim.finishes import FinishQueue

# An op, run when its parent fires: ("timeout" | "urgent", delay, label, children) makes one
# other event; ("finish", lane, [(delay, label, children), ...]) adds finishes to one lane of
# the queue at once.
DELAYS = st.sampled_from([0.0, 0.5, 1.0, 1.0, 1.5, 2.0])  # few values: many exact ties


def _ops(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    event = st.tuples(st.sampled_from(["timeout", "urgent"]), DELAYS, st.integers(0, 99), children)
    finish = st.tuples(
        st.just("finish"),
        st.sampled_from(["x", "y", "z"]),
        st.lists(st.tuples(DELAYS, st.integers(0, 99), children), max_size=4),
    )
    return st.lists(st.one_of(event, finish), max_size=4)


PROGRAMS = st.recursive(st.just([]), _ops, max_leaves=30)


def run(program: list[Any], queued: bool) -> tuple[list[tuple[str, float]], int]:
    """Run ``program`` from time 0; finishes through a FinishQueue (``queued``) or as one
    timeout each. Returns the callbacks in order with their times, and the ids used."""
    env = simpy.Environment()
    log: list[tuple[str, float]] = []

    def fired(label: str, children: list[Any]) -> None:
        log.append((label, env.now))
        start(children)

    queue = FinishQueue(env, lambda payload: fired(*payload))

    def start(ops: list[Any]) -> None:
        for op in ops:
            if op[0] == "finish":
                entries = [(d, (f"f{op[1]}{label}", kids)) for d, label, kids in op[2]]
                if queued:
                    queue.add(entries, op[1])
                else:
                    for d, payload in entries:
                        env.timeout(d).callbacks.append(lambda _e, p=payload: fired(*p))
                continue
            kind, delay, label, kids = op
            if kind == "timeout":
                ev: simpy.Event = env.timeout(delay)
            else:  # an URGENT event now (a process woken at once, as the cohorts' kicks)
                ev = env.event()
                ev._ok, ev._value = True, None
                env.schedule(ev, URGENT)
            ev.callbacks.append(lambda _e, n=f"{kind[0]}{label}", k=kids: fired(n, k))

    start(program)
    env.run()
    return log, next(env._eid)


@settings(max_examples=300, deadline=None)
@given(PROGRAMS)
def test_finishes_fire_in_the_order_and_at_the_times_of_one_timeout_each(program):
    assert run(program, queued=True) == run(program, queued=False)


def test_a_finish_added_before_the_next_pending_one_is_reported_first():
    env = simpy.Environment()
    got: list[tuple[str, float]] = []
    queue = FinishQueue(env, lambda label: got.append((label, env.now)))
    queue.add([(1.0, "a"), (3.0, "c")])
    env.timeout(0.5).callbacks.append(lambda _e: queue.add([(1.0, "b")]))  # due at 1.5
    env.timeout(2.0).callbacks.append(lambda _e: got.append(("other", env.now)))
    env.run()
    assert got == [("a", 1.0), ("b", 1.5), ("other", 2.0), ("c", 3.0)]
    assert queue.pending == 0 and queue.armed == set()


def test_only_the_next_finish_waits_in_simpys_queue():
    env = simpy.Environment()
    queue = FinishQueue(env, lambda label: None)
    queue.add([(float(i), i) for i in range(1, 1001)])
    assert len(env._queue) == 1 and queue.pending == 1000
    env.run()
    assert env.now == 1000.0 and queue.pending == 0


def test_finishes_of_interleaved_lanes_are_reported_in_one_callback():
    env = simpy.Environment()
    got: list[tuple[str, float]] = []
    queue = FinishQueue(env, lambda label: got.append((label, env.now)))
    queue.add([(1.0, "a1"), (3.0, "a3")], "a")
    queue.add([(2.0, "b2"), (4.0, "b4")], "b")
    assert len(env._queue) == 1  # only the first, a1
    env.step()  # one SimPy event: every finish, nothing else being due
    assert got == [("a1", 1.0), ("b2", 2.0), ("a3", 3.0), ("b4", 4.0)]
    assert queue.pending == 0 and not env._queue


def test_the_event_of_a_finish_a_drain_reported_does_not_stop_the_next_drain():
    env = simpy.Environment()
    got: list[str] = []
    queue = FinishQueue(env, got.append)
    queue.add([(2.0, "a2"), (4.0, "a4")], "a")  # a2 is armed
    queue.add([(1.0, "b1"), (3.0, "b3")], "b")  # b1 comes first: armed too
    assert len(env._queue) == 2
    env.step()  # b1's event: b1, then a2 (reported before its own event fires), b3, a4
    assert got == ["b1", "a2", "b3", "a4"]
    assert not env._queue and queue.armed == set() and queue.pending == 0


@pytest.mark.parametrize("error", [RuntimeError, StopSimulation])
def test_finishes_after_a_report_that_raised_are_still_reported_when_the_run_goes_on(error):
    def run(queued: bool) -> tuple[list[tuple[str, float]], int]:
        env = simpy.Environment()
        got: list[tuple[str, float]] = []

        def report(label: str) -> None:
            got.append((label, env.now))
            if label == "a":
                raise error("stop")

        if queued:
            FinishQueue(env, report).add([(1.0, "a"), (2.0, "b")])
        else:
            for delay, label in [(1.0, "a"), (2.0, "b")]:
                env.timeout(delay).callbacks.append(lambda _e, x=label: report(x))
        with pytest.raises(error) if error is RuntimeError else nullcontext():
            env.run()
        env.run()
        return got, next(env._eid)

    queued, plain = run(queued=True), run(queued=False)
    assert queued == plain and queued[0] == [("a", 1.0), ("b", 2.0)]


def test_a_negative_delay_is_refused_before_any_event_id_is_taken():
    env = simpy.Environment()
    queue = FinishQueue(env, lambda label: None)
    with pytest.raises(ValueError, match="negative delay"):
        queue.add([(1.0, "a"), (-1.0, "b")])
    assert next(env._eid) == 0 and queue.pending == 0
