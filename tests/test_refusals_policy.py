"""Refusals count, and never kill (aurora/policy/refusals.py, the Ledger core, allocation): what
a result's completions may look like, every refused result one strike against its Actor up to
exclusion, and a throughput report counted only as far as the Actor's admitted results show."""

import copy
import math

import pytest

from aurora.policy import IllegalTransition, allocation
from aurora.policy.events import (
    ActorJoined,
    Assign,
    BatchRequested,
    DeltaPublished,
    Evicted,
    Refused,
    Released,
    ResultArrived,
    ResultMalformed,
    ResultRefused,
)
from aurora.policy.leases import Refusal
from aurora.policy.ledger import LedgerConfig, decide, initial_state
from aurora.policy.refusals import (
    DEFAULT_MAX_REFUSALS,
    Standing,
    StrikeBook,
    completion_fault,
    logprob_floor,
)

EOS = 2


def run(state, event, now=0.0):
    return decide(state, event, now=now)[1]


@pytest.fixture
def ledger():
    """v0 published; a1 and a2 in the Trainer's region; a batch of 8 prompts on v0 leased."""
    s = initial_state(LedgerConfig(trainer_region="us"))
    run(s, DeltaPublished(version=0, weights_hash="h0", delta_bytes=None, snapshot_bytes=1000))
    for actor in ("a1", "a2"):
        run(s, ActorJoined(actor=actor, region="us", active=0))
    run(s, BatchRequested(version=0, prompts=tuple(f"b1-{i}" for i in range(8))))
    return s


# ---- the payload rule ---------------------------------------------------------------------


def test_the_log_prob_floor_is_a_one_in_a_billion_token_event_for_an_honest_sampler():
    # ln(1e-9 / V) - 1 nat: V e^(floor + 1) = 1e-9 whatever V is.
    for v in (17, 1000, 151_936):
        assert math.isclose(v * math.exp(logprob_floor(v) + 1.0), 1e-9, rel_tol=1e-9)
    assert round(logprob_floor(17), 2) == -24.56 and round(logprob_floor(151_936), 2) == -33.65
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="vocab_size"):
            logprob_floor(bad)


@pytest.mark.parametrize(
    ("ids", "lps", "why"),
    [
        ([5, 7, EOS], [-1.0] * 3, None),
        ([5, 7, 9, 3], [-1.0] * 4, None),  # cut at the limit (4)
        ([5, EOS, 7], [-1.0] * 3, "after end-of-sequence"),
        ([5, 7], [-1.0] * 2, "without end-of-sequence"),
        ([], [], "no tokens"),
        ([5, EOS], [-1.0, -30.0], "below the plausible floor"),
        ([5, EOS], [math.nan, -1.0], "below the plausible floor"),
        ([5, EOS], [-math.inf, -1.0], "below the plausible floor"),
    ],
)
def test_a_completion_ends_at_its_first_eos_and_has_plausible_log_probs(ids, lps, why):
    got = completion_fault(ids, lps, eos_ids=(EOS,), max_new_tokens=4, floor=logprob_floor(17))
    assert (got is None) if why is None else (why in got), got


@pytest.mark.parametrize(
    ("ids", "why"),
    [
        ([5, 7, 9], None),  # ends at the second end id, below the limit
        ([5, EOS], None),
        ([9, 5, 7], "after end-of-sequence"),  # a token after the second end id
        ([5, 9, EOS], "after end-of-sequence"),
        ([EOS, 9], "after end-of-sequence"),
    ],
)
def test_a_completion_ends_at_the_first_of_any_of_the_models_end_ids(ids, why):
    """A model's generation config may name several end ids (Qwen3: <|im_end|> and
    <|endoftext|>), and every engine stops at each. Before, the rule knew the tokenizer's alone:
    an honest completion ending at the other was refused (a strike), and tokens after it passed."""
    got = completion_fault(
        ids, [-1.0] * len(ids), eos_ids=(EOS, 9), max_new_tokens=4, floor=logprob_floor(17)
    )
    assert (got is None) if why is None else (why in got), got


def test_what_is_not_known_is_not_checked():
    assert (
        completion_fault([5, EOS, 7], [-99.0] * 3, eos_ids=None, max_new_tokens=None, floor=None)
        is None
    )


# ---- strikes --------------------------------------------------------------------------------


def test_refusals_count_per_actor_up_to_exclusion_and_exclusion_is_final():
    book = StrikeBook()
    assert [book.strike("a", f"L{i}") for i in range(DEFAULT_MAX_REFUSALS)] == [False, False, True]
    assert book.excluded("a") and not book.excluded("b")
    before = copy.deepcopy(book)
    with pytest.raises(IllegalTransition):
        book.strike("a", "L9")
    assert book == before
    assert book.standing["a"] is Standing.EXCLUDED


def test_a_lease_counts_once_and_a_repeat_changes_nothing():
    book = StrikeBook(max_refusals=2)
    book.strike("a", "L1")
    before = copy.deepcopy(book)
    with pytest.raises(ValueError, match="counted already"):
        book.strike("a", "L1")  # a restarted Trainer telling the same refusal again
    assert book == before and not book.excluded("a")


