"""What this machine can emulate: namespaces at all, and which shaping facilities the kernel has.

Theory of operation
-------------------
:func:`check_available` says in one line why namespaces cannot be made here (not Linux, not
root, no ``ip``/``tc``, creation refused): tests and commands skip or stop on it.
:func:`probe_capabilities` tries each facility a plan may use (htb with bfifo and a u32 filter,
netem, the iptables NFQUEUE target and ``statistic`` match) in a scratch namespace, once per
process, and records why each missing one failed; :func:`emulation.plan.make_plan` then picks
the mechanisms from what is there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid

from emulation.commands import in_ns, run
from emulation.plan import Capabilities, EmulationUnavailable


def check_available() -> None:
    """Raise :class:`EmulationUnavailable` saying why namespaces cannot be made here."""
    if sys.platform != "linux":
        raise EmulationUnavailable("network namespaces are Linux only")
    if os.geteuid() != 0:
        raise EmulationUnavailable("network namespaces need root: run the command as root (sudo)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise EmulationUnavailable(f"the `{tool}` command (apt iproute2) is not installed")
    probe = f"aurem-{uuid.uuid4().hex[:6]}-chk"
    proc = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if proc.returncode != 0:
        raise EmulationUnavailable(f"cannot create a network namespace: {proc.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)


_CAPS: Capabilities | None = None


def probe_capabilities(*, refresh: bool = False) -> Capabilities:
    """Find out what this kernel offers by trying it in a scratch namespace (cached)."""
    global _CAPS
    if _CAPS is not None and not refresh:
        return _CAPS
    check_available()
    ns = f"aurem-{uuid.uuid4().hex[:6]}-caps"
    missing: list[str] = []
    run(["ip", "netns", "add", ns])
    try:
        run(["ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])

        def tc(*args: str) -> str | None:
            proc = subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True)
            return None if proc.returncode == 0 else (proc.stderr.strip() or "failed")

        err = (
            tc("qdisc", "add", "dev", "p0", "root", "handle", "1:", "htb", "default", "0")
            or tc(
                "class",
                "add",
                "dev",
                "p0",
                "parent",
                "1:",
                "classid",
                "1:11",
                "htb",
                "rate",
                "10mbit",
            )
            or tc(
                "qdisc",
                "add",
                "dev",
                "p0",
                "parent",
                "1:11",
                "handle",
                "11:",
                "bfifo",
                "limit",
                "30000",
            )
            or tc(
                "filter",
                "add",
                "dev",
                "p0",
                "parent",
                "1:",
                "protocol",
                "ip",
                "prio",
                "1",
                "u32",
                "match",
                "ip",
                "src",
                "10.0.0.0/8",
                "flowid",
                "1:11",
            )
        )
        htb = err is None
        if not htb:
            missing.append(f"htb: `tc` htb/bfifo/u32 failed: {err}")
        err = tc("qdisc", "add", "dev", "p1", "root", "netem", "delay", "1ms")
        netem = err is None
        if not netem:
            missing.append(f"netem: the kernel has no netem qdisc ({err})")
        iptables = shutil.which("iptables")
        nfqueue = statistic = False
        if iptables is None:
            missing.append("nfqueue: the iptables command is not installed (apt iptables)")
            missing.append("statistic: the iptables command is not installed (apt iptables)")
        else:
            for name, rule in (
                ("nfqueue", ["-j", "NFQUEUE", "--queue-num", "7"]),
                (
                    "statistic",
                    ["-m", "statistic", "--mode", "random", "--probability", "0.5", "-j", "DROP"],
                ),
            ):
                proc = subprocess.run(
                    in_ns(ns, [iptables, "-w", "5", "-A", "FORWARD", *rule]),
                    capture_output=True,
                    text=True,
                )
                if proc.returncode == 0:
                    if name == "nfqueue":
                        nfqueue = True
                    else:
                        statistic = True
                else:
                    missing.append(
                        f"{name}: `iptables ... {' '.join(rule)}` failed: {proc.stderr.strip()}"
                    )
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    _CAPS = Capabilities(
        htb=htb, netem=netem, nfqueue=nfqueue, statistic=statistic, missing=tuple(missing)
    )
    return _CAPS


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (False where namespaces cannot be made)."""
    try:
        return probe_capabilities().netem
    except EmulationUnavailable:
        return False
