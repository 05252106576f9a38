"""Simulator configuration: fault schedules, recorded link rates and the run config.

All frozen ``@dataclass(kw_only=True)``; building one has no side effects. The strategy table
(:mod:`aurora.strategies`) is the runtime's too; it is re-exported here for the simulator's
users.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from aurora.faults import FAULT_KINDS, Fault, check_faults, link_ends
from aurora.policy.leases import LeaseConfig
from aurora.strategies import Strategy, replace_strategy, strategy
from aurora.topology import Topology
from aurora.traces import Traces
from sim.tcp import DEFAULT_CONGESTION
from sim.tcp import check as check_congestion

__all__ = [
    "FAULT_KINDS",
    "PIPELINES",
    "Fault",
    "RateSchedule",
    "SimConfig",
    "Strategy",
    "strategy",
    "replace_strategy",
]
PIPELINES = ("overlapped", "sequential")


@dataclass(frozen=True, kw_only=True)
class RateSchedule:
    """A link's rate over time as it was recorded (the emulated WAN of a real run applies its
    fluctuation draws from when its network is built, not from the run's first batch: a replay
    takes the rates it applied, at the times it applied them)."""

    link: str
    """The link, ``A-B`` (region names, either order)."""
    points: tuple[tuple[float, float], ...]
    """``(simulated second, Gbit/s)`` in increasing time: from each point's time the link has
    that rate; points before 0 set the rate at 0."""

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError(f"rate schedule {self.link!r}: needs at least one point")
        times = [t for t, _ in self.points]
        if times != sorted(times) or not all(math.isfinite(t) for t in times):
            raise ValueError(f"rate schedule {self.link!r}: times must be finite and increasing")
        if not all(math.isfinite(g) and g > 0 for _, g in self.points):
            raise ValueError(f"rate schedule {self.link!r}: rates must be > 0 Gbit/s")


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """One simulated run."""

    topology: Topology
    """The deployment."""
    traces: Traces
    """Recorded inputs."""
    strategy: Strategy
    """How policy updates travel."""
    steps: int
    """Training steps (versions published after v0)."""
    seed: int = 0
    """Seed of every random draw (throughput noise, link fluctuation, spot hazard)."""
    workload: str = "gsm8k"
    """Workload name in the traces (tokens per rollout)."""
    batch_rollouts: int | None = None
    """Rollouts per step (B); None: the traces' rollouts_per_actor times the initial Actors."""
    rollouts_per_lease: int = 16
    """Rollouts per lease: one prompt and its GRPO group of completions."""
    segment_bytes: int = 4 << 20
    """Segment size of a delta (bytes); the first segment must arrive before a relay forwards."""
    snapshot_interval: int = 50
    """The Trainer writes a full snapshot every this many versions (joins start from one)."""
    lease: LeaseConfig = field(default_factory=LeaseConfig)
    """Lease length policy."""
    faults: tuple[Fault, ...] = ()
    """Scheduled membership events."""
    spot_hazard_per_hour: float = 0.0
    """Preemption rate of each spot Actor (1/h, exponential inter-arrival)."""
    spot_notice_s: float | None = 30.0
    """Warning of a hazard preemption (s); None: preempted without notice."""
    spot_return_s: float | None = None
    """A preempted spot Actor rejoins (fresh machine, from a snapshot) after this many seconds;
    None: it does not return."""
    stall_after_s: float = 86_400.0
    """Stop with :class:`sim.model.SimulationStalled` when no step completes for this many
    simulated seconds (a deployment that cannot make progress, e.g. every Actor churning)."""
    rate_schedules: tuple[RateSchedule, ...] = ()
    """Recorded rates of links (replaces their ``fluctuation`` draws, e.g. in the replay of a
    real run over the emulated WAN: :mod:`sim.runtrace`)."""
    publish_pipeline: str = "overlapped"
    """How the Trainer gets a version out (:mod:`sim.publication`): ``overlapped``, the paper's
    design (extraction or serialization beside the next optimizer step); ``sequential``, the
    runtime's Trainer (``aurora/runtime/trainer.py``: extract while sending, write to the store
    and checkpoint, announce, and only then train the next step)."""
    control_latency: bool = False
    """Messages between the Ledger and each Actor take the one-way delay of the link between
    their regions (:mod:`sim.ledger_driver`), as the runtime's control connections do. Off by
    default: the paper-trace experiments and golden traces predate it, and at their step times
    (minutes) a few tens of ms per message are within their noise; a replay of a real run
    (:mod:`sim.runtrace`, steps of a fraction of a second) turns it on."""
    store_local: bool = False
    """The Checkpoint Store is on every Actor's own host (a shared directory, as ``aurora real``
    has it on one host): a catch-up reads it through the Actor's interface at its region's LAN
    rate, with no WAN round trip. Off: the Store is in the Trainer's region (the paper)."""
    loss_recovery: bool = False
    """On lossy links, charge TCP's loss recovery where the fluid model has no term for it
    (:mod:`sim.tcp`, RACK-TLP and the RTO as Linux runs them): the end of every transfer
    across a lossy WAN path is late by a draw of how long its last lost packet takes to be
    sent again, and with ``control_latency`` every control message is lost with the link's
    probability, recovered by a tail-loss probe (then RTOs), and holds back the messages behind
    it on its connection. Off by default: the paper-trace experiments and golden traces
    predate it, and at their sizes (minutes a step) a few RTTs are within their noise; the
    host-profile predictions (:mod:`sim.hostprofile`) and replays of real runs turn it on."""
    cohorts: bool = False
    """Drive the Actors of each topology group that join together as one cohort process
    (:mod:`sim.cohorts`): the same events reach the Ledger at the same simulated times, only
    the order of events at one instant can differ. Off by default: exact mode (one process
    per Actor) is the reference the golden traces and parity tests were made with."""
    record_trace: bool = True
    """Keep the human-readable event trace, the timeline and every event fed to the Ledger with
    its decisions (turn off for 10^4 Actors and for sweeps)."""

    @property
    def batch_total(self) -> int:
        """Rollouts per step: ``batch_rollouts``, else the traces' rollouts per Actor times the
        Actors the topology starts with."""
        if self.batch_rollouts is not None:
            return self.batch_rollouts
        actors = sum(g.count for g in self.topology.actors)
        return int(self.traces.constants.rollouts_per_actor.value) * actors

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.rollouts_per_lease < 1:
            raise ValueError(f"rollouts_per_lease must be >= 1, got {self.rollouts_per_lease}")
        if self.batch_rollouts is not None and self.batch_rollouts % self.rollouts_per_lease:
            raise ValueError(
                f"batch_rollouts ({self.batch_rollouts}) must be a multiple of "
                f"rollouts_per_lease ({self.rollouts_per_lease})"
            )
        if self.batch_rollouts is None and self.batch_total % self.rollouts_per_lease:
            per = int(self.traces.constants.rollouts_per_actor.value)
            raise ValueError(
                f"rollouts_per_lease ({self.rollouts_per_lease}) must divide the batch of "
                f"{self.batch_total} rollouts ({per} per Actor x "
                f"{self.batch_total // per} Actors)"
            )
        if self.segment_bytes < 1 or self.snapshot_interval < 1:
            raise ValueError("segment_bytes and snapshot_interval must be >= 1")
        if self.spot_hazard_per_hour < 0:
            raise ValueError(f"spot_hazard_per_hour must be >= 0, got {self.spot_hazard_per_hour}")
        if self.spot_hazard_per_hour > 0 and not any(g.spot for g in self.topology.actors):
            raise ValueError(
                f"spot_hazard_per_hour: {self.spot_hazard_per_hour:g} preemptions per hour, but "
                f"topology {self.topology.name!r} has no spot Actors (set spot: true on an "
                "Actor group)"
            )
        for name in ("spot_notice_s", "spot_return_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be >= 0 seconds, got {value!r}")
        if self.publish_pipeline not in PIPELINES:
            raise ValueError(
                f"publish_pipeline must be one of {PIPELINES}, got {self.publish_pipeline!r}"
            )
        for sched in self.rate_schedules:
            if link_ends(sched.link, self.topology) is None:
                names = ", ".join(f"{lk.a}-{lk.b}" for lk in self.topology.links) or "none"
                raise ValueError(f"rate schedule: no link {sched.link!r} (links: {names})")
        if not self.stall_after_s > 0:
            raise ValueError(f"stall_after_s must be > 0, got {self.stall_after_s!r}")
        congestion = self.topology.congestion or DEFAULT_CONGESTION
        for i, link in enumerate(self.topology.links):
            try:
                check_congestion(congestion, link.loss)
            except ValueError as exc:
                raise ValueError(f"links[{i}] {link.a}-{link.b}: {exc}") from None
        # Everything the run will look up must exist: fail before simulating, naming the field.
        model = self.topology.trainer.model
        m = self.traces.model(model, where="trainer.model")
        if self.topology.trainer.gpu not in m.train_tokens_per_s_per_gpu:
            raise ValueError(
                f"trainer.gpu: no training throughput of {self.topology.trainer.gpu!r} "
                f"on {model!r} in traces"
            )
        for i, group in enumerate(self.topology.actors):
            self.traces.gpu(group.gpu, model, where=f"actors[{i}].gpu")
        check_faults(self.faults, self.topology, steps=self.steps)
        for f in self.faults:
            if f.kind == "ledger_crash":
                raise ValueError(
                    f"--fault {f.spec()!r}: the simulator has no Ledger process to crash "
                    "(real mode only)"
                )
            if f.kind == "join":
                self.traces.gpu(f.gpu, model, where=f"faults join {f.target}.gpu")
        self.traces.workload(self.workload)
        if self.strategy.payload == "delta":
            self.traces.delta_bytes(model, self.strategy.codec)
