"""The Trainer: one SimPy process that trains step ``k`` once batch ``k`` is complete and
publishes version ``k``.

Theory of operation
-------------------
For k = 1, 2, ...: wait until batch k is complete; train for tokens(k) / (tokens/s per GPU x
GPUs); get the weights out (the blocking part of the strategy's publication,
:mod:`sim.publication`); publish version k, whose background work runs beside step k+1. With the
``sequential`` pipeline (the runtime's Trainer) the version is extracted, pushed, written and
announced before the next batch is fetched. Every ``snapshot_interval`` versions a full snapshot
also goes to the Checkpoint Store. A Trainer crash ends the process's life wherever it is (it
stops when it next wakes); a new life starts after ``trainer_restart_s`` and redoes the step
that was in progress. The loop in full is on :class:`Trainer`."""

from __future__ import annotations

import math
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import simpy

from aurora.policy.events import DeltaPublished
from aurora.policy.membership import TRAINER
from sim.publication import publication

if TYPE_CHECKING:  # pragma: no cover - typing only
    from sim.model import Simulation


HOST = "trainer-host"
"""The Trainer's host CPUs in the timeline: extraction and serialization run there, beside
training on the GPUs."""


def weights_hash(version: int) -> str:
    """Stand-in for h(v) in the simulator: unique per version, as the real hash chain is."""
    return f"h{version}"


