"""Cohort mode (:mod:`sim.cohorts`) against exact mode: the same step rows, the same events fed
to the Ledger at the same simulated times with the same decisions (only the order of events at
one instant may differ), far fewer SimPy events; members that diverge are split out."""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml

from aurora.faults import parse_fault
from aurora.policy.events import Accepted, BatchCompleted, to_record
from aurora.strategies import strategy
from aurora.topology import topology_from_dict
from aurora.traces import load_traces
from sim.config import SimConfig
from sim.model import Result, Simulation, simulate
from tests.test_sim import geo_config

ROOT = Path(__file__).resolve().parents[1]


def regions_config(actors: int, steps: int, regions: int = 10, **kw: Any) -> SimConfig:
    """The deployment of benchmarks/test_sim_speed.py: ``regions`` regions of Actors behind
    one relay each, a Trainer sized to absorb their output, one lease per Actor per step."""
    data = {
        "name": "scale",
        "trainer": {"region": "us", "model": "qwen3-8b", "gpus": max(1, 3 * actors // 10)},
        "regions": [{"name": "us"}] + [{"name": f"r{i}"} for i in range(regions)],
        "links": [
            {"a": "us", "b": f"r{i}", "gbps": 10.0, "rtt_ms": 50, "loss": 1e-6}
            for i in range(regions)
        ],
        "actors": [
            {"region": f"r{i}", "gpu": "A100", "count": actors // regions} for i in range(regions)
        ],
        "relays": [
            {"region": f"r{i}", "nic_gbps": max(1.0, 0.4 * actors / regions)}
            for i in range(regions)
        ],
    }
    base: dict[str, Any] = dict(
        topology=topology_from_dict(data),
        traces=load_traces(),
        strategy=strategy("aurora"),
        steps=steps,
        rollouts_per_lease=512,
    )
    base.update(kw)
    return SimConfig(**base)


def by_instant(res: Result) -> dict[float, tuple[Counter[str], Counter[str]]]:
    """Per simulated instant: the events fed to the Ledger and the actions it returned, as
    multisets (the order within an instant is what cohort mode may change)."""
    out: dict[float, tuple[Counter[str], Counter[str]]] = defaultdict(
        lambda: (Counter(), Counter())
    )
    for (t, event), actions in zip(res.fed, res.decisions, strict=True):
        fed, acts = out[t]
        fed[repr(to_record(event))] += 1
        for a in actions:
            acts[repr(to_record(a))] += 1
    return dict(out)


def accepted_per_batch(res: Result) -> list[int]:
    """Results admitted before each ``BatchCompleted``: every prompt of every batch."""
    counts, n = [], 0
    for actions in res.decisions:
        for a in actions:
            if type(a) is Accepted:
                n += 1
            elif type(a) is BatchCompleted:
                counts.append(n)
                n = 0
    return counts


def run_both(cfg: SimConfig) -> tuple[Result, Result, Simulation]:
    exact = simulate(dataclasses.replace(cfg, cohorts=False))
    sim = Simulation(dataclasses.replace(cfg, cohorts=True))
    return exact, sim.run(), sim


def test_cohort_mode_feeds_the_ledger_the_same_events_at_the_same_times_as_exact_mode():
    exact, cohort, _ = run_both(regions_config(100, 6))
    assert cohort.rows == exact.rows
    assert cohort.trace and sorted(cohort.trace) == sorted(exact.trace)
    assert by_instant(cohort) == by_instant(exact)
    # Nothing lost: every batch admitted all its prompts, and nothing expired.
    per_batch = 100  # one lease per Actor per step
    assert accepted_per_batch(cohort) == accepted_per_batch(exact)
    assert accepted_per_batch(exact)[:6] == [per_batch] * 6
    assert sum(r["expired"] for r in cohort.rows) == 0
    # The point of it: a small fraction of exact mode's SimPy events.
    assert cohort.events < exact.events / 2


def test_a_cohort_losing_a_region_splits_nothing_and_matches_exact_mode():
    cfg = regions_config(100, 6, faults=(parse_fault("region_loss:r3@step=3"),))
    exact, cohort, sim = run_both(cfg)
    assert cohort.rows == exact.rows
    assert by_instant(cohort) == by_instant(exact)
    assert all(a.cohort is None for a in sim.actors.nodes.values() if a.region == "r3")


@pytest.mark.parametrize("fault", ["preempt:ca-a100-1@step=4", "link_cut:us-ca@step=3,for=20"])
def test_faults_and_diverging_members_give_exact_modes_rows(fault):
    cfg = geo_config(steps=8, faults=(parse_fault(fault),))
    exact, cohort, sim = run_both(cfg)
    assert cohort.rows == exact.rows
    assert by_instant(cohort) == by_instant(exact)


def test_members_given_more_work_while_others_generate_keep_generating_in_the_cohort():
    # examples/geo.yaml, 12 Actors with 16-rollout leases: dispatch hands an Actor that
    # finished early more of a held-back pool while others still generate.
    exact, cohort, sim = run_both(geo_config(steps=6))
    assert cohort.rows == exact.rows
    assert by_instant(cohort) == by_instant(exact)
    assert sim.actors.cohorts.splits == 0
    assert all(a.cohort is not None for a in sim.actors.nodes.values() if a.id != "ca-a100-1")


def test_a_member_split_out_at_a_safe_point_continues_exactly():
    cfg = regions_config(100, 5)
    exact = simulate(cfg)
    sim = Simulation(dataclasses.replace(cfg, cohorts=True))
    split = ["r1-a100-3", "r4-a100-0", "r9-a100-9"]

    def split_out() -> Any:  # once each one's cohort waits at a safe point (after step 1)
        left = list(split)
        while left:
            yield sim.env.timeout(1.0)
            for name in list(left):
                actor = sim.actors.nodes[name]
                assert actor.cohort is not None
                if actor.cohort.idle is not None and sim.trainer.trained >= 1:
                    sim.actors.cohorts.split(actor.cohort, actor, None)
                    left.remove(name)

    sim.env.process(split_out())
    cohort = sim.run()
    assert sim.actors.cohorts.splits == len(split)
    assert [n for n, a in sim.actors.nodes.items() if a.cohort is None] == split
    assert cohort.rows == exact.rows
    assert by_instant(cohort) == by_instant(exact)


def test_members_that_must_catch_up_are_split_out_and_the_run_finishes():
    # examples/geo.yaml scaled to 300 Actors: its 1 Gbit/s link cannot carry the deltas to
    # them in time, so every Actor falls behind and catches up (ApplyPlan, never done together:
    # a cohort whose largest group catches up used to loop without end at that instant).
    data = yaml.safe_load((ROOT / "examples" / "geo.yaml").read_text())
    data["actors"][0]["count"] = 300
    cfg = SimConfig(
        topology=topology_from_dict(data),
        traces=load_traces(),
        strategy=strategy("aurora"),
        steps=3,
        record_trace=False,
    )
    exact, cohort, sim = run_both(cfg)
    assert sim.actors.cohorts.splits == 300
    assert cohort.rows == exact.rows
