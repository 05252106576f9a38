"""From a topology to a plan of the emulated network: addresses, classes, queues, mechanisms.

Theory of operation
-------------------
Pure: a plan is computed from the topology's links, the scale and what this kernel can do
(:class:`Capabilities`), with no I/O, so every choice is unit-tested without root.
:mod:`emulation.network` carries a plan out. Each region gets a namespace behind one router
namespace; every WAN link ``a-b`` becomes two *directions*, each shaped on the router's egress
with a rate, a queue, a delay and a loss (:func:`make_plan`); pairs of regions with no link are
prohibited, so a connection between them fails at once instead of crossing an unshaped path.
Fluctuation follows the simulator: the same seeded draws give both modes the same sequence of
rates (:func:`rate_draws`). Scale multiplies every rate (``gbps``, ``low_gbps``,
``high_gbps``); RTT and loss are kept."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

MTU_FRAME_BYTES = 1514
"""Bytes of one MTU-sized Ethernet frame (1500 IP bytes + 14 header)."""
MIN_QUEUE_MTU_BYTES = 16 * MTU_FRAME_BYTES
"""Smallest bottleneck queue (bytes) when packets are MTU-sized."""
MIN_QUEUE_GSO_BYTES = 128 * 1024
"""Smallest bottleneck queue (bytes) when 64 KB GSO super-packets reach it
(docs/journal/early-measurements.md: a 30 KB queue under GSO cut bbr to 17% of the rate)."""
SUBNET = "10.201.{}.0/24"
ROUTER_NS = "rt"


class EmulationError(RuntimeError):
    """The emulated network cannot be built as asked (a missing facility, a failed command)."""


class EmulationUnavailable(EmulationError):
    """Network namespaces cannot be made here at all (not root, no iproute2)."""


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What this kernel and machine offer, probed in a scratch namespace."""

    htb: bool
    """htb qdisc with u32 filters and bfifo leaves (the rate and the queue)."""
    netem: bool
    """netem qdisc (delay, loss, limit)."""
    nfqueue: bool
    """The iptables command and the NFQUEUE target (the delay line)."""
    statistic: bool
    """The iptables command and the ``statistic`` match (random loss)."""
    missing: tuple[str, ...] = ()
    """One line per facility that is missing, with the reason (for error messages)."""

    def why(self, facility: str) -> str:
        lines = [m for m in self.missing if m.startswith(facility)]
        return "; ".join(lines) or f"{facility}: available"


@dataclass(frozen=True, kw_only=True)
class PlanLink:
    """A WAN link as the planner needs it (built from ``aurora.topology.LinkSpec``)."""

    index: int
    """Position in the topology's ``links`` (the simulator's fluctuation generator key)."""
    a: str
    """One end (a region name)."""
    b: str
    """The other end (a region name)."""
    gbps: float
    """Nominal rate before scaling (Gbit/s)."""
    rtt_ms: float
    """Round-trip time (ms); 0 adds no delay (only for :class:`emulation.netns.EmulatedLink`)."""
    loss: float = 0.0
    """Packet loss probability, each direction."""
    fluctuation: tuple[float, float, float] | None = None
    """``(low_gbps, high_gbps, period_s)`` before scaling."""


@dataclass(frozen=True, kw_only=True)
class RegionPlan:
    """Where one region lives."""

    name: str
    """The topology's region name."""
    index: int
    """1-based; the third byte of the region's subnet."""
    namespace: str
    """Its network namespace (``aurem-<tag>-<name>``)."""
    address: str
    """The address other regions reach this one at."""
    router_address: str
    """The router's address on this region's subnet (the region's default route)."""
    host_if: str
    """The region's interface toward the router."""
    router_if: str
    """The router's interface toward the region (where traffic into the region is shaped)."""


