"""Faults: carrying out a membership or network event (:class:`aurora.faults.Fault`).

Theory of operation
-------------------
A schedule comes from ``SimConfig.faults`` (``--fault``): ``@t=S`` faults strike at that
simulated time, ``@step=N`` faults right after batch ``N`` is handed out (the orchestrator calls
:meth:`Faults.strike`). Spot Actors also get a hazard (:mod:`sim.actors`). What each kind does:

* ``preempt`` / ``leave``: the Actor is lost (its leases expire) or leaves (its leases are
  released at once); ``preempt_notice``: the Ledger is told, and the machine goes after
  ``notice_s``;
* ``join``: a fresh machine that must catch up from a snapshot;
* ``region_loss``: every Actor and relay of the region; ``relay_fail``: one relay (a standalone
  one, or a seed Actor);
* ``trainer_crash``: the Trainer restarts after ``trainer_restart_s`` and redoes its step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aurora.faults import Fault
from aurora.policy.ledger import ActorLeft, ActorLost, PreemptionNotice, RelayLost
from aurora.topology import ActorGroup
from sim.nodes import ActorNode, Node

if TYPE_CHECKING:  # pragma: no cover - typing only
    from sim.model import Simulation


class Faults:
    """Carries out faults."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.env = sim.env

    def schedule(self, faults: tuple[Fault, ...]) -> None:
        for f in faults:
            if f.at_s is not None:
                self.sim.later(f.at_s, lambda f=f: self.strike(f))
            else:
                assert f.at_step is not None
                self.sim.orchestrator.faults_at_step.setdefault(f.at_step, []).append(f)

    def strike(self, f: Fault) -> None:
        sim = self.sim
        sim.recorder.log("faults", f"{f.kind} {f.target}".rstrip())
        if f.kind == "trainer_crash":
            sim.trainer.crash()
        elif f.kind in ("preempt", "leave"):
            actor = self._live_actor(f)
            if actor is not None:
                self.lose(actor, graceful=f.kind == "leave")
        elif f.kind == "preempt_notice":
            actor = self._live_actor(f)
            if actor is not None and not actor.draining:  # one notice per machine
                actor.draining = True
                sim.driver.feed(
                    PreemptionNotice(actor=actor.id, deadline=self.env.now + f.notice_s)
                )
                life = actor.life

                def deadline() -> None:
                    if actor.life is life:
                        self.lose(actor, graceful=True)

                sim.later(f.notice_s, deadline)
        elif f.kind == "join":
            group = ActorGroup(region=f.region, gpu=f.gpu)
            sim.actors.join(f.target, f.region, f.gpu, group.nic_gbps, False, None)
        elif f.kind == "region_loss":
            for actor in sorted(sim.actors.nodes.values(), key=lambda a: a.id):
                if actor.region == f.target and actor.live:
                    self.lose(actor, graceful=False)
            for relay in sorted(sim.transfers.relays.values(), key=lambda r: r.id):
                if relay.region == f.target and relay.live:
                    self.lose_relay(relay)
        elif f.kind == "relay_fail":
            relays = sim.transfers.relays
            if f.target in relays:
                if relays[f.target].live:
                    self.lose_relay(relays[f.target])
            elif f.target in sim.actors.nodes:
                actor = sim.actors.nodes[f.target]
                if actor.live:
                    self.lose(actor, graceful=False)
            else:
                raise ValueError(f"fault relay_fail: unknown relay or Actor {f.target!r}")
        else:
            raise ValueError(f"fault {f.spec()!r}: {f.kind} is not simulated")

    def _live_actor(self, f: Fault) -> ActorNode | None:
        actors = self.sim.actors.nodes
        if f.target not in actors:
            raise ValueError(f"fault {f.kind}: unknown Actor {f.target!r}")
        actor = actors[f.target]
        return actor if actor.live else None

    def lose(self, actor: ActorNode, *, graceful: bool) -> None:
        sim = self.sim
        sim.actors.lose(actor)
        sim.transfers.drop_node(actor)
        sim.recorder.log(actor.id, "left" if graceful else "lost")
        sim.driver.feed(ActorLeft(actor=actor.id) if graceful else ActorLost(actor=actor.id))
        sim.orchestrator.actor_gone(actor.id)

    def lose_relay(self, relay: Node) -> None:
        sim = self.sim
        sim.transfers.drop_node(relay)
        sim.recorder.log(relay.id, "relay lost")
        sim.driver.feed(RelayLost(relay=relay.id))
