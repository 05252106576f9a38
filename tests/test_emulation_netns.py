"""The emulated WAN on real namespaces: delay, loss, cut/restore, reachability, cleanup.

Needs root and network namespaces (skips, saying why, elsewhere). Delay uses netem where the
kernel has it and the NFQUEUE delay line otherwise; loss is iptables statistic (or netem).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from aurora.topology import topology_from_dict
from emulation import cleanup
from emulation.capabilities import probe_capabilities
from emulation.measure import PROBE
from emulation.network import Network, build_network, new_tag
from emulation.plan import EmulationError, EmulationUnavailable, rate_draws

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def caps():
    try:
        found = probe_capabilities()
    except EmulationUnavailable as exc:
        pytest.skip(f"cannot emulate a network here: {exc}")
    if not (found.netem or (found.nfqueue and found.statistic)):
        pytest.skip(f"no delay or loss mechanism here: {'; '.join(found.missing)}")
    return found


def topo(links, regions=("us", "ca", "eu")):
    return topology_from_dict(
        {
            "name": "t",
            "trainer": {"region": regions[0], "model": "m", "gpus": 1},
            "regions": [{"name": r} for r in regions],
            "links": links,
            "actors": [{"region": r, "gpu": "A100"} for r in regions[1:]],
        }
    )


def build(t, **kw):
    kw.setdefault("verify", False)
    try:
        return build_network(t, **kw)
    except EmulationError as exc:  # a facility this machine lacks: say which
        pytest.skip(f"this machine cannot build the network: {exc}")


@contextlib.contextmanager
def server(net: Network, region: str):
    proc = net.popen(
        region,
        [sys.executable, PROBE, "serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        assert ready, "probe server did not start"
        proc.ports = json.loads(proc.stdout.readline())  # type: ignore[attr-defined]
        yield proc
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=10)


def client(net: Network, region: str, *args: str) -> dict:
    out = subprocess.run(
        net.wrap(region, [sys.executable, PROBE, *args]),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout.splitlines()[-1])


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def test_the_delay_gives_each_link_its_configured_rtt_both_ways(caps):
    t = topo(
        [
            {"a": "us", "b": "ca", "gbps": 0.1, "rtt_ms": 20},
            {"a": "us", "b": "eu", "gbps": 0.1, "rtt_ms": 60},
        ]
    )
    with build(t) as net:
        for src, dst, want in (("us", "ca", 20), ("ca", "us", 20), ("eu", "us", 60)):
            got = net.ping(src, dst, count=15)
            assert got["lost"] == 0
            m = median(got["rtt_ms"])
            # never short by more than the delay line's half quantum per direction (0.5 ms in
            # all); long by what a busy machine adds to the delay line and to ping's wake-ups
            assert want - 1.0 <= m <= want + max(0.05 * want, 3.0), (src, dst, got)
        desc = net.describe()
        mech = {(x["a"], x["b"]): x["mechanisms"]["delay"] for x in desc["links"]}
        assert set(mech.values()) == {"netem" if caps.netem else "NFQUEUE"}


def test_the_loss_rate_is_within_30_percent_over_ten_thousand_packets(caps):
    t = topo([{"a": "us", "b": "ca", "gbps": 0.1, "rtt_ms": 4, "loss": 0.02}], ("us", "ca"))
    # A queue far deeper than the blast can fill: a stalled client that catches up sends
    # back-to-back, and drops at a 1-BDP queue (50 KB here) would count as link loss.
    with build(t, queue_bytes=8 << 20) as net, server(net, "ca") as srv:
        sent = client(
            net,
            "us",
            "blast",
            net.address("ca"),
            str(srv.ports["udp"]),
            "--packets",
            "12000",
            "--pps",
            "8000",
            "--size",
            "200",
        )
        ready, _, _ = select.select([srv.stdout], [], [], 30)
        assert ready
        got = json.loads(srv.stdout.readline())
    assert sent["sent"] == got["sent"] == 12000
    loss = 1 - got["received"] / got["sent"]
    assert 0.7 * 0.02 <= loss <= 1.3 * 0.02, loss


def test_a_cut_link_drops_both_ways_until_restored_and_the_other_links_keep_working(caps):
    t = topo(
        [
            {"a": "us", "b": "ca", "gbps": 0.1, "rtt_ms": 2},
            {"a": "us", "b": "eu", "gbps": 0.1, "rtt_ms": 2},
        ]
    )
    with build(t) as net:
        assert net.ping("ca", "us", count=3)["lost"] == 0
        net.cut("us", "ca")
        assert net.is_cut("ca", "us")
        assert net.ping("ca", "us", count=3, timeout_s=0.2)["lost"] == 3
        assert net.ping("us", "ca", count=3, timeout_s=0.2)["lost"] == 3
        assert net.ping("eu", "us", count=3)["lost"] == 0
        with pytest.raises(EmulationError, match="already cut"):
            net.cut("ca", "us")
        assert net.is_cut("us", "ca")  # the refused cut changed nothing
        assert net.describe()["links"][0]["cut"] is True
        net.restore("ca", "us")
        assert net.ping("ca", "us", count=3)["lost"] == 0
        with pytest.raises(EmulationError, match="is not cut"):
            net.restore("us", "ca")
        assert not net.is_cut("us", "ca")
        assert net.ping("us", "ca", count=2)["lost"] == 0
        with pytest.raises(KeyError, match="no link ca-eu"):
            net.cut("ca", "eu")


def test_a_dead_delay_line_drops_its_direction_and_is_reported(caps):
    if caps.netem:
        pytest.skip("netem delays here: there is no delay line to kill")
    t = topo([{"a": "us", "b": "ca", "gbps": 0.1, "rtt_ms": 4}], ("us", "ca"))
    with build(t) as net:
        assert net.errors() == []
        q = net.plan.direction("us", "ca").nfqueue
        line = net._delaylines[q]
        line.kill()
        line.wait(timeout=10)
        # fail closed: no packet crosses undelayed
        assert net.ping("us", "ca", count=3, timeout_s=0.2)["lost"] == 3
        assert net.errors() == [f"the delay line of us->ca exited ({line.returncode})"]


def test_regions_without_a_link_are_refused_at_once_and_loopback_works_inside_a_region(caps):
    t = topo(
        [
            {"a": "us", "b": "ca", "gbps": 0.1, "rtt_ms": 2},
            {"a": "us", "b": "eu", "gbps": 0.1, "rtt_ms": 2},
        ]
    )
    with build(t) as net, server(net, "ca") as srv:
        # ca and eu share no link: the router answers "prohibited", nothing crosses
        got = client(net, "eu", "rtt", net.address("ca"), str(srv.ports["udp"]), "--count", "2")
        assert got["lost"] == 2
        # roles of one region talk over loopback and over the region's own address
        for host in ("127.0.0.1", net.address("ca")):
            got = client(net, "ca", "rtt", host, str(srv.ports["udp"]), "--count", "3")
            assert got["lost"] == 0 and max(got["rtt_ms"]) < 50


def test_the_fluctuating_rate_changes_the_kernels_class_every_period(caps):
    t = topo(
        [
            {
                "a": "us",
                "b": "ca",
                "gbps": 0.1,
                "rtt_ms": 2,
                "fluctuation": {"low_gbps": 0.02, "high_gbps": 0.1, "period_s": 0.2},
            }
        ],
        ("us", "ca"),
    )
    with build(t, seed=3, scale=0.5) as net:
        schedule = net.wait_for_rate_changes("us", "ca", 3, timeout_s=20)
        # the simulator's draws for this seed and link, in order, scaled; each applied at or
        # after its period's start (how late is the machine's, not the controller's)
        draws = rate_draws(3, 0, 0.02, 0.1)
        want = [next(draws) * 0.5 for _ in schedule]
        assert [x["gbps"] for x in schedule] == pytest.approx(want)
        assert all(x["t_s"] >= k * 0.2 - 1e-3 for k, x in enumerate(schedule)), schedule
        assert all(0.01 <= x["gbps"] <= 0.05 for x in schedule)  # scaled bounds
        # The kernel's class is changed just before the schedule records the change: read the
        # class first, then wait for one more change, so the rate read is in the list read.
        now = net.class_rate_gbps("ca", "us")
        n = len(net.rate_schedule("us", "ca"))
        rates = [x["gbps"] for x in net.wait_for_rate_changes("us", "ca", n + 1, timeout_s=20)]
        assert any(abs(now - r) <= 1e-3 * r for r in rates), (now, rates)
        latest = net.rate_schedule("us", "ca")[-1]["gbps"]
        assert latest in [x["gbps"] for x in net.describe()["rate_schedule"]["us-ca"]]


def test_verify_probes_every_direction_and_describe_is_the_emulation_json(caps):
    t = topo([{"a": "us", "b": "ca", "gbps": 0.05, "rtt_ms": 10, "loss": 1e-4}], ("us", "ca"))
    with build(t, verify=True, probe_seconds=2.0, scale=2.0, tcp_window_bytes=4 << 20) as net:
        desc = json.loads(json.dumps(net.describe()))
    assert desc["backend"] == "netns" and desc["scale"] == 2.0 and desc["errors"] == []
    assert desc["tcp"]["tcp_wmem"].split()[-1] == str(4 << 20)
    assert len(desc["links"]) == 2
    for link in desc["links"]:
        for key in (
            "a",
            "b",
            "gbps",
            "rtt_ms",
            "loss",
            "backend",
            "mechanism",
            "scale",
            "measured_rtt_ms",
            "measured_gbps",
        ):
            assert key in link, key
        assert link["gbps"] == pytest.approx(0.1)
        # the median may run long by what a busy 2-core machine adds (delay lines, probe), never
        # short by more than the delay line's half quantum per direction
        assert 10 - 1 <= link["measured_rtt_ms"] <= 10 + 3
        assert 0.07 <= link["measured_gbps"] <= 0.12


def test_a_rate_this_machine_cannot_reach_fails_the_build_instead_of_running_unshaped(caps):
    t = topo([{"a": "us", "b": "ca", "gbps": 400, "rtt_ms": 1}], ("us", "ca"))
    with pytest.raises(
        EmulationError,
        match=r"us->ca: measured .* Mbit/s against 400000.0 "
        r"configured \(over the measured window, best of 3 tries\); this machine cannot emulate "
        "that rate",
    ):
        build_network(t, verify=True, probe_seconds=1.0)


# -- cleanup -----------------------------------------------------------------------------------

BUILDER = """
import sys
from aurora.topology import topology_from_dict
from emulation.network import build_network
t = topology_from_dict({"name": "t", "trainer": {"region": "us", "model": "m", "gpus": 1},
    "regions": [{"name": "us"}, {"name": "ca"}],
    "links": [{"a": "us", "b": "ca", "gbps": 0.1, "rtt_ms": 4, "loss": 0.01}],
    "actors": [{"region": "ca", "gpu": "A100"}]})
