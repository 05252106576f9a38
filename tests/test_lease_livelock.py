"""Leases that cannot livelock (issue 26): the lease length adapts from expiries as well as
admissions, per Actor, so a slow Actor left alone after a fast one shrank the median still gets
results admitted. Driven through ``decide`` as the simulator and the runtime drive it."""

from __future__ import annotations

import heapq

import pytest

from aurora.policy.leases import LeaseBook, LeaseConfig, Refusal
from aurora.policy.ledger import (
    Accepted,
    ActorJoined,
    ActorLeft,
    Assign,
    BatchRequested,
    DeltaPublished,
    LedgerConfig,
    ResultArrived,
    ThroughputObserved,
    Tick,
    decide,
    initial_state,
)

TICK_SLACK_S = 0.05
"""The runtime checks a lease this long after its expiry (aurora.runtime.ledger)."""


def _drive(state, first_actions, now, *, needs, until):
    """Play the Ledger's loop from ``now`` to ``until`` (s): every Assign makes its Actor return
    a result for each of its leases ``needs[actor]`` seconds after the claim (whether or not the
    lease is still live: an Actor does not know), and a Tick runs just after each expiry, as
    the runtime schedules it. Returns the admitted results per Actor."""
    queue: list[tuple[float, int, object]] = []
    seq = 0
    admitted: dict[str, int] = {}

    def handle(actions, t):
        nonlocal seq
        for a in actions:
            if isinstance(a, Assign):
                for lease in a.leases:
                    seq += 1
                    event = ResultArrived(
                        actor=a.actor, lease=lease, version=a.version, weights_hash="h0"
                    )
                    heapq.heappush(queue, (t + needs[a.actor], seq, event))
                seq += 1
                heapq.heappush(queue, (a.expiry + TICK_SLACK_S, seq, Tick()))
            elif isinstance(a, Accepted):
                admitted[a.actor] = admitted.get(a.actor, 0) + 1

    handle(first_actions, now)
    while queue and queue[0][0] <= until:
        t, _, event = heapq.heappop(queue)
        _, actions = decide(state, event, now=t)
        handle(actions, t)
    return admitted


def _fast_then_slow(config: LedgerConfig):
    """A fast Actor (0.2 s a prompt) and a slow one (5 s) share batch 1 on v0; the fast one's
    many quick completions take the median to 0.2 s (L = max(1 s, 2.5 x 0.2 s) = 1 s); then it
    leaves, and batch 2 goes to the slow one alone."""
    s = initial_state(config)
    decide(
        s,
        DeltaPublished(version=0, weights_hash="h0", delta_bytes=None, snapshot_bytes=1000),
        now=0.0,
    )
    for actor in ("fast", "slow"):
        decide(s, ActorJoined(actor=actor, region="us", active=0), now=0.0)
    # Throughput 25:1, so the fast Actor takes most of batch 1 and most completions are its.
    decide(s, ThroughputObserved(actor="fast", tokens=25_000, seconds=1.0), now=0.5)
    decide(s, ThroughputObserved(actor="slow", tokens=1_000, seconds=1.0), now=0.5)
    needs = {"fast": 0.2, "slow": 5.0}
    _, actions = decide(
        s, BatchRequested(version=0, prompts=tuple(f"a{i}" for i in range(40))), now=1.0
    )
    _drive(s, actions, 1.0, needs=needs, until=30.0)
    assert all(p in s.book.done for p in (f"a{i}" for i in range(40)))
    assert s.book.lease_length() == pytest.approx(1.0)  # the median shrank to the fast Actor's
    decide(s, ActorLeft(actor="fast"), now=31.0)
    _, actions = decide(
        s, BatchRequested(version=0, prompts=tuple(f"b{i}" for i in range(4))), now=32.0
    )
    return s, actions, needs


def test_a_slow_actor_left_alone_after_a_fast_one_shrank_the_median_still_makes_progress():
    """The attack of issue 26 (also without malice: the fast Actor preempted). Before, every
    lease of the slow Actor was 1 s long, each of its results came after 5 s, none was admitted
    and the batch never completed (76 expiries in the attack's run)."""
    s, actions, needs = _fast_then_slow(LedgerConfig(trainer_region="us"))
    admitted = _drive(s, actions, 32.0, needs=needs, until=32.0 + 120.0)
    assert admitted.get("slow", 0) >= 4
    assert all(f"b{i}" in s.book.done for i in range(4))
    # Expiries doubled its leases 1 -> 2 -> 4 -> 8 s: admitted within four rounds.
    done_at = max(s.book.leases[lid].claimed_at for lid in s.book.done.values())
    assert done_at - 32.0 < 1 + 2 + 4 + 2 * TICK_SLACK_S + 1e-6


