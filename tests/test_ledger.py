"""The Ledger core, driven through decide() exactly as the simulator and the runtime drive it."""

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aurora.policy import IllegalTransition
from aurora.policy.events import (
    Accepted,
    ActorJoined,
    ActorLeft,
    ActorLost,
    Assign,
    BatchRequested,
    CatchUp,
    CaughtUp,
    Commit,
    DeltaPublished,
    DeltaStaged,
    Exclude,
    Expired,
    FallBack,
    Fanout,
    PreemptionNotice,
    Refused,
    RelayAssigned,
    RelayJoined,
    RelayLost,
    Released,
    ResultArrived,
    ResultMalformed,
    ThroughputObserved,
    Tick,
    VersionActivated,
)
from aurora.policy.leases import LeaseState, Refusal
from aurora.policy.ledger import LedgerConfig, decide, initial_state


def run(state, event, now=0.0):
    return decide(state, event, now=now)[1]


@pytest.fixture
def ledger():
    """Version 0 (snapshot) published; a1, a2 in region ca; a3 in the Trainer's region us."""
    s = initial_state(LedgerConfig(trainer_region="us"))
    run(s, DeltaPublished(version=0, weights_hash="h0", delta_bytes=None, snapshot_bytes=16_000))
    for actor, region in [("a1", "ca"), ("a2", "ca"), ("a3", "us")]:
        run(s, ActorJoined(actor=actor, region=region, active=0))
    return s


def publish_and_stage(s, version, actors=("a1", "a2", "a3")):
    run(s, DeltaPublished(version=version, weights_hash=f"h{version}", delta_bytes=200))
    for a in actors:
        run(s, DeltaStaged(actor=a, version=version))


def prompts(n, prefix="p"):
    return tuple(f"{prefix}{i}" for i in range(n))


def test_first_actor_of_a_remote_region_becomes_its_relay_and_peers_route_through_it(ledger):
    assert ledger.region_relay == {"ca": "a1"}
    assert {a: r.source for a, r in ledger.actors.items()} == {
        "a1": "trainer",
        "a2": "a1",
        "a3": "trainer",
    }


def test_a_delta_fans_out_once_per_remote_region(ledger):
    out = run(ledger, DeltaPublished(version=1, weights_hash="h1", delta_bytes=200))
    assert out == [Fanout(version=1, edges=(("a1", "a2"), ("trainer", "a1"), ("trainer", "a3")))]


def test_staged_actors_get_commit_then_a_proportional_share(ledger):
    for a, tps in [("a1", 2000), ("a2", 1000), ("a3", 1000)]:
        run(ledger, ThroughputObserved(actor=a, tokens=tps * 10, seconds=10.0))
    publish_and_stage(ledger, 1)
    out = run(ledger, BatchRequested(version=1, prompts=prompts(8)), now=5.0)
    assert [type(a) for a in out] == [Commit, Assign, Commit, Assign, Commit, Assign]
    assigns = {a.actor: len(a.leases) for a in out if isinstance(a, Assign)}
    assert assigns == {"a1": 4, "a2": 2, "a3": 2}
    assert all(a.version == 1 and a.expiry == 605.0 for a in out if isinstance(a, Assign))


def test_an_actor_two_versions_behind_is_excluded_decayed_and_sent_a_catch_up_plan(ledger):
    run(ledger, ThroughputObserved(actor="a2", tokens=1000, seconds=1.0))
    publish_and_stage(ledger, 1, actors=("a1", "a3"))
    run(ledger, VersionActivated(actor="a1", version=1))
    run(ledger, VersionActivated(actor="a3", version=1))
    publish_and_stage(ledger, 2, actors=("a1", "a3"))
    out = run(ledger, BatchRequested(version=2, prompts=prompts(4)))
    assert out[0] == Exclude(actor="a2", version=2, active=0)
    assert isinstance(out[1], CatchUp) and out[1].plan.deltas == (1, 2) and out[1].plan.bytes == 400
    assert ledger.actors["a2"].estimate == 500.0
    assert all(a.actor != "a2" for a in out if isinstance(a, Assign))


