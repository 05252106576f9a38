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


def transfer(link: EmulatedLink, mb: float, streams: int) -> dict:
    srv = link.popen(
        link.sender,
        [sys.executable, PEER, "serve", link.sender_ip, "7000", str(mb), str(streams)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
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
