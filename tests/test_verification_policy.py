"""The verification rule (aurora/policy/verification.py) and its place in the Ledger's decision:
what a recompute must show, how often each Actor is checked, and what a failure does (exact
traces)."""

import asyncio
import dataclasses
import math

import pytest

from aurora.policy import IllegalTransition
from aurora.policy.core import LedgerCore
from aurora.policy.events import (
    ActorJoined,
    Assign,
    BatchRequested,
    DeltaPublished,
    Evicted,
    Refused,
    Released,
    ResultArrived,
    ResultVerified,
    event_from_record,
    to_record,
)
from aurora.policy.leases import LeaseConfig, Refusal
from aurora.policy.ledger import LedgerConfig
from aurora.policy.membership import ActorLife
from aurora.policy.verification import (
    CheckFailure,
    Measures,
    Plan,
    Trust,
    TrustBook,
    VerificationConfig,
    coin,
    judge,
    measure,
    payload_digest,
    pick_completions,
    plan,
)

CFG = VerificationConfig(fraction=0.25, halving=32, min_fraction=0.05, suspect_ratio=0.5)
KEY = bytes(range(32))
"""A verification key (the Trainer's: :func:`aurora.keys.verification_key`)."""
PH = payload_digest(b"the admitted payload")
HONEST = Measures(max_delta=1e-5, mean_delta=1e-6, min_logprob=-9.0, tokens=40)


def test_an_honest_result_passes_and_each_bound_fails_with_its_own_reason():
    assert judge(HONEST, CFG) is None
    forged = dataclasses.replace(HONEST, max_delta=CFG.token_tolerance * 1.01)
    assert judge(forged, CFG) is CheckFailure.TOKEN_MISMATCH
    shifted = dataclasses.replace(HONEST, mean_delta=CFG.mean_tolerance * 1.01)
    assert judge(shifted, CFG) is CheckFailure.MEAN_MISMATCH
    implausible = dataclasses.replace(HONEST, min_logprob=CFG.implausible_logprob - 0.1)
    assert judge(implausible, CFG) is CheckFailure.IMPLAUSIBLE_TOKEN
    assert judge(dataclasses.replace(HONEST, max_delta=math.nan), CFG) is (
        CheckFailure.TOKEN_MISMATCH
    )


def test_measure_takes_the_largest_and_mean_difference_and_the_lowest_recomputed_logprob():
    m = measure([[-1.0, -2.0], [-0.5]], [[-1.1, -2.0], [-0.5 - 0.4]])
    assert m.tokens == 3
    assert m.max_delta == pytest.approx(0.4)
    assert m.mean_delta == pytest.approx(0.5 / 3)
    assert m.min_logprob == -2.0
    # A token of probability 0 under pi_v is a finite, failing number.
    m = measure([[-1.0]], [[-math.inf]])
    assert m.min_logprob == -1e9 and judge(m, CFG) is CheckFailure.IMPLAUSIBLE_TOKEN
    with pytest.raises(ValueError, match="shape"):
        measure([[-1.0]], [[-1.0, -2.0]])


