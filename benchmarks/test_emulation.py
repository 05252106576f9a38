"""Accuracy of the emulated WAN: RTT idle and under load, multi-stream goodput against the
simulator's Mathis model, rate fluctuation per period, loss rate, and the rates this machine
can emulate. Needs root and network namespaces (skips, saying why, elsewhere).

    python -m pytest benchmarks/test_emulation.py --benchmark-enable -s
    AURORA_EMU_SECONDS=30 python -m pytest benchmarks/test_emulation.py -k goodput ...

Every number is a ratio against the configured value (or the model's prediction) measured in
the same run. The numbers of record are in docs/EMULATION.md.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path

import pytest

from aurora.topology import topology_from_dict
from emulation.capabilities import probe_capabilities
from emulation.measure import tail_gbps
from emulation.network import build_network
from emulation.plan import MTU_FRAME_BYTES, EmulationError, EmulationUnavailable
from sim.network import tcp_cap

SECONDS = float(os.environ.get("AURORA_EMU_SECONDS", "20"))
"""Length of each goodput transfer (s); loss events at 1e-4 are rare, so longer is steadier."""
MSS = 1448
"""TCP payload per MTU packet (1500 - IP - TCP - timestamps), as in aurora/traces/paper.yaml."""
WINDOW = 4 << 20
"""Linux's default tcp_wmem maximum, the simulator's tcp_window_bytes."""
PAYLOAD = MSS / MTU_FRAME_BYTES
"""Goodput over wire rate for full-sized packets (the htb rate counts whole frames)."""


@pytest.fixture(scope="module")
def caps():
    try:
        return probe_capabilities()
    except EmulationUnavailable as exc:
        pytest.skip(f"cannot emulate a network here: {exc}")


def two_regions(gbps, rtt_ms, loss=0.0, fluctuation=None):
    link = {"a": "us", "b": "ca", "gbps": gbps, "rtt_ms": rtt_ms, "loss": loss}
    if fluctuation:
        link["fluctuation"] = fluctuation
    return topology_from_dict(
        {
            "name": "bench",
            "trainer": {"region": "us", "model": "m", "gpus": 1},
            "regions": [{"name": "us"}, {"name": "ca"}],
            "links": [link],
            "actors": [{"region": "ca", "gpu": "A100"}],
        }
    )


def build(topology, **kw):
    try:
        return build_network(topology, verify=False, **kw)
    except EmulationError as exc:
        pytest.skip(f"this machine cannot build the network: {exc}")


def delay_line_cpu_s(net) -> float:
    """CPU seconds used so far by the network's delay-line processes (0 with netem)."""
    total = 0.0
    for proc in net._delaylines.values():
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


@pytest.mark.benchmark(group="emulation")
def test_rtt_idle_and_under_load_against_the_configured_rtt(caps, benchmark):
    rows = []

    def run():
        for rtt in (10, 40, 100):
            with build(two_regions(0.1, rtt)) as net:
                d = net.plan.direction("us", "ca")
                for src, dst in (("us", "ca"), ("ca", "us")):
                    got = net.ping(src, dst, count=50, interval_s=0.02)
                    rows.append(("idle", rtt, src, dst, got["rtt_ms"], None))
                for cc in ("cubic", "bbr"):
                    loaded = {}

                    def bulk(cc=cc, loaded=loaded, net=net):
                        loaded["tcp"] = net.tcp("us", "ca", streams=1, seconds=8, cc=cc)

                    t = threading.Thread(target=bulk)
                    t.start()
                    try:
                        # the echo requests queue behind the transfer at the router's egress
                        # toward ca; skip the first 2 s of the transfer's ramp
                        net.ping("us", "ca", count=20, interval_s=0.1)
                        got = net.ping("us", "ca", count=40, interval_s=0.1)
                    finally:
                        t.join()
                    bound = rtt + d.queue_delay_ms
                    rows.append((f"load {cc}", rtt, "us", "ca", got["rtt_ms"], bound))

    benchmark.pedantic(run, rounds=1, iterations=1)
    print("\nRTT (ms): configured, median, p95, max; under load the bound is RTT + queue/rate")
    for kind, rtt, src, dst, xs, bound in rows:
        med = statistics.median(xs)
        extra = f"  bound {bound:.1f}, p95 within: {pct(xs, 0.95) <= bound + 1}" if bound else ""
        print(
            f"{kind:10s} {src}->{dst} {rtt:5.0f}  median {med:7.2f} ({med / rtt - 1:+.1%}) "
            f"p95 {pct(xs, 0.95):7.2f} max {max(xs):7.2f} n={len(xs)}{extra}"
        )
    for kind, rtt, *_rest, xs, _bound in rows:
        if kind == "idle":
            assert abs(statistics.median(xs) - rtt) <= max(0.05 * rtt, 1.0)


