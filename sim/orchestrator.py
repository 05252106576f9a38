"""The Trainer's batch loop: when to hand out batch ``k`` and on which version, and when a batch
is complete.

Theory of operation
-------------------
Batch ``k`` is requested once batch ``k-1`` is complete and the lag bound allows a version
(:func:`aurora.policy.pacing.batch_version`); if Actors one version behind are still staging it,
the request waits for them up to the strategy's grace period
(:func:`aurora.policy.pacing.request_at`). The orchestrator re-evaluates that condition whenever
something it depends on changes (a batch completes, a version is published, an Actor stages,
activates, catches up or goes away): it is a condition, not a sequence, so it is a method the
other roles call rather than a process.

A batch is complete when every one of its prompts has an accepted result (``Accepted`` from the
Ledger); the Trainer is then told (:meth:`sim.trainer.Trainer.batch_ready`).
Scheduled faults ``@step=N`` strike right after batch ``N`` is handed out, so a lost Actor loses
the leases it just got.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from aurora.faults import Fault
from aurora.policy import pacing
from aurora.policy.ledger import Accepted, BatchRequested

if TYPE_CHECKING:  # pragma: no cover - typing only
    from sim.model import Simulation


class Orchestrator:
    """Requests batches and counts accepted results per batch."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.env = sim.env
        self.next_batch = 1
        self.requesting = 0
        """The batch being handed out (Exclude actions are charged to it)."""
        self.accepted: dict[int, int] = {}
        self.shares: dict[int, dict[str, int]] = {}
        self.gen_versions: dict[int, dict[str, int]] = {}
        self.batch_target: dict[int, int] = {}
        self.batch_done: dict[int, float] = {}
        self.waiting: set[str] = set()
        """Actors a ready batch is waiting for (still staging its version)."""
        self.ready_since: float | None = None
        self._grace_timer = False
        self.faults_at_step: dict[int, list[Fault]] = {}
        self._step_of: dict[str, int] = {}
        """Prompt id -> the batch it was handed out in, until its result is accepted."""

    def accepted_results(self, run: list[Accepted]) -> None:
        """The Ledger accepted these results, in this order (one ``decide`` call's)."""
        step_of = self._step_of
        batches = [step_of.pop(a.prompt) for a in run]
        first = run[0]
        actor, version = first.actor, first.version
        if batches.count(batches[0]) == len(batches) and all(
            a.actor == actor and a.version == version for a in run
        ):
            # One Actor's results for one batch (a finished assignment): counted at once. A
            # batch completes with its last result, so at the end of the run if in it.
            self._count(batches[0], actor, version, len(run))
        else:
            for a, batch in zip(run, batches, strict=True):
                self._count(batch, a.actor, a.version, 1)

    def _count(self, batch: int, actor: str, version: int, results: int) -> None:
        """``results`` more accepted results of ``actor`` on ``version`` for ``batch``."""
        n = self.accepted.get(batch, 0) + results
        self.accepted[batch] = n
        shares = self.shares.get(batch)
        if shares is None:
            shares = self.shares[batch] = {}
            self.gen_versions[batch] = {}
        shares[actor] = shares.get(actor, 0) + results
        self.gen_versions[batch][actor] = version
        if n == self.sim.prompts_per_batch:
            self.batch_done[batch] = self.env.now
            self.sim.recorder.log("trainer", f"batch {batch} complete")
            self.sim.trainer.batch_ready()
            self.sim.later(0, self.try_request)

    def no_longer_waited_for(self, actor: str) -> None:
        """``actor`` staged, activated or caught up: a batch waiting for it may start now."""
        if actor in self.waiting:
            self.waiting.discard(actor)
            if not self.waiting:
                self.try_request()

    def actor_gone(self, actor: str) -> None:
        self.waiting.discard(actor)  # (try_request below re-evaluates the wait)
        if self.ready_since is not None:
            self.try_request()

    def try_request(self) -> None:
        sim = self.sim
        cfg = sim.cfg
        k = self.next_batch
        if k > cfg.steps or (k > 1 and k - 1 not in self.batch_done):
            return
        ledger = sim.ledger
        w = pacing.batch_version(ledger, k)
        if w is None:
            return
        now = self.env.now
        if self.ready_since is None:
            self.ready_since = now
        waiting = pacing.waiting_on(ledger, w) if w > 0 else []
        grace = cfg.strategy.staging_grace_s
        if not pacing.request_at(
            ready_since=self.ready_since, waiting=waiting, grace_s=grace, now=now
        ):
            self.waiting = set(waiting)
            if not self._grace_timer and math.isfinite(grace):
                self._grace_timer = True

                def expire() -> None:
                    self._grace_timer = False
                    self.try_request()

                sim.later(self.ready_since + grace - now, expire)
            return
        self.ready_since = None
        self.waiting = set()
        self.next_batch = k + 1
        self.batch_target[k] = w
        sim.recorder.log("trainer", f"request batch {k} on v{w}")
        self.requesting = k
        prompts = tuple(map(f"s{k}-{{}}".format, range(sim.prompts_per_batch)))
        self._step_of.update(dict.fromkeys(prompts, k))
        sim.driver.feed(BatchRequested(version=w, prompts=prompts))
        # Step faults strike once the batch is handed out, so a lost Actor loses its leases.
        for fault in self.faults_at_step.pop(k, []):
            sim.faults.strike(fault)
