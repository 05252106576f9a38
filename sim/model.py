"""The SimPy model of an AuroraRL job, assembled from one module per role.

Theory of operation
-------------------
Simulated time is SimPy's ``env.now`` in seconds. Every scheduling decision comes from
:func:`aurora.policy.ledger.decide` and every Actor-side choice from :mod:`aurora.policy.actor`:
the simulator only *reports* what happened and *carries out* what the policy returns. Roles:
:mod:`sim.ledger_driver` (feeds the policy core, routes its actions), :mod:`sim.trainer` (train,
extract, publish), :mod:`sim.actors` (one process per Actor machine life), :mod:`sim.transfers`
(links and versions as flows of :mod:`sim.network`), :mod:`sim.faults` and :mod:`sim.recorder`
(trace, timeline, step rows).

:class:`Simulation` builds them around one ``simpy.Environment`` and runs until the last step is
published. Randomness (throughput noise, link fluctuation, hazards) comes from per-entity numpy
generators seeded from ``(seed, entity)``, so a run is a deterministic function of its config."""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy

from aurora.policy.events import Action, DeltaPublished, Event, RelayJoined
from sim.actors import GBPS, Actors
from sim.cohorts import Cohort
from sim.config import SimConfig
from sim.faults import Faults
from sim.ledger_driver import LedgerDriver
from sim.network import Network, Resource
from sim.nodes import Node
from sim.recorder import Recorder
from sim.trainer import Trainer, weights_hash
from sim.transfers import Transfers

__all__ = ["Result", "Simulation", "SimulationStalled", "simulate", "weights_hash"]


@dataclass
class Result:
    """What a run produced."""

    rows: list[dict[str, Any]]
    """One row per training step."""
    trace: list[tuple[float, str, str]]
    """Human-readable event trace ``(time, who, what)`` (empty unless ``record_trace``)."""
    timeline: list[dict[str, Any]]
    """Spans ``{role, who, activity, version, start, end}`` for Gantt charts."""
    fed: list[tuple[float, Event]]
    """Every event fed to ``decide``, with its time: replaying it reproduces ``decisions``
    (empty unless ``record_trace``)."""
    decisions: list[list[Action]]
    """The actions ``decide`` returned for each fed event (empty unless ``record_trace``)."""
    events: int
    """SimPy events processed (for events/s)."""
    sim_time: float
    """Simulated seconds at the end."""
    trainer_busy: dict[int, float] = field(default_factory=dict)
    """Seconds the Trainer worked on each step (training and the publication it waits for)."""

    def summary(self, warmup: int = 2) -> dict[str, float]:
        """Mean step time and tokens/s over steps after ``warmup``, as the paper reports."""
        rows = self.rows[warmup:] if len(self.rows) > warmup else self.rows
        tokens = sum(r["tokens"] for r in rows)
        span = sum(r["step_time_s"] for r in rows)
        return {
            "steps": len(self.rows),
            "step_time_s": span / len(rows) if rows else math.nan,
            "tokens_per_s": tokens / span if span > 0 else math.nan,
            "wan_gb_per_step": sum(r["wan_bytes"] for r in rows) / max(len(rows), 1) / 1e9,
            "expired_leases": sum(r["expired"] for r in self.rows),
            "sim_time_s": self.sim_time,
        }


class SimulationStalled(RuntimeError):
    """Nothing is left that could ever finish the run (e.g. every Actor is gone)."""

    def __init__(self, message: str, result: Result | None = None) -> None:
        super().__init__(message)
        self.result = result
        """What the run produced up to the stall (rows, trace, timeline)."""


