"""The SimPy model of an AuroraRL job: Trainer, Job Ledger, Checkpoint Store, relays, Actors.

Theory of operation
-------------------
Simulated time is SimPy's ``env.now`` in seconds. Every scheduling decision comes from
:func:`aurora.policy.ledger.decide`, called with ``env.now``: the model only *reports* what
happened (an Actor joined, staged a delta, returned a result) and *carries out* the returned
actions (Commit, Assign, Exclude, CatchUp, Route, FallBack, Fanout). It never decides who works
on what. Each call is recorded (``Result.fed``) so that a test can replay the run through
``decide`` alone and get the same actions (the policy-parity test). When to request a batch and
on which version comes from :mod:`aurora.policy.pacing`, also pure.

The roles:

* **Trainer** trains step ``k`` once batch ``k`` is complete (every prompt's result accepted) and
  version ``k-1`` exists, for ``tokens(k) / (tokens/s per GPU x GPUs)`` seconds; then publishes
  ``D_k``. With a delta strategy it extracts for ``extract_s`` and, cut-through, announces ``D_k``
  when extraction starts, so segments leave while it is still scanning; the next step starts
  when extraction ends (it reads the weights that step would change). Every
  ``snapshot_interval`` versions a full snapshot also goes to the Checkpoint Store.
* **Orchestrator** (the Trainer's batch loop) requests batch ``k`` when batch ``k-1`` is complete
  and the lag bound allows a version (:func:`aurora.policy.pacing.batch_version`).
* **Checkpoint Store** sits in the Trainer's region; catch-up and join fetches pull from it.
* **Relays** (standalone, or a seed Actor elected by the Ledger) receive each delta once over the
  WAN and forward it to their region's Actors as segments arrive.
* **Actors** generate their leases on their active version
  (``tokens / (GPU tokens/s x noise x drift)`` seconds), stage the next delta meanwhile, and
  activate it at the end-of-batch safe point when the Ledger sends Commit. Results go to the
  Ledger per lease; the throughput of the batch feeds the Ledger's EMA estimate.

Transfers are flows in :mod:`sim.network`. Faults come from a schedule or a hazard rate
(:class:`sim.config.Fault`). Randomness (throughput noise, link fluctuation, hazards) comes from
per-entity numpy generators seeded from ``(seed, entity)``, so a run is a deterministic function
of its config.
"""

from __future__ import annotations

import gc
import json
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy

from aurora.policy import actor as actor_policy
from aurora.policy import pacing
from aurora.policy.actor import Activate, ApplyPlan, Drop, Generate, Work
from aurora.policy.ledger import Accepted as AcceptedAction
from aurora.policy.ledger import (
    Action,
    ActorJoined,
    ActorLeft,
    ActorLost,
    Assign,
    BatchRequested,
    CatchUp,
    CaughtUp,
    Commit,
    DeltaPublished,
    DeltaStaged,
    Event,
    Exclude,
    FallBack,
    Fanout,
    LedgerConfig,
    PreemptionNotice,
    RelayAssigned,
    RelayJoined,
    RelayLost,
    ResultArrived,
    Route,
    ThroughputObserved,
    Tick,
    VersionActivated,
    decide,
    initial_state,
)
from aurora.policy.membership import TRAINER
from aurora.policy.versions import CatchUpPlan
from aurora.topology import ActorGroup
from sim.config import Fault, SimConfig
from sim.network import Flow, Network, Producer, Resource, tcp_cap

GBPS = 1e9 / 8
"""Bytes/s in one Gbit/s."""
_TICK_SLACK_S = 1e-6
"""A lease is expired strictly after its expiry; tick this long after it (s)."""


def weights_hash(version: int) -> str:
    """Stand-in for h(v) in the simulator: unique per version, as the real hash chain is."""
    return f"h{version}"


@dataclass
class Transfer:
    """One version moving from ``src`` to ``members`` (a cohort of identical receivers)."""

    version: int
    src: str
    members: list[str]
    flow: Flow


@dataclass
class Node:
    """A receiver of deltas: an Actor or a standalone relay."""

    id: str
    region: str
    nic: Resource
    """Its interface: caps what it receives, and is shared by what it forwards."""
    held: set[int] = field(default_factory=set)
    """Versions held whole (verified)."""
    inbound: dict[int, Transfer] = field(default_factory=dict)
    """Versions being received."""
    live: bool = True
    waiters: dict[int, list[Callable[[], None]]] = field(default_factory=dict)
    """Callbacks for when a version is held whole (store-and-forward relays, catch-up)."""
    starters: dict[int, list[Callable[[], None]]] = field(default_factory=dict)
    """Callbacks for when a version starts arriving (cut-through forwards)."""


