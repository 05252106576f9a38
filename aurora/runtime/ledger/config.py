"""What one Ledger runs with: its configuration, the job the Trainer registered, and what follows.

Theory of operation
-------------------
:class:`LedgerServiceConfig` is fixed when the process starts (the policy's parameters, the
log's path, the staging and reconnect graces). :class:`Job` arrives later, as the Trainer's
registration, and is logged as a driver record so a restarted Ledger reads it back
(:meth:`Job.from_record`). Two things derive from a job: the pacer that decides when each of
its batches starts (:func:`job_pacing`, also used to rebuild the run's files from the log) and
the control channel's limits (:func:`channel_limits`: the largest message a peer sends is one
result).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aurora.jobspec import JobSpec
from aurora.policy.ledger import LedgerConfig
from aurora.policy.pacer import PacerConfig
from aurora.runtime.channel import ChannelLimits

PROMPT_PREFIX = "b"
"""The runtime's prompt ids are ``b{batch}-{index}``."""


def channel_limits(spec: JobSpec) -> ChannelLimits:
    """The control server's limits for a job: the largest message is one result (``group_size``
    completions of ``max_new_tokens`` tokens, each id and log-probability at most 14 bytes of
    msgpack), with room for twice that and 64 KiB of framing, at least 1 MiB, at most the
    channel's default (16 MiB)."""
    group = spec.group_size or 16
    tokens = spec.max_new_tokens or 4096
    biggest = min(16 << 20, max(1 << 20, 2 * group * tokens * 14 + (64 << 10)))
    return ChannelLimits(max_message=biggest, buffer_budget=max(16 << 20, biggest))


def job_pacing(job: Job, *, staging_grace_s: float) -> PacerConfig:
    """The pacer of a registered job."""
    return PacerConfig(
        steps=job.steps,
        prompts_per_batch=job.prompts_per_batch,
        staging_grace_s=staging_grace_s,
        prompt_prefix=PROMPT_PREFIX,
        start_actors=job.spec.start_actors,
        start_wait_s=job.spec.start_wait_s,
    )


@dataclass(frozen=True, kw_only=True)
class LedgerServiceConfig:
    """How the Ledger process runs (the policy itself is ``policy``)."""

    policy: LedgerConfig
    """The policy core's parameters (lag bound, relays, lease lengths, EMA)."""
    log_path: str
    """SQLite file of the durable event log (created if missing, replayed if present)."""
    staging_grace_s: float = 10.0
    """How long a batch waits for Actors still staging its version (s); ``inf`` waits for all
    (the PrimeRL baselines, whose orchestrator waits for the weights)."""
    reconnect_grace_s: float = 0.0
    """A peer whose connection drops is lost unless it reconnects within this (s). 0 (the
    default): lost at once, so no prompt is leased to a dead machine meanwhile (each such lease
    would cost the batch another lease length); an Actor that was only cut off comes back
    through the join path as a returning Actor."""
    stats_path: str | None = None
    """Where :meth:`LedgerService.close` writes its counts and latencies (JSON); None: beside
    the log (``ledger.stats.json``)."""

    def __post_init__(self) -> None:
        if not self.staging_grace_s >= 0 or not self.reconnect_grace_s >= 0:
            raise ValueError("staging_grace_s and reconnect_grace_s must be >= 0")


@dataclass
class Job:
    """What the Trainer registered: the run's shape and what every Actor needs to take part."""

    steps: int
    prompts_per_batch: int
    spec: JobSpec
    """Model, task, sampling, store URL, strategy, job id: sent to each Actor and relay."""

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> Job:
        """The job of a ``Job`` driver record (the Trainer's registration, as logged)."""
        return cls(
            steps=int(rec["steps"]),
            prompts_per_batch=int(rec["prompts_per_batch"]),
            spec=JobSpec.decode(rec["spec"]),
        )
