"""Traces recorded from real runs: a finished ``aurora real`` run folder as the simulator's inputs.

Theory of operation
-------------------
The simulator is trace-driven: it charges time only from recorded inputs (:mod:`aurora.traces`).
The paper's trace (``aurora/traces/paper.yaml``) holds the paper's stated inputs; this module makes
a trace from a run of our own runtime (``aurora/runtime``), so that the simulator can replay the
run and its predictions can be checked against what the run did (``experiments/sim_vs_real``).

:func:`record_run` reads a run folder (``steps.csv`` is not read: it is an *output*; only the
Ledger's event log ``events.csv``, the Actors' spans ``ledger.spans.jsonl``, ``job.json``,
``summary.json``, ``faults.jsonl`` and ``emulation.json`` are) and writes ``<run>/sim/``:

* ``trace.yaml`` in the simulator's trace format (it loads with :func:`aurora.traces.load_traces`);
  every number says which run it was recorded from and how (mean of how many spans, their
  spread), or that the run could not measure it and where the value comes from instead;
* ``topology.yaml``: the deployment as the run had it (the Actors and relays it started, the
  links as configured after the emulation's scaling, or the host's loopback as probed);
* ``replay.json``: the rest of what a replay needs (strategy, steps, seed, batch and lease
  settings, whether the Checkpoint Store was a directory on the host (``store_local``: a
  catch-up then never crosses the emulated WAN), the faults as they struck, a join at the time
  the Ledger saw the new Actor join (its process start is not modelled), each link's rate
  schedule as the emulator applied it)
  and what the trace was derived from in detail (``recorded``: per Actor, per version, per
  join, the probed links);

and :func:`replay_config` turns that folder into a :class:`sim.config.SimConfig`.

Time origin. The simulator starts with every Actor holding v0 and batch 1 requested at t = 0;
the run's clock is therefore read from its first ``BatchRequested`` (the model load and the
held-out evaluation before it are not part of any step).

Inputs, and what each is recorded from (means over the run past its warm-up,
:data:`WARMUP_STEPS`: versions after the first two, generation on v1 and later):

=================================  ===============================================================
trace field                        recorded from
=================================  ===============================================================
``gpus.<actor>.tokens_per_s``      generate spans: tokens / seconds, pooled over every Actor
``gpus.<actor>.cv``                spread (std / mean) of the per-span rates
``workloads.<task>``               generated tokens per rollout (tokens / (results x G))
``models.<m>.train_tokens_...``    the Trainer's ``train_s`` per step against the step's tokens
``models.<m>.extract_s``           the Trainer's ``extract_s`` (a delta, or a dense copy)
``models.<m>.publish_s``           end of extraction to the Ledger's ``Published`` (store write,
                                   checkpoint, digest, announcement)
``models.<m>.delta_bytes_leb128``  bytes of every published D_v, in the codec the run used
``models.<m>.delta_bytes_by_v...``  each published D_v's bytes, v1 on (the warm-up's too)
``models.<m>.dense_payload_...``   a dense run: the same (a dense copy in the delta format)
``models.<m>.dense_bytes``         bf16 bytes of the model (the Trainer's statistics)
``constants.apply_bytes_per_s``    apply spans: bytes of the version applied / seconds
``constants.dense_load_...``       catch-up spans that loaded a snapshot: bytes / seconds
``constants.serialize_bytes_...``  a dense run: dense bytes / the seconds to encode one copy
``constants.tcp_window_bytes``     the emulated regions' ``tcp_wmem`` ceiling
``constants.result_bytes``         each result's payload in ``ledger.db``, framed as sent
``constants.store_read_bytes...``  the Actors' first catch-ups (to v0): plan bytes / seconds
=================================  ===============================================================
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from aurora.faults import parse_fault
from aurora.jobspec import JobSpec
from aurora.policy.leases import LeaseConfig
from aurora.topology import CONGESTION, Topology, load_topology
from aurora.traces import PAPER, Traces, load_traces
from sim.config import RateSchedule, SimConfig, strategy

WARMUP_STEPS = 2
"""The Trainer's first steps and the generation on v0 (the first batches) are left out of the
rates, times and sizes: they carry one-time costs (allocation, kernel selection, caches) that the
simulator has no notion of, and a comparison leaves these steps out too."""
ACTOR_GPU = "run-actor"
"""GPU type of the replayed Actors: one type, whose rate is what the run's Actors measured."""
TRAINER_GPU = "run-trainer"
"""GPU type of the replayed Trainer (one device: the run's Trainer process)."""
LOOPBACK = "loopback.json"
"""A loopback run's probe of the host's loopback (written beside the run by whoever ran it)."""


