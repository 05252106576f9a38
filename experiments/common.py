"""Plumbing shared by the experiments: result rows that skip existing points, the paper's
claims beside ours, figures.

An experiment module has ``NAME``, ``points(full)`` (identifying columns plus a config each),
a ``measure`` (``SimConfig -> metrics``), ``claims(rows)`` (every claim of the paper it checks,
as :class:`Claim`), ``figure(rows, path)`` and ``main(argv)``, which runs the points not yet in
``results/<name>/rows.csv`` (over every local core, or a Dask cluster: :mod:`experiments.sweep`),
appends each row as its run finishes (identifying columns, resolved config, seed, git SHA,
metrics), draws ``results/<name>/<name>.png`` and prints the claims. CLI parsing happens only
under ``__main__``; re-running a sweep computes only the missing rows (cleanrl / nanochat habits).
"""

from __future__ import annotations

import argparse
import csv
import functools
import math
import os
import re
import sys
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd
from tqdm import tqdm

from aurora.provenance import git_sha, run_key
from aurora.topology import Topology
from aurora.traces import load_traces
from experiments import sweep
from sim.config import SimConfig, strategy
from sim.output import config_columns

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


def plain(text: str) -> str:
    """``text`` (a docstring's first paragraph) as a command's help shows it: reST roles and
    literals (``:func:`x```, double backquotes) reduced to their words, lines joined."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    return " ".join(text.replace("``", "").replace("`", "").split())


def parser(description: str) -> argparse.ArgumentParser:
    """The options every simulated experiment takes; ``description`` (a docstring's first
    paragraph) is shown without its markup."""
    p = argparse.ArgumentParser(description=plain(description))
    p.add_argument("--full", action="store_true", help="paper scale (slower)")
    p.add_argument("--out", default=None, help="results root (default results/)")
    p.add_argument(
        "--force",
        action="store_true",
        help="run every point again, even those with a current row (same resolved "
        "configuration, same code) in rows.csv",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="simulations at once on this machine (default: every core, "
        f"{sweep.default_workers()})",
    )
    p.add_argument(
        "--cluster",
        default=None,
        metavar="ADDRESS",
        help="run on the Dask scheduler at tcp://HOST:PORT ('local': a cluster on this machine); "
        "needs pip install -e .[cluster]",
    )
    p.add_argument(
        "--log",
        choices=("tensorboard", "wandb"),
        default=None,
        help="also write each point's step series to TensorBoard or W&B (offline) under "
        "<out>/<experiment>/runs/ (each point is simulated once more for its rows; "
        "docs/OBSERVABILITY.md)",
    )
    return p


def results_root(args: argparse.Namespace) -> Path:
    """Where an experiment writes: ``--out``, else :data:`RESULTS`."""
    return Path(args.out) if args.out else RESULTS


def sweep_options(args: argparse.Namespace) -> dict[str, Any]:
    """``run_points`` keywords from the command line (``--workers``, ``--cluster``,
    ``--force``)."""
    return {"workers": args.workers, "cluster": args.cluster, "force": args.force}


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
            key={"workload": w, column: label, "steps": steps, "warmup": WARMUP},
            config=summary_config(
                topology=topology, strategy=strategy(name), steps=steps, workload=w
            ),
        )
        for w in workloads
        for label, name in pairs
    ]


def gain_claim(
    rows: pd.DataFrame,
    *,
    where: str,
    what: str,
    column: str,
    better: str,
    baseline: str,
    workload: str,
    paper_pct: float,
) -> Claim:
    """How much ``better`` beats ``baseline`` in tokens/s (%), on one workload."""
    a = one(rows, "tokens_per_s", workload=workload, **{column: better})
    b = one(rows, "tokens_per_s", workload=workload, **{column: baseline})
    return Claim(
        id=f"{where}.{better}_over_{baseline}.{workload}".replace(" ", "_"),
        where=where,
        text=f"{what}, {workload} (%)",
        low=paper_pct,
        high=paper_pct,
        ours=100 * (a / b - 1),
        kind="mechanism",
        steady=steady(rows, workload=workload, **{column: better})
        and steady(rows, workload=workload, **{column: baseline}),
    )


def experiment_main(module: Any, argv: Sequence[str] | None) -> pd.DataFrame:
    """The ``main`` of a point-based experiment module: run its missing points, draw its
    figure, print its claims beside ours."""
    doc = (module.__doc__ or module.NAME).split("\n\n")[0]
    args = parser(doc).parse_args(argv)
    files_only()
    root = results_root(args)
    measure = getattr(module, "measure", summary_measure)
    if args.log is not None:
        from aurora.observe.steplog import check

        check(args.log)
        measure = Logged(measure, args.log, root / module.NAME / "runs")
    try:
        rows = run_points(
            module.NAME,
            module.points(args.full),
            measure,
            root=root,
            **sweep_options(args),
        )
    except ValueError as exc:  # a bad option, e.g. --cluster without the cluster extra
        raise SystemExit(f"python -m experiments.{module.NAME}: {exc}") from None
    module.figure(rows, root / module.NAME / f"{module.NAME}.png")
    print(claims_table(module.claims(rows)))
    print(written(root, module.NAME))
    return rows


class Logged:
    """A point's measure that also writes the point's step series (``--log``): the point is
    simulated once more for its rows (the simulator is deterministic: the same run) and the rows
    go through :func:`aurora.observe.steplog.write_rows` into ``folder/<run>/``. A class, not a
    closure, so a process pool or a cluster can pickle it."""

    def __init__(
        self, measure: Callable[[SimConfig], dict[str, Any]], kind: str, folder: Path
    ) -> None:
        self.measure, self.kind, self.folder = measure, kind, folder

    def __call__(self, cfg: SimConfig) -> dict[str, Any]:
        import hashlib
        import json

        from aurora.observe.steplog import write_rows
        from sim.model import simulate

        columns = config_columns(cfg)
        digest = hashlib.sha256(json.dumps(columns, sort_keys=True, default=str).encode())
        name = f"{columns['topology']}-{columns['strategy']}-s{cfg.seed}-{digest.hexdigest()[:8]}"
        write_rows(self.kind, self.folder / name, simulate(cfg).rows, name=name, config=columns)
        return self.measure(cfg)


def files_only() -> None:
    """Draw figures into files (the Agg backend), unless something already chose a backend
    (a notebook draws inline)."""
    import sys

    if "matplotlib.pyplot" not in sys.modules:
        import matplotlib

        matplotlib.use("Agg")


@functools.cache
def _sha() -> str:
    return git_sha()


def provenance(cfg: SimConfig) -> dict[str, Any]:
    """The columns every row carries: resolved config, seed, git SHA (looked up once; ``-dirty``
    when the tree had uncommitted changes) and the reuse key (:func:`run_points`)."""
    return config_columns(cfg) | {"git_sha": _sha(), "run_key": run_key(cfg)}


def _key_of(values: Iterable[Any]) -> tuple[str, ...]:
    return tuple(str(v) for v in values)


def run_points(
    name: str,
    points: Sequence[Point],
    measure: Callable[[SimConfig], dict[str, Any]],
    *,
    root: Path | None = None,
    workers: int | None = None,
    cluster: str | None = None,
    force: bool = False,
) -> pd.DataFrame:
    """Run the points of ``points`` that ``<root>/<name>/rows.csv`` has no current row for, and
    return the rows of ``points`` in their order.

    A stored row is current for a point when its key columns are the point's and its ``run_key``
    is the point's :func:`~aurora.provenance.run_key`: the digest of the whole resolved
    configuration and the code's version (SHA, and the uncommitted changes' digest on a dirty
    tree). Any other row of that key is stale: the point runs again and its new row replaces it,
    so a changed setting or changed code never prints old numbers. ``force`` reruns every point.
    Each row is written as its run finishes, so an interrupted sweep resumes where it stopped;
    the file keeps the rows of other points (e.g. other budgets)."""
    out = (root or RESULTS) / name
    out.mkdir(parents=True, exist_ok=True)
    path = out / "rows.csv"
    old = pd.read_csv(path) if path.exists() and path.stat().st_size else pd.DataFrame()
    keys = list(points[0].key) if points else []
    want = {_key_of(p.key.values()): run_key(p.config) for p in points}
    current: set[tuple[str, ...]] = set()
    if not old.empty and all(k in old.columns for k in keys):
        stored = old["run_key"] if "run_key" in old.columns else pd.Series([""] * len(old))
        old_keys = [_key_of(row) for row in old[keys].itertuples(index=False)]
        if not force:
            current = {k for k, rk in zip(old_keys, stored, strict=True) if want.get(k) == rk}
        # a stale row of a point about to run goes now, so the file never holds both
        stale = [k in want and k not in current for k in old_keys]
        if any(stale):
            old = old[[not s for s in stale]].reset_index(drop=True)
            _write(old, path)
    todo = [p for p in points if _key_of(p.key.values()) not in current]
    new: dict[tuple[str, ...], dict[str, Any]] = {}
    header = list(old.columns)
    bar = tqdm(  # a bar on a terminal only: piped or redirected output gets the rows alone
        total=len(todo), desc=name, unit="run", leave=False, disable=not sys.stderr.isatty()
    )
    try:
        for point, metrics in sweep.run(todo, measure, workers=workers, cluster=cluster):
            row = point.key | metrics | provenance(point.config)
            new[_key_of(point.key.values())] = row
            if header and set(row) <= set(header):
                with open(path, "a", newline="") as f:
                    csv.DictWriter(f, fieldnames=header).writerow(row)
            else:  # a new file, or new columns: rewrite it whole
                merged = pd.concat([old, pd.DataFrame(list(new.values()))], ignore_index=True)
                _write(merged, path)
                header = list(merged.columns)
            bar.update(1)
    finally:
        bar.close()
    ordered = [new[_key_of(p.key.values())] for p in todo if _key_of(p.key.values()) in new]
    rows = pd.concat([old, pd.DataFrame(ordered)], ignore_index=True) if ordered else old
    if ordered:
        _write(rows, path)  # the same rows, now in point order: deterministic files
    rows = pd.read_csv(path)  # one parse for old and new rows alike (types as on disk)
    wanted = {_key_of(p.key.values()): i for i, p in enumerate(points)}
    mine = rows[[_key_of(r) in wanted for r in rows[keys].itertuples(index=False)]].copy()
    mine["_order"] = [wanted[_key_of(r)] for r in mine[keys].itertuples(index=False)]
    return mine.sort_values("_order").drop(columns="_order").reset_index(drop=True)


def _write(rows: pd.DataFrame, path: Path) -> None:
    tmp = path.with_suffix(".csv.tmp")
    rows.to_csv(tmp, index=False)
    os.replace(tmp, path)


Kind = Literal["mechanism", "arithmetic", "input"]
KINDS: tuple[Kind, ...] = ("mechanism", "arithmetic", "input")


@dataclass(frozen=True, kw_only=True)
class Claim:
    """One number the paper states, and ours."""

    id: str
    """Stable name, e.g. ``fig8a.aurora_over_full.qwen3-4b``."""
    where: str
    """Where the paper states it (``§6.2 Fig. 8a``)."""
    text: str
    """What is claimed, with its unit."""
    low: float | None
    """The paper's value, or the low end of its range (None: not a number)."""
    high: float | None
    """The high end of the paper's range (= ``low`` for a single value)."""
    ours: float | None
    """Our value (None: not simulable; ``note`` says why)."""
    kind: Kind
    """What our value rests on: ``mechanism`` (modelled behaviour: queues, streams, leases,
    overlap), ``arithmetic`` (stated inputs combined by a formula: bytes / rate, prices) or
    ``input`` (a stated input that comes back out). Only a ``mechanism`` row can count as
    reproduced: an arithmetic or input row agrees or disagrees by construction of its inputs."""
    steady: bool = True
    """False when a run behind the value did not reach steady state (the warm-up detection,
    :func:`warmup_steps`, found no stationary tail in the steps run): the row says so and does
    not count. True also for one-shot measurements (a single transfer), which have no warm-up."""
    note: str = ""
    """Why a claim is not simulable, or what an open-ended range means."""

    @property
    def paper(self) -> str:
        if self.low is None:
            return "-"
        if self.high is None or self.high == self.low:
            return f"{self.low:.3g}"
        if math.isinf(self.high):
            return f"> {self.low:.3g}"
        return f"{self.low:.3g}-{self.high:.3g}"

    @property
    def within(self) -> bool:
        """Whether our value is inside the paper's range (a single value: within 20%)."""
        if self.ours is None or self.low is None or not math.isfinite(self.ours):
            return False
        high = self.low if self.high is None else self.high
        tol = 0.0 if high != self.low else 0.2  # a single value: within 20%
        return self.low * (1 - tol) <= self.ours <= high * (1 + tol)

    @property
    def reproduced(self) -> bool:
        """Counts as reproduced: a steady ``mechanism`` row within the paper's value."""
        return self.kind == "mechanism" and self.steady and self.within

    @property
    def verdict(self) -> str:
        v = self._comparison
        if self.ours is None or v == "-":
            return v
        if not self.steady:
            return f"{v}; NOT STEADY (run too short), not counted"
        if self.kind != "mechanism":
            return f"{v}; {self.kind}, not counted"
        return v

    @property
    def _comparison(self) -> str:
        if self.ours is None:
            return "not simulable"
        if self.low is None or not math.isfinite(self.ours):
            return "-"
        high = self.low if self.high is None else self.high
        if self.within:
            return "within" if high != self.low else f"within 20% ({self.ours / self.low:.2f}x)"
        edge = self.low if self.ours < self.low else high
        side = "below" if self.ours < self.low else "above"
        return f"{side} by {abs(self.ours / edge - 1):.0%}" if edge else side


