"""Measurements across an emulated network: RTT, TCP goodput, UDP loss, the start-up probe.

Theory of operation
-------------------
Each measurement runs real endpoints inside the namespaces (``ip netns exec``): a server from
:mod:`emulation.probe` (or the kernel itself, for ICMP echo) in the destination region and a
client in the source region, and reads what they print. :func:`ping` measures the idle RTT one
echo at a time, :func:`tcp` the goodput of ``streams`` TCP streams counted at the receiver over
a window that skips the ramp-up and stops at the first stream's end, and :func:`blast` the UDP
loss by sequence number at the receiver."""

from __future__ import annotations

import contextlib
import json
import math
import re
import select
import shutil
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from emulation.plan import DirectionPlan, EmulationError

if TYPE_CHECKING:  # pragma: no cover
    from emulation.network import Network

PROBE = str(Path(__file__).resolve().parent / "probe.py")


def read_line(proc: subprocess.Popen, what: str, timeout_s: float = 30.0) -> str:
    """One line of ``proc``'s stdout within ``timeout_s``; fail naming ``what`` otherwise."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout.fileno()], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        err = ""
        if proc.stderr is not None:
            with contextlib.suppress(Exception):
                err = proc.stderr.read().strip()
        raise EmulationError(f"{what} did not start: {err or 'no answer in time'}")
    return line.strip()


@contextlib.contextmanager
def probe_server(
    net: Network, region: str, *, buffer_bytes: int = 0
) -> Iterator[tuple[subprocess.Popen, dict]]:
    """A probe server in ``region``; yields the process and its ports (``udp``, ``tcp``)."""
    proc = net.popen(
        region,
        [sys.executable, PROBE, "serve", "--buffer", str(buffer_bytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc, json.loads(read_line(proc, f"the probe server in {region}"))
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def client(net: Network, region: str, args: list[str], *, timeout: float) -> dict:
    """Run one probe client in ``region``; its JSON result."""
    try:
        out = subprocess.run(
            net.wrap(region, [sys.executable, PROBE, *args]),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise EmulationError(f"probe {args[0]} from {region} took over {timeout:.0f} s") from None
    if out.returncode != 0:
        raise EmulationError(f"probe {args[0]} from {region} failed: {out.stderr.strip()}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def ping(
    net: Network,
    src: str,
    dst: str,
    *,
    count: int = 10,
    interval_s: float = 0.01,
    timeout_s: float = 2.0,
) -> dict:
    """RTTs (ms) from ``src`` to ``dst``: ``{"rtt_ms": [...], "lost", "method"}``.

    ICMP ``ping`` where installed (the far end's kernel answers, so no user-space scheduling
    there; ``ping`` stamps replies in the kernel), else the probe's UDP echo. One echo at a
    time, idle link: the configured RTT plus the delay line's wake-ups.
    """
    exe = shutil.which("ping")
    limit = count * (interval_s + timeout_s) + 10
    if exe is None:
        with probe_server(net, dst) as (_proc, ports):
            got = client(
                net,
                src,
                [
                    "rtt",
                    net.address(dst),
                    str(ports["udp"]),
                    "--count",
                    str(count),
                    "--interval",
                    str(interval_s),
                    "--timeout",
                    str(timeout_s),
                ],
                timeout=limit,
            )
        return {"rtt_ms": got["rtt_ms"], "lost": got["lost"], "method": "udp-echo"}
    argv = [
        exe,
        "-n",
        "-c",
        str(count),
        "-i",
        f"{interval_s:.3f}",
        "-W",
        f"{max(timeout_s, 0.001):.3f}",
        net.address(dst),
    ]
    try:
        out = subprocess.run(net.wrap(src, argv), capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        raise EmulationError(f"ping {src}->{dst} did not finish") from None
    rtts = [float(m.group(1)) for m in re.finditer(r"time=([\d.]+) ms", out.stdout)]
    return {"rtt_ms": rtts, "lost": count - len(rtts), "method": "ping"}


def tail_window(
    samples: list, *, skip_fraction: float = 0.5, until_s: float | None = None
) -> tuple[float, float, float]:
    """The window :func:`tail_gbps` measures over: ``(start_s, end_s, bytes)`` from cumulative
    ``(seconds, bytes)`` receiver samples, the part of ``[0, until_s]`` after ``skip_fraction``
    of it (the ramp-up is skipped). ``(0, 0, 0)`` when there is nothing to measure."""
    if until_s is not None:
        kept = [s for s in samples if s[0] <= until_s]
        samples = kept if len(kept) >= 2 else samples
    if not samples or samples[-1][0] <= 0:
        return 0.0, 0.0, 0.0
    end_t, end_b = samples[-1]
    start = skip_fraction * end_t
    t0, b0 = samples[0]
    for t, b in samples:
        if t > start:
            break
        t0, b0 = t, b
    return t0, end_t, end_b - b0


def tail_gbps(samples: list, *, skip_fraction: float = 0.5, until_s: float | None = None) -> float:
    """Goodput (Gbit/s) from cumulative ``(seconds, bytes)`` receiver samples, over the part
    of ``[0, until_s]`` after ``skip_fraction`` of it (the ramp-up is skipped)."""
    t0, t1, nbytes = tail_window(samples, skip_fraction=skip_fraction, until_s=until_s)
    span = t1 - t0
    return nbytes * 8 / span / 1e9 if span > 0 else 0.0


def mean_rate(schedule: list[dict], start: float, end: float, default: float) -> float:
    """Time-weighted mean of a link's configured rate (Gbit/s) over ``[start, end]`` on
    ``time.monotonic``'s clock. ``schedule`` is :meth:`Network.rate_schedule`'s list (each
    change's ``monotonic`` instant and the ``gbps`` it set); before its first change, and with
    no schedule (a link that does not fluctuate), the rate is ``default``."""
    if end <= start:
        rate = default
        for change in schedule:
            if change["monotonic"] <= start:
                rate = change["gbps"]
        return rate
    total = 0.0
    rate, t = default, start
    for change in schedule:
        at = change["monotonic"]
        if at <= start:
            rate = change["gbps"]
            continue
        if at >= end:
            break
        total += rate * (at - t)
        rate, t = change["gbps"], at
    total += rate * (end - t)
    return total / (end - start)


def tcp(
    net: Network,
    src: str,
    dst: str,
    *,
    streams: int = 4,
    seconds: float = 2.0,
    cc: str = "bbr",
    skip_fraction: float = 0.5,
    buffer_bytes: int = 0,
    abort: bool = False,
) -> dict:
    """Goodput of ``streams`` TCP streams ``src -> dst`` (see the module docstring); with
    ``buffer_bytes`` every socket's SO_SNDBUF and SO_RCVBUF are set to it, as the data plane
    sets its own (no autotuning), else autotuned up to the regions' ceiling. ``abort`` resets
    the streams after ``seconds`` instead of letting their buffers drain (on a slow path with
    large buffers that takes minutes; the goodput is measured before the first close either way).

    Returns ``gbps`` (the measured window), ``bytes`` (all received), ``cc`` (as the socket
    reports it), ``first_close_s``, the receiver's cumulative ``samples`` (seconds from the
    first byte, bytes) and ``first_monotonic`` (the first byte on ``time.monotonic``'s clock,
    which is the same in every process of the machine).

    ``streams`` TCP streams for ``seconds`` with congestion control ``cc`` set per socket,
    counted at the receiver. The rate is taken over the window from ``skip_fraction`` of the
    time to the first stream's end: the ramp-up is skipped, and once a stream ends the rest are
    no longer S streams (and the senders' socket buffers, up to 4 MiB a stream, keep draining
    after they stop writing).
    """
    with probe_server(net, dst, buffer_bytes=buffer_bytes) as (proc, ports):
        sent = client(
            net,
            src,
            [
                "tcp",
                net.address(dst),
                str(ports["tcp"]),
                "--streams",
                str(streams),
                "--seconds",
                str(seconds),
                "--cc",
                cc,
                "--buffer",
                str(buffer_bytes),
                *(["--abort"] if abort else []),
            ],
            timeout=seconds * 10 + 60,
        )
        got = json.loads(read_line(proc, f"the probe server in {dst}", 60))
    t0, t1, nbytes = tail_window(
        got["samples"], skip_fraction=skip_fraction, until_s=got["first_close_s"]
    )
    return {
        "gbps": nbytes * 8 / (t1 - t0) / 1e9 if t1 > t0 else 0.0,
        # the measured window on time.monotonic's clock (where a fluctuating link's rate is known)
        "window_monotonic": [got["first_monotonic"] + t0, got["first_monotonic"] + t1],
        "bytes": got["bytes"],
        "cc": sent["cc"],
        "streams": streams,
        "seconds": seconds,
        "first_close_s": got["first_close_s"],
        "first_monotonic": got["first_monotonic"],
        "samples": got["samples"],
    }


def blast(net: Network, src: str, dst: str, *, packets: int, pps: float, size: int = 200) -> dict:
    """Send ``packets`` UDP datagrams ``src -> dst``; ``{"sent", "received", "loss"}``.

    ``packets`` UDP datagrams at ``pps``, counted by sequence number at the receiver; keep ``pps
    x size`` under the link's rate, or queue drops add to the loss.
    """
    with probe_server(net, dst) as (proc, ports):
        client(
            net,
            src,
            [
                "blast",
                net.address(dst),
                str(ports["udp"]),
                "--packets",
                str(packets),
                "--pps",
                str(pps),
                "--size",
                str(size),
            ],
            timeout=packets / pps * 3 + 30,
        )
        got = json.loads(read_line(proc, f"the probe server in {dst}", 30))
    return {
        "sent": got["sent"],
        "received": got["received"],
        "loss": 1 - got["received"] / got["sent"],
    }


def probe_direction(
    net: Network,
    d: DirectionPlan,
    *,
    pings: int,
    seconds: float,
    streams: int,
    cc: str,
    gbps_now: float,
) -> dict:
    """The start-up probe of one direction (a row of ``emulation.json``'s ``probe``)."""
    rtt = ping(net, d.src, d.dst, count=pings, timeout_s=2.0 + 4 * d.rtt_ms / 1e3)
    got = tcp(net, d.src, d.dst, streams=streams, seconds=seconds, cc=cc)
    rtts = rtt["rtt_ms"]
    report: dict[str, Any] = {
        "a": d.src,
        "b": d.dst,
        "rtt_ms": d.rtt_ms,
        "gbps": gbps_now,
        "measured_rtt_ms": statistics.median(rtts) if rtts else None,
        "rtt_min_ms": min(rtts) if rtts else None,
        "rtt_max_ms": max(rtts) if rtts else None,
        "pings": pings,
        "pings_lost": rtt["lost"],
        "rtt_method": rtt["method"],
        "measured_gbps": got["gbps"],
        "window_monotonic": got["window_monotonic"],
        "tcp_streams": streams,
        "tcp_cc": got["cc"],
        "tcp_seconds": seconds,
        "tcp_bytes": got["bytes"],
    }
    return report


def payload_efficiency(
    net: Network, src: str, dst: str, *, streams: int = 1, seconds: float = 3.0
) -> dict:
    """Payload bytes per byte the link's htb class counts, ``src -> dst``, for a bulk TCP
    transfer (:func:`tcp`): the share of the configured rate left for data once every packet's
    headers are paid (Ethernet, IP, TCP with its options; e.g. a 1448-byte MSS in a 1514-byte
    frame is 0.956). Measured, not assumed: segmentation offloads, options and ACK-free data
    packets all show up in the kernel's own byte counter. Returns ``efficiency``, the payload
    and counted bytes, the counted bytes per packet of the leaf qdisc, and the goodput."""
    from emulation.counters import parse_qdisc_stats

    def leaf() -> tuple[int, int]:
        d = net.plan.direction(src, dst)
        dev = net.plan.region(dst).router_if
        out = subprocess.run(
            ["tc", "-s", "-n", net.router_namespace, "qdisc", "show", "dev", dev],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for q in parse_qdisc_stats(out).values():
            if q.get("kind") in ("bfifo", "pfifo"):
                return int(q.get("sent_bytes", 0)), int(q.get("sent_packets", 0))
        raise EmulationError(f"no leaf qdisc for {d.src}->{d.dst} on {dev}")

    before, (leaf_b0, leaf_p0) = net.class_bytes(src, dst), leaf()
    got = tcp(net, src, dst, streams=streams, seconds=seconds)
    counted, (leaf_b1, leaf_p1) = net.class_bytes(src, dst) - before, leaf()
    packets = leaf_p1 - leaf_p0
    return {
        "efficiency": got["bytes"] / counted if counted else math.nan,
        "payload_bytes": got["bytes"],
        "counted_bytes": counted,
        "packets": packets,
        "bytes_per_packet": (leaf_b1 - leaf_b0) / packets if packets else math.nan,
        "goodput_gbps": got["gbps"],
        "streams": streams,
        "seconds": seconds,
    }