class RunFolderError(ValueError):
    """The folder is not a finished run, or lacks what a trace needs (the message says what)."""


# ------------------------------------------------------------------------------------------
# Reading a run
# ------------------------------------------------------------------------------------------


@dataclass
class RunRecord:
    """What a finished run measured, on the run's own clock (seconds from its first batch)."""

    path: Path
    job: dict[str, Any]
    summary: dict[str, Any]
    t0: float
    """Wall time of the first ``BatchRequested`` (the replay's t = 0)."""
    published: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Per version: ``at`` (s), ``stats``, ``delta_bytes``, ``snapshot_bytes``."""
    staged: dict[int, dict[str, float]] = field(default_factory=dict)
    """Per version, per Actor: when the Ledger counted it staged (s)."""
    requested: dict[int, float] = field(default_factory=dict)
    """Per batch: when it was requested (s)."""
    joined: dict[str, list[float]] = field(default_factory=dict)
    """Per Actor: every ``ActorJoined`` (s)."""
    caught_up: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    """Per Actor: every ``CaughtUp`` (s, version)."""
    plans: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    """Per Actor: every ``CatchUp`` the Ledger sent (s, bytes of the plan)."""
    results: Counter[str] = field(default_factory=Counter)
    """Admitted results per Actor."""
    arrived: list[dict[str, Any]] = field(default_factory=list)
    """Every ``ResultArrived`` record (actor, lease, version, weights hash)."""
    spans: list[dict[str, Any]] = field(default_factory=list)
    """The Actors' spans (generate, apply, catch-up), times in s."""
    faults: list[tuple[float, str]] = field(default_factory=list)
    """(s, spec) of every fault the injector struck."""
    emulation: dict[str, Any] | None = None
    loopback: dict[str, Any] | None = None

    @property
    def spec(self) -> JobSpec:
        return JobSpec.decode(self.job["spec"])

    @property
    def strategy(self) -> str:
        return self.spec.strategy.name

    @property
    def name(self) -> str:
        return self.path.name