class Trainer:
    """The Trainer's process and what it publishes.

    The loop, for k = 1, 2, ...::

        wait until batch k is complete
        train for tokens(k) / (tokens/s per GPU x GPUs)
        wait until the background work on version k-1 is done with the host buffers
        get the weights out: the blocking part of the strategy's publication (sim.publication)
        publish version k; its background work (extraction, serialization) runs beside step k+1

    A delta strategy extracts ``D_k`` and, cut-through, announces it when extraction starts, so
    segments leave while the scan runs (the network caps the Trainer's flows at the extraction
    rate until it ends); ``aurora-nocut`` announces it when extraction ends. A dense strategy
    announces the checkpoint once it is written.

    With the ``sequential`` pipeline (the runtime's Trainer, :mod:`sim.publication`) the loop is
    instead: train, then extract version ``k`` while the data plane pushes its segments to every
    subscriber as they are cut (:meth:`sim.transfers.Transfers.push`), then ``publish_s`` (store
    write, checkpoint), then announce ``k`` to the Ledger; only then the next batch. The Ledger
    learns of ``k`` at the announcement, and an Actor that staged it before then is counted
    staged there (:meth:`sim.ledger_driver.LedgerDriver.staged`), as the runtime's Ledger does.
    """

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.env = sim.env
        self.trained = 0
        """Newest version published."""
        self.producing: int | None = None
        """Version whose bytes are being produced (extracted, serialized), if any."""
        self.crashed = False
        self.pub = publication(sim)
        """What publishing a version costs (blocking and background work)."""
        self.ready_at = 0.0
        """When the background work on the newest version ends: its bytes are all produced
        (simulated s)."""
        self.produce_rate = math.inf
        """Bytes/s the background work produces (caps cut-through sends until it ends)."""
        self.published_at: dict[int, float] = {}
        self.busy: dict[int, float] = {}
        """Seconds the Trainer worked on each step (training, then what publishing blocks it
        for): what a step costs at least, so a step time equal to it is Trainer-bound."""
        self._wake: simpy.Event | None = None
        self._life: object | None = None
        """Token of the Trainer's current life; a crash ends it (see :meth:`crash`)."""

    def start(self) -> None:
        self._life = life = object()
        self.env.process(self._run(life))

    def batch_ready(self) -> None:
        """A batch is complete: wake the Trainer if it is waiting for one."""
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def crash(self) -> None:
        """The Trainer is lost: whatever it was doing is gone (its process stops when it next
        wakes); a new life starts after ``trainer_restart_s`` and redoes the step. A crash while
        restarting restarts the restart."""
        self.crashed = True
        self._life = life = object()
        self._wake = None
        self.sim.later(self.sim.consts.trainer_restart_s.value, lambda: self._restart(life))

    def _restart(self, life: object) -> None:
        if self._life is not life:
            return  # crashed again while restarting
        self.crashed = False
        self.sim.recorder.log("trainer", "restarted")
        self.env.process(self._run(life))

    # -- the process --------------------------------------------------------------------------

    def _run(self, me: object) -> Generator[simpy.Event, Any, None]:
        sim, env = self.sim, self.env
        pacer = sim.driver.pacer
        steps = sim.cfg.steps
        topo = sim.cfg.topology
        rate = sim.model.train_tokens_per_s_per_gpu[topo.trainer.gpu].value * topo.trainer.gpus
        while self._life is me and self.trained < steps:
            k = self.trained + 1
            if k not in pacer.done:
                self._wake = wake = env.event()
                yield wake
                continue
            duration = sim.prompts_per_batch * sim.tokens_per_lease / rate
            start = env.now
            sim.recorder.log("trainer", f"train step {k}")
            yield env.timeout(duration)
            if self._life is not me:
                return  # crashed while training: the step is redone after restart
            sim.recorder.span("trainer", TRAINER, "train", k, start)
            self.busy[k] = duration
            if self.pub.sequential:
                yield from self._publish_sequential(k, me)
                continue
            if env.now < self.ready_at:
                # The host buffers still hold what the last extraction reads.
                yield env.timeout(self.ready_at - env.now)
                if self._life is not me:
                    return
            if self.pub.blocking_s > 0:
                start = env.now
                yield env.timeout(self.pub.blocking_s)
                if self._life is not me:
                    return
                sim.recorder.span("trainer", TRAINER, self.pub.blocking, k, start)
                self.busy[k] += self.pub.blocking_s
            self.publish(k)

    # -- publication ----------------------------------------------------------------------------

    def _publish_sequential(self, v: int, me: object) -> Generator[simpy.Event, Any, None]:
        """Extract ``v`` while its segments leave, spend ``announce_s``, announce it."""
        sim, env, pub = self.sim, self.env, self.pub
        start = env.now
        work = pub.blocking_s
        self.producing = v
        self.ready_at = start + work
        self.produce_rate = sim.bytes_of(v) / work if work > 0 else math.inf
        sim.recorder.log("trainer", f"extract v{v}")
        sim.transfers.push(v)
        if work > 0:
            yield env.timeout(work)
            if self._life is not me:
                return
            sim.recorder.span("trainer", TRAINER, pub.blocking, v, start)
            self.busy[v] = self.busy.get(v, 0.0) + work
        if pub.announce_s > 0:
            start = env.now
            yield env.timeout(pub.announce_s)
            if self._life is not me:
                return
            sim.recorder.span("trainer", TRAINER, "publish", v, start)
            self.busy[v] = self.busy.get(v, 0.0) + pub.announce_s
        self.trained = v
        sim.recorder.row(v)
        snapshot = int(sim.dense_bytes) if v % sim.cfg.snapshot_interval == 0 else None
        if sim.cfg.strategy.payload == "dense":
            snapshot = int(sim.dense_bytes)
        sim.recorder.log("trainer", f"publish v{v}")
        sim.driver.feed(
            DeltaPublished(
                version=v,
                weights_hash=weights_hash(v),
                delta_bytes=int(sim.bytes_of(v)),
                snapshot_bytes=snapshot,
            )
        )
        sim.driver.published(v)
        self.published_at[v] = start
        if v >= sim.cfg.steps:
            sim.finished.succeed()
        sim.later(0, sim.driver.poll)

    def publish(self, v: int) -> None:
        sim = self.sim
        strat = sim.cfg.strategy
        now = self.env.now
        self.trained = v
        sim.recorder.row(v)
        snapshot = int(sim.dense_bytes) if v % sim.cfg.snapshot_interval == 0 else None
        if strat.payload == "dense":
            snapshot = int(sim.dense_bytes)
        event = DeltaPublished(
            version=v,
            weights_hash=weights_hash(v),
            delta_bytes=int(sim.bytes_of(v)),
            snapshot_bytes=snapshot,
        )
        pub = self.pub
        work = pub.background_s
        self.ready_at = now + work
        self.producing = v
        self.produce_rate = sim.bytes_of(v) / work if work > 0 else math.inf
        if work > 0:
            sim.later(work, lambda: sim.recorder.span("trainer", HOST, pub.background, v, now))
        if pub.cut_through or work == 0:
            sim.recorder.log("trainer", f"publish v{v}")
            sim.driver.feed(event)
        else:

            def publish() -> None:
                sim.recorder.log("trainer", f"publish v{v}")
                sim.driver.feed(event)
                sim.driver.poll()

            sim.later(work, publish)
        self.published_at[v] = now
        if v >= sim.cfg.steps:
            sim.finished.succeed()
        sim.later(0, sim.driver.poll)
