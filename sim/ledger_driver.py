"""The Job Ledger's driver: reports events to :func:`aurora.policy.ledger.decide` and hands each
returned action to the role that carries it out.

Theory of operation
-------------------
The simulator never decides who works on what. Every role reports what happened through
:meth:`LedgerDriver.feed` (an Actor joined, staged a delta, returned a result, a tick), which
calls ``decide`` at ``env.now`` and routes its actions: ``Assign``/``Commit``/``CatchUp``/``Route``
to :mod:`sim.actors`, ``Fanout``/``FallBack`` to :mod:`sim.transfers`, ``Accepted`` to the
orchestrator's batch accounting, the rest to the recorder. Each fed event and its actions are
kept (``fed``, ``decisions``) when the run records decisions, so a test can replay the run through
``decide`` alone (the policy-parity test).

Lease expiries need a ``Tick`` just after them: one timer per distinct expiry time.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from aurora.policy.ledger import Accepted as AcceptedAction
from aurora.policy.ledger import (
    Action,
    Assign,
    CatchUp,
    Commit,
    Event,
    Exclude,
    FallBack,
    Fanout,
    LedgerConfig,
    RelayAssigned,
    Route,
    Tick,
    decide,
    initial_state,
)

if TYPE_CHECKING:  # pragma: no cover - typing only
    from sim.model import Simulation

_TICK_SLACK_S = 1e-6
"""A lease is expired strictly after its expiry; tick this long after it (s)."""


class LedgerDriver:
    """Feeds events to the policy core and carries out its actions."""

    def __init__(self, sim: Simulation) -> None:
        cfg = sim.cfg
        self.sim = sim
        self.env = sim.env
        self.state = initial_state(
            LedgerConfig(
                trainer_region=cfg.topology.trainer.region,
                lease=cfg.lease,
                max_lag=cfg.strategy.max_lag,
                relays=cfg.strategy.relays,
            )
        )
        self.fed: list[tuple[float, Event]] = []
        self.decisions: list[list[Action]] = []
        self._ticks: set[float] = set()

    def feed(self, event: Event) -> None:
        """Report ``event`` to the Ledger at ``env.now`` and carry out its decisions."""
        now = self.env.now
        _, actions = decide(self.state, event, now=now)
        self.fed.append((now, event))
        self.decisions.append(actions)
        sim = self.sim
        fallbacks = []
        for action in actions:
            if type(action) is AcceptedAction:  # the common case, kept cheap
                sim.orchestrator.accepted_result(action.actor, action.prompt, action.version)
            elif isinstance(action, FallBack):
                fallbacks.append(action)
            else:
                self._do(action)
        # A new relay's own fallback (to the Trainer) first, so that its region can follow it.
        fallbacks.sort(key=lambda a: a.source in sim.actors.nodes)
        for action in fallbacks:
            sim.transfers.fall_back(action)

    def _do(self, action: Action) -> None:
        sim, rec = self.sim, self.sim.recorder
        if isinstance(action, Assign):
            sim.actors.assign(action)
            self._schedule_tick(action.expiry)
        elif isinstance(action, Commit):
            sim.actors.commit(action)
        elif isinstance(action, Exclude):
            rec.log(action.actor, f"excluded from v{action.version} (on v{action.active})")
            rec.excluded.setdefault(sim.orchestrator.requesting, []).append(action.actor)
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
        if expiry in self._ticks or not math.isfinite(expiry):
            return
        self._ticks.add(expiry)

        def tick() -> None:
            self._ticks.discard(expiry)
            self.feed(Tick())

        self.sim.later(max(0.0, expiry - self.env.now) + _TICK_SLACK_S, tick)