def test_a_result_is_admitted_once_and_refused_as_duplicate_afterwards(ledger):
    publish_and_stage(ledger, 1)
    run(ledger, BatchRequested(version=1, prompts=prompts(3)))
    ok = ResultArrived(actor="a1", lease="L1", version=1, weights_hash="h1")
    assert run(ledger, ok, now=1.0) == [Accepted(lease="L1", actor="a1", prompt="p0", version=1)]
    assert run(ledger, ok, now=2.0) == [Refused(lease="L1", actor="a1", reason=Refusal.DUPLICATE)]


@pytest.mark.parametrize(
    "result,now,reason",
    [
        (dict(actor="a1", lease="L1", version=0, weights_hash="h1"), 1.0, Refusal.WRONG_VERSION),
        (dict(actor="a1", lease="L1", version=1, weights_hash="hX"), 1.0, Refusal.WRONG_HASH),
        (dict(actor="a1", lease="L1", version=1, weights_hash="h1"), 601.0, Refusal.LATE),
        (dict(actor="a1", lease="L99", version=1, weights_hash="h1"), 1.0, Refusal.UNKNOWN_LEASE),
        (dict(actor="a2", lease="L1", version=1, weights_hash="h1"), 1.0, Refusal.WRONG_ACTOR),
    ],
)
def test_the_acceptance_predicate_refuses_with_a_reason(ledger, result, now, reason):
    publish_and_stage(ledger, 1, actors=("a1",))
    run(ledger, BatchRequested(version=1, prompts=prompts(1)))
    out = run(ledger, ResultArrived(**result), now=now)
    assert out[0] == Refused(lease=result["lease"], actor=result["actor"], reason=reason)
    ledger.book.check()


def test_a_refused_result_returns_its_prompt_to_an_eligible_actor_at_once(ledger):
    publish_and_stage(ledger, 1, actors=("a1", "a3"))
    run(ledger, BatchRequested(version=1, prompts=prompts(2)))
    out = run(ledger, ResultArrived(actor="a1", lease="L1", version=1, weights_hash="bad"), now=1.0)
    assert out[0] == Refused(lease="L1", actor="a1", reason=Refusal.WRONG_HASH)
    again = [a for a in out if isinstance(a, Assign)]
    assert len(again) == 1 and again[0].prompts == ("p0",)
    assert again[0].actor == "a3"  # not back to the Actor whose weights spoiled it


def test_a_malformed_result_is_refused_as_bad_payload_and_its_prompt_goes_to_another_actor(
    ledger,
):
    publish_and_stage(ledger, 1, actors=("a1", "a3"))
    run(ledger, BatchRequested(version=1, prompts=prompts(2)))
    holder = next(a for a in ("a1", "a3") if ledger.book.live(a))
    lease = ledger.book.live(holder)[0]
    other = "a3" if holder == "a1" else "a1"
    # Someone else's malformed result touches nothing of the holder's.
    out = run(ledger, ResultMalformed(actor=other, lease=lease.id), now=1.0)
    assert out == [Refused(lease=lease.id, actor=other, reason=Refusal.WRONG_ACTOR)]
    assert lease in ledger.book.live(holder)
    out = run(ledger, ResultMalformed(actor=holder, lease=lease.id), now=1.0)
    assert out[0] == Refused(lease=lease.id, actor=holder, reason=Refusal.BAD_PAYLOAD)
    assert lease not in ledger.book.live(holder)
    again = [a for a in out if isinstance(a, Assign)]
    assert again and lease.prompt in again[0].prompts and again[0].actor == other
    ledger.book.check()


def test_preemption_notice_releases_leases_at_once_and_survivors_take_them(ledger):
    publish_and_stage(ledger, 1)
    run(ledger, BatchRequested(version=1, prompts=prompts(6)))
    out = run(ledger, PreemptionNotice(actor="a3", deadline=30.0), now=2.0)
    released = [a for a in out if isinstance(a, Released)]
    assert [r.prompt for r in released] == ["p4", "p5"]
    reassigned = [p for a in out if isinstance(a, Assign) for p in a.prompts]
    assert sorted(reassigned) == ["p4", "p5"]
    assert all(a.actor in ("a1", "a2") for a in out if isinstance(a, Assign))


