"""From a topology YAML to a job: which processes run where, and the spec every role reads.

Theory of operation
-------------------
``aurora real`` and each role subcommand read the same YAML as ``aurora sim``. Its ``real:``
section (:class:`aurora.topology.RealSpec`, every field with a default) says how to run it on real
processes. :func:`plan_processes` turns it into a :class:`ProcessPlan`: the Actors (ids and
regions, the topology's groups scaled to ``real.actors`` for one host) and the relays (one
standalone relay per remote region, or none when a seed Actor relays). :func:`make_spec` builds
the **job spec** (:class:`JobSpec`, frozen): everything a peer needs to take part, handed out by
the Ledger, so an Actor on another host needs nothing but the Ledger's address and the job's
secret and public key. Strategies keep the simulator's names and meanings
(:data:`REAL_STRATEGIES`).
"""

from __future__ import annotations

import ipaddress
import math
import secrets
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from aurora.jobspec import JobSpec, StrategySpec
from aurora.policy.verification import VerificationConfig
from aurora.strategies import strategy
from aurora.topology import Topology
from aurora.transport.config import TransportConfig

REAL_STRATEGIES = (
    "aurora",
    "aurora-norelay",
    "prime-full",
    "prime-async2",
    "prime-async4",
    "ideal-singledc",
)
"""Strategies ``aurora real`` runs (the simulator has more: its ablations). ``aurora-norelay``
starts no relay process and the Ledger routes every Actor to the Trainer (the held-out
validation's relay-off case, ``experiments.heldout``).

Strategies keep the simulator's names and meanings (:func:`aurora.strategies.strategy`): ``aurora``
sends sparse deltas through relays over S streams with a one-step lag; ``prime-full`` a dense
bf16 copy every step, one stream, store-and-forward relays, and waits for the weights;
``prime-async2/4`` the same with a lag bound of 2/4; ``ideal-singledc`` is ``aurora`` with no
link shaping (on loopback they are the same run)."""


@dataclass(frozen=True, kw_only=True)
class ActorPlan:
    id: str
    """Actor id (as in the topology: ``<group prefix>-<i>``)."""
    region: str
    """Region it runs in."""
    engine: str
    """Inference engine."""


@dataclass(frozen=True, kw_only=True)
class ProcessPlan:
    """The processes of one job, besides the Trainer (which hosts the Ledger)."""

    actors: tuple[ActorPlan, ...]
    relays: tuple[tuple[str, str], ...]
    """(relay id, region) of every standalone relay process."""
    scaled_from: int
    """Actors in the topology, before scaling to ``real.actors``."""


def scale_counts(counts: list[int], total: int | None) -> list[int]:
    """Scale group sizes to ``total`` (at least one per group, largest remainder)."""
    have = sum(counts)
    if total is None or total >= have:
        return list(counts)
    total = max(total, len(counts))
    exact = [c * total / have for c in counts]
    out = [max(1, math.floor(x)) for x in exact]
    order = sorted(range(len(counts)), key=lambda i: (out[i] - exact[i], i))
    i = 0
    while sum(out) < total:
        out[order[i % len(order)]] += 1
        i += 1
    while sum(out) > total:
        j = max(range(len(out)), key=lambda k: (out[k], -k))
        out[j] -= 1
    return out


def plan_processes(
    topology: Topology, *, actors: int | None = None, relays: bool = True
) -> ProcessPlan:
    """Actors and relays to start for ``topology`` (``actors`` overrides ``real.actors``;
    ``relays`` False: a strategy without relays, none are started)."""
    real = topology.real
    want = actors if actors is not None else real.actors
    counts = scale_counts([g.count for g in topology.actors], want)
    plan = []
    for group, n in zip(topology.actors, counts, strict=True):
        for i in range(n):
            plan.append(
                ActorPlan(
                    id=f"{group.prefix}-{i}",
                    region=group.region,
                    engine=group.engine or real.engine,
                )
            )
    standalone: list[tuple[str, str]] = []
    if relays and real.relays == "standalone":
        remote = sorted({a.region for a in plan} - {topology.trainer.region})
        named = {r.region: r.id for r in topology.relays}
        standalone = [(named.get(region, f"relay-{region}"), region) for region in remote]
    return ProcessPlan(
        actors=tuple(plan),
        relays=tuple(standalone),
        scaled_from=sum(g.count for g in topology.actors),
    )


