"""``ResultsArrived`` (a whole assignment's results at one instant, the simulator's fast path)
decides exactly as one ``ResultArrived`` per lease, and the simulator's outputs do not depend on
which of the two it feeds."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aurora.faults import Fault
from aurora.policy.events import (
    ActorJoined,
    Assign,
    BatchRequested,
    DeltaPublished,
    DeltaStaged,
    ResultArrived,
    ResultsArrived,
    event_from_record,
    to_record,
)
from aurora.policy.ledger import LedgerConfig, decide, initial_state
from aurora.topology import load_topology
from aurora.traces import load_traces
from sim.config import SimConfig, strategy
from sim.model import simulate

GEO = Path(__file__).resolve().parent.parent / "examples" / "geo.yaml"


def _ledger():  # type: ignore[no-untyped-def]
    """a1, a2 on v1 and a3 still on v0 (its share is held for it): 12 prompts of batch v1."""
    s = initial_state(LedgerConfig(trainer_region="us"))
    decide(
        s, DeltaPublished(version=0, weights_hash="h0", delta_bytes=None, snapshot_bytes=9), now=0
    )
    for actor in ("a1", "a2", "a3"):
        decide(s, ActorJoined(actor=actor, region="us", active=0), now=0)
    decide(s, DeltaPublished(version=1, weights_hash="h1", delta_bytes=9), now=0)
    for actor in ("a1", "a2"):
        decide(s, DeltaStaged(actor=actor, version=1), now=0)
    _, out = decide(s, BatchRequested(version=1, prompts=tuple(f"p{i}" for i in range(12))), now=0)
    return s, {a.actor: a.leases for a in out if isinstance(a, Assign)}


# What one result of a1 may be: its own lease (sound or spoiled), another's, an unknown one.
_results = st.lists(
    st.tuples(
        st.sampled_from(["L1", "L2", "L3", "L4", "L5", "L6", "L9", "L99"]),
        st.sampled_from([(1, "h1"), (1, "h1"), (1, "h1"), (0, "h1"), (1, "hX")]),
    ),
    max_size=10,
)


@settings(max_examples=60, deadline=None)
@given(results=_results, now=st.sampled_from([1.0, 2.0, 700.0]))
def test_results_arrived_decides_as_its_results_one_by_one_concatenated(results, now):
    batched, leases = _ledger()
    assert leases["a1"]  # a1 holds leases; the pool holds a3's share
    single = copy.deepcopy(batched)
    one_by_one = []
    for lease, (v, h) in results:
        ev = ResultArrived(actor="a1", lease=lease, version=v, weights_hash=h)
        one_by_one += decide(single, ev, now=now)[1]
    # One version and hash for the batch: split the draw by (version, hash) runs.
    together = []
    i = 0
    while i < len(results):
        v, h = results[i][1]
        j = i
        while j < len(results) and results[j][1] == (v, h):
            j += 1
        ev2 = ResultsArrived(
            actor="a1", leases=tuple(r[0] for r in results[i:j]), version=v, weights_hash=h
        )
        together += decide(batched, ev2, now=now)[1]
        i = j
    assert together == one_by_one
    assert batched == single  # the same state, lease book included
    batched.book.check()


def test_all_results_of_an_assignment_at_once_settle_it_and_dispatch_the_held_share_after():
    s, leases = _ledger()
    single = copy.deepcopy(s)
    ev = ResultsArrived(actor="a1", leases=leases["a1"], version=1, weights_hash="h1")
    together = decide(s, ev, now=5.0)[1]
    one_by_one = [
        a
        for lease in leases["a1"]
        for a in decide(
            single, ResultArrived(actor="a1", lease=lease, version=1, weights_hash="h1"), now=5.0
        )[1]
    ]
    assert together == one_by_one
    assert isinstance(together[-1], Assign)  # idle a1 took more of the pool, after its last result


def test_results_from_an_unknown_actor_raise_and_change_nothing():
    s, leases = _ledger()
    before = copy.deepcopy(s)
    with pytest.raises(ValueError, match="unknown Actor id 'ghost'"):
        decide(
            s, ResultsArrived(actor="ghost", leases=("L1",), version=1, weights_hash="h1"), now=1
        )
    assert s == before


def test_results_arrived_round_trips_through_its_record():
    ev = ResultsArrived(actor="a1", leases=("L1", "L2"), version=3, weights_hash="h3")
    assert event_from_record(to_record(ev)) == ev


@pytest.mark.parametrize(
    "faults",
    [(), (Fault(kind="preempt", target="ca-a100-3", at_step=3),)],
    ids=["plain", "preempt"],
)
def test_a_run_without_its_trace_feeds_results_per_assignment_and_gives_the_same_steps(faults):
    cfg = SimConfig(
        topology=load_topology(GEO),
        traces=load_traces(),
        strategy=strategy("aurora"),
        steps=6,
        faults=faults,
    )
    recorded = simulate(cfg)  # one ResultArrived per lease (the trace lists them)
    fast = simulate(replace(cfg, record_trace=False))  # one ResultsArrived per assignment
    assert any(type(ev) is ResultArrived for _, ev in recorded.fed)
    assert fast.rows == recorded.rows
    assert (fast.events, fast.sim_time) == (recorded.events, recorded.sim_time)