@pytest.mark.benchmark(group="emulation")
def test_goodput_of_parallel_streams_against_the_mathis_model(caps, benchmark):
    rate_mbit, rtt_ms, loss = 100, 40, 1e-4
    results = {}

    def run():
        with build(two_regions(rate_mbit / 1e3, rtt_ms, loss)) as net:
            for cc in ("cubic", "bbr"):
                for s in (1, 2, 4, 8):
                    got = net.tcp("us", "ca", streams=s, seconds=SECONDS, cc=cc, skip_fraction=0.2)
                    results[(cc, s)] = got

    benchmark.pedantic(run, rounds=1, iterations=1)
    link = rate_mbit * 1e6 / 8  # bytes/s, as the simulator's resource
    print(
        f"\n{rate_mbit} Mbit/s, {rtt_ms} ms, loss {loss:g}, {SECONDS:.0f} s per run "
        f"(payload ceiling {PAYLOAD * rate_mbit:.1f} Mbit/s)"
    )
    print("cc     S  measured  sim(Mathis, window, link)  measured/sim")
    for (cc, s), got in results.items():
        cap = tcp_cap(streams=s, rtt_s=rtt_ms / 1e3, loss=loss, window_bytes=WINDOW, mss_bytes=MSS)
        sim = min(cap, link) * 8 / 1e6
        m = got["gbps"] * 1e3
        print(f"{cc:6s} {s}  {m:7.1f}   {sim:7.1f}                    {m / sim:5.2f}")
    for cc in ("cubic", "bbr"):
        one, eight = results[(cc, 1)]["gbps"], results[(cc, 8)]["gbps"]
        four = results[(cc, 4)]["gbps"]
        print(f"{cc}: S=4 / S=1 = {four / one:.2f}, S=8 / S=1 = {eight / one:.2f}")
    assert all(0 < g["gbps"] * 1e3 <= 1.1 * rate_mbit for g in results.values())


@pytest.mark.benchmark(group="emulation")
@pytest.mark.parametrize(
    ("rate_mbit", "rtt_ms", "loss", "seconds"),
    [(47.2, 40, 1e-6, 3.0), (100, 10, 1e-4, 1.0), (100, 10, 1e-4, 2.0)],
)
def test_spread_of_the_start_up_goodput_probe(caps, benchmark, rate_mbit, rtt_ms, loss, seconds):
    """What the build-time check (``verify``) sees: single probes as it runs them (4 bbr
    streams, the second half of ``seconds``), ten in a row, as a share of the htb rate. The
    cases: ``aurora emulate``'s geo.yaml at scale 0.05 (first period) and the netns verify test
    at its old 1 s and its 2 s probe. The check's floor is 0.75 of the rate; this spread is why
    a short probe below it is tried again (best of 3) before a build is refused."""
    shares: list[float] = []

    def run():
        with build(two_regions(rate_mbit / 1e3, rtt_ms, loss)) as net:
            for _ in range(10):
                got = net.tcp("us", "ca", streams=4, seconds=seconds, cc="bbr")
                shares.append(got["gbps"] * 1e3 / rate_mbit)

    benchmark.pedantic(run, rounds=1, iterations=1)
    low = sum(x < 0.75 for x in shares)
    print(
        f"\n{rate_mbit} Mbit/s, {rtt_ms} ms, {seconds:g} s probes: share of the rate "
        f"{min(shares):.2f}-{max(shares):.2f} (median {statistics.median(shares):.2f}), "
        f"{low}/10 below the 0.75 floor"
    )
    assert all(0 < x <= 1.1 for x in shares)