VERDICT_WORDS = {
    "within": "our value is inside the paper's range (a single value: within 20% of it)",
    "below": "our value is under the paper's range, by the share given",
    "above": "our value is over the paper's range, by the share given",
    "not simulable": "the claim is about training quality, which the simulator does not model",
    "NOT STEADY": "a run behind the value had not reached steady state; the row does not count",
    "arithmetic, not counted": "our value is stated inputs through a formula (bytes / rate, "
    "prices): it agrees or disagrees by construction, so it never counts as reproduced",
    "input, not counted": "our value is one of the paper's stated inputs coming back out: it "
    "agrees by construction and never counts as reproduced",
}
"""What each verdict word of :func:`claims_table` means (its footer explains the ones used)."""


def verdict_footer(verdicts: Iterable[str]) -> str:
    """A footer explaining every verdict word that occurs in ``verdicts``; '' when none does."""
    text = " ".join(verdicts)
    used = [
        (word, meaning)
        for word, meaning in VERDICT_WORDS.items()
        if re.search(rf"(^|[ ;(]){re.escape(word)}\b", text)
    ]
    if not used:
        return ""
    text = "verdicts: " + "; ".join(f'"{word}": {meaning}' for word, meaning in used) + "."
    return textwrap.fill(text, width=100, subsequent_indent="  ")


