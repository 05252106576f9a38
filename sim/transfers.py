"""Links and transfers: how a published version gets from the Trainer to every Actor.

Theory of operation
-------------------
The network resources are the Trainer's interface, one per WAN path between two regions (whose
rate may fluctuate) and each node's interface. A sender-receiver pair has one connection bundle
of S TCP streams, whatever the version; versions on one pair are sent one after the other
(:class:`sim.network.Network` bundles). A transfer of version ``v`` from a source to a set of
receivers is one flow per *cohort* (receivers with the same path, cap and latency). ``Fanout``
actions from the Ledger say who sends ``v`` to whom; ``FallBack`` re-routes the receivers of a
lost source. A receiver holds ``v`` when the last byte arrives; an Actor then reports it staged.
Invariant: a relay never forwards a byte it has not received and verified."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aurora.faults import link_ends
from aurora.policy.events import FallBack
from aurora.policy.membership import TRAINER
from sim.network import Flow, Producer, Resource
from sim.nodes import ActorNode, Node, Transfer
from sim.tcp import DEFAULT_CONGESTION, tail_delay, tcp_cap

if TYPE_CHECKING:  # pragma: no cover - typing only
    from sim.model import Simulation

GBPS = 1e9 / 8
"""Bytes/s in one Gbit/s."""


class Transfers:
    """Every link of the deployment and every transfer in flight.

    Each node's interface: sending side shared by what it forwards, receiving side shared by
    what it receives. A bundle's rate is capped by ``S * min(W/RTT,
    MSS*sqrt(3/2)/(RTT*sqrt(p)))`` across a WAN path, and by the region's per-pair ``lan_gbps``
    inside a region. A transfer comes from the Trainer, a relay or an Actor that relays; a relay
    forwarding to 1000 identical Actors is one flow of multiplicity 1000. A receiver that gets a
    second flow at the same time (a catch-up pull, a fallback) is split off into a flow of its
    own, so its interface is shared exactly.

    The Trainer's sends start when the first segment is extracted (cut-through) or when
    extraction ends; a relay's forward starts one segment after its own inbound copy starts
    (cut-through: it verifies a segment before forwarding it, and never runs ahead of its
    upstream), or when it holds ``v`` whole (store-and-forward). On ``FallBack``, what the
    receivers already verified is kept, the rest comes from the new source.
    """

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.env = sim.env
        self.net = sim.net
        topo = sim.cfg.topology
        self.trainer_nic = Resource("trainer", topo.trainer.egress_gbps * GBPS)
        self.resources: list[Resource] = [self.trainer_nic]
        """Shared resources whose bytes each step row reports (Trainer interface, WAN paths)."""
        self.wan: dict[frozenset[str], Resource] = {}
        recorded = {frozenset(link_ends(s.link, topo) or ()): s for s in sim.cfg.rate_schedules}
        for i, link in enumerate(topo.links):
            res = Resource(f"wan:{link.a}-{link.b}", link.gbps * GBPS)
            pair = frozenset((link.a, link.b))
            self.wan[pair] = res
            self.resources.append(res)
            if pair in recorded:
                self._follow(res, recorded[pair].points)
            elif link.fluctuation is not None:
                self._fluctuate(res, link.fluctuation, i)
        self.relays: dict[str, Node] = {}
        self._outgoing: dict[str, dict[int, Transfer]] = {}
        """Transfers each node is sending, so that losing the node stops them."""
        self._bundles: dict[tuple[str, frozenset[str]], tuple[str, frozenset[str]]] = {}
        """Canonical connection-bundle keys (see :meth:`_bundle`)."""
        self.on_hold: Callable[[str], None] | None = None
        """Called with an Actor's id when it holds a version (fan-out measurement)."""
        self._tail_rng = sim.rng(7) if sim.cfg.loss_recovery else None
        """Draws of loss recovery at the end of each transfer across a lossy WAN path."""

    def _fluctuate(self, res: Resource, fl: Any, index: int) -> None:
        rng = self.sim.rng(1, index)
        net = self.net

        def change() -> None:
            net.set_capacity(res, float(rng.uniform(fl.low_gbps, fl.high_gbps)) * GBPS)
            self.sim.later(fl.period_s, change)

        change()

    def _follow(self, res: Resource, points: tuple[tuple[float, float], ...]) -> None:
        """A recorded schedule: each rate from its time on (those before 0 set the start)."""
        net = self.net
        start = [g for t, g in points if t <= 0]
        if start:
            net.set_capacity(res, start[-1] * GBPS)
        for t, g in points:
            if t > 0:
                # mypy cannot type a lambda with a default argument (which binds the current value)
                self.sim.later(t, lambda g=g: net.set_capacity(res, g * GBPS))  # type: ignore[misc]

    # -- nodes and paths ----------------------------------------------------------------------

    def node(self, node_id: str) -> Node:
        return self.sim.actors.nodes.get(node_id) or self.relays[node_id]

    def path(self, src: str, dst: Node) -> tuple[tuple[Resource, ...], float, float]:
        """Shared resources, the pair's rate cap (bytes/s: its connection bundle's TCP cap
        across a WAN path, the region's per-pair LAN rate inside one) and one-way latency (s)
        from ``src`` to ``dst``. The receiver's interface is added by the caller."""
        sim = self.sim
        strat, topo = sim.cfg.strategy, sim.cfg.topology
        if strat.rdma:
            return (), sim.consts.rdma_gbps.value * GBPS, 0.0
        if src == TRAINER:
            src_region, src_nic = topo.trainer.region, self.trainer_nic
        else:
            node = self.node(src)
            src_region, src_nic = node.region, node.nic
        if src_region == dst.region:
            return (src_nic,), topo.region(dst.region).lan_gbps * GBPS, 0.0
        link = topo.link(src_region, dst.region)
        if link is None:
            raise ValueError(f"no link between {src_region!r} and {dst.region!r} in the topology")
        rtt = link.rtt_ms / 1e3
        tcp = tcp_cap(
            streams=strat.streams,
            rtt_s=rtt,
            loss=link.loss,
            window_bytes=sim.consts.tcp_window_bytes.value,
            mss_bytes=sim.consts.mss_bytes.value,
            congestion=topo.congestion or DEFAULT_CONGESTION,
        )
        return (src_nic, self.wan[frozenset((src_region, dst.region))]), tcp, rtt / 2

    def tail(self, src: str, region: str) -> Callable[[Flow], float] | None:
        """With ``loss_recovery``: the draw of how late a flow from ``src`` into ``region``
        ends after its fluid end (:func:`sim.tcp.tail_delay`: its connection bundle's streams
        at the rate it last had); None inside a region, on a lossless link, or without it."""
        rng = self._tail_rng
        if rng is None or self.sim.cfg.strategy.rdma:
            return None
        topo = self.sim.cfg.topology
        src_region = topo.trainer.region if src == TRAINER else self.node(src).region
        link = topo.link(src_region, region) if src_region != region else None
        if link is None or link.loss <= 0:
            return None
        loss, rtt = link.loss, link.rtt_ms / 1e3
        streams, mss = self.sim.cfg.strategy.streams, self.sim.consts.mss_bytes.value
        return lambda f: tail_delay(
            rng, loss=loss, rtt_s=rtt, rate=f.rate, streams=streams, mss=mss
        )

    def receiving(self, node: Node) -> tuple[Resource, ...]:
        """Extra path of a flow to ``node`` alone: its interface, shared by all it receives
        (RDMA writes straight into GPU memory: no interface to share)."""
        return () if self.sim.cfg.strategy.rdma else (node.nic_in,)

    def _segment_rate(self, node: Node, pair_cap: float) -> float:
        """The rate one segment crosses the last hop at, unshared (for the cut-through tail)."""
        return pair_cap if self.sim.cfg.strategy.rdma else min(pair_cap, node.nic_in.capacity)

    def _bundle(self, src: str, members: list[str]) -> tuple[str, frozenset[str]]:
        """The connection bundle from ``src`` to ``members``: one object per pair (or cohort),
        so that comparing two is an identity check, not a walk over 10^4 member ids."""
        key = (src, frozenset(members))
        return self._bundles.setdefault(key, key)

    def _busy(self, node: Node, bundle: object) -> bool:
        """Whether ``node`` receives anything other than on ``bundle`` (so a new flow to it must
        be its own, sharing its interface)."""
        if isinstance(node, ActorNode) and node.pulling:
            return True
        return any(
            t.flow is not None and t.flow.active and t.flow.bundle is not bundle
            for t in node.inbound.values()
        )

    def detach(self, node: Node) -> None:
        """``node`` gets a flow of its own: take it out of every cohort it receives in, so that
        its interface is shared exactly among its flows."""
        for v, t in list(node.inbound.items()):
            flow = t.flow
            if flow is None or not flow.active or len(t.members) < 2:
                continue
            t.members.remove(node.id)
            own = Transfer(
                v,
                t.src,
                [node.id],
                start=t.start,
                cap=t.cap,
                pair_cap=t.pair_cap,
                upstream=t.upstream,
            )
            own.flow = self.net.split(
                flow,
                label=f"v{v} {t.src}->{node.id}",
                path=flow.path + self.receiving(node),
                cap=t.pair_cap,
                # mypy cannot type a lambda with a default argument (which binds the current value)
                on_done=lambda _f, t=own: self._forwarded(t),  # type: ignore[misc]
            )
            node.inbound[v] = own
            self._outgoing.setdefault(t.src, {})[id(own)] = own

    def _leave_cohort(self, transfer: Transfer, node_id: str) -> None:
        """``node_id`` no longer receives ``transfer``: the cohort carries one copy fewer."""
        transfer.members.remove(node_id)
        flow = transfer.flow
        if flow is None:
            return
        if not transfer.members:
            self.net.cancel(flow)
        else:
            self.net.set_mult(flow, len(transfer.members))

    # -- sending ------------------------------------------------------------------------------

    def fanout(self, v: int, edges: tuple[tuple[str, str], ...]) -> None:
        by_src: dict[str, list[str]] = {}
        for src, dst in edges:
            by_src.setdefault(src, []).append(dst)
        # Trainer edges first: relays forward what they receive from it.
        for src in sorted(by_src, key=lambda s: s != TRAINER):
            self.send(v, src, by_src[src])

    def push(self, v: int) -> None:
        """The runtime's data plane (the ``sequential`` pipeline): version ``v`` goes to every
        subscriber as the Trainer cuts it, before the Ledger has heard of it. Relays subscribe
        to the Trainer; each live Actor to the source the Ledger last routed it to
        (``Route``/``FallBack``). The Ledger's ``Fanout`` at the announcement then finds them
        receiving it already."""
        edges = []
        if self.sim.cfg.strategy.relays:
            edges += [(TRAINER, rid) for rid, node in self.relays.items() if node.live]
        edges += [(a.source, a.id) for a in self.sim.actors.nodes.values() if a.live]
        self.fanout(v, tuple(edges))

    def send(self, v: int, src: str, dsts: list[str], size: float | None = None) -> None:
        """Start sending version ``v`` from ``src`` to ``dsts`` (grouped into cohorts)."""
        sim = self.sim
        size = sim.bytes_of(v) if size is None else size
        todo = []
        for d in dsts:
            node = self.node(d)
            if (
                node.live
                and v not in node.held
                and v not in node.inbound
                and not (
                    isinstance(node, ActorNode) and node.active is not None and v <= node.active
                )
            ):
                todo.append(node)
        if not todo:
            return
        strat = sim.cfg.strategy
        if src == TRAINER:
            trainer = sim.trainer
            now = self.env.now
            producing = trainer.ready_at > now and v == trainer.producing
            if producing and trainer.pub.cut_through:
                # The first segment must be extracted before it can be sent.
                first = min(sim.cfg.segment_bytes, size) / trainer.produce_rate
                producer = Producer(rate=trainer.produce_rate, until=trainer.ready_at)
                sim.later(first, lambda: self._start(v, src, todo, size, None, producer))
            elif producing:
                sim.later(trainer.ready_at - now, lambda: self._start(v, src, todo, size))
            else:
                self._start(v, src, todo, size)
            return
        holder = self.node(src)
        if v in holder.held:
            self._start(v, src, todo, size)
        elif v in holder.inbound and strat.cut_through:
            self._forward_when_first_segment(v, src, todo, size, holder.inbound[v].flow)
        else:
            # Store-and-forward, or the source has not started receiving yet: forward cut-through
            # when its inbound starts, or whole once it holds the version, whichever comes first.
            fired = [False]

            def once(fn: Callable[[], None]) -> Callable[[], None]:
                def run() -> None:
                    if not fired[0]:
                        fired[0] = True
                        fn()

                return run

            holder.waiters.setdefault(v, []).append(once(lambda: self._start(v, src, todo, size)))
            if strat.cut_through:
                holder.starters.setdefault(v, []).append(
                    once(
                        lambda: self._forward_when_first_segment(
                            v, src, todo, size, holder.inbound[v].flow
                        )
                    )
                )

    def _forward_when_first_segment(
        self, v: int, src: str, todo: list[Node], size: float, up: Flow | None
    ) -> None:
        assert up is not None

        def first_segment() -> None:
            # A relay verifies a segment before forwarding it: the first must arrive whole.
            first = min(self.sim.cfg.segment_bytes, size) / max(up.rate, 1.0) + up.latency
            self.sim.later(first, lambda: self._start(v, src, todo, size, up))

        # Its inbound copy may wait behind an earlier version on the relay's connection.
        self.net.when_flowing(up, first_segment)

    def _start(
        self,
        v: int,
        src: str,
        dsts: list[Node],
        size: float,
        upstream: Flow | None = None,
        producer: Producer | None = None,
    ) -> None:
        if src != TRAINER and not self.node(src).live:
            return  # the source died before it could forward; FallBack re-routes these Actors
        live = [
            d
            for d in dsts
            if d.live
            and v not in d.held
            and v not in d.inbound
            # An Actor re-routed since this send was scheduled gets it from its new source.
            and (not isinstance(d, ActorNode) or d.source == src)
        ]
        groups: dict[tuple[Any, ...], list[Node]] = {}
        paths: dict[str, tuple[tuple[Resource, ...], float, float]] = {}
        for d in live:
            # From one source the path depends on the receiver's region only (path()): once
            # per region, not per receiver (a relay's 10^4 Actors).
            got = paths.get(d.region)
            if got is None:
                got = paths[d.region] = self.path(src, d)
            path, cap, latency = got
            groups.setdefault((path, cap, latency, d.nic_in.capacity), []).append(d)
        # (path, flow cap, pair cap, latency, members)
        cohorts: list[tuple[tuple[Resource, ...], float, float, float, list[Node]]] = []
        for (path, cap, latency, _nic), members in groups.items():
            singles, rest = members, []
            if len(members) > 1:
                # A receiver already getting something else (not an earlier version on this same
                # connection) shares its interface: it gets a flow of its own.
                bundle = self._bundle(src, [m.id for m in members])
                singles = [m for m in members if self._busy(m, bundle)]
                rest = [m for m in members if m not in singles]
                if len(rest) == 1:
                    singles, rest = singles + rest, []
            if rest:
                # Nobody else loads these interfaces: each member's is a cap.
                cohorts.append((path, self._segment_rate(rest[0], cap), cap, latency, rest))
            for m in singles:
                self.detach(m)
                cohorts.append((path + self.receiving(m), cap, cap, latency, [m]))
        for path, flow_cap, pair_cap, latency, members in cohorts:
            if upstream is not None and not upstream.active:
                upstream = None
            transfer = Transfer(
                v,
                src,
                [m.id for m in members],
                start=self.env.now,
                cap=self._segment_rate(members[0], pair_cap),
                pair_cap=pair_cap,
                upstream=upstream,
            )
            label = f"v{v} {src}->{members[0].id}" + (
                f"+{len(members) - 1}" if len(members) > 1 else ""
            )
            transfer.flow = self.net.start(
                label,
                size,
                path,
                cap=flow_cap,
                mult=len(members),
                upstream=upstream,
                producer=producer,
                latency=latency,
                bundle=self._bundle(src, transfer.members),
                tail=self.tail(src, members[0].region),
                # mypy cannot type a lambda with a default argument (which binds the current value)
                on_done=lambda _f, t=transfer: self._forwarded(t),  # type: ignore[misc]
            )
            self._outgoing.setdefault(src, {})[id(transfer)] = transfer
            for m in members:
                m.inbound[v] = transfer
                for fn in m.starters.pop(v, []):
                    fn()

    def _forwarded(self, transfer: Transfer) -> None:
        """A forward's last byte cannot arrive before the relay has received and verified the
        last segment: no earlier than the upstream's arrival plus one segment at this rate."""
        up = transfer.upstream
        if up is not None and up.finished is not None:
            assert transfer.flow is not None
            seg = min(self.sim.cfg.segment_bytes, transfer.flow.size) / transfer.cap
            due = up.finished + up.latency + up.tail_s + seg
            if due > self.env.now:
                self.sim.later(due - self.env.now, lambda: self._arrived(transfer))
                return
        self._arrived(transfer)

    def _arrived(self, transfer: Transfer) -> None:
        sim = self.sim
        self._outgoing.get(transfer.src, {}).pop(id(transfer), None)
        v = transfer.version
        if transfer.members:
            src = transfer.src
            who = transfer.members[0] + (
                f" +{len(transfer.members) - 1}" if len(transfer.members) > 1 else ""
            )
            flow = transfer.flow
            # From when bytes moved (it may have waited behind an earlier version on its pair).
            began = flow.began if flow is not None and flow.began is not None else transfer.start
            sim.recorder.span("transfer", f"{src}->{who}", "transfer", v, began)
        # A cohort member (sim.cohorts) whose cohort already has its kick due this instant,
        # and that nothing waits on, reports into one run (a relay's 10^4 Actors: their reports
        # decided in one call); anything else is done one by one, after the run so far.
        run = sim.driver.together() if len(transfer.members) > 1 else None
        for member in transfer.members:
            node = self.node(member)
            if node.inbound.get(v) is not transfer or not node.live:
                continue
            cohort = getattr(node, "cohort", None)
            batched = (
                run is not None and cohort is not None and cohort.kick_due and not node.waiters
            )
            if run is not None and not batched:
                run.flush()
            del node.inbound[v]
            node.held.add(v)
            if sim.recorder.on:  # one message per receiver: 10^5 of them per version
                sim.recorder.log(member, f"received v{v} from {transfer.src}")
            for fn in node.waiters.pop(v, []):
                fn()
            if isinstance(node, ActorNode):
                if self.on_hold is not None:
                    self.on_hold(member)
                sim.actors.staged(node, v, run if batched else None)
        if run is not None:
            run.flush()

    # -- losing a source or a receiver --------------------------------------------------------

    def fall_back(self, action: FallBack) -> None:
        sim = self.sim
        actor = sim.actors.nodes[action.actor]
        actor.source = action.source
        sim.recorder.log(actor.id, f"fall back to {action.source} (lost {action.lost})")
        for v, transfer in sorted(actor.inbound.items()):
            if transfer.src != action.lost:
                continue
            assert transfer.flow is not None
            # Segments already verified are kept: only the rest is fetched again.
            left = transfer.flow.remaining
            self._leave_cohort(transfer, actor.id)
            del actor.inbound[v]
            self.send(v, action.source, [actor.id], size=left)
        # Forwards the lost source had scheduled but not started (or was holding back until it
        # had the whole version) are owed by the new source.
        latest = sim.ledger.latest
        if latest is not None and actor.active is not None:
            for v in range(actor.active + 1, latest + 1):
                if v not in actor.held and v not in actor.inbound:
                    self.send(v, action.source, [actor.id])

    def drop_node(self, node: Node) -> None:
        """``node`` is gone: stop everything it receives and sends."""
        node.live = False
        for transfer in list(node.inbound.values()):
            if node.id in transfer.members:
                self._leave_cohort(transfer, node.id)
        node.inbound.clear()
        node.waiters.clear()
        node.starters.clear()
        for transfer in self._outgoing.pop(node.id, {}).values():
            if transfer.flow is not None:
                self.net.cancel(transfer.flow)  # FallBack re-routes its receivers
