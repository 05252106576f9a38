"""A recorded run's folder of simulator inputs, written, and read back as a configuration.

Theory of operation
-------------------
:func:`record_run` writes ``<run>/sim/``: ``trace.yaml`` (:mod:`sim.runtrace.trace`),
``topology.yaml`` (the deployment as the run had it: the Actors and relays it started, the links
as configured after the emulation's scaling, or the host's loopback as probed) and
``replay.json`` (strategy, steps, seed, batch and lease settings, whether the Checkpoint Store
was a directory on the host, the faults as they struck with a join at the time the Ledger saw
it, each link's rate schedule as the emulator applied it, and the measurements behind the
trace). Each file loads back as it is replayed, so a bad record fails when it is written;
:func:`replay_config` turns the folder into a :class:`sim.config.SimConfig`.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from aurora.faults import parse_fault
from aurora.policy.leases import LeaseConfig
from aurora.topology import CONGESTION, Topology, load_topology
from aurora.traces import Traces, load_traces
from sim.config import RateSchedule, SimConfig, strategy
from sim.runtrace.loopback import LOOPBACK
from sim.runtrace.measurements import measurements
from sim.runtrace.run import RunFolderError, RunRecord, read_run
from sim.runtrace.trace import ACTOR_GPU, TRAINER_GPU, model_id, trace_data


def _source_topology(rec: RunRecord) -> Topology:
    path = Path(rec.job["topology"])
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, _REPO / path]
    for p in candidates:
        if p.exists():
            return load_topology(p)
    raise RunFolderError(f"{rec.path}/job.json: topology {rec.job['topology']!r} not found")


_REPO = Path(__file__).resolve().parent.parent.parent


def topology_data(rec: RunRecord) -> dict[str, Any]:
    """The deployment as the run had it (see the module docstring)."""
    src = _source_topology(rec)
    regions = [{"name": r.name, "lan_gbps": r.lan_gbps} for r in src.regions]
    links = []
    emu = rec.emulation
    if emu is not None:
        seen = set()
        for lk in emu["links"]:
            pair = frozenset((lk["a"], lk["b"]))
            if pair in seen:
                continue  # one object per direction; the simulator's link is both
            seen.add(pair)
            link: dict[str, Any] = {
                "a": lk["a"],
                "b": lk["b"],
                "gbps": float(lk["gbps"]),
                "rtt_ms": float(lk["rtt_ms"]),
                "loss": float(lk.get("loss") or 0.0),
            }
            if lk.get("fluctuation"):
                link["fluctuation"] = dict(lk["fluctuation"])
            links.append(link)
    else:
        if rec.loopback is None:
            raise RunFolderError(
                f"{rec.path}: a loopback run needs {LOOPBACK} (the host's loopback as probed: "
                "sim.runtrace.loopback.probe_loopback) to be replayed"
            )
        gbps, rtt = float(rec.loopback["gbps"]), float(rec.loopback["rtt_ms"])
        # Every role runs on this host: each "WAN link" and each region's LAN is its loopback.
        links = [
            {"a": lk.a, "b": lk.b, "gbps": gbps, "rtt_ms": max(rtt, 1e-3), "loss": 0.0}
            for lk in src.links
        ]
        regions = [{"name": r.name, "lan_gbps": gbps} for r in src.regions]
    by_group: dict[tuple[str, str], int] = {}
    for a in rec.job["actors"]:
        prefix = a["id"].rsplit("-", 1)[0]
        by_group[(a["region"], prefix)] = by_group.get((a["region"], prefix), 0) + 1
    nic = {g.prefix: g.nic_gbps for g in src.actors}
    actors = [
        {
            "region": region,
            "gpu": ACTOR_GPU,
            "count": n,
            "name": prefix,
            "nic_gbps": nic.get(prefix, 25.0),
        }
        for (region, prefix), n in by_group.items()
    ]
    relays = [{"region": region, "name": rid} for rid, region in rec.job.get("relays", [])]
    congestion = run_congestion(rec)
    return {
        "name": src.name,
        "trainer": {
            "region": src.trainer.region,
            "model": model_id(rec),
            "gpu": TRAINER_GPU,
            "gpus": 1,
            "egress_gbps": src.trainer.egress_gbps,
        },
        "regions": regions,
        "links": links,
        "actors": actors,
        "relays": relays,
        **({"congestion": congestion} if congestion else {}),
    }


def run_congestion(rec: RunRecord) -> str | None:
    """The congestion control the run's data plane used: the job's, else the emulated
    regions' default (``emulation.json``), else None (a loopback run on the host's default,
    where loss never enters)."""
    if rec.spec.congestion:
        return rec.spec.congestion
    tcp = (rec.emulation or {}).get("tcp") or {}
    cc = str(tcp.get("tcp_congestion_control", "")).strip()
    return cc if cc in CONGESTION else None


def replay_data(rec: RunRecord, m: dict[str, Any]) -> dict[str, Any]:
    """Settings of the replay and the detailed record behind the trace."""
    spec = rec.spec
    faults = []
    joined = {j["actor"]: j["joined_s"] for j in m["joins"] if j["joined_s"] is not None}
    for when, text in rec.faults:
        f = parse_fault(text)
        if f.kind == "join":
            f = replace(f, gpu=ACTOR_GPU)
            if f.target in joined:
                # The injector starts a process; it joins once Python, the engine and its
                # connections are up (recorded.joins: struck_s -> joined_s). The simulator's
                # machine exists at once, so the replay joins it when the Ledger saw it join.
                f = replace(f, at_s=max(0.0, joined[f.target]), at_step=None)
                faults.append(f.spec())
                continue
        if f.at_s is not None:
            # The injector's clock starts with the launcher; the replay's at the first batch.
            f = replace(f, at_s=max(0.0, when))
        faults.append(f.spec())
    schedules = []
    emu = rec.emulation or {}
    for name, points in sorted((emu.get("rate_schedule") or {}).items()):
        schedules.append(
            {
                "link": name,
                "points": [[float(p["unix"]) - rec.t0, float(p["gbps"])] for p in points],
            }
        )
    probed = [
        {
            k: lk.get(k)
            for k in (
                "a",
                "b",
                "gbps",
                "rtt_ms",
                "loss",
                "measured_rtt_ms",
                "measured_gbps",
                "mechanism",
            )
        }
        for lk in emu.get("links", [])
    ]
    return {
        "run": str(rec.path),
        "strategy": rec.strategy,
        "steps": spec.steps,
        "seed": spec.seed,
        "workload": spec.task,
        "batch_rollouts": spec.prompts_per_step * spec.group_size,
        "rollouts_per_lease": spec.group_size,
        "snapshot_interval": spec.snapshot_interval,
        "lease_initial_s": spec.lease_initial_s,
        "faults": faults,
        "store_local": "://" not in spec.store,
        "rate_schedules": schedules,
        "emulated": rec.emulation is not None,
        "link_scale": rec.summary.get("link_scale"),
        "backend": spec.backend,
        "recorded": {
            **m,
            "links_probed": probed,
            "loopback": rec.loopback,
            "t0_unix": rec.t0,
            "git_sha": rec.summary.get("git_sha"),
        },
    }


def record_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write ``trace.yaml``, ``topology.yaml`` and ``replay.json`` for a finished run (into
    ``<run>/sim/`` unless ``out`` says where); return the folder. Each loads back as it is
    replayed (the trace with :func:`aurora.traces.load_traces`), so a bad record fails here."""
    rec = read_run(run_dir)
    m = measurements(rec)
    dest = Path(out) if out is not None else rec.path / "sim"
    dest.mkdir(parents=True, exist_ok=True)
    header = (
        f"# Simulator inputs recorded from the real run {rec.path} (sim/runtrace).\n"
        "# Every number says how it was recorded; replay.json holds the detail behind them.\n"
    )
    (dest / "trace.yaml").write_text(header + yaml.safe_dump(trace_data(rec, m), sort_keys=True))
    (dest / "topology.yaml").write_text(
        header + yaml.safe_dump(topology_data(rec), sort_keys=False)
    )
    (dest / "replay.json").write_text(
        json.dumps(replay_data(rec, m), indent=2, sort_keys=True, default=_json) + "\n"
    )
    replay_config(dest)  # fail now, naming the file, rather than at replay time
    return dest


