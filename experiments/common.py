"""Plumbing shared by the experiments: result rows that skip existing points, paper-vs-ours
tables, figures.

An experiment is a function returning a list of *points* (identifying columns plus a config) and
a ``main()`` that runs the points not yet in ``results/<name>/rows.csv``, appends their rows
(identifying columns, resolved config, seed, git SHA, metrics), draws ``results/<name>/<name>.png``
from the whole CSV and prints the paper's numbers beside ours. CLI parsing happens only under
``__main__``; re-running a sweep computes only the missing rows (cleanrl / nanochat habits).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm import tqdm

from aurora.topology import Topology
from sim.config import SimConfig, strategy
from sim.output import provenance
from sim.traces import load_traces

RESULTS = Path(os.environ.get("AURORA_RESULTS", "results"))
"""Root of all result folders (``AURORA_RESULTS`` overrides it, e.g. for tests)."""


@dataclass(frozen=True, kw_only=True)
class Point:
    """One run of an experiment."""

    key: dict[str, Any]
    """Columns that identify the point (model, strategy, bandwidth, ...): a row with the same
    values in ``rows.csv`` means the point is done."""
    config: SimConfig
    """What to simulate."""


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--full", action="store_true", help="paper scale (slower)")
    p.add_argument("--out", default=None, help="results root (default results/)")
    return p


def results_root(args: argparse.Namespace) -> Path:
    """Where an experiment writes: ``--out``, else :data:`RESULTS`."""
    return Path(args.out) if args.out else RESULTS


def written(root: Path, name: str) -> str:
    """The line an experiment ends with: where its rows and figure are."""
    return f"rows: {root / name / 'rows.csv'}  figure: {root / name / (name + '.png')}"


def summary_config(**fields: Any) -> SimConfig:
    """A point measured by its summary only: the paper's traces, no event trace kept."""
    return SimConfig(traces=load_traces(), record_trace=False, **fields)


def paired_points(
    topology: Topology,
    *,
    column: str,
    pairs: Sequence[tuple[str, str]],
    workloads: Iterable[str],
    steps: int,
) -> list[Point]:
    """An A/B comparison on one topology: a point per workload and (label, strategy) pair,
    the label in ``column``."""
    return [
        Point(
            key={"workload": w, column: label, "steps": steps},
            config=summary_config(
                topology=topology, strategy=strategy(name), steps=steps, workload=w
            ),
        )
        for w in workloads
        for label, name in pairs
    ]


def gain_claims(
    rows: pd.DataFrame, *, column: str, better: str, baseline: str, paper_pct: dict[str, float]
) -> list[tuple[str, float, float]]:
    """(claim, paper %, ours %) per workload: how much ``better`` beats ``baseline`` in tokens/s."""
    out = []
    for w, paper in paper_pct.items():
        a = one(rows, "tokens_per_s", workload=w, **{column: better})
        b = one(rows, "tokens_per_s", workload=w, **{column: baseline})
        out.append((f"{better} over {baseline}, {w} (%)", paper, 100 * (a / b - 1)))
    return out


def run_points(
    name: str,
    points: Sequence[Point],
    measure: Callable[[SimConfig], dict[str, float]],
    *,
    root: Path | None = None,
) -> pd.DataFrame:
    """Run the points missing from ``<root>/<name>/rows.csv``; return the rows of ``points``
    (the file keeps every row ever computed, e.g. other budgets)."""
    out = (root or RESULTS) / name
    out.mkdir(parents=True, exist_ok=True)
    path = out / "rows.csv"
    old = pd.read_csv(path) if path.exists() else pd.DataFrame()
    keys = list(points[0].key) if points else []

    def key_of(values: Iterable[Any]) -> tuple[str, ...]:
        return tuple(str(v) for v in values)

    done: set[tuple[str, ...]] = set()
    if not old.empty and all(k in old.columns for k in keys):
        done = {key_of(row) for row in old[keys].itertuples(index=False)}
    todo = [p for p in points if key_of(p.key.values()) not in done]
    new = []
    for point in tqdm(todo, desc=name, unit="run", leave=False):
        new.append(point.key | measure(point.config) | provenance(point.config))
    rows = pd.concat([old, pd.DataFrame(new)], ignore_index=True) if new else old
    if new:
        tmp = path.with_suffix(".csv.tmp")
        rows.to_csv(tmp, index=False)
        os.replace(tmp, path)
    wanted = {key_of(p.key.values()) for p in points}
    mine = [key_of(row) in wanted for row in rows[keys].itertuples(index=False)]
    return rows[mine].reset_index(drop=True)


