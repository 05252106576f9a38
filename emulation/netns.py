"""Two hosts and a router in Linux network namespaces, with an htb rate limit on the router.

Theory of operation
-------------------
``sender`` -- veth -- ``router`` -- veth -- ``receiver``. The router forwards IPv4 and shapes
its egress towards the receiver with htb (rate) and a pfifo queue (buffer), so the bottleneck
sits on a router and TCP sees real drops and queueing, not the local backpressure it would feel
if the sender's own interface were shaped (``../shared/notes/wan-emulation-on-this-kernel.md``).

This kernel has htb/tbf/pfifo but no netem, so no propagation delay is added here: the path's
RTT is the veth's ~0.1 ms. :func:`netem_available` detects netem instead of assuming it; a
caller that needs delay must check it and fail loudly. Everything is done with the ``ip`` and
``tc`` commands of iproute2 (no Python netlink dependency), as root; without the rights,
:class:`EmulationUnavailable` says why, and tests skip with that reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Sequence
from dataclasses import dataclass


class EmulationUnavailable(RuntimeError):
    """Namespaces or qdiscs cannot be made here (not root, no iproute2, no kernel support)."""


def _run(argv: Sequence[str]) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if proc.returncode != 0:
        raise EmulationUnavailable(f"`{' '.join(argv)}` failed: {proc.stderr.strip()}")
    return proc.stdout


def check_available() -> None:
    """Raise :class:`EmulationUnavailable` with the reason when namespaces cannot be made."""
    if os.geteuid() != 0:
        raise EmulationUnavailable("network namespaces need root (this process is not root)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise EmulationUnavailable(f"the `{tool}` command (iproute2) is not installed")
    probe = f"aurprobe{uuid.uuid4().hex[:6]}"
    _run(["ip", "netns", "add", probe])
    _run(["ip", "netns", "del", probe])


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (delay, loss); probed on a dummy interface."""
    ns = f"aurnetem{uuid.uuid4().hex[:6]}"
    try:
        _run(["ip", "netns", "add", ns])
    except EmulationUnavailable:
        return False
    try:
        _run(["ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
        proc = subprocess.run(
            ["tc", "-n", ns, "qdisc", "add", "dev", "p0", "root", "netem", "delay", "1ms"],
            capture_output=True,
        )
        return proc.returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@dataclass
class EmulatedLink:
    """A shaped path from ``sender`` to ``receiver``; use as a context manager."""

    rate_mbit: float
    """Bottleneck rate on the router (Mbit/s)."""
    queue_packets: int = 1000
    """pfifo limit at the bottleneck (packets)."""
    prefix: str = ""

    def __post_init__(self) -> None:
        if not self.rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0, got {self.rate_mbit}")
        self.prefix = self.prefix or f"aur{uuid.uuid4().hex[:5]}"
        p = self.prefix
        self.sender, self.router, self.receiver = f"{p}-s", f"{p}-r", f"{p}-c"
        self.sender_ip, self.receiver_ip = "10.77.1.1", "10.77.2.1"

    def __enter__(self) -> EmulatedLink:
        check_available()
        p = self.prefix
        try:
            for ns in (self.sender, self.router, self.receiver):
                _run(["ip", "netns", "add", ns])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            for a, b, ns, ip_host, ip_router in (
                (f"{p}s0", f"{p}rs", self.sender, self.sender_ip, "10.77.1.2"),
                (f"{p}c0", f"{p}rc", self.receiver, self.receiver_ip, "10.77.2.2"),
            ):
                _run(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
                _run(["ip", "link", "set", a, "netns", ns])
                _run(["ip", "link", "set", b, "netns", self.router])
                _run(["ip", "-n", ns, "addr", "add", f"{ip_host}/24", "dev", a])
                _run(["ip", "-n", self.router, "addr", "add", f"{ip_router}/24", "dev", b])
                _run(["ip", "-n", ns, "link", "set", a, "up"])
                _run(["ip", "-n", self.router, "link", "set", b, "up"])
                _run(["ip", "-n", ns, "route", "add", "default", "via", ip_router])
            _run(["ip", "netns", "exec", self.router, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
            dev = f"{p}rc"  # router egress towards the receiver: the bottleneck
            # htb root with one class at the link rate; a pfifo of queue_packets under it, so
            # TCP sees drops when it overruns the bottleneck.
            tc = ["tc", "-n", self.router]
            _run([*tc, *f"qdisc add dev {dev} root handle 1: htb default 10".split()])
            rate = f"rate {self.rate_mbit}mbit"
            _run([*tc, *f"class add dev {dev} parent 1: classid 1:10 htb {rate}".split()])
            limit = f"limit {self.queue_packets}"
            _run([*tc, *f"qdisc add dev {dev} parent 1:10 handle 10: pfifo {limit}".split()])
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in (self.sender, self.router, self.receiver):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def bottleneck_bytes(self) -> int:
        """Bytes sent so far through the router's rate-limited class (the emulated WAN)."""
        out = _run(["tc", "-s", "-n", self.router, "class", "show", "dev", f"{self.prefix}rc"])
        for line in out.splitlines():
            line = line.strip()
            if line.startswith("Sent "):
                return int(line.split()[1])
        raise EmulationUnavailable(f"no byte counter in `tc -s class show`: {out!r}")

    def popen(self, ns: str, argv: Sequence[str], **kw: object) -> subprocess.Popen:
        """Start ``argv`` inside namespace ``ns``."""
        return subprocess.Popen(["ip", "netns", "exec", ns, *argv], **kw)  # type: ignore[call-overload]
