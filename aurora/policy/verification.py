"""Verified rollouts: which admitted results the Trainer recomputes, what a recompute must show,
and what happens to an Actor whose result fails.

The acceptance predicate (:func:`aurora.policy.leases.admits`) checks *who* may return a result
and on *which* weights it claims to be generated; it cannot see whether the completions were
sampled from pi_v at all (made-up tokens, another model or version, forged behaviour log-probs).
The Trainer, which keeps the published bf16 weights of every version a result may claim,
recomputes the per-token log-probs of a sample of the admitted results under the claimed version
(:func:`plan`, :func:`pick_completions`: a keyed coin only the Trainer can compute, so an Actor
cannot tell which results or completions are looked at) and :func:`judge` decides on the
:class:`Measures` (log-prob differences, implausible tokens, and the ranks of
:mod:`aurora.policy.sampling`). Per Actor a record (:class:`TrustBook`) sets how often it is
checked and excludes it for good on a failure; every outcome is a logged event, so a replay of
the Ledger's log rebuilds the records. Each record is one state machine (``TRANSITIONS``); an
illegal move (a check of an excluded Actor) raises :class:`~aurora.policy.IllegalTransition`.
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
    """The verification rule of one job (:func:`judge`, :meth:`TrustBook.fraction`,
    :func:`pick_completions`)."""

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
    """Completions of a checked result that are recomputed (chosen by the keyed coin; all
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
    """The rule: None when the result passes. ``ranks``: the Actor's rank sums before this
    check (given, the sampling test runs on them with this check's added).

    The acceptance predicate checks *who* may return a result and on *which* weights it claims
    to be generated (lease, time, v, h(v)); an Actor holding the job secret and its own identity
    could still return made-up tokens, samples from another model or an older version, or honest
    tokens with forged behaviour log-probs (which steer the importance ratio of GRPO).

    **What is checked** (per result, over all its completions' tokens):

    * ``max |lp_reported - lp_recomputed| <= token_tolerance`` (nats): one forged or foreign
      token fails. The tolerance covers what two honest computations of the same bf16 weights
      differ by (an engine's batched KV-cache decode against the Trainer's single forward; fp32
      or bf16 arithmetic), measured per engine and set with a margin (docs/VERIFICATION.md).
    * ``mean |lp_reported - lp_recomputed| <= mean_tolerance`` (nats): a systematic shift
      (another version of the same model, whose tokens each differ a little) fails even when no
      single token is beyond the per-token bound; honest rounding noise averages out, a
      different policy does not.
    * ``min lp_recomputed >= implausible_logprob`` (nats): a sampled token whose probability
      under pi_v is vanishing (below ``exp(implausible_logprob)``) fails whatever the Actor
      reported. An honest Actor samples such a token at one position with probability at most
      ``V * exp(implausible_logprob)`` (V the vocabulary size): 1.4e-8 for V = 151,936 at -30.

    **Sampled, not chosen** (:mod:`aurora.policy.sampling`, per Actor): the recompute also gives
    each checked token's rank ``u`` under pi_v's sampling distribution (U(0, 1) for a sample);
    the Actor's record sums them over all its checks
    (:class:`~aurora.policy.sampling.RankStats`), and an Actor whose sums cross the
    always-valid boundary fails (``SAMPLING_DISTRIBUTION``): greedy, chosen or best-of-N tokens
    pass every recompute but rank too high, random ids too low.
    """
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


KEY_BYTES = 32
"""Length of a verification key (bytes)."""

COIN_PERSON = b"aurora-coin-v1"
"""BLAKE2b personalisation of the coin: its outputs are never another hash's."""


def payload_digest(payload: bytes) -> bytes:
    """h(payload): BLAKE2b-256 of a result's payload as the Ledger admitted it (the bytes it
    logged and hands the Trainer), one of the coin's inputs."""
    return hashlib.blake2b(payload, digest_size=32).digest()


def coin(key: bytes, *parts: str | bytes) -> float:
    """A number in [0, 1) fixed by ``key`` and ``parts``: keyed BLAKE2b (53 bits). Without
    ``key`` it is uniform and independent of ``parts``; each part is length-prefixed, so no two
    lists of parts hash alike. ValueError for a key that is not :data:`KEY_BYTES` long."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"a verification key is {KEY_BYTES} bytes")
    h = hashlib.blake2b(key=key, digest_size=8, person=COIN_PERSON)
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(4, "little"))
        h.update(data)
    return (int.from_bytes(h.digest(), "little") >> 11) / float(1 << 53)


def plan(key: bytes, fraction: float | None, actor: str, lease: str, payload_hash: bytes) -> Plan:
    """What the Trainer does with ``actor``'s admitted result for ``lease`` (its payload's
    :func:`payload_digest` ``payload_hash``), given the fraction of that Actor's results to
    check (:meth:`TrustBook.fraction`, sent by the Ledger; None: the Actor is excluded).

    The Ledger keeps the records and says each admitted result's fraction; the Trainer checks
    the result iff ``coin(key, actor, lease, h(payload)) < fraction``, and recomputes the
    completions :func:`pick_completions` names. ``coin`` is keyed BLAKE2b (a pseudo-random
    function) under the job's *verification key*, which only the Trainer holds (derived from its
    signing key: :func:`aurora.keys.verification_key`); ``h(payload)`` is the hash of the
    payload as the Ledger admitted it. Without the key the coin is uniform and independent of
    everything an Actor or a relay is sent (the job spec and its seed, the job id, ``welcome``,
    lease and prompt ids), so an Actor cannot tell which of its results or completions a check
    will look at before it returns them, nor grind a payload until one is not looked at. With
    the key, the choice needs no random state: the same after a restart of the Trainer or the
    Ledger, and in a replay.
    """
    if fraction is None:
        return Plan.DROP
    if coin(key, "result", actor, lease, payload_hash) < fraction:
        return Plan.CHECK
    return Plan.TRAIN


def pick_completions(
    config: VerificationConfig,
    key: bytes,
    actor: str,
    lease: str,
    payload_hash: bytes,
    group_size: int,
) -> tuple[int, ...]:
    """Which completions of ``actor``'s result for ``lease`` (``group_size`` of them, payload
    hash ``payload_hash``) a check recomputes: the ``config.completions`` (4) with the
    smallest keyed coins (:func:`plan`), in order.

    **How much of a result.** Every dishonest mode of the tests lies on every completion of a
    result it lies about; recomputing 4 of ``group_size`` 8 costs half a whole result's
    recompute, and an Actor that lies on ``j`` of 8 completions of a checked result escapes with
    probability ``C(8 - j, 4) / C(8, 4)`` (1/2 for one, 1/70 for four).
    """
    if group_size <= config.completions:
        return tuple(range(group_size))
    coins = sorted(
        range(group_size),
        key=lambda i: coin(key, "completion", actor, lease, payload_hash, str(i)),
    )
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
    """Every Actor's record; all moves go through :meth:`observe`.

    **What a failure does**: the result is refused (``Refusal.UNVERIFIED``), the Actor's record
    goes to ``EXCLUDED`` for good (no move leaves it), the Ledger releases its live leases to
    the pool, stops its membership and refuses it if it joins again
    (:mod:`aurora.policy.ledger`); the Trainer drops every result of that Actor in the batch it
    was checking, and every later result of it is marked ``DROP`` (the Ledger sends no fraction
    for it: :func:`plan`). Every outcome is a logged ``ResultVerified`` event, so the records
    (and the exclusion) are rebuilt by a replay of the Ledger's log.
    """

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
        """Fraction of ``actor``'s results to check now (0 when excluded: nothing is trained).

        Per Actor, from its record. A ``NEW`` Actor has every result checked
        (``new_fraction``) until ``probation`` checks passed on results of at least
        ``probation_versions`` distinct versions (an Actor frozen on old weights is honest on
        the version it froze at: checks on that version alone prove nothing); a ``SUSPECTED``
        one (a check that passed with a maximum difference above ``suspect_ratio`` of the
        tolerance) likewise; then ``TRUSTED`` at ``fraction``, halved every ``halving`` further
        passed checks down to ``min_fraction``.
        """
        cfg = self.config
        rec = self.record(actor)
        if rec.state is Trust.EXCLUDED:
            return 0.0
        if rec.state is not Trust.TRUSTED:
            return cfg.new_fraction
        halvings = (rec.passed - cfg.probation) // cfg.halving
        return max(cfg.min_fraction, cfg.fraction * 0.5 ** max(0, halvings))

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
