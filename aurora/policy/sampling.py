"""Were an Actor's tokens *sampled* from pi_v? Per-Actor statistics of the ranks of its checked
tokens, beside the log-prob recompute of :mod:`aurora.policy.verification`.

The recompute checks each returned token's log-prob, not *which* tokens were returned: written-in
answers, greedy decodes and the best of N samples pass it, with their true log-probs. Selection
changes the *rank* of the returned tokens. Each checked token gets a randomized probability
integral transform ``u`` under the job's sampling distribution, exactly U(0, 1) given the past
for a sample (:class:`RankStats`); likely tokens push ``u`` toward 1, random ids toward 0. Per
Actor, over the whole job, the location and dispersion sums are held to Robbins' normal-mixture
boundary (:func:`boundary`, :func:`judge_ranks`): an always-valid sequential test, so an Actor
that samples exactly from pi_v is ever excluded with probability at most ``alpha``. What selection
gains below the boundary is bounded (:func:`detection_tokens`, :func:`best_of_shift`,
:func:`reward_gain_bound`); selection that does not move the ranks, or an adversary that knows
pi_v and compensates, is not seen. Nothing here is a state machine: :class:`RankStats` is a value
(:meth:`RankStats.add` returns a new one and raises on a ``u`` outside [0, 1], changing nothing).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

LOCATION_VARIANCE = 1.0 / 12.0
"""Sub-Gaussian variance proxy of ``u - 1/2`` for u ~ U(0, 1) (its variance: exact)."""
DISPERSION_VARIANCE = 0.0062
"""Sub-Gaussian variance proxy of ``(u - 1/2)^2 - 1/12`` for u ~ U(0, 1): the supremum over l
of ``2 ln E exp(l w) / l^2`` is 0.006117 (numerically; its variance is 1/180 = 0.005556),
rounded up."""


class Skew(Enum):
    """How an Actor's ranks failed the test."""

    LIKELY = "its tokens are likelier than samples of pi_v (greedy, chosen, best of N)"
    UNLIKELY = "its tokens are less likely than samples of pi_v (random or foreign tokens)"
    SPREAD = "its tokens' ranks are more spread than samples' (likely and unlikely mixed)"
    NARROW = "its tokens' ranks are less spread than samples' (middling tokens chosen)"


