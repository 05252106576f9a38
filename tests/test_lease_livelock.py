"""Leases that cannot livelock: the lease length adapts from expiries as well as admissions, per
Actor, so a slow Actor left alone after a fast one shrank the median still gets results
admitted. Driven through ``decide`` as the simulator and the runtime drive it; the serial
Actors below decide what to run next with :func:`aurora.policy.actor.next_action`, as the
simulator's and the runtime's do."""

from __future__ import annotations

import heapq
import math
from collections import deque

import pytest

from aurora.policy.actor import Drop, Generate, Wait, Work, next_action
from aurora.policy.leases import Claim, LeaseBook, LeaseConfig, Refusal
from aurora.policy.ledger import (
    Accepted,
    ActorJoined,
    ActorLeft,
    Assign,
    BatchRequested,
    DeltaPublished,
    Expired,
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
        (lease,) = book.claim([Claim(actor, 1, 0, "h")], now=0.0)[0]
        assert book.settle(lease.id, actor=actor, version=0, weights_hash="h", now=took).admitted
    # The median is 0.5 s (L = max(1, 1.25)); "a" once needed 4 s, but none of its leases
    # expired, so its leases follow the median rule exactly as before.
    assert book.lease_length("a") == book.lease_length() == pytest.approx(1.25)


def test_an_expired_lease_grows_its_holders_next_leases_up_to_max_s_and_only_its_holders():
    book = LeaseBook(LeaseConfig(initial_s=10.0, max_s=25.0))
    book.add([f"p{i}" for i in range(8)], 0)
    (lease,) = book.claim([Claim("a", 1, 0, "h")], now=0.0)[0]
    book.expire_due(11.0)
    assert book.lease_length("a") == pytest.approx(20.0) and book.lease_length("b") == 10.0
    (lease,) = book.claim([Claim("a", 1, 0, "h")], now=11.0)[0]
    assert lease.expiry == pytest.approx(31.0)
    book.expire_due(32.0)
    assert book.lease_length("a") == pytest.approx(25.0)  # 40 s, capped at max_s


def test_a_late_result_sets_its_holders_floor_to_what_it_measured():
    book = LeaseBook(LeaseConfig(initial_s=2.0, max_s=60.0))
    book.add(["p0", "p1"], 0)
    (lease,) = book.claim([Claim("a", 1, 0, "h")], now=0.0)[0]
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
    book.claim([Claim("a", 1, 0, "h")], now=0.0)
    book.expire_due(11.0)
    assert book.lease_length("a") == pytest.approx(10.0)  # 2 x 10 s, capped at initial_s
    with pytest.raises(ValueError, match="max_s"):
        LeaseConfig(max_s=0.0)


class SerialActors:
    """Actors that generate one assignment at a time, as the runtime's and the simulator's do:
    each ``Assign`` queues a :class:`Work` with its expiry; at every safe point the Actor asks
    :func:`next_action` (with ``now`` and its recent generations, or, with ``skip=False``,
    without them: the Actor before it dropped work no longer worth starting); a generation of
    any number of leases takes ``needs[actor]`` seconds (an engine that batches them), and
    every lease's result arrives when it ends, whether or not the lease is still live."""

    def __init__(self, state, needs: dict[str, float], *, skip: bool = True) -> None:
        self.state, self.needs, self.skip = state, needs, skip
        self.queue: dict[str, deque[Work]] = {a: deque() for a in needs}
        self.busy: set[str] = set()
        self.recent: dict[str, list[tuple[int, float]]] = {a: [] for a in needs}
        self.events: list[tuple[float, int, object]] = []
        self.seq = 0
        self.admitted: list[tuple[float, str, str]] = []
        """(time, actor, prompt) of every admitted result."""
        self.expired: list[tuple[float, str]] = []
        """(time, lease) of every expiry."""
        self.length: dict[str, float] = {}
        """Lease -> its length (s) as the Ledger set it."""
        self.gone: set[str] = set()

    def _at(self, t: float, item: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, item))

    def handle(self, actions, t: float) -> None:
        for a in actions:
            if isinstance(a, Assign):
                self.queue[a.actor].append(Work(a.version, a.leases, a.expiry))
                self.length.update(dict.fromkeys(a.leases, a.expiry - t))
                self._at(a.expiry + TICK_SLACK_S, Tick())
                self._at(t, ("safe point", a.actor))
            elif isinstance(a, Accepted):
                self.admitted.append((t, a.actor, a.prompt))
            elif isinstance(a, Expired):
                self.expired.append((t, a.lease))

    def _safe_point(self, actor: str, t: float) -> None:
        if actor in self.busy or actor in self.gone:
            return
        queue = self.queue[actor]
        while True:
            decision = next_action(
                active=0,
                staged=(),
                queue=queue,
                now=t if self.skip else None,
                recent=self.recent[actor],
            )
            if isinstance(decision, Drop):
                queue.popleft()
                continue
            if isinstance(decision, Wait):
                return
            assert isinstance(decision, Generate)
            work = queue.popleft()
            self.busy.add(actor)
            self.recent[actor].append((len(work.leases), self.needs[actor]))
            self._at(t + self.needs[actor], ("finished", actor, work))
            return

    def run(self, first_actions, now: float, *, until: float) -> None:
        self.handle(first_actions, now)
        while self.events and self.events[0][0] <= until:
            t, _, item = heapq.heappop(self.events)
            if isinstance(item, Tick):
                _, actions = decide(self.state, item, now=t)
                self.handle(actions, t)
                continue
            if item[0] == "safe point":
                self._safe_point(item[1], t)
                continue
            _, actor, work = item
            self.busy.discard(actor)
            if actor in self.gone:
                continue
            for lease in work.leases:
                event = ResultArrived(
                    actor=actor, lease=lease, version=work.version, weights_hash="h0"
                )
                _, actions = decide(self.state, event, now=t)
                self.handle(actions, t)
            self._safe_point(actor, t)


