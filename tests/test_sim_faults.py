"""Faults in the simulator (issue 17, defect 8): stalls are reported on time with what the run
produced, hazards need spot Actors, and a cut link stops data and messages until restored."""

from __future__ import annotations

import pytest
import yaml

from aurora.faults import parse_fault
from aurora.policy.leases import LeaseConfig
from aurora.topology import topology_from_dict
from aurora.traces import load_traces
from sim.config import SimConfig, strategy
from sim.model import SimulationStalled, simulate
from tests.test_sim import GEO, tiny_config


def geo(**kw) -> SimConfig:
    return SimConfig(
        topology=topology_from_dict(yaml.safe_load(GEO.read_text())),
        traces=load_traces(),
        strategy=strategy("aurora"),
        **kw,
    )


def test_a_stall_is_reported_stall_after_s_after_the_last_step_with_what_the_run_produced():
    cfg = geo(steps=6, faults=(parse_fault("region_loss:ca@step=3"),), stall_after_s=1000.0)
    with pytest.raises(SimulationStalled) as err:
        simulate(cfg)
    partial = err.value.result
    assert partial is not None and [r["step"] for r in partial.rows] == [1, 2]
    last = partial.rows[-1]["time_s"]
    assert partial.sim_time == pytest.approx(last + 1000.0)
    assert f"after t={last:.1f} s" in str(err.value) and "live Actors none" in str(err.value)


def test_a_spot_hazard_needs_spot_actors():
    with pytest.raises(ValueError, match="spot_hazard_per_hour: 1.5 .* has no spot Actors"):
        geo(steps=3, spot_hazard_per_hour=1.5)


def test_eight_spot_actors_preempted_at_1_5_per_hour_that_return_finish_the_run():
    data = yaml.safe_load(GEO.read_text())
    data["actors"][0]["spot"] = True
    cfg = SimConfig(
        topology=topology_from_dict(data),
        traces=load_traces(),
        strategy=strategy("aurora"),
        steps=30,
        spot_hazard_per_hour=1.5,
        spot_return_s=600.0,
        record_trace=True,
    )
    result = simulate(cfg)
    assert len(result.rows) == 30
    who = [w for _, w, what in result.trace if what == "join on nothing"]
    assert len(who) >= 3  # machines came back


def test_a_cut_link_stalls_the_transfer_across_it_until_restored():
    # As in the exact trace of tests/test_sim.py, v1 leaves at 12.2 s at the extraction rate
    # (1 MB/s). Cut at 12.5 s (0.3 MB sent) for 5 s: the other 0.7 MB go at 10 MB/s from 17.5 s.
    result = simulate(tiny_config(faults=(parse_fault("link_cut:us-ca@t=12.5,for=5"),)))
    trace = result.trace
    assert (12.5, "faults", "link_cut us-ca") in trace
    assert (17.5, "faults", "link us-ca restored") in trace
    assert (17.58, "ca-a100-0", "received v1 from trainer") in trace
    assert len(result.rows) == 3


def test_messages_across_a_cut_link_wait_for_it_and_are_judged_when_they_arrive():
    # Batch 1 ends at 2 s, inside a cut from 1 s to 11 s: its results reach the Ledger at 11 s.
    held = simulate(tiny_config(faults=(parse_fault("link_cut:ca-us@t=1,for=10"),)))
    assert (11.0, "trainer", "batch 1 complete") in held.trace
    # With 8 s leases they expire during the cut: the prompts are leased again (the leases
    # reach the Actors at 11 s), the late results are refused, the new ones complete at 13 s.
    late = simulate(
        tiny_config(
            faults=(parse_fault("link_cut:ca-us@t=1,for=10"),),
            lease=LeaseConfig(initial_s=8.0),
        )
    )
    assert [t for t, _, what in late.trace if what.startswith("expired")] == [8.000001] * 4
    assert [t for t, _, what in late.trace if what.startswith("refused")] == [11.0] * 4
    assert (13.0, "trainer", "batch 1 complete") in late.trace
