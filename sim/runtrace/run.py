"""A finished ``aurora real`` run folder, parsed on the run's own clock.

Theory of operation
-------------------
Only what the run recorded as it went is read: the Ledger's event log ``events.csv``, the
Actors' spans ``ledger.spans.jsonl``, ``job.json``, ``summary.json``, ``faults.jsonl``,
``emulation.json`` and a loopback run's probe of the host; never ``steps.csv``, which is an
output, what a replay predicts. Time origin: the simulator starts with every Actor holding v0
and batch 1 requested at t = 0, so every time is read from the run's first ``BatchRequested``
(the model load and the held-out evaluation before it are not part of any step).
"""

from __future__ import annotations

import csv
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aurora.jobspec import JobSpec
from sim.runtrace.loopback import LOOPBACK


class RunFolderError(ValueError):
    """The folder is not a finished run, or lacks what a trace needs (the message says what)."""


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