def read_run(run_dir: str | Path) -> RunRecord:
    """Parse a finished run's folder (see the module docstring for which files)."""
    path = Path(run_dir)
    for need in ("job.json", "summary.json", "events.csv", "ledger.spans.jsonl"):
        if not (path / need).exists():
            raise RunFolderError(f"{path}: not a finished aurora real run (no {need})")
    job = json.loads((path / "job.json").read_text())
    summary = json.loads((path / "summary.json").read_text())
    with open(path / "events.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    first = [
        float(r["time"])
        for r in rows
        if r["type"] == "BatchRequested" and json.loads(r["record"]).get("prompts")
    ]
    if not first:
        raise RunFolderError(f"{path}/events.csv: no batch was ever requested")
    rec = RunRecord(path=path, job=job, summary=summary, t0=min(first))
    t0 = rec.t0
    for r in rows:
        record = json.loads(r["record"])
        t = float(r["time"]) - t0
        kind = r["type"]
        if kind == "Published":
            v = int(record["version"])
            rec.published[v] = {
                "at": float(record.get("at", float(r["time"]))) - t0,
                "stats": record.get("stats") or {},
                "delta_bytes": record.get("delta_bytes"),
                "snapshot_bytes": record.get("snapshot_bytes"),
            }
        elif kind == "CatchUp" and r["kind"] == "action":
            rec.plans.setdefault(record["actor"], []).append((t, int(record["plan"]["bytes"])))
            continue
        elif r["kind"] != "event":
            continue
        elif kind == "DeltaStaged":
            rec.staged.setdefault(int(record["version"]), {})[record["actor"]] = t
        elif kind == "BatchRequested" and record.get("prompts"):
            p = record["prompts"][0]
            rec.requested[int(p[1 : p.index("-")])] = t
        elif kind == "ActorJoined":
            rec.joined.setdefault(record["actor"], []).append(t)
        elif kind == "CaughtUp":
            rec.caught_up.setdefault(record["actor"], []).append((t, int(record["version"])))
        elif kind == "ResultArrived":
            rec.results[record["actor"]] += 1
            rec.arrived.append(record)
    for line in (path / "ledger.spans.jsonl").read_text().splitlines():
        s = json.loads(line)
        rec.spans.append({**s, "start": float(s["start"]) - t0, "end": float(s["end"]) - t0})
    faults = path / "faults.jsonl"
    if faults.exists():
        for line in faults.read_text().splitlines():
            f = json.loads(line)
            rec.faults.append((float(f["time"]) - t0, str(f["spec"])))
    if (path / "emulation.json").exists():
        rec.emulation = json.loads((path / "emulation.json").read_text())
    if (path / LOOPBACK).exists():
        rec.loopback = json.loads((path / LOOPBACK).read_text())
    if not any(v > 0 for v in rec.published):
        raise RunFolderError(f"{path}: the run published no version after v0")
    return rec


# ------------------------------------------------------------------------------------------
# Measurements
# ------------------------------------------------------------------------------------------


def _mean(xs: Sequence[float]) -> float:
    return statistics.fmean(xs) if xs else math.nan


def _cv(xs: Sequence[float]) -> float:
    return statistics.pstdev(xs) / statistics.fmean(xs) if len(xs) > 1 and _mean(xs) > 0 else 0.0


def _stats(xs: Sequence[float]) -> dict[str, float]:
    """n, mean, std, min, max of ``xs`` (for the provenance record)."""
    if not xs:
        return {"n": 0}
    return {
        "n": len(xs),
        "mean": statistics.fmean(xs),
        "std": statistics.pstdev(xs),
        "min": min(xs),
        "max": max(xs),
    }