net = build_network(t, verify=False, tag=sys.argv[1])
print(net.tag, flush=True)
sys.stdin.read()
"""


def nothing_left(tag: str) -> bool:
    left = cleanup.leftovers(tag)
    return not (left["namespaces"] or left["interfaces"] or left["registry"])


def start_builder(tag: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-c", BUILDER, tag],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    assert ready and proc.stdout.readline().strip() == tag
    return proc


def helpers(tag: str) -> list[int]:
    data = json.loads(cleanup.registry_path(tag).read_text())
    return [h["pid"] for h in data.get("helpers", [])]


def wait_exit(pid: int, timeout_s: float) -> bool:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([fd], [], [], timeout_s)
        return bool(ready)
    finally:
        os.close(fd)


def test_closing_a_network_leaves_nothing_of_it(caps):
    t = topo([{"a": "us", "b": "ca", "gbps": 0.1, "rtt_ms": 4, "loss": 0.01}], ("us", "ca"))
    net = build(t)
    pids = cleanup.processes(net.tag)
    assert pids and cleanup.namespaces(net.tag)
    net.close()
    assert nothing_left(net.tag)
    assert all(not cleanup.alive(p, None) or p == os.getpid() for p in pids)


def test_a_sigkilled_builder_is_cleaned_up_by_its_reaper(caps):
    tag = new_tag()
    proc = start_builder(tag)
    inside = cleanup.processes(tag)
    (reaper,) = helpers(tag)
    assert inside  # the delay lines
    proc.kill()
    proc.wait()
    assert wait_exit(reaper, 30)
    assert nothing_left(tag)
    assert not any(cleanup.alive(p, None) for p in inside)


def test_cleanup_leftovers_removes_a_network_whose_builder_and_reaper_died(caps):
    dead, live = new_tag(), new_tag()
    killed = start_builder(dead)
    alive = start_builder(live)
    try:
        os.kill(helpers(dead)[0], signal.SIGKILL)  # the reaper first, then the builder
        assert wait_exit(helpers(dead)[0], 10)
        killed.kill()
        killed.wait()
        assert cleanup.namespaces(dead)  # nobody cleaned up
        reports = cleanup.cleanup_leftovers()
        assert dead in [r["tag"] for r in reports]
        assert live not in [r["tag"] for r in reports]  # its builder still runs
        assert nothing_left(dead)
        assert cleanup.namespaces(live)
    finally:
        alive.stdin.close()  # a normal end: the builder exits, its reaper removes the network
        alive.wait(timeout=30)
        with contextlib.suppress(FileNotFoundError, ValueError):
            assert wait_exit(helpers(live)[0], 30)
    assert nothing_left(live)


def test_a_goodput_probe_that_falls_short_once_is_measured_again_and_the_best_try_counts(
    caps, monkeypatch
):
    from emulation import measure

    t = topo([{"a": "us", "b": "ca", "gbps": 0.05, "rtt_ms": 4}], ("us", "ca"))
    real = measure.probe_direction
    with build(t) as net:
        # us->ca: out of the band, then inside it (Gbit/s); ca->us: inside at once
        scripted = {("us", "ca"): [0.02, 0.045], ("ca", "us"): [0.048]}

        def flaky(net_, d, **kw):
            return dict(real(net_, d, **kw), measured_gbps=scripted[(d.src, d.dst)].pop(0))

        monkeypatch.setattr(measure, "probe_direction", flaky)
        net.probe(seconds=0.5)
        net._verify(0.25, 0.5)
        links = {(x["a"], x["b"]): x["probe"] for x in net.describe()["links"]}
        assert links[("us", "ca")]["goodput_tries"] == [0.02, 0.045]
        assert links[("us", "ca")]["measured_gbps"] == 0.045
        assert "goodput_tries" not in links[("ca", "us")]

        # always short: every try is spent and the error says so
        def short(net_, d, **kw):
            return dict(real(net_, d, **kw), measured_gbps=0.01)

        monkeypatch.setattr(measure, "probe_direction", short)
        net.probe(seconds=0.5)
        with pytest.raises(EmulationError, match=r"measured 10.0 Mbit/s .* best of 3 tries"):
            net._verify(0.25, 0.5)
