"""The Job Ledger's driver: reports events to the policy core
(:class:`aurora.policy.core.LedgerCore`: ``decide``, the pacer, staged reports) and hands each
returned action to the role that carries it out.

Theory of operation
-------------------
The simulator never decides who works on what, nor when a batch starts or is complete. Every
role reports what happened through :meth:`LedgerDriver.feed` (an Actor joined, staged a delta,
returned a result, a tick), which calls the core at ``env.now`` and routes its actions:
``Assign``/``Commit``/``CatchUp``/``Route`` to :mod:`sim.actors`, ``Fanout``/``FallBack`` to
:mod:`sim.transfers`, ``BatchCompleted`` to the Trainer, the rest to the recorder. Each fed
event and its actions are kept (``fed``, ``decisions``) when the run records its trace, so a
test can replay the run through the core alone (the policy-parity test).

:meth:`LedgerDriver.poll` asks the core's pacer whether to request the next batch; it is called
whenever something the pacer's condition reads changes (a batch completes, a version is
published, an Actor the ready batch waits for stages, activates, catches up or goes away) and
when a timer the pacer asked for fires. Scheduled faults ``@step=N`` strike right after batch
``N`` is handed out, so a lost Actor loses the leases it just got. Lease expiries need a
``Tick`` just after them (:class:`aurora.policy.timers.TickTimers`).

An Actor that finishes an assignment reports all its results at that instant as one
``ResultsArrived``, which ``decide`` settles exactly as one ``ResultArrived`` per lease (the
actions are theirs, concatenated; ``tests/test_results_batch.py``): one event and one ``decide``
call per assignment instead of per prompt. Where results are separate messages (under
``control_latency`` each queues on its region's uplink; while a link is cut each is held), and
when the run records its trace (kept in the runtime log's vocabulary), it is fed as one
``ResultArrived`` per lease instead.

With ``SimConfig.control_latency`` every message between the Ledger (in the Trainer's region)
and an Actor in another region takes the one-way delay of the link between them (half its RTT):
the Actors' reports (results, staged, activated, caught up, throughput) reach ``decide`` that
much later, and its leases, commits and catch-up plans reach the Actor that much later. That is
how the runtime's control plane works (one TCP connection per Actor to the Ledger, across the
WAN); a message still in flight when its Actor's life ends is lost with it. A region's reports
leave in order over its link at the link's rate, each result taking ``result_bytes`` of it (the
trace's; none without it), so a step's results arrive one after another. The link's delta
traffic flows the other way (full duplex) and is not charged for them. Joins and losses are
not delayed (a join is followed by a catch-up of seconds; a loss is learnt when it is learnt).

With ``SimConfig.loss_recovery`` as well, each such message on a lossy link is lost with the
link's probability and recovered as TCP recovers a lone packet (:func:`sim.tcp.message_delay`:
the tail-loss probe, then RTOs); the messages behind it on its Actor's connection wait for it
(TCP delivers in order), each direction its own connection.

While a ``link_cut`` separates a region from the Trainer's (:mod:`sim.faults`), messages between
the Ledger and that region's Actors are held here and delivered, in order, when it is restored:
the Actors' reports are then judged at their arrival time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aurora.faults import Fault
from aurora.policy.core import LedgerCore
from aurora.policy.events import (
    Accepted,
    Action,
    ActorLeft,
    ActorLost,
    Assign,
    BatchCompleted,
    CatchUp,
    CaughtUp,
    Commit,
    DeltaStaged,
    Event,
    Exclude,
    FallBack,
    Fanout,
    RelayAssigned,
    ResultArrived,
    ResultsArrived,
    Route,
    ThroughputObserved,
    Tick,
    VersionActivated,
)
from aurora.policy.ledger import LedgerConfig
from aurora.policy.pacer import PacerConfig, WakeAt
from aurora.policy.timers import TickTimers
from sim import fastpaths
from sim.tcp import message_delay

if TYPE_CHECKING:  # pragma: no cover - typing only
    from sim.model import Simulation

_TICK_SLACK_S = 1e-6
"""A lease is expired strictly after its expiry; tick this long after it (s)."""
_TO_ACTORS = (Assign, Commit, CatchUp, Route, FallBack)
"""Actions that are messages to an Actor (held while its region is cut off)."""
_GONE = (ActorLeft, ActorLost)
"""Events the Ledger learns whatever the network (a lost Actor stops heartbeating): what that
Actor's region still held for or from it is dropped."""
_REPORTS = (ResultArrived, DeltaStaged, VersionActivated, CaughtUp, ThroughputObserved)
"""An Actor's messages that cross the WAN to the Ledger (``control_latency``)."""
_STATE_REPORTS = (DeltaStaged, VersionActivated, CaughtUp)
"""Reports a batch waiting on the Actor's staging may start on."""
_SENT = (Assign, Commit, CatchUp)
"""The Ledger's messages that cross the WAN to an Actor (``control_latency``)."""


