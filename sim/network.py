"""Fluid-flow network: max-min fair sharing of links among concurrent transfers.

Theory of operation
-------------------
A transfer is a *flow* of ``size`` bytes over a *path* of shared resources (the Trainer's
interface, a WAN path between two regions, a relay's interface). At any instant each flow has a
rate, and rates change only when a flow starts or ends or a link changes rate. Rates are max-min
fair (progressive filling): every flow gets the same share of a saturated resource unless it is
limited elsewhere, by another resource or by its own *cap* (S TCP streams' rate, :mod:`sim.tcp`,
and the receiver's interface). A flow may be capped by an *upstream* flow (cut-through relays,
the Trainer's extraction); identical flows form one *cohort* of multiplicity ``m``; flows of one
*bundle* (sender-receiver pair) run one after the other; each has a fixed *latency* added at the
end. Bytes carried are accounted per resource (``Resource.carried``). Invariant: a per-member
resource (a receiver's interface) is loaded by one member only, whatever the multiplicity."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import simpy

from sim.tcp import tcp_cap

__all__ = ["Flow", "Network", "Producer", "Resource", "tcp_cap"]

_EPS_BYTES = 1e-3
"""A flow with less than this many bytes left is complete (floating-point slack, bytes)."""


class Resource:
    """A shared link or interface with a (possibly changing) capacity in bytes/s."""

    __slots__ = ("name", "capacity", "flows", "carried", "per_member", "cut")

    def __init__(self, name: str, capacity: float, *, per_member: bool = False) -> None:
        if not capacity > 0:
            raise ValueError(f"resource {name!r}: capacity must be > 0 bytes/s, got {capacity!r}")
        self.name = name
        self.capacity = capacity
        self.per_member = per_member
        """One receiver's resource: a cohort flow loads it with one member's rate."""
        self.cut = 0
        """While > 0 (cuts in force), it carries nothing; ``capacity`` is kept for after."""
        self.flows: dict[Flow, None] = {}
        """Flows on this resource, in start order (a dict, so iteration is deterministic)."""
        self.carried = 0.0
        """Bytes carried so far (sum over flows and cohort members)."""

    def __repr__(self) -> str:
        return f"Resource({self.name!r}, {self.capacity:.4g} B/s)"


class Flow:
    """One transfer (or a cohort of ``mult`` identical ones)."""

    __slots__ = (
        "label",
        "size",
        "remaining",
        "rate",
        "cap",
        "path",
        "mult",
        "upstream",
        "latency",
        "on_done",
        "started",
        "finished",
        "active",
        "bundle",
        "queued",
        "on_begin",
        "weights",
        "began",
        "tail",
        "tail_s",
    )

    def __init__(
        self,
        label: str,
        size: float,
        path: tuple[Resource, ...],
        cap: float,
        mult: int,
        upstream: Flow | None,
        latency: float,
        on_done: Callable[[Flow], None],
        started: float,
    ) -> None:
        self.label = label
        self.size = size
        self.remaining = size
        self.rate = 0.0
        self.cap = cap
        self.path = path
        self.mult = mult
        self.upstream = upstream
        self.latency = latency
        self.on_done = on_done
        self.started = started
        self.finished: float | None = None
        self.active = True
        """Not yet finished or cancelled (queued flows are active)."""
        self.bundle: object | None = None
        """Connection bundle (sender-receiver pair) it is sent on, in FIFO order."""
        self.queued = False
        """Waiting behind earlier flows of its bundle: moves no bytes yet."""
        self.on_begin: list[Callable[[], None]] = []
        """Called (through the event queue) when it leaves the queue."""
        self.began: float | None = None
        """When it left its queue and started moving bytes (simulated s)."""
        self.weights: tuple[int, ...] = ()
        """Load per unit of rate on each resource of ``path`` (``mult``, or 1 per member)."""
        self.tail: Callable[[Flow], float] | None = None
        """Seconds its last byte is late beyond ``latency`` (loss recovery at the end of a
        flight: :func:`sim.tcp.tail_delay`), asked once when it completes; None: none."""
        self.tail_s = 0.0
        """What ``tail`` answered (s)."""
        self.set_weights()

    def set_weights(self) -> None:
        self.weights = tuple(1 if r.per_member else self.mult for r in self.path)

    def __repr__(self) -> str:
        return f"Flow({self.label!r}, {self.remaining:.4g}/{self.size:.4g} B, {self.rate:.4g} B/s)"


@dataclass(frozen=True, kw_only=True)
class Producer:
    """A source that makes bytes at a finite rate until ``until`` (the Trainer's extraction)."""

    rate: float
    """Bytes/s produced."""
    until: float
    """Simulated time (s) at which production ends."""


class Network:
    """All flows of one simulation, advanced by a SimPy environment.

    Flows are not simulated packet by packet. A flow's *cap* is what one TCP connection bundle
    can reach on its path, S times one stream's rate under the path's congestion control
    (:mod:`sim.tcp`: window-limited by the socket buffer, and loss-limited by reno's Mathis
    relation or CUBIC's response function; BBR is not), and the receiver's interface rate. So S
    parallel streams beat one stream on a lossy long-RTT path until the link itself saturates,
    as in the paper (§5.2: 4.71 s -> 2.90 s for 202 MB).

    A flow may have an *upstream* flow: a relay forwards segments as they arrive (cut-through),
    so the forward can never run ahead of what the relay has received. While the upstream flow
    is running, the forward's rate is capped by the upstream's rate; it starts one segment after
    the upstream (the first segment must arrive whole, since each is verified before it is
    forwarded). The Trainer's extraction is modelled the same way: a flow from the Trainer is
    capped at the rate at which extraction produces bytes until extraction ends.

    Identical flows (same path, cap, size, upstream, start) form one *cohort* with a
    multiplicity ``m`` (a relay forwarding to 1000 identical Actors): it takes ``m`` shares of
    each *shared* resource (a sender's interface, a WAN path) and finishes for all its members
    at once, which keeps 10^4 Actors cheap. A *per-member* resource (a receiver's interface) is
    one member's: a flow loads it with its per-member rate whatever its multiplicity. A member
    whose situation diverges (it gets a second flow at the same time) is split off into a flow
    of its own (:meth:`Network.split`), so per-member resources stay exact.

    TCP connections belong to a sender-receiver pair, not to a version: flows started with the
    same *bundle* key (the pair) are sent one after the other, in start order, as bytes queued
    on one connection bundle are. A queued flow moves nothing until the flows ahead of it end.

    Each flow also has a fixed *latency* (half an RTT of propagation on a push, a full RTT more
    on a pull) added between the last byte leaving and the receiver holding it.
    """

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self.flows: list[Flow] = []
        self._last = env.now
        self._token = 0
        self._producers: dict[int, Producer] = {}
        self._bundles: dict[object, list[Flow]] = {}
        """Flows of each connection bundle in start order; the first one is sending."""

    # -- public ------------------------------------------------------------------------------

    def start(
        self,
        label: str,
        size: float,
        path: tuple[Resource, ...],
        *,
        cap: float = math.inf,
        mult: int = 1,
        upstream: Flow | None = None,
        producer: Producer | None = None,
        latency: float = 0.0,
        bundle: object | None = None,
        tail: Callable[[Flow], float] | None = None,
        on_done: Callable[[Flow], None],
    ) -> Flow:
        """Start a flow now (or queue it behind the flows of its ``bundle``); ``on_done(flow)``
        runs when its last byte reaches the receiver (``latency`` after it leaves, plus what
        ``tail`` answers then)."""
        assert size >= 0 and mult >= 1 and latency >= 0 and cap > 0
        self._advance()
        flow = Flow(label, float(size), path, cap, mult, upstream, latency, on_done, self.env.now)
        flow.tail = tail
        if producer is not None and producer.until > self.env.now:
            self._producers[id(flow)] = producer
            # Re-rate when production ends: the cap lifts.
            self.env.timeout(producer.until - self.env.now).callbacks.append(self._on_change)
        flow.bundle = bundle
        if bundle is not None:
            queue = self._bundles.setdefault(bundle, [])
            queue.append(flow)
            if len(queue) > 1:
                flow.queued = True
                return flow
        self._begin(flow)
        self._reschedule()
        return flow

    def when_flowing(self, flow: Flow, fn: Callable[[], None]) -> None:
        """Call ``fn`` now if ``flow`` is moving bytes, else when it leaves its queue."""
        if flow.queued:
            flow.on_begin.append(fn)
        else:
            fn()

    def cancel(self, flow: Flow) -> None:
        """Stop a flow (its sender or receiver is gone); ``on_done`` is never called."""
        if not flow.active:
            return
        self._advance()
        self._remove(flow)
        self._reschedule()

    def set_mult(self, flow: Flow, mult: int) -> None:
        """A cohort lost or gave away members: it now carries ``mult`` copies."""
        assert mult >= 1
        if mult == flow.mult or not flow.active:
            return
        self._advance()
        flow.mult = mult
        flow.set_weights()
        if not flow.queued:
            self._reschedule()

    def split(
        self,
        flow: Flow,
        *,
        label: str,
        path: tuple[Resource, ...],
        cap: float,
        on_done: Callable[[Flow], None],
    ) -> Flow:
        """Take one member out of cohort ``flow`` into a flow of its own, with the same bytes
        left, upstream, producer, latency and place in the bundle order (it may use another
        ``path`` and ``cap``, e.g. its own interface instead of the cohort's cap)."""
        assert flow.active and flow.mult > 1
        self._advance()
        new = Flow(
            label, flow.size, path, cap, 1, flow.upstream, flow.latency, on_done, flow.started
        )
        new.remaining = flow.remaining
        new.tail = flow.tail
        prod = self._producers.get(id(flow))
        if prod is not None:
            self._producers[id(new)] = prod
        flow.mult -= 1
        flow.set_weights()
        if flow.queued:
            # Starts sending when the cohort does (it waits behind the same flows).
            new.queued = True
            flow.on_begin.append(lambda: self._begin_split(new))
            return new
        self._begin(new)
        self._reschedule()
        return new

    def _begin_split(self, flow: Flow) -> None:
        if flow.active and flow.queued:
            self._advance()
            self._begin(flow)
            self._reschedule()

    def set_capacity(self, res: Resource, capacity: float) -> None:
        if not capacity > 0:
            raise ValueError(f"resource {res.name!r}: capacity must be > 0, got {capacity!r}")
        self._advance()
        res.capacity = capacity
        self._reschedule()

    def set_cut(self, res: Resource, cut: bool) -> None:
        """Cut ``res`` (it carries nothing; flows on it stall) or lift one cut of it."""
        self._advance()
        res.cut += 1 if cut else -1
        assert res.cut >= 0
        self._reschedule()

    def settle(self) -> None:
        """Bring every flow's progress and byte counters up to ``env.now``."""
        self._advance()

    # -- internals ---------------------------------------------------------------------------

    def _on_change(self, _event: simpy.Event) -> None:
        self._advance()
        self._reschedule()

    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._last
        if dt > 0:
            for f in self.flows:
                moved = min(f.rate * dt, f.remaining)
                f.remaining -= moved
                for res, w in zip(f.path, f.weights, strict=True):
                    res.carried += moved * w
        self._last = now

    def _begin(self, flow: Flow) -> None:
        flow.queued = False
        flow.began = self.env.now
        self.flows.append(flow)
        for res in flow.path:
            res.flows[flow] = None
        if flow.on_begin:
            callbacks, flow.on_begin = flow.on_begin, []
            for fn in callbacks:
                # Through the event queue: it may start flows, not allowed mid-computation.
                # mypy cannot type a lambda with a default argument (which binds the current value)
                self.env.timeout(0).callbacks.append(lambda _e, fn=fn: fn())  # type: ignore[misc]

    def _remove(self, flow: Flow) -> None:
        flow.active = False
        self._producers.pop(id(flow), None)
        if flow.queued:
            flow.queued = False
            if flow.bundle is not None:
                self._bundles[flow.bundle].remove(flow)
            return
        self.flows.remove(flow)
        for res in flow.path:
            res.flows.pop(flow, None)
        if flow.bundle is not None:
            queue = self._bundles[flow.bundle]
            queue.remove(flow)
            if queue:
                self._begin(queue[0])  # the next flow on the connection starts sending
            else:
                del self._bundles[flow.bundle]

    def _caps(self) -> dict[Flow, float]:
        now = self.env.now
        caps = {}
        for f in self.flows:
            cap = f.cap
            prod = self._producers.get(id(f))
            if prod is not None and prod.until > now:
                cap = min(cap, prod.rate)
            caps[f] = cap
        return caps

    def _fill(self, caps: dict[Flow, float]) -> None:
        """Max-min fair rates by progressive filling, honouring per-flow caps."""
        unfrozen = set(self.flows)
        left: dict[Resource, float] = {}
        count: dict[Resource, int] = {}
        for f in self.flows:
            for res, w in zip(f.path, f.weights, strict=True):
                left.setdefault(res, 0.0 if res.cut else res.capacity)
                count[res] = count.get(res, 0) + w
        by_cap = sorted(self.flows, key=lambda f: (caps[f], f.started, f.label))
        i = 0
        while unfrozen:
            share, bottleneck = math.inf, None
            for res, n in count.items():
                if n > 0:
                    s = left[res] / n
                    if s < share:
                        share, bottleneck = s, res
            while i < len(by_cap) and by_cap[i] not in unfrozen:
                i += 1
            smallest = by_cap[i] if i < len(by_cap) else None
            if smallest is not None and caps[smallest] <= share:
                frozen = [smallest]
                rate = caps[smallest]
            else:
                assert bottleneck is not None
                frozen = [f for f in bottleneck.flows if f in unfrozen]
                rate = share
            for f in frozen:
                f.rate = max(rate, 0.0)
                unfrozen.discard(f)
                for res, w in zip(f.path, f.weights, strict=True):
                    left[res] -= rate * w
                    count[res] -= w

    def _reschedule(self) -> None:
        caps = self._caps()
        self._fill(caps)
        # Cut-through: a forward never outruns its upstream. Cap by the upstream's rate and
        # refill; two rounds settle a two-level tree (Trainer -> relay -> Actors).
        coupled = [f for f in self.flows if f.upstream is not None and f.upstream.active]
        if coupled:
            for _ in range(2):
                changed = False
                for f in coupled:
                    limit = f.upstream.rate  # type: ignore[union-attr]
                    if caps[f] > limit:
                        caps[f] = limit
                        changed = True
                if not changed:
                    break
                self._fill(caps)
        # Wake at the next completion.
        self._token += 1
        token = self._token
        done_now = [f for f in self.flows if f.remaining <= _EPS_BYTES]
        if done_now:
            self._complete(done_now)
            return
        soonest = math.inf
        for f in self.flows:
            if f.rate > 0:
                soonest = min(soonest, f.remaining / f.rate)
        if soonest < math.inf:
            ev = self.env.timeout(soonest)
            # mypy cannot type a lambda with a default argument (which binds the current value)
            ev.callbacks.append(lambda _e, t=token: self._wake(t))  # type: ignore[misc]

    def _wake(self, token: int) -> None:
        if token != self._token:
            return  # superseded by a later change
        self._advance()
        done = [f for f in self.flows if f.remaining <= max(_EPS_BYTES, f.size * 1e-12)]
        if not done:
            # Float slack: the soonest flow is a hair short; finish it.
            soonest = min((f for f in self.flows if f.rate > 0), key=lambda f: f.remaining / f.rate)
            soonest.remaining = 0.0
            done = [soonest]
        self._complete(done)

    def _complete(self, done: list[Flow]) -> None:
        now = self.env.now
        for f in done:
            self._remove(f)
            f.finished = now
        self._reschedule()
        for f in sorted(done, key=lambda f: (f.started, f.label)):
            # Always through the event queue (even at zero latency): ``on_done`` may start or
            # cancel flows, which must not happen inside a rate computation.
            if f.tail is not None:
                f.tail_s = f.tail(f)
            ev = self.env.timeout(f.latency + f.tail_s if f.tail_s else f.latency)
            # mypy cannot type a lambda with a default argument (which binds the current value)
            ev.callbacks.append(lambda _e, fl=f: fl.on_done(fl))  # type: ignore[misc]