def measurements(rec: RunRecord) -> dict[str, Any]:
    """Everything the trace is derived from, per Actor, per version and per join."""
    spec = rec.spec
    group = spec.group_size
    gen = [s for s in rec.spans if s.get("activity") == "generate" and s["end"] > s["start"]]
    min_v = 1 if any(int(s["version"]) >= 1 for s in gen) else 0
    # Past the warm-up: the first batches (on v0) carry the engine's one-time costs.
    gen = [s for s in gen if int(s["version"]) >= min_v]
    results = Counter(r["actor"] for r in rec.arrived if int(r["version"]) >= min_v)
    per_actor: dict[str, dict[str, Any]] = {}
    for actor in sorted({s["who"] for s in gen}):
        mine = [s for s in gen if s["who"] == actor]
        tokens = sum(int(s.get("tokens", 0)) for s in mine)
        seconds = sum(s["end"] - s["start"] for s in mine)
        rollouts = results[actor] * group
        per_actor[actor] = {
            "spans": len(mine),
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else math.nan,
            "rate_per_span": _stats(
                [int(s.get("tokens", 0)) / (s["end"] - s["start"]) for s in mine]
            ),
            "rollouts": rollouts,
            "tokens_per_rollout": tokens / rollouts if rollouts else math.nan,
        }
    span_rates = [int(s.get("tokens", 0)) / (s["end"] - s["start"]) for s in gen]
    gen_tokens = sum(int(s.get("tokens", 0)) for s in gen)
    gen_seconds = sum(s["end"] - s["start"] for s in gen)
    rollouts = sum(results.values()) * group

    versions: dict[int, dict[str, Any]] = {}
    for v, pub in sorted(rec.published.items()):
        st = pub["stats"]
        if v == 0 or "time" not in st:
            continue
        end_extract = float(st["time"]) - rec.t0
        versions[v] = {
            "train_s": float(st.get("train_s", 0.0)),
            "extract_s": float(st.get("extract_s", 0.0)),
            "publish_s": pub["at"] - end_extract,
            "tokens": int(st.get("tokens", 0)),
            "delta_bytes": pub["delta_bytes"],
            "dense_bytes": st.get("dense_bytes"),
            "density": st.get("density"),
            "snapshot_bytes": pub["snapshot_bytes"],
        }
    sizes = {v: p["delta_bytes"] for v, p in rec.published.items() if p["delta_bytes"]}
    applies = [
        (sizes[int(s["version"])], s["end"] - s["start"])
        for s in rec.spans
        if s.get("activity") == "apply" and int(s["version"]) in sizes and s["end"] > s["start"]
    ]
    snapshots = {v: p["snapshot_bytes"] for v, p in rec.published.items() if p["snapshot_bytes"]}
    loads = []
    for s in rec.spans:
        if s.get("activity") != "catch-up" or s["end"] <= s["start"]:
            continue
        # A catch-up from nothing loads the newest snapshot at or below its target.
        base = max((v for v in snapshots if v <= int(s["version"])), default=None)
        if base is not None:
            loads.append((snapshots[base], s["end"] - s["start"], s["who"]))
    # Store reads of the Actors' first catch-up (to v0, before the first batch): from the
    # Ledger's CatchUp to its CaughtUp, less a control round trip and the load span.
    one_way = _control_one_way_s(rec)
    first_loads = {x[2]: x[1] for x in reversed(loads)}
    store_reads = []
    for actor, plans in rec.plans.items():
        t_plan, size = plans[0]
        caught = [t for t, _v in rec.caught_up.get(actor, []) if t >= t_plan]
        if t_plan < 0 and caught and caught[0] <= 0 and actor in first_loads:
            fetch = caught[0] - t_plan - 2 * one_way.get(actor, 0.0) - first_loads[actor]
            store_reads.append({"actor": actor, "bytes": size, "seconds": max(fetch, 0.0)})
    results = result_messages(rec, gen_tokens / max(1, len(rec.arrived)))
    joins = []
    for when, spec_text in rec.faults:
        f = parse_fault(spec_text)
        if f.kind != "join":
            continue
        joined = [t for t in rec.joined.get(f.target, []) if t >= when - 1e-6]
        caught = [(t, v) for t, v in rec.caught_up.get(f.target, []) if t >= when - 1e-6]
        joins.append(
            {
                "actor": f.target,
                "fault": spec_text,
                "struck_s": when,
                "joined_s": joined[0] if joined else None,
                "caught_up_s": caught[0][0] if caught else None,
                "caught_up_to": caught[0][1] if caught else None,
            }
        )
    return {
        "actors": per_actor,
        "generation": {
            "tokens": gen_tokens,
            "seconds": gen_seconds,
            "tokens_per_s": gen_tokens / gen_seconds if gen_seconds > 0 else math.nan,
            "rate_per_span": _stats(span_rates),
            "cv": _cv(span_rates),
            "rollouts": rollouts,
            "tokens_per_rollout": gen_tokens / rollouts if rollouts else math.nan,
        },
        "versions": versions,
        "apply": {
            "n": len(applies),
            "bytes": sum(b for b, _ in applies),
            "seconds": sum(s for _, s in applies),
        },
        "snapshot_loads": [{"bytes": b, "seconds": s, "actor": a} for b, s, a in loads],
        "store_reads": store_reads,
        "result_messages": results,
        "joins": joins,
    }


TCP_IP_HEADER_BYTES = 52
"""IPv4 (20) + TCP with timestamps (32) bytes per segment; asyncio sets TCP_NODELAY, so each
control message an Actor writes leaves as its own segment."""


