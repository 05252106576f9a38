"""Data-plane goodput over an emulated bottleneck: sender and receiver in their own network
namespaces, an htb rate limit on a router namespace between them (emulation/netns.py).

Reported for S = 1, 2, 4, 8 at 100 Mbit/s and 1 Gbit/s as a share of the configured rate: once
when the last segment arrived verified (the transfer), once when the delta was staged (after
the whole-file parse). Skips, saying why, where namespaces cannot be made.

    python -m pytest benchmarks/test_transport_netns.py --benchmark-enable -s
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from emulation.netns import EmulatedLink, EmulationUnavailable, check_available

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