@pytest.mark.benchmark(group="emulation")
def test_rate_follows_the_fluctuation_schedule_period_by_period(caps, benchmark):
    period, periods = 2.0, 6
    fl = {"low_gbps": 0.02, "high_gbps": 0.1, "period_s": period}
    out = {}

    def run():
        with build(two_regions(0.1, 10, fluctuation=fl), seed=11) as net:
            got = net.tcp("us", "ca", streams=4, seconds=period * periods, cc="bbr")
            out["tcp"] = got
            out["schedule"] = net.rate_schedule("us", "ca")

    benchmark.pedantic(run, rounds=1, iterations=1)
    got, schedule = out["tcp"], out["schedule"]
    first = got["first_monotonic"]
    samples = [(first + t, b) for t, b in got["samples"]]
    print(f"\nfluctuation 20-100 Mbit/s every {period:.0f} s (bbr, 4 streams, 10 ms RTT)")
    print("period  scheduled  measured  measured/(scheduled x payload share)")
    ratios = []
    for k, entry in enumerate(schedule):
        start, end = entry["monotonic"] + 0.4, entry["monotonic"] + period - 0.1
        window = [(t - start, b) for t, b in samples if start <= t <= end]
        if len(window) < 10 or end > first + got["first_close_s"]:
            continue
        gbps = tail_gbps(window, skip_fraction=0.0)
        want = entry["gbps"] * PAYLOAD
        ratios.append(gbps / want)
        print(f"{k:5d}   {entry['gbps'] * 1e3:7.1f}   {gbps * 1e3:7.1f}    {gbps / want:5.2f}")
    assert len(ratios) >= 3
    print(f"median ratio {statistics.median(ratios):.2f}")


@pytest.mark.benchmark(group="emulation")
def test_loss_rate_against_the_configured_loss(caps, benchmark):
    rows = []

    def run():
        for loss, packets in ((1e-2, 20_000), (1e-3, 100_000)):
            with build(two_regions(0.1, 4, loss=loss)) as net:
                got = net.blast("us", "ca", packets=packets, pps=10_000, size=200)
                rows.append((loss, packets, got))

    benchmark.pedantic(run, rounds=1, iterations=1)
    print("\nloss configured, packets, measured (ratio)")
    for loss, packets, got in rows:
        print(f"{loss:g}  {packets}  {got['loss']:.5f} ({got['loss'] / loss:.2f})")
    for loss, _packets, got in rows:
        assert 0.7 * loss <= got["loss"] <= 1.3 * loss


@pytest.mark.benchmark(group="emulation")
def test_rates_this_machine_can_emulate_with_delay(caps, benchmark):
    rows = []

    def run():
        for mbit in (100, 300, 1000):
            with build(two_regions(mbit / 1e3, 20)) as net:
                load = {}
                cpu0, wall0 = delay_line_cpu_s(net), time.monotonic()
                t = threading.Thread(
                    target=lambda net=net, load=load: load.update(
                        tcp=net.tcp("us", "ca", streams=4, seconds=6, cc="bbr")
                    )
                )
                t.start()
                try:
                    net.ping("us", "ca", count=20, interval_s=0.1)  # the ramp
                    rtt = net.ping("us", "ca", count=30, interval_s=0.1)["rtt_ms"]
                finally:
                    t.join()
                cpu = (delay_line_cpu_s(net) - cpu0) / (time.monotonic() - wall0)
                rows.append((mbit, net.plan.segmentation, load["tcp"]["gbps"] * 1e3, rtt, cpu))

    benchmark.pedantic(run, rounds=1, iterations=1)
    print(
        "\n20 ms RTT, bbr x 4: configured, segmentation, goodput (share), RTT under load, "
        "CPU of both delay lines (share of one core)"
    )
    for mbit, seg, got, rtt, cpu in rows:
        print(
            f"{mbit:5d} Mbit/s  {seg}  {got:7.1f} ({got / mbit:.0%})  "
            f"median {statistics.median(rtt):.1f} ms, p95 {pct(rtt, 0.95):.1f} ms  CPU {cpu:.0%}"
        )