@dataclass(frozen=True, kw_only=True)
class DirectionPlan:
    """One direction ``src -> dst`` of one link, shaped on the router's egress toward dst."""

    link: int
    """Index of the link in the topology."""
    src: str
    """Sending region."""
    dst: str
    """Receiving region."""
    gbps: float
    """Nominal rate after scaling (Gbit/s)."""
    rtt_ms: float
    """The link's round-trip time (ms)."""
    loss: float
    """Packet loss probability of this direction."""
    fluctuation: tuple[float, float, float] | None
    """``(low_gbps, high_gbps, period_s)`` after scaling."""
    delay_ms: float
    """One-way delay added (ms): half the RTT."""
    queue_bytes: int
    """Bottleneck queue (bytes)."""
    classid: int
    """htb class minor number on the router's interface toward ``dst``."""
    nfqueue: int | None
    """NFQUEUE number of the delay line (None when netem delays or there is no delay)."""
    nfqueue_maxlen: int
    """Packets the kernel may hold in that queue."""
    delay_by: str
    """``netem``, ``NFQUEUE`` or ``none``."""
    loss_by: str
    """``netem``, ``iptables`` or ``none``."""

    @property
    def queue_delay_ms(self) -> float:
        """Longest wait in the full bottleneck queue at the lowest rate (ms)."""
        low = self.fluctuation[0] if self.fluctuation else self.gbps
        return self.queue_bytes * 8 / (min(low, self.gbps) * 1e9) * 1e3

    @property
    def mechanisms(self) -> dict[str, str]:
        return {
            "rate": "htb",
            "queue": "bfifo" if self.delay_by != "netem" else "netem",
            "delay": self.delay_by,
            "loss": self.loss_by,
        }