@dataclass(frozen=True, kw_only=True)
class SamplingRule:
    """The test of an Actor's ranks (:func:`judge_ranks`, :func:`boundary`)."""

    alpha: float = 1e-6
    """Probability that an Actor sampling exactly from pi_v is ever excluded by this test over a
    whole job (half to each statistic)."""
    scale: float = 16.0
    """Tokens at which the boundary is tightest (the mixture's ``r = scale * s^2``): 16, a check
    of the tiny model's 4 completions, so that random ids (``u`` near 0) fail in one check."""
    bias: float = 0.0
    """Largest ``|E[u] - 1/2|`` per token an honest engine's arithmetic may cause (location
    only; docs/journal/verification-sampling.md)."""

    def __post_init__(self) -> None:
        if not (0 < self.alpha < 1):
            raise ValueError(f"SamplingRule.alpha must be in (0, 1), got {self.alpha!r}")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"SamplingRule.scale must be > 0 tokens, got {self.scale!r}")
        if not (0 <= self.bias < 0.5):
            raise ValueError(f"SamplingRule.bias must be in [0, 0.5), got {self.bias!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class RankStats:
    """Sums over an Actor's checked tokens (or one check's).

    **The statistic.** At each recomputed position the Trainer orders the vocabulary by
    increasing probability under the job's sampling distribution ``p`` (``softmax(logits / T)``:
    the engines apply the temperature and nothing else), ties by id, and gives the returned
    token ``t``

        u = F(t-) + V * p(t)        F(t-): the probability of the tokens before t; V ~ U(0, 1)

    (:func:`aurora.rl.ranks.rank_transform`), V drawn by the Trainer from a keyed hash
    (:func:`noise`). If ``t`` was drawn from ``p``, ``u`` is exactly U(0, 1) given everything
    before it (the randomized probability integral transform), so an honest Actor's ``u``'s are
    i.i.d. U(0, 1) whatever the prompts and the model. Greedy, chosen and best-of-N tokens are
    likelier than samples: ``u`` moves toward 1 (greedy: ``u = 1 - p_max + V p_max``, mean
    ``1 - p_max / 2``); random ids are unlikely: ``u`` near 0.

    **The sums.** Per Actor, over all its checked tokens: ``S_n = sum (u - 1/2)`` (location,
    :attr:`shift`) and ``Q_n = sum ((u - 1/2)^2 - 1/12)`` (dispersion, :attr:`spread`: a mix of
    very likely and very unlikely tokens that keeps the mean at 1/2 spreads ``u`` toward 0 and
    1; tokens of middling rank narrow it). :func:`judge_ranks` holds each to :func:`boundary`.
    """

    tokens: int = 0
    """Tokens counted."""
    shift: float = 0.0
    """``sum (u - 1/2)``."""
    spread: float = 0.0
    """``sum ((u - 1/2)^2 - 1/12)``."""

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 0:
            raise ValueError(f"RankStats.tokens must be an int >= 0, got {self.tokens!r}")
        # |shift| <= n/2 and -n/12 <= spread <= n/6 for any u in [0, 1] (a little slack for
        # the rounding of sums).
        n = self.tokens
        if not (
            math.isfinite(self.shift)
            and math.isfinite(self.spread)
            and abs(self.shift) <= n / 2 + 1e-6 * (n + 1)
            and -n / 12 - 1e-6 * (n + 1) <= self.spread <= n / 6 + 1e-6 * (n + 1)
        ):
            raise ValueError(
                f"RankStats: shift {self.shift!r}, spread {self.spread!r} are impossible for "
                f"{n} ranks in [0, 1]"
            )

    def add(self, ranks: Iterable[float]) -> RankStats:
        """These sums with the ranks ``u`` (each in [0, 1]) added; ValueError for one outside
        (NaN included), and nothing changes (a new value is returned)."""
        n, s1, s2 = self.tokens, self.shift, self.spread
        for u in ranks:
            if isinstance(u, bool) or not isinstance(u, int | float) or not 0.0 <= u <= 1.0:
                raise ValueError(f"a rank must be a number in [0, 1], got {u!r}")
            x = float(u) - 0.5
            n, s1, s2 = n + 1, s1 + x, s2 + (x * x - LOCATION_VARIANCE)
        return RankStats(tokens=n, shift=s1, spread=s2)

    def merge(self, other: RankStats) -> RankStats:
        """The sums of both."""
        return RankStats(
            tokens=self.tokens + other.tokens,
            shift=self.shift + other.shift,
            spread=self.spread + other.spread,
        )

    @property
    def z(self) -> float:
        """The location statistic in standard deviations (0 without tokens)."""
        return self.shift / math.sqrt(self.tokens * LOCATION_VARIANCE) if self.tokens else 0.0

    @property
    def z_spread(self) -> float:
        """The dispersion statistic in standard deviations (its variance is 1/180 a token)."""
        return self.spread / math.sqrt(self.tokens / 180.0) if self.tokens else 0.0


def boundary(tokens: int, variance: float, rule: SamplingRule) -> float:
    """``b(n)`` for one statistic of variance proxy ``variance``: an honest sum ever reaches it
    with probability at most ``rule.alpha / 2``.

    Under honest sampling both sums of :class:`RankStats` are martingales with increments
    sub-Gaussian of variance proxy ``s^2`` (``u - 1/2`` uniform on [-1/2, 1/2]: ``s^2 = 1/12``
    exactly, since ``sinh(x)/x <= exp(x^2/6)``; ``(u - 1/2)^2 - 1/12``: ``s^2 = 0.0062``, its
    moment generating function's bound computed numerically, ``tests/test_sampling_policy.py``
    checks it on a grid). For such a martingale ``exp(l S_n - l^2 n s^2 / 2)`` is a
    supermartingale for every ``l``; mixed over ``l ~ N(0, 1/r)`` it is ``sqrt(r/(r+n s^2))
    exp(S_n^2 / (2 (r + n s^2)))``, and Ville's inequality bounds the chance that it *ever*
    reaches ``1/a``: the Actor fails the first time

        |S_n| - bias * n >= b(n) = sqrt(2 (n s^2 + r) (ln(1/a) + ln((n s^2 + r) / r) / 2))

    (Robbins' normal-mixture boundary; ``r = scale * s^2``, the boundary is tightest near
    ``scale`` tokens). It holds for any number of checks, stopped whenever (an always-valid
    sequential test: no correction for testing after every check is needed), so an honest Actor
    that samples from ``p`` exactly is excluded at most with probability ``alpha`` over a whole
    job (``a = alpha / 2`` per statistic). ``bias`` (per token, location only) absorbs what an
    honest engine's own arithmetic moves ``u`` by: a bf16 engine samples from its own ``p'``, a
    little off the Trainer's fp32 ``p``; if ``|E[u] - 1/2| <= bias`` at every position the
    boundary still holds with ``S_n - sum E[u] - 1/2`` as the martingale (measured per engine:
    docs/journal/verification-sampling.md).
    """
    v = tokens * variance
    r = rule.scale * variance
    return math.sqrt(2.0 * (v + r) * (math.log(2.0 / rule.alpha) + 0.5 * math.log((v + r) / r)))


def judge_ranks(stats: RankStats, rule: SamplingRule) -> Skew | None:
    """The test on an Actor's sums (:class:`RankStats`): None while each is within its
    :func:`boundary`, else how it failed (location first).

    **What it cannot see.** Only the ranks' distribution is tested. Selection on anything that
    does not move it (a reward whose correct answers rank like any others: ``s1 = s0`` of
    :func:`reward_gain_bound`) is invisible, and an Actor that knows pi_v can compensate, e.g.
    return likely tokens where it matters and unlikely ones elsewhere so that location and
    dispersion stay in bounds; V being secret only hides where in ``[F(t-), F(t)]`` each ``u``
    falls, not ``F`` itself. The test raises the cost of selection and bounds the crude kinds;
    it proves nothing about an adaptive adversary.
    """
    n = stats.tokens
    if n == 0:
        return None
    if abs(stats.shift) - rule.bias * n >= boundary(n, LOCATION_VARIANCE, rule):
        return Skew.LIKELY if stats.shift > 0 else Skew.UNLIKELY
    if abs(stats.spread) >= boundary(n, DISPERSION_VARIANCE, rule):
        return Skew.SPREAD if stats.spread > 0 else Skew.NARROW
    return None


def detection_tokens(shift: float, rule: SamplingRule, *, limit: int = 1 << 40) -> int | None:
    """Checked tokens after which a cheat moving ``u`` by ``shift`` per token crosses the
    location boundary in expectation (the least ``n`` with ``(|shift| - bias) n >= b(n)``);
    None when it never does (``|shift| <= bias``) or not before ``limit``.

    **What selection gains below the boundary.** A cheat whose tokens move ``u`` by ``d`` per
    token on average (``E[u] = 1/2 + d``) crosses, in expectation, after the ``n`` that solves
    ``(|d| - bias) n = b(n)``; ``b(n)/n`` shrinks as ``sqrt(2 s^2 ln(n) / n)``, so any fixed
    ``|d| > bias`` is caught, and a cheat that must survive ``n`` checked tokens is held to
    ``|d| <= bias + b(n)/n`` (:func:`max_shift`). What that allows depends on how selection
    moves ranks: :func:`best_of_shift`, :func:`reward_gain_bound`.
    """
    excess = abs(shift) - rule.bias
    if excess <= 0:
        return None

    def over(n: int) -> bool:
        return excess * n >= boundary(n, LOCATION_VARIANCE, rule)

    if not over(limit):
        return None
    lo, hi = 0, 1
    while not over(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # over() is monotone: b(n)/n decreases in n
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if over(mid) else (mid, hi)
    return hi


def max_shift(tokens: int, rule: SamplingRule) -> float:
    """The largest per-token shift of ``u`` an Actor's ``tokens`` checked tokens may show and
    still pass the location test: ``bias + b(n)/n`` (0.053 at 1,000 tokens, 0.017 at 10,000,
    with ``bias`` 0)."""
    if tokens < 1:
        raise ValueError(f"max_shift needs tokens >= 1, got {tokens!r}")
    return rule.bias + boundary(tokens, LOCATION_VARIANCE, rule) / tokens


def expected_max_normal(n: int) -> float:
    """``c_N``: the mean of the largest of ``n`` independent standard normals (trapezoid rule
    on ``x n phi(x) Phi(x)^(n-1)`` over [-10, 10], step 1e-3)."""
    if n < 1:
        raise ValueError(f"expected_max_normal needs n >= 1, got {n!r}")
    h, total = 1e-3, 0.0
    for k in range(20001):
        x = -10.0 + k * h
        phi = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        w = 0.5 if k in (0, 20000) else 1.0
        total += w * x * n * phi * cdf ** (n - 1)
    return total * h


def best_of_shift(n: int, length: float) -> float:
    """Upper bound of the per-token shift of ``u`` that keeping the best of ``n`` whole
    completions of ``length`` tokens makes, whatever the score: ``c_N / sqrt(12 L)``, the
    normal approximation of the largest of ``n`` means of ``length`` uniforms.

    Best of N whole completions of ``L`` tokens, by any score: the chosen one's mean ``u`` is at
    most the largest of N means of ``L`` uniforms, so ``d <= c_N / sqrt(12 L)`` (``c_N`` the
    mean of the largest of N standard normals, :func:`expected_max_normal`: 1.03 for N = 4, 1.42
    for N = 8); the bound is reached by selection on the likelihood (the strongest rank
    selection).
    """
    if length <= 0:
        raise ValueError(f"best_of_shift needs length > 0, got {length!r}")
    return expected_max_normal(n) / math.sqrt(12.0 * length)


def reward_gain_bound(tokens: int, rule: SamplingRule, *, length: float, gap: float) -> float:
    """Largest expected reward gain per result (binary reward, selection on the reward alone)
    of an Actor that passes ``tokens`` checked tokens: ``max_shift * length / gap``; ``gap`` =
    ``s1 - s0``, the expected rank sum of a correct completion minus a wrong one's, at least
    this on every prompt; ``length`` the mean completion length (tokens). Infinite for ``gap <=
    0`` (such selection does not move the ranks up).

    Selection on a binary reward alone (keep a correct sample when one of the N is correct):
    within each class the kept completion is distributed as ``p`` would, only the class changes,
    so on a prompt where it raises the expected reward by ``g`` the expected rank sum moves by
    ``g (s1 - s0)``, ``s1``, ``s0`` the expected ``sum (u - 1/2)`` of a correct and of a wrong
    completion of that prompt; over prompts ``d = E[g (s1 - s0)] / L`` (``L`` the mean length).
    Where the gap is at least ``s1 - s0`` on every prompt, an Actor undetected over ``n`` tokens
    gains at most ``g <= (bias + b(n)/n) L / (s1 - s0)`` per result. The gap pooled over honest
    rollouts weighs each prompt by how often it is answered right; best of N weighs them much
    alike, an answer written in (``chosen``) does not: it gains most on the prompts the model
    rarely gets right, whose answers rank low (measured on the tiny model:
    docs/journal/verification-sampling.md).
    """
    if gap <= 0:
        return math.inf
    return max_shift(tokens, rule) * length / gap


def noise(secret: bytes, key: str, completion: int, length: int) -> list[float]:
    """The V's of one completion's ``length`` tokens: numbers in [0, 1) fixed by ``(secret,
    key, completion, position)`` (keyed BLAKE2b under ``secret``, the Trainer's verification
    key, 53 bits), so that a recompute after a restart gives the same ranks and an Actor
    without ``secret`` cannot predict them. ValueError for a key that is not 32 bytes."""
    if not isinstance(secret, bytes) or len(secret) != 32:
        raise ValueError("the ranks' key is 32 bytes (the Trainer's verification key)")
    base = hashlib.blake2b(key=secret, digest_size=8, person=b"aurora-rank-v1")
    base.update(f"{len(key)}|{key}|{completion}|".encode())
    out = []
    for t in range(length):
        h = base.copy()
        h.update(str(t).encode())
        out.append((int.from_bytes(h.digest(), "little") >> 11) / float(1 << 53))
    return out