def test_involuntary_loss_leaves_leases_until_they_expire_then_survivors_get_them(ledger):
    publish_and_stage(ledger, 1)
    run(ledger, BatchRequested(version=1, prompts=prompts(6)))
    for lease, actor in [("L1", "a1"), ("L2", "a1"), ("L3", "a2"), ("L4", "a2")]:
        run(ledger, ResultArrived(actor=actor, lease=lease, version=1, weights_hash="h1"), now=0.5)
    out = run(ledger, ActorLost(actor="a3"), now=1.0)
    assert not any(isinstance(a, Released | Assign) for a in out)
    assert run(ledger, Tick(), now=600.0) == []  # expiry is 600.0: not yet past it
    out = run(ledger, Tick(), now=600.5)
    assert [a.prompt for a in out if isinstance(a, Expired)] == ["p4", "p5"]
    assert sorted(p for a in out if isinstance(a, Assign) for p in a.prompts) == ["p4", "p5"]


def test_losing_a_seed_relay_elects_a_new_one_and_its_peers_fall_back(ledger):
    run(ledger, ActorJoined(actor="a4", region="ca", active=0))
    out = run(ledger, ActorLost(actor="a1"))
    assert out == [
        RelayAssigned(region="ca", relay="a2"),
        FallBack(actor="a2", source="trainer", lost="a1"),
        FallBack(actor="a4", source="a2", lost="a1"),
    ]


def test_a_standalone_relay_takes_over_and_its_loss_falls_back_to_the_trainer(ledger):
    out = run(ledger, RelayJoined(relay="r-ca", region="ca"))
    assert out[0] == RelayAssigned(region="ca", relay="r-ca")
    assert {a.actor: a.source for a in out[1:]} == {"a1": "r-ca", "a2": "r-ca"}
    out = run(ledger, RelayLost(relay="r-ca"))
    assert out[0] == RelayAssigned(region="ca", relay="a1")
    assert out[1:] == [
        FallBack(actor="a1", source="trainer", lost="r-ca"),
        FallBack(actor="a2", source="a1", lost="r-ca"),
    ]


def test_peer_relay_fallback_when_configured_and_the_region_is_empty():
    s = initial_state(LedgerConfig(trainer_region="us", peer_relay_fallback=True))
    run(s, DeltaPublished(version=0, weights_hash="h0", delta_bytes=None, snapshot_bytes=1))
    run(s, RelayJoined(relay="r-jp", region="jp"))
    run(s, RelayJoined(relay="r-ca", region="ca"))
    run(s, ActorJoined(actor="a1", region="ca", active=0))
    out = run(s, RelayLost(relay="r-ca"))
    # the only Actor of ca becomes its seed; it fetches from the peer relay in jp, not the Trainer
    assert out == [
        RelayAssigned(region="ca", relay="a1"),
        FallBack(actor="a1", source="r-jp", lost="r-ca"),
    ]


def test_a_joining_actor_without_weights_gets_snapshot_plus_replay_then_becomes_eligible(ledger):
    publish_and_stage(ledger, 1)
    out = run(ledger, ActorJoined(actor="a9", region="us"))
    plan = out[-1].plan
    assert (plan.snapshot, plan.deltas, plan.bytes) == (0, (1,), 16_200)
    run(ledger, CaughtUp(actor="a9", version=1))
    out = run(ledger, BatchRequested(version=1, prompts=prompts(8)))
    assert any(isinstance(a, Assign) and a.actor == "a9" for a in out)


def test_a_rejoining_actor_keeps_its_decayed_estimate(ledger):
    run(ledger, ThroughputObserved(actor="a2", tokens=1000, seconds=1.0))
    run(ledger, ActorLeft(actor="a2"))
    run(ledger, ActorJoined(actor="a2", region="ca", active=0))
    assert ledger.actors["a2"].estimate == 1000.0


def snapshot(state):
    return copy.deepcopy(state)