@dataclass(frozen=True, kw_only=True)
class NetworkPlan:
    """The whole emulated network, ready to be carried out."""

    tag: str
    """Six characters [a-z0-9] in every name this network creates."""
    scale: float
    """Factor applied to every rate."""
    segmentation: str
    """``mtu`` (senders send MTU-sized packets) or ``gso`` (see the module docstring)."""
    router_namespace: str
    """The router's namespace (``aurem-<tag>-rt``)."""
    regions: tuple[RegionPlan, ...]
    """One per region, in the topology's order."""
    directions: tuple[DirectionPlan, ...]
    """Two per link."""
    unlinked: tuple[tuple[str, str], ...]
    """Ordered region pairs with no link (prohibited on the router)."""
    queue_bdp: float
    """Bottleneck queue in bandwidth-delay products (before the floor)."""
    region_index: dict[str, RegionPlan] = field(init=False, repr=False, compare=False)
    """``regions`` by name (derived)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "region_index", {r.name: r for r in self.regions})

    def segments_toward(self, region: str) -> bool:
        """Whether the router must cut super-packets into MTU packets toward ``region``: in
        ``gso`` mode, where a link into it drops per packet at its ingress."""
        return self.segmentation == "gso" and any(
            d.dst == region and d.loss_by == "iptables" for d in self.directions
        )

    def region(self, name: str) -> RegionPlan:
        try:
            return self.region_index[name]
        except KeyError:
            known = [r.name for r in self.regions]
            raise KeyError(f"no region {name!r} in this network (regions: {known})") from None

    def direction(self, src: str, dst: str) -> DirectionPlan:
        for d in self.directions:
            if (d.src, d.dst) == (src, dst):
                return d
        raise KeyError(f"no link {src}-{dst} in this network")


def links_of(topology: object) -> list[PlanLink]:
    """The links of an ``aurora.topology.Topology`` as :class:`PlanLink`."""
    out = []
    for i, link in enumerate(topology.links):  # type: ignore[attr-defined]
        fl = link.fluctuation
        out.append(
            PlanLink(
                index=i,
                a=link.a,
                b=link.b,
                gbps=link.gbps,
                rtt_ms=link.rtt_ms,
                loss=link.loss,
                fluctuation=None if fl is None else (fl.low_gbps, fl.high_gbps, fl.period_s),
            )
        )
    return out


def _ns_suffix(name: str, index: int) -> str:
    ok = name.replace("-", "").replace("_", "").isalnum() and name.isascii() and len(name) <= 24
    return name if ok and name != ROUTER_NS else f"r{index}"


def make_plan(
    regions: Sequence[str],
    links: Sequence[PlanLink],
    *,
    tag: str,
    scale: float,
    caps: Capabilities,
    segmentation: str = "auto",
    queue_bdp: float = 1.0,
    queue_bytes: int | None = None,
    gso_above_mbit: float = 150.0,
) -> NetworkPlan:
    """Plan the network; raise :class:`EmulationError` naming what this machine lacks.

    Shape. Region ``i`` (1-based, in the topology's order) gets the namespace
    ``aurem-<tag>-<region>`` with address ``10.201.i.1/24`` and a veth to the router namespace
    ``aurem-<tag>-rt`` (``10.201.i.254``). Every WAN link ``a-b`` becomes two *directions*. The
    direction ``a -> b`` is shaped on the router, on its egress toward ``b``:

    * **rate**: an htb class at ``gbps x scale`` (u32 filter on the source subnet of ``a``, so a
      region reached by several links has one class per link);
    * **queue**: a bfifo under that class of ``queue_bdp`` bandwidth-delay products (rate x RTT),
      at least :data:`MIN_QUEUE_MTU_BYTES` (or :data:`MIN_QUEUE_GSO_BYTES` when super-packets
      pass); the queue bounds the RTT under load to ``rtt + queue_bytes / rate``;
    * **delay** of ``rtt_ms / 2`` each way: a netem leaf where the kernel has netem, otherwise an
      NFQUEUE delay line (:mod:`emulation.delayline`) in the router's FORWARD chain, before the htb
      class, so a packet is delayed and then queued at the bottleneck, as on a path whose
      propagation precedes its bottleneck;
    * **loss**: netem's where netem delays and packets are MTU-sized; otherwise an iptables
      ``statistic`` drop at ``b``'s ingress (raw PREROUTING, matching ``a``'s subnet). That is the
      first hook where packets are MTU-sized in both segmentation modes (the router segments
      super-packets only when it sends them toward ``b``), so the loss rate is per packet, as in
      the Mathis model; and a drop there is invisible to the sender's stack, unlike a drop on its
      own egress (which TCP is told about and does not count as loss).

    Pairs of regions with no link get an ``ip rule ... prohibit`` on the router.

    Segmentation. With every link at most ``gso_above_mbit`` (150 Mbit/s, after scaling),
    senders send MTU-sized packets (``gso_max_segs 1`` on the region side), so the delay line
    and the queue see each packet. Above it, senders keep GSO (super-packets of up to 64 KB: a
    fraction of the notifications), the bottleneck queue's floor is then 128 KB so one
    super-packet fits, and the router's egress toward a region with a lossy link segments them
    after the bottleneck queue (``gso_max_segs 1``), so the loss at that region's ingress is
    still per MTU packet.
    """
    from emulation.cleanup import TAG_RE, interface_name, namespace_name

    if not TAG_RE.match(tag):
        raise ValueError(f"tag must be six characters a-z or 0-9, got {tag!r}")
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a positive number, got {scale!r}")
    if not queue_bdp > 0:
        raise ValueError(f"queue_bdp must be > 0, got {queue_bdp!r}")
    if queue_bytes is not None and queue_bytes < MTU_FRAME_BYTES:
        raise ValueError(f"queue_bytes must be >= {MTU_FRAME_BYTES} (one frame), got {queue_bytes}")
    if segmentation not in ("auto", "mtu", "gso"):
        raise ValueError(f"segmentation must be auto, mtu or gso, got {segmentation!r}")
    if len(regions) > 250:
        raise ValueError(f"at most 250 regions can be emulated, got {len(regions)}")
    if not caps.htb:
        raise EmulationError(f"rate limiting needs the htb qdisc: {caps.why('htb')}")
    region_plans = []
    for i, name in enumerate(regions, start=1):
        region_plans.append(
            RegionPlan(
                name=name,
                index=i,
                namespace=namespace_name(tag, _ns_suffix(name, i)),
                address=f"10.201.{i}.1",
                router_address=f"10.201.{i}.254",
                host_if=interface_name(tag, "h", i),
                router_if=interface_name(tag, "r", i),
            )
        )
    known = {r.name for r in region_plans}
    peak_mbit = 0.0
    for link in links:
        for end in (link.a, link.b):
            if end not in known:
                raise ValueError(f"links[{link.index}]: unknown region {end!r}")
        top = max(link.gbps, link.fluctuation[1] if link.fluctuation else 0.0)
        peak_mbit = max(peak_mbit, top * scale * 1e3)
    if segmentation == "auto":
        segmentation = "mtu" if peak_mbit <= gso_above_mbit else "gso"
    floor = MIN_QUEUE_MTU_BYTES if segmentation == "mtu" else MIN_QUEUE_GSO_BYTES

    directions = []
    per_dst: dict[str, int] = {}
    queue_num = 0
    for link in links:
        where = f"links[{link.index}] {link.a}-{link.b}"
        if link.rtt_ms > 0:
            if caps.netem:
                delay_by = "netem"
            elif caps.nfqueue:
                delay_by = "NFQUEUE"
            else:
                raise EmulationError(
                    f"{where}: a {link.rtt_ms:g} ms RTT needs netem or an NFQUEUE delay line, "
                    f"and this machine has neither ({caps.why('netem')}; {caps.why('nfqueue')})"
                )
        else:
            delay_by = "none"
        if link.loss > 0:
            if delay_by == "netem" and segmentation == "mtu":
                loss_by = "netem"
            elif caps.statistic:
                loss_by = "iptables"
            else:
                raise EmulationError(
                    f"{where}: a loss of {link.loss:g} needs netem (with MTU-sized packets) or "
                    f"the iptables statistic match ({caps.why('netem')}; "
                    f"{caps.why('statistic')})"
                )
        else:
            loss_by = "none"
        gbps = link.gbps * scale
        fl = None
        if link.fluctuation is not None:
            low, high, period = link.fluctuation
            fl = (low * scale, high * scale, period)
        bdp = gbps * 1e9 / 8 * link.rtt_ms / 1e3
        queue = int(max(queue_bdp * bdp, floor)) if queue_bytes is None else queue_bytes
        peak = max(gbps, fl[1] if fl else 0.0)
        # Packets in the delay line: up to a window per flow in flight, plus the ACKs of the
        # other direction; 8 x (BDP + queue) in MTU packets covers several windows.
        held = 8 * (peak * 1e9 / 8 * link.rtt_ms / 1e3 + queue) / MTU_FRAME_BYTES
        maxlen = int(min(max(8192, math.ceil(held)), 1 << 20))
        for src, dst in ((link.a, link.b), (link.b, link.a)):
            per_dst[dst] = per_dst.get(dst, 0) + 1
            nfq = None
            if delay_by == "NFQUEUE":
                queue_num += 1
                nfq = queue_num
            directions.append(
                DirectionPlan(
                    link=link.index,
                    src=src,
                    dst=dst,
                    gbps=gbps,
                    rtt_ms=link.rtt_ms,
                    loss=link.loss,
                    fluctuation=fl,
                    delay_ms=link.rtt_ms / 2,
                    queue_bytes=queue,
                    classid=0x10 + per_dst[dst],
                    nfqueue=nfq,
                    nfqueue_maxlen=maxlen,
                    delay_by=delay_by,
                    loss_by=loss_by,
                )
            )
    linked = {(d.src, d.dst) for d in directions}
    unlinked = tuple(
        (a.name, b.name)
        for a in region_plans
        for b in region_plans
        if a.name != b.name and (a.name, b.name) not in linked
    )
    return NetworkPlan(
        tag=tag,
        scale=scale,
        segmentation=segmentation,
        router_namespace=namespace_name(tag, ROUTER_NS),
        regions=tuple(region_plans),
        directions=tuple(directions),
        unlinked=unlinked,
        queue_bdp=queue_bdp,
    )


def rate_draws(seed: int, link_index: int, low_gbps: float, high_gbps: float):  # noqa: ANN201
    """The simulator's sequence of fluctuating rates for one link (Gbit/s, before scaling).

    Same generator and same draws as ``sim/model.py``'s ``_fluctuate``: draw ``k`` holds from
    ``k x period_s`` to ``(k + 1) x period_s`` after the start.

    Fluctuation follows the simulator (``sim/model.py``): at the start and every ``period_s``
    the link's rate is redrawn uniformly in ``[low_gbps, high_gbps]``, piecewise constant in
    between; the draws come from ``numpy.random.default_rng([seed, 1, link_index])``, the
    simulator's own generator for that link, so with the same seed both modes see the same
    sequence of rates (times ``scale`` here). One difference: the simulator's link is one
    resource shared by both directions; here each direction has its own class at the drawn rate
    (a full-duplex path).
    """
    import numpy as np

    rng = np.random.default_rng([seed, 1, link_index])
    while True:
        yield float(rng.uniform(low_gbps, high_gbps))


def tc_commands(plan: NetworkPlan) -> list[str]:
    """``tc -batch`` lines for the router namespace: htb, classes, filters, queues."""
    lines = []
    by_dst: dict[str, list[DirectionPlan]] = {}
    for d in plan.directions:
        by_dst.setdefault(d.dst, []).append(d)
    for dst, dirs in by_dst.items():
        dev = plan.region(dst).router_if
        # default 0: unclassified packets (ARP, the router's own ICMP) bypass the classes.
        lines.append(f"qdisc add dev {dev} root handle 1: htb default 0")
        for d in dirs:
            lines.append(
                f"class add dev {dev} parent 1: classid 1:{d.classid:x} htb {htb_rate(d.gbps)}"
            )
            if d.delay_by == "netem":
                lines.append(
                    f"qdisc add dev {dev} parent 1:{d.classid:x} handle {d.classid:x}: "
                    f"{netem_args(d)}"
                )
            else:
                lines.append(
                    f"qdisc add dev {dev} parent 1:{d.classid:x} handle {d.classid:x}: "
                    f"bfifo limit {d.queue_bytes}"
                )
            src = plan.region(d.src)
            lines.append(
                f"filter add dev {dev} parent 1: protocol ip prio 1 u32 match ip src "
                f"{SUBNET.format(src.index)} flowid 1:{d.classid:x}"
            )
    return lines


def htb_rate(gbps: float) -> str:
    bits = max(int(round(gbps * 1e9)), 8000)
    return f"rate {bits}bit ceil {bits}bit"


def netem_args(d: DirectionPlan) -> str:
    """netem leaf: the delay, the loss when netem drops, and a limit in packets that holds a
    delay's worth of packets at the peak rate plus the bottleneck queue."""
    peak = max(d.gbps, d.fluctuation[1] if d.fluctuation else 0.0)
    in_flight = peak * 1e9 / 8 * d.delay_ms / 1e3
    limit = math.ceil((in_flight + d.queue_bytes) / MTU_FRAME_BYTES) + 64
    args = f"netem delay {d.delay_ms:.3f}ms limit {limit}"
    if d.loss_by == "netem":
        args += f" loss {d.loss * 100:.6f}%"
    return args