def result_messages(rec: RunRecord, tokens_per_result: float) -> dict[str, Any]:
    """Bytes of the run's result messages on the wire, rebuilt as the Actor frames them
    (:func:`aurora.transport.wire.control` of ``{op, lease, version, weights_hash, payload,
    tokens}``) with each payload the Ledger logged, plus one segment's TCP/IP headers."""
    from aurora.store.ledgerlog import LedgerLog
    from aurora.transport import wire

    db = rec.path / "ledger.db"
    if not db.exists() or not rec.arrived:
        return {"n": 0}
    log = LedgerLog(db)
    sizes = []
    try:
        for r in rec.arrived:
            body = log.payload(r["actor"], r["lease"])
            if body is None:
                continue
            msg = {
                "op": "result",
                "lease": r["lease"],
                "version": r["version"],
                "weights_hash": r["weights_hash"],
                "payload": body,
                "tokens": round(tokens_per_result),
            }
            sizes.append(len(wire.control(msg)) + TCP_IP_HEADER_BYTES)
    finally:
        log.close()
    return _stats(sizes) | {"how": "wire.control(msg) + 52 B of IPv4/TCP headers per message"}


def _control_one_way_s(rec: RunRecord) -> dict[str, float]:
    """Per Actor: one-way delay (s) of its control connection to the Ledger (half the RTT of
    its region's link to the Trainer's, as emulated; 0 on loopback)."""
    if rec.emulation is None:
        return {}
    trainer = rec.spec.trainer_region
    rtt = {}
    for lk in rec.emulation["links"]:
        if trainer in (lk["a"], lk["b"]):
            other = lk["b"] if lk["a"] == trainer else lk["a"]
            rtt[other] = float(lk["rtt_ms"]) / 2e3
    region = {a["id"]: a["region"] for a in rec.job["actors"]}
    for _when, text in rec.faults:
        f = parse_fault(text)
        if f.kind == "join":
            region[f.target] = f.region
    return {a: rtt.get(r, 0.0) for a, r in region.items()}


# ------------------------------------------------------------------------------------------
# The trace, the topology and the replay settings
# ------------------------------------------------------------------------------------------


def _q(value: float, source: str) -> dict[str, Any]:
    return {"value": float(value), "source": source}


def _by_version(versions: dict[int, dict[str, Any]], run: str) -> dict[str, Any]:
    """``delta_bytes_by_version``: every published version's delta size, the warm-up's
    included (their larger deltas cross the link too, and the steps after them wait for them),
    when the run recorded one for each of versions 1..last; else nothing (the mean serves)."""
    last = max(versions, default=0)
    sizes = [versions.get(v, {}).get("delta_bytes") for v in range(1, last + 1)]
    if not sizes or not all(sizes):
        return {}
    return {
        "delta_bytes_by_version": {
            "values": [float(b) for b in sizes],
            "source": f"{run}: the bytes of each of its {len(sizes)} published deltas "
            f"(v1-v{last}, {min(sizes):.0f}-{max(sizes):.0f}), in the codec it used",
        }
    }


def _paper_value(path: str) -> float:
    """A number from the paper's trace (for inputs a run cannot measure)."""
    obj: Any = load_traces(PAPER)
    for part in path.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return float(obj.value)


