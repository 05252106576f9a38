"""The policy core's batched paths decide exactly as their one-at-a-time ones.

``LedgerCore.feed_each`` (many Actors' reports at one instant: a cohort of the simulator staging
or activating a version) must leave the same state and return the same actions as ``feed`` called
for each event in turn, including when one event is refused (the ones before it decided, it and
the rest not); the positional makers of :mod:`aurora.policy.makers` must build the objects the
classes' own constructors build. Random runs of mixed reports, from Actors on different versions
with a batch's pool held back or empty, check it event by event.
"""

from __future__ import annotations

import contextlib
import copy
import random
from dataclasses import fields

import pytest

from aurora.policy.actor import Generate, Wait, Work, next_action
from aurora.policy.core import LedgerCore
from aurora.policy.events import (
    Accepted,
    ActorJoined,
    Assign,
    BatchRequested,
    CaughtUp,
    Commit,
    DeltaPublished,
    DeltaStaged,
    ResultsArrived,
    ThroughputObserved,
    VersionActivated,
)
from aurora.policy.ledger import LedgerConfig
from aurora.policy.makers import maker
from aurora.policy.pacer import PacerConfig

ACTORS = [f"a{i:02d}" for i in range(12)]


def _core(seed: int) -> tuple[LedgerCore, list[Assign]]:
    """Twelve Actors, v0..v2 published, most on v1 (some with v2 staged), batch 1 on v1 done
    and batch 2 on v2 requested: its pool held back for the Actors still staging v2."""
    rng = random.Random(seed)
    c = LedgerCore(
        LedgerConfig(trainer_region="us"),
        PacerConfig(steps=5, prompts_per_batch=24, staging_grace_s=30.0, prompt_prefix="b"),
    )
    c.feed(DeltaPublished(version=0, weights_hash="h0", delta_bytes=None, snapshot_bytes=9), now=0)
    for a in ACTORS:
        c.feed(ActorJoined(actor=a, region="us", active=0), now=0.0)
    for v in (1, 2):
        c.feed(DeltaPublished(version=v, weights_hash=f"h{v}", delta_bytes=5), now=0.0)
    for a in ACTORS:
        if rng.random() < 0.85:
            c.feed(DeltaStaged(actor=a, version=1), now=1.0)
            c.feed(VersionActivated(actor=a, version=1), now=1.0)
    pacer = c.pacer
    assert pacer is not None
    got = c.feed(BatchRequested(version=1, prompts=pacer.prompts(1)), now=2.0)
    for a in [a for a in got if type(a) is Assign]:
        c.feed(
            ResultsArrived(actor=a.actor, leases=a.leases, version=1, weights_hash="h1"), now=3.0
        )
    for a in ACTORS:
        if c.state.actors[a].versions.active == 1 and rng.random() < 0.4:
            c.feed(DeltaStaged(actor=a, version=2), now=3.0)
    got = c.feed(BatchRequested(version=2, prompts=pacer.prompts(2)), now=3.5)
    return c, [a for a in got if type(a) is Assign]


def _reports(seed: int, assigns: list[Assign]) -> list[object]:
    """A random run of reports at one instant, some of them refused (staged twice, an unknown
    Actor, an activation without its delta)."""
    rng = random.Random(seed)
    events: list[object] = []
    for _ in range(rng.randint(5, 30)):
        a = rng.choice(ACTORS + ["ghost"])
        r = rng.random()
        if r < 0.3:
            events.append(DeltaStaged(actor=a, version=rng.choice((2, 2, 3))))
        elif r < 0.55:
            events.append(VersionActivated(actor=a, version=rng.choice((1, 2))))
        elif r < 0.75:
            events.append(ThroughputObserved(actor=a, tokens=rng.randint(1, 500), seconds=2.5))
        elif r < 0.85:
            events.append(CaughtUp(actor=a, version=2))
        elif assigns:
            mine = rng.choice(assigns)
            events.append(
                ResultsArrived(
                    actor=mine.actor, leases=mine.leases, version=mine.version, weights_hash="h2"
                )
            )
    return events


def _same(a: LedgerCore, b: LedgerCore) -> None:
    assert a.state == b.state
    assert vars(a.pacer) == vars(b.pacer)
    assert a.reports.early == b.reports.early


@pytest.mark.parametrize("seed", range(40))
def test_feed_each_decides_as_feed_called_for_each_event(seed):
    c, assigns = _core(seed)
    events = _reports(seed, assigns)
    one = copy.deepcopy(c)
    expected, refused_at = [], None
    for i, event in enumerate(events):
        try:
            expected.append(one.feed(event, now=4.0))  # type: ignore[arg-type]
        except ValueError:
            refused_at = i
            break
    if refused_at is None:
        assert c.feed_each(events, now=4.0) == expected  # type: ignore[arg-type]
    else:
        with pytest.raises(ValueError):
            c.feed_each(events, now=4.0)  # type: ignore[arg-type]
    _same(c, one)


