"""The simulator's fast paths (:mod:`sim.fastpaths`) against the policy core's own operations.

Each path must give what the core's one entry point gives, called in a loop: the builders the
objects the classes' constructors build; ``decide_reports`` and ``feed_results`` the actions of
``LedgerCore.feed`` for each event, and the same core afterwards (the Ledger's state, the
pacer's, the staged reports), also when an event is refused. Random scenarios: Actors on
several versions, batches whose pool is held back for Actors still staging or all leased,
results for leases that are settled, expired, another Actor's or unknown, on the wrong version
or weights, late, or repeated.
"""

from __future__ import annotations

import copy
import random
from dataclasses import fields

import pytest

from aurora.policy.actor import Work
from aurora.policy.core import LedgerCore
from aurora.policy.events import (
    Accepted,
    Action,
    ActorJoined,
    Assign,
    BatchRequested,
    DeltaPublished,
    DeltaStaged,
    ResultsArrived,
    ThroughputObserved,
    Tick,
    VersionActivated,
)
from aurora.policy.leases import LeaseConfig
from aurora.policy.ledger import LedgerConfig
from aurora.policy.pacer import PacerConfig
from sim import fastpaths

ACTORS = [f"a{i:02d}" for i in range(12)]


def _core(seed: int) -> tuple[LedgerCore, list[Assign]]:
    """Twelve Actors, v0..v2 published, most on v1 (some with v2 staged), batch 1 on v1
    dispatched and batch 2 on v2 requested (its pool held back for the Actors still staging
    v2, or all leased when none is); some of batch 1's results are in, some not."""
    rng = random.Random(seed)
    c = LedgerCore(
        LedgerConfig(trainer_region="us", lease=LeaseConfig(initial_s=30.0)),
        PacerConfig(
            steps=5,
            prompts_per_batch=rng.choice((12, 24, 30)),
            staging_grace_s=30.0,
            prompt_prefix="b",
        ),
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
    request = BatchRequested(version=1, prompts=pacer.prompts(1))
    assigns = [a for a in c.feed(request, now=2.0) if type(a) is Assign]
    for a in assigns:
        if rng.random() < 0.8:
            c.feed(
                ResultsArrived(actor=a.actor, leases=a.leases, version=1, weights_hash="h1"),
                now=3.0,
            )
    staging = rng.random() < 0.5
    for a in ACTORS:
        if c.state.actors[a].versions.active == 1 and (staging or rng.random() < 0.4):
            c.feed(DeltaStaged(actor=a, version=2), now=3.0)
    request = BatchRequested(version=2, prompts=pacer.prompts(2))
    assigns += [a for a in c.feed(request, now=3.5) if type(a) is Assign]
    return c, assigns


def _same(a: LedgerCore, b: LedgerCore) -> None:
    assert a.state == b.state
    assert vars(a.pacer) == vars(b.pacer)
    assert a.reports.early == b.reports.early


def _decide(call: object) -> tuple[str, object]:
    """What a call answered, or the type of what it raised."""
    try:
        return "ok", call()  # type: ignore[operator]
    except (ValueError, KeyError) as exc:
        return "raised", type(exc)


# ------------------------------------------------------------------------------------------
# Builders
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "cls"),
    [
        (fastpaths.results_arrived, ResultsArrived),
        (fastpaths.throughput_observed, ThroughputObserved),
        (fastpaths.version_activated, VersionActivated),
        (fastpaths.accepted, Accepted),
        (fastpaths.work, Work),
    ],
)
def test_a_builder_builds_what_the_constructor_builds(build, cls):
    rng = random.Random(cls.__name__)
    values = {
        str: lambda: rng.choice(["a", "L7", "p3", "h2", ""]),
        int: lambda: rng.randint(0, 9),
        float: lambda: rng.uniform(0, 9),
        tuple: lambda: tuple(f"L{i}" for i in range(rng.randint(0, 3))),
    }
    for _ in range(50):
        args = []
        for f in fields(cls):
            kind = f.type if isinstance(f.type, type) else str(f.type)
            pick = next((v for k, v in values.items() if k.__name__ in str(kind)), values[str])
            args.append(pick())
        made = build(*args)
        built = cls(**{f.name: v for f, v in zip(fields(cls), args, strict=True)})
        assert type(made) is cls and made == built and repr(made) == repr(built)
        assert hash(made) == hash(built)
        with pytest.raises(AttributeError):
            made.__setattr__(fields(cls)[0].name, args[0])


