"""The steps that make a plan's network in the kernel, each one batch of commands.

Theory of operation
-------------------
:meth:`emulation.network.Network` calls these in order, recording every process it starts so
that ``close()`` stops it even when a later step fails: the reaper (:mod:`emulation.cleanup`,
started before anything exists); the namespaces, with veths created straight inside them, or
Mininet's hosts given our names (``ip netns attach``); addresses, routes, loopback, forwarding,
``prohibit`` rules between regions with no link, segmentation and TCP window settings; the
router's htb classes, queues and filters; one NFQUEUE delay line per delayed direction, each
answering "ready" before any packet is queued to it; then the iptables rules that feed the delay
lines and drop at each region's ingress. Why iproute2 and iptables rather than a library:
docs/EMULATION.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from emulation import measure
from emulation.commands import batch, in_ns, run
from emulation.plan import (
    SUBNET,
    DirectionPlan,
    EmulationError,
    EmulationUnavailable,
    NetworkPlan,
    iptables_loss_rules,
    iptables_router_rules,
    tc_commands,
)

HERE = Path(__file__).resolve().parent
DELAYLINE = str(HERE / "delayline.py")
CLEANUP = str(HERE / "cleanup.py")
MININET = str(HERE / "mininet_backend.py")
SYSTEM_PYTHON = "/usr/bin/python3"
"""Mininet's Python (the apt package installs it for the system interpreter only)."""