def claims_table(claims: Sequence[Claim]) -> str:
    """A table of claims: where, what, paper, ours, kind, verdict; a footer says what the
    verdict words used mean."""
    lines = [f"{'where':<16} {'claim':<62} {'paper':>13} {'ours':>9}  {'kind':<10}  verdict"]
    for c in claims:
        ours = "-" if c.ours is None else f"{c.ours:.3g}"
        lines.append(
            f"{c.where:<16} {c.text:<62} {c.paper:>13} {ours:>9}  {c.kind:<10}  {c.verdict}"
        )
        if c.ours is None and c.note:
            lines.append(f"{'':<16}   ({c.note})")
    footer = verdict_footer(c.verdict for c in claims)
    if footer:
        lines.append(footer)
    return "\n".join(lines)


def kind_counts(claims: Sequence[Claim]) -> str:
    """Per kind: how many rows, how many simulated, steady, within the paper's value, and
    reproduced (only ``mechanism`` rows can be)."""
    lines = []
    for kind in KINDS:
        mine = [c for c in claims if c.kind == kind]
        simulated = [c for c in mine if c.ours is not None]
        steady = [c for c in simulated if c.steady]
        within = [c for c in steady if c.within]
        lines.append(
            f"{kind:<10} {len(mine):>3} rows: {len(simulated)} simulated, {len(steady)} steady, "
            f"{len(within)} within the paper's value, "
            f"{sum(c.reproduced for c in mine)} counted as reproduced"
            + ("" if kind == "mechanism" else " (agrees or not by construction)")
        )
    return "\n".join(lines)