def strategy_spec(name: str) -> StrategySpec:
    """The transfer strategy ``name`` as the runtime needs it (same meanings as the simulator)."""
    if name not in REAL_STRATEGIES:
        raise ValueError(
            f"--strategy: {name!r} does not run on real processes (one of "
            f"{', '.join(REAL_STRATEGIES)}; the simulator's ablations are simulator-only)"
        )
    s = strategy(name)
    dense = s.payload == "dense" and not s.rdma
    return StrategySpec(
        name=s.name,
        payload="dense" if dense else "delta",
        codec=s.codec if not dense else None,
        streams=s.streams if not s.rdma else 4,
        relays=s.relays,
        max_lag=s.max_lag,
        cut_through=s.cut_through if not s.rdma else True,
        staging_grace_s=s.staging_grace_s if not s.rdma else 10.0,
        shaped=not s.rdma,
    )


JOB_NONCE_BYTES = 8
"""Random bytes in every job id (64 bits: two jobs never share an id by chance)."""


def job_id(topology: Topology, strategy: str, seed: int, *, nonce: str | None = None) -> str:
    """One run's job id (the scope of its signed announcements): readable name, strategy and
    seed, then a random nonce. Without the nonce the id was a function of (name, strategy,
    seed), so with reused keys one run's signed announcements verified in the next. A role
    that restarts keeps the id it was given (``job.json``), it never derives it again."""
    nonce = secrets.token_hex(JOB_NONCE_BYTES) if nonce is None else nonce
    return f"{topology.name}-{strategy}-s{seed}-{nonce}"