@pytest.mark.parametrize(
    "event,match",
    [
        (ActorJoined(actor="a1", region="ca", active=0), "'join' from state READY"),
        (ActorJoined(actor="a7", region="ca", active=5), "never published"),
        (ActorLeft(actor="nobody"), "unknown Actor id 'nobody'"),
        (DeltaPublished(version=0, weights_hash="h", delta_bytes=1), "going backwards"),
        (DeltaPublished(version=3, weights_hash="h", delta_bytes=1), "gap"),
        (DeltaPublished(version=1, weights_hash="h", delta_bytes=-1), "delta_bytes"),
        (VersionActivated(actor="a1", version=1), "activate"),
        (DeltaStaged(actor="a1", version=9), "unknown version 9"),
        (BatchRequested(version=0, prompts=("x", "x")), "already submitted"),
        (BatchRequested(version=4, prompts=("y",)), "latest published is 0"),
        (ThroughputObserved(actor="a1", tokens=10, seconds=float("nan")), "seconds"),
        (RelayLost(relay="ghost"), "unknown relay id 'ghost'"),
        (PreemptionNotice(actor="a1", deadline=float("inf")), "deadline"),
    ],
)
def test_bad_or_illegal_events_raise_naming_the_value_and_leave_state_unchanged(
    ledger, event, match
):
    before = snapshot(ledger)
    with pytest.raises(ValueError, match=match):
        decide(ledger, event, now=1.0)
    assert ledger == before


def test_illegal_transition_is_a_value_error():
    assert issubclass(IllegalTransition, ValueError)


def test_now_must_be_finite(ledger):
    with pytest.raises(ValueError, match="now"):
        decide(ledger, Tick(), now=float("nan"))


# --------------------------------------------------------------------------------------
# Property: random histories never lose or double-settle a prompt, never admit a result
# whose version or hash differs from its lease, never give work to an Actor > 1 behind.
# --------------------------------------------------------------------------------------

ACTORS = ["a1", "a2", "a3", "a4"]
REGIONS = ["us", "ca", "jp"]

op = st.one_of(
    st.tuples(st.just("join"), st.sampled_from(ACTORS), st.sampled_from(REGIONS)),
    st.tuples(st.just("leave"), st.sampled_from(ACTORS)),
    st.tuples(st.just("lose"), st.sampled_from(ACTORS)),
    st.tuples(st.just("notice"), st.sampled_from(ACTORS)),
    st.tuples(st.just("publish"), st.integers(1, 500)),
    st.tuples(st.just("stage"), st.sampled_from(ACTORS)),
    st.tuples(st.just("activate"), st.sampled_from(ACTORS)),
    st.tuples(st.just("catchup"), st.sampled_from(ACTORS)),
    st.tuples(st.just("batch"), st.integers(0, 12)),
    st.tuples(
        st.just("result"), st.integers(1, 60), st.sampled_from(["ok", "ver", "hash", "actor"])
    ),
    st.tuples(st.just("tick"), st.floats(0, 900)),
    st.tuples(st.just("tput"), st.sampled_from(ACTORS), st.integers(1, 10_000)),
)


