"""When to request the next batch, and on which version (the Trainer's side of algorithm 1).

Theory of operation
-------------------
One-step asynchronous RL: the Actors generate batch ``k`` on an older policy while the Trainer
trains on batch ``k-1``. With a lag bound ``ell`` (``LedgerConfig.max_lag``; 1 for AuroraRL),
batch ``k`` may be generated on any version ``w`` with ``k-1-ell <= w <= latest``: the Trainer
must have published ``k-1-ell`` before batch ``k`` can start. Within that range the batch goes to
the newest version every current Actor already holds (active, or staged on the one before), so a
dense broadcast still in flight does not hold work back when the bound allows older weights
(PrimeRL-Async2/4), nor does a version the Trainer published while the previous one was still
on its way.

A batch requested the instant a version is published would find every Actor still receiving it:
the version predicate would exclude them all and the first Actor to finish staging would take the
whole batch. So the request waits until every Actor one version behind has staged ``w``, or until
``grace_s`` has passed since the batch could first have started; Actors that are later than that
are excluded for this step, as the paper's predicate says, and catch up. AuroraRL stages during
generation, so normally nobody is waited for; a dense baseline waits for its broadcast (grace is
infinite for PrimeRL, whose orchestrator waits for the weights).

The :class:`Pacer` is the machine both drivers hold: :meth:`Pacer.poll` answers "request a batch
now?" at ``now`` (a :class:`~aurora.policy.events.BatchRequested` to feed, a :class:`WakeAt` the
driver must set a timer for, or nothing), :meth:`Pacer.requested` records a request once it is
fed (live or replayed from a log), and :meth:`Pacer.settle` counts admitted results, so a batch
is complete when every one of its prompts has one. The runtime's first batch also waits for a
start barrier: ``start_actors`` Actors ready, or ``start_wait_s`` since the pacer first asked, so
a run's first steps are not taken by whichever Actor loaded first. When to call :meth:`poll` is
the driver's business (after anything the condition reads changed, and when a timer it was
asked for fires); what it answers is decided only here. Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from aurora.policy.events import Accepted, BatchRequested
from aurora.policy.ledger import LedgerState


def lowest_allowed(step: int, max_lag: int) -> int:
    """Oldest version batch ``step`` (1-based) may be generated on."""
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    return max(0, step - 1 - max_lag)


def batch_version(state: LedgerState, step: int) -> int | None:
    """Version for batch ``step``, or None while the Trainer has not published one allowed."""
    lag = state.config.max_lag
    lowest = lowest_allowed(step, lag)
    latest = state.latest
    if latest is None or latest < lowest:
        return None
    floor = max(lowest, latest - lag)
    # The newest version every schedulable Actor with weights from lowest-1 on can reach by
    # activating its staged deltas in order (ActorVersions.reachable: a walk, no sort).
    newest_all_hold: int | None = None
    for rec in state.actors.values():
        if not rec.schedulable:
            continue
        versions = rec.versions
        active = versions.active
        if active is None or active < lowest - 1:
            continue
        held = versions.reachable()
        if newest_all_hold is None or held < newest_all_hold:  # type: ignore[operator]
            newest_all_hold = held
    if newest_all_hold is None:
        newest_all_hold = latest
    return min(max(newest_all_hold, floor), latest)


def waiting_on(state: LedgerState, version: int) -> list[str]:
    """Schedulable Actors one version behind ``version`` that have not staged it yet."""
    return sorted(
        rec.id
        for rec in state.actors.values()
        if rec.schedulable
        and rec.versions.active == version - 1
        and not rec.versions.is_staged(version)
    )


def request_at(*, ready_since: float, waiting: list[str], grace_s: float, now: float) -> bool:
    """Request now? Yes when nobody is waited for, or the grace period has run out."""
    if grace_s < 0:
        raise ValueError(f"grace_s must be >= 0, got {grace_s}")
    return not waiting or now >= ready_since + grace_s


# ------------------------------------------------------------------------------------------
# The machine
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PacerConfig:
    """When batches are requested: the run's shape, the staging grace and the start barrier."""

    steps: int
    """Batches (training steps) in the run; batch ``steps + 1`` is never requested."""
    prompts_per_batch: int
    """Prompts in one batch; a batch is complete when each has an admitted result."""
    staging_grace_s: float
    """How long a ready batch waits for Actors still staging its version (s); ``inf`` waits
    for all (the PrimeRL baselines, whose orchestrator waits for the weights)."""
    prompt_prefix: str
    """Prompt ids are ``{prefix}{batch}-{index}`` (the simulator's ``s``, the runtime's ``b``)."""
    start_actors: int = 0
    """The first batch waits until this many Actors are ready (schedulable, with weights)."""
    start_wait_s: float = math.inf
    """... or until this long after the pacer was first asked for it (s)."""

    def __post_init__(self) -> None:
        if self.steps < 0 or self.prompts_per_batch < 1:
            raise ValueError(
                f"PacerConfig: steps must be >= 0 and prompts_per_batch >= 1, got "
                f"{self.steps} and {self.prompts_per_batch}"
            )
        if not self.staging_grace_s >= 0 or not self.start_wait_s >= 0:
            raise ValueError("PacerConfig: staging_grace_s and start_wait_s must be >= 0")
        if not self.prompt_prefix or "-" in self.prompt_prefix:
            raise ValueError("PacerConfig.prompt_prefix must be non-empty without '-'")