def trace_data(rec: RunRecord, m: dict[str, Any]) -> dict[str, Any]:
    """The run's measurements in the simulator's trace format (YAML-ready)."""
    spec = rec.spec
    run = f"recorded from run {rec.name}"
    model = model_id(rec)
    dense_payload = spec.strategy.payload == "dense"
    versions = m["versions"]
    vs = sorted(versions)
    if len([v for v in vs if v > WARMUP_STEPS]) >= 2:
        vs = [v for v in vs if v > WARMUP_STEPS]  # past the warm-up (module docstring)
    trained = [v for v in vs if versions[v]["train_s"] > 0]
    tokens = sum(versions[v]["tokens"] for v in trained)
    train_s = sum(versions[v]["train_s"] for v in trained)
    extract = [versions[v]["extract_s"] for v in vs]
    publish = [versions[v]["publish_s"] for v in vs]
    deltas = [float(versions[v]["delta_bytes"]) for v in vs if versions[v]["delta_bytes"]]
    dense = [float(versions[v]["dense_bytes"]) for v in vs if versions[v]["dense_bytes"]]
    if not dense:
        raise RunFolderError(f"{rec.path}: no dense_bytes in the Trainer's statistics")
    dense_bytes = _mean(dense)
    g = m["generation"]
    codec = spec.strategy.codec or "aurora"
    what_delta = "dense copies in the delta format" if dense_payload else f"{codec}-codec deltas"
    models = {
        model: {
            "params": _q(dense_bytes / 2, f"{run}: dense bf16 bytes / 2"),
            "dense_bytes": _q(dense_bytes, f"{run}: the Trainer's dense_bytes (bf16 weights)"),
            "delta_bytes_leb128": _q(
                _mean(deltas),
                f"{run}: mean bytes of its {len(deltas)} published versions ({what_delta}; "
                f"std {statistics.pstdev(deltas):.0f}, {min(deltas):.0f}-{max(deltas):.0f}); "
                "the size in the run's own codec, so codec_bytes_vs_leb128 of that codec is 1",
            ),
            "extract_s": _q(
                _mean(extract),
                f"{run}: mean of the Trainer's extract_s over {len(extract)} versions "
                f"(std {statistics.pstdev(extract):.3f} s; "
                + ("encoding a dense copy" if dense_payload else "extracting the delta")
                + ", segments leaving as they are cut)",
            ),
            "publish_s": _q(
                max(_mean(publish), 0.0),
                f"{run}: mean seconds from the end of extraction to the Ledger's Published "
                f"(store write, checkpoint, digest, announcement) over {len(publish)} versions "
                f"(std {statistics.pstdev(publish):.3f} s)",
            ),
            **(
                {
                    "dense_payload_bytes": _q(
                        _mean(deltas),
                        f"{run}: mean bytes of its {len(deltas)} published dense copies in the "
                        "delta format (what crossed the data plane per version)",
                    )
                }
                if dense_payload
                else {}
            ),
            **({} if dense_payload else _by_version(versions, run)),
            "train_tokens_per_s_per_gpu": {
                TRAINER_GPU: _q(
                    tokens / train_s,
                    f"{run}: {tokens} generated tokens trained in {train_s:.2f} s over "
                    f"{len(trained)} steps (train_s, one Trainer process)",
                )
            },
        }
    }
    rate_stats = g["rate_per_span"]
    per_actor = ", ".join(
        f"{a} {d['tokens_per_s']:.0f} tok/s ({d['spans']} spans, cv "
        f"{d['rate_per_span'].get('std', 0) / max(d['rate_per_span'].get('mean', 1), 1e-9):.2f}, "
        f"{d['tokens_per_rollout']:.2f} tok/rollout)"
        for a, d in m["actors"].items()
    )
    gpus = {
        ACTOR_GPU: {
            "tokens_per_s": {
                model: _q(
                    g["tokens_per_s"],
                    f"{run}: {g['tokens']} tokens generated in {g['seconds']:.2f} s of "
                    f"{rate_stats['n']} generate spans, pooled over the Actors ({per_actor})",
                )
            },
            "cv": _q(
                g["cv"],
                f"{run}: std/mean of the {rate_stats['n']} per-span rates "
                f"({rate_stats.get('min', 0):.0f}-{rate_stats.get('max', 0):.0f} tok/s)",
            ),
            "drift_per_hour": _q(0.0, "not measured: the run is minutes long"),
        }
    }
    workloads = {
        spec.task: {
            "tokens_per_rollout": _q(
                g["tokens_per_rollout"],
                f"{run}: {g['tokens']} generated tokens over {g['rollouts']} rollouts "
                "(results on v1 and later x group size)",
            )
        }
    }
    actors = sum(1 for _ in rec.job["actors"])
    rollouts_per_step = spec.prompts_per_step * spec.group_size
    applied = m["apply"]
    if applied["seconds"] > 0:
        apply_q = _q(
            applied["bytes"] / applied["seconds"],
            f"{run}: {applied['bytes']} bytes applied in {applied['seconds']:.3f} s over "
            f"{applied['n']} apply spans (the Actor's pause to activate a staged version)",
        )
    else:
        apply_q = _q(
            _paper_value("constants.apply_bytes_per_s"),
            "not measured in this run (no apply span): the paper trace's value",
        )
    loads = m["snapshot_loads"]
    load_b = sum(x["bytes"] for x in loads)
    load_s = sum(x["seconds"] for x in loads)
    load_q = (
        _q(
            load_b / load_s,
            f"{run}: {load_b} snapshot bytes loaded in {load_s:.3f} s over "
            f"{len(loads)} catch-up spans (fetch excluded: the span is the load and apply)",
        )
        if load_s > 0
        else _q(
            _paper_value("constants.dense_load_bytes_per_s"),
            "not measured in this run (no catch-up span): the paper trace's value",
        )
    )
    reads = m["store_reads"]
    read_b = sum(x["bytes"] for x in reads)
    read_s = sum(x["seconds"] for x in reads)
    store_q = (
        {
            "store_read_bytes_per_s": _q(
                read_b / read_s,
                f"{run}: {read_b} bytes of {len(reads)} first catch-ups (to v0, before the "
                f"first batch) read from the Checkpoint Store in {read_s:.3f} s (CatchUp to "
                "CaughtUp, less a control round trip and the load span)",
            )
        }
        if read_s > 0
        else {}
    )
    msgs = m["result_messages"]
    if msgs.get("n"):
        store_q["result_bytes"] = _q(
            msgs["mean"],
            f"{run}: mean bytes of its {msgs['n']} result messages on the wire (each payload "
            f"as the Ledger logged it, framed as the Actor sends it, + {TCP_IP_HEADER_BYTES} B "
            f"of IPv4/TCP headers; {msgs['min']}-{msgs['max']} B)",
        )
    if dense_payload:
        serialize_q = _q(
            dense_bytes / _mean(extract),
            f"{run}: dense bytes / mean seconds to encode one dense copy ({_mean(extract):.3f} s)",
        )
    else:
        serialize_q = _q(
            _paper_value("constants.serialize_bytes_per_s"),
            "not measured (this run published deltas; only dense strategies use it): the paper "
            "trace's value",
        )
    tcp = (rec.emulation or {}).get("tcp") or {}
    wmem = str(tcp.get("tcp_wmem", "")).split()
    window_q = (
        _q(float(wmem[-1]), f"{run}: the emulated regions' tcp_wmem ceiling ({tcp['tcp_wmem']!r})")
        if wmem
        else _q(
            _paper_value("constants.tcp_window_bytes"),
            "not measured (loopback: the window never binds at its RTT): the paper trace's value",
        )
    )
    paper = "from aurora/traces/paper.yaml"
    constants = {
        "rollouts_per_actor": _q(
            rollouts_per_step / actors,
            f"{run}: prompts_per_step x group_size / Actors started "
            f"({spec.prompts_per_step} x {spec.group_size} / {actors})",
        ),
        "codec_bytes_vs_leb128": {
            "leb128": _q(1.0, "definition"),
            codec: _q(1.0, f"{run}: delta_bytes_leb128 holds the run's own {codec} sizes"),
        },
        "rdma_gbps": _q(
            _paper_value("constants.rdma_gbps"), f"not used (no RDMA in a real run): {paper}"
        ),
        "tcp_window_bytes": window_q,
        "mss_bytes": _q(
            1448.0, "1500-byte MTU less IP, TCP and timestamp headers (the veths' MTU)"
        ),
        "apply_bytes_per_s": apply_q,
        "dense_load_bytes_per_s": load_q,
        "trainer_restart_s": _q(
            _paper_value("constants.trainer_restart_s"),
            f"not measured (no trainer_crash in this run): {paper}",
        ),
        "d2h_bytes_per_s_per_gpu": _q(
            _paper_value("constants.d2h_bytes_per_s_per_gpu"),
            "not used: the CPU Trainer's weights are in host memory (its bf16 copy is inside "
            f"extract_s) and replays use the sequential publication pipeline: {paper}",
        ),
        "serialize_bytes_per_s": serialize_q,
        **store_q,
    }
    if dense_payload:
        constants["codec_bytes_vs_leb128"].pop(codec, None)
    return {"models": models, "gpus": gpus, "workloads": workloads, "constants": constants}