def test_a_builder_refuses_a_class_whose_fields_it_does_not_name_in_order():
    with pytest.raises(TypeError, match="fields"):
        fastpaths._setters(VersionActivated, "version", "actor")


# ------------------------------------------------------------------------------------------
# decide_reports
# ------------------------------------------------------------------------------------------


def _reports(rng: random.Random) -> list[DeltaStaged | VersionActivated]:
    """A run of staged and activated reports at one instant, some refused (staged twice, an
    unknown Actor, an activation without its delta)."""
    events: list[DeltaStaged | VersionActivated] = []
    for _ in range(rng.randint(1, 30)):
        actor = rng.choice(ACTORS + ["ghost"])
        if rng.random() < 0.5:
            events.append(DeltaStaged(actor=actor, version=rng.choice((2, 2, 3))))
        else:
            events.append(VersionActivated(actor=actor, version=rng.choice((1, 2, 2))))
    return events


@pytest.mark.parametrize("seed", range(60))
def test_decide_reports_decides_as_feed_called_for_each_report(seed):
    rng = random.Random(seed)
    fast, _ = _core(seed)
    slow = copy.deepcopy(fast)
    events = _reports(rng)
    expected: list[list[Action]] = []
    refused = False
    for event in events:
        got = _decide(lambda event=event: slow.feed(event, now=4.0))
        if got[0] == "raised":
            refused = True
            break
        expected.append(got[1])  # type: ignore[arg-type]
    if refused:
        with pytest.raises(ValueError):
            fastpaths.decide_reports(fast, events, now=4.0)
    else:
        assert fastpaths.decide_reports(fast, events, now=4.0) == expected
    _same(fast, slow)


def test_decide_reports_refuses_an_event_the_pacer_reads():
    c, _ = _core(0)
    with pytest.raises(TypeError, match="pacer"):
        fastpaths.decide_reports(c, [BatchRequested(version=2, prompts=("x",))], now=4.0)  # type: ignore[list-item]


# ------------------------------------------------------------------------------------------
# feed_results
# ------------------------------------------------------------------------------------------


def _result(rng: random.Random, assigns: list[Assign], now: float) -> ResultsArrived:
    """A result event for one of ``assigns``, mostly as an honest Actor sends it."""
    a = rng.choice(assigns)
    leases = list(a.leases)
    r = rng.random()
    if r < 0.15 and len(leases) > 1:
        rng.shuffle(leases)
    elif r < 0.3:
        leases = leases[: rng.randint(1, len(leases))]
    if rng.random() < 0.15:  # another Assign's lease, or one never made
        other = rng.choice(assigns)
        leases.insert(rng.randint(0, len(leases)), rng.choice([*other.leases, "L999"]))
    actor = a.actor if rng.random() < 0.9 else rng.choice(ACTORS + ["ghost"])
    version = a.version if rng.random() < 0.9 else a.version + 1
    weights_hash = f"h{version}" if rng.random() < 0.93 else "spoiled"
    return ResultsArrived(
        actor=actor, leases=tuple(leases), version=version, weights_hash=weights_hash
    )


def _feed_results_against_feed(seed: int) -> int:
    """One random scenario, event by event; how many results the fast path could settle
    (the pool empty and the first lease the sender's claimed one)."""
    rng = random.Random(seed)
    fast, assigns = _core(seed)
    slow = copy.deepcopy(fast)
    now = 4.0
    taken = 0
    for _ in range(rng.randint(5, 40)):
        now += rng.choice((0.0, 0.5, 1.0, 20.0))  # 20 s: some leases expire
        if rng.random() < 0.1:
            assert fast.feed(Tick(), now=now) == slow.feed(Tick(), now=now)
        else:
            event = _result(rng, assigns, now)
            book = fast.state.book
            taken += book.pool_size == 0 and not book.changes_nothing(event.leases[0], event.actor)
            got = _decide(lambda event=event, now=now: fastpaths.feed_results(fast, event, now=now))
            expected = _decide(lambda event=event, now=now: slow.feed(event, now=now))
            assert got == expected, (seed, event)
            if got[0] == "ok":
                assigns += [a for a in got[1] if type(a) is Assign]  # type: ignore[union-attr]
        _same(fast, slow)
    fast.state.book.check()
    return taken


def test_feed_results_decides_as_feed_does():
    taken = sum(_feed_results_against_feed(seed) for seed in range(80))
    assert taken > 200  # the fast path was exercised, not only its fallback to feed