def start_reaper(tag: str) -> subprocess.Popen:
    """The process that removes network ``tag`` when its builder dies (its stdin closes)."""
    return subprocess.Popen(
        [sys.executable, CLEANUP, "--reap", tag],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def make_namespaces(plan: NetworkPlan) -> None:
    """The router's and every region's namespace, joined by veths, addressed and routed."""
    router = plan.router_namespace
    lines = [f"netns add {router}"]
    lines += [f"netns add {r.namespace}" for r in plan.regions]
    batch("ip", None, lines)
    # Both ends created straight inside their namespaces: nothing appears in the host's.
    batch(
        "ip",
        None,
        [
            f"link add {r.host_if} netns {r.namespace} type veth peer name {r.router_if} "
            f"netns {router}"
            for r in plan.regions
        ],
    )
    for r in plan.regions:
        batch(
            "ip",
            r.namespace,
            [
                f"addr add {r.address}/24 dev {r.host_if}",
                f"link set {r.host_if} up",
                f"route add default via {r.router_address}",
            ],
        )
    batch(
        "ip",
        router,
        [f"addr add {r.router_address}/24 dev {r.router_if}" for r in plan.regions]
        + [f"link set {r.router_if} up" for r in plan.regions],
    )


def start_mininet(plan: NetworkPlan) -> tuple[subprocess.Popen, dict[str, Any]]:
    """Start Mininet's builder of the router, hosts and links (``emulation/mininet_backend.py``
    under the system Python); return it and the spec it was given."""
    if not Path(SYSTEM_PYTHON).exists():
        raise EmulationUnavailable(f"the Mininet backend needs {SYSTEM_PYTHON}")
    check = subprocess.run([SYSTEM_PYTHON, "-c", "import mininet.net"], capture_output=True)
    if check.returncode != 0:
        raise EmulationUnavailable(
            f"Mininet is not installed for {SYSTEM_PYTHON} (apt-get install mininet)"
        )
    spec = {
        "tag": plan.tag,
        "router": {"name": f"{plan.tag}rt"},
        "hosts": [
            {
                "name": f"{plan.tag}h{r.index}",
                "intf": r.host_if,
                "router_intf": r.router_if,
                "ip": r.address,
                "router_ip": r.router_address,
            }
            for r in plan.regions
        ],
    }
    proc = subprocess.Popen(
        [SYSTEM_PYTHON, MININET, json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, spec


def attach_mininet(plan: NetworkPlan, proc: subprocess.Popen, spec: dict[str, Any]) -> None:
    """Once Mininet has built its nodes, give their namespaces the plan's names."""
    line = measure.read_line(proc, "Mininet (emulation/mininet_backend.py)", 60)
    while not line.startswith("AUREM "):
        line = measure.read_line(proc, "Mininet (emulation/mininet_backend.py)", 60)
    pids = json.loads(line[len("AUREM ") :])["pids"]
    lines = [f"netns attach {plan.router_namespace} {pids[spec['router']['name']]}"]
    for r, h in zip(plan.regions, spec["hosts"], strict=True):
        lines.append(f"netns attach {r.namespace} {pids[h['name']]}")
    batch("ip", None, lines)


def configure_namespaces(plan: NetworkPlan, tcp_window_bytes: int | None) -> None:
    """Loopback, segmentation, unlinked pairs refused, forwarding, TCP window ceilings."""
    mtu = plan.segmentation == "mtu"
    for r in plan.regions:
        lines = ["link set lo up"]
        if mtu:  # senders send MTU-sized packets (the delay line sees one per packet)
            lines.append(f"link set {r.host_if} gso_max_segs 1")
        batch("ip", r.namespace, lines)
    lines = ["link set lo up"]
    # In gso mode the router segments what it sends toward a region with a lossy link,
    # after the bottleneck queue, so the loss at the region's ingress is per MTU packet.
    lines += [
        f"link set {r.router_if} gso_max_segs 1"
        for r in plan.regions
        if plan.segments_toward(r.name)
    ]
    for a, b in plan.unlinked:
        lines.append(f"rule add from {subnet(plan, a)} to {subnet(plan, b)} prohibit pref 1000")
    batch("ip", plan.router_namespace, lines)
    run(in_ns(plan.router_namespace, ["sysctl", "-qw", "net.ipv4.ip_forward=1"]))
    if tcp_window_bytes is not None:
        # Autotuning's ceiling, per namespace: a stream's window, as the simulator's
        # tcp_window_bytes models it (the host's own may differ: 16 MiB here).
        w = tcp_window_bytes
        for r in plan.regions:
            run(
                in_ns(
                    r.namespace,
                    [
                        "sysctl",
                        "-qw",
                        f"net.ipv4.tcp_wmem=4096 16384 {w}",
                        f"net.ipv4.tcp_rmem=4096 131072 {w}",
                    ],
                )
            )


def shape_links(plan: NetworkPlan) -> None:
    """Per direction on the router: an htb class, its queue (or netem) and a u32 filter."""
    batch("tc", plan.router_namespace, tc_commands(plan))


def start_delay_line(plan: NetworkPlan, d: DirectionPlan, quantum_us: float) -> subprocess.Popen:
    """The NFQUEUE delay line of direction ``d``, in the router's namespace (wait for it with
    :func:`await_ready`)."""
    assert d.nfqueue is not None
    return subprocess.Popen(
        in_ns(
            plan.router_namespace,
            [
                sys.executable,
                DELAYLINE,
                "--queue",
                f"{d.nfqueue}:{d.delay_ms}",
                "--maxlen",
                str(d.nfqueue_maxlen),
                "--quantum-us",
                str(quantum_us),
                "--rt-priority",
                os.environ.get("AURORA_DELAYLINE_RT", "10"),
            ],
        ),
        stdin=subprocess.PIPE,  # end of file (the builder died) stops it
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def await_ready(proc: subprocess.Popen, d: DirectionPlan) -> None:
    """Return once the delay line of ``d`` listens on its queue; raise if it does not."""
    line = measure.read_line(proc, f"the delay line of {d.src}->{d.dst} (NFQUEUE {d.nfqueue})")
    if line != "ready":
        raise EmulationError(f"delay line {d.src}->{d.dst}: unexpected {line!r}")


def install_iptables(plan: NetworkPlan) -> None:
    """The rules that queue packets to the delay lines (router) and drop at each region's
    ingress (the regions), where the plan needs them."""
    rules = iptables_router_rules(plan)
    if rules:
        iptables_restore(plan.router_namespace, rules)
    for r in plan.regions:
        rules = iptables_loss_rules(plan, r.name)
        if rules:
            iptables_restore(r.namespace, rules)


def iptables_restore(namespace: str, rules: str) -> None:
    run(in_ns(namespace, ["iptables-restore", "-w", "5", "--noflush"]), stdin=rules)


def subnet(plan: NetworkPlan, region: str) -> str:
    """The /24 of ``region``."""
    return SUBNET.format(plan.region(region).index)