@dataclass
class ActorSim(Node):
    gpu: str = ""
    rate: float = 0.0
    """Nominal generation throughput (tokens/s)."""
    spot: bool = False
    index: int = 0
    rng: np.random.Generator | None = None
    epoch: int = 0
    """Bumped when the machine is lost: callbacks from an older epoch are ignored."""
    busy: bool = False
    active: int | None = None
    queue: deque[Work] = field(default_factory=deque)
    pending_commit: int | None = None
    plan: CatchUpPlan | None = None
    pulling: set[int] = field(default_factory=set)
    """Versions (deltas, or a snapshot) being pulled from the Checkpoint Store; a revised
    catch-up plan (the target moved on) does not pull them again."""
    source: str = TRAINER
    draining: bool = False
    """Under a preemption notice: leaving at its deadline."""


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
    """Every event fed to ``decide``, with its time: replaying it reproduces ``decisions``."""
    decisions: list[list[Action]]
    """The actions ``decide`` returned for each fed event."""
    events: int
    """SimPy events processed (for events/s)."""
    sim_time: float
    """Simulated seconds at the end."""

    def summary(self, warmup: int = 2) -> dict[str, float]:
        """Mean step time and tokens/s over steps after ``warmup``, as the paper reports."""
        rows = self.rows[warmup:] if len(self.rows) > warmup else self.rows
        tokens = sum(r["tokens"] for r in rows)
        span = sum(r["step_time_s"] for r in rows)
        return {
            "steps": len(self.rows),
            "step_time_s": span / len(rows),
            "tokens_per_s": tokens / span,
            "wan_gb_per_step": sum(r["wan_bytes"] for r in rows) / len(rows) / 1e9,
            "expired_leases": sum(r["expired"] for r in self.rows),
            "sim_time_s": self.sim_time,
        }


