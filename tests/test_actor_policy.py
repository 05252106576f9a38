"""The Actor-side decisions the simulator and the runtime both call (aurora.policy.actor)."""

from aurora.policy.actor import (
    Activate,
    ApplyPlan,
    Drop,
    Generate,
    Wait,
    Work,
    after_catch_up,
    next_action,
    plan_ready,
    to_fetch,
)
from aurora.policy.versions import CatchUpPlan

PLAN = CatchUpPlan(target=7, snapshot=5, deltas=(6, 7), bytes=100)


def test_work_on_the_active_version_runs():
    w = Work(version=3, leases=("a", "b"))
    assert next_action(active=3, staged=(), queue=[w]) == Generate(w)


def test_work_on_the_next_version_activates_its_staged_delta_first():
    w = Work(version=4, leases=("a",))
    assert next_action(active=3, staged={4}, queue=[w]) == Activate(4)


def test_work_on_a_version_the_actor_cannot_reach_is_dropped_with_the_reason():
    old, far, unstaged = (
        Work(version=2, leases=("a",)),
        Work(version=6, leases=("b",)),
        Work(version=4, leases=("c",)),
    )
    assert next_action(active=3, staged={4}, queue=[old]) == Drop(old, "stale")
    assert next_action(active=3, staged={4}, queue=[far]) == Drop(far, "unreachable")
    assert next_action(active=3, staged=(), queue=[unstaged]) == Drop(unstaged, "unreachable")
    assert next_action(active=None, staged=(), queue=[old]) == Drop(old, "unreachable")


def test_only_the_head_of_the_queue_is_considered():
    head, later = Work(version=2, leases=("a",)), Work(version=3, leases=("b",))
    assert next_action(active=3, staged=(), queue=[head, later]) == Drop(head, "stale")


def test_a_pending_commit_activates_only_a_staged_successor_of_the_active_version():
    assert next_action(active=3, staged={4}, queue=[], pending_commit=4) == Activate(4)
    assert next_action(active=3, staged=(), queue=[], pending_commit=4) == Wait()
    assert next_action(active=3, staged={5}, queue=[], pending_commit=5) == Wait()
    assert next_action(active=None, staged={1}, queue=[], pending_commit=1) == Wait()


def test_a_held_catch_up_plan_comes_before_any_work():
    w = Work(version=3, leases=("a",))
    assert next_action(active=3, staged={6, 7}, snapshots={5}, queue=[w], plan=PLAN) == ApplyPlan(
        PLAN
    )
    # Not held yet: the Actor keeps serving what it can meanwhile.
    assert next_action(active=3, staged={6}, snapshots={5}, queue=[w], plan=PLAN) == Generate(w)


def test_plan_ready_needs_the_snapshot_and_every_delta():
    assert plan_ready(PLAN, staged={6, 7}, snapshots={5})
    assert not plan_ready(PLAN, staged={6, 7}, snapshots=())
    assert not plan_ready(PLAN, staged={7}, snapshots={5})
    replay = CatchUpPlan(target=4, snapshot=None, deltas=(4,), bytes=1)
    assert plan_ready(replay, staged={4}, snapshots=())


def test_to_fetch_skips_what_is_held_or_on_its_way():
    assert to_fetch(PLAN, staged=()) == (5, (6, 7))
    assert to_fetch(PLAN, staged={6}, snapshots={5}) == (None, (7,))
    assert to_fetch(PLAN, staged=(), in_flight={5, 7}) == (None, (6,))


def test_after_catch_up_keeps_newer_work_and_restages_deltas_above_the_target():
    queue = [Work(version=6, leases=("a",)), Work(version=7, leases=("b",)), Work(8, ("c",))]
    keep, restage = after_catch_up(PLAN, queue=queue, staged={6, 7, 8, 9})
    assert keep == queue[1:]
    assert restage == [8, 9]


def test_wait_when_there_is_nothing_to_do():
    assert next_action(active=3, staged=(), queue=[]) == Wait()


def test_a_catch_up_is_taken_only_when_it_moves_the_actor_forwards():
    """An injected (or confused) catch-up to v0 must not load the signed v0 snapshot over an
    Actor's v2 (issue 26); a joiner with no weights takes any plan."""
    from aurora.policy.actor import takes_catch_up

    back = CatchUpPlan(target=0, snapshot=0, deltas=(), bytes=0)
    same = CatchUpPlan(target=2, snapshot=None, deltas=(2,), bytes=0)
    ahead = CatchUpPlan(target=3, snapshot=None, deltas=(3,), bytes=0)
    assert not takes_catch_up(back, active=2) and not takes_catch_up(same, active=2)
    assert takes_catch_up(ahead, active=2) and takes_catch_up(back, active=None)


def test_work_whose_lease_has_expired_is_dropped_before_it_starts():
    w = Work(version=3, leases=("a",), expiry=10.0)
    assert next_action(active=3, staged=(), queue=[w], now=9.9) == Generate(w)
    assert next_action(active=3, staged=(), queue=[w], now=10.0) == Drop(w, "expired")
    # Expired work on the next version does not activate its delta for nothing either.
    nxt = Work(version=4, leases=("b",), expiry=10.0)
    assert next_action(active=3, staged={4}, queue=[nxt], now=11.0) == Drop(nxt, "expired")
    # Without a clock, or without an expiry, nothing is dropped for lateness.
    assert next_action(active=3, staged=(), queue=[w]) == Generate(w)
    free = Work(version=3, leases=("c",))
    assert next_action(active=3, staged=(), queue=[free], now=1e9) == Generate(free)


def test_work_the_actor_cannot_finish_before_its_expiry_at_its_best_pace_is_dropped_as_late():
    w = Work(version=3, leases=("a", "b"), expiry=10.0)
    # Two leases took 5 s at best: from t = 6 they would come at 11, after the expiry.
    recent = [(2, 7.0), (2, 5.0), (4, 9.0)]
    assert next_action(active=3, staged=(), queue=[w], now=6.0, recent=recent) == Drop(w, "late")
    assert next_action(active=3, staged=(), queue=[w], now=4.0, recent=recent) == Generate(w)


def test_least_seconds_is_the_shortest_generation_of_no_more_leases_never_scaled_up():
    from aurora.policy.actor import least_seconds

    recent = [(1, 4.0), (16, 6.0), (2, 3.0)]
    assert least_seconds(2, recent) == 3.0
    assert least_seconds(1, recent) == 4.0
    assert least_seconds(32, recent) == 3.0
    # Nothing comparable (only larger batches seen), or nothing at all: no lower bound.
    assert least_seconds(1, [(16, 6.0)]) == 0.0
    assert least_seconds(4, []) == 0.0


def test_an_assign_that_resends_held_leases_gives_only_the_new_ones_once():
    from aurora.policy.actor import assigned

    assert assigned(3, ["a", "b"], 9.0, held=set()) == Work(3, ("a", "b"), 9.0)
    assert assigned(3, ["a", "b", "c"], 9.0, held={"a", "b"}) == Work(3, ("c",), 9.0)
    assert assigned(3, ["a"], 9.0, held={"a"}) is None
    assert assigned(3, ["a", "a"], 9.0, held=set()) == Work(3, ("a",), 9.0)
