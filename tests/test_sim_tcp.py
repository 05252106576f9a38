"""The simulator's TCP model (sim/tcp.py): each congestion control's response to loss against
known values of its formula, monotonicity, the loss-recovery draws, and how the simulator uses
them (the topology's ``congestion``, ``SimConfig.loss_recovery``)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from aurora.topology import topology_from_dict
from sim import tcp

MSS = 1448
WINDOW = 4 << 20


@pytest.mark.parametrize(
    ("loss", "window"),
    # RFC 8312 §5.1 Table 1: average window (MSS-sized segments) of CUBIC with C = 0.4 at an
    # RTT of 0.1 s (its TCP-friendly region rounds Standard TCP's as 1.2 / sqrt(p)).
    [(1e-2, 12), (1e-3, 38), (1e-4, 187), (1e-5, 1054), (1e-6, 5926)],
)
def test_cubic_window_is_the_rfc_8312_table(loss, window):
    got = tcp.window_packets("cubic", rtt_s=0.1, loss=loss)
    assert got == pytest.approx(window, rel=0.025)


def test_reno_is_the_mathis_relation_bit_for_bit():
    # 100 Mbit/s, 40 ms, 1e-4: 35.5 Mbit/s per stream (docs/EMULATION.md's simulator column).
    rate = tcp.stream_rate("reno", rtt_s=0.04, loss=1e-4, window_bytes=WINDOW, mss_bytes=MSS)
    assert rate == MSS * math.sqrt(1.5) / (0.04 * math.sqrt(1e-4))
    assert rate * 8 / 1e6 == pytest.approx(35.47, abs=0.01)
    assert tcp.window_packets("reno", rtt_s=0.04, loss=1e-4) == pytest.approx(122.47, abs=0.01)


def test_cubic_is_reno_in_its_friendly_region_and_faster_beyond():
    # At 40 ms and 1e-4 CUBIC's own window (94 packets) is below reno's (122): reno's holds.
    kw = dict(window_bytes=WINDOW, mss_bytes=MSS)
    assert tcp.stream_rate("cubic", rtt_s=0.04, loss=1e-4, **kw) == tcp.stream_rate(
        "reno", rtt_s=0.04, loss=1e-4, **kw
    )
    # At 150 ms and 1e-3: 45.2 packets against reno's 38.7.
    assert tcp.window_packets("cubic", rtt_s=0.15, loss=1e-3) == pytest.approx(45.17, abs=0.02)
    for rtt in (0.02, 0.04, 0.08, 0.15):
        for loss in (1e-3, 5e-3, 1e-2, 2e-2):
            assert tcp.stream_rate("cubic", rtt_s=rtt, loss=loss, **kw) >= tcp.stream_rate(
                "reno", rtt_s=rtt, loss=loss, **kw
            )


@pytest.mark.parametrize("cc", ["reno", "cubic"])
def test_loss_based_rates_fall_with_loss_and_rtt_and_rise_with_streams(cc):
    kw = dict(window_bytes=WINDOW, mss_bytes=MSS)
    losses = [1e-4, 1e-3, 5e-3, 1e-2, 2e-2]
    rates = [tcp.stream_rate(cc, rtt_s=0.04, loss=p, **kw) for p in losses]
    assert rates == sorted(rates, reverse=True) and len(set(rates)) == len(rates)
    by_rtt = [tcp.stream_rate(cc, rtt_s=r, loss=1e-2, **kw) for r in (0.02, 0.04, 0.08, 0.15)]
    assert by_rtt == sorted(by_rtt, reverse=True)
    caps = [tcp.tcp_cap(streams=s, rtt_s=0.04, loss=1e-2, congestion=cc, **kw) for s in (1, 2, 4)]
    assert caps[1] == pytest.approx(2 * caps[0]) and caps[2] == pytest.approx(4 * caps[0])


def test_bbr_ignores_loss_below_its_threshold_and_refuses_above():
    kw = dict(window_bytes=WINDOW, mss_bytes=MSS)
    clean = tcp.stream_rate("bbr", rtt_s=0.04, loss=0.0, **kw)
    assert clean == WINDOW / 0.04
    for loss in (1e-3, 1e-2, 0.1, 0.19):
        assert tcp.stream_rate("bbr", rtt_s=0.04, loss=loss, **kw) == clean
    with pytest.raises(ValueError, match="bbr model holds below 0.2"):
        tcp.stream_rate("bbr", rtt_s=0.04, loss=0.2, **kw)
    with pytest.raises(ValueError, match="congestion must be one of"):
        tcp.check("vegas", 0.0)


def test_every_stream_is_held_to_its_window():
    for cc in tcp.CONGESTION:
        rate = tcp.stream_rate(cc, rtt_s=0.1, loss=1e-7, window_bytes=1 << 20, mss_bytes=MSS)
        assert rate <= (1 << 20) / 0.1


def test_bulk_goodput_shares_the_link_less_what_is_sent_twice():
    kw = dict(rtt_s=0.04, window_bytes=WINDOW, mss_bytes=MSS)
    link = 100e6 / 8
    assert tcp.bulk_goodput("bbr", streams=1, loss=0.01, capacity=link, **kw) == link * 0.99
    one = tcp.bulk_goodput("reno", streams=1, loss=0.01, capacity=link, **kw)
    assert one == tcp.stream_rate("reno", loss=0.01, **kw) < link * 0.99
    assert tcp.bulk_goodput("cubic", streams=8, loss=1e-4, capacity=link, **kw) == link * 0.9999


def test_timeouts_are_linuxs():
    assert tcp.rto_s(0.04) == pytest.approx(0.24)
    # One packet out: min(2 SRTT + 200 ms, RTO) = the RTO; several: 2 SRTT (+ 2 ms).
    assert tcp.probe_timeout_s(0.04, one_out=True) == pytest.approx(0.24)
    assert tcp.probe_timeout_s(0.04, one_out=False) == pytest.approx(0.082)


def test_tail_cost_by_where_the_last_loss_is():
    rtt, gap = 0.04, 0.001
    assert tcp.tail_cost(0, rtt_s=rtt, gap_s=gap) == pytest.approx(0.04 + 0.24 - 0.001)
    assert tcp.tail_cost(1, rtt_s=rtt, gap_s=gap) == pytest.approx(1.25 * 0.04 - 0.001)
    assert tcp.tail_cost(3, rtt_s=rtt, gap_s=gap) == pytest.approx(0.04)
    assert tcp.tail_cost(13, rtt_s=rtt, gap_s=gap) == pytest.approx(0.03)
    assert tcp.tail_cost(43, rtt_s=rtt, gap_s=gap) == 0.0
    costs = [tcp.tail_cost(k, rtt_s=rtt, gap_s=gap) for k in range(60)]
    assert costs == sorted(costs, reverse=True)


def test_tail_delay_draws_match_their_distribution():
    rng = np.random.default_rng(0)
    kw = dict(loss=0.01, rtt_s=0.04, rate=100e6 / 8, streams=1, mss=MSS)
    draws = np.array([tcp.tail_delay(rng, **kw) for _ in range(20000)])
    gap = MSS / (100e6 / 8)
    expected = sum(0.01 * 0.99**k * tcp.tail_cost(k, rtt_s=0.04, gap_s=gap) for k in range(5000))
    assert draws.mean() == pytest.approx(expected, rel=0.05)
    # The probe's wait shows in about p of the draws.
    assert (draws > 0.2).mean() == pytest.approx(0.01, abs=0.003)
    assert tcp.tail_delay(rng, **{**kw, "loss": 0.0}) == 0.0
    # More streams: the nearest last loss among them, so the end is later on average.
    four = np.array([tcp.tail_delay(rng, **{**kw, "streams": 4}) for _ in range(20000)])
    assert four.mean() > draws.mean()


def test_message_delay_is_a_probe_then_doubling_rtos():
    rng = np.random.default_rng(1)
    draws = np.array([tcp.message_delay(rng, loss=0.05, rtt_s=0.04) for _ in range(40000)])
    assert (draws == 0).mean() == pytest.approx(0.95, abs=0.005)
    assert set(np.round(draws[draws > 0], 6)) >= {0.24, 0.48}
    assert (np.isclose(draws, 0.24 + 0.24 + 0.48)).sum() > 0  # a third loss: doubled RTO
    assert tcp.message_delay(rng, loss=0.0, rtt_s=0.04) == 0.0


def _topology(**link):
    return topology_from_dict(
        {
            "name": "t",
            "trainer": {"region": "us", "model": "qwen3-8b", "gpus": 1},
            "regions": [{"name": "us"}, {"name": "ca"}],
            "links": [{"a": "us", "b": "ca", "gbps": 1.0, "rtt_ms": 40, **link}],
            "actors": [{"region": "ca", "gpu": "A100", "count": 2}],
            **({"congestion": link.pop("cc")} if "cc" in link else {}),
        }
    )


def test_a_topology_names_its_congestion_control_or_none():
    assert _topology().congestion is None
    with pytest.raises(ValueError, match="congestion: must be one of"):
        topology_from_dict(
            {
                "name": "t",
                "trainer": {"region": "us", "model": "m", "gpus": 1},
                "regions": [{"name": "us"}],
                "actors": [{"region": "us", "gpu": "A100"}],
                "congestion": "vegas",
            }
        )


def _sim(cc: str | None, loss: float, **kw):
    from aurora.strategies import strategy
    from aurora.traces import load_traces
    from sim.config import SimConfig
    from sim.model import simulate

    base = _topology(loss=loss)
    topo = dataclasses.replace(base, congestion=cc)
    cfg = SimConfig(
        topology=topo,
        traces=load_traces(),
        strategy=strategy(kw.pop("strategy", "prime-full")),
        steps=kw.pop("steps", 4),
        batch_rollouts=64,
        **kw,
    )
    return simulate(cfg)


def test_the_simulator_takes_the_topologys_congestion_control():
    # One dense stream over 40 ms at 1e-4: reno is loss-limited, bbr only by its window.
    reno = _sim(None, 1e-4)
    named = _sim("reno", 1e-4)
    bbr = _sim("bbr", 1e-4)
    assert [r["step_time_s"] for r in reno.rows] == [r["step_time_s"] for r in named.rows]
    assert bbr.rows[-1]["time_s"] < 0.5 * reno.rows[-1]["time_s"]
    with pytest.raises(ValueError, match=r"links\[0\] us-ca: the bbr model holds below"):
        _sim("bbr", 0.25)


def test_loss_recovery_changes_nothing_on_lossless_links_and_delays_lossy_ones():
    plain = _sim("cubic", 0.0, strategy="aurora", control_latency=True)
    recovering = _sim("cubic", 0.0, strategy="aurora", control_latency=True, loss_recovery=True)
    assert plain.rows == recovering.rows
    lossy = _sim("bbr", 0.02, strategy="aurora", control_latency=True)
    lossy_rec = _sim("bbr", 0.02, strategy="aurora", control_latency=True, loss_recovery=True)
    assert lossy_rec.rows[-1]["time_s"] > lossy.rows[-1]["time_s"]
    again = _sim("bbr", 0.02, strategy="aurora", control_latency=True, loss_recovery=True)
    assert again.rows == lossy_rec.rows  # seeded draws
