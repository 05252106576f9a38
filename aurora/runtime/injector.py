"""The fault injector for real processes: the same ``--fault`` schedule as ``aurora sim``.

Theory of operation
-------------------
A schedule is a list of :class:`aurora.faults.Fault` (parsed by :func:`aurora.faults.
parse_fault`, checked against the topology by :func:`aurora.faults.check_faults`, exactly as the
simulator reads them). The injector fires each one at its time: ``at_s`` seconds after the run
starts, or right after batch ``at_step`` is handed out (the Ledger tells the launcher, which
calls :meth:`Injector.batch_requested`), and carries it out on the :class:`Cluster` the launcher
provides (:class:`Injector` says how, fault by fault). A :class:`SpotHazard` adds seeded random
preemptions of spot Actors, so a schedule is reproducible. Every fault lands in the Ledger's log
(``events.csv``) with the wall time it was carried out.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from aurora.faults import Fault

log = logging.getLogger("aurora.runtime.injector")


class Cluster(Protocol):
    """What the injector needs from whoever owns the processes (the launcher)."""

    def kill(self, pid: str) -> None: ...
    def notice(self, pid: str, notice_s: float) -> None: ...
    def leave(self, pid: str) -> None: ...
    def join(self, pid: str, region: str, gpu: str) -> None: ...
    def region_loss(self, region: str) -> None: ...
    def relay_fail(self, pid: str) -> None: ...
    def trainer_crash(self) -> None: ...
    def ledger_crash(self) -> None: ...
    def link_cut(self, target: str, duration_s: float) -> None: ...
    def record(self, spec: str) -> None: ...


@dataclass(frozen=True, kw_only=True)
class SpotHazard:
    """Random preemptions of spot Actors.

    ``--spot-hazard H`` draws preemptions of every spot Actor (``spot: true`` in the topology) as a
    Poisson process of rate ``H`` per hour, each with ``spot_notice_s`` of notice; with
    ``spot_return_s`` a preempted Actor comes back as a fresh process under its id after that many
    seconds. Draws come from one seeded generator, so a schedule is reproducible."""

    per_hour: float
    """Preemptions per hour per spot Actor."""
    actors: tuple[str, ...]
    """The spot Actors."""
    notice_s: float = 30.0
    """Notice before each preemption (s); 0: none (SIGKILL)."""
    return_s: float | None = None
    """A preempted Actor comes back after this many seconds; None: it does not."""
    seed: int = 0
    """Seed of the draws."""


class Injector:
    """Fires a fault schedule (and a spot hazard) on a :class:`Cluster`, each fault as:

    =================  ===========================================================================
    ``preempt``        SIGKILL the Actor (no notice: its leases expire back to the pool)
    ``preempt_notice`` SIGTERM (the Actor tells the Ledger, drains, leaves), SIGKILL after
                       ``notice_s`` if it is still there
    ``leave``          SIGUSR1: the Actor finishes its batch, leaves gracefully, exits
    ``join``           a new Actor process; it catches up from a snapshot + the delta chain
    ``region_loss``    SIGKILL every Actor and relay of the region at once
    ``relay_fail``     SIGKILL the relay (or the seed Actor relaying)
    ``trainer_crash``  SIGKILL the Trainer (and the Ledger in its process); restart it from its
                       checkpoint and the Ledger from its log after ``restart_s``
    ``link_cut``       the emulated link drops everything for ``duration_s`` (emulation), or the
                       region's processes are cut off (loopback: SIGSTOP, then SIGCONT)
    ``ledger_crash``   SIGKILL the Ledger process; restart it from its log after ``restart_s``
    =================  ===========================================================================
    """

    def __init__(
        self, faults: Iterable[Fault], cluster: Cluster, *, spot: SpotHazard | None = None
    ) -> None:
        self.faults = list(faults)
        self.cluster = cluster
        self.spot = spot
        self.fired: list[str] = []
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        """Schedule the timed faults and the hazard (call from the running event loop)."""
        for f in self.faults:
            if f.at_s is not None:
                self._spawn(self._at(f.at_s, f))
        if self.spot is not None and self.spot.per_hour > 0:
            rng = random.Random(self.spot.seed)
            for pid in self.spot.actors:
                self._spawn(self._hazard(pid, random.Random(rng.random())))

    def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()

    def batch_requested(self, batch: int) -> None:
        """Fire the faults scheduled right after batch ``batch`` is handed out."""
        for f in self.faults:
            if f.at_step == batch:
                self.fire(f)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _at(self, delay: float, f: Fault) -> None:
        await asyncio.sleep(delay)
        self.fire(f)

    async def _hazard(self, pid: str, rng: random.Random) -> None:
        assert self.spot is not None
        while True:
            await asyncio.sleep(rng.expovariate(self.spot.per_hour / 3600.0))
            if self.spot.notice_s > 0:
                self.fire(
                    Fault(kind="preempt_notice", target=pid, at_s=0.0, notice_s=self.spot.notice_s)
                )
                await asyncio.sleep(self.spot.notice_s)
            else:
                self.fire(Fault(kind="preempt", target=pid, at_s=0.0))
            if self.spot.return_s is None:
                return
            await asyncio.sleep(self.spot.return_s)
            self.cluster.record(f"return:{pid}")
            self.cluster.join(pid, "", "")

    def fire(self, f: Fault) -> None:
        """Carry out one fault now."""
        spec = f.spec()
        log.info("injector: %s", spec)
        self.fired.append(spec)
        self.cluster.record(spec)
        c = self.cluster
        if f.kind == "preempt":
            c.kill(f.target)
        elif f.kind == "preempt_notice":
            c.notice(f.target, f.notice_s)
        elif f.kind == "leave":
            c.leave(f.target)
        elif f.kind == "join":
            c.join(f.target, f.region, f.gpu)
        elif f.kind == "region_loss":
            c.region_loss(f.target)
        elif f.kind == "relay_fail":
            c.relay_fail(f.target)
        elif f.kind == "trainer_crash":
            c.trainer_crash()
        elif f.kind == "link_cut":
            c.link_cut(f.target, f.duration_s)
        elif f.kind == "ledger_crash":
            c.ledger_crash()
        else:  # pragma: no cover - Fault validates its kind
            raise ValueError(f"unknown fault kind {f.kind!r}")