def model_id(rec: RunRecord) -> str:
    """The model's id in the replay (``run-<model>``, e.g. ``run-tiny``)."""
    name = rec.spec.model if rec.spec.backend == "rl" else "standin"
    return "run-" + Path(name).name


def _source_topology(rec: RunRecord) -> Topology:
    path = Path(rec.job["topology"])
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, _REPO / path]
    for p in candidates:
        if p.exists():
            return load_topology(p)
    raise RunFolderError(f"{rec.path}/job.json: topology {rec.job['topology']!r} not found")


_REPO = Path(__file__).resolve().parent.parent


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
                "sim.runtrace.probe_loopback) to be replayed"
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
        f"# Simulator inputs recorded from the real run {rec.path} (sim/runtrace.py).\n"
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


# ------------------------------------------------------------------------------------------
# The host's loopback (what a loopback run's links are)
# ------------------------------------------------------------------------------------------


def probe_loopback(*, seconds: float = 1.0, chunk: int = 1 << 16) -> dict[str, Any]:
    """Measure this host's loopback: one TCP stream's goodput (Gbit/s) for ``seconds`` and the
    median round trip of 50 small messages (ms). What a loopback run's links are."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    received = [0]

    def sink() -> None:
        conn, _ = srv.accept()
        with conn:
            while data := conn.recv(1 << 20):
                received[0] += len(data)

    t = threading.Thread(target=sink, daemon=True)
    t.start()
    payload = b"\0" * chunk
    with socket.create_connection(("127.0.0.1", port)) as c:
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            c.sendall(payload)
        c.shutdown(socket.SHUT_WR)
        t.join(10)
        elapsed = time.perf_counter() - start
    srv.close()
    gbps = received[0] * 8 / elapsed / 1e9
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def echo() -> None:
        conn, _ = srv.accept()
        with conn:
            while data := conn.recv(64):
                conn.sendall(data)

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    rtts = []
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(50):
            s = time.perf_counter()
            c.sendall(b"x")
            c.recv(64)
            rtts.append((time.perf_counter() - s) * 1e3)
    t.join(5)
    srv.close()
    return {
        "gbps": gbps,
        "rtt_ms": statistics.median(rtts),
        "seconds": elapsed,
        "bytes": received[0],
        "how": "one TCP stream of 64 KiB sends for 1 s; 50 one-byte echoes (median)",
    }


# ------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sim.runtrace RUN_DIR [--out DIR]``: record a run's trace and replay it."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a finished aurora real run folder (results/real/NAME-...)")
    p.add_argument("--out", default=None, help="where to write the trace (default RUN/sim)")
    args = p.parse_args(argv)
    try:
        dest = record_run(args.run, args.out)
        cfg = replay_config(dest)
    except ValueError as exc:
        print(f"sim.runtrace: {exc}", file=sys.stderr)
        return 2
    from sim.model import simulate

    s = simulate(cfg).summary(warmup=2)
    print(f"trace: {dest}/trace.yaml  topology: {dest}/topology.yaml  replay: {dest}/replay.json")
    print(
        f"replayed {cfg.strategy.name}: {s['steps']} steps, mean step {s['step_time_s']:.3f} s, "
        f"{s['tokens_per_s']:.1f} tokens/s (after 2 warm-up steps)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
