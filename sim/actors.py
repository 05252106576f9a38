"""Rollout Actors: each machine life is one SimPy process.

Theory of operation
-------------------
An Actor's life, from joining until it is lost or leaves, is the loop::

    at each safe point: ask aurora.policy.actor.next_action what to do
        Generate  run the head of the queue on the active version: tokens / (rate x noise x drift)
                  seconds; then report a result per lease and the batch's throughput
        Activate  apply the staged delta (bytes / apply rate); report the activation
        ApplyPlan load the snapshot and/or apply the chain of a catch-up plan; report it
        Drop      the work cannot run here (its leases expire back to the pool); ask again
        Wait      sleep until something arrives (work, a commit, a delta, a catch-up piece)

The Ledger's actions reach the Actor from outside (``Assign`` queues work, ``Commit`` records
the version to switch to, ``CatchUp`` starts fetching the plan's pieces from the Checkpoint
Store) and wake it if it is waiting. Deltas arrive through :mod:`sim.transfers`, which reports
them staged here. Losing the machine interrupts its process; a returning machine starts a new
life with nothing loaded. Spot Actors get a second process per life: the hazard that preempts
them after an exponential wait.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import numpy as np
import simpy
from simpy.events import URGENT

from aurora.faults import Fault
from aurora.policy import actor as actor_policy
from aurora.policy.actor import Activate, ApplyPlan, Decision, Drop, Generate, Wait
from aurora.policy.events import (
    ActorJoined,
    Assign,
    CaughtUp,
    Commit,
    ResultsArrived,
    ThroughputObserved,
    VersionActivated,
)
from aurora.policy.membership import TRAINER
from aurora.policy.versions import CatchUpPlan
from sim import fastpaths
from sim.cohorts import Cohort, Cohorts
from sim.network import Flow, Resource
from sim.nodes import ActorNode
from sim.trainer import weights_hash

if TYPE_CHECKING:  # pragma: no cover - typing only
    from sim.ledger_driver import ReportRun
    from sim.model import Simulation

GBPS = 1e9 / 8
"""Bytes/s in one Gbit/s."""


class Actors:
    """Every Actor machine of a run, and what they do."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.env = sim.env
        self.nodes: dict[str, ActorNode] = {}
        self._count = 0
        self.cohorts = Cohorts(self)

    # -- membership ---------------------------------------------------------------------------

    def join(
        self,
        actor_id: str,
        region: str,
        gpu: str,
        nic_gbps: float,
        spot: bool,
        active: int | None,
        cohort: Cohort | None = None,
    ) -> None:
        """A machine joins with version ``active`` loaded (None: nothing, it must catch up), as
        a member of ``cohort`` (:mod:`sim.cohorts`; its process is the cohort's) or alone."""
        sim = self.sim
        model = sim.cfg.topology.trainer.model
        trace = sim.cfg.traces.gpu(gpu, model)
        actor = self.nodes.get(actor_id)
        if actor is None:
            self._count += 1
            actor = ActorNode(
                id=actor_id,
                region=region,
                nic=Resource(f"nic:{actor_id}", nic_gbps * GBPS),
                nic_in=Resource(f"nic-in:{actor_id}", nic_gbps * GBPS, per_member=True),
                gpu=gpu,
                rate=trace.tokens_per_s[model].value,
                spot=spot,
                index=self._count,
                rng=sim.rng(2, self._count),
            )
            self.nodes[actor_id] = actor
        else:
            # A returning machine: fresh, with nothing loaded.
            actor.live, actor.draining = True, False
            actor.held, actor.inbound, actor.waiters, actor.starters = set(), {}, {}, {}
            actor.queue.clear()
            actor.pending_commit, actor.plan, actor.pulling = None, None, set()
        actor.active = active
        if active is not None:
            actor.held.add(active)
        actor.idle = None
        actor.life = life = object()
        if cohort is None:
            self.env.process(self._life(actor, life))
        else:
            actor.cohort = cohort
            cohort.members[actor] = None
        sim.recorder.log(
            actor_id, f"join on {'v' + str(active) if active is not None else 'nothing'}"
        )
        sim.driver.feed(ActorJoined(actor=actor_id, region=region, active=active))
        if spot and sim.cfg.spot_hazard_per_hour > 0:
            assert actor.rng is not None
            wait = float(actor.rng.exponential(3600.0 / sim.cfg.spot_hazard_per_hour))
            self.env.process(self._hazard(actor, life, wait, nic_gbps))

    def lose(self, actor: ActorNode) -> None:
        """The machine is gone: its life ends, whatever it was doing is lost (its process sees
        that it is no longer the machine's life when it next wakes, and stops)."""
        actor.life = None
        actor.idle = None
        if actor.cohort is not None:
            actor.cohort.leave(actor)
        actor.queue.clear()
        actor.plan, actor.pulling, actor.pending_commit = None, set(), None

    def _hazard(
        self, actor: ActorNode, life: object, wait: float, nic_gbps: float
    ) -> Generator[simpy.Event, Any, None]:
        """Spot preemption after ``wait`` seconds (exponential), unless this life ended first."""
        sim = self.sim
        cfg = sim.cfg
        yield self.env.timeout(wait)
        if actor.life is not life or not actor.live:
            return
        notice = cfg.spot_notice_s
        kind = "preempt" if notice is None else "preempt_notice"
        sim.faults.strike(Fault(kind=kind, target=actor.id, at_s=0.0, notice_s=notice or 0.0))
        if cfg.spot_return_s is not None:
            yield self.env.timeout(cfg.spot_return_s + (notice or 0.0))
            self.join(actor.id, actor.region, actor.gpu, nic_gbps, actor.spot, None)

    # -- what the Ledger tells an Actor ---------------------------------------------------------

    def assign(self, action: Assign) -> None:
        actor = self.nodes[action.actor]
        actor.queue.append(fastpaths.work(action.version, action.leases, action.expiry))
        rec = self.sim.recorder
        if rec.on:  # the message costs more than the rest of an assignment at 10^5 Actors
            rec.log(action.actor, f"assign {len(action.leases)} on v{action.version}")
        if actor.cohort is not None:
            self.cohorts.kick(actor)
        else:
            self.sim.later(0, lambda: self.kick(actor))

    def commit(self, action: Commit) -> None:
        actor = self.nodes[action.actor]
        actor.pending_commit = action.version
        rec = self.sim.recorder
        if rec.on:
            rec.log(action.actor, f"commit v{action.version}")
        if actor.cohort is not None:
            self.cohorts.kick(actor)
        else:
            self.sim.later(0, lambda: self.kick(actor))

    def decide(self, actor: ActorNode) -> Decision:
        """What ``actor`` does next, by :func:`aurora.policy.actor.next_action`."""
        return actor_policy.next_action(
            active=actor.active,
            staged=actor.held,
            snapshots=actor.held,
            queue=actor.queue,
            plan=actor.plan,
            pending_commit=actor.pending_commit,
            now=self.env.now,
            recent=actor.recent,
        )

    def kick(self, actor: ActorNode) -> None:
        """Something arrived: if ``actor`` waits at a safe point and now has something to do,
        it does it at this instant (its process resumes before anything else due now)."""
        if actor.cohort is not None:
            self.cohorts.kick(actor)
            return
        idle = actor.idle
        if idle is None or idle.triggered:
            return  # busy, gone, or already woken
        decision = self.decide(actor)
        if type(decision) is Wait:
            return
        idle._ok, idle._value = True, decision  # succeed(decision), but URGENT
        self.env.schedule(idle, URGENT)

    def staged(self, actor: ActorNode, v: int, run: ReportRun | None = None) -> None:
        """``actor`` holds version ``v`` whole (verified); its report goes into ``run`` if
        given (:class:`sim.ledger_driver.ReportRun`), else to the Ledger now."""
        if actor.active is not None and v > actor.active:
            if run is not None:
                run.staged(actor.id, v)
            else:
                driver = self.sim.driver
                driver.staged(actor.id, v)
                driver.no_longer_waited_for(actor.id)
        self.kick(actor)

    def catch_up(self, actor: ActorNode, plan: CatchUpPlan) -> None:
        """Fetch what ``plan`` still needs from the Checkpoint Store; apply it when held."""
        sim = self.sim
        actor.plan = plan
        sim.recorder.log(
            actor.id,
            f"catch up to v{plan.target}"
            + (f" from snapshot v{plan.snapshot}" if plan.snapshot is not None else "")
            + f" + {len(plan.deltas)} deltas",
        )
        in_flight = actor.pulling | actor.inbound.keys()
        snapshot, deltas = actor_policy.to_fetch(
            plan, staged=actor.held, snapshots=actor.held, in_flight=in_flight
        )
        wanted = list(deltas)
        size = sum(sim.bytes_of(v) for v in wanted)
        if snapshot is not None:
            size += sim.dense_bytes
            wanted.append(snapshot)
        if not wanted:
            self.kick(actor)
            return
        # Pull from the Checkpoint Store in the Trainer's region: a request round trip first,
        # on the Store's own connection, sharing the Actor's interface with what it receives
        # (store_local: from the Actor's own host, at its region's LAN rate).
        transfers = sim.transfers
        path: tuple[Resource, ...]
        if sim.cfg.store_local:
            cap = sim.cfg.topology.region(actor.region).lan_gbps * GBPS
            read = sim.consts.store_read_bytes_per_s
            path, cap, latency = (), cap if read is None else min(cap, read.value), 0.0
        else:
            path, cap, latency = transfers.path(TRAINER, actor)
        transfers.detach(actor)
        path += transfers.receiving(actor)
        actor.pulling.update(wanted)
        life = actor.life
        start = self.env.now

        def fetched(_f: Flow) -> None:
            if actor.life is not life:
                return
            actor.pulling.difference_update(wanted)
            actor.held.update(wanted)
            sim.recorder.span("transfer", f"store->{actor.id}", "catch-up", plan.target, start)
            self.kick(actor)

        sim.net.start(
            f"v{plan.target} store->{actor.id}",
            size,
            path,
            cap=cap,
            latency=3 * latency,
            bundle=("store", actor.id),
            on_done=fetched,
        )

    # -- a machine's life ---------------------------------------------------------------------

    def _life(
        self, actor: ActorNode, me: object, decision: Decision | None = None
    ) -> Generator[simpy.Event, Any, None]:
        """One machine life, from ``decision`` (None: it decides first)."""
        while actor.life is me:
            if decision is None:
                decision = self.decide(actor)
            kind = type(decision)
            if kind is Wait:
                # Until kick() finds something to do; it hands over what.
                actor.idle = idle = self.env.event()
                decision = yield idle
                if actor.idle is idle:
                    actor.idle = None
                continue
            if kind is Generate:
                actor.queue.popleft()
                work = decision.work  # type: ignore[union-attr]
                yield from self._generate(actor, me, work.version, work.leases)
            elif kind is Activate:
                yield from self._activate(actor, me, decision.version)  # type: ignore[union-attr]
            elif kind is ApplyPlan:
                yield from self._apply_plan(actor, me, decision.plan)  # type: ignore[union-attr]
            else:
                assert kind is Drop
                # Its leases will expire back to the pool, where others can take them.
                actor.queue.popleft()
                work = decision.work  # type: ignore[union-attr]
                self.sim.recorder.log(
                    actor.id, f"cannot run {len(work.leases)} leases on v{work.version}"
                )
            decision = None

    life = _life

    def generation_seconds(self, actor: ActorNode, leases: int) -> tuple[float, float]:
        """``(seconds, tokens)`` of generating ``leases`` leases starting now: the nominal rate
        times this generation's noise (one draw from the Actor's own generator) and drift."""
        sim = self.sim
        assert actor.rng is not None
        trace = sim.cfg.traces.gpus[actor.gpu]
        tokens = leases * sim.tokens_per_lease
        cv = trace.cv.value
        noise = 1.0
        if cv > 0:
            drawn = actor.noise
            if drawn:
                noise = drawn.pop()  # the next draw, made ahead (draw_noise)
            else:
                sigma = math.sqrt(math.log1p(cv * cv))
                noise = float(np.exp(actor.rng.normal(-sigma * sigma / 2, sigma)))
        drift = 1.0 + trace.drift_per_hour.value * self.env.now / 3600.0
        rate = actor.rate * noise * max(drift, 0.05)
        return tokens / rate, tokens

    def draw_noise(self, actor: ActorNode, count: int = 16) -> None:
        """Draw ``actor``'s next ``count`` throughput noises ahead, if it has none left
        (``ActorNode.noise``): one generator call and one ``np.exp`` for ``count`` generations
        instead of one each (~2 us). A generator's ``normal(size=n)`` gives the values of ``n``
        scalar calls, and ``np.exp`` of an array those of each element (one loop): the noises
        :meth:`generation_seconds` would draw one by one, in order; ``tests/test_sim_cohorts``
        checks the runs equal. Only for cohort members (exact mode draws as it always did)."""
        if actor.noise:
            return
        cv = self.sim.cfg.traces.gpus[actor.gpu].cv.value
        if cv > 0:
            assert actor.rng is not None
            sigma = math.sqrt(math.log1p(cv * cv))
            drawn = np.exp(actor.rng.normal(-sigma * sigma / 2, sigma, size=count))
            actor.noise = drawn[::-1].tolist()  # popped from the end: in drawing order

    def _generate(
        self, actor: ActorNode, me: object, version: int, leases: tuple[str, ...]
    ) -> Generator[simpy.Event, Any, None]:
        sim = self.sim
        seconds, tokens = self.generation_seconds(actor, len(leases))
        start = self.env.now
        yield self.env.timeout(seconds)
        if actor.life is not me:
            return  # lost while generating: the rollouts are gone
        actor.recent = ((len(leases), seconds),)
        sim.recorder.span("actor", actor.id, "generate", version, start)
        h = weights_hash(version)
        feed = sim.driver.feed
        # The whole assignment's results at this instant: one event, decided as one per lease.
        feed(ResultsArrived(actor=actor.id, leases=leases, version=version, weights_hash=h))
        if sim.cfg.strategy.proportional:
            feed(ThroughputObserved(actor=actor.id, tokens=max(1, round(tokens)), seconds=seconds))

    def _activate(self, actor: ActorNode, me: object, v: int) -> Generator[simpy.Event, Any, None]:
        sim = self.sim
        start = self.env.now
        # RDMA (Ideal-SingleDC) writes the broadcast straight into the engine's GPU memory.
        yield self.env.timeout(0.0 if sim.cfg.strategy.rdma else sim.bytes_of(v) / sim.apply_rate)
        if actor.life is not me:
            return
        actor.active = v
        if actor.pending_commit is not None and actor.pending_commit <= v:
            actor.pending_commit = None
        sim.recorder.span("actor", actor.id, "apply", v, start)
        sim.recorder.log(actor.id, f"activate v{v}")
        sim.driver.feed(VersionActivated(actor=actor.id, version=v))
        sim.driver.no_longer_waited_for(actor.id)

    def _apply_plan(
        self, actor: ActorNode, me: object, plan: CatchUpPlan
    ) -> Generator[simpy.Event, Any, None]:
        sim = self.sim
        seconds = sum(sim.bytes_of(v) for v in plan.deltas) / sim.apply_rate
        if plan.snapshot is not None:
            seconds += sim.dense_bytes / sim.consts.dense_load_bytes_per_s.value
        start = self.env.now
        yield self.env.timeout(seconds)
        if actor.life is not me:
            return
        actor.plan = None
        actor.active = plan.target
        actor.pending_commit = None
        keep, restage = actor_policy.after_catch_up(plan, queue=actor.queue, staged=actor.held)
        actor.queue = deque(keep)
        sim.recorder.span("actor", actor.id, "catch-up", plan.target, start)
        sim.recorder.log(actor.id, f"caught up to v{plan.target}")
        sim.driver.feed(CaughtUp(actor=actor.id, version=plan.target))
        # Versions that arrived during the catch-up are staged on top of it.
        for v in restage:
            if actor.life is me:
                sim.driver.staged(actor.id, v)
        sim.driver.no_longer_waited_for(actor.id)