def compare(rows: Sequence[tuple[str, float, float]], unit: str = "") -> str:
    """A table of (claim, paper, ours) with the ratio ours/paper."""
    lines = [f"{'claim':<58} {'paper':>10} {'ours':>10} {'ours/paper':>10}"]
    for claim, paper, ours in rows:
        ratio = ours / paper if paper else math.nan
        lines.append(f"{claim:<58} {paper:>10.3g} {ours:>10.3g} {ratio:>10.2f}")
    return "\n".join(lines) + (f"\n(units: {unit})" if unit else "")


def one(rows: pd.DataFrame, column: str, **where: Any) -> float:
    """The single value of ``column`` in the row matching ``where``."""
    sel = rows
    for k, v in where.items():
        sel = sel[sel[k] == v]
    if len(sel) != 1:
        raise KeyError(f"{len(sel)} rows match {where}")
    return float(sel[column].iloc[0])


def compare_ranges(rows: Sequence[tuple[str, float, float, float]]) -> str:
    """A table of (claim, paper low, paper high, ours) saying whether ours falls in the range."""
    lines = [f"{'claim':<58} {'paper':>13} {'ours':>9}  verdict"]
    for claim, low, high, ours in rows:
        paper = f"{low:.3g}-{high:.3g}" if low != high else f"{low:.3g}"
        if low <= ours <= high:
            verdict = "within"
        else:
            edge = low if ours < low else high
            verdict = f"{'below' if ours < low else 'above'} by {abs(ours / edge - 1):.0%}"
        lines.append(f"{claim:<58} {paper:>13} {ours:>9.3g}  {verdict}")
    return "\n".join(lines)


def geo_topology(
    *,
    model: str,
    trainer_gpus: int,
    trainer_region: str = "us",
    actors: Sequence[tuple[str, str, int]],
    links: Sequence[dict[str, Any]] = (),
    relays: Sequence[str] = (),
    name: str = "geo",
) -> dict[str, Any]:
    """A topology dict: ``actors`` as (region, gpu, count); links default to the paper's
    US-Canada cross-cloud link for every region without one."""
    regions = sorted({trainer_region} | {r for r, _, _ in actors} | set(relays))
    have = {frozenset((lk["a"], lk["b"])) for lk in links}
    links = list(links)
    for r in regions:
        if r != trainer_region and frozenset((trainer_region, r)) not in have:
            links.append(dict(US_CANADA_LINK, a=trainer_region, b=r))
    return {
        "name": name,
        "trainer": {"region": trainer_region, "model": model, "gpus": trainer_gpus},
        "regions": [{"name": r} for r in regions],
        "links": links,
        "actors": [
            {"region": r, "gpu": g, "count": n, "name": f"{r}-{g.lower()}"} for r, g, n in actors
        ],
        "relays": [{"region": r} for r in relays],
    }


US_CANADA_LINK: dict[str, Any] = {
    "gbps": 1.0,
    "rtt_ms": 40,
    "loss": 1e-6,
    "fluctuation": {"low_gbps": 0.5, "high_gbps": 1.0, "period_s": 10},
}
"""The paper's default link (§6.1: 0.5-1 Gbit/s cross-cloud); RTT and loss assumed as in
``examples/geo.yaml``."""


def summary_measure(cfg: SimConfig) -> dict[str, float]:
    """Mean tokens/s, step time and WAN GB per step after two warm-up steps."""
    from sim.model import simulate

    s = simulate(cfg).summary(warmup=2)
    return {k: s[k] for k in ("tokens_per_s", "step_time_s", "wan_gb_per_step")}


def bar_figure(
    rows: pd.DataFrame,
    *,
    x: str,
    hue: str,
    value: str,
    ylabel: str,
    title: str,
    path: Path,
    paper: dict[tuple[Any, Any], float] | None = None,
) -> None:
    """Grouped bars of ``value`` by ``x`` and ``hue``; paper values as black crosses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    xs = list(dict.fromkeys(rows[x]))
    hues = list(dict.fromkeys(rows[hue]))
    width = 0.8 / len(hues)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(xs) * len(hues) / 2), 4))
    for i, h in enumerate(hues):
        sub = rows[rows[hue] == h].set_index(x)
        vals = [float(sub.loc[v, value]) if v in sub.index else np.nan for v in xs]
        pos = np.arange(len(xs)) + i * width
        ax.bar(pos, vals, width, label=str(h))
        for j, v in enumerate(xs):
            if paper and (v, h) in paper:
                ax.scatter([pos[j]], [paper[(v, h)]], marker="x", color="black", zorder=5)
    if paper:
        ax.scatter([], [], marker="x", color="black", label="paper")
    ax.set_xticks(np.arange(len(xs)) + width * (len(hues) - 1) / 2, [str(v) for v in xs])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
