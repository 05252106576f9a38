"""Links and transfers (issue 17, defects 1 and 5): a sender-receiver pair has one connection
bundle whatever the version, a region's LAN rate limits each host pair, and a receiver's
interface is shared by everything it receives."""

from __future__ import annotations

from pathlib import Path

import pytest
import simpy
import yaml

from aurora.policy.versions import CatchUpPlan
from aurora.topology import load_topology, topology_from_dict
from aurora.traces import load_traces
from sim.config import SimConfig, strategy
from sim.model import Simulation
from sim.network import Network, Resource, tcp_cap

GEO = Path(__file__).resolve().parent.parent / "examples" / "geo.yaml"


def _watch(monkeypatch, check):
    """Call ``check(network)`` after every rate computation."""
    original = Network._reschedule

    def watched(self):
        original(self)
        check(self)

    monkeypatch.setattr(Network, "_reschedule", watched)


def test_a_single_stream_dense_broadcast_never_exceeds_one_streams_cap(monkeypatch):
    # PrimeRL-Full publishes a 15.6 GB version every step and a broadcast takes longer than a
    # step, so versions k and k+1 are both being sent: on one connection, one after the other.
    link = load_topology(GEO).links[0]
    consts = load_traces().constants
    one_stream = tcp_cap(
        streams=1,
        rtt_s=link.rtt_ms / 1e3,
        loss=link.loss,
        window_bytes=consts.tcp_window_bytes.value,
        mss_bytes=consts.mss_bytes.value,
    )
    peak = [0.0]

    def check(net):
        wan = [f for f in net.flows if any(r.name.startswith("wan:") for r in f.path)]
        peak[0] = max(peak[0], sum(f.rate * f.mult for f in wan))

    _watch(monkeypatch, check)
    cfg = SimConfig(
        topology=load_topology(GEO), traces=load_traces(), strategy=strategy("prime-full"), steps=5
    )
    Simulation(cfg).run()
    assert one_stream * 0.99 < peak[0] <= one_stream * (1 + 1e-9)


def test_versions_on_one_connection_are_sent_one_after_the_other():
    env = simpy.Environment()
    net = Network(env)
    link = Resource("wan", 100.0)
    done = {}
    for name in ("v1", "v2"):
        net.start(
            name,
            100.0,
            (link,),
            cap=50.0,
            bundle=("trainer", "relay"),
            on_done=lambda f: done.__setitem__(f.label, env.now),
        )
    net.start("other", 100.0, (link,), cap=50.0, on_done=lambda f: done.__setitem__("o", env.now))
    env.run()
    # v2 waits for v1 on its connection, and does not take v1's share meanwhile.
    assert done == {"v1": pytest.approx(2.0), "o": pytest.approx(2.0), "v2": pytest.approx(4.0)}


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