def to_event(s, o, batch_no):
    kind = o[0]
    latest = s.latest
    if kind == "join":
        return ActorJoined(actor=o[1], region=o[2], active=None)
    if kind == "leave":
        return ActorLeft(actor=o[1])
    if kind == "lose":
        return ActorLost(actor=o[1])
    if kind == "notice":
        return PreemptionNotice(actor=o[1], deadline=1e9)
    if kind == "publish":
        return DeltaPublished(version=latest + 1, weights_hash=f"h{latest + 1}", delta_bytes=o[1])
    if kind == "stage":
        rec = s.actors.get(o[1])
        v = (rec.versions.active or 0) + 1 if rec else 1
        return DeltaStaged(actor=o[1], version=v)
    if kind == "activate":
        rec = s.actors.get(o[1])
        return VersionActivated(
            actor=o[1], version=rec.versions.staged if rec and rec.versions.staged else 1
        )
    if kind == "catchup":
        return CaughtUp(actor=o[1], version=latest)
    if kind == "batch":
        return BatchRequested(
            version=latest, prompts=tuple(f"b{batch_no}-{i}" for i in range(o[1]))
        )
    if kind == "result":
        lease = s.book.leases.get(f"L{o[1]}")
        if lease is None:
            return ResultArrived(actor="a1", lease=f"L{o[1]}", version=0, weights_hash="h0")
        version, h, actor = lease.version, lease.weights_hash, lease.actor
        if o[2] == "ver":
            version += 1
        elif o[2] == "hash":
            h = "forged"
        elif o[2] == "actor":
            actor = "a1" if actor != "a1" else "a2"
        return ResultArrived(actor=actor, lease=lease.id, version=version, weights_hash=h)
    if kind == "tick":
        return Tick()
    return ThroughputObserved(actor=o[1], tokens=o[2], seconds=1.0)


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=60), st.lists(st.floats(0, 50), min_size=60, max_size=60))
def test_random_histories_keep_every_prompt_and_admit_only_matching_results(ops, gaps):
    s = initial_state(LedgerConfig(trainer_region="us"))
    decide(
        s,
        DeltaPublished(version=0, weights_hash="h0", delta_bytes=None, snapshot_bytes=10),
        now=0.0,
    )
    now = 0.0
    submitted: set[str] = set()
    admitted: list[str] = []
    for i, o in enumerate(ops):
        now += gaps[i]
        event = to_event(s, o, i)
        before = copy.deepcopy(s)
        try:
            _, actions = decide(s, event, now=now)
        except ValueError:
            assert s == before, f"{event} raised but changed the state"
            continue
        if isinstance(event, BatchRequested):
            submitted.update(event.prompts)
        for a in actions:
            if isinstance(a, Accepted):
                lease = s.book.leases[a.lease]
                assert isinstance(event, ResultArrived)
                assert event.version == lease.version and event.weights_hash == lease.weights_hash
                assert event.actor == lease.actor and now <= lease.expiry
                admitted.append(a.prompt)
            if isinstance(a, Assign):
                rec = s.actors[a.actor]
                active = rec.versions.active
                assert active == a.version or (
                    active == a.version - 1 and rec.commit_sent == a.version
                )
        s.book.check()
    assert len(admitted) == len(set(admitted)), "a prompt was settled twice"
    placed = set(s.book.done) | set(s.book.leased) | set(s.book.pool())
    assert placed == submitted, "a prompt was lost"
    assert all(st_ is not None for st_ in s.book.states.values())
    assert set(s.book.done) == {p for p in admitted}
    assert all(s.book.states[lid] is LeaseState.SETTLED for lid in s.book.done.values())


def test_a_straggler_whose_leases_expired_gets_none_of_them_back_until_it_returns_a_result(
    ledger,
):
    s = ledger
    run(s, BatchRequested(version=0, prompts=tuple(f"p{i}" for i in range(6))))
    a1 = [lease.id for lease in s.book.live("a1")]
    assert a1
    for actor in ("a2", "a3"):  # they finish in time; a1 is stuck
        for lease in s.book.live(actor):
            run(s, ResultArrived(actor=actor, lease=lease.id, version=0, weights_hash="h0"), 1.0)
    run(s, BatchRequested(version=0, prompts=("q0", "q1", "q2")), now=500.0)
    actions = run(s, Tick(), now=700.0)  # only a1's leases (from t=0, 600 s long) are due
    assert {a.actor for a in actions if isinstance(a, Expired)} == {"a1"}
    assigned = {a.actor for a in actions if isinstance(a, Assign)}
    assert assigned and "a1" not in assigned and s.actors["a1"].stalled
    # A late result is refused and changes nothing; an admitted one shows a1 works again.
    run(s, ResultArrived(actor="a1", lease=a1[0], version=0, weights_hash="h0"), now=701.0)
    assert s.actors["a1"].stalled
    mine = [
        a
        for a in run(s, BatchRequested(version=0, prompts=("r0",)), now=702.0)
        if isinstance(a, Assign)
    ]
    assert mine and all(a.actor != "a1" for a in mine)


def test_an_actor_whose_result_is_on_the_wrong_weights_is_not_handed_the_prompt_back(ledger):
    s = ledger
    run(s, BatchRequested(version=0, prompts=tuple(f"p{i}" for i in range(6))))
    lease = s.book.live("a1")[0]
    actions = run(s, ResultArrived(actor="a1", lease=lease.id, version=0, weights_hash="bad"))
    assert any(isinstance(a, Refused) and a.reason is Refusal.WRONG_HASH for a in actions)
    again = [a for a in actions if isinstance(a, Assign) and lease.prompt in a.prompts]
    assert again and again[0].actor != "a1" and s.actors["a1"].stalled


