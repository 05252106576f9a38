import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aurora.policy import allocation


def test_split_matches_the_papers_h100_a100_example():
    assert allocation.split(300, {"h100": 5000.0, "a100": 2500.0}, ["h100", "a100"]) == {
        "h100": 200,
        "a100": 100,
    }


def test_split_gives_the_remainder_to_the_largest_fractional_parts():
    # exact shares 3.33.. each: one prompt left, tie on fraction and estimate -> smallest id
    assert allocation.split(10, {"a": 1.0, "b": 1.0, "c": 1.0}, "abc") == {"a": 4, "b": 3, "c": 3}


def test_split_ties_go_to_the_faster_actor_first():
    # exact shares 0.5 and 1.5: equal fractional parts, the faster one gets the leftover
    shares = allocation.split(2, {"slow": 1.0, "fast": 3.0}, ["slow", "fast"])
    assert shares == {"slow": 0, "fast": 2}


def test_split_with_no_eligible_actor_returns_nothing():
    assert allocation.split(512, {"a": 1.0}, []) == {}


def test_split_gives_unknown_actors_the_median_prior():
    shares = allocation.split(300, {"a": 100.0, "b": 300.0, "c": 200.0}, ["a", "new"])
    # new gets median 200 -> a:new = 1:2
    assert shares == {"a": 100, "new": 200}


def test_prior_without_any_estimate_is_the_documented_default():
    assert allocation.prior({}) == allocation.DEFAULT_PRIOR_TOKENS_PER_S


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_split_rejects_a_bad_batch_naming_it(bad):
    with pytest.raises(ValueError, match="batch"):
        allocation.split(bad, {"a": 1.0}, ["a"])


@pytest.mark.parametrize("bad", [math.nan, math.inf, 0.0, -2.0])
def test_split_rejects_a_bad_estimate_naming_the_actor(bad):
    with pytest.raises(ValueError, match="'x'"):
        allocation.split(4, {"x": bad}, ["x"])


def test_ema_update_blends_and_starts_from_the_first_observation():
    assert allocation.ema_update(None, 800.0) == 800.0
    assert allocation.ema_update(1000.0, 500.0, beta=0.3) == pytest.approx(850.0)


def test_exclusion_decay_multiplies_by_alpha():
    assert allocation.exclusion_decay(1000.0, alpha=0.5) == 500.0
    with pytest.raises(ValueError, match="alpha"):
        allocation.exclusion_decay(1000.0, alpha=0.0)


@given(
    batch=st.integers(min_value=0, max_value=5000),
    estimates=st.dictionaries(
        st.text(alphabet="abcdefgh", min_size=1, max_size=3),
        st.floats(min_value=1e-3, max_value=1e6, allow_nan=False),
        min_size=1,
        max_size=20,
    ),
)
def test_split_shares_sum_to_the_batch_and_stay_within_one_of_proportional(batch, estimates):
    shares = allocation.split(batch, estimates, estimates.keys())
    assert sum(shares.values()) == batch
    total = math.fsum(estimates.values())
    for actor, share in shares.items():
        assert abs(share - batch * estimates[actor] / total) < 1 + 1e-9
        assert share >= 0


def _split_by_dicts(batch: int, estimates: dict[str, float], eligible: list[str]) -> dict[str, int]:
    """split() as it was written before it kept lists (the reference it must equal)."""
    actors = sorted(set(eligible))
    if not actors:
        return {}
    fallback = allocation.prior(estimates) if not estimates.keys() >= set(actors) else 0.0
    tau = {a: float(estimates.get(a, fallback)) for a in actors}
    total = math.fsum(tau.values())
    exact = {a: batch * tau[a] / total for a in actors}
    shares = {a: math.floor(exact[a]) for a in actors}
    left = batch - sum(shares.values())
    order = sorted(actors, key=lambda a: (-(exact[a] - shares[a]), -tau[a], a))
    for a in order[:left]:
        shares[a] += 1
    return shares


def test_split_equals_the_dict_written_reference_share_by_share():
    rng = random.Random(7)
    for _ in range(400):
        n = rng.randint(1, 40)
        names = [f"a{i:02d}" for i in range(n)]
        pick = rng.random()
        if pick < 0.3:  # ties: a few distinct estimates
            estimates = {a: float(rng.choice((500, 1000, 1500))) for a in names}
        else:
            estimates = {a: rng.uniform(1.0, 5000.0) for a in names}
        for a in rng.sample(names, rng.randint(0, n // 3)):
            del estimates[a]  # some without an estimate: the prior
        eligible = rng.sample(names, rng.randint(1, n))
        if rng.random() < 0.5:
            eligible.sort()
        batch = rng.randint(0, 3 * n)
        got = allocation.split(batch, estimates, eligible)
        assert list(got.items()) == list(_split_by_dicts(batch, estimates, eligible).items())
