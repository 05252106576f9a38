"""Writing a run's results: per-step rows, the event trace and the timeline, as CSV.

Every row carries the resolved configuration (topology, model, strategy, workload, seed) and the
git SHA of the code that produced it, so a table of many runs can be filtered and traced back
(cleanrl's and nanochat's habit). Files are written to a temporary name and renamed, so a run
killed halfway leaves no half-written CSV behind.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sim.config import SimConfig
from sim.model import Result


def git_sha() -> str:
    """SHA of the checkout this code runs from, with ``-dirty`` for uncommitted changes."""
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def config_columns(cfg: SimConfig) -> dict[str, Any]:
    """The resolved configuration as flat columns for every row of a run."""
    topo = cfg.topology
    return {
        "topology": topo.name,
        "model": topo.trainer.model,
        "trainer_gpus": topo.trainer.gpus,
        "actors": sum(g.count for g in topo.actors),
        "strategy": cfg.strategy.name,
        "workload": cfg.workload,
        "seed": cfg.seed,
        "strategy_config": json.dumps(asdict(cfg.strategy), sort_keys=True),
    }


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", newline="") as f:
        if rows:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    os.replace(tmp, path)


def write_result(result: Result, cfg: SimConfig, out_dir: str | Path) -> Path:
    """Write ``steps.csv``, ``events.csv``, ``timeline.csv`` and ``summary.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = config_columns(cfg) | {"git_sha": git_sha()}
    _write_csv(out / "steps.csv", [meta | row for row in result.rows])
    _write_csv(out / "events.csv", [{"time_s": t, "who": w, "what": x} for t, w, x in result.trace])
    _write_csv(out / "timeline.csv", result.timeline)
    summary = meta | result.summary()
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out / "summary.json")
    return out
