"""The emulation plan (pure: no root needed): classes, queues, mechanisms, failures, names."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from aurora.topology import load_topology, topology_from_dict
from emulation import cleanup, delayline
from emulation.measure import mean_rate, tail_gbps, tail_window
from emulation.plan import (
    MIN_QUEUE_GSO_BYTES,
    Capabilities,
    EmulationError,
    PlanLink,
    iptables_loss_rules,
    iptables_router_rules,
    links_of,
    make_plan,
    rate_draws,
    tc_commands,
)

ROOT = Path(__file__).resolve().parent.parent
NO_NETEM = Capabilities(htb=True, netem=False, nfqueue=True, statistic=True)
NETEM = Capabilities(htb=True, netem=True, nfqueue=True, statistic=True)


def topo(**link):
    base = {"a": "us", "b": "ca", "gbps": 0.1, "rtt_ms": 40.0, "loss": 1e-4}
    base.update(link)
    return topology_from_dict(
        {
            "name": "t",
            "trainer": {"region": "us", "model": "m", "gpus": 1},
            "regions": [{"name": "us"}, {"name": "ca"}, {"name": "eu"}],
            "links": [base, {"a": "us", "b": "eu", "gbps": 1.0, "rtt_ms": 100.0}],
            "actors": [{"region": "ca", "gpu": "A100"}, {"region": "eu", "gpu": "A100"}],
        }
    )


def plan(t=None, caps=NO_NETEM, **kw):
    t = t or topo()
    return make_plan(
        [r.name for r in t.regions],
        links_of(t),
        tag="abc123",
        caps=caps,
        scale=kw.pop("scale", 1.0),
        **kw,
    )


def test_each_link_becomes_two_directions_with_half_the_rtt_each_and_a_bdp_queue():
    p = plan(scale=0.1)
    d = p.direction("us", "ca")
    assert (d.gbps, d.rtt_ms, d.delay_ms, d.loss) == pytest.approx((0.01, 40.0, 20.0, 1e-4))
    # 10 Mbit/s x 40 ms = 50 kB, one bandwidth-delay product
    assert d.queue_bytes == 50_000
    assert d.queue_delay_ms == pytest.approx(40.0)
    assert {(x.src, x.dst) for x in p.directions} == {
        ("us", "ca"),
        ("ca", "us"),
        ("us", "eu"),
        ("eu", "us"),
    }
    # the Trainer's region receives from two links: one htb class per link on its interface
    into_us = [x.classid for x in p.directions if x.dst == "us"]
    assert len(set(into_us)) == 2


def test_scale_multiplies_every_rate_and_keeps_rtt_and_loss():
    t = topo(fluctuation={"low_gbps": 0.05, "high_gbps": 0.1, "period_s": 5})
    d = plan(t, scale=0.5).direction("ca", "us")
    assert d.gbps == pytest.approx(0.05)
    assert d.fluctuation == pytest.approx((0.025, 0.05, 5.0))
    assert (d.rtt_ms, d.loss) == (40.0, 1e-4)


def test_without_netem_the_delay_is_an_nfqueue_per_direction_and_loss_is_iptables():
    p = plan()
    queues = [d.nfqueue for d in p.directions]
    assert all(q is not None for q in queues) and len(set(queues)) == len(queues)
    d = p.direction("us", "ca")
    assert d.mechanisms == {"rate": "htb", "queue": "bfifo", "delay": "NFQUEUE", "loss": "iptables"}
    assert p.direction("us", "eu").loss_by == "none"
    rules = iptables_router_rules(p)
    assert "--queue-bypass" not in rules  # fail closed: no delay line, no packets
    assert rules.count("-j NFQUEUE") == 4
    loss = iptables_loss_rules(p, "ca")
    assert "-A PREROUTING -i auabc123h2 -s 10.201.1.0/24" in loss
    assert "--probability 0.0001000000" in loss
    assert iptables_loss_rules(p, "eu") == ""


def test_with_netem_delay_and_loss_are_a_netem_leaf_when_packets_are_mtu_sized():
    p = plan(caps=NETEM, scale=0.1)
    d = p.direction("us", "ca")
    assert (d.delay_by, d.loss_by, d.nfqueue) == ("netem", "netem", None)
    lines = tc_commands(p)
    assert any("netem delay 20.000ms limit" in x and "loss 0.010000%" in x for x in lines)
    assert iptables_router_rules(p) == ""
    # with super-packets netem would drop a whole 64 KB burst at once: loss goes to iptables
    g = plan(caps=NETEM, scale=10.0).direction("us", "ca")
    assert (g.delay_by, g.loss_by) == ("netem", "iptables")


def test_a_delay_with_neither_netem_nor_nfqueue_fails_naming_both():
    caps = Capabilities(
        htb=True,
        netem=False,
        nfqueue=False,
        statistic=True,
        missing=("netem: no netem qdisc", "nfqueue: no iptables"),
    )
    with pytest.raises(
        EmulationError,
        match=r"links\[0\] us-ca: a 40 ms RTT needs netem or an "
        r"NFQUEUE.*no netem qdisc.*no iptables",
    ):
        plan(caps=caps)


def test_a_loss_with_neither_netem_nor_statistic_fails_naming_them():
    caps = Capabilities(
        htb=True, netem=False, nfqueue=True, statistic=False, missing=("statistic: no match",)
    )
    with pytest.raises(EmulationError, match=r"us-ca: a loss of 0.0001 needs netem .*no match"):
        plan(caps=caps)


def test_no_htb_means_no_rate_limit_and_fails():
    caps = Capabilities(
        htb=False, netem=True, nfqueue=True, statistic=True, missing=("htb: tc failed",)
    )
    with pytest.raises(EmulationError, match="htb qdisc: htb: tc failed"):
        plan(caps=caps)


def test_senders_send_mtu_packets_up_to_150_mbit_and_keep_gso_above():
    assert plan(scale=0.15).segmentation == "mtu"  # 1 Gbit/s link scaled to 150 Mbit/s
    assert plan(scale=0.16).segmentation == "gso"
    p = plan(scale=1.0, queue_bdp=0.1)
    assert p.segmentation == "gso"
    # 0.1 x 100 Mbit/s x 40 ms = 50 kB: below the floor that holds one 64 KB super-packet
    assert p.direction("us", "ca").queue_bytes == MIN_QUEUE_GSO_BYTES
    # the router cuts super-packets only toward a region whose link drops per packet
    assert p.segments_toward("ca") and p.segments_toward("us") and not p.segments_toward("eu")
    assert not plan(scale=0.1).segments_toward("ca")


def test_regions_without_a_link_are_prohibited_both_ways():
    assert set(plan().unlinked) == {("ca", "eu"), ("eu", "ca")}


def test_tc_batch_has_a_class_a_bfifo_and_a_source_filter_per_direction():
    lines = tc_commands(plan(scale=0.1))
    dev = "auabc123r2"  # the router's interface toward ca (region 2)
    assert f"qdisc add dev {dev} root handle 1: htb default 0" in lines
    assert (
        f"class add dev {dev} parent 1: classid 1:11 htb rate 10000000bit ceil 10000000bit" in lines
    )
    assert f"qdisc add dev {dev} parent 1:11 handle 11: bfifo limit 50000" in lines
    assert (
        f"filter add dev {dev} parent 1: protocol ip prio 1 u32 match ip src 10.201.1.0/24 "
        "flowid 1:11"
    ) in lines


def test_bad_inputs_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="tag must be six characters"):
        make_plan(["a"], [], tag="UPPER!", scale=1, caps=NO_NETEM)
    with pytest.raises(ValueError, match="scale must be a positive number"):
        plan(scale=0.0)
    with pytest.raises(ValueError, match="segmentation must be auto, mtu or gso"):
        plan(segmentation="jumbo")
    with pytest.raises(ValueError, match="unknown region 'xx'"):
        make_plan(
            ["a"],
            [PlanLink(index=0, a="a", b="xx", gbps=1, rtt_ms=1)],
            tag="abc123",
            scale=1,
            caps=NO_NETEM,
        )


def test_names_carry_the_tag_and_fit_the_kernel_limits():
    p = plan()
    assert p.router_namespace == "aurem-abc123-rt"
    assert p.region("ca").namespace == "aurem-abc123-ca"
    odd = make_plan(["rt", "a b/c"], [], tag="abc123", scale=1, caps=NO_NETEM)
    assert [r.namespace for r in odd.regions] == ["aurem-abc123-r1", "aurem-abc123-r2"]
    for r in p.regions:
        assert len(r.host_if) <= 15 and len(r.router_if) <= 15  # IFNAMSIZ - 1
        assert cleanup._IF_RE.match(r.host_if) and cleanup._IF_RE.match(r.router_if)
    assert cleanup.interface_name("abc123", "r", 250) == "auabc123r250"
    with pytest.raises(KeyError, match="no region 'mars'"):
        p.region("mars")


def test_fluctuation_draws_are_the_simulators_own(monkeypatch):
    """The emulator's rate sequence for a link equals the simulator's for the same seed."""
    from aurora.traces import load_traces
    from sim import network as simnet
    from sim.config import SimConfig, strategy
    from sim.model import simulate

    calls = []
    original = simnet.Network.set_capacity

    def record(self, res, capacity):
        calls.append((self.env.now, res.name, capacity))
        return original(self, res, capacity)

    monkeypatch.setattr(simnet.Network, "set_capacity", record)
    geo = load_topology(ROOT / "examples" / "geo.yaml")
    simulate(
        SimConfig(topology=geo, traces=load_traces(), strategy=strategy("aurora"), steps=2, seed=7)
    )
    sim_rates = [(t, c * 8 / 1e9) for t, name, c in calls if name == "wan:us-ca"]
    assert len(sim_rates) >= 3
    fl = geo.links[0].fluctuation
    draws = rate_draws(7, 0, fl.low_gbps, fl.high_gbps)
    ours = [(k * fl.period_s, next(draws)) for k in range(len(sim_rates))]
    assert [t for t, _ in sim_rates] == [t for t, _ in ours]
    assert [g for _, g in sim_rates] == pytest.approx([g for _, g in ours], rel=1e-12)


def test_a_verdict_batch_message_carries_the_verdict_header_attribute():
    """NFQA_VERDICT_HDR is attribute 2 (1 is the packet header): a wrong type is EINVAL."""
    hdr = delayline._attr(delayline.NFQA_VERDICT_HDR, struct.pack("!II", delayline.NF_ACCEPT, 42))
    msg = delayline._message(delayline.NFQNL_MSG_VERDICT_BATCH, 7, [hdr], 1, 0)
    length, kind, flags, _seq, _pid = struct.unpack_from("=IHHII", msg)
    assert (length, kind, flags) == (len(msg), (3 << 8) | 3, 1)
    assert struct.unpack_from("!BBH", msg, 16) == (0, 0, 7)  # AF_UNSPEC, v0, queue 7
    assert struct.unpack_from("=HH", msg, 20) == (12, 2)
    assert struct.unpack_from("!II", msg, 24) == (1, 42)


def test_goodput_is_taken_after_the_ramp_and_before_the_first_stream_ends():
    samples = [(0.0, 0), (1.0, 1_000_000), (2.0, 3_500_000), (3.0, 6_000_000), (4.0, 6_100_000)]
    # over [1.5, 3.0] -> from the 1.0 s sample: 5 MB in 2 s = 20 Mbit/s
    assert tail_gbps(samples, skip_fraction=0.5, until_s=3.0) == pytest.approx(0.02)
    assert tail_gbps([], skip_fraction=0.5) == 0.0


def test_a_probe_window_that_spans_a_rate_change_is_held_to_the_time_weighted_rate():
    schedule = [
        {"monotonic": 100.0, "gbps": 0.04},
        {"monotonic": 110.0, "gbps": 0.02},
        {"monotonic": 120.0, "gbps": 0.05},
    ]
    # 2 s at 0.04 then 2 s at 0.02
    assert mean_rate(schedule, 108.0, 112.0, 1.0) == pytest.approx(0.03)
    # wholly inside one period; and across two changes: 1 s of 0.04, 10 s of 0.02, 1 s of 0.05
    assert mean_rate(schedule, 101.0, 103.0, 1.0) == pytest.approx(0.04)
    assert mean_rate(schedule, 109.0, 121.0, 1.0) == pytest.approx((0.04 + 0.2 + 0.05) / 12)
    # before the first change, or no schedule at all (a steady link): the link's own rate
    assert mean_rate(schedule, 90.0, 95.0, 1.0) == pytest.approx(1.0)
    assert mean_rate([], 0.0, 3.0, 0.7) == pytest.approx(0.7)
    # an empty window: the rate in force at its start
    assert mean_rate(schedule, 111.0, 111.0, 1.0) == pytest.approx(0.02)


def test_the_probe_measures_over_the_window_it_reports():
    samples = [(0.0, 0), (1.0, 1000), (2.0, 3000), (3.0, 5500), (4.0, 8000)]
    assert tail_window(samples, skip_fraction=0.5, until_s=3.0) == (1.0, 3.0, 4500)
    assert tail_gbps(samples, skip_fraction=0.5, until_s=3.0) == pytest.approx(4500 * 8 / 2 / 1e9)