def iptables_router_rules(plan: NetworkPlan) -> str:
    """``iptables-restore --noflush`` input for the router: the delay lines' NFQUEUE rules.

    No ``--queue-bypass``: without its delay line a direction drops, it never runs undelayed.
    """
    rules = []
    for d in plan.directions:
        if d.nfqueue is None:
            continue
        src, dst = plan.region(d.src), plan.region(d.dst)
        rules.append(
            f"-A FORWARD -s {SUBNET.format(src.index)} -d {SUBNET.format(dst.index)} "
            f'-m comment --comment "aurem-{plan.tag} delay {d.src}->{d.dst}" '
            f"-j NFQUEUE --queue-num {d.nfqueue}"
        )
    return "*filter\n" + "".join(r + "\n" for r in rules) + "COMMIT\n" if rules else ""


def iptables_loss_rules(plan: NetworkPlan, region: str) -> str:
    """``iptables-restore --noflush`` input for ``region``: drops at its ingress, per link."""
    rules = []
    me = plan.region(region)
    for d in plan.directions:
        if d.dst != region or d.loss_by != "iptables":
            continue
        src = plan.region(d.src)
        rules.append(
            f"-A PREROUTING -i {me.host_if} -s {SUBNET.format(src.index)} "
            f"-m statistic --mode random --probability {d.loss:.10f} "
            f'-m comment --comment "aurem-{plan.tag} loss {d.src}->{d.dst}" -j DROP'
        )
    return "*raw\n" + "".join(r + "\n" for r in rules) + "COMMIT\n" if rules else ""
