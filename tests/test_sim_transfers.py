"""Links and transfers (issue 17, defect 5): a region's LAN rate limits each host pair, and a
receiver's interface is shared by everything it receives."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from aurora.policy.versions import CatchUpPlan
from aurora.topology import topology_from_dict
from sim.config import SimConfig, strategy
from sim.model import Simulation
from sim.network import Network
from sim.traces import load_traces

GEO = Path(__file__).resolve().parent.parent / "examples" / "geo.yaml"


def _watch(monkeypatch, check):
    """Call ``check(network)`` after every rate computation."""
    original = Network._reschedule

    def watched(self):
        original(self)
        check(self)

    monkeypatch.setattr(Network, "_reschedule", watched)


def _fanout_s(lan_gbps: float) -> float:
    data = yaml.safe_load(GEO.read_text())
    data["regions"][1]["lan_gbps"] = lan_gbps
    cfg = SimConfig(
        topology=topology_from_dict(data),
        traces=load_traces(),
        strategy=strategy("aurora"),
        steps=1,
    )
    return Simulation(cfg).measure_fanout()


def test_the_regions_lan_rate_limits_each_relay_forward():
    # The relay forwards a 158 MB delta to 7 Actors, one host pair each, as it arrives over the
    # WAN (~1.3 s): at 0.1 Gbit/s per pair the forwards take 12.6 s, at 100 Gbit/s they keep up.
    slow, fast = _fanout_s(0.1), _fanout_s(100.0)
    delta = load_traces().delta_bytes("qwen3-8b", "aurora")
    assert slow == pytest.approx(delta / (0.1e9 / 8), rel=0.02)
    assert fast < 2.0


def test_an_actors_interface_is_shared_by_everything_it_receives(monkeypatch):
    data = {
        "name": "fast-wan",
        "trainer": {"region": "us", "model": "qwen3-8b", "gpus": 4, "egress_gbps": 400},
        "regions": [{"name": "us"}, {"name": "ca"}],
        "links": [{"a": "us", "b": "ca", "gbps": 400, "rtt_ms": 1, "loss": 0}],
        "actors": [{"region": "ca", "gpu": "A100", "count": 3, "nic_gbps": 10}],
        "relays": [{"region": "ca", "nic_gbps": 400}],
    }
    cfg = SimConfig(
        topology=topology_from_dict(data),
        traces=load_traces(),
        strategy=strategy("aurora"),
        steps=1,
    )
    sim = Simulation(cfg)
    sim._setup()
    nic = 10e9 / 8
    others = sorted(sim.actors.nodes)
    sim.transfers.relays["relay-ca"].held.add(1)
    sim.transfers.send(1, "relay-ca", others)  # a forward to three Actors: one cohort flow
    first = sim.actors.nodes[others[0]]
    cohort = first.inbound[1]
    assert cohort.flow.mult == 3 and cohort.flow.rate == pytest.approx(nic)
    # The first of them also pulls a version from the Checkpoint Store, across the WAN: it leaves
    # the cohort for a flow of its own, and its two flows share its 10 Gbit/s interface.
    plan = CatchUpPlan(target=2, snapshot=None, deltas=(2,), bytes=int(sim.version_bytes))
    sim.actors.catch_up(first, plan)
    sim.env.run(until=0.01)
    own = first.inbound[1]
    assert own is not cohort and cohort.flow.mult == 2 and cohort.members == others[1:]
    into_first = [f for f in sim.net.flows if f.label.endswith("->" + first.id)]
    assert len(into_first) == 2
    assert sum(f.rate for f in into_first) == pytest.approx(nic)
    assert cohort.flow.rate == pytest.approx(nic)  # the others keep their interfaces
    assert own.flow.remaining == pytest.approx(cohort.flow.remaining, rel=0.5)