def loopback(host: str) -> bool:
    """Whether an address to listen on is reachable from this host only: ``localhost``, and
    127.0.0.0/8 and ::1. Any other name or address (``0.0.0.0``, ``""``: every interface) is
    reachable from others."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def resolve_actors(explicit: str | None, listen: Sequence[str]) -> str:
    """Where a job's Actors come from (:attr:`JobSpec.actors`): ``explicit`` when the job says
    so (a tunnel or a proxy can bring other hosts to a loopback address), else ``remote`` iff
    the control plane (the Ledger the Actors join: the Trainer's own, or a standalone one) or
    the Trainer listens on, or is advertised at, an address other hosts reach."""
    if explicit is not None:
        return explicit
    return "local" if all(loopback(h) for h in listen) else "remote"


def unverified_warning(spec: JobSpec) -> str | None:
    """The line every role logs at start when Actors from other hosts are trained on unchecked
    (``verify: false`` on a ``remote`` job: an explicit opt-out), else None."""
    if spec.actors != "remote" or spec.verify:
        return None
    why = (
        "verify: false"
        if spec.backend == "rl"
        else f"the {spec.backend} backend cannot recompute log-probs"
    )
    return (
        f"verification is off ({why}) though this job's Actors join from other hosts: their "
        "results are trained on unchecked (docs/VERIFICATION.md)"
    )


def make_spec(
    topology: Topology,
    *,
    strategy: str,
    seed: int,
    steps: int | None,
    store: str,
    backend: str = "rl",
    extra: dict[str, Any] | None = None,
    listen: Sequence[str] | None = None,
) -> JobSpec:
    """The job spec: everything an Actor or relay needs to take part (model, task, sampling,
    strategy, store URL, job id). The Trainer registers it with the Ledger and the Ledger hands
    it to each peer that joins, so an Actor on another host needs nothing but the Ledger's
    address, the job secret and the job's public key. On the wire and in files it is
    :meth:`JobSpec.encode`'s JSON-ready dict, read back by :meth:`JobSpec.decode` (which refuses
    an unknown key): the one place its keys are spelled.

    ``extra`` sets backend settings (fields of
    :class:`JobSpec` with a default). ``listen``: the addresses the job's Trainer and Ledger
    listen on and are advertised at (None: ``real.host``, where ``aurora real`` starts every
    role), which decide :attr:`JobSpec.actors` unless ``extra`` names it; ``verify``, unless
    ``extra`` or the topology's ``real.verify`` names it, is on iff the Actors are ``remote``
    and the backend can recompute (``rl``)."""
    real = topology.real
    strat = strategy_spec(strategy)
    extra = dict(extra or {})
    actors = resolve_actors(extra.pop("actors", None), [real.host] if listen is None else listen)
    verify = extra.pop("verify", real.verify)
    if verify is None:
        verify = actors == "remote" and backend == "rl"
    spec: dict[str, Any] = {
        "job_id": job_id(topology, strategy, seed),
        "name": topology.name,
        "backend": backend,
        "model": real.model,
        "engine": real.engine,
        "device": real.device,
        "task": real.task,
        "regime": real.regime,
        "learning_rate": real.learning_rate,
        "seed": seed,
        "steps": steps if steps is not None else real.steps,
        "prompts_per_step": real.prompts_per_step,
        "group_size": real.group_size,
        "max_new_tokens": real.max_new_tokens,
        "temperature": real.temperature,
        "snapshot_interval": real.snapshot_interval,
        "digest_interval": real.digest_interval
        if real.digest_interval is not None
        else (1 if real.device == "cpu" else 10),
        "lease_initial_s": real.lease_initial_s,
        "threads": real.threads_per_process,
        "eval_prompts": real.eval_prompts,
        "store": store,
        "trainer_region": topology.trainer.region,
        "strategy": asdict(strat),
        "window_s": real.window_s,
        "congestion": topology.congestion,
        "actors": actors,
        "verify": verify,
    }
    spec.update(extra)
    if "dense_bytes" in spec:
        return JobSpec.decode(spec)
    # The model's size follows from the other fields: decode with 0, then fill it in.
    job = JobSpec.decode({**spec, "dense_bytes": 0})
    return replace(job, dense_bytes=dense_bytes(job))


def verification_config(spec: JobSpec) -> VerificationConfig | None:
    """The job's verification rule (the Ledger decides with it, the Trainer judges its
    recomputes with it: one config from one spec); None when the job does not verify."""
    if not spec.verify:
        return None
    changes: dict[str, Any] = {}
    if spec.verify_fraction is not None:
        changes["fraction"] = spec.verify_fraction
        changes["min_fraction"] = min(spec.verify_fraction, VerificationConfig.min_fraction)
    if spec.verify_probation is not None:
        changes["probation"] = spec.verify_probation
    return VerificationConfig(**changes)


def digest_due(spec: JobSpec, version: int) -> bool:
    """Whether the Trainer and the Actors compute the content digest of version ``version``
    (every ``digest_interval`` versions, version 0 and every snapshot version); the Ledger
    compares digests only where both sides sent one. One rule for both sides, here."""
    return version % spec.digest_interval == 0 or version % spec.snapshot_interval == 0


def dense_bytes(spec: JobSpec) -> int:
    """bf16 bytes of the job's model (what a dense broadcast sends per step)."""
    if spec.backend == "standin":
        from aurora.runtime.standin import standin_shapes

        shapes = standin_shapes(spec.standin_hidden)
        return sum(2 * math.prod(s) for s in shapes.values())
    if spec.backend == "shapes":
        from aurora.runtime.shapes import dense_bytes as shapes_dense_bytes

        return shapes_dense_bytes(spec.model)
    from aurora.runtime.rlbackend import model_dense_bytes

    return model_dense_bytes(spec)


def cache_versions(max_lag: int) -> int:
    """Versions a node keeps in memory to serve late subscribers and re-fetches: the lag bound
    plus the one being published and one in flight, at least 8."""
    return max(8, max_lag + 2)


def transport_config(
    spec: JobSpec,
    *,
    secret: bytes,
    public_key: bytes,
    overrides: dict[str, Any] | None = None,
) -> TransportConfig:
    """The data plane's settings for any role of the job (Trainer, relay, Actor): streams,
    cut-through and cache from the job's strategy (cut-through only matters where a node
    forwards), the congestion control from the job, ``overrides`` last (a fault hook's
    store-and-forward relay)."""
    strat = spec.strategy
    settings: dict[str, Any] = {
        "congestion": spec.congestion,
        "streams": strat.streams,
        "cut_through": strat.cut_through,
        "cache_versions": cache_versions(strat.max_lag),
        **(overrides or {}),
    }
    return TransportConfig(secret=secret, job=spec.job_id, public_key=public_key, **settings)