def one(rows: pd.DataFrame, column: str, **where: Any) -> float:
    """The single value of ``column`` in the row matching ``where``."""
    sel = rows
    for k, v in where.items():
        sel = sel[sel[k] == v]
    if len(sel) != 1:
        raise KeyError(f"{len(sel)} rows match {where}")
    return float(sel[column].iloc[0])


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


WARMUP = "mser"
"""The warm-up rule of every summary-measured row (:func:`warmup_steps`); a key column, so rows
measured under another rule are recomputed rather than reused."""


STEADY_TOLERANCE = 0.02
"""How far (relative) the mean after the warm-up may sit from the mean of the run's last quarter
for the run to count as steady: the 2% at which the experiments call a mechanism's effect
(``regimes.THRESHOLD_PCT``); a transient still going at the end moves the last quarter."""


def warmup_steps(series: Sequence[float]) -> tuple[int, bool]:
    """The warm-up of a per-step series by MSER (White 1997; Hoad, Robinson & Davies 2010):
    the truncation ``d`` that minimises the squared standard error of the mean of what is
    left, ``sum((y[d:] - mean(y[d:]))**2) / (n - d)**2``, the smallest such ``d`` on ties.
    ``d`` is searched over the first half of the run only: past it the statistic is minimised
    by chance by a few quiet last steps (MSER's known tail artefact; a stationary 40-step run
    of the heterogeneity experiment picks d = 27 otherwise). Returns ``(d, steady)``: steady
    when the mean after ``d`` is within :data:`STEADY_TOLERANCE`, or two standard errors, of
    the mean of the last quarter of the run (at least 2 steps), i.e. nothing is still drifting
    at the end; False also for runs of fewer than 4 steps."""
    y = np.asarray(series, dtype=float)
    n = len(y)
    if n < 4:
        return 0, False
    half = n // 2
    mser = np.array([((y[d:] - y[d:].mean()) ** 2).sum() / (n - d) ** 2 for d in range(half + 1)])
    # Equal up to rounding counts as a tie (a constant tail gives zeros only up to rounding).
    ties = mser <= mser.min() * (1 + 1e-9) + 1e-12 * float(np.mean(y**2))
    best = int(np.flatnonzero(ties)[0])
    k = max(n // 4, 2)
    tail, last = float(y[best:].mean()), float(y[-k:].mean())
    # The last quarter's mean has its own sampling error: two standard errors of it (a noisy
    # link's step times vary by several %). The step-to-step noise is estimated robustly, from
    # the median absolute successive difference (MAD x 1.4826 / sqrt 2 for Gaussian noise), so
    # a transient's one large jump does not count as noise and hide itself.
    diffs = np.abs(np.diff(y[best:]))
    sigma = 1.4826 * float(np.median(diffs)) / math.sqrt(2) if len(diffs) else 0.0
    noise = 2 * sigma / math.sqrt(k)
    return best, abs(tail - last) <= max(STEADY_TOLERANCE * abs(last), noise)


def steady_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Tokens/s, step time and WAN GB per step over the steps after the detected warm-up
    (:func:`warmup_steps` on the step times), with the warm-up and whether it was found."""
    d, steady = warmup_steps([r["step_time_s"] for r in rows])
    tail = rows[d:]
    span = sum(r["step_time_s"] for r in tail)
    return {
        "tokens_per_s": sum(r["tokens"] for r in tail) / span if span > 0 else math.nan,
        "step_time_s": span / len(tail) if tail else math.nan,
        "wan_gb_per_step": sum(r["wan_bytes"] for r in tail) / max(len(tail), 1) / 1e9,
        "warmup_steps": d,
        "steady": steady,
    }


def summary_measure(cfg: SimConfig) -> dict[str, Any]:
    """Mean tokens/s, step time and WAN GB per step after the warm-up :func:`warmup_steps`
    detects, the warm-up, and whether the run reached steady state."""
    from sim.model import simulate

    return steady_summary(simulate(cfg).rows)


def steady(rows: pd.DataFrame, **where: Any) -> bool:
    """Whether every row matching ``where`` reached steady state (rows without the column,
    e.g. one-shot transfers, have no warm-up to detect)."""
    sel = rows
    for k, v in where.items():
        sel = sel[sel[k] == v]
    if "steady" not in sel.columns:
        return True
    return bool(sel["steady"].astype(bool).all())


def fanout_measure(cfg: SimConfig) -> dict[str, float]:
    """Seconds for one version (bytes ready) to reach every Actor, and its size (MB)."""
    from sim.model import Simulation

    sim = Simulation(cfg)
    return {"transfer_s": sim.measure_fanout(), "payload_mb": sim.version_bytes / 1e6}


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
    logy: bool = False,
) -> None:
    """Grouped bars of ``value`` by ``x`` and ``hue``; paper values as black crosses; ``logy``
    for values spanning decades (a linear axis hides the small bars)."""
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
    labels = [str(v) for v in xs]
    ax.set_xticks(np.arange(len(xs)) + width * (len(hues) - 1) / 2, labels)
    if sum(len(label) for label in labels) > 60:  # would overlap side by side
        ax.tick_params(axis="x", labelrotation=30)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    if logy:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, axis="y", which="both" if logy else "major", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
