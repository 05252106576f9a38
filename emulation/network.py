"""Build a topology's WAN as Linux network namespaces: one per region, joined through a router.

Theory of operation
-------------------
:func:`build_network` probes what the kernel can do (:func:`probe_capabilities`, in a scratch
namespace), computes a plan (:mod:`emulation.plan`: addresses, htb classes, queues, which
mechanism delays and drops), and carries it out:

1. registry file and reaper (:mod:`emulation.cleanup`), before anything exists;
2. namespaces, veths created directly inside them (never in the host's namespace), addresses,
   routes, loopback up, IP forwarding on the router, ``ip rule ... prohibit`` between regions
   with no link; segmentation settings (``gso_max_segs``) per the plan. With
   ``backend="mininet"`` Mininet's Python API builds the hosts, router, links and addresses
   instead (:mod:`emulation.mininet_backend`) and its namespaces are given our names with
   ``ip netns attach``; everything after this step is the same for both backends;
3. ``tc -batch`` on the router: per direction an htb class, a bfifo (or netem) leaf, a u32
   filter on the source subnet;
4. the NFQUEUE delay lines (one process per direction, in the router namespace, started and
   answering "ready" before any packet is queued to them), then the iptables rules that feed
   them and the loss rules at each region's ingress;
5. the fluctuation controller (one thread per fluctuating link, changing both directions' htb
   classes at ``t0 + k x period_s``);
6. a probe of every direction (:meth:`Network.probe`): median idle RTT (``ping``) and TCP
   goodput of 4 bbr streams at the receiver; with ``verify=True`` (default) a direction that
   misses its configured RTT or rate by more than the tolerance fails the build, naming the
   link, the numbers and the likely cause, rather than letting a run claim a shape it did not
   get.

Commands are iproute2's ``ip``/``tc`` (``-batch`` per namespace, so a build is a few dozen
processes) and ``iptables-restore``. Why not pyroute2: every step here is one batch of the
commands a person would type to inspect or reproduce the setup (``docs/EMULATION.md`` lists
them), ``ip netns exec`` is needed anyway to run roles in a namespace, pyroute2 has no bfifo
plugin (it forces the parent to root and fails with EEXIST) and no NFQUEUE verdicts, and it would
be one more dependency in CI for no capability iproute2 lacks.

The runtime's API: ``namespace``, ``address``, ``wrap``/``popen``, ``cut``/``restore``,
``probe``, ``describe`` (the content of ``emulation.json``), ``close``.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from emulation import cleanup, measure
from emulation.plan import (
    SUBNET,
    Capabilities,
    DirectionPlan,
    EmulationError,
    EmulationUnavailable,
    NetworkPlan,
    PlanLink,
    htb_rate,
    iptables_loss_rules,
    iptables_router_rules,
    links_of,
    make_plan,
    rate_draws,
    tc_commands,
)

HERE = Path(__file__).resolve().parent
DELAYLINE = str(HERE / "delayline.py")
PROBE = measure.PROBE
CLEANUP = str(HERE / "cleanup.py")
MININET = str(HERE / "mininet_backend.py")
SYSTEM_PYTHON = "/usr/bin/python3"
"""Mininet's Python (the apt package installs it for the system interpreter only)."""
VERIFY_TRIES = 3
"""Goodput probes a direction gets at build time before its rate counts as out of reach."""


def _run(argv: Sequence[str], *, stdin: str | None = None, check: bool = True) -> str:
    proc = subprocess.run(list(argv), input=stdin, capture_output=True, text=True)
    if check and proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise EmulationError(f"`{' '.join(argv)}` failed: {' / '.join(msg[-3:])}")
    return proc.stdout


def _batch(tool: str, namespace: str | None, lines: list[str]) -> None:
    if not lines:
        return
    argv = [tool] + (["-n", namespace] if namespace else []) + ["-batch", "-"]
    _run(argv, stdin="\n".join(lines) + "\n")


