"""Writing a run's results: per-step rows, the event trace and the timeline, as CSV.

Every row carries the resolved configuration (topology, model, strategy, workload, seed) and the
git SHA of the code that produced it, so a table of many runs can be filtered and traced back
(cleanrl's and nanochat's habit). Files are written to a temporary name and renamed, so a run
killed halfway leaves no half-written CSV behind.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from aurora.provenance import git_sha
from aurora.store.files import write_csv
from sim.config import SimConfig
from sim.model import Result


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
        "faults": " ".join(f.spec() for f in cfg.faults),
        "spot_hazard_per_hour": cfg.spot_hazard_per_hour,
        "spot_notice_s": cfg.spot_notice_s,
        "spot_return_s": cfg.spot_return_s,
    }


def provenance(cfg: SimConfig) -> dict[str, Any]:
    """The columns every result row of a run carries: resolved config, seed, git SHA."""
    return config_columns(cfg) | {"git_sha": git_sha()}


def write_result(
    result: Result, cfg: SimConfig, out_dir: str | Path, *, stalled: str | None = None
) -> Path:
    """Write ``steps.csv``, ``events.csv``, ``timeline.csv`` and ``summary.json``; a run that
    stalled (``stalled`` says why) writes what it produced, and says so in the summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = provenance(cfg)
    write_csv(out / "steps.csv", [meta | row for row in result.rows])
    write_csv(out / "events.csv", [{"time_s": t, "who": w, "what": x} for t, w, x in result.trace])
    write_csv(out / "timeline.csv", result.timeline)
    summary = meta | result.summary() | {"steps_requested": cfg.steps, "stalled": stalled}
    # JSON has no NaN: a run that stalled before its first step has no means.
    summary = {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in summary.items()
    }
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out / "summary.json")
    return out