def test_a_new_actor_is_checked_always_then_less_as_it_keeps_passing_down_to_the_floor():
    book = TrustBook(CFG)
    fractions = []
    for i in range(CFG.probation + 4 * CFG.halving + 1):
        fractions.append(book.fraction("a"))
        assert book.observe("a", HONEST, i // 3) is None
    assert fractions[: CFG.probation] == [1.0] * CFG.probation
    assert book.record("a").state is Trust.TRUSTED
    p = CFG.probation
    assert fractions[p] == 0.25 and fractions[p + CFG.halving - 1] == 0.25
    assert fractions[p + CFG.halving] == 0.125
    assert fractions[p + 2 * CFG.halving] == 0.0625
    assert fractions[p + 3 * CFG.halving] == CFG.min_fraction  # 0.03125 is below the floor
    assert book.fraction("someone else") == 1.0


def test_a_near_miss_makes_a_trusted_actor_suspected_and_checked_always_again():
    book = TrustBook(CFG)
    for i in range(CFG.probation):
        book.observe("a", HONEST, i)
    assert book.fraction("a") == 0.25
    near = dataclasses.replace(HONEST, max_delta=CFG.token_tolerance * 0.9)
    assert book.observe("a", near, 9) is None
    assert book.record("a").state is Trust.SUSPECTED and book.fraction("a") == 1.0
    for i in range(CFG.probation):
        book.observe("a", HONEST, i)
    assert book.record("a").state is Trust.TRUSTED


def test_checks_on_one_version_alone_never_end_probation():
    # An Actor frozen on old weights is honest on the version it froze at.
    book = TrustBook(CFG)
    for _ in range(3 * CFG.probation):
        book.observe("a", HONEST, 0)
    assert book.record("a").state is Trust.NEW and book.fraction("a") == 1.0
    book.observe("a", HONEST, 1)
    assert book.record("a").state is Trust.NEW
    book.observe("a", HONEST, 2)
    assert book.record("a").state is Trust.TRUSTED


def test_which_results_are_checked_is_fixed_by_key_actor_lease_and_payload_at_the_stated_rate():
    book = TrustBook(CFG)
    for i in range(CFG.probation):
        book.observe("a", HONEST, i)
    f = book.fraction("a")
    assert f == 0.25
    plans = [plan(KEY, f, "a", f"L{i}", PH) for i in range(20000)]
    assert plans == [plan(KEY, f, "a", f"L{i}", PH) for i in range(20000)]  # no hidden state
    checked = plans.count(Plan.CHECK)
    # Binomial(20000, 0.25): mean 5000, sd 61; 5 sd either side.
    assert 5000 - 306 < checked < 5000 + 306
    assert checked == sum(coin(KEY, "result", "a", f"L{i}", PH) < 0.25 for i in range(20000))
    # Another key, or another payload for the same lease, is another coin.
    other = bytes(31) + b"\x01"
    assert [plan(other, f, "a", f"L{i}", PH) for i in range(200)] != plans[:200]
    ph2 = payload_digest(b"another payload")
    assert [plan(KEY, f, "a", f"L{i}", ph2) for i in range(200)] != plans[:200]
    # None: the Actor is excluded; 0: verification off (nothing checked).
    assert plan(KEY, None, "a", "L1", PH) is Plan.DROP
    assert {plan(KEY, 0.0, "a", f"L{i}", PH) for i in range(200)} == {Plan.TRAIN}


def test_the_coin_refuses_a_key_that_is_not_32_bytes_and_never_confuses_its_parts():
    for bad in (b"", bytes(16), bytes(33), "x" * 32):
        with pytest.raises(ValueError):
            coin(bad, "a")  # type: ignore[arg-type]
    # Length-prefixed parts: moving a separator between them moves the coin.
    assert coin(KEY, "a|b", "c") != coin(KEY, "a", "b|c")
    assert 0.0 <= coin(KEY, "a") < 1.0


def test_a_check_recomputes_keyed_completions_of_a_group_and_all_of_a_small_one():
    cfg = dataclasses.replace(CFG, completions=2)
    picks = [pick_completions(cfg, KEY, "a", f"L{i}", PH, 8) for i in range(400)]
    assert all(len(p) == 2 and p == tuple(sorted(set(p))) for p in picks)
    assert picks == [pick_completions(cfg, KEY, "a", f"L{i}", PH, 8) for i in range(400)]
    # Every completion is picked about equally often (400 x 2 picks of 8: 100 each, sd ~9).
    counts = [sum(j in p for p in picks) for j in range(8)]
    assert all(55 < c < 145 for c in counts), counts
    assert pick_completions(CFG, KEY, "a", "L1", PH, 4) == (0, 1, 2, 3)
    assert len(pick_completions(CFG, KEY, "a", "L1", PH, 8)) == CFG.completions == 4
    assert pick_completions(
        dataclasses.replace(CFG, completions=8), KEY, "a", "L1", PH, 8
    ) == tuple(range(8))


def test_a_failed_check_excludes_for_good_and_a_check_after_it_raises_and_changes_nothing():
    book = TrustBook(CFG)
    bad = dataclasses.replace(HONEST, max_delta=3.0)
    assert book.observe("a", bad, 0) is CheckFailure.TOKEN_MISMATCH
    rec = book.record("a")
    assert (rec.state, rec.failure, rec.checks) == (Trust.EXCLUDED, CheckFailure.TOKEN_MISMATCH, 1)
    before = dataclasses.replace(rec)
    with pytest.raises(IllegalTransition):
        book.observe("a", HONEST, 0)
    assert book.record("a") == before
    assert book.fraction("a") == 0.0


def test_the_default_bounds_sit_between_the_measured_honest_and_dishonest_differences():
    # docs/journal/verification-measurements.md, 2,048 honest results, 4 completions checked:
    # largest token / mean |delta| 8.8e-6 / 1.9e-6 (transformers engine), 0.32 (of all 8
    # completions) / 0.023 (vLLM CPU build); a randomly initialised model of the same tokenizer:
    # mean >= 4.0 per result.
    cfg = VerificationConfig()
    for honest_max, honest_mean in ((8.8e-6, 1.9e-6), (0.32, 0.023)):
        m = Measures(max_delta=honest_max, mean_delta=honest_mean, min_logprob=-11.5, tokens=9)
        assert judge(m, cfg) is None
        assert honest_max * 3 < cfg.token_tolerance and honest_mean * 3 < cfg.mean_tolerance
        assert honest_max < cfg.suspect_ratio * cfg.token_tolerance  # not even suspected
    other = Measures(max_delta=11.6, mean_delta=4.0, min_logprob=-14.0, tokens=9)
    assert judge(other, cfg) is CheckFailure.TOKEN_MISMATCH


def test_the_config_refuses_bounds_that_cannot_work():
    for bad in (
        {"token_tolerance": 0.0},
        {"mean_tolerance": math.inf},
        {"implausible_logprob": 1.0},
        {"fraction": 0.0},
        {"min_fraction": 0.5},
        {"probation": 0},
        {"suspect_ratio": 1.5},
    ):
        with pytest.raises(ValueError):
            VerificationConfig(**bad)


# -- in the Ledger's decision ------------------------------------------------------------------


def ledger(verification=CFG) -> tuple[LedgerCore, list]:
    core = LedgerCore(
        LedgerConfig(
            trainer_region="us",
            lease=LeaseConfig(initial_s=30.0),
            verification=verification,
        )
    )
    core.feed(
        DeltaPublished(version=0, weights_hash="h0", delta_bytes=None, snapshot_bytes=9), now=0
    )
    for a in ("a", "b"):
        core.feed(ActorJoined(actor=a, region="us", active=0), now=0)
    actions = core.feed(BatchRequested(version=0, prompts=tuple(f"p{i}" for i in range(6))), now=1)
    return core, [x for x in actions if isinstance(x, Assign)]


def verified(actor: str, lease: str, max_delta: float) -> ResultVerified:
    return ResultVerified(
        actor=actor,
        lease=lease,
        version=0,
        max_delta=max_delta,
        mean_delta=max_delta / 10,
        min_logprob=-5.0,
        tokens=12,
    )


def test_a_failed_check_refuses_the_result_releases_the_actors_leases_and_excludes_it():
    core, assigns = ledger()
    assert [(a.actor, a.leases) for a in assigns] == [
        ("a", ("L1", "L2", "L3")),
        ("b", ("L4", "L5", "L6")),
    ]
    core.feed(ResultArrived(actor="a", lease="L1", version=0, weights_hash="h0"), now=2)
    assert core.check_fraction("a") == 1.0  # a NEW Actor: every result
    actions = core.feed(verified("a", "L1", 2.0), now=3)
    assert actions == [
        Refused(lease="L1", actor="a", reason=Refusal.UNVERIFIED),
        Released(lease="L2", actor="a", prompt="p1"),
        Released(lease="L3", actor="a", prompt="p2"),
        Evicted(actor="a", reason="TOKEN_MISMATCH"),
        Assign(actor="b", version=0, leases=("L7", "L8"), prompts=("p1", "p2"), expiry=33.0),
    ]
    assert core.state.actors["a"].life is ActorLife.GONE
    assert core.check_fraction("a") is None  # dropped
    # It cannot come back under its id; the refusal changes nothing.
    snapshot = (core.state.actors["a"].life, core.state.book.pool_size)
    with pytest.raises(ValueError, match="excluded"):
        core.feed(ActorJoined(actor="a", region="us", active=0), now=4)
    with pytest.raises(IllegalTransition):
        core.feed(verified("a", "L1", 0.0), now=4)
    assert (core.state.actors["a"].life, core.state.book.pool_size) == snapshot


def test_a_passed_check_changes_nothing_but_the_actors_record():
    core, _ = ledger()
    core.feed(ResultArrived(actor="a", lease="L1", version=0, weights_hash="h0"), now=2)
    assert core.feed(verified("a", "L1", 1e-5), now=3) == []
    assert core.state.trust.record("a").passed == 1
    assert core.state.trust.record("b").passed == 0


def test_a_check_of_another_actors_lease_or_with_verification_off_is_refused():
    core, _ = ledger()
    with pytest.raises(ValueError, match="not 'b'"):
        core.feed(verified("b", "L1", 0.0), now=2)
    off, _ = ledger(verification=None)
    with pytest.raises(ValueError, match="off"):
        off.feed(verified("a", "L1", 0.0), now=2)
    assert off.check_fraction("a") == 0.0


def test_the_exclusion_is_rebuilt_by_replaying_the_events_from_their_records():
    core, _ = ledger()
    events = [
        ResultArrived(actor="a", lease="L1", version=0, weights_hash="h0"),
        verified("a", "L1", 2.0),
    ]
    for e in events:
        core.feed(e, now=3)
    again, _ = ledger()
    for e in events:
        again.feed(event_from_record(to_record(e)), now=3)
    assert again.state == core.state
    assert again.state.trust.excluded("a")


def test_a_restarted_ledger_service_keeps_the_exclusion_from_its_log(tmp_path):
    from aurora.runtime.ledger.config import LedgerServiceConfig
    from aurora.runtime.ledger.service import LedgerService

    config = LedgerServiceConfig(
        policy=LedgerConfig(trainer_region="us", verification=CFG),
        log_path=str(tmp_path / "ledger.db"),
    )

    async def first() -> LedgerService:
        svc = LedgerService(config, clock=lambda: 1000.0)
        svc.feed(DeltaPublished(version=0, weights_hash="h0", delta_bytes=None, snapshot_bytes=9))
        svc.feed(ActorJoined(actor="a", region="us", active=0))
        svc.feed(BatchRequested(version=0, prompts=("p0",)))
        svc.feed(ResultArrived(actor="a", lease="L1", version=0, weights_hash="h0"))
        svc.feed(verified("a", "L1", 2.0))
        return svc

    before = asyncio.run(first())
    assert before.state.trust.excluded("a")
    after = LedgerService(config, clock=lambda: 2000.0)
    assert after.replay() > 0
    assert after.state.trust.excluded("a") and after.state.trust == before.state.trust
    assert after.feed(ActorJoined(actor="a", region="us", active=0)) == []  # refused, logged
    assert after.state.actors["a"].life is ActorLife.GONE
