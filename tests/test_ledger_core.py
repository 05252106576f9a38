"""The Ledger's whole decision, as both drivers hold it: the pacer (when each batch starts, the
start barrier, completion), staged reports that precede their version, hello classification,
lease-expiry ticks, and their composition with ``decide`` (exact traces)."""

import math

import pytest

from aurora.policy.core import LedgerCore
from aurora.policy.events import (
    Accepted,
    ActorJoined,
    ActorLost,
    Assign,
    BatchCompleted,
    BatchRequested,
    CaughtUp,
    DeltaPublished,
    DeltaStaged,
    ResultArrived,
)
from aurora.policy.ledger import LedgerConfig
from aurora.policy.membership import TRAINER, fetch_order
from aurora.policy.pacer import Pacer, PacerConfig, WakeAt
from aurora.policy.reports import classify_hello
from aurora.policy.timers import TickTimers


def core(*, actors=("a", "b"), prompts=4, steps=3, grace=10.0, start_actors=0, wait=math.inf):
    c = LedgerCore(
        LedgerConfig(trainer_region="us"),
        PacerConfig(
            steps=steps,
            prompts_per_batch=prompts,
            staging_grace_s=grace,
            prompt_prefix="b",
            start_actors=start_actors,
            start_wait_s=wait,
        ),
    )
    c.feed(DeltaPublished(version=0, weights_hash="h0", delta_bytes=None, snapshot_bytes=9), now=0)
    for a in actors:
        c.feed(ActorJoined(actor=a, region="us", active=0), now=0)
    return c


def answer(c, actions):
    """Return every Assign's results at once; the kinds of what came back."""
    out = []
    for act in actions:
        if isinstance(act, Assign):
            for lease in act.leases:
                got = c.feed(
                    ResultArrived(
                        actor=act.actor, lease=lease, version=act.version, weights_hash="h0"
                    ),
                    now=5,
                )
                out += [type(x).__name__ for x in got]
    return out


def test_the_pacer_requests_batch_one_then_completes_it_with_the_last_admitted_result():
    c = core()
    req = c.poll(1.0)
    assert req == BatchRequested(version=0, prompts=("b1-0", "b1-1", "b1-2", "b1-3"))
    actions = c.feed(req, now=1.0)
    assert c.pacer.next_batch == 2 and c.pacer.target == {1: 0}
    assert c.poll(1.0) is None  # batch 1 is not complete
    kinds = answer(c, actions)
    assert kinds == ["Accepted"] * 3 + ["Accepted", "BatchCompleted"]
    assert c.pacer.done == {1: 5} and len(c.pacer.results[1]) == 4
    # Batch 2 may use v0 too (lag 1): requested at once.
    assert c.poll(5.0) == BatchRequested(version=0, prompts=tuple(f"b2-{i}" for i in range(4)))


def test_a_batch_waits_for_stagers_until_the_grace_runs_out_from_when_it_became_ready():
    c = core(steps=5)
    answer(c, c.feed(c.poll(1.0), now=1.0))  # batch 1 done at 5
    answer(c, c.feed(c.poll(5.0), now=5.0))  # batch 2 (v0) done at 5
    assert c.poll(5.0) is None  # batch 3 needs v1
    c.feed(DeltaPublished(version=1, weights_hash="h1", delta_bytes=3), now=7.0)
    assert c.pacer.ready_since == 7.0  # the event that made it ready, not the poll
    assert c.poll(8.0) == WakeAt(17.0, "grace")
    assert c.pacer.waiting == {"a", "b"}
    assert c.poll(9.0) is None  # one timer
    c.feed(DeltaStaged(actor="a", version=1), now=10.0)
    assert not c.pacer.unblocked("a") and c.poll(10.0) is None
    c.pacer.woke(WakeAt(17.0, "grace"))
    assert c.poll(17.0) == BatchRequested(version=1, prompts=tuple(f"b3-{i}" for i in range(4)))


def test_a_batch_starts_as_soon_as_the_last_stager_stages():
    c = core(steps=5)
    answer(c, c.feed(c.poll(1.0), now=1.0))
    answer(c, c.feed(c.poll(5.0), now=5.0))
    c.feed(DeltaPublished(version=1, weights_hash="h1", delta_bytes=3), now=7.0)
    assert isinstance(c.poll(7.0), WakeAt)
    c.feed(DeltaStaged(actor="a", version=1), now=8.0)
    c.feed(DeltaStaged(actor="b", version=1), now=9.0)
    assert c.pacer.unblocked("a") is False and c.pacer.unblocked("b") is True
    assert c.poll(9.0).version == 1


def test_the_start_barrier_waits_for_enough_actors_or_the_start_wait():
    c = core(actors=("a",), start_actors=2, wait=30.0)
    assert c.poll(1.0) == WakeAt(31.0, "start")
    assert c.poll(2.0) is None
    c.feed(ActorJoined(actor="b", region="us", active=0), now=3.0)
    assert c.poll(3.0).prompts[0] == "b1-0"  # two ready: no need to wait
    lone = core(actors=("a",), start_actors=2, wait=30.0)
    wake = lone.poll(1.0)
    assert lone.poll(30.9) is None
    lone.pacer.woke(wake)
    assert lone.poll(31.0).version == 0


