"""Cohorts: Actors with identical inputs driven by one SimPy process (``SimConfig.cohorts``).

Theory of operation
-------------------
In exact mode (:mod:`sim.actors`) every Actor machine is its own SimPy process: at 10^4-10^5
Actors the run is dominated by per-Actor SimPy events (a kick scheduled per ``Assign`` and per
``Commit``, the wake of the waiting process, a timeout per generation and per activation: ~4.8
events per Actor per step). The Actors of one group of the topology that join together (same
region, GPU, interface, not spot, named by no fault) receive the same deltas through the same
fan-out (:mod:`sim.transfers` already moves a version to such receivers as one transfer), the
same ``Commit`` at the same instant and one lease each from the same ``BatchRequested``: they
step in lockstep. A :class:`Cohort` runs them as one process:

* a safe point asks :func:`aurora.policy.actor.next_action` for every member not generating;
  the members whose decision is the cohort's (the largest group of equal decisions: ``Wait``,
  ``Generate`` on one version, ``Activate`` one version) carry it out together, every other
  member is **split out** for good into an exact process of its own, starting with the
  decision it got (a catch-up, a drop, another version: it continues exactly as in exact mode);
* ``Activate``: one timeout for all (the apply time depends on the version only), then each
  member's ``VersionActivated`` in member order;
* ``Generate``: each member still draws its own throughput noise from its own generator (the
  same draws as in exact mode); each distinct finish time is one pending finish, taken in the
  order one timeout scheduled at the start of the generation would fire
  (:class:`sim.finishes.FinishQueue`: only the cohorts' next finish waits in SimPy's queue),
  which feeds that time's members' ``ResultsArrived`` (one each), so the policy core sees the
  events it sees in exact mode, at the same times. A member that
  finishes and finds more work generates again inside the cohort (its exact process would);
  one that finds nothing waits at its safe point, and a kick that gives it work starts it;
* kicks (``Assign``, ``Commit``, a staged delta) of members are merged into one per instant.

What differs from exact mode is only the order of events at one instant (the members' kicks
and activations are handled together instead of interleaved with other same-instant events):
every decision is the same, made at the same simulated time (``tests/test_sim_cohorts.py``
compares the events fed and the actions returned per instant; docs/SIMULATOR.md).

A member that is lost leaves its cohort (:meth:`sim.actors.Actors.lose`); a machine that comes
back is a fresh exact process.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import simpy
from simpy.events import URGENT

from aurora.policy.actor import Activate, Decision, Generate, Wait, Work
from aurora.policy.events import VersionActivated
from sim import fastpaths
from sim.finishes import FinishQueue
from sim.nodes import ActorNode
from sim.trainer import weights_hash

if TYPE_CHECKING:  # pragma: no cover - typing only
    from sim.actors import Actors


class Cohort:
    """Members of one topology group stepping in lockstep (module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.members: dict[ActorNode, None] = {}
        """Members still in the cohort, in join order (an ordered set)."""
        self.idle: simpy.Event | None = None
        """While every member waits at a safe point: the event that wakes the cohort."""
        self.waiting: dict[ActorNode, None] = {}
        """Members that finished generating while others still generate (at a safe point)."""
        self.kick_due = False
        """A merged kick is scheduled for this instant."""
        self.generating: set[ActorNode] = set()
        """Members generating now (not at a safe point: nothing is decided for them)."""
        self.generated: simpy.Event | None = None
        """Succeeds when the last of them has finished (the phase ends)."""

    def leave(self, actor: ActorNode) -> None:
        """``actor`` is lost or split out (if it was generating, the phase stops counting it
        when its timeout fires and finds it gone)."""
        self.members.pop(actor, None)
        self.waiting.pop(actor, None)
        self.generating.discard(actor)
        actor.cohort = None


def _key(decision: Decision) -> tuple[Any, ...]:
    """Decisions the members can carry out together compare equal."""
    kind = type(decision)
    if kind is Generate:
        return (Generate, decision.work.version)  # type: ignore[union-attr]
    if kind is Activate:
        return (Activate, decision.version)  # type: ignore[union-attr]
    if kind is Wait:
        return (Wait,)
    return (kind, id(decision))  # ApplyPlan, Drop: never together


class Cohorts:
    """The cohort processes of a run (owned by :class:`sim.actors.Actors`)."""

    def __init__(self, actors: Actors) -> None:
        self.actors = actors
        self.sim = actors.sim
        self.env = actors.env
        self.splits = 0
        """Members split out of their cohort so far (each continues as an exact process)."""
        self.finishes = FinishQueue(self.env, self._finished)
        """When each generation under way in any cohort ends (a lane per cohort): one queue for
        all cohorts, so that finishes of different cohorts, interleaved in time, are reported
        one after another in one callback (with a queue per cohort, 9 in 10 of them at 10^4
        Actors waited in SimPy's queue behind another cohort's)."""

    def start(self, cohort: Cohort) -> None:
        self.env.process(self._life(cohort))

    def split(self, cohort: Cohort, actor: ActorNode, decision: Decision | None) -> None:
        """``actor`` continues alone, exactly, from ``decision`` (None: it decides)."""
        cohort.leave(actor)
        self.splits += 1
        self.env.process(self.actors.life(actor, actor.life, decision))

    def kick(self, actor: ActorNode) -> None:
        """Something arrived for member ``actor``: one merged kick of its cohort per instant."""
        cohort = actor.cohort
        assert cohort is not None
        if not cohort.kick_due:
            cohort.kick_due = True
            self.sim.later(0, lambda: self._kick(cohort))

    def _kick(self, cohort: Cohort) -> None:
        cohort.kick_due = False
        decide = self.actors.decide
        for actor in list(cohort.waiting):
            decision = decide(actor)
            kind = type(decision)
            if kind is Generate:
                del cohort.waiting[actor]
                self._start(cohort, actor, decision.work)  # type: ignore[union-attr]
            elif kind is not Wait:
                self.split(cohort, actor, decision)
        idle = cohort.idle
        if idle is None or idle.triggered:
            return
        idle._ok, idle._value = True, None  # succeed(), but URGENT
        self.env.schedule(idle, URGENT)

    def _life(self, cohort: Cohort) -> Generator[simpy.Event, Any, None]:
        decide = self.actors.decide
        all_wait = False
        key: tuple[Any, ...]
        chosen: list[tuple[ActorNode, Decision]]
        while cohort.members:
            if all_wait:
                # After a generation every member left decided Wait when it finished, and a
                # kick since re-decided those it reached: nothing to ask again.
                all_wait = False
                key, chosen = (Wait,), []
            else:
                groups: dict[tuple[Any, ...], list[tuple[ActorNode, Decision]]] = {}
                busy = cohort.generating
                # The members usually all decide alike: compare each decision with the last
                # one's key first (by kind and version, as _key), grouping only on a change.
                last_key: tuple[Any, ...] = ()
                last: list[tuple[ActorNode, Decision]] = []
                last_kind: Any = None
                last_v: Any = None
                for actor in cohort.members:
                    if busy and actor in busy:
                        continue  # a member started again at this instant, after the phase
                    decision = decide(actor)
                    kind = type(decision)
                    if kind is last_kind and (
                        (kind is Generate and decision.work.version == last_v)  # type: ignore[union-attr]
                        or (kind is Activate and decision.version == last_v)  # type: ignore[union-attr]
                        or kind is Wait
                    ):
                        last.append((actor, decision))
                        continue
                    last_key = _key(decision)
                    last = groups.setdefault(last_key, [])
                    last.append((actor, decision))
                    last_kind = kind if kind in (Generate, Activate, Wait) else None
                    last_v = last_key[1] if len(last_key) > 1 else None
                key, chosen = max(groups.items(), key=lambda kv: len(kv[1]), default=((Wait,), []))
                cohort.waiting.clear()  # every member at a safe point was just decided for
                if len(groups) > 1:
                    for other, rest in groups.items():
                        if other is not key:
                            for actor, decision in rest:
                                self.split(cohort, actor, decision)
            kind = key[0]
            if kind is Wait:
                cohort.idle = idle = self.env.event()
                yield idle
                cohort.idle = None
            elif kind is Generate:
                yield from self._generate(cohort, chosen)
                all_wait = True
            elif kind is Activate:
                yield from self._activate(cohort, [a for a, _ in chosen], key[1])
            else:  # ApplyPlan or Drop: never done together; each member goes on alone
                for actor, decision in chosen:
                    self.split(cohort, actor, decision)

    def _generate(
        self, cohort: Cohort, chosen: list[tuple[ActorNode, Decision]]
    ) -> Generator[simpy.Event, Any, None]:
        """A generation phase: every chosen member generates its own work for its own time;
        one that finishes and finds more work generates again within the phase (as its exact
        process would), one that finds other work is split out. Ends when none generates."""
        by_seconds: dict[float, list[tuple[ActorNode, Work, float]]] = {}
        actors = self.actors
        for actor, decision in chosen:
            actor.queue.popleft()
            work = decision.work  # type: ignore[union-attr]
            if not actor.noise:
                actors.draw_noise(actor)
            seconds, tokens = actors.generation_seconds(actor, len(work.leases))
            by_seconds.setdefault(seconds, []).append((actor, work, tokens))
        # One pending finish per distinct finish time, in the order (time, event id) exact
        # mode's timeouts would have, made now (so it lands at start + seconds bit for bit):
        # its members are reported at that time, and no process resumes per member.
        self._schedule(cohort, [(by_seconds[seconds], seconds) for seconds in sorted(by_seconds)])
        while cohort.generating:
            cohort.generated = done = self.env.event()
            yield done
        cohort.generated = None
        cohort.waiting.clear()

    def _start(self, cohort: Cohort, actor: ActorNode, work: Work) -> None:
        """``actor``, a member at a safe point, generates ``work`` now, within the phase."""
        actor.queue.popleft()
        if not actor.noise:
            self.actors.draw_noise(actor)
        seconds, tokens = self.actors.generation_seconds(actor, len(work.leases))
        self._schedule(cohort, [([(actor, work, tokens)], seconds)])

    def _schedule(
        self, cohort: Cohort, groups: list[tuple[list[tuple[ActorNode, Work, float]], float]]
    ) -> None:
        """Each group's ``runs`` finish its ``seconds`` from now (groups in that order), each
        at the time and in the order one SimPy timeout made now would fire
        (:class:`sim.finishes.FinishQueue`)."""
        start = self.env.now
        generating = cohort.generating
        for runs, _ in groups:
            generating.update([actor for actor, _, _ in runs])
        self.finishes.add(
            [(seconds, (cohort, runs, seconds, start)) for runs, seconds in groups], cohort
        )

    def _finished(
        self, finish: tuple[Cohort, list[tuple[ActorNode, Work, float]], float, float]
    ) -> None:
        """A finish of :meth:`_schedule` (``(cohort, finished, seconds, start)``, the payload
        :class:`~sim.finishes.FinishQueue` reports): the members that generated for
        ``seconds`` report their results (in member order, as exact mode orders them at one
        instant), then generate again, wait at a safe point, or split out."""
        cohort, finished, seconds, start = finish
        sim = self.sim
        driver = sim.driver
        decide = self.actors.decide
        now = self.env.now
        direct = driver.direct()
        proportional = sim.cfg.strategy.proportional
        rec = sim.recorder
        hashed, h = -1, ""  # the version whose hash h is (one f-string per version, not result)
        for actor, work, tokens in finished:
            cohort.generating.discard(actor)
            if actor.cohort is not cohort:
                continue  # lost while generating: the rollouts are gone
            actor.recent = ((len(work.leases), seconds),)
            if rec.on:
                rec.span("actor", actor.id, "generate", work.version, start)
            version = work.version
            if version != hashed:
                hashed, h = version, weights_hash(version)
            results = fastpaths.results_arrived(actor.id, work.leases, version, h)
            direct = driver.report_next(results, now, direct)
            if proportional:
                ev = fastpaths.throughput_observed(actor.id, max(1, round(tokens)), seconds)
                direct = driver.report_next(ev, now, direct)
            if actor.cohort is not cohort:
                continue
            decision = decide(actor)
            kind = type(decision)
            if kind is Wait:
                cohort.waiting[actor] = None
            elif kind is Generate:
                self._start(cohort, actor, decision.work)  # type: ignore[union-attr]
            else:
                self.split(cohort, actor, decision)
        done = cohort.generated
        if not cohort.generating and done is not None and not done.triggered:
            done.succeed()

    def _activate(
        self, cohort: Cohort, members: list[ActorNode], v: int
    ) -> Generator[simpy.Event, Any, None]:
        sim = self.sim
        start = self.env.now
        yield self.env.timeout(0.0 if sim.cfg.strategy.rdma else sim.bytes_of(v) / sim.apply_rate)
        driver = sim.driver
        rec = sim.recorder
        # The members' reports decided in runs (sim.ledger_driver.ReportRun), in member order.
        run = driver.together()
        for actor in members:
            if actor.cohort is not cohort:
                continue  # lost (a fault that struck with a batch requested at this instant)
            actor.active = v
            if actor.pending_commit is not None and actor.pending_commit <= v:
                actor.pending_commit = None
            if rec.on:
                rec.span("actor", actor.id, "apply", v, start)
                rec.log(actor.id, f"activate v{v}")
            if run is not None:
                run.activated(actor.id, v)
            else:
                driver.feed(VersionActivated(actor=actor.id, version=v))
                driver.no_longer_waited_for(actor.id)
        if run is not None:
            run.flush()
            # A Commit of v the Ledger sent a member while that member's report waited in the
            # run (one by one: sent before the member came, and cleared then) is served; one
            # sent after its report was decided can only be of v + 1.
            for actor in members:
                pending = actor.pending_commit
                if actor.cohort is cohort and pending is not None and pending <= v:
                    actor.pending_commit = None