class Simulation:
    """One run of :class:`~sim.config.SimConfig`. Call :meth:`run` once."""

    def __init__(self, cfg: SimConfig, *, progress: Callable[[int], None] | None = None) -> None:
        self.cfg = cfg
        self.progress = progress
        """Called with the step number after each step (a progress bar)."""
        topo, traces, strat = cfg.topology, cfg.traces, cfg.strategy
        self.env = simpy.Environment()
        self.net = Network(self.env)
        self.model = traces.model(topo.trainer.model)
        self.consts = traces.constants
        self.tokens_per_rollout = traces.workload(cfg.workload).tokens_per_rollout.value
        self.finished = self.env.event()

        # Payload sizes (bytes) of one published version: one number for every version, or a
        # recorded run's own size per version where the trace has them (``bytes_of``).
        dense = self.model.dense_bytes.value
        self.version_sizes: tuple[float, ...] = ()
        if strat.payload == "delta":
            self.version_bytes = traces.delta_bytes(topo.trainer.model, strat.codec)
            self.version_sizes = traces.delta_bytes_by_version(topo.trainer.model, strat.codec)
            self.apply_rate = self.consts.apply_bytes_per_s.value
        else:
            wire = self.model.dense_payload_bytes
            self.version_bytes = dense if wire is None else wire.value
            self.apply_rate = self.consts.dense_load_bytes_per_s.value
        self.dense_bytes = dense

        # Batches.
        total = cfg.batch_total  # a multiple of rollouts_per_lease (checked by SimConfig)
        self.prompts_per_batch = total // cfg.rollouts_per_lease
        self.tokens_per_lease = cfg.rollouts_per_lease * self.tokens_per_rollout

        # The roles.
        self.recorder = Recorder(self)
        self.driver = LedgerDriver(self)
        self.ledger = self.driver.state
        self.trainer = Trainer(self)
        self.transfers = Transfers(self)
        self.actors = Actors(self)
        self.faults = Faults(self)

    # ------------------------------------------------------------------------------------
    # Plumbing shared by the roles
    # ------------------------------------------------------------------------------------

    def later(self, delay: float, fn: Callable[[], None]) -> None:
        """Call ``fn`` after ``delay`` simulated seconds."""
        ev = self.env.timeout(delay)
        ev.callbacks.append(lambda _e: fn())

    def rng(self, *key: int) -> np.random.Generator:
        """The random generator of one entity: a function of the seed and ``key`` only."""
        return np.random.default_rng([self.cfg.seed, *key])

    # ------------------------------------------------------------------------------------
    # Run
    # ------------------------------------------------------------------------------------

    def run(self) -> Result:
        # The cyclic garbage collector would rescan the Ledger's whole lease history (10^5-10^6
        # long-lived objects) again and again (journal: code-notes-simulator.md). The model
        # makes few reference cycles (a flow and its transfer), so it runs without it, from
        # the set-up on.
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._setup()
            self.trainer.start()
            self.driver.poll()
            self.env.process(self._watchdog())
            self.env.run(until=self.finished)
        except SimulationStalled as exc:
            raise SimulationStalled(str(exc), self.result()) from None
        except RuntimeError as exc:
            if "No scheduled events left" not in str(exc):
                raise
            raise SimulationStalled(self._stall_report(), self.result()) from None
        finally:
            if was_enabled:
                gc.enable()
        return self.result()

    def result(self) -> Result:
        """What the run has produced so far."""
        return Result(
            rows=self.recorder.rows,
            trace=self.recorder.trace,
            timeline=self.recorder.timeline,
            fed=self.driver.fed,
            decisions=self.driver.decisions,
            events=next(self.env._eid),  # SimPy's running event id: events scheduled so far
            sim_time=self.env.now,
            trainer_busy=self.trainer.busy,
        )

    def measure_fanout(self) -> float:
        """Seconds for one published version (no extraction: the bytes are ready) to reach
        every Actor through the strategy's transfer path: the paper's per-step transfer cost
        (Fig. 11, Fig. 14). Includes the TCP model, relays and the last hop; excludes apply."""
        self._setup()
        waiting = set(self.actors.nodes)
        done = self.env.event()

        def held(actor: str) -> None:
            waiting.discard(actor)
            if not waiting and not done.triggered:
                done.succeed()

        self.transfers.on_hold = held
        self.trainer.ready_at, self.trainer.produce_rate = -math.inf, math.inf
        self.driver.feed(
            DeltaPublished(
                version=1, weights_hash=weights_hash(1), delta_bytes=int(self.bytes_of(1))
            )
        )
        self.env.run(until=done)
        return self.env.now

    def bytes_of(self, v: int) -> float:
        """Bytes of version ``v``'s payload: the trace's size of that version where it records
        one per version, else the one number every version has."""
        sizes = self.version_sizes
        return sizes[v - 1] if 1 <= v <= len(sizes) else self.version_bytes

    def _setup(self) -> None:
        cfg, topo = self.cfg, self.cfg.topology
        snapshot = int(self.dense_bytes)
        self.driver.feed(
            DeltaPublished(
                version=0, weights_hash=weights_hash(0), delta_bytes=None, snapshot_bytes=snapshot
            )
        )
        self.trainer.published_at[0] = 0.0
        if cfg.strategy.relays:
            for relay in topo.relays:
                rate = relay.nic_gbps * GBPS
                node = Node(
                    relay.id,
                    relay.region,
                    Resource(f"relay:{relay.id}", rate),
                    Resource(f"relay-in:{relay.id}", rate, per_member=True),
                )
                node.held.add(0)
                self.transfers.relays[relay.id] = node
                self.driver.feed(RelayJoined(relay=relay.id, region=relay.region))
        named = {f.target for f in cfg.faults}
        cohorts: dict[int, Cohort] = {}
        for actor_id, group in topo.actor_ids():
            cohort = None
            if cfg.cohorts and not group.spot and group.count > 1 and actor_id not in named:
                cohort = cohorts.get(id(group))
                if cohort is None:
                    cohort = cohorts[id(group)] = Cohort(group.prefix)
            self.actors.join(
                actor_id, group.region, group.gpu, group.nic_gbps, group.spot, 0, cohort
            )
        for cohort in cohorts.values():
            self.actors.cohorts.start(cohort)
        self.faults.schedule(cfg.faults)

    def _watchdog(self) -> Generator[simpy.Event, Any, None]:
        """Stop the run ``stall_after_s`` simulated seconds after the last step, if no step
        completes in between (every Actor gone for good, say)."""
        rows = self.recorder.rows
        while True:
            seen = self.trainer.trained
            since = rows[-1]["time_s"] if rows else 0.0
            yield self.env.timeout(since + self.cfg.stall_after_s - self.env.now)
            if self.trainer.trained == seen:
                raise SimulationStalled(
                    f"no step completed in the {self.cfg.stall_after_s:g} simulated seconds "
                    f"after t={since:.1f} s; " + self._stall_report()
                )

    def _stall_report(self) -> str:
        live = sorted(a.id for a in self.actors.nodes.values() if a.live)
        return (
            f"the run stalled at t={self.env.now:.1f} s after {self.trainer.trained} of "
            f"{self.cfg.steps} steps: batch {self.driver.pacer.next_batch} not yet requested, "
            f"{self.ledger.book.pool_size} prompts in the pool, latest version "
            f"{self.ledger.latest}, live Actors {live or 'none'}"
        )


def simulate(cfg: SimConfig) -> Result:
    """Run one configuration and return its rows, trace and recorded decisions."""
    return Simulation(cfg).run()