def _json(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return str(x)


def replay_config(trace_dir: str | Path, *, record_trace: bool = True) -> SimConfig:
    """The simulator configuration that replays a recorded run (its folder from
    :func:`record_run`)."""
    d = Path(trace_dir)
    traces: Traces = load_traces(d / "trace.yaml")
    topo = load_topology(d / "topology.yaml")
    replay = json.loads((d / "replay.json").read_text())
    return SimConfig(
        topology=topo,
        traces=traces,
        strategy=strategy(replay["strategy"]),
        steps=int(replay["steps"]),
        seed=int(replay["seed"]),
        workload=replay["workload"],
        batch_rollouts=int(replay["batch_rollouts"]),
        rollouts_per_lease=int(replay["rollouts_per_lease"]),
        snapshot_interval=int(replay["snapshot_interval"]),
        lease=LeaseConfig(initial_s=float(replay["lease_initial_s"])),
        faults=tuple(parse_fault(s) for s in replay["faults"]),
        rate_schedules=tuple(
            RateSchedule(link=s["link"], points=tuple((float(t), float(g)) for t, g in s["points"]))
            for s in replay["rate_schedules"]
        ),
        publish_pipeline="sequential",
        control_latency=True,
        loss_recovery=True,
        store_local=bool(replay.get("store_local", False)),
        record_trace=record_trace,
    )