def test_the_pacer_refuses_a_request_out_of_turn_and_changes_nothing():
    c = core()
    before = (c.pacer.next_batch, dict(c.pacer.target), c.state.target)
    with pytest.raises(ValueError, match="expects batch 1"):
        c.feed(BatchRequested(version=0, prompts=tuple(f"b2-{i}" for i in range(4))), now=1)
    with pytest.raises(ValueError, match="expects batch 1"):
        c.feed(BatchRequested(version=0, prompts=("b1-0",)), now=1)
    assert (c.pacer.next_batch, dict(c.pacer.target), c.state.target) == before
    with pytest.raises(ValueError):
        Pacer(c.pacer.config).batch_of("x1-0")


def test_publishing_a_version_forgets_the_batches_trained_into_it():
    c = core(steps=5)
    answer(c, c.feed(c.poll(1.0), now=1.0))
    answer(c, c.feed(c.poll(5.0), now=5.0))
    c.feed(DeltaPublished(version=1, weights_hash="h1", delta_bytes=3), now=7.0)
    assert (
        set(c.pacer.results) == {2}
        and set(c.pacer.done) == {1, 2}
        and c.pacer.target
        == {
            1: 0,
            2: 0,
        }
    )
    c.feed(DeltaPublished(version=2, weights_hash="h2", delta_bytes=3), now=8.0)
    assert c.pacer.results == {} and set(c.pacer.done) == {2} and c.pacer.target == {2: 0}


def test_a_staged_report_before_its_version_is_kept_and_decided_after_the_publication():
    c = core()
    assert c.staged("b", 1) is None and c.staged("a", 1) is None
    assert c.early(1) == []  # not published yet: nothing to hand back, nothing dropped
    assert c.reports.early == {1: {"a", "b"}}
    c.feed(DeltaPublished(version=1, weights_hash="h1", delta_bytes=3), now=2)
    assert c.early(1) == [DeltaStaged(actor="a", version=1), DeltaStaged(actor="b", version=1)]
    assert c.early(1) == []


def test_a_staged_report_already_known_or_from_a_gone_actor_is_dropped():
    c = core()
    c.feed(DeltaPublished(version=1, weights_hash="h1", delta_bytes=3), now=2)
    assert c.staged("a", 1) == DeltaStaged(actor="a", version=1)
    c.feed(DeltaStaged(actor="a", version=1), now=3)
    assert c.staged("a", 1) is None  # already staged
    assert c.staged("a", 0) is None  # its active version
    c.feed(ActorLost(actor="b"), now=4)
    assert c.staged("b", 1) is None
    c.staged("b", 2)
    c.feed(DeltaPublished(version=2, weights_hash="h2", delta_bytes=3), now=5)
    assert c.early(2) == []  # b is gone


def test_a_hello_is_a_reconnection_a_catch_up_or_a_join():
    c = core()
    st = c.state
    assert classify_hello(st, "a", region="us", active=0).reconnected
    assert classify_hello(st, "a", region="us", active=0).events == ()
    c.feed(DeltaPublished(version=1, weights_hash="h1", delta_bytes=3), now=2)
    moved = classify_hello(st, "a", region="us", active=1)
    assert moved.reconnected and moved.events == (CaughtUp(actor="a", version=1),)
    fresh = classify_hello(st, "a", region="us", active=None)  # a new life of the machine
    assert not fresh.reconnected
    assert fresh.events == (
        ActorLost(actor="a"),
        ActorJoined(actor="a", region="us", active=None),
    )
    new = classify_hello(st, "n", region="ca", active=None)
    assert new.events == (ActorJoined(actor="n", region="ca", active=None),)
    # A version the Ledger does not know is not a catch-up: a new life.
    assert not classify_hello(st, "a", region="us", active=7).reconnected


def test_one_tick_per_distinct_expiry_just_after_it():
    t = TickTimers(0.05)
    assert t.arm(10.0, now=4.0) == pytest.approx(6.05)
    assert t.arm(10.0, now=5.0) is None
    assert t.arm(math.inf, now=5.0) is None
    assert t.arm(3.0, now=5.0) == 0.05  # already past: at once
    t.fired(10.0)
    assert t.arm(10.0, now=9.0) == pytest.approx(1.05)
    with pytest.raises(ValueError):
        TickTimers(0.0)


def test_an_actor_fetches_from_its_route_then_the_trainer():
    assert fetch_order("relay-ca") == ["relay-ca", TRAINER]
    assert fetch_order(TRAINER) == [TRAINER]
    assert fetch_order(None) == [TRAINER]


def test_the_core_inserts_batch_completed_right_after_the_completing_result():
    c = core(prompts=2, actors=("a",))
    actions = c.feed(c.poll(1.0), now=1.0)
    (assign,) = [a for a in actions if isinstance(a, Assign)]
    first = c.feed(
        ResultArrived(actor="a", lease=assign.leases[0], version=0, weights_hash="h0"), now=2
    )
    assert [type(a) for a in first] == [Accepted]
    last = c.feed(
        ResultArrived(actor="a", lease=assign.leases[1], version=0, weights_hash="h0"), now=3
    )
    assert [type(a) for a in last] == [Accepted, BatchCompleted]
    assert last[1] == BatchCompleted(batch=1)
