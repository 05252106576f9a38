"""What the kernel reports about a built network: queue and TCP counters, htb classes, settings.

Theory of operation
-------------------
Everything here reads; nothing changes the network. Per direction, every qdisc on the router's
interface towards its destination (``tc -s qdisc show``: bytes and packets sent, drops,
overlimits, backlog) and its htb class (the rate in force, the bytes it sent); per region, its
namespace's TCP counters (``/proc/net/snmp`` and ``/proc/net/netstat``, :data:`TCP_COUNTERS`),
which count every connection of the roles running there, and its TCP settings. A run's share of
the counters is the :func:`difference` between a reading after the build and one at close.
"""

from __future__ import annotations

import contextlib
import re
import time
from typing import Any

from emulation.commands import in_ns, run
from emulation.plan import EmulationError, NetworkPlan


def read_counters(plan: NetworkPlan) -> dict:
    """What the kernel counts for ``plan``'s network now: per direction, every qdisc on the
    router's interface towards it (:func:`parse_qdisc_stats`: bytes and packets sent, drops,
    overlimits, backlog); per region, its namespace's TCP counters (:data:`TCP_COUNTERS`:
    retransmitted segments, retransmission timeouts, tail-loss probes...), which count every
    connection of the roles running there."""
    qdiscs = {}
    for d in plan.directions:
        dev = plan.region(d.dst).router_if
        out = run(["tc", "-s", "-n", plan.router_namespace, "qdisc", "show", "dev", dev])
        qdiscs[f"{d.src}->{d.dst}"] = parse_qdisc_stats(out)
    tcp = {}
    for r in plan.regions:
        text = run(in_ns(r.namespace, ["cat", "/proc/net/snmp", "/proc/net/netstat"]))
        tcp[r.name] = parse_tcp_counters(text)
    return {"unix": time.time(), "qdiscs": qdiscs, "tcp": tcp}


def htb_class(plan: NetworkPlan, src: str, dst: str, *, stats: bool = False) -> tuple[str, str]:
    """(router device, ``tc class show`` output) of the htb class of ``src -> dst``."""
    d = plan.direction(src, dst)
    dev = plan.region(dst).router_if
    cmd = ["tc", *(["-s"] if stats else []), "-n", plan.router_namespace, "class", "show"]
    return dev, run([*cmd, "dev", dev, "classid", f"1:{d.classid:x}"])


def class_rate_gbps(plan: NetworkPlan, src: str, dst: str) -> float:
    """The rate the kernel's htb class of ``src -> dst`` has now (Gbit/s)."""
    dev, out = htb_class(plan, src, dst)
    # iproute2 6.1 has no JSON for htb classes; it prints e.g. "rate 23456Kbit" (SI units,
    # divided only while exact or above 10^6 of a unit: within 0.1%).
    m = re.search(r"\brate (\d+(?:\.\d+)?)([KMGT]?)bit", out)
    if m is None:
        raise EmulationError(f"no htb class for {src}->{dst} on {dev}: {out!r}")
    unit = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}[m.group(2)]
    return float(m.group(1)) * unit / 1e9


def class_bytes(plan: NetworkPlan, src: str, dst: str) -> int:
    """Bytes sent so far by the htb class of direction ``src -> dst``."""
    _, out = htb_class(plan, src, dst, stats=True)
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("Sent "):
            return int(line.split()[1])
    raise EmulationError(f"no byte counter for {src}->{dst} in `tc -s class show`: {out!r}")


def tcp_settings(namespace: str) -> dict[str, str]:
    """The congestion control and TCP buffer sysctls of ``namespace`` (those it can read)."""
    out: dict[str, str] = {}
    for key in ("tcp_congestion_control", "tcp_rmem", "tcp_wmem"):
        with contextlib.suppress(EmulationError):
            out[key] = run(in_ns(namespace, ["sysctl", "-n", f"net.ipv4.{key}"])).strip()
    return out


TCP_COUNTERS = (
    ("Tcp", "OutSegs"),
    ("Tcp", "RetransSegs"),
    ("TcpExt", "TCPTimeouts"),
    ("TcpExt", "TCPLossProbes"),
    ("TcpExt", "TCPSpuriousRTOs"),
    ("TcpExt", "TCPLostRetransmit"),
    ("TcpExt", "TCPFastRetrans"),
    ("TcpExt", "TCPSlowStartRetrans"),
    ("TcpExt", "TCPSynRetrans"),
)
"""The TCP counters ``emulation.json`` keeps per region (``/proc/net/snmp`` and
``/proc/net/netstat`` of the namespace): segments sent and retransmitted, retransmission
timeouts (an RTO of >= 200 ms each), tail-loss probes, spurious RTOs, fast and slow-start
retransmissions."""


def parse_tcp_counters(text: str) -> dict[str, int]:
    """:data:`TCP_COUNTERS` from the text of ``/proc/net/snmp`` and ``/proc/net/netstat``
    (pairs of lines: ``Prefix: name name ...`` then ``Prefix: value value ...``)."""
    values: dict[tuple[str, str], int] = {}
    lines = [line.split() for line in text.splitlines() if line.strip()]
    for names, nums in zip(lines, lines[1:], strict=False):
        if names[0] != nums[0] or not names[0].endswith(":") or not nums[1:2]:
            continue
        if not nums[1].lstrip("-").isdigit():
            continue  # a header line followed by another header
        prefix = names[0][:-1]
        for name, num in zip(names[1:], nums[1:], strict=False):
            with contextlib.suppress(ValueError):
                values[(prefix, name)] = int(num)
    return {
        name: values[(prefix, name)] for prefix, name in TCP_COUNTERS if (prefix, name) in values
    }


_QDISC = re.compile(r"^qdisc (\S+) (\S+)")
_SENT = re.compile(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+) requeues (\d+)\)")
_BACKLOG = re.compile(r"backlog (\d+)b (\d+)p")


def parse_qdisc_stats(text: str) -> dict[str, dict[str, int | str]]:
    """Per qdisc (by handle) of ``tc -s qdisc show`` output: its kind, bytes and packets sent,
    packets dropped, overlimits, requeues and the backlog (bytes, packets) when read."""
    out: dict[str, dict[str, int | str]] = {}
    current: dict[str, int | str] | None = None
    for line in text.splitlines():
        head = _QDISC.match(line.strip())
        if head:
            current = out[head.group(2)] = {"kind": head.group(1)}
            continue
        if current is None:
            continue
        sent = _SENT.search(line)
        if sent:
            keys = ("sent_bytes", "sent_packets", "dropped", "overlimits", "requeues")
            current.update(zip(keys, map(int, sent.groups()), strict=True))
        backlog = _BACKLOG.search(line)
        if backlog:
            current["backlog_bytes"], current["backlog_packets"] = map(int, backlog.groups())
    return out


def difference(last: Any, first: Any) -> Any:
    """``last - first`` for every number in two nested dicts of the same shape (``unix``: the
    span between them)."""
    if isinstance(last, dict) and isinstance(first, dict):
        # A backlog is a level, not a count: the one at close.
        return {
            k: v if k.startswith("backlog") else difference(v, first.get(k))
            for k, v in last.items()
        }
    if isinstance(last, int | float) and isinstance(first, int | float):
        return last - first
    return last
