"""Verified rollouts: which admitted results the Trainer recomputes, what a recompute must show,
and what happens to an Actor whose result fails (issue 31).

Theory of operation
-------------------
The acceptance predicate (:func:`aurora.policy.leases.admits`) checks *who* may return a result
and on *which* weights it claims to be generated (lease, time, v, h(v)); it cannot see whether
the completions were sampled from pi_v at all. An Actor holding the job secret and its own
identity could return made-up tokens, samples from another model or an older version, or honest
tokens with forged behaviour log-probs (which steer the importance ratio of GRPO). The check: the
Trainer, which keeps the published bf16 weights of every version a result may claim (the lag
bound), recomputes the per-token log-probs of a sample of the admitted results under the claimed
version and reports three numbers per result (:class:`Measures`); :func:`judge` decides.

**What is checked** (:func:`judge`, per result, over all its completions' tokens):

* ``max |lp_reported - lp_recomputed| <= token_tolerance`` (nats): one forged or foreign token
  fails. The tolerance covers what two honest computations of the same bf16 weights differ by
  (an engine's batched KV-cache decode against the Trainer's single forward; fp32 or bf16
  arithmetic), measured per engine and set with a margin (docs/VERIFICATION.md).
* ``mean |lp_reported - lp_recomputed| <= mean_tolerance`` (nats): a systematic shift (another
  version of the same model, whose tokens each differ a little) fails even when no single token
  is beyond the per-token bound; honest rounding noise averages out, a different policy does not.
* ``min lp_recomputed >= implausible_logprob`` (nats): a sampled token whose probability under
  pi_v is vanishing (below ``exp(implausible_logprob)``) fails whatever the Actor reported. An
  honest Actor samples such a token at one position with probability at most
  ``V * exp(implausible_logprob)`` (V the vocabulary size): 1.4e-8 for V = 151,936 at -30.

**Sampled, not chosen** (:mod:`aurora.policy.sampling`, per Actor): the recompute also gives each
checked token's rank ``u`` under pi_v's sampling distribution (U(0, 1) for a sample); the
Actor's record sums them over all its checks (:class:`~aurora.policy.sampling.RankStats`), and
an Actor whose sums cross the always-valid boundary fails (``SAMPLING_DISTRIBUTION``): greedy,
chosen or best-of-N tokens pass every recompute but rank too high, random ids too low.

**How often** (:meth:`TrustBook.fraction`): per Actor, from its record. A ``NEW`` Actor has every
result checked (``new_fraction``) until ``probation`` checks passed on results of at least
``probation_versions`` distinct versions (an Actor frozen on old weights is honest on the version
it froze at: checks on that version alone prove nothing); a ``SUSPECTED`` one (a check that
passed with a maximum difference above ``suspect_ratio`` of the tolerance) likewise; then
``TRUSTED`` at ``fraction``, halved every ``halving`` further passed checks down to
``min_fraction``. Which results is deterministic: result (actor, lease) is checked iff
``u(seed, actor, lease) < fraction``, ``u`` a uniform number from a BLAKE2b hash, so the choice
needs no random state, is the same after a restart, and an Actor cannot predict it without the
job's ``seed`` (which Actors are not told beyond their sampling seed: see docs/VERIFICATION.md
for what this does and does not hide).

**How much of a result.** A checked result's ``completions`` (4) completions are recomputed,
chosen by the same seeded coin (:func:`pick_completions`): every dishonest mode of the tests lies
on every completion of a result it lies about, and the check then costs half of a whole
result's recompute at ``group_size`` 8.

**What a failure does**: the result is refused (``Refusal.UNVERIFIED``), the Actor's record goes
to ``EXCLUDED`` for good (no move leaves it), the Ledger releases its live leases to the pool,
stops its membership and refuses it if it joins again (:mod:`aurora.policy.ledger`); the Trainer
drops every result of that Actor in the batch it was checking, and the Ledger hands no result of
an excluded Actor to the Trainer again (:meth:`TrustBook.plan` says ``DROP``). Every outcome is a
logged ``ResultVerified`` event, so the records (and the exclusion) are rebuilt by a replay of
the Ledger's log.

Each Actor's record is one state machine (``TRANSITIONS``); an illegal move (a check of an
excluded Actor) raises :class:`~aurora.policy.IllegalTransition` and changes nothing.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from enum import Enum

from aurora.policy._fsm import step
from aurora.policy.sampling import RankStats, SamplingRule, judge_ranks


class Trust(Enum):
    NEW = "new"
    TRUSTED = "trusted"
    SUSPECTED = "suspected"
    EXCLUDED = "excluded"


TRANSITIONS: dict[Trust, dict[str, Trust]] = {
    Trust.NEW: {
        "pass": Trust.NEW,
        "trust": Trust.TRUSTED,
        "suspect": Trust.SUSPECTED,
        "fail": Trust.EXCLUDED,
    },
    Trust.SUSPECTED: {
        "pass": Trust.SUSPECTED,
        "trust": Trust.TRUSTED,
        "suspect": Trust.SUSPECTED,
        "fail": Trust.EXCLUDED,
    },
    Trust.TRUSTED: {"pass": Trust.TRUSTED, "suspect": Trust.SUSPECTED, "fail": Trust.EXCLUDED},
    Trust.EXCLUDED: {},
}
"""Legal moves of one Actor's verification record: exclusion is final."""