def test_feed_each_of_a_cohorts_reports_with_a_batch_held_for_them():
    # The Actors on v1 stage and activate v2 at one instant while batch 2's pool is held back
    # for them: activations dispatch (Commit, Assign) in the middle of the run.
    dispatched = 0
    for seed in range(10):
        c, _ = _core(seed)
        on_v1 = [
            a
            for a in ACTORS
            if c.state.actors[a].versions.active == 1 and not c.state.actors[a].versions.staged
        ]
        events = [DeltaStaged(actor=a, version=2) for a in on_v1]
        events += [VersionActivated(actor=a, version=2) for a in on_v1]
        one = copy.deepcopy(c)
        expected = [one.feed(event, now=4.0) for event in events]
        got = c.feed_each(events, now=4.0)  # type: ignore[arg-type]
        assert got == expected
        _same(c, one)
        dispatched += sum(1 for acts in got for a in acts if type(a) in (Assign, Commit))
    assert dispatched > 0


def test_feed_each_refuses_a_bad_now_before_deciding_anything():
    c, _ = _core(0)
    before = copy.deepcopy(c)
    with pytest.raises(ValueError, match="now must be a finite number"):
        c.feed_each([DeltaStaged(actor="a00", version=2)], now=float("nan"))
    _same(c, before)


@pytest.mark.parametrize(
    ("cls", "values"),
    [
        (Assign, ("a", 3, ("L1", "L2"), ("p1", "p2"), 9.5)),
        (Commit, ("a", 3)),
        (Accepted, ("L1", "a", "p1", 3)),
        (DeltaStaged, ("a", 3)),
        (VersionActivated, ("a", 3)),
        (ResultsArrived, ("a", ("L1",), 3, "h3")),
        (ThroughputObserved, ("a", 120, 2.5)),
        (Work, (3, ("L1",), 9.5)),
        (Generate, (Work(3, ("L1",)),)),
    ],
)
def test_a_maker_builds_what_the_constructor_builds(cls, values):
    made = maker(cls)(*values)
    built = cls(**{f.name: v for f, v in zip(fields(cls), values, strict=True)})
    assert type(made) is cls and made == built and repr(made) == repr(built)
    if cls.__hash__ is not None:
        assert hash(made) == hash(built)


def test_next_action_answers_the_classes_it_always_answered():
    work = Work(1, ("L1",))
    assert next_action(active=1, staged=(), queue=[work]) == Generate(work)
    assert next_action(active=1, staged=(), queue=[]) == Wait()


@pytest.mark.parametrize("seed", range(20))
def test_fanout_edges_are_every_edge_sorted(seed):
    # _fanout_edges builds its edges by source from the Actors in id order; the reference is
    # the set of edges sorted, as it was built before: relays, several regions, Actors gone.
    from aurora.policy.events import ActorLeft, RelayJoined, RelayLost
    from aurora.policy.ledger import SCHEDULABLE, TRAINER, _fanout_edges

    rng = random.Random(seed)
    for relays in (True, False):
        c = LedgerCore(LedgerConfig(trainer_region="us", relays=relays))
        c.feed(
            DeltaPublished(version=0, weights_hash="h0", delta_bytes=None, snapshot_bytes=9), now=0
        )
        names = [f"n{i:03d}" for i in range(60)]
        rng.shuffle(names)
        for name in names:
            r = rng.random()
            with contextlib.suppress(ValueError):
                if r < 0.1:
                    c.feed(RelayJoined(relay="r" + name, region=rng.choice(("eu", "ap"))), now=1.0)
                elif r < 0.15 and c.state.relays:
                    c.feed(RelayLost(relay=rng.choice(sorted(c.state.relays))), now=1.0)
                elif r < 0.25 and c.state.actors:
                    c.feed(ActorLeft(actor=rng.choice(sorted(c.state.actors))), now=1.0)
                else:
                    region = rng.choice(("us", "eu", "ap"))
                    c.feed(ActorJoined(actor=name, region=region, active=0), now=1.0)
            state = c.state
            edges = {(TRAINER, relay) for relay in state.relays} if relays else set()
            edges |= {(r.source, r.id) for r in state.actors.values() if r.life in SCHEDULABLE}
            assert _fanout_edges(state) == tuple(sorted(edges)), (seed, relays)
