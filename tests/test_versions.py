import pytest

from aurora.policy.versions import CatchUpPlan, Eligibility, eligibility, plan_catch_up


def test_an_actor_on_the_target_is_eligible():
    assert eligibility(5, None, 5) is Eligibility.ELIGIBLE


def test_an_actor_one_behind_with_the_target_staged_needs_a_commit():
    assert eligibility(4, 5, 5) is Eligibility.NEEDS_COMMIT


def test_an_actor_one_behind_without_the_delta_is_excluded():
    assert eligibility(4, None, 5) is Eligibility.EXCLUDED


def test_an_actor_two_behind_is_excluded_even_with_something_staged():
    assert eligibility(3, 4, 5) is Eligibility.EXCLUDED
    assert eligibility(3, 5, 5) is Eligibility.EXCLUDED


def test_an_actor_without_weights_is_excluded():
    assert eligibility(None, None, 0) is Eligibility.EXCLUDED
    assert eligibility(None, 1, 1) is Eligibility.EXCLUDED


def test_an_actor_on_a_newer_published_version_is_eligible_and_one_beyond_latest_is_not():
    assert eligibility(6, None, 5, latest=6) is Eligibility.ELIGIBLE
    assert eligibility(6, None, 5) is Eligibility.EXCLUDED  # latest not known
    assert eligibility(7, None, 5, latest=6) is Eligibility.EXCLUDED


def test_catch_up_replays_the_chain_when_that_is_cheapest():
    plan = plan_catch_up(7, 10, {8: 200, 9: 210, 10: 190}, {0: 16_000})
    assert plan == CatchUpPlan(target=10, snapshot=None, deltas=(8, 9, 10), bytes=600)


def test_catch_up_uses_a_snapshot_when_replay_costs_more_bytes():
    deltas = {v: 200 for v in range(1, 101)}
    plan = plan_catch_up(2, 100, deltas, {0: 16_000, 95: 16_000})
    assert plan == CatchUpPlan(target=100, snapshot=95, deltas=(96, 97, 98, 99, 100), bytes=17_000)


def test_catch_up_without_weights_needs_a_snapshot():
    plan = plan_catch_up(None, 3, {1: 5, 2: 5, 3: 5}, {0: 100, 2: 100})
    assert plan == CatchUpPlan(target=3, snapshot=2, deltas=(3,), bytes=105)


def test_catch_up_of_a_current_actor_is_empty():
    assert plan_catch_up(4, 4, {}, {}) == CatchUpPlan(target=4, snapshot=None, deltas=(), bytes=0)


def test_catch_up_skips_a_pruned_chain_and_takes_a_snapshot():
    plan = plan_catch_up(1, 4, {3: 1, 4: 1}, {2: 1000})
    assert plan.snapshot == 2 and plan.deltas == (3, 4)


def test_catch_up_without_any_complete_chain_raises_naming_what_is_held():
    with pytest.raises(ValueError, match="no complete chain"):
        plan_catch_up(1, 4, {4: 1}, {})


def test_catch_up_from_ahead_of_latest_raises():
    with pytest.raises(ValueError, match="ahead"):
        plan_catch_up(5, 4, {}, {})