class LedgerDriver:
    """Feeds events to the policy core and carries out its actions."""

    def __init__(self, sim: Simulation) -> None:
        cfg = sim.cfg
        self.sim = sim
        self.env = sim.env
        self.core = LedgerCore(
            LedgerConfig(
                trainer_region=cfg.topology.trainer.region,
                lease=cfg.lease,
                max_lag=cfg.strategy.max_lag,
                relays=cfg.strategy.relays,
            ),
            PacerConfig(
                steps=cfg.steps,
                prompts_per_batch=sim.prompts_per_batch,
                staging_grace_s=cfg.strategy.staging_grace_s,
                prompt_prefix="s",
            ),
        )
        self.state = self.core.state
        assert self.core.pacer is not None
        self.pacer = self.core.pacer
        self.faults_at_step: dict[int, list[Fault]] = {}
        self.record = cfg.record_trace
        """Keep every fed event and its actions (the parity test replays them); 10^5 Actors
        feed 10^7 events, so big runs do not."""
        self.fed: list[tuple[float, Event]] = []
        self.decisions: list[list[Action]] = []
        self._ticks = TickTimers(_TICK_SLACK_S)
        self._held: dict[str, tuple[list[Action], list[Event]]] = {}
        """Per region cut off from the Ledger: actions to its Actors, and their reports."""
        self._one_way: dict[str, float] = {}
        """Per region: seconds a control message takes between it and the Ledger."""
        self._uplink_free: dict[str, float] = {}
        """Per region: when its link to the Ledger has sent the reports queued on it (s)."""
        rb = sim.consts.result_bytes
        self._result_bytes = 0.0 if rb is None else rb.value
        self._lossy: dict[str, tuple[float, float]] = {}
        """Per region whose link to the Ledger loses packets (``loss_recovery``): (loss, RTT s)."""
        self._delivered: dict[tuple[str, bool], float] = {}
        """Per Actor and direction (True: to the Ledger): when its connection last delivered a
        message (s); a later one cannot overtake it."""
        self._loss_rng = sim.rng(8) if cfg.loss_recovery else None
        topo = cfg.topology
        if cfg.control_latency and not cfg.strategy.rdma:
            for region in topo.regions:
                link = topo.link(topo.trainer.region, region.name)
                if link is not None and region.name != topo.trainer.region:
                    self._one_way[region.name] = link.rtt_ms / 2e3
                    if cfg.loss_recovery and link.loss > 0:
                        self._lossy[region.name] = (link.loss, link.rtt_ms / 1e3)

    def _latency(self, actor: str) -> tuple[float, object | None]:
        """The one-way control delay to ``actor`` (s) and its current life."""
        node = self.sim.actors.nodes.get(actor)
        if node is None:
            return 0.0, None
        return self._one_way.get(node.region, 0.0), node.life

    def _sent_latency(self, actor: str) -> tuple[float, object | None]:
        """:meth:`_latency` of a message from the Ledger to ``actor``, with its loss recovery."""
        delay, life = self._latency(actor)
        if self._lossy and delay > 0:
            delay = self._recovered(actor, self.sim.actors.nodes[actor].region, delay, up=False)
        return delay, life

    def _recovered(self, actor: str, region: str, delay: float, *, up: bool) -> float:
        """``delay`` (s from now) of a message on ``actor``'s connection, plus its loss
        recovery on a lossy link, and no earlier than the message before it on the same
        connection (in-order delivery)."""
        lossy = self._lossy.get(region)
        if lossy is None:
            return delay
        assert self._loss_rng is not None
        now = self.env.now
        at = now + delay + message_delay(self._loss_rng, loss=lossy[0], rtt_s=lossy[1])
        key = (actor, up)
        at = max(at, self._delivered.get(key, at))
        self._delivered[key] = at
        return at - now

    def _report_delay(self, actor: str, size: float) -> tuple[float, object | None]:
        """Seconds until a report of ``size`` bytes from ``actor`` reaches the Ledger: behind
        what its region's link is still sending, then its own bytes, then the latency."""
        delay, life = self._latency(actor)
        if delay <= 0:
            return delay, life
        node = self.sim.actors.nodes[actor]
        now = self.env.now
        start = max(now, self._uplink_free.get(node.region, now))
        if size > 0:
            topo = self.sim.cfg.topology
            wan = self.sim.transfers.wan[frozenset((topo.trainer.region, node.region))]
            start += size / wan.capacity
        self._uplink_free[node.region] = start
        if self._lossy:
            return self._recovered(actor, node.region, start - now + delay, up=True), life
        return start - now + delay, life

    # -- the pacer ------------------------------------------------------------------------------

    def poll(self) -> None:
        """Ask the pacer whether to request the next batch now; request it, or set its timer."""
        sim = self.sim
        now = self.env.now
        got = self.core.poll(now)
        if got is None:
            return
        if isinstance(got, WakeAt):

            def wake() -> None:
                self.pacer.woke(got)
                self.poll()

            sim.later(got.at - now, wake)
            return
        k = self.pacer.next_batch
        sim.recorder.log("trainer", f"request batch {k} on v{got.version}")
        self.feed(got)
        # Step faults strike once the batch is handed out, so a lost Actor loses its leases.
        for fault in self.faults_at_step.pop(k, []):
            sim.faults.strike(fault)

    def no_longer_waited_for(self, actor: str) -> None:
        """``actor`` staged, activated or caught up: a batch waiting for it may start now."""
        if self.pacer.unblocked(actor):
            self.poll()

    def actor_gone(self, actor: str) -> None:
        if self.pacer.left(actor):
            self.poll()

    def _alive(self, actor: str, life: object | None) -> bool:
        node = self.sim.actors.nodes.get(actor)
        return node is not None and node.life is life

    def staged(self, actor: str, v: int) -> None:
        """``actor`` holds ``v`` whole: report it, or keep it until ``v`` is announced (when
        the report reaches the Ledger)."""
        delay, life = self._report_delay(actor, 0.0) if self._one_way else (0.0, None)
        if delay > 0:

            def arrive() -> None:
                if self._alive(actor, life):
                    self._staged_now(actor, v)
                    self.no_longer_waited_for(actor)

            self.sim.later(delay, arrive)
        else:
            self._staged_now(actor, v)

    def _staged_now(self, actor: str, v: int) -> None:
        event = self.core.staged(actor, v)
        if event is not None:
            # The report has crossed the link already (``staged`` charged its delay).
            self.feed(event, arrived=True)

    def together(self) -> ReportRun | None:
        """A run for Actors' reports at this instant (:class:`ReportRun`), or None when they
        must go through :meth:`feed` one at a time: each crosses the WAN
        (``control_latency``), or may be held (a region cut off from the Ledger)."""
        if self._one_way or self._held or self.sim.faults.cut_off:
            return None
        return ReportRun(self)

    def _feed_run(self, events: list[DeltaStaged | VersionActivated]) -> None:
        """Decide ``events`` (staged and activated reports at this instant, none held or
        delayed) one after another (:func:`sim.fastpaths.decide_reports`), then carry out
        their actions."""
        now = self.env.now
        decided = fastpaths.decide_reports(self.core, events, now=now)
        for event, actions in zip(events, decided, strict=True):
            self._carry_out(now, event, actions)

    def published(self, v: int) -> None:
        """``v`` was just announced: report the Actors that staged it before (the core keeps
        them)."""
        for event in self.core.early(v):
            # Reports the Ledger received before the announcement: they crossed the link
            # when they were made, so they take effect now, with no second crossing.
            self.feed(event, arrived=True)
            self.no_longer_waited_for(event.actor)

    def _cut_off(self, actor: str) -> str | None:
        """The region of ``actor`` if the Ledger cannot reach it now, else None."""
        cut = self.sim.faults.cut_off
        if not cut:
            return None
        node = self.sim.actors.nodes.get(actor)
        return node.region if node is not None and node.region in cut else None

    def _forget(self, actor: str) -> None:
        for actions, events in self._held.values():
            actions[:] = [a for a in actions if getattr(a, "actor", None) != actor]
            events[:] = [e for e in events if getattr(e, "actor", None) != actor]

    def reconnected(self, region: str) -> None:
        """``region`` can reach the Ledger again: deliver what waited, in order."""
        actions, events = self._held.pop(region, ([], []))
        for action in actions:
            if isinstance(action, FallBack):
                self.sim.transfers.fall_back(action)
            else:
                self._do(action)
        for event in events:
            self.feed(event)

    def feed(self, event: Event, *, arrived: bool = False) -> None:
        """Report ``event`` to the Ledger at ``env.now`` (an Actor's report: when it arrives,
        unless ``arrived``) and carry out its decisions."""
        if type(event) is ResultsArrived and (
            self.record or self._one_way or self._held or self.sim.faults.cut_off
        ):
            # One event per lease, as the runtime's Actors send them: each result is its own
            # message on the WAN (it queues on the uplink, it is held while its region is cut
            # off), and a recorded trace lists them as the runtime's log does. Decided the same
            # either way (``ResultsArrived`` is its results' ``ResultArrived``s, concatenated).
            for lease in event.leases:
                self.feed(
                    ResultArrived(
                        actor=event.actor,
                        lease=lease,
                        version=event.version,
                        weights_hash=event.weights_hash,
                    ),
                    arrived=arrived,
                )
            return
        if self._one_way and not arrived and isinstance(event, _REPORTS):
            actor = event.actor
            size = self._result_bytes if isinstance(event, ResultArrived) else 0.0
            delay, life = self._report_delay(actor, size)
            if delay > 0:

                def arrive() -> None:
                    if self._alive(actor, life):
                        self.feed(event, arrived=True)
                        if isinstance(event, _STATE_REPORTS):
                            self.no_longer_waited_for(actor)

                self.sim.later(delay, arrive)
                return
        if self._held or self.sim.faults.cut_off:
            kind = type(event)
            if kind in _GONE:
                # Whatever the machine had not yet got through is lost with it.
                self._forget(event.actor)  # type: ignore[union-attr]
            elif kind is not Tick:
                region = self._cut_off(getattr(event, "actor", ""))
                if region is not None:
                    self._held.setdefault(region, ([], []))[1].append(event)
                    return
        now = self.env.now
        if type(event) is ResultsArrived:  # (split above when recorded, held or delayed)
            actions = fastpaths.feed_results(self.core, event, now=now)
        else:
            actions = self.core.feed(event, now=now)
        self._carry_out(now, event, actions)

    def direct(self) -> bool:
        """True when an Actor's report can be decided at once (:meth:`report_next`): nothing
        can delay, hold, record or split it."""
        return not (self.record or self._one_way or self._held or self.sim.faults.cut_off)

    def report_next(self, event: Event, now: float, direct: bool) -> bool:
        """An Actor's report at ``now``, one of many (a cohort's results), ``direct`` being
        :meth:`direct` as the last one left it; returns it for the next. Not direct, it is
        :meth:`feed`'s, with its checks; decided at once, its actions are
        carried out only when one is not an ``Accepted`` (:meth:`_carry_out` does nothing for
        those with ``record`` off), and only then can :meth:`direct` change: a cohort's 10^5
        results are decided without a check or a call each."""
        if not direct:
            self.feed(event)
            return self.direct()
        if type(event) is ResultsArrived:
            actions = fastpaths.feed_results(self.core, event, now=now)
        else:
            actions = self.core.feed(event, now=now)
        for action in actions:
            if type(action) is not Accepted:
                self._carry_out(now, event, actions)
                return self.direct()
        return True

    def _carry_out(self, now: float, event: Event, actions: list[Action]) -> None:
        """``event`` was decided at ``now`` into ``actions``: record them, carry them out."""
        if self.record:
            self.fed.append((now, event))
            self.decisions.append(actions)
        if not actions:
            return
        sim = self.sim
        fallbacks: list[FallBack] = []
        # Assign and Commit straight to the Actors when nothing holds or delays messages (what
        # _do would do then): a batch's dispatch is one of each per Actor, 10^5 of them.
        direct = not (self._one_way or sim.faults.cut_off)
        actors = sim.actors
        for action in actions:
            kind = type(action)
            if kind is Accepted:  # the common case: the core counted it toward its batch
                continue
            if direct and kind is Assign:
                actors.assign(action)  # type: ignore[arg-type]
                self._schedule_tick(action.expiry)  # type: ignore[union-attr]
            elif direct and kind is Commit:
                actors.commit(action)  # type: ignore[arg-type]
            elif kind is BatchCompleted:
                sim.recorder.log("trainer", f"batch {action.batch} complete")  # type: ignore[union-attr]
                sim.trainer.batch_ready()
                sim.later(0, self.poll)
            elif kind is FallBack:
                fallbacks.append(action)  # type: ignore[arg-type]
            else:
                self._do(action)
        # A new relay's own fallback (to the Trainer) first, so that its region can follow it.
        fallbacks.sort(key=lambda a: a.source in sim.actors.nodes)
        for action in fallbacks:
            if not self._hold(action):
                sim.transfers.fall_back(action)

    def _hold(self, action: Action) -> bool:
        """Keep an action for an Actor the Ledger cannot reach now; True if kept."""
        if not self.sim.faults.cut_off or not isinstance(action, _TO_ACTORS):
            return False
        region = self._cut_off(action.actor)
        if region is None:
            return False
        self._held.setdefault(region, ([], []))[0].append(action)
        return True

    def _do(self, action: Action, *, arrived: bool = False) -> None:
        sim, rec = self.sim, self.sim.recorder
        if not arrived and self._hold(action):
            if isinstance(action, Assign):
                self._schedule_tick(action.expiry)  # the Ledger's clock runs on
            return
        if self._one_way and not arrived and isinstance(action, _SENT):
            actor = action.actor
            delay, life = self._sent_latency(actor)
            if delay > 0:
                if isinstance(action, Assign):
                    self._schedule_tick(action.expiry)  # the Ledger's clock runs on

                def arrive() -> None:
                    if self._alive(actor, life):
                        self._do(action, arrived=True)

                sim.later(delay, arrive)
                return
        if isinstance(action, Assign):
            sim.actors.assign(action)
            if not arrived:
                self._schedule_tick(action.expiry)
        elif isinstance(action, Commit):
            sim.actors.commit(action)
        elif isinstance(action, Exclude):
            rec.log(action.actor, f"excluded from v{action.version} (on v{action.active})")
            rec.excluded.setdefault(self.pacer.requesting, []).append(action.actor)
        elif isinstance(action, CatchUp):
            sim.actors.catch_up(sim.actors.nodes[action.actor], action.plan)
        elif isinstance(action, Route):
            sim.actors.nodes[action.actor].source = action.source
        elif isinstance(action, RelayAssigned):
            rec.log(action.region, f"relay is {action.relay}")
        elif isinstance(action, Fanout):
            sim.transfers.fanout(action.version, action.edges)
        else:
            name = type(action).__name__
            if name == "Expired":
                rec.expired += 1
            elif name == "Refused":
                rec.refused += 1
            rec.log(getattr(action, "actor", ""), f"{name.lower()} {getattr(action, 'lease', '')}")

    def _schedule_tick(self, expiry: float) -> None:
        delay = self._ticks.arm(expiry, self.env.now)
        if delay is None:
            return

        def tick() -> None:
            self._ticks.fired(expiry)
            self.feed(Tick())

        self.sim.later(delay, tick)