def test_after_its_first_admission_a_slow_actor_keeps_leases_as_long_as_it_needed():
    """The floor: once one of its leases expired, an Actor's leases are never shorter than the
    longest completion it was admitted with, so the fast Actors' median does not starve it
    again (no new round of expiries per batch)."""
    s, actions, needs = _fast_then_slow(LedgerConfig(trainer_region="us"))
    _drive(s, actions, 32.0, needs=needs, until=32.0 + 60.0)
    assert s.book.lease_length() == pytest.approx(1.0)  # the median alone is still the fast one's
    assert s.book.lease_length("slow") >= needs["slow"]
    _, actions = decide(s, BatchRequested(version=0, prompts=("c0", "c1")), now=100.0)
    expiries = {a.expiry - 100.0 for a in actions if isinstance(a, Assign)}
    assert expiries and min(expiries) >= needs["slow"]


def test_where_no_lease_expires_every_lease_length_is_the_median_rules():
    book = LeaseBook(LeaseConfig(min_samples=2))
    book.add([f"p{i}" for i in range(6)], 0)
    for actor, took in (("a", 4.0), ("b", 0.5), ("b", 0.5)):
        (lease,) = book.claim(actor, 1, version=0, weights_hash="h", now=0.0)
        assert book.settle(lease.id, actor=actor, version=0, weights_hash="h", now=took).admitted
    # The median is 0.5 s (L = max(1, 1.25)); "a" once needed 4 s, but none of its leases
    # expired, so its leases follow the median rule exactly as before.
    assert book.lease_length("a") == book.lease_length() == pytest.approx(1.25)


def test_an_expired_lease_grows_its_holders_next_leases_up_to_max_s_and_only_its_holders():
    book = LeaseBook(LeaseConfig(initial_s=10.0, max_s=25.0))
    book.add([f"p{i}" for i in range(8)], 0)
    (lease,) = book.claim("a", 1, version=0, weights_hash="h", now=0.0)
    book.expire_due(11.0)
    assert book.lease_length("a") == pytest.approx(20.0) and book.lease_length("b") == 10.0
    (lease,) = book.claim("a", 1, version=0, weights_hash="h", now=11.0)
    assert lease.expiry == pytest.approx(31.0)
    book.expire_due(32.0)
    assert book.lease_length("a") == pytest.approx(25.0)  # 40 s, capped at max_s


def test_a_late_result_sets_its_holders_floor_to_what_it_measured():
    book = LeaseBook(LeaseConfig(initial_s=2.0, max_s=60.0))
    book.add(["p0", "p1"], 0)
    (lease,) = book.claim("a", 1, version=0, weights_hash="h", now=0.0)
    verdict = book.settle(lease.id, actor="a", version=0, weights_hash="h", now=7.0)
    assert verdict.refusal is Refusal.LATE
    assert book.lease_length("a") == pytest.approx(7.0)  # 2 x 2 s grown, 7 s measured


def test_a_lease_config_refuses_a_growth_that_would_not_grow():
    with pytest.raises(ValueError, match="expiry_growth"):
        LeaseConfig(expiry_growth=1.0)
    with pytest.raises(ValueError, match="own_window"):
        LeaseConfig(own_window=0)


def test_by_default_expiries_grow_leases_no_longer_than_the_initial_length():
    """A dead Actor's leases expire too: should it rejoin and die again, its prompts are held
    no longer than before anything was known."""
    book = LeaseBook(LeaseConfig(initial_s=10.0))
    book.add(["p0", "p1"], 0)
    book.claim("a", 1, version=0, weights_hash="h", now=0.0)
    book.expire_due(11.0)
    assert book.lease_length("a") == pytest.approx(10.0)  # 2 x 10 s, capped at initial_s
    with pytest.raises(ValueError, match="max_s"):
        LeaseConfig(max_s=0.0)
