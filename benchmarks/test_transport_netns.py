"""Data-plane goodput over an emulated bottleneck: sender and receiver in their own network
namespaces, an htb rate limit on a router namespace between them (emulation/netns.py).

Reported for S = 1, 2, 4, 8 at 100 Mbit/s and 1 Gbit/s as a share of the configured rate: once
when the last segment arrived verified (the transfer), once when the delta was staged (after
the whole-file parse). Skips, saying why, where namespaces cannot be made.

    python -m pytest benchmarks/test_transport_netns.py --benchmark-enable -s
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from aurora.topology import topology_from_dict
from emulation.capabilities import probe_capabilities
from emulation.netns import EmulatedLink, EmulationUnavailable, check_available
from emulation.network import build_network
from emulation.plan import MTU_FRAME_BYTES, EmulationError

PAYLOAD = 1448 / MTU_FRAME_BYTES
"""Goodput over wire rate for full-sized packets (the htb rate counts whole frames)."""

PEER = str(Path(__file__).with_name("_transport_peer.py"))
ROOT = str(Path(__file__).resolve().parent.parent)


@pytest.fixture(scope="module")
def namespaces_usable() -> None:
    try:
        check_available()
    except EmulationUnavailable as exc:
        pytest.skip(f"cannot emulate a link here: {exc}")


def serve(link: EmulatedLink, mb: float, streams: int) -> subprocess.Popen:
    """A Trainer in the sender namespace with the delta published (it prints "ready")."""
    return link.popen(
        link.sender,
        [sys.executable, PEER, "serve", link.sender_ip, "7000", str(mb), str(streams)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def transfer(link: EmulatedLink, mb: float, streams: int) -> dict:
    srv = serve(link, mb, streams)
    try:
        assert srv.stdout is not None and srv.stdout.readline().strip() == "ready"
        out = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                link.receiver,
                sys.executable,
                PEER,
                "receive",
                link.sender_ip,
                "7000",
                str(mb),
                str(streams),
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=True,
        )
    finally:
        srv.kill()
        srv.wait()
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.benchmark(group="netns")
@pytest.mark.parametrize(("rate_mbit", "mb"), [(100, 25), (1000, 200)])
def test_goodput_over_an_htb_bottleneck(namespaces_usable, benchmark, rate_mbit, mb):
    results = {}
    with EmulatedLink(rate_mbit=rate_mbit) as link:

        def sweep() -> None:
            for s in (1, 2, 4, 8):
                results[s] = transfer(link, mb, s)

        benchmark.pedantic(sweep, rounds=1, iterations=1)
    rate = rate_mbit * 1e6 / 8
    for s, r in results.items():
        recv = r["bytes"] / r["received_s"] / rate
        staged = r["bytes"] / r["staged_s"] / rate
        print(
            f"\n{rate_mbit} Mbit/s, S={s}: {recv:.0%} of the rate to the last verified segment, "
            f"{staged:.0%} to staged (target S=4 >= 90%)"
        )
    assert all(r["bytes"] > 0 for r in results.values())


@pytest.mark.benchmark(group="netns")
def test_fanout_through_a_relay_crosses_the_bottleneck_once(namespaces_usable, benchmark):
    """Trainer -> relay -> 4 Actors, the relay and Actors behind a 100 Mbit/s bottleneck."""
    mb, streams, actors = 25, 4, 4
    out = {}
    with EmulatedLink(rate_mbit=100) as link:

        def run() -> None:
            out["single"] = transfer(link, mb, streams)["staged_s"]
            trainer = serve(link, mb, streams)
            procs = [trainer]
            try:
                assert trainer.stdout.readline().strip() == "ready"
                relay = link.popen(
                    link.receiver,
                    [
                        sys.executable,
                        PEER,
                        "relay",
                        link.sender_ip,
                        "7000",
                        str(mb),
                        str(streams),
                        "7001",
                        str(actors),
                    ],
                    stdout=subprocess.PIPE,
                    text=True,
                    cwd=ROOT,
                )
                procs.append(relay)
                assert relay.stdout.readline().strip() == "ready"
                before = link.bottleneck_bytes()
                receivers = [
                    link.popen(
                        link.receiver,
                        [
                            sys.executable,
                            PEER,
                            "receive-wall",
                            link.receiver_ip,
                            "7001",
                            str(mb),
                            str(streams),
                            f"actor-{i}",
                        ],
                        stdout=subprocess.PIPE,
                        text=True,
                        cwd=ROOT,
                    )
                    for i in range(actors)
                ]
                procs += receivers
                start = json.loads(relay.stdout.readline())["start_wall"]
                ends = [json.loads(r.stdout.readline())["staged_wall"] for r in receivers]
                out["fanout"] = max(ends) - start
                out["wan_bytes"] = link.bottleneck_bytes() - before
            finally:
                for p in procs:
                    p.kill()
                    p.wait()

        benchmark.pedantic(run, rounds=1, iterations=1)
    size = mb * 1e6
    print(
        f"\nfanout to {actors} Actors: {out['fanout']:.2f} s vs one direct transfer "
        f"{out['single']:.2f} s ({out['fanout'] / out['single']:.2f} x, target <= 1.15); "
        f"bottleneck carried {out['wan_bytes'] / size:.2f} x the delta (target: once)"
    )
    assert out["wan_bytes"] < 1.5 * size  # each byte crosses the bottleneck once, plus headers


@pytest.mark.benchmark(group="netns")
def test_a_small_delta_over_a_scaled_wan_link_takes_its_ideal_time_on_one_or_four_streams(
    benchmark,
):
    """The rl backend's deltas (~370 KB, one 4 MiB segment) over `aurora real --emulate`'s
    scaled us-ca link (5.71 Mbit/s, 40 ms, a 1-BDP drop-tail queue), on one subscription that
    stays up for the whole chain, as in a running job. A delta of one segment travels on one
    stream whatever S is (segments are striped across streams, not split), so S = 4 cannot burst
    into the shallow queue; this measures whether anything else on the path costs time.

    Reported per S: the median of publish -> last byte verified for D_2..D_6 (D_1 pays for the
    idle connection's restart) against the ideal: wire bytes at the htb rate + one-way delay."""
    try:
        probe_capabilities()
    except EmulationUnavailable as exc:
        pytest.skip(f"cannot emulate a network here: {exc}")
    rate_gbps, rtt_ms, mb, n, gap = 0.00571, 40.0, 0.37, 6, 1.5
    t = topology_from_dict(
        {
            "name": "bench",
            "trainer": {"region": "us", "model": "m", "gpus": 1},
            "regions": [{"name": "us"}, {"name": "ca"}],
            "links": [{"a": "us", "b": "ca", "gbps": rate_gbps, "rtt_ms": rtt_ms, "loss": 1e-6}],
            "actors": [{"region": "ca", "gpu": "A100"}],
        }
    )
    out: dict[int, list[float]] = {}
    sizes: list[int] = []
    try:
        net = build_network(t, verify=False)
    except EmulationError as exc:
        pytest.skip(f"this machine cannot build the network: {exc}")
    with net:
        host = net.address("us")

        def run() -> None:
            for s in (1, 4, 1, 4):
                srv = net.popen(
                    "us",
                    [
                        sys.executable,
                        PEER,
                        "serve-chain",
                        host,
                        "7000",
                        str(mb),
                        str(s),
                        str(n),
                        str(gap),
                    ],
                    stdout=subprocess.PIPE,
                    text=True,
                    cwd=ROOT,
                )
                try:
                    assert srv.stdout is not None and srv.stdout.readline().strip() == "ready"
                    got = subprocess.run(
                        net.wrap(
                            "ca",
                            [
                                sys.executable,
                                PEER,
                                "receive-chain",
                                host,
                                "7000",
                                str(mb),
                                str(s),
                                str(n),
                            ],
                        ),
                        capture_output=True,
                        text=True,
                        cwd=ROOT,
                        check=True,
                    )
                finally:
                    srv.kill()
                    published = {
                        r["v"]: r["published"]
                        for r in map(json.loads, srv.stdout.read().splitlines()[:n])
                    }
                    srv.wait()
                received = [json.loads(x) for x in got.stdout.splitlines() if x.startswith("{")]
                sizes.extend(r["bytes"] for r in received)
                out.setdefault(s, []).extend(
                    r["received"] - published[r["v"]] for r in received if r["v"] >= 2
                )

        benchmark.pedantic(run, rounds=1, iterations=1)
    size = max(sizes)
    ideal = size / PAYLOAD * 8 / (rate_gbps * 1e9) + rtt_ms / 2e3
    for s, times in out.items():
        med = statistics.median(times)
        print(
            f"\nS={s}: {size / 1e3:.0f} KB delta, publish -> received {med:.3f} s median "
            f"({min(times):.3f}-{max(times):.3f}) against {ideal:.3f} s ideal "
            f"({med / ideal:.2f}x)"
        )
    assert all(len(v) == 2 * (n - 1) for v in out.values())