@dataclass(frozen=True, slots=True)
class WakeAt:
    """Poll again at ``at`` (s): a timer the driver sets, then reports with
    :meth:`Pacer.woke` before it polls."""

    at: float
    reason: str
    """``"grace"`` (Actors still staging the batch's version) or ``"start"`` (the barrier)."""


class Pacer:
    """Which batch comes next, when, on which version, and when each is complete."""

    def __init__(self, config: PacerConfig) -> None:
        self.config = config
        self.next_batch = 1
        """The batch the next request hands out (1-based)."""
        self.target: dict[int, int] = {}
        """batch -> the version it was requested on (batches before the latest published are
        forgotten)."""
        self.done: dict[int, float] = {}
        """batch -> when it completed (s)."""
        self.results: dict[int, list[Accepted]] = {}
        """batch -> its admitted results, in order (forgotten once trained into a version)."""
        self.ready_since: float | None = None
        """When the next batch could first have started (s): the grace runs from here."""
        self.waiting: set[str] = set()
        """Actors the ready batch waits for (still staging its version)."""
        self._batch_of: dict[str, int] = {}
        """prompt id -> its batch, until its result is admitted."""
        self._armed: set[str] = set()
        """Reasons with a timer set and not yet fired (one timer each)."""
        self._start_deadline: float | None = None
        self._started = False
        self._made: tuple[int, tuple[str, ...]] = (0, ())
        """The last batch's prompt ids as :meth:`prompts` made them (polling, checking and
        recording a request each ask for them)."""

    @property
    def requesting(self) -> int:
        """The batch handed out last (0 before the first)."""
        return self.next_batch - 1

    def prompts(self, batch: int) -> tuple[str, ...]:
        """The prompt ids of ``batch``."""
        if self._made[0] == batch:
            return self._made[1]
        made = tuple(
            map(
                f"{self.config.prompt_prefix}{batch}-{{}}".format,
                range(self.config.prompts_per_batch),
            )
        )
        self._made = (batch, made)
        return made

    def batch_of(self, prompt: str) -> int:
        """The batch of a prompt id made by :meth:`prompts`."""
        prefix = self.config.prompt_prefix
        if not prompt.startswith(prefix) or "-" not in prompt:
            raise ValueError(f"prompt id {prompt!r} is not {prefix}<batch>-<index>")
        return int(prompt[len(prefix) : prompt.index("-")])

    # -- when -----------------------------------------------------------------------------

    def poll(self, state: LedgerState, now: float) -> BatchRequested | WakeAt | None:
        """Request the next batch at ``now``? A request must be fed to the Ledger at once
        (its :meth:`requested` happens there); a :class:`WakeAt` asks for one timer."""
        cfg = self.config
        k = self.next_batch
        if k > cfg.steps or (k > 1 and k - 1 not in self.done):
            return None
        if k == 1 and not self._started:
            passed, wake = self._start_barrier(state, now)
            if not passed:
                return wake
        w = batch_version(state, k)
        if w is None:
            return None
        if self.ready_since is None:
            self.ready_since = now
        waiting = waiting_on(state, w) if w > 0 else []
        grace = cfg.staging_grace_s
        if not request_at(ready_since=self.ready_since, waiting=waiting, grace_s=grace, now=now):
            self.waiting = set(waiting)
            if "grace" not in self._armed and math.isfinite(grace):
                self._armed.add("grace")
                return WakeAt(self.ready_since + grace, "grace")
            return None
        return BatchRequested(version=w, prompts=self.prompts(k))

    def _start_barrier(self, state: LedgerState, now: float) -> tuple[bool, WakeAt | None]:
        """Whether the first batch may start; if not, the timer to set (once)."""
        want = self.config.start_actors
        ready = 0
        if want > 0:
            ready = sum(
                1 for a in state.actors.values() if a.schedulable and a.versions.active is not None
            )
        if ready >= want or (self._start_deadline is not None and now >= self._start_deadline):
            self._started = True
            return True, None
        if self._start_deadline is None:
            self._start_deadline = now + self.config.start_wait_s
            if math.isfinite(self._start_deadline):
                self._armed.add("start")
                return False, WakeAt(self._start_deadline, "start")
        return False, None

    def observe(self, state: LedgerState, now: float) -> None:
        """An event was decided at ``now``: if it made the next batch ready (the one before it
        complete, a version it may use published), the grace runs from now. So when a batch
        became ready follows from the events alone, whenever the driver polls."""
        if self.ready_since is not None:
            return
        k = self.next_batch
        if k > self.config.steps or (k > 1 and k - 1 not in self.done):
            return
        if k == 1 and not self._started:
            return  # the start barrier is judged when polled
        latest = state.latest
        if latest is not None and latest >= lowest_allowed(k, state.config.max_lag):
            self.ready_since = now

    def woke(self, wake: WakeAt) -> None:
        """The timer of ``wake`` fired (poll next)."""
        self._armed.discard(wake.reason)

    def unblocked(self, actor: str) -> bool:
        """``actor`` staged, activated, caught up or left: True when the ready batch waited
        for it and now waits for no one (poll now)."""
        waiting = self.waiting
        if actor not in waiting:
            return False
        waiting.discard(actor)
        return not waiting

    def left(self, actor: str) -> bool:
        """``actor`` is gone: True when a batch is ready and waiting (poll now: the wait may be
        over)."""
        self.waiting.discard(actor)
        return self.ready_since is not None

    # -- what happened ----------------------------------------------------------------------

    def check_request(self, event: BatchRequested) -> int:
        """The batch ``event`` requests; raises ValueError (nothing changed) unless it is the
        next batch with its own prompt ids."""
        k = self.batch_of(event.prompts[0]) if event.prompts else -1
        if k != self.next_batch or event.prompts != self.prompts(k):
            raise ValueError(
                f"BatchRequested for batch {k} with {len(event.prompts)} prompts; the pacer "
                f"expects batch {self.next_batch} with {self.config.prompts_per_batch}"
            )
        return k

    def requested(self, event: BatchRequested) -> None:
        """``event`` was fed to the Ledger (live, or replayed from its log)."""
        k = self.check_request(event)
        self.ready_since = None
        self.waiting = set()
        self._started = True
        self.next_batch = k + 1
        self.target[k] = event.version
        self.results[k] = []
        self._batch_of.update(dict.fromkeys(event.prompts, k))

    def settle(self, accepted: Sequence[Accepted], now: float) -> list[tuple[int, int]]:
        """Count admitted results (in order); returns ``(index in accepted, batch)`` for each
        result that completed its batch."""
        batch_of, results, size = self._batch_of, self.results, self.config.prompts_per_batch
        completed = []
        for i, a in enumerate(accepted):
            k = batch_of.pop(a.prompt)
            got = results[k]
            got.append(a)
            if len(got) == size:
                self.done[k] = now
                completed.append((i, k))
        return completed

    def published(self, version: int) -> None:
        """``version`` was published: batch ``version``'s results were trained into it, and a
        batch older than it is neither requested again nor asked for."""
        for k in [k for k in self.results if k <= version]:
            del self.results[k]
        for k in [k for k in self.target if k < version]:
            del self.target[k]
        for k in [k for k in self.done if k < version]:
            del self.done[k]