def _in_ns(namespace: str, argv: Sequence[str]) -> list[str]:
    return ["ip", "netns", "exec", namespace, *argv]


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
    _run(["ip", "netns", "add", ns])
    try:
        _run(["ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])

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
                    _in_ns(ns, [iptables, "-w", "5", "-A", "FORWARD", *rule]),
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


class Network:
    """An emulated WAN; build it with :func:`build_network` (a context manager)."""

    def __init__(
        self,
        plan: NetworkPlan,
        *,
        backend: str,
        caps: Capabilities,
        links: Sequence[PlanLink],
        seed: int,
    ) -> None:
        self.plan = plan
        self.tag = plan.tag
        self.backend = backend
        self.scale = plan.scale
        self.caps = caps
        self.seed = seed
        self.tcp_window_bytes: int | None = None
        """Ceiling of TCP buffer autotuning in the regions (None: the host's)."""
        self.delay_quantum_us = 500.0
        """Shortest time between two releases of a delay line while it holds packets (us)."""
        self._links = {link.index: link for link in links}
        self._reaper: subprocess.Popen | None = None
        self._mininet: subprocess.Popen | None = None
        self._delaylines: dict[int, subprocess.Popen] = {}
        self._delayline_stats: dict[int, dict] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._cut: set[frozenset[str]] = set()
        self._probe: dict[tuple[str, str], dict] = {}
        self._schedule: dict[int, list[dict]] = {}
        self._current_gbps: dict[int, float] = {}
        self._errors: list[str] = []
        self._counters: dict[str, dict] = {}
        self._tcp_cache: dict[str, str] = {}
        self.started = time.time()
        self.closed = False

    # -- the runtime's API -------------------------------------------------------------------

    def namespace(self, region: str) -> str:
        """Network namespace of ``region`` (every role of the region runs in it)."""
        return self.plan.region(region).namespace

    def address(self, region: str) -> str:
        """IPv4 address at which other regions reach ``region``."""
        return self.plan.region(region).address

    @property
    def router_namespace(self) -> str:
        return self.plan.router_namespace

    @property
    def regions(self) -> list[str]:
        return [r.name for r in self.plan.regions]

    def wrap(self, region: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``region``'s namespace (``ip netns exec NS argv...``)."""
        return _in_ns(self.namespace(region), argv)

    def popen(self, region: str, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``region``'s namespace."""
        return subprocess.Popen(self.wrap(region, argv), **kw)

    def cut(self, a: str, b: str) -> None:
        """Drop every packet between ``a`` and ``b``, both ways (a ``blackhole`` ip rule on
        the router: the packets vanish without an ICMP error, as on a severed path). Packets
        already inside the link (in the delay line or the queue) still arrive."""
        key = self._link_key(a, b)
        with self._lock:
            if key in self._cut:
                raise EmulationError(f"link {a}-{b} is already cut")
            _batch("ip", self.router_namespace, self._cut_rules("add", a, b))
            self._cut.add(key)

    def restore(self, a: str, b: str) -> None:
        """Undo :meth:`cut`."""
        key = self._link_key(a, b)
        with self._lock:
            if key not in self._cut:
                raise EmulationError(f"link {a}-{b} is not cut")
            _batch("ip", self.router_namespace, self._cut_rules("del", a, b))
            self._cut.discard(key)

    def is_cut(self, a: str, b: str) -> bool:
        return self._link_key(a, b) in self._cut

    def probe(
        self,
        *,
        pings: int = 10,
        seconds: float | None = None,
        streams: int = 4,
        cc: str = "bbr",
    ) -> list[dict]:
        """Measure every direction: median idle RTT (:meth:`ping`) and TCP goodput of ``streams``
        streams with congestion control ``cc``, measured at the receiver over the second half
        of the transfer (after the ramp-up). ``seconds`` defaults to max(3, 25 RTTs), at most
        6 s. Also stored for :meth:`describe`. Each report's ``gbps`` is the configured rate
        the goodput is held to: on a fluctuating link, the time-weighted mean of the rates in
        force over the measured window (``gbps_at_start`` is the rate when probing began)."""
        reports = []
        for d in self.plan.directions:
            if self.is_cut(d.src, d.dst):
                continue
            report = self._probe_direction(d, pings=pings, seconds=seconds, streams=streams, cc=cc)
            self._probe[(d.src, d.dst)] = report
            reports.append(report)
        return reports

    def _probe_direction(
        self, d: DirectionPlan, *, pings: int, seconds: float | None, streams: int, cc: str
    ) -> dict:
        secs = seconds if seconds is not None else min(max(3.0, 25 * d.rtt_ms / 1e3), 6.0)
        report = measure.probe_direction(
            self,
            d,
            pings=pings,
            seconds=secs,
            streams=streams,
            cc=cc,
            gbps_now=self._current_gbps.get(d.link, d.gbps),
        )
        # A fluctuating link may change rate while it is measured: the goodput is held to
        # the time-weighted configured rate over the measured window, not the rate at start.
        start, end = report.pop("window_monotonic")
        report["gbps_at_start"] = report["gbps"]
        with self._lock:
            schedule = list(self._schedule.get(d.link, []))
        report["gbps"] = measure.mean_rate(schedule, start, end, report["gbps_at_start"])
        return report

    def ping(
        self,
        src: str,
        dst: str,
        *,
        count: int = 10,
        interval_s: float = 0.01,
        timeout_s: float = 2.0,
    ) -> dict:
        """RTTs from ``src`` to ``dst``: ``{"rtt_ms": [...], "lost", "method"}``
        (:func:`emulation.measure.ping`: ICMP where ``ping`` is installed, else UDP echo)."""
        return measure.ping(self, src, dst, count=count, interval_s=interval_s, timeout_s=timeout_s)

    def tcp(
        self,
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
        """Goodput of ``streams`` TCP streams ``src -> dst`` (:func:`emulation.measure.tcp`)."""
        return measure.tcp(
            self,
            src,
            dst,
            streams=streams,
            seconds=seconds,
            cc=cc,
            skip_fraction=skip_fraction,
            buffer_bytes=buffer_bytes,
            abort=abort,
        )

    def blast(self, src: str, dst: str, *, packets: int, pps: float, size: int = 200) -> dict:
        """UDP loss ``src -> dst`` over ``packets`` datagrams (:func:`emulation.measure.blast`)."""
        return measure.blast(self, src, dst, packets=packets, pps=pps, size=size)

    def describe(self) -> dict:
        """Everything about this network as data (written as ``emulation.json``)."""
        links = []
        for d in self.plan.directions:
            measured = self._probe.get((d.src, d.dst), {})
            mech = d.mechanisms
            links.append(
                {
                    "a": d.src,
                    "b": d.dst,
                    "gbps": d.gbps,
                    "rtt_ms": d.rtt_ms,
                    "loss": d.loss,
                    "fluctuation": None
                    if d.fluctuation is None
                    else {
                        "low_gbps": d.fluctuation[0],
                        "high_gbps": d.fluctuation[1],
                        "period_s": d.fluctuation[2],
                    },
                    "scale": self.scale,
                    "backend": self.backend,
                    "mechanism": "+".join(
                        dict.fromkeys(
                            v for v in (mech["rate"], mech["delay"], mech["loss"]) if v != "none"
                        )
                    ),
                    "mechanisms": mech,
                    "one_way_delay_ms": d.delay_ms,
                    "queue_bytes": d.queue_bytes,
                    "queue_delay_ms": round(d.queue_delay_ms, 3),
                    "nfqueue": d.nfqueue,
                    "measured_rtt_ms": measured.get("measured_rtt_ms"),
                    "measured_gbps": measured.get("measured_gbps"),
                    "probe": measured or None,
                    "cut": self.is_cut(d.src, d.dst),
                }
            )
        return {
            "tag": self.tag,
            "backend": self.backend,
            "scale": self.scale,
            "seed": self.seed,
            "segmentation": self.plan.segmentation,
            "queue_bdp": self.plan.queue_bdp,
            "kernel": platform.release(),
            "capabilities": {
                "htb": self.caps.htb,
                "netem": self.caps.netem,
                "nfqueue": self.caps.nfqueue,
                "statistic": self.caps.statistic,
                "missing": list(self.caps.missing),
            },
            "router": self.router_namespace,
            "regions": {
                r.name: {"namespace": r.namespace, "address": r.address} for r in self.plan.regions
            },
            "unlinked": [list(p) for p in self.plan.unlinked],
            "tcp": self._tcp_settings(),
            "links": links,
            "rate_schedule": {
                f"{link.a}-{link.b}": self.rate_schedule(link.a, link.b)
                for i, link in self._links.items()
                if i in self._schedule
            },
            "delay_lines": {str(q): s for q, s in self._delayline_stats.items()},
            "counters": self._counters_report(),
            "errors": self.errors(),
            "started_unix": self.started,
        }

    def errors(self) -> list[str]:
        """What has gone wrong since the build (empty when the network is as described): a
        delay line that exited (its direction now drops everything) or a fluctuation controller
        that stopped."""
        with self._lock:
            out = list(self._errors)
        if not self.closed:
            for d in self.plan.directions:
                proc = self._delaylines.get(d.nfqueue) if d.nfqueue is not None else None
                if proc is not None and proc.poll() is not None:
                    out.append(f"the delay line of {d.src}->{d.dst} exited ({proc.returncode})")
        return out

    def rate_schedule(self, a: str, b: str) -> list[dict]:
        """Rate changes applied so far to link ``a-b``: ``{"t_s", "gbps", "unix",
        "monotonic"}`` (``gbps`` after scaling; ``t_s`` since the start of the schedule, at
        which the change was made; ``unix`` and ``monotonic`` the same instant on those
        clocks)."""
        index = self._link_index(a, b)
        with self._lock:
            return list(self._schedule.get(index, []))

    def _link_index(self, a: str, b: str) -> int:
        for i, link in self._links.items():
            if {link.a, link.b} == {a, b}:
                return i
        raise KeyError(f"no link {a}-{b} in this network")

    def wait_for_rate_changes(self, a: str, b: str, count: int, timeout_s: float) -> list[dict]:
        """Block until link ``a-b`` has had ``count`` rates applied (the first at the start);
        return the schedule. Raises ``TimeoutError`` after ``timeout_s``."""
        index = self._link_index(a, b)
        with self._changed:
            if not self._changed.wait_for(
                lambda: len(self._schedule.get(index, [])) >= count, timeout_s
            ):
                raise TimeoutError(f"link {a}-{b}: under {count} rate changes in {timeout_s} s")
            return list(self._schedule[index])

    def _class_show(self, src: str, dst: str, *, stats: bool = False) -> tuple[str, str]:
        """(router device, ``tc class show`` output) of the htb class of ``src -> dst``."""
        d = self.plan.direction(src, dst)
        dev = self.plan.region(dst).router_if
        cmd = ["tc", *(["-s"] if stats else []), "-n", self.router_namespace, "class", "show"]
        return dev, _run([*cmd, "dev", dev, "classid", f"1:{d.classid:x}"])

    def class_rate_gbps(self, src: str, dst: str) -> float:
        """The rate the kernel's htb class of ``src -> dst`` has now (Gbit/s)."""
        dev, out = self._class_show(src, dst)
        # iproute2 6.1 has no JSON for htb classes; it prints e.g. "rate 23456Kbit" (SI units,
        # divided only while exact or above 10^6 of a unit: within 0.1%).
        m = re.search(r"\brate (\d+(?:\.\d+)?)([KMGT]?)bit", out)
        if m is None:
            raise EmulationError(f"no htb class for {src}->{dst} on {dev}: {out!r}")
        unit = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}[m.group(2)]
        return float(m.group(1)) * unit / 1e9

    def class_bytes(self, src: str, dst: str) -> int:
        """Bytes sent so far by the htb class of direction ``src -> dst``."""
        _, out = self._class_show(src, dst, stats=True)
        for line in out.splitlines():
            line = line.strip()
            if line.startswith("Sent "):
                return int(line.split()[1])
        raise EmulationError(f"no byte counter for {src}->{dst} in `tc -s class show`: {out!r}")

    def close(self) -> None:
        """Stop the helpers and remove every namespace, interface, rule and process."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)
        with contextlib.suppress(EmulationError, OSError):  # before the namespaces go
            self._counters["at_close"] = self.counters()
        for q, proc in self._delaylines.items():
            if proc.poll() is None:
                proc.terminate()
            try:
                out, _ = proc.communicate(timeout=5)
                last = (out or "").strip().splitlines()
                if last and last[-1].startswith("{"):
                    self._delayline_stats[q] = json.loads(last[-1])
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
        if self._mininet is not None:
            with contextlib.suppress(Exception):
                assert self._mininet.stdin is not None
                self._mininet.stdin.write("stop\n")
                self._mininet.stdin.flush()
                self._mininet.stdin.close()
            try:
                self._mininet.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._mininet.kill()
                self._mininet.wait()
        cleanup.remove_network(self.tag)
        if self._reaper is not None:
            with contextlib.suppress(Exception):
                assert self._reaper.stdin is not None
                self._reaper.stdin.close()
            try:
                self._reaper.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._reaper.kill()
                self._reaper.wait()

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- building ----------------------------------------------------------------------------

    def _build(self, *, verify: bool, tolerance: float, probe_seconds: float | None) -> None:
        cleanup.register(self.tag, backend=self.backend)
        self._reaper = subprocess.Popen(
            [sys.executable, CLEANUP, "--reap", self.tag],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        cleanup.add_helper(self.tag, self._reaper.pid)
        if self.backend == "mininet":
            self._build_mininet()
        else:
            self._build_namespaces()
        self._configure_namespaces()
        _batch("tc", self.router_namespace, tc_commands(self.plan))
        self._start_delaylines()
        rules = iptables_router_rules(self.plan)
        if rules:
            self._iptables_restore(self.router_namespace, rules)
        for r in self.plan.regions:
            rules = iptables_loss_rules(self.plan, r.name)
            if rules:
                self._iptables_restore(r.namespace, rules)
        self._start_fluctuation()
        if verify:
            self.probe(seconds=probe_seconds)
            self._verify(tolerance, probe_seconds)
        # The kernel's counters once built (and probed): the run's own drops and retransmissions
        # are what the counters at close add to these.
        with contextlib.suppress(EmulationError, OSError):
            self._counters["after_build"] = self.counters()

    def _build_namespaces(self) -> None:
        lines = [f"netns add {self.router_namespace}"]
        lines += [f"netns add {r.namespace}" for r in self.plan.regions]
        _batch("ip", None, lines)
        # Both ends created straight inside their namespaces: nothing appears in the host's.
        _batch(
            "ip",
            None,
            [
                f"link add {r.host_if} netns {r.namespace} type veth peer name {r.router_if} "
                f"netns {self.router_namespace}"
                for r in self.plan.regions
            ],
        )
        for r in self.plan.regions:
            _batch(
                "ip",
                r.namespace,
                [
                    f"addr add {r.address}/24 dev {r.host_if}",
                    f"link set {r.host_if} up",
                    f"route add default via {r.router_address}",
                ],
            )
        _batch(
            "ip",
            self.router_namespace,
            [f"addr add {r.router_address}/24 dev {r.router_if}" for r in self.plan.regions]
            + [f"link set {r.router_if} up" for r in self.plan.regions],
        )

    def _build_mininet(self) -> None:
        if not Path(SYSTEM_PYTHON).exists():
            raise EmulationUnavailable(f"the Mininet backend needs {SYSTEM_PYTHON}")
        check = subprocess.run([SYSTEM_PYTHON, "-c", "import mininet.net"], capture_output=True)
        if check.returncode != 0:
            raise EmulationUnavailable(
                f"Mininet is not installed for {SYSTEM_PYTHON} (apt-get install mininet)"
            )
        spec = {
            "tag": self.tag,
            "router": {"name": f"{self.tag}rt"},
            "hosts": [
                {
                    "name": f"{self.tag}h{r.index}",
                    "intf": r.host_if,
                    "router_intf": r.router_if,
                    "ip": r.address,
                    "router_ip": r.router_address,
                }
                for r in self.plan.regions
            ],
        }
        proc = subprocess.Popen(
            [SYSTEM_PYTHON, MININET, json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._mininet = proc
        cleanup.add_helper(self.tag, proc.pid)
        line = measure.read_line(proc, "Mininet (emulation/mininet_backend.py)", 60)
        while not line.startswith("AUREM "):
            line = measure.read_line(proc, "Mininet (emulation/mininet_backend.py)", 60)
        pids = json.loads(line[len("AUREM ") :])["pids"]
        lines = [f"netns attach {self.router_namespace} {pids[spec['router']['name']]}"]
        for r, h in zip(self.plan.regions, spec["hosts"], strict=True):
            lines.append(f"netns attach {r.namespace} {pids[h['name']]}")
        _batch("ip", None, lines)

    def _configure_namespaces(self) -> None:
        mtu = self.plan.segmentation == "mtu"
        for r in self.plan.regions:
            lines = ["link set lo up"]
            if mtu:  # senders send MTU-sized packets (the delay line sees one per packet)
                lines.append(f"link set {r.host_if} gso_max_segs 1")
            _batch("ip", r.namespace, lines)
        lines = ["link set lo up"]
        # In gso mode the router segments what it sends toward a region with a lossy link,
        # after the bottleneck queue, so the loss at the region's ingress is per MTU packet.
        lines += [
            f"link set {r.router_if} gso_max_segs 1"
            for r in self.plan.regions
            if self.plan.segments_toward(r.name)
        ]
        for a, b in self.plan.unlinked:
            lines.append(f"rule add from {self._subnet(a)} to {self._subnet(b)} prohibit pref 1000")
        _batch("ip", self.router_namespace, lines)
        _run(_in_ns(self.router_namespace, ["sysctl", "-qw", "net.ipv4.ip_forward=1"]))
        if self.tcp_window_bytes is not None:
            # Autotuning's ceiling, per namespace: a stream's window, as the simulator's
            # tcp_window_bytes models it (the host's own may differ: 16 MiB here).
            w = self.tcp_window_bytes
            for r in self.plan.regions:
                _run(
                    _in_ns(
                        r.namespace,
                        [
                            "sysctl",
                            "-qw",
                            f"net.ipv4.tcp_wmem=4096 16384 {w}",
                            f"net.ipv4.tcp_rmem=4096 131072 {w}",
                        ],
                    )
                )

    def _iptables_restore(self, namespace: str, rules: str) -> None:
        _run(_in_ns(namespace, ["iptables-restore", "-w", "5", "--noflush"]), stdin=rules)

    def _start_delaylines(self) -> None:
        for d in self.plan.directions:
            if d.nfqueue is None:
                continue
            proc = subprocess.Popen(
                _in_ns(
                    self.router_namespace,
                    [
                        sys.executable,
                        DELAYLINE,
                        "--queue",
                        f"{d.nfqueue}:{d.delay_ms}",
                        "--maxlen",
                        str(d.nfqueue_maxlen),
                        "--quantum-us",
                        str(self.delay_quantum_us),
                        "--rt-priority",
                        os.environ.get("AURORA_DELAYLINE_RT", "10"),
                    ],
                ),
                stdin=subprocess.PIPE,  # end of file (the builder died) stops it
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            self._delaylines[d.nfqueue] = proc
            line = measure.read_line(
                proc, f"the delay line of {d.src}->{d.dst} (NFQUEUE {d.nfqueue})"
            )
            if line != "ready":
                raise EmulationError(f"delay line {d.src}->{d.dst}: unexpected {line!r}")

    def _start_fluctuation(self) -> None:
        for index, link in self._links.items():
            if link.fluctuation is None:
                continue
            low, high, period = link.fluctuation
            draws = rate_draws(self.seed, index, low, high)
            first = next(draws)  # the draw for [0, period); the first draw imports numpy
            t0 = time.monotonic()
            self._apply_rate(index, first * self.scale, 0.0, t0)
            t = threading.Thread(
                target=self._fluctuate,
                args=(index, draws, t0, period),
                name=f"aurem-{self.tag}-fluctuation-{index}",
                daemon=True,
            )
            t.start()
            self._threads.append(t)

    def _fluctuate(self, index: int, draws: Any, t0: float, period: float) -> None:
        k = 1
        while not self._stop.wait(max(t0 + k * period - time.monotonic(), 0.0)):
            try:
                self._apply_rate(index, next(draws) * self.scale, time.monotonic() - t0, t0)
            except EmulationError as exc:
                if not self._stop.is_set():  # never fluctuate no more while claiming to
                    with self._lock:
                        self._errors.append(f"fluctuation of link {index} stopped: {exc}")
                return
            k += 1

    def _apply_rate(self, index: int, gbps: float, t: float, t0: float) -> None:
        lines = []
        for d in self.plan.directions:
            if d.link == index:
                dev = self.plan.region(d.dst).router_if
                lines.append(
                    f"class change dev {dev} parent 1: classid 1:{d.classid:x} htb {htb_rate(gbps)}"
                )
        _batch("tc", self.router_namespace, lines)
        with self._changed:
            self._current_gbps[index] = gbps
            self._schedule.setdefault(index, []).append(
                {"t_s": round(t, 4), "gbps": gbps, "unix": time.time(), "monotonic": t0 + t}
            )
            self._changed.notify_all()

    # -- probing -----------------------------------------------------------------------------

    def _verify(self, tolerance: float, probe_seconds: float | None) -> None:
        """Fail when a direction misses its configured RTT or rate by more than ``tolerance``
        (a fraction; the RTT also gets 1 ms of slack for the delay line's wake-ups).

        A goodput below the band is measured again, up to ``VERIFY_TRIES`` probes in all, and
        the best one counts: a few seconds of TCP on a busy 2-core machine lands anywhere in
        0.67-0.96 of an htb rate that is exact (measured here: 4 bbr streams, 47 Mbit/s,
        40 ms), while a rate the machine cannot carry misses on every try."""
        for d in self.plan.directions:
            got = self._probe.get((d.src, d.dst))
            if got is None:
                continue
            rtt = got["measured_rtt_ms"]
            if rtt is None:
                raise EmulationError(f"link {d.src}->{d.dst}: no probe echo came back")
            if d.rtt_ms > 0 and abs(rtt - d.rtt_ms) > tolerance * d.rtt_ms + 1.0:
                raise EmulationError(
                    f"link {d.src}->{d.dst}: measured RTT {rtt:.2f} ms against "
                    f"{d.rtt_ms:g} ms configured (delay by {d.delay_by}); the delay line may "
                    f"be starved of CPU"
                )
            tries = [got]
            while (
                tries[-1]["measured_gbps"] < (1 - tolerance) * tries[-1]["gbps"] * (1 - d.loss)
                and len(tries) < VERIFY_TRIES
            ):
                tries.append(
                    self._probe_direction(
                        d,
                        pings=got["pings"],
                        seconds=probe_seconds,
                        streams=got["tcp_streams"],
                        cc=got["tcp_cc"],
                    )
                )
            best = max(tries, key=lambda r: r["measured_gbps"] / r["gbps"])
            if len(tries) > 1:
                best = dict(best, goodput_tries=[r["measured_gbps"] for r in tries])
                self._probe[(d.src, d.dst)] = best
            want = best["gbps"]
            if best["measured_gbps"] < (1 - tolerance) * want * (1 - d.loss) or (
                best["measured_gbps"] > (1 + tolerance) * want
            ):
                raise EmulationError(
                    f"link {d.src}->{d.dst}: measured {best['measured_gbps'] * 1e3:.1f} Mbit/s "
                    f"against {want * 1e3:.1f} configured (over the measured window"
                    f"{f', best of {len(tries)} tries' if len(tries) > 1 else ''}); this "
                    f"machine cannot emulate that rate here (lower the scale, or see "
                    f"docs/EMULATION.md)"
                )

    # -- helpers -----------------------------------------------------------------------------

    def _subnet(self, region: str) -> str:
        return SUBNET.format(self.plan.region(region).index)

    def _link_key(self, a: str, b: str) -> frozenset[str]:
        self.plan.region(a), self.plan.region(b)
        if not any({d.src, d.dst} == {a, b} for d in self.plan.directions):
            raise KeyError(f"no link {a}-{b} in this network")
        return frozenset((a, b))

    def _cut_rules(self, op: str, a: str, b: str) -> list[str]:
        return [
            f"rule {op} from {self._subnet(x)} to {self._subnet(y)} blackhole pref 100"
            for x, y in ((a, b), (b, a))
        ]

    def _tcp_settings(self) -> dict:
        out: dict[str, str] = self._tcp_cache  # read once: still there after close
        if out or self.closed or not self.plan.regions:
            return dict(out)
        ns = self.plan.regions[0].namespace
        for key in ("tcp_congestion_control", "tcp_rmem", "tcp_wmem"):
            with contextlib.suppress(EmulationError):
                out[key] = _run(_in_ns(ns, ["sysctl", "-n", f"net.ipv4.{key}"])).strip()
        return dict(out)

    def counters(self) -> dict:
        """What the kernel counts for this network now: per direction, every qdisc on the
        router's interface towards it (:func:`parse_qdisc_stats`: bytes and packets sent,
        drops, overlimits, backlog); per region, its namespace's TCP counters
        (:data:`TCP_COUNTERS`: retransmitted segments, retransmission timeouts, tail-loss
        probes...), which count every connection of the roles running there."""
        qdiscs = {}
        for d in self.plan.directions:
            dev = self.plan.region(d.dst).router_if
            out = _run(["tc", "-s", "-n", self.router_namespace, "qdisc", "show", "dev", dev])
            qdiscs[f"{d.src}->{d.dst}"] = parse_qdisc_stats(out)
        tcp = {}
        for r in self.plan.regions:
            text = _run(_in_ns(r.namespace, ["cat", "/proc/net/snmp", "/proc/net/netstat"]))
            tcp[r.name] = parse_tcp_counters(text)
        return {"unix": time.time(), "qdiscs": qdiscs, "tcp": tcp}

    def _counters_report(self) -> dict:
        """The counters after the build and at close, and the run's share: their difference."""
        out = dict(self._counters)
        first, last = self._counters.get("after_build"), self._counters.get("at_close")
        if first is not None and last is not None:
            out["during_run"] = _difference(last, first)
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


def _difference(last: Any, first: Any) -> Any:
    """``last - first`` for every number in two nested dicts of the same shape (``unix``: the
    span between them)."""
    if isinstance(last, dict) and isinstance(first, dict):
        # A backlog is a level, not a count: the one at close.
        return {
            k: v if k.startswith("backlog") else _difference(v, first.get(k))
            for k, v in last.items()
        }
    if isinstance(last, int | float) and isinstance(first, int | float):
        return last - first
    return last


def new_tag() -> str:
    return uuid.uuid4().hex[:6]


def build_network(
    topology: Any,
    *,
    scale: float = 1.0,
    backend: str = "auto",
    tag: str | None = None,
    seed: int = 0,
    verify: bool = True,
    tolerance: float = 0.25,
    probe_seconds: float | None = None,
    segmentation: str = "auto",
    queue_bdp: float = 1.0,
    queue_bytes: int | None = None,
    delay_quantum_us: float = 500.0,
    tcp_window_bytes: int | None = None,
    links: Sequence[PlanLink] | None = None,
    regions: Sequence[str] | None = None,
) -> Network:
    """Build ``topology``'s WAN (an ``aurora.topology.Topology``) and return it, built.

    ``scale`` multiplies every link rate; ``backend`` is ``netns`` (ours), ``mininet``
    (Mininet's Python API builds the nodes and links) or ``auto`` (``netns``); ``tag`` (six
    characters a-z0-9, random by default) names everything created; ``seed`` keys the
    fluctuation draws as in the simulator; ``verify`` probes every direction at the start and
    fails when one misses its RTT or rate by more than ``tolerance`` (each direction's TCP
    probe lasts ``probe_seconds``, default max(3, 25 RTTs) up to 6 s); ``segmentation`` and
    ``queue_bdp``/``queue_bytes`` override the plan's choices (:func:`emulation.plan.make_plan`);
    ``delay_quantum_us`` is the NFQUEUE delay line's shortest time between releases under load
    (a packet leaves within half of it of its due time; smaller costs more CPU);
    ``tcp_window_bytes`` sets the regions' ``tcp_wmem``/``tcp_rmem`` ceiling (e.g. the
    simulator's ``tcp_window_bytes`` for parity; None keeps the host's);
    ``links``/``regions`` replace ``topology`` (pass None) for links the topology format cannot
    state (no delay). Raises
    :class:`EmulationUnavailable` where namespaces cannot be made and :class:`EmulationError`
    (naming the missing facility) when the topology asks for what this machine cannot give.
    Use it as a context manager, or call ``close()``.
    """
    if backend not in ("auto", "netns", "mininet"):
        raise ValueError(f"backend must be auto, netns or mininet, got {backend!r}")
    backend = "netns" if backend == "auto" else backend
    if topology is not None:
        links = links_of(topology)
        regions = [r.name for r in topology.regions]
    assert links is not None and regions is not None
    caps = probe_capabilities()
    plan = make_plan(
        regions,
        links,
        tag=tag or new_tag(),
        scale=scale,
        caps=caps,
        segmentation=segmentation,
        queue_bdp=queue_bdp,
        queue_bytes=queue_bytes,
    )
    if cleanup.registry_path(plan.tag).exists() or cleanup.namespaces(plan.tag):
        raise EmulationError(f"an emulated network tagged {plan.tag!r} already exists")
    if not delay_quantum_us >= 0:
        raise ValueError(f"delay_quantum_us must be >= 0, got {delay_quantum_us!r}")
    net = Network(plan, backend=backend, caps=caps, links=links, seed=seed)
    net.delay_quantum_us = delay_quantum_us
    if tcp_window_bytes is not None and tcp_window_bytes < 65536:
        raise ValueError(f"tcp_window_bytes must be >= 65536, got {tcp_window_bytes!r}")
    net.tcp_window_bytes = tcp_window_bytes
    try:
        net._build(verify=verify, tolerance=tolerance, probe_seconds=probe_seconds)
    except BaseException:
        net.close()
        raise
    return net
