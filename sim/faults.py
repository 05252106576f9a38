"""Faults: carrying out a membership or network event (:class:`aurora.faults.Fault`).

Theory of operation
-------------------
A schedule comes from ``SimConfig.faults`` (``--fault``): ``@t=S`` faults strike at that
simulated time, ``@step=N`` faults right after batch ``N`` is handed out (the Ledger driver calls
:meth:`Faults.strike`). Spot Actors also get a hazard (:mod:`sim.actors`). A fault removes,
adds or restarts a machine, or cuts a WAN path for a while; what each kind does is listed on
:class:`Faults`. Nothing verified is lost to a fault: cut flows resume, lost leases expire."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aurora.faults import Fault, link_ends
from aurora.policy.events import ActorLeft, ActorLost, PreemptionNotice, RelayLost
from aurora.topology import ActorGroup
from sim.nodes import ActorNode, Node

if TYPE_CHECKING:  # pragma: no cover - typing only
    from sim.model import Simulation


class Faults:
    """Carries out faults.

    What each kind does:

    * ``preempt`` / ``leave``: the Actor is lost (its leases expire) or leaves (its leases are
      released at once); ``preempt_notice``: the Ledger is told, and the machine goes after
      ``notice_s``;
    * ``join``: a fresh machine that must catch up from a snapshot;
    * ``region_loss``: every Actor and relay of the region; ``relay_fail``: one relay (a standalone
      one, or a seed Actor);
    * ``trainer_crash``: the Trainer restarts after ``trainer_restart_s`` and redoes its step;
    * ``link_cut``: the WAN path between two regions carries nothing for ``duration_s``: flows on it
      stall and resume when it is restored (TCP retransmits; nothing verified is lost), and when one
      end is the Trainer's region, messages between the Ledger and that region's Actors (results,
      throughput, staging reports; leases, commits, catch-up plans) wait until then, in order, and
      are judged when they arrive (a result may then be late).
    """

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.env = sim.env
        self.cut_off: dict[str, int] = {}
        """Regions the Ledger cannot reach (a cut of their link to the Trainer's region), with
        the number of cuts in force."""

    def schedule(self, faults: tuple[Fault, ...]) -> None:
        for f in faults:
            if f.at_s is not None:
                # mypy cannot type a lambda with a default argument (which binds the current value)
                self.sim.later(f.at_s, lambda f=f: self.strike(f))  # type: ignore[misc]
            else:
                assert f.at_step is not None
                self.sim.driver.faults_at_step.setdefault(f.at_step, []).append(f)

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
                noticed, life = actor, actor.life

                def deadline() -> None:
                    if noticed.life is life:
                        self.lose(noticed, graceful=True)

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
        elif f.kind == "link_cut":
            self.cut(f)
        else:
            raise ValueError(f"fault {f.spec()!r}: {f.kind} is not simulated")

    def cut(self, f: Fault) -> None:
        sim = self.sim
        topo = sim.cfg.topology
        ends = link_ends(f.target, topo)
        if ends is None:
            raise ValueError(f"fault {f.spec()!r}: no such link")
        res = sim.transfers.wan[frozenset(ends)]
        sim.net.set_cut(res, True)
        remote = [r for r in ends if r != topo.trainer.region]
        isolated = remote[0] if len(remote) == 1 else None
        if isolated is not None:
            self.cut_off[isolated] = self.cut_off.get(isolated, 0) + 1

        def restore() -> None:
            sim.recorder.log("faults", f"link {f.target} restored")
            sim.net.set_cut(res, False)
            if isolated is not None:
                self.cut_off[isolated] -= 1
                if not self.cut_off[isolated]:
                    del self.cut_off[isolated]
                    sim.driver.reconnected(isolated)

        sim.later(f.duration_s, restore)

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
        sim.driver.actor_gone(actor.id)

    def lose_relay(self, relay: Node) -> None:
        sim = self.sim
        sim.transfers.drop_node(relay)
        sim.recorder.log(relay.id, "relay lost")
        sim.driver.feed(RelayLost(relay=relay.id))
