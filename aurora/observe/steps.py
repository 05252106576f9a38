"""One step's record: the per-step series both the simulator and real runs write.

Theory of operation
-------------------
A step ends when its version is published. :func:`step_record` turns what is known then (the
publication times of this version and the previous one, the tokens trained on, the version the
batch was generated on, the delta's bytes, what the scheduler did during the step, and, in a
real run, the Trainer's statistics) into the fields named in :data:`aurora.observe.table.
STEP_FIELDS`, each defined here once. The Ledger calls it at every publication
(:class:`aurora.observe.ledger.LedgerMetrics`); the simulator's rows go through it too
(:func:`from_sim_row`), so a simulated and a real run of one topology carry the same series under
the same tags.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

LEARNING_STATS = {
    "reward": "reward",
    "loss": "loss",
    "kl": "kl",
    "entropy": "entropy",
    "clip_frac": "clip_fraction",
    "grad_norm": "grad_norm",
    "density": "changed_fraction",
}
"""The Trainer's statistic -> the step record's field (only real runs have a model)."""


def step_record(
    *,
    step: int,
    time_s: float,
    prev_time_s: float,
    tokens: int,
    batch_version: int | None,
    delta_bytes: int | float | None,
    actors_contributing: int,
    actors_excluded: int,
    leases_expired: int,
    results_refused: int,
    stats: Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """The step record of step ``step`` (its version), published at ``time_s`` after the
    previous version at ``prev_time_s`` (s, any clock shared by both); ``stats`` are the
    Trainer's statistics of the step (real runs). Fields that are unknown are left out."""
    step_time = time_s - prev_time_s
    out: dict[str, float] = {
        "step_time_s": step_time,
        "tokens": float(tokens),
        "tokens_per_s": tokens / step_time if step_time > 0 else 0.0,
        "actors_contributing": float(actors_contributing),
        "actors_excluded": float(actors_excluded),
        "leases_expired": float(leases_expired),
        "results_refused": float(results_refused),
    }
    if batch_version is not None:
        out["staleness"] = float(step - 1 - batch_version)
    if delta_bytes is not None:
        out["delta_bytes"] = float(delta_bytes)
    for key, field in LEARNING_STATS.items():
        value = (stats or {}).get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out[field] = float(value)
    return out


def from_sim_row(row: Mapping[str, Any]) -> dict[str, float]:
    """The step record of one of the simulator's step rows (:class:`sim.recorder.Recorder`)."""
    shares = row["shares"]
    excluded = row.get("excluded", "[]")
    return step_record(
        step=int(row["step"]),
        time_s=float(row["time_s"]),
        prev_time_s=float(row["time_s"]) - float(row["step_time_s"]),
        tokens=int(row["tokens"]),
        batch_version=int(row["batch_version"]),
        delta_bytes=row.get("delta_bytes"),
        actors_contributing=len(json.loads(shares) if isinstance(shares, str) else shares),
        actors_excluded=len(json.loads(excluded) if isinstance(excluded, str) else excluded),
        leases_expired=int(row["expired"]),
        results_refused=int(row["refused"]),
    )