def test_bad_refusal_limits_are_refused():
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="max_refusals"):
            StrikeBook(max_refusals=bad)
        with pytest.raises(ValueError, match="max_refusals"):
            LedgerConfig(trainer_region="us", max_refusals=bad)


def test_three_malformed_results_exclude_their_actor_and_every_prompt_is_leased_again(ledger):
    for n in range(DEFAULT_MAX_REFUSALS):
        lease = ledger.book.live("a1")[0]
        out = run(ledger, ResultMalformed(actor="a1", lease=lease.id), now=1.0 + n)
        assert out[0] == Refused(lease=lease.id, actor="a1", reason=Refusal.BAD_PAYLOAD)
    assert ledger.strikes.excluded("a1")
    evicted = [a for a in out if isinstance(a, Evicted)]
    assert evicted == [Evicted(actor="a1", reason="REFUSED")]
    released = {a.prompt for a in out if isinstance(a, Released)}
    assigned = {p for a in out if isinstance(a, Assign) for p in a.prompts}
    assert released <= assigned and all(a.actor == "a2" for a in out if isinstance(a, Assign))
    assert not ledger.book.live("a1") and not ledger.actors["a1"].live
    assert ledger.check_fraction("a1") is None  # nothing of it is trained after
    with pytest.raises(ValueError, match="refused results"):
        run(ledger, ActorJoined(actor="a1", region="us", active=0), now=9.0)
    ledger.book.check()


def test_the_trainers_refusals_of_admitted_results_count_too(ledger):
    leases = ledger.book.live("a1")
    for lease in leases[:2]:
        out = run(ledger, ResultArrived(actor="a1", lease=lease.id, version=0, weights_hash="h0"))
        assert out[0].__class__.__name__ == "Accepted"
    out = run(ledger, ResultRefused(actor="a1", lease=leases[0].id, why="gradient is nan"))
    assert out == [Refused(lease=leases[0].id, actor="a1", reason=Refusal.TRAINER_REFUSED)]
    state = copy.deepcopy(ledger.strikes)
    with pytest.raises(ValueError, match="counted already"):  # told again after a restart
        run(ledger, ResultRefused(actor="a1", lease=leases[0].id, why="gradient is nan"))
    assert ledger.strikes == state
    with pytest.raises(ValueError, match="not 'a2'"):  # another Actor's lease
        run(ledger, ResultRefused(actor="a2", lease=leases[1].id, why="x"))
    run(ledger, ResultRefused(actor="a1", lease=leases[1].id, why="x"))
    live = ledger.book.live("a1")[0]
    out = run(ledger, ResultMalformed(actor="a1", lease=live.id), now=2.0)
    assert Evicted(actor="a1", reason="REFUSED") in out


def test_an_excluded_actors_refusals_change_nothing(ledger):
    ledger.strikes.max_refusals = 1
    lease = ledger.book.live("a1")[0]
    run(ledger, ResultMalformed(actor="a1", lease=lease.id))
    with pytest.raises(ValueError, match="excluded"):
        run(ledger, ResultRefused(actor="a1", lease=lease.id, why="x"))
    with pytest.raises(ValueError, match="excluded"):
        run(ledger, ResultMalformed(actor="a1", lease=lease.id))


# ---- throughput ---------------------------------------------------------------------------


def test_a_throughput_claim_counts_only_as_far_as_admitted_results_show_it():
    # The lie: 2^40 tokens in 1e-9 s, beside 40 admitted tokens delivered in 0.5 s.
    got = allocation.bounded_throughput(2**40, 1e-9, shown_tokens=40, shown_seconds=0.5)
    assert got == (40, 0.25)  # at most THROUGHPUT_SLACK (2) times the rate the Ledger saw
    honest = allocation.bounded_throughput(40, 0.45, shown_tokens=40, shown_seconds=0.5)
    assert honest == (40, 0.45)  # an honest claim (generation within the span) is unchanged
    assert allocation.bounded_throughput(40, 0.1, shown_tokens=0, shown_seconds=0.5) is None
    assert allocation.bounded_throughput(40, 0.1, shown_tokens=40, shown_seconds=0.0) is None
    # Nothing admitted since (its leases expired): only a claim that lowers its estimate counts.
    slower = allocation.bounded_throughput(
        40, 1.0, shown_tokens=0, shown_seconds=0.0, estimate=80.0
    )
    assert slower == (40, 1.0)
    faster = allocation.bounded_throughput(
        2**40, 1e-9, shown_tokens=0, shown_seconds=0.0, estimate=80.0
    )
    assert faster is None
    with pytest.raises(ValueError):
        allocation.bounded_throughput(40, 0.1, shown_tokens=40, shown_seconds=1.0, slack=0.5)


def test_a_liar_beside_an_equally_fast_honest_actor_takes_at_most_two_thirds_of_a_batch():
    seen = 40 / 0.5  # both delivered 40 tokens in 0.5 s
    liar = allocation.bounded_throughput(2**40, 1e-9, shown_tokens=40, shown_seconds=0.5)
    assert liar is not None
    shares = allocation.split(30, {"liar": liar[0] / liar[1], "honest": seen}, ["honest", "liar"])
    assert shares == {"liar": 20, "honest": 10}