def _fast_then_slow_serial(*, skip: bool) -> tuple[SerialActors, float, float]:
    """The scenario of :func:`_fast_then_slow` with serial Actors: a fast Actor (0.2 s a
    generation) and a slow one (5 s) share batch 1; the fast one's completions take the median
    to 0.2 s (L = max(1 s, 2.5 x 0.2 s) = 1 s); it leaves, and batch 2 (4 prompts) goes to the
    slow one alone. Returns the Actors, L and the time batch 2 was requested."""
    s = initial_state(LedgerConfig(trainer_region="us"))
    decide(
        s,
        DeltaPublished(version=0, weights_hash="h0", delta_bytes=None, snapshot_bytes=1000),
        now=0.0,
    )
    for actor in ("fast", "slow"):
        decide(s, ActorJoined(actor=actor, region="us", active=0), now=0.0)
    decide(s, ThroughputObserved(actor="fast", tokens=25_000, seconds=1.0), now=0.5)
    decide(s, ThroughputObserved(actor="slow", tokens=1_000, seconds=1.0), now=0.5)
    actors = SerialActors(s, {"fast": 0.2, "slow": 5.0}, skip=skip)
    _, actions = decide(
        s, BatchRequested(version=0, prompts=tuple(f"a{i}" for i in range(40))), now=1.0
    )
    actors.run(actions, 1.0, until=30.0)
    assert all(f"a{i}" in s.book.done for i in range(40))
    length = s.book.lease_length()
    assert length == pytest.approx(1.0)
    actors.gone.add("fast")
    decide(s, ActorLeft(actor="fast"), now=31.0)
    _, actions = decide(
        s, BatchRequested(version=0, prompts=tuple(f"b{i}" for i in range(4))), now=32.0
    )
    actors.run(actions, 32.0, until=32.0 + 120.0)
    s.book.check()
    return actors, length, 32.0


def _rounds(actors: SerialActors, after: float) -> list[float]:
    """The length of the leases of each round of expiry after ``after`` (s), in order."""
    rounds: dict[float, float] = {}
    for t, lease in actors.expired:
        if t > after:
            rounds[t] = max(rounds.get(t, 0.0), actors.length[lease])
    return [rounds[t] for t in sorted(rounds)]


def test_a_serial_actor_left_alone_is_admitted_within_log2_t_over_l_rounds_and_one_generation():
    """The design's bound, for an Actor that generates one assignment at a time and needs T
    seconds: every expiry at least doubles its leases, so it is admitted after at most
    floor(log2(T / L)) + 1 rounds of expiry; and since it drops work it can no longer finish
    in time instead of generating it, the batch completes within the expired leases' lengths
    (each at most T, each at least twice the one before: less than 2T together), the ticks
    that found them expired, and one generation: sum(l) + r x tick + T < 3T + r x tick. Here
    T = 5 s, L = 1 s: 2 rounds (1 s, then 5 s: the longest completion it was admitted with),
    11.1 s, where the Actor that ran its backlog in order took 15 s (the next test)."""
    actors, length, asked = _fast_then_slow_serial(skip=True)
    batch = {f"b{i}" for i in range(4)}
    assert {p for _, _, p in actors.admitted} >= batch
    stall = max(t for t, _, p in actors.admitted if p in batch) - asked
    need = actors.needs["slow"]
    rounds = _rounds(actors, asked)
    assert 1 <= len(rounds) <= math.floor(math.log2(need / length)) + 1
    assert all(r <= need for r in rounds)
    bound = sum(rounds) + len(rounds) * TICK_SLACK_S + need
    assert stall <= bound + 1e-6
    assert bound < 3 * need + len(rounds) * TICK_SLACK_S
    assert stall == pytest.approx(11.1)


def test_an_actor_that_runs_its_expired_backlog_in_order_stalls_past_the_design_bound():
    """Without the rule (the Actor runs its backlog of expired assignments in order, as it did
    before it asked :func:`next_action` with the time), the lease that would have been admitted
    waits behind a generation that can only be refused late: 15 s, beyond the bound the
    previous test holds."""
    actors, length, asked = _fast_then_slow_serial(skip=False)
    stall = max(t for t, _, p in actors.admitted if p.startswith("b")) - asked
    rounds = _rounds(actors, asked)
    assert stall > sum(rounds) + len(rounds) * TICK_SLACK_S + actors.needs["slow"] + 1.0