def test_when_every_eligible_actor_is_a_straggler_they_still_get_the_work(ledger):
    s = ledger
    run(s, BatchRequested(version=0, prompts=tuple(f"p{i}" for i in range(6))))
    actions = run(s, Tick(), now=1000.0)
    assert {a.actor for a in actions if isinstance(a, Expired)} == {"a1", "a2", "a3"}
    assert sum(len(a.leases) for a in actions if isinstance(a, Assign)) == 6


def test_the_book_forgets_settled_batches_past_the_lag_bound_and_keeps_everything_else(ledger):
    from aurora.policy.ledger import RETAIN_BATCHES

    first_leases: list[tuple[str, str]] = []
    for v in range(1, 31):
        publish_and_stage(ledger, v)
        out = run(ledger, BatchRequested(version=v, prompts=prompts(6, f"b{v}-")), now=float(v))
        leases = [(a.actor, lease) for a in out if isinstance(a, Assign) for lease in a.leases]
        if v == 1:
            first_leases = leases
        held_back = leases[0]  # one prompt of every batch is never answered
        for actor, lease in leases[1:]:
            ok = ResultArrived(actor=actor, lease=lease, version=v, weights_hash=f"h{v}")
            assert isinstance(run(ledger, ok, now=v + 0.5)[0], Accepted)
        ledger.book.check()
        assert held_back[1] in ledger.book.leased.values()
        for a in ("a1", "a2", "a3"):
            run(ledger, VersionActivated(actor=a, version=v), now=v + 0.6)
    # Bounded: settled prompts of the newest 1 + max_lag + RETAIN_BATCHES batches, plus the
    # unanswered prompt of every batch (never forgotten: it is not settled).
    kept = 1 + ledger.config.max_lag + RETAIN_BATCHES
    assert len(ledger.book.done) == 5 * kept
    assert len(ledger.book.leased) == 30
    # A result for a forgotten lease is refused and changes nothing.
    actor, lease = first_leases[1]
    before = copy.deepcopy(ledger.book)
    late = ResultArrived(actor=actor, lease=lease, version=1, weights_hash="h1")
    assert run(ledger, late, now=40.0)[0] == Refused(
        lease=lease, actor=actor, reason=Refusal.UNKNOWN_LEASE
    )
    assert ledger.book == before


@pytest.mark.parametrize("seed", range(20))
def test_fanout_edges_are_every_edge_sorted(seed):
    # _fanout_edges builds its edges by source from the Actors in id order; the reference is
    # the set of edges sorted, as it was built before: relays, several regions, Actors gone.
    import contextlib
    import random

    from aurora.policy.core import LedgerCore
    from aurora.policy.events import ActorLeft, RelayJoined, RelayLost
    from aurora.policy.ledger import SCHEDULABLE, TRAINER, _fanout_edges

    rng = random.Random(seed)
    for relays in (True, False):
        c = LedgerCore(LedgerConfig(trainer_region="us", relays=relays))
        c.feed(
            DeltaPublished(version=0, weights_hash="h0", delta_bytes=None, snapshot_bytes=9), now=0
        )
        names = [f"n{i:03d}" for i in range(60)]
        rng.shuffle(names)
        for name in names:
            r = rng.random()
            with contextlib.suppress(ValueError):
                if r < 0.1:
                    c.feed(RelayJoined(relay="r" + name, region=rng.choice(("eu", "ap"))), now=1.0)
                elif r < 0.15 and c.state.relays:
                    c.feed(RelayLost(relay=rng.choice(sorted(c.state.relays))), now=1.0)
                elif r < 0.25 and c.state.actors:
                    c.feed(ActorLeft(actor=rng.choice(sorted(c.state.actors))), now=1.0)
                else:
                    region = rng.choice(("us", "eu", "ap"))
                    c.feed(ActorJoined(actor=name, region=region, active=0), now=1.0)
            state = c.state
            edges = {(TRAINER, relay) for relay in state.relays} if relays else set()
            edges |= {(r.source, r.id) for r in state.actors.values() if r.life in SCHEDULABLE}
            assert _fanout_edges(state) == tuple(sorted(edges)), (seed, relays)
