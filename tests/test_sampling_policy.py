"""The per-Actor test of sampled tokens' ranks (aurora.policy.sampling): honest ranks pass at the
stated rate, shifted ones fail within the stated count, the bounds on what selection gains hold
in simulation, and the Trust book excludes an Actor through it."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from aurora.policy import IllegalTransition
from aurora.policy.events import ResultVerified, event_from_record, to_record
from aurora.policy.sampling import (
    DISPERSION_VARIANCE,
    LOCATION_VARIANCE,
    RankStats,
    SamplingRule,
    Skew,
    best_of_shift,
    boundary,
    detection_tokens,
    expected_max_normal,
    judge_ranks,
    max_shift,
    noise,
    reward_gain_bound,
)
from aurora.policy.verification import (
    CheckFailure,
    Measures,
    Trust,
    TrustBook,
    VerificationConfig,
    judge,
    measure,
)

RULE = SamplingRule()
CHECK = 20
"""Tokens per check in these simulations (a check of the tiny model's 4 completions is ~15)."""


def first_failure(us: np.ndarray, rule: SamplingRule = RULE) -> tuple[int, Skew] | None:
    """Feed ``us`` in checks of CHECK tokens: (tokens when the test first failed, why)."""
    stats = RankStats()
    for lo in range(0, len(us), CHECK):
        stats = stats.add(us[lo : lo + CHECK].tolist())
        verdict = judge_ranks(stats, rule)
        if verdict is not None:
            return stats.tokens, verdict
    return None


def shifted(rng: np.random.Generator, n: int, mean: float) -> np.ndarray:
    """``n`` ranks of mean ``mean``: U^(1/k) (mean k/(k+1)) above 1/2, 1 - that below."""
    m = max(mean, 1 - mean)
    k = m / (1 - m)
    u = rng.random(n) ** (1 / k)
    return u if mean >= 0.5 else 1 - u


def test_honest_ranks_are_never_excluded_over_many_actors_at_the_default_rate():
    # 1,000 Actors x 4,000 tokens, tested after every check: at alpha = 1e-6 the chance of any
    # exclusion is 1e-3.
    rng = np.random.default_rng(0)
    assert all(first_failure(rng.random(4000)) is None for _ in range(1000))


def test_honest_ranks_fail_at_most_at_the_stated_rate_when_it_is_large():
    # At alpha = 0.1 the always-valid guarantee is measurable: over 2,000 Actors of 4,000 tokens
    # each, tested after every check, at most 10% (+3 sigma) are ever excluded.
    rule = SamplingRule(alpha=0.1)
    rng = np.random.default_rng(1)
    fails = sum(first_failure(rng.random(4000), rule) is not None for _ in range(2000))
    assert fails / 2000 <= 0.1 + 3 * math.sqrt(0.1 * 0.9 / 2000)
    assert fails > 0  # the boundary is not so loose that nothing ever crosses it


@pytest.mark.parametrize(("mean", "why"), [(0.55, Skew.LIKELY), (0.45, Skew.UNLIKELY)])
def test_shifted_ranks_fail_within_the_stated_count(mean, why):
    # detection_tokens is where the expected sum meets the boundary: about half the cheats are
    # caught by then, all by twice as many tokens.
    stated = detection_tokens(mean - 0.5, RULE)
    assert stated is not None
    rng = np.random.default_rng(2)
    caught = [first_failure(shifted(rng, 2 * stated + CHECK, mean)) for _ in range(200)]
    assert all(c is not None and c[1] is why for c in caught)
    by_stated = sum(c[0] <= stated + CHECK for c in caught if c is not None)
    assert by_stated >= 0.45 * len(caught)


def test_random_ids_fail_in_the_first_check():
    # u near 0 (tokens pi_v would hardly sample): one check of 20 tokens.
    rng = np.random.default_rng(3)
    for _ in range(20):
        assert first_failure(rng.random(CHECK) * 0.01) == (CHECK, Skew.UNLIKELY)


def test_a_mix_of_likely_and_unlikely_tokens_with_the_mean_kept_fails_on_dispersion():
    rng = np.random.default_rng(4)
    spread = first_failure(rng.beta(0.5, 0.5, 4000))  # mean 1/2, toward 0 and 1
    narrow = first_failure(rng.beta(3.0, 3.0, 4000))  # mean 1/2, middling ranks
    assert spread is not None and spread[1] is Skew.SPREAD
    assert narrow is not None and narrow[1] is Skew.NARROW


def test_the_variance_proxies_bound_the_moment_generating_functions():
    # Sub-Gaussianity of the increments (what the boundary rests on), on a grid of l; the
    # integrals by the midpoint rule on 200,000 points of [0, 1].
    u = (np.arange(200_000) + 0.5) / 200_000
    for w, s2 in ((u - 0.5, LOCATION_VARIANCE), ((u - 0.5) ** 2 - 1 / 12, DISPERSION_VARIANCE)):
        for lam in np.concatenate([-np.logspace(-2, 3, 300), np.logspace(-2, 3, 300)]):
            assert np.log(np.mean(np.exp(lam * w))) <= lam * lam * s2 / 2 + 1e-12


def test_a_bias_allowance_absorbs_an_engine_shift_and_no_more():
    rule = SamplingRule(bias=0.01)
    rng = np.random.default_rng(5)
    assert all(first_failure(shifted(rng, 20_000, 0.509), rule) is None for _ in range(20))
    assert detection_tokens(0.009, rule) is None
    assert detection_tokens(0.05, rule) > detection_tokens(0.05, RULE)


def test_the_boundary_shrinks_per_token_and_detection_needs_more_tokens_for_smaller_shifts():
    assert max_shift(1000, RULE) > max_shift(10_000, RULE) > max_shift(100_000, RULE)
    counts = [detection_tokens(d, RULE) for d in (0.5, 0.2, 0.1, 0.05, 0.02)]
    assert counts == sorted(counts) and counts[0] <= CHECK
    assert detection_tokens(0.0, RULE) is None
    for n in (1, 50, 10_000):
        assert boundary(n, LOCATION_VARIANCE, RULE) / n == pytest.approx(max_shift(n, RULE))


def test_best_of_n_whole_completions_shifts_ranks_at_most_by_the_stated_bound():
    # The strongest rank selection (the largest mean u of N completions of L tokens) reaches
    # c_N / sqrt(12 L); a selection on anything else (here a noisy score) stays below it.
    rng = np.random.default_rng(6)
    for n, length in ((4, 4), (8, 4), (4, 16), (8, 16)):
        u = rng.random((20_000, n, length))
        means = u.mean(-1)
        best = means.max(-1).mean() - 0.5
        noisy = means[np.arange(20_000), (means + rng.normal(0, 0.1, means.shape)).argmax(-1)]
        bound = best_of_shift(n, length)
        assert best == pytest.approx(bound, rel=0.06)
        assert noisy.mean() - 0.5 < bound
    assert expected_max_normal(4) == pytest.approx(1.0294, abs=1e-4)
    assert expected_max_normal(8) == pytest.approx(1.4236, abs=1e-4)


def test_reward_selection_moves_ranks_by_the_gain_times_the_rank_gap():
    # A toy policy: completions of L = 4 tokens; one is "correct" when its first token's u is
    # above 0.8 (likelier tokens are the right ones, as on a task the model half knows). Best of
    # N by the reward alone gains g per completion and shifts the per-token mean of u by
    # g (s1 - s0) / L; an Actor that passes n checked tokens gains at most reward_gain_bound.
    rng = np.random.default_rng(7)
    length, draws = 4, 40_000
    u = rng.random((draws, 8, length))
    correct = u[:, :, 0] > 0.8
    sums = (u - 0.5).sum(-1)
    gap = sums[correct].mean() - sums[~correct].mean()
    for n in (4, 8):
        pick = correct[:, :n].argmax(-1)  # the first correct one, else the first (a tie)
        chosen = sums[np.arange(draws), pick]
        gain = correct[np.arange(draws), pick].mean() - correct.mean()
        shift = chosen.mean() / length
        assert shift == pytest.approx(gain * gap / length, rel=0.05)
        stated = detection_tokens(shift, RULE)
        assert stated is not None
        tokens = stated - 1  # the most it passes in expectation
        assert gain <= reward_gain_bound(tokens, RULE, length=length, gap=gap) + 1e-9
    assert reward_gain_bound(1000, RULE, length=4, gap=0.0) == math.inf


def test_rank_stats_refuse_a_rank_outside_the_unit_interval_and_change_nothing():
    stats = RankStats().add([0.2, 0.9])
    same = RankStats(tokens=stats.tokens, shift=stats.shift, spread=stats.spread)
    for bad in (1.5, -0.1, float("nan"), True, "0.5"):
        with pytest.raises(ValueError):
            stats.add([0.3, bad])
        assert stats == same and stats.shift == pytest.approx(0.1)
    with pytest.raises(ValueError):
        RankStats(tokens=2, shift=1.5, spread=0.0)  # |shift| <= n/2
    with pytest.raises(ValueError):
        RankStats(tokens=-1)
    with pytest.raises(ValueError):
        SamplingRule(alpha=0.0)


def test_the_noise_is_fixed_by_its_key_and_uniform():
    k7, k8 = bytes([7] * 32), bytes([8] * 32)
    a = noise(k7, "actor-0|l1", 2, 1000)
    assert a == noise(k7, "actor-0|l1", 2, 1000)
    assert a != noise(k8, "actor-0|l1", 2, 1000) and a != noise(k7, "actor-0|l1", 3, 1000)
    with pytest.raises(ValueError):
        noise(b"short", "actor-0|l1", 2, 10)
    assert all(0 <= v < 1 for v in a) and abs(np.mean(a) - 0.5) < 0.05


# ---- through the Trust book ----------------------------------------------------------------

CFG = VerificationConfig()


def checked(us: list[float]) -> Measures:
    """An honest recompute's log-prob measures with these ranks."""
    return measure([[-1.0] * len(us)], [[-1.0] * len(us)], [us])


def test_an_actor_whose_tokens_rank_too_high_is_excluded_for_sampling_and_stays_excluded():
    rng = np.random.default_rng(8)
    book = TrustBook(CFG)
    failure = None
    checks = 0
    while failure is None and checks < 1000:
        failure = book.observe("greedy", checked(shifted(rng, CHECK, 0.6).tolist()), checks % 4)
        checks += 1
    assert failure is CheckFailure.SAMPLING_DISTRIBUTION
    assert book.record("greedy").state is Trust.EXCLUDED
    assert checks * CHECK <= 2 * detection_tokens(0.1, RULE)
    before = dataclasses.replace(book.record("greedy"))
    with pytest.raises(IllegalTransition):
        book.observe("greedy", checked([0.5] * CHECK), 9)
    assert book.record("greedy") == before


def test_honest_ranks_never_fail_the_book_and_each_check_alone_is_not_judged_by_them():
    rng = np.random.default_rng(9)
    book = TrustBook(CFG)
    for k in range(500):
        assert book.observe("honest", checked(rng.random(CHECK).tolist()), k % 4) is None
    assert book.record("honest").ranks.tokens == 500 * CHECK
    # judge() without the Actor's sums does not run the test (one check proves little).
    assert judge(checked([1.0] * CHECK), CFG) is None
    assert judge(checked([1.0] * CHECK), CFG, RankStats()) is CheckFailure.SAMPLING_DISTRIBUTION
    off = dataclasses.replace(CFG, sampling=None)
    assert judge(checked([1.0] * CHECK), off, RankStats()) is None


def test_result_verified_records_carry_the_rank_sums_and_old_records_still_decode():
    ev = ResultVerified(
        actor="a",
        lease="l",
        version=1,
        max_delta=0.0,
        mean_delta=0.0,
        min_logprob=-1.0,
        tokens=4,
        rank_tokens=4,
        rank_shift=0.25,
        rank_spread=-0.01,
    )
    assert event_from_record(to_record(ev)) == ev
    old = {k: v for k, v in to_record(ev).items() if not k.startswith("rank_")}
    assert event_from_record(old).rank_tokens == 0


def test_the_ledger_excludes_an_actor_whose_reported_rank_sums_cross_the_boundary():
    from aurora.policy.events import Evicted, ResultArrived
    from tests.test_verification_policy import ledger

    core, _ = ledger()
    core.feed(ResultArrived(actor="a", lease="L1", version=0, weights_hash="h0"), now=2)

    def check(shift: float, spread: float = 0.0) -> ResultVerified:
        # One check of 20 tokens whose log-probs were true (an honest recompute).
        return ResultVerified(
            actor="a",
            lease="L1",
            version=0,
            max_delta=1e-6,
            mean_delta=1e-7,
            min_logprob=-3.0,
            tokens=20,
            rank_tokens=20,
            rank_shift=shift,
            rank_spread=spread,
        )

    # Sums no ranks in [0, 1] give are refused, and change nothing.
    before = dataclasses.replace(core.state.trust.record("a"))
    with pytest.raises(ValueError, match="impossible"):
        core.feed(check(11.0), now=3)
    assert core.state.trust.record("a") == before
    evicted = []
    for k in range(40):  # mean u 0.65 per check: greedy-like
        evicted = [x for x in core.feed(check(3.0), now=4 + k) if isinstance(x, Evicted)]
        if evicted:
            break
    assert evicted == [Evicted(actor="a", reason="SAMPLING_DISTRIBUTION")]
    assert (k + 1) * 20 <= 2 * detection_tokens(0.15, RULE)
    assert core.state.trust.record("a").failure is CheckFailure.SAMPLING_DISTRIBUTION