class ReportRun:
    """Reports of many Actors at one instant (a cohort staging or activating a version,
    :mod:`sim.cohorts`), decided together, in order, before any of their actions is carried
    out (:func:`sim.fastpaths.decide_reports`: as :meth:`~aurora.policy.core.LedgerCore.feed`
    decides each).

    Each report is added where the one-by-one driver would feed it, followed, as there, by the
    pacer's ``unblocked``; when that asks for a poll, the run is decided first and the poll
    made, so requests (and the faults that strike with them) fall between the same reports as
    one by one. What a caller does between two adds must read and change none of the Ledger's
    state nor depend on the actions of the reports before (its own Actor's fields are fine:
    decided reports only queue work and commits); anything else is preceded by :meth:`flush`.
    """

    def __init__(self, driver: LedgerDriver) -> None:
        self.driver = driver
        self.run: list[DeltaStaged | VersionActivated] = []
        self._unblocked = driver.pacer.unblocked

    def staged(self, actor: str, v: int) -> None:
        """As :meth:`LedgerDriver.staged` then :meth:`LedgerDriver.no_longer_waited_for`."""
        event = self.driver.core.staged(actor, v)
        if event is not None:
            self.run.append(event)
        self._unblock(actor)

    def activated(self, actor: str, v: int) -> None:
        """As feeding ``VersionActivated`` then :meth:`LedgerDriver.no_longer_waited_for`."""
        self.run.append(fastpaths.version_activated(actor, v))
        self._unblock(actor)

    def _unblock(self, actor: str) -> None:
        if self._unblocked(actor):
            self.flush()
            self.driver.poll()

    def flush(self) -> None:
        """Decide the reports added so far."""
        if self.run:
            run, self.run = self.run, []
            self.driver._feed_run(run)
