"""When and on which version batches are requested; dispatch holds shares for late stagers."""

from aurora.policy import pacer as pacing
from aurora.policy.events import (
    ActorJoined,
    Assign,
    BatchRequested,
    DeltaPublished,
    DeltaStaged,
    Tick,
)
from aurora.policy.ledger import LedgerConfig, decide, initial_state


def _ledger(max_lag=1, actors=("a", "b")):
    state = initial_state(LedgerConfig(trainer_region="us", max_lag=max_lag))
    decide(
        state,
        DeltaPublished(version=0, weights_hash="h0", delta_bytes=None, snapshot_bytes=9),
        now=0,
    )
    for a in actors:
        decide(state, ActorJoined(actor=a, region="us", active=0), now=0)
    return state


def test_lowest_allowed_version_follows_the_lag_bound():
    assert [pacing.lowest_allowed(k, 1) for k in (1, 2, 3, 4)] == [0, 0, 1, 2]
    assert [pacing.lowest_allowed(k, 2) for k in (1, 2, 3, 4, 5)] == [0, 0, 0, 1, 2]


def test_batch_waits_for_the_trainer_then_takes_the_newest_version_everyone_holds():
    state = _ledger(max_lag=2)
    assert pacing.batch_version(state, 4) is None  # needs v1 published
    decide(state, DeltaPublished(version=1, weights_hash="h1", delta_bytes=5), now=1)
    assert pacing.batch_version(state, 4) == 1
    decide(state, DeltaPublished(version=2, weights_hash="h2", delta_bytes=5), now=2)
    # Actors still on v0 without v1 staged: the oldest allowed version, v1.
    assert pacing.batch_version(state, 4) == 1
    assert pacing.waiting_on(state, 1) == ["a", "b"]
    decide(state, DeltaStaged(actor="a", version=1), now=3)
    assert pacing.waiting_on(state, 1) == ["b"]
    assert not pacing.request_at(ready_since=2, waiting=["b"], grace_s=10, now=3)
    assert pacing.request_at(ready_since=2, waiting=["b"], grace_s=10, now=12)


def test_dispatch_holds_the_share_of_an_actor_still_staging_and_releases_it_after_the_hold():
    state = _ledger(actors=("a", "b"))
    decide(state, DeltaPublished(version=1, weights_hash="h1", delta_bytes=5), now=1)
    decide(state, DeltaStaged(actor="a", version=1), now=2)
    _, out = decide(
        state, BatchRequested(version=1, prompts=tuple(f"p{i}" for i in range(10))), now=3
    )
    assigns = [a for a in out if isinstance(a, Assign)]
    assert [(a.actor, len(a.leases)) for a in assigns] == [("a", 5)]  # b's 5 are held
    _, out = decide(state, DeltaStaged(actor="b", version=1), now=4)
    assert [(a.actor, len(a.leases)) for a in out if isinstance(a, Assign)] == [("b", 5)]


def test_held_shares_go_to_the_eligible_actors_once_the_hold_ends():
    state = _ledger(actors=("a", "b"))
    decide(state, DeltaPublished(version=1, weights_hash="h1", delta_bytes=5), now=1)
    decide(state, DeltaStaged(actor="a", version=1), now=2)
    decide(state, BatchRequested(version=1, prompts=tuple(f"p{i}" for i in range(10))), now=3)
    assert state.hold_until == 3 + 600
    _, out = decide(state, Tick(), now=604)
    # a's own 5 leases expired at 603 too (a never answered): all 10 go to a, b still staging.
    assert [(a.actor, len(a.leases)) for a in out if isinstance(a, Assign)] == [("a", 10)]
    assert state.book.pool_size == 0