class SimulationStalled(RuntimeError):
    """Nothing is left that could ever finish the run (e.g. every Actor is gone)."""


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
        self.ledger = initial_state(
            LedgerConfig(
                trainer_region=topo.trainer.region,
                lease=cfg.lease,
                max_lag=strat.max_lag,
                relays=strat.relays,
            )
        )
        self.fed: list[tuple[float, Event]] = []
        self.decisions: list[list[Action]] = []
        self.trace: list[tuple[float, str, str]] = []
        self.timeline: list[dict[str, Any]] = []
        self.rows: list[dict[str, Any]] = []
        self.finished = self.env.event()

        # Payload sizes (bytes) of one published version.
        dense = self.model.dense_bytes.value
        if strat.payload == "delta":
            self.version_bytes = traces.delta_bytes(topo.trainer.model, strat.codec)
            self.apply_rate = self.consts.apply_bytes_per_s.value
        else:
            self.version_bytes = dense
            self.apply_rate = self.consts.dense_load_bytes_per_s.value
        self.dense_bytes = dense

        # Network resources.
        self.trainer_nic = Resource("trainer", topo.trainer.egress_gbps * GBPS)
        self.resources: list[Resource] = [self.trainer_nic]
        self.wan: dict[frozenset[str], Resource] = {}
        for i, link in enumerate(topo.links):
            res = Resource(f"wan:{link.a}-{link.b}", link.gbps * GBPS)
            self.wan[frozenset((link.a, link.b))] = res
            self.resources.append(res)
            if link.fluctuation is not None:
                self._fluctuate(res, link.fluctuation, i)

        # Nodes.
        self.actors: dict[str, ActorSim] = {}
        self.relays: dict[str, Node] = {}
        self._actor_count = 0
        # Batches.
        total = cfg.batch_rollouts or int(self.consts.rollouts_per_actor.value) * sum(
            g.count for g in topo.actors
        )
        if total % cfg.rollouts_per_lease:
            raise ValueError(
                f"batch of {total} rollouts is not a multiple of rollouts_per_lease "
                f"({cfg.rollouts_per_lease})"
            )
        self.prompts_per_batch = total // cfg.rollouts_per_lease
        self.tokens_per_lease = cfg.rollouts_per_lease * self.tokens_per_rollout
        self.accepted: dict[int, int] = {}
        self.shares: dict[int, dict[str, int]] = {}
        self.gen_versions: dict[int, dict[str, int]] = {}
        self.batch_target: dict[int, int] = {}
        self.batch_done: dict[int, float] = {}
        self.excluded: dict[int, list[str]] = {}
        self.expired = 0
        self.refused = 0
        self._ticks: set[float] = set()
        # Trainer and orchestrator.
        self.next_batch = 1
        self.trained = 0
        self.training = False
        self.crashed = False
        self.trainer_epoch = 0
        self._ready_since: float | None = None
        self._grace_timer = False
        self._waiting: set[str] = set()
        self._published_at: dict[int, float] = {}
        self._carried_at_last_row = [0.0] * len(self.resources)
        self._faults_at_step: dict[int, list[Fault]] = {}
        self._requesting = 0
        self._on_hold: Callable[[str], None] | None = None
        self._train_after_extract = False
        self._outgoing: dict[str, dict[int, Transfer]] = {}
        """Transfers each node is sending, so that losing the node stops them."""
        self._extract_until = 0.0
        self._extract_rate = math.inf

    # ------------------------------------------------------------------------------------
    # Plumbing
    # ------------------------------------------------------------------------------------

    def _log(self, who: str, what: str) -> None:
        if self.cfg.record_trace:
            self.trace.append((round(self.env.now, 6), who, what))

    def _span(self, role: str, who: str, activity: str, version: int, start: float) -> None:
        if self.cfg.record_trace:
            self.timeline.append(
                {
                    "role": role,
                    "who": who,
                    "activity": activity,
                    "version": version,
                    "start": start,
                    "end": self.env.now,
                }
            )

    def _later(self, delay: float, fn: Callable[[], None]) -> None:
        ev = self.env.timeout(delay)
        ev.callbacks.append(lambda _e: fn())

    def feed(self, event: Event) -> None:
        """Report ``event`` to the Ledger at ``env.now`` and carry out its decisions."""
        now = self.env.now
        _, actions = decide(self.ledger, event, now=now)
        self.fed.append((now, event))
        self.decisions.append(actions)
        fallbacks = []
        for action in actions:
            if type(action) is AcceptedAction:  # the common case, kept cheap
                self._accepted(action.actor, action.prompt, action.version)
            elif isinstance(action, FallBack):
                fallbacks.append(action)
            else:
                self._do(action)
        # A new relay's own fallback (to the Trainer) first, so that its region can follow it.
        fallbacks.sort(key=lambda a: a.source in self.actors)
        for action in fallbacks:
            self._fall_back(action)

    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng([self.cfg.seed, *key])

    def _fluctuate(self, res: Resource, fl: Any, index: int) -> None:
        rng = self._rng(1, index)

        def change() -> None:
            self.net.set_capacity(res, float(rng.uniform(fl.low_gbps, fl.high_gbps)) * GBPS)
            self._later(fl.period_s, change)

        change()

    # ------------------------------------------------------------------------------------
    # Run
    # ------------------------------------------------------------------------------------

    def run(self) -> Result:
        self._setup()
        self._try_request()
        self._watchdog(0)
        # The cyclic garbage collector would rescan the Ledger's whole lease history (10^5-10^6
        # long-lived objects) again and again: measured at 60% of a 10^4-Actor run. The model
        # makes few reference cycles (a flow and its transfer), so it runs without it.
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            self.env.run(until=self.finished)
        except RuntimeError as exc:
            if "No scheduled events left" not in str(exc):
                raise
            raise SimulationStalled(self._stall_report()) from None
        finally:
            if was_enabled:
                gc.enable()
        return Result(
            rows=self.rows,
            trace=self.trace,
            timeline=self.timeline,
            fed=self.fed,
            decisions=self.decisions,
            events=next(self.env._eid),  # SimPy's running event id: events scheduled so far
            sim_time=self.env.now,
        )

    def measure_fanout(self) -> float:
        """Seconds for one published version (no extraction: the bytes are ready) to reach
        every Actor through the strategy's transfer path: the paper's per-step transfer cost
        (Fig. 11, Fig. 14). Includes the TCP model, relays and the last hop; excludes apply."""
        self._setup()
        waiting = {a.id for a in self.actors.values()}
        done = self.env.event()

        def held(actor: str) -> None:
            waiting.discard(actor)
            if not waiting and not done.triggered:
                done.succeed()

        self._on_hold = held
        self._extract_until, self._extract_rate = -math.inf, math.inf
        self.feed(
            DeltaPublished(
                version=1, weights_hash=weights_hash(1), delta_bytes=int(self.version_bytes)
            )
        )
        self.env.run(until=done)
        return self.env.now

    def _setup(self) -> None:
        cfg, topo = self.cfg, self.cfg.topology
        snapshot = int(self.dense_bytes)
        self.feed(
            DeltaPublished(
                version=0, weights_hash=weights_hash(0), delta_bytes=None, snapshot_bytes=snapshot
            )
        )
        self._published_at[0] = 0.0
        if cfg.strategy.relays:
            for relay in topo.relays:
                self.relays[relay.id] = Node(
                    relay.id, relay.region, Resource(f"relay:{relay.id}", relay.nic_gbps * GBPS)
                )
                self.relays[relay.id].held.add(0)
                self.feed(RelayJoined(relay=relay.id, region=relay.region))
        for actor_id, group in topo.actor_ids():
            self._new_actor(actor_id, group.region, group.gpu, group.nic_gbps, group.spot, 0)
        for f in cfg.faults:
            if f.at_s is not None:
                self._later(f.at_s, lambda f=f: self._fault(f))
            else:
                assert f.at_step is not None
                self._faults_at_step.setdefault(f.at_step, []).append(f)

    def _watchdog(self, steps_seen: int) -> None:
        def check() -> None:
            if self.trained == steps_seen and not self.finished.triggered:
                raise SimulationStalled(
                    f"no step completed in {self.cfg.stall_after_s:.0f} simulated seconds; "
                    + self._stall_report()
                )
            self._watchdog(self.trained)

        self._later(self.cfg.stall_after_s, check)

    def _stall_report(self) -> str:
        live = sorted(a.id for a in self.actors.values() if a.live)
        return (
            f"the run stalled at t={self.env.now:.1f} s after {self.trained} of "
            f"{self.cfg.steps} steps: batch {self.next_batch} not yet requested, "
            f"{self.ledger.book.pool_size} prompts in the pool, latest version "
            f"{self.ledger.latest}, live Actors {live or 'none'}"
        )

    # ------------------------------------------------------------------------------------
    # Actions
    # ------------------------------------------------------------------------------------

    def _do(self, action: Action) -> None:
        if isinstance(action, Assign):
            actor = self.actors[action.actor]
            actor.queue.append(Work(action.version, action.leases))
            self._log(action.actor, f"assign {len(action.leases)} on v{action.version}")
            self._schedule_tick(action.expiry)
            self._later(0, lambda: self._kick(actor))
        elif isinstance(action, Commit):
            actor = self.actors[action.actor]
            actor.pending_commit = action.version
            self._log(action.actor, f"commit v{action.version}")
            self._later(0, lambda: self._kick(actor))
        elif isinstance(action, Exclude):
            self._log(action.actor, f"excluded from v{action.version} (on v{action.active})")
            self.excluded.setdefault(self._requesting, []).append(action.actor)
        elif isinstance(action, CatchUp):
            self._catch_up(self.actors[action.actor], action.plan)
        elif isinstance(action, Route):
            self.actors[action.actor].source = action.source
        elif isinstance(action, RelayAssigned):
            self._log(action.region, f"relay is {action.relay}")
        elif isinstance(action, Fanout):
            self._fanout(action.version, action.edges)
        else:
            name = type(action).__name__
            if name == "Expired":
                self.expired += 1
            elif name == "Refused":
                self.refused += 1
            self._log(
                getattr(action, "actor", ""), f"{name.lower()} {getattr(action, 'lease', '')}"
            )

    def _schedule_tick(self, expiry: float) -> None:
        if expiry in self._ticks or not math.isfinite(expiry):
            return
        self._ticks.add(expiry)

        def tick() -> None:
            self._ticks.discard(expiry)
            self.feed(Tick())

        self._later(max(0.0, expiry - self.env.now) + _TICK_SLACK_S, tick)

    def _accepted(self, actor: str, prompt: str, version: int) -> None:
        batch = int(prompt[1 : prompt.index("-")])
        self.accepted[batch] = self.accepted.get(batch, 0) + 1
        shares = self.shares.setdefault(batch, {})
        shares[actor] = shares.get(actor, 0) + 1
        self.gen_versions.setdefault(batch, {})[actor] = version
        if self.accepted[batch] == self.prompts_per_batch:
            self.batch_done[batch] = self.env.now
            self._log("trainer", f"batch {batch} complete")
            self._later(0, self._try_train)
            self._later(0, self._try_request)

    # ------------------------------------------------------------------------------------
    # Trainer and orchestrator
    # ------------------------------------------------------------------------------------

    def _try_request(self) -> None:
        cfg = self.cfg
        k = self.next_batch
        if k > cfg.steps or (k > 1 and k - 1 not in self.batch_done):
            return
        w = pacing.batch_version(self.ledger, k)
        if w is None:
            return
        now = self.env.now
        if self._ready_since is None:
            self._ready_since = now
        waiting = pacing.waiting_on(self.ledger, w) if w > 0 else []
        grace = cfg.strategy.staging_grace_s
        if not pacing.request_at(
            ready_since=self._ready_since, waiting=waiting, grace_s=grace, now=now
        ):
            self._waiting = set(waiting)
            if not self._grace_timer and math.isfinite(grace):
                self._grace_timer = True

                def expire() -> None:
                    self._grace_timer = False
                    self._try_request()

                self._later(self._ready_since + grace - now, expire)
            return
        self._ready_since = None
        self._waiting = set()
        self.next_batch = k + 1
        self.batch_target[k] = w
        self._log("trainer", f"request batch {k} on v{w}")
        self._requesting = k
        prompts = tuple(f"s{k}-{i}" for i in range(self.prompts_per_batch))
        self.feed(BatchRequested(version=w, prompts=prompts))
        # Step faults strike once the batch is handed out, so a lost Actor loses its leases.
        for fault in self._faults_at_step.pop(k, []):
            self._fault(fault)

    def _try_train(self) -> None:
        k = self.trained + 1
        if self.training or self.crashed or k > self.cfg.steps or k not in self.batch_done:
            return
        if self.env.now < self._extract_until:
            # The extractor reads the bf16 weights the next optimizer step would change, so the
            # Trainer waits for it (the paper's residual gap to Ideal-SingleDC, §6.2).
            if not self._train_after_extract:
                self._train_after_extract = True
                self._later(self._extract_until - self.env.now, self._resume_after_extract)
            return
        topo = self.cfg.topology
        rate = self.model.train_tokens_per_s_per_gpu[topo.trainer.gpu].value * topo.trainer.gpus
        duration = self.prompts_per_batch * self.tokens_per_lease / rate
        self.training = True
        epoch = self.trainer_epoch
        start = self.env.now
        self._log("trainer", f"train step {k}")

        def done() -> None:
            if epoch != self.trainer_epoch:
                return  # crashed while training: the step is redone after restart
            self.training = False
            self._span("trainer", TRAINER, "train", k, start)
            self._publish(k)
            self._try_train()

        self._later(duration, done)

    def _resume_after_extract(self) -> None:
        self._train_after_extract = False
        self._try_train()

    def _publish(self, v: int) -> None:
        strat = self.cfg.strategy
        now = self.env.now
        self.trained = v
        self._row(v)
        snapshot = int(self.dense_bytes) if v % self.cfg.snapshot_interval == 0 else None
        if strat.payload == "dense":
            extract = 0.0
            snapshot = int(self.dense_bytes)
        elif strat.rdma:
            extract = 0.0
        else:
            extract = self.model.extract_s.value
        event = DeltaPublished(
            version=v,
            weights_hash=weights_hash(v),
            delta_bytes=int(self.version_bytes),
            snapshot_bytes=snapshot,
        )
        self._extract_until = now + extract
        self._extract_rate = self.version_bytes / extract if extract > 0 else math.inf
        if extract > 0:
            self._later(extract, lambda: self._span("trainer", TRAINER, "extract", v, now))
        if strat.cut_through or extract == 0:
            self._log("trainer", f"publish v{v}")
            self.feed(event)
        else:

            def publish() -> None:
                self._log("trainer", f"publish v{v}")
                self.feed(event)
                self._try_request()

            self._later(extract, publish)
        self._published_at[v] = now
        if v >= self.cfg.steps:
            self.finished.succeed()
        self._later(0, self._try_request)

    def _row(self, v: int) -> None:
        now = self.env.now
        prev = self.rows[-1]["time_s"] if self.rows else 0.0
        tokens = self.accepted.get(v, 0) * self.tokens_per_lease
        step_time = now - prev
        self.net.settle()
        carried = [r.carried for r in self.resources]
        by_res = {
            r.name: carried[i] - self._carried_at_last_row[i] for i, r in enumerate(self.resources)
        }
        self._carried_at_last_row = carried
        target = self.batch_target.get(v, 0)
        self.rows.append(
            {
                "step": v,
                "version": v,
                "time_s": now,
                "step_time_s": step_time,
                "tokens": tokens,
                "tokens_per_s": tokens / step_time if step_time > 0 else 0.0,
                "batch_version": target,
                "staleness": v - 1 - target,
                "shares": json.dumps(self.shares.get(v, {}), sort_keys=True),
                "actor_versions": json.dumps(self.gen_versions.get(v, {}), sort_keys=True),
                "excluded": json.dumps(sorted(self.excluded.get(v, []))),
                "expired": self.expired,
                "refused": self.refused,
                "wan_bytes": sum(b for n, b in by_res.items() if n.startswith("wan:")),
                "trainer_bytes": by_res["trainer"],
                "link_bytes": json.dumps({n: round(b) for n, b in by_res.items()}, sort_keys=True),
            }
        )
        self.expired = 0
        self.refused = 0
        if self.progress is not None:
            self.progress(v)

    # ------------------------------------------------------------------------------------
    # Transfers
    # ------------------------------------------------------------------------------------

    def _node(self, node_id: str) -> Node:
        return self.actors.get(node_id) or self.relays[node_id]

    def _path(self, src: str, dst: Node) -> tuple[tuple[Resource, ...], float, float]:
        """Resources, rate cap (bytes/s) and one-way latency (s) from ``src`` to ``dst``."""
        strat, topo = self.cfg.strategy, self.cfg.topology
        if strat.rdma:
            return (), self.consts.rdma_gbps.value * GBPS, 0.0
        if src == TRAINER:
            src_region, src_nic = topo.trainer.region, self.trainer_nic
        else:
            node = self._node(src)
            src_region, src_nic = node.region, node.nic
        cap = dst.nic.capacity
        if src_region == dst.region:
            return (src_nic,), cap, 0.0
        link = topo.link(src_region, dst.region)
        if link is None:
            raise ValueError(f"no link between {src_region!r} and {dst.region!r} in the topology")
        rtt = link.rtt_ms / 1e3
        tcp = tcp_cap(
            streams=strat.streams,
            rtt_s=rtt,
            loss=link.loss,
            window_bytes=self.consts.tcp_window_bytes.value,
            mss_bytes=self.consts.mss_bytes.value,
        )
        return (src_nic, self.wan[frozenset((src_region, dst.region))]), min(cap, tcp), rtt / 2

    def _fanout(self, v: int, edges: tuple[tuple[str, str], ...]) -> None:
        by_src: dict[str, list[str]] = {}
        for src, dst in edges:
            by_src.setdefault(src, []).append(dst)
        # Trainer edges first: relays forward what they receive from it.
        for src in sorted(by_src, key=lambda s: s != TRAINER):
            self._send(v, src, by_src[src])

    def _send(self, v: int, src: str, dsts: list[str], size: float | None = None) -> None:
        """Start sending version ``v`` from ``src`` to ``dsts`` (grouped into cohorts)."""
        size = self.version_bytes if size is None else size
        todo = []
        for d in dsts:
            node = self._node(d)
            if (
                node.live
                and v not in node.held
                and v not in node.inbound
                and not (
                    isinstance(node, ActorSim) and node.active is not None and v <= node.active
                )
            ):
                todo.append(node)
        if not todo:
            return
        strat = self.cfg.strategy
        if src == TRAINER:
            now = self.env.now
            extracting = self._extract_until > now and v == self.trained
            if extracting and strat.cut_through:
                # The first segment must be extracted before it can be sent.
                first = min(self.cfg.segment_bytes, size) / self._extract_rate
                producer = Producer(rate=self._extract_rate, until=self._extract_until)
                self._later(first, lambda: self._start(v, src, todo, size, None, producer))
            elif extracting:
                self._later(self._extract_until - now, lambda: self._start(v, src, todo, size))
            else:
                self._start(v, src, todo, size)
            return
        holder = self._node(src)
        if v in holder.held:
            self._start(v, src, todo, size)
        elif v in holder.inbound and strat.cut_through:
            self._forward_when_first_segment(v, src, todo, size, holder.inbound[v].flow)
        else:
            # Store-and-forward, or the source has not started receiving yet: forward cut-through
            # when its inbound starts, or whole once it holds the version, whichever comes first.
            fired = [False]

            def once(fn: Callable[[], None]) -> Callable[[], None]:
                def run() -> None:
                    if not fired[0]:
                        fired[0] = True
                        fn()

                return run

            holder.waiters.setdefault(v, []).append(once(lambda: self._start(v, src, todo, size)))
            if strat.cut_through:
                holder.starters.setdefault(v, []).append(
                    once(
                        lambda: self._forward_when_first_segment(
                            v, src, todo, size, holder.inbound[v].flow
                        )
                    )
                )

    def _forward_when_first_segment(
        self, v: int, src: str, todo: list[Node], size: float, up: Flow
    ) -> None:
        # A relay verifies a segment before forwarding it: the first must arrive whole.
        first = min(self.cfg.segment_bytes, size) / max(up.rate, 1.0) + up.latency
        self._later(first, lambda: self._start(v, src, todo, size, up))

    def _start(
        self,
        v: int,
        src: str,
        dsts: list[Node],
        size: float,
        upstream: Flow | None = None,
        producer: Producer | None = None,
    ) -> None:
        if src != TRAINER and not self._node(src).live:
            return  # the source died before it could forward; FallBack re-routes these Actors
        live = [
            d
            for d in dsts
            if d.live
            and v not in d.held
            and v not in d.inbound
            # An Actor re-routed since this send was scheduled gets it from its new source.
            and (not isinstance(d, ActorSim) or d.source == src)
        ]
        groups: dict[tuple[Any, ...], list[Node]] = {}
        for d in live:
            path, cap, latency = self._path(src, d)
            groups.setdefault((path, cap, latency), []).append(d)
        for (path, cap, latency), members in groups.items():
            if upstream is not None and not upstream.active:
                upstream = None
            transfer = Transfer(v, src, [m.id for m in members], None)  # type: ignore[arg-type]
            label = f"v{v} {src}->{members[0].id}" + (
                f"+{len(members) - 1}" if len(members) > 1 else ""
            )
            start = self.env.now
            transfer.flow = self.net.start(
                label,
                size,
                path,
                cap=cap,
                mult=len(members),
                upstream=upstream,
                producer=producer,
                latency=latency,
                on_done=lambda _f, t=transfer, s=start, c=cap, u=upstream: self._forwarded(
                    t, s, c, u
                ),
            )
            self._outgoing.setdefault(src, {})[id(transfer)] = transfer
            for m in members:
                m.inbound[v] = transfer
                for fn in m.starters.pop(v, []):
                    fn()

    def _forwarded(self, transfer: Transfer, start: float, cap: float, up: Flow | None) -> None:
        """A forward's last byte cannot arrive before the relay has received and verified the
        last segment: no earlier than the upstream's arrival plus one segment at this rate."""
        if up is not None and up.finished is not None:
            due = up.finished + up.latency + min(self.cfg.segment_bytes, transfer.flow.size) / cap
            if due > self.env.now:
                self._later(due - self.env.now, lambda: self._arrived(transfer, start))
                return
        self._arrived(transfer, start)

    def _arrived(self, transfer: Transfer, start: float) -> None:
        self._outgoing.get(transfer.src, {}).pop(id(transfer), None)
        v = transfer.version
        if transfer.members:
            src = transfer.src
            who = transfer.members[0] + (
                f" +{len(transfer.members) - 1}" if len(transfer.members) > 1 else ""
            )
            self._span("transfer", f"{src}->{who}", "transfer", v, start)
        for member in transfer.members:
            node = self._node(member)
            if node.inbound.get(v) is not transfer or not node.live:
                continue
            del node.inbound[v]
            node.held.add(v)
            self._log(member, f"received v{v} from {transfer.src}")
            for fn in node.waiters.pop(v, []):
                fn()
            if isinstance(node, ActorSim):
                if self._on_hold is not None:
                    self._on_hold(member)
                self._staged(node, v)

    def _staged(self, actor: ActorSim, v: int) -> None:
        if actor.active is not None and v > actor.active:
            self.feed(DeltaStaged(actor=actor.id, version=v))
            self._no_longer_waited_for(actor)
        self._kick(actor)

    def _no_longer_waited_for(self, actor: ActorSim) -> None:
        """``actor`` staged, activated or caught up: a batch waiting for it may start now."""
        if actor.id in self._waiting:
            self._waiting.discard(actor.id)
            if not self._waiting:
                self._try_request()

    def _fall_back(self, action: FallBack) -> None:
        actor = self.actors[action.actor]
        actor.source = action.source
        self._log(actor.id, f"fall back to {action.source} (lost {action.lost})")
        for v, transfer in sorted(actor.inbound.items()):
            if transfer.src != action.lost:
                continue
            transfer.members.remove(actor.id)
            if not transfer.members:
                self.net.cancel(transfer.flow)
            # Segments already verified are kept: only the rest is fetched again.
            left = transfer.flow.remaining
            del actor.inbound[v]
            self._send(v, action.source, [actor.id], size=left)
        # Forwards the lost source had scheduled but not started (or was holding back until it
        # had the whole version) are owed by the new source.
        latest = self.ledger.latest
        if latest is not None and actor.active is not None:
            for v in range(actor.active + 1, latest + 1):
                if v not in actor.held and v not in actor.inbound:
                    self._send(v, action.source, [actor.id])

    def _drop_node(self, node: Node) -> None:
        """``node`` is gone: stop everything it receives and sends."""
        node.live = False
        for transfer in list(node.inbound.values()):
            if node.id in transfer.members:
                transfer.members.remove(node.id)
            if not transfer.members:
                self.net.cancel(transfer.flow)
        node.inbound.clear()
        node.waiters.clear()
        node.starters.clear()
        for transfer in self._outgoing.pop(node.id, {}).values():
            self.net.cancel(transfer.flow)  # FallBack re-routes its receivers

    # ------------------------------------------------------------------------------------
    # Actors
    # ------------------------------------------------------------------------------------

    def _new_actor(
        self, actor_id: str, region: str, gpu: str, nic_gbps: float, spot: bool, active: int | None
    ) -> None:
        model = self.cfg.topology.trainer.model
        trace = self.cfg.traces.gpu(gpu, model)
        actor = self.actors.get(actor_id)
        if actor is None:
            self._actor_count += 1
            actor = ActorSim(
                id=actor_id,
                region=region,
                nic=Resource(f"nic:{actor_id}", nic_gbps * GBPS),
                gpu=gpu,
                rate=trace.tokens_per_s[model].value,
                spot=spot,
                index=self._actor_count,
                rng=self._rng(2, self._actor_count),
            )
            self.actors[actor_id] = actor
        else:
            # A returning machine: fresh, with nothing loaded.
            actor.live, actor.busy, actor.epoch = True, False, actor.epoch + 1
            actor.draining = False
            actor.held, actor.inbound, actor.waiters, actor.starters = set(), {}, {}, {}
            actor.queue.clear()
            actor.pending_commit, actor.plan, actor.pulling = None, None, set()
        actor.active = active
        if active is not None:
            actor.held.add(active)
        self._log(actor_id, f"join on {'v' + str(active) if active is not None else 'nothing'}")
        self.feed(ActorJoined(actor=actor_id, region=region, active=active))
        if spot and self.cfg.spot_hazard_per_hour > 0:
            assert actor.rng is not None
            wait = float(actor.rng.exponential(3600.0 / self.cfg.spot_hazard_per_hour))
            epoch = actor.epoch

            def preempt() -> None:
                if actor.epoch != epoch or not actor.live:
                    return
                notice = self.cfg.spot_notice_s
                kind = "preempt" if notice is None else "preempt_notice"
                self._fault(Fault(kind=kind, target=actor_id, at_s=0.0, notice_s=notice or 0.0))
                if self.cfg.spot_return_s is not None:
                    back = self.cfg.spot_return_s + (notice or 0.0)
                    self._later(
                        back, lambda: self._new_actor(actor_id, region, gpu, nic_gbps, spot, None)
                    )

            self._later(wait, preempt)

    def _kick(self, actor: ActorSim) -> None:
        """A safe point: what to do next is :func:`aurora.policy.actor.next_action`'s call."""
        if not actor.live or actor.busy:
            return
        while True:
            decision = actor_policy.next_action(
                active=actor.active,
                staged=actor.held,
                snapshots=actor.held,
                queue=actor.queue,
                plan=actor.plan,
                pending_commit=actor.pending_commit,
            )
            if type(decision) is Generate:
                actor.queue.popleft()
                self._generate(actor, decision.work.version, decision.work.leases)
            elif type(decision) is Activate:
                self._activate(actor, decision.version)
            elif type(decision) is ApplyPlan:
                self._apply_plan(actor, decision.plan)
            elif type(decision) is Drop:
                # Its leases will expire back to the pool, where others can take them.
                actor.queue.popleft()
                work = decision.work
                self._log(actor.id, f"cannot run {len(work.leases)} leases on v{work.version}")
                continue
            return

    def _occupy(self, actor: ActorSim, seconds: float, then: Callable[[float], None]) -> None:
        """Keep ``actor`` busy for ``seconds``, then call ``then(start)`` unless the machine was
        lost (or replaced) meanwhile."""
        actor.busy = True
        epoch = actor.epoch
        start = self.env.now

        def done() -> None:
            if epoch == actor.epoch:
                actor.busy = False
                then(start)

        self._later(seconds, done)

    def _activate(self, actor: ActorSim, v: int) -> None:
        def done(start: float) -> None:
            actor.active = v
            if actor.pending_commit is not None and actor.pending_commit <= v:
                actor.pending_commit = None
            self._span("actor", actor.id, "apply", v, start)
            self._log(actor.id, f"activate v{v}")
            self.feed(VersionActivated(actor=actor.id, version=v))
            self._no_longer_waited_for(actor)
            self._kick(actor)

        # RDMA (Ideal-SingleDC) writes the broadcast straight into the engine's GPU memory.
        self._occupy(
            actor, 0.0 if self.cfg.strategy.rdma else self.version_bytes / self.apply_rate, done
        )

    def _catch_up(self, actor: ActorSim, plan: CatchUpPlan) -> None:
        actor.plan = plan
        self._log(
            actor.id,
            f"catch up to v{plan.target}"
            + (f" from snapshot v{plan.snapshot}" if plan.snapshot is not None else "")
            + f" + {len(plan.deltas)} deltas",
        )

        in_flight = actor.pulling | actor.inbound.keys()
        snapshot, deltas = actor_policy.to_fetch(
            plan, staged=actor.held, snapshots=actor.held, in_flight=in_flight
        )
        wanted = list(deltas)
        size = sum(self.version_bytes for _ in wanted)
        if snapshot is not None:
            size += self.dense_bytes
            wanted.append(snapshot)
        if not wanted:
            self._kick(actor)
            return
        # Pull from the Checkpoint Store in the Trainer's region: a request round trip first.
        path, cap, latency = self._path(TRAINER, actor)
        actor.pulling.update(wanted)
        epoch = actor.epoch
        start = self.env.now

        def fetched(_f: Flow) -> None:
            if epoch != actor.epoch:
                return
            actor.pulling.difference_update(wanted)
            actor.held.update(wanted)
            self._span("transfer", f"store->{actor.id}", "catch-up", plan.target, start)
            self._kick(actor)

        self.net.start(
            f"v{plan.target} store->{actor.id}",
            size,
            path,
            cap=cap,
            latency=3 * latency,
            on_done=fetched,
        )

    def _apply_plan(self, actor: ActorSim, plan: CatchUpPlan) -> None:
        seconds = len(plan.deltas) * self.version_bytes / self.apply_rate
        if plan.snapshot is not None:
            seconds += self.dense_bytes / self.consts.dense_load_bytes_per_s.value

        def done(start: float) -> None:
            epoch = actor.epoch
            actor.plan = None
            actor.active = plan.target
            actor.pending_commit = None
            keep, restage = actor_policy.after_catch_up(
                plan, queue=actor.queue, staged=actor.held
            )
            actor.queue = deque(keep)
            self._span("actor", actor.id, "catch-up", plan.target, start)
            self._log(actor.id, f"caught up to v{plan.target}")
            self.feed(CaughtUp(actor=actor.id, version=plan.target))
            # Versions that arrived during the catch-up are staged on top of it.
            for v in restage:
                if actor.live and actor.epoch == epoch:
                    self.feed(DeltaStaged(actor=actor.id, version=v))
            self._no_longer_waited_for(actor)
            self._kick(actor)

        self._occupy(actor, seconds, done)

    def _generate(self, actor: ActorSim, version: int, leases: tuple[str, ...]) -> None:
        assert actor.rng is not None
        trace = self.cfg.traces.gpus[actor.gpu]
        tokens = len(leases) * self.tokens_per_lease
        cv = trace.cv.value
        sigma = math.sqrt(math.log1p(cv * cv))
        noise = float(np.exp(actor.rng.normal(-sigma * sigma / 2, sigma))) if cv > 0 else 1.0
        drift = 1.0 + trace.drift_per_hour.value * self.env.now / 3600.0
        rate = actor.rate * noise * max(drift, 0.05)
        seconds = tokens / rate

        def done(start: float) -> None:
            self._span("actor", actor.id, "generate", version, start)
            h = weights_hash(version)
            for lease in leases:
                self.feed(
                    ResultArrived(actor=actor.id, lease=lease, version=version, weights_hash=h)
                )
            if self.cfg.strategy.proportional:
                self.feed(
                    ThroughputObserved(
                        actor=actor.id, tokens=max(1, round(tokens)), seconds=seconds
                    )
                )
            self._kick(actor)

        self._occupy(actor, seconds, done)

    # ------------------------------------------------------------------------------------
    # Faults
    # ------------------------------------------------------------------------------------

    def _fault(self, f: Fault) -> None:
        self._log("faults", f"{f.kind} {f.target}".rstrip())
        if f.kind == "trainer_crash":
            self._crash_trainer()
        elif f.kind in ("preempt", "leave"):
            actor = self._live_actor(f)
            if actor is not None:
                self._lose(actor, graceful=f.kind == "leave")
        elif f.kind == "preempt_notice":
            actor = self._live_actor(f)
            if actor is not None and not actor.draining:  # one notice per machine
                actor.draining = True
                self.feed(PreemptionNotice(actor=actor.id, deadline=self.env.now + f.notice_s))
                epoch = actor.epoch
                self._later(
                    f.notice_s,
                    lambda: self._lose(actor, graceful=True) if actor.epoch == epoch else None,
                )
        elif f.kind == "join":
            group = ActorGroup(region=f.region, gpu=f.gpu)
            self._new_actor(f.target, f.region, f.gpu, group.nic_gbps, False, None)
        elif f.kind == "region_loss":
            for actor in sorted(self.actors.values(), key=lambda a: a.id):
                if actor.region == f.target and actor.live:
                    self._lose(actor, graceful=False)
            for relay in sorted(self.relays.values(), key=lambda r: r.id):
                if relay.region == f.target and relay.live:
                    self._lose_relay(relay)
        elif f.kind == "relay_fail":
            if f.target in self.relays:
                if self.relays[f.target].live:
                    self._lose_relay(self.relays[f.target])
            elif f.target in self.actors:
                actor = self.actors[f.target]
                if actor.live:
                    self._lose(actor, graceful=False)
            else:
                raise ValueError(f"fault relay_fail: unknown relay or Actor {f.target!r}")

    def _live_actor(self, f: Fault) -> ActorSim | None:
        if f.target not in self.actors:
            raise ValueError(f"fault {f.kind}: unknown Actor {f.target!r}")
        actor = self.actors[f.target]
        return actor if actor.live else None

    def _lose(self, actor: ActorSim, *, graceful: bool) -> None:
        actor.epoch += 1
        actor.busy = False
        actor.queue.clear()
        actor.plan, actor.pulling, actor.pending_commit = None, set(), None
        self._drop_node(actor)
        self._waiting.discard(actor.id)  # (_try_request below re-evaluates the wait)
        self._log(actor.id, "left" if graceful else "lost")
        self.feed(ActorLeft(actor=actor.id) if graceful else ActorLost(actor=actor.id))
        if self._ready_since is not None:
            self._try_request()

    def _lose_relay(self, relay: Node) -> None:
        self._drop_node(relay)
        self._log(relay.id, "relay lost")
        self.feed(RelayLost(relay=relay.id))

    def _crash_trainer(self) -> None:
        self.trainer_epoch += 1
        self.training = False
        self.crashed = True

        def restart() -> None:
            self.crashed = False
            self._log("trainer", "restarted")
            self._try_train()

        self._later(self.consts.trainer_restart_s.value, restart)


def simulate(cfg: SimConfig) -> Result:
    """Run one configuration and return its rows, trace and recorded decisions."""
    return Simulation(cfg).run()