MACHINE = "verification"


class CheckFailure(Enum):
    """Why a recomputed result failed (the named reason a ``ResultVerified`` is refused for)."""

    TOKEN_MISMATCH = "a reported log-prob differs from the recompute under pi_v beyond the bound"
    MEAN_MISMATCH = "the mean reported-vs-recomputed log-prob difference is beyond the bound"
    IMPLAUSIBLE_TOKEN = "a sampled token has vanishing probability under pi_v"
    SAMPLING_DISTRIBUTION = "the ranks of its checked tokens under pi_v are not those of samples"


class Plan(Enum):
    """What the Trainer does with one admitted result of a batch."""

    TRAIN = "train"
    """Train on it unchecked."""
    CHECK = "check"
    """Recompute it under its version first; train on it only if it passes."""
    DROP = "drop"
    """Its Actor is excluded: never train on it."""


@dataclass(frozen=True, kw_only=True)
class VerificationConfig:
    """The verification rule of one job (module docstring)."""

    seed: int
    """Seed of the deterministic choice of the results to check (the job's seed)."""
    token_tolerance: float = 1.0
    """Largest |reported - recomputed| log-prob of any checked token of an honest result
    (nats). Honest per-token differences measured on the tiny model over 2,048 results
    (docs/VERIFICATION.md): at most 8.8e-6 with the transformers engine (fp32 arithmetic on
    the bf16 weights, as the Trainer's recompute); with vLLM's CPU build (bf16 arithmetic) a
    heavy tail: 99.99% below 0.18, the largest 0.19 of 30,465 checked tokens and 0.32 of all
    60,909 tokens of the same results: 1.0 is 3.1x the largest."""
    mean_tolerance: float = 0.075
    """Largest mean |reported - recomputed| log-prob over a check's tokens (nats). Honest
    maxima measured over 2,048 checks of 4 completions: 1.9e-6 (transformers), 0.023 (vLLM
    CPU); 0.075 is 3.3x the larger."""
    implausible_logprob: float = -30.0
    """A sampled token whose recomputed log-prob is below this fails (nats)."""
    new_fraction: float = 1.0
    """Fraction of a NEW or SUSPECTED Actor's results checked."""
    probation: int = 8
    """Passed checks that make a NEW or SUSPECTED Actor TRUSTED ..."""
    probation_versions: int = 3
    """... on results of at least this many distinct versions."""
    fraction: float = 0.1
    """Fraction of a newly TRUSTED Actor's results checked."""
    halving: int = 64
    """Passed checks as TRUSTED that halve its fraction ..."""
    min_fraction: float = 0.02
    """... down to this floor."""
    completions: int = 4
    """Completions of a checked result that are recomputed (chosen by the seeded coin; all
    when the group is no larger): a cheat on every completion of a result is caught by any
    one, and the check costs ``completions / group_size`` of a whole result's recompute. 4,
    not fewer: the mean over ~16 tokens halves the honest vLLM mean's worst case against 2."""
    suspect_ratio: float = 0.8
    """A passing check whose largest token difference is above this x ``token_tolerance``
    marks the Actor SUSPECTED (checked at ``new_fraction`` again)."""
    sampling: SamplingRule | None = SamplingRule()
    """The per-Actor test of the checked tokens' ranks (:mod:`aurora.policy.sampling`); None:
    off (only the log-probs are checked)."""

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"VerificationConfig.seed must be an int, got {self.seed!r}")
        for name in ("token_tolerance", "mean_tolerance"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"VerificationConfig.{name} must be > 0 nats, got {value!r}")
        if not (math.isfinite(self.implausible_logprob) and self.implausible_logprob < 0):
            raise ValueError(
                "VerificationConfig.implausible_logprob must be a negative log-prob, got "
                f"{self.implausible_logprob!r}"
            )
        for name in ("new_fraction", "fraction", "min_fraction"):
            value = getattr(self, name)
            if not (0 < value <= 1):
                raise ValueError(f"VerificationConfig.{name} must be in (0, 1], got {value!r}")
        if self.min_fraction > self.fraction:
            raise ValueError("VerificationConfig.min_fraction must be <= fraction")
        if (
            self.probation < 1
            or self.halving < 1
            or self.probation_versions < 1
            or (self.completions < 1)
        ):
            raise ValueError(
                "VerificationConfig.probation, probation_versions, halving and completions "
                "must be >= 1"
            )
        if not (0 < self.suspect_ratio <= 1):
            raise ValueError(
                f"VerificationConfig.suspect_ratio must be in (0, 1], got {self.suspect_ratio!r}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class Measures:
    """What the Trainer measured on one result (all completions' tokens together)."""

    max_delta: float
    """Largest |reported - recomputed| log-prob of a token (nats)."""
    mean_delta: float
    """Mean |reported - recomputed| log-prob over the tokens (nats)."""
    min_logprob: float
    """Smallest recomputed log-prob of a sampled token (nats)."""
    tokens: int
    """Tokens compared."""
    ranks: RankStats = RankStats()
    """Sums of the checked tokens' ranks (none counted: no ranks were computed)."""


LOGPROB_FLOOR = -1e9
"""Where a recomputed log-prob of -inf (a token of probability 0) is clamped, so that every
measure is a finite number in the Ledger's JSON log."""


def measure(
    reported: list[list[float]],
    recomputed: list[list[float]],
    ranks: list[list[float]] | None = None,
) -> Measures:
    """:class:`Measures` of one result: ``reported[i][t]`` and ``recomputed[i][t]`` are the
    log-probs of token ``t`` of completion ``i``, ``ranks[i][t]`` its rank ``u`` (when
    computed). Raises ValueError if their shapes differ (a payload decode makes them agree
    before this is called) or a rank is outside [0, 1]."""
    if len(reported) != len(recomputed) or any(
        len(a) != len(b) for a, b in zip(reported, recomputed, strict=True)
    ):
        raise ValueError("reported and recomputed log-probs differ in shape")
    if ranks is not None and (
        len(ranks) != len(reported)
        or any(len(a) != len(b) for a, b in zip(ranks, reported, strict=True))
    ):
        raise ValueError("ranks and log-probs differ in shape")
    deltas: list[float] = []
    low = 0.0
    for rep, rec in zip(reported, recomputed, strict=True):
        for a, b in zip(rep, rec, strict=True):
            b = max(b, LOGPROB_FLOOR) if not math.isnan(b) else LOGPROB_FLOOR
            deltas.append(abs(a - b))
            low = min(low, b)
    if not deltas:
        raise ValueError("a result with no tokens cannot be measured")
    return Measures(
        max_delta=max(deltas),
        mean_delta=sum(deltas) / len(deltas),
        min_logprob=low,
        tokens=len(deltas),
        ranks=RankStats().add(u for r in ranks or () for u in r),
    )


def judge(
    measures: Measures, config: VerificationConfig, ranks: RankStats | None = None
) -> CheckFailure | None:
    """The rule (module docstring): None when the result passes. ``ranks``: the Actor's rank
    sums before this check (given, the sampling test runs on them with this check's added)."""
    if measures.min_logprob < config.implausible_logprob:
        return CheckFailure.IMPLAUSIBLE_TOKEN
    if not measures.max_delta <= config.token_tolerance:  # NaN fails too
        return CheckFailure.TOKEN_MISMATCH
    if not measures.mean_delta <= config.mean_tolerance:
        return CheckFailure.MEAN_MISMATCH
    if (
        ranks is not None
        and config.sampling is not None
        and judge_ranks(ranks.merge(measures.ranks), config.sampling) is not None
    ):
        return CheckFailure.SAMPLING_DISTRIBUTION
    return None


def unit(seed: int, actor: str, lease: str) -> float:
    """A number in [0, 1) fixed by ``(seed, actor, lease)``: the deterministic coin of the
    sampling (BLAKE2b, 53 bits)."""
    digest = hashlib.blake2b(f"{seed}|{actor}|{lease}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def pick_completions(
    config: VerificationConfig, actor: str, lease: str, group_size: int
) -> tuple[int, ...]:
    """Which completions of ``actor``'s result for ``lease`` (``group_size`` of them) a check
    recomputes: the ``config.completions`` with the smallest seeded coins, in order."""
    if group_size <= config.completions:
        return tuple(range(group_size))
    coins = sorted(range(group_size), key=lambda i: unit(config.seed, actor, f"{lease}#{i}"))
    return tuple(sorted(coins[: config.completions]))


@dataclass(slots=True)
class TrustRecord:
    """One Actor's verification record."""

    state: Trust = Trust.NEW
    passed: int = 0
    """Checks passed since it was NEW or last SUSPECTED."""
    checks: int = 0
    """Checks of it in all."""
    versions: tuple[int, ...] = ()
    """Distinct versions of its passed probation checks (up to ``probation_versions``)."""
    failure: CheckFailure | None = None
    """Why it was excluded."""
    ranks: RankStats = RankStats()
    """Sums of the ranks of all its checked tokens (never reset: the test is over the job)."""


class TrustBook:
    """Every Actor's record (module docstring); all moves go through :meth:`observe`."""

    def __init__(self, config: VerificationConfig) -> None:
        self.config = config
        self.records: dict[str, TrustRecord] = {}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TrustBook):
            return NotImplemented
        return (self.config, self.records) == (other.config, other.records)

    __hash__ = None  # type: ignore[assignment]

    def record(self, actor: str) -> TrustRecord:
        return self.records.get(actor) or TrustRecord()

    def excluded(self, actor: str) -> bool:
        rec = self.records.get(actor)
        return rec is not None and rec.state is Trust.EXCLUDED

    def fraction(self, actor: str) -> float:
        """Fraction of ``actor``'s results to check now (0 when excluded: nothing is trained)."""
        cfg = self.config
        rec = self.record(actor)
        if rec.state is Trust.EXCLUDED:
            return 0.0
        if rec.state is not Trust.TRUSTED:
            return cfg.new_fraction
        halvings = (rec.passed - cfg.probation) // cfg.halving
        return max(cfg.min_fraction, cfg.fraction * 0.5 ** max(0, halvings))

    def plan(self, actor: str, lease: str) -> Plan:
        """What to do with ``actor``'s admitted result for ``lease``."""
        if self.excluded(actor):
            return Plan.DROP
        if unit(self.config.seed, actor, lease) < self.fraction(actor):
            return Plan.CHECK
        return Plan.TRAIN

    def observe(self, actor: str, measures: Measures, version: int) -> CheckFailure | None:
        """Record a check of ``actor``'s result generated on ``version``; returns why it failed
        (None: passed). Raises :class:`~aurora.policy.IllegalTransition` for an excluded Actor,
        changing nothing."""
        cfg = self.config
        rec = self.record(actor)
        failure = judge(measures, cfg, rec.ranks)
        versions = rec.versions
        if rec.state is not Trust.TRUSTED and version not in versions:
            versions = (*versions, version)[-cfg.probation_versions :]
        if failure is not None:
            trigger = "fail"
        elif measures.max_delta > cfg.suspect_ratio * cfg.token_tolerance:
            trigger = "suspect"
        elif (
            rec.state is not Trust.TRUSTED
            and rec.passed + 1 >= cfg.probation
            and len(versions) >= cfg.probation_versions
        ):
            trigger = "trust"
        else:
            trigger = "pass"
        new = step(MACHINE, TRANSITIONS, rec.state, trigger)  # raises before any change
        self.records[actor] = rec
        rec.state = new
        rec.checks += 1
        rec.ranks = rec.ranks.merge(measures.ranks)
        if trigger == "suspect":
            rec.passed = 0
            rec.versions = ()
        elif trigger != "fail":
            rec.passed += 1
            rec.versions = versions
        else:
            rec.failure = failure
        return failure
