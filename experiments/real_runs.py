"""Plumbing of the experiments that run real processes (``aurora real``) instead of the simulator.

Theory of operation
-------------------
A real-mode experiment describes each run by a frozen config whose ``key()`` names it (strategy,
seed, steps, preset) and a ``measure`` that starts the run and reads its files. :func:`sweep`
runs the configs whose key is not yet in ``<root>/<name>/rows.csv``, one at a time (a real run
already uses every core), and appends each row as soon as the run ends: an interrupted sweep
resumes at the first missing run. :func:`launch` starts one run through the runtime's own
launcher, exactly what ``aurora real`` does, over the emulated WAN or a stated fallback, and
raises on failure so a sweep never records a row for a run that did not complete.
:func:`paired_bootstrap` and :func:`t_interval` give intervals of a mean paired difference.

Other experiments (``experiments.accuracy``; ``experiments.sim_vs_real`` may use it) rely on
these functions' signatures: keep them stable."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd

from aurora.runtime.launcher import EXIT_BAD_INPUT, EXIT_OK, Launcher, RealRun, run_folder


class RunConfig(Protocol):
    def key(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Outcome:
    """What one launched run left behind."""

    dir: Path
    """The run's folder (``steps.csv``, ``summary.json``, ``events.csv``, ``timeline.csv``)."""
    wan: str
    """``emulated``, ``loopback`` or ``loopback (<why the emulated WAN was not used>)``."""

    @property
    def summary(self) -> dict[str, Any]:
        return dict(json.loads((self.dir / "summary.json").read_text()))

    @property
    def steps(self) -> pd.DataFrame:
        return pd.read_csv(self.dir / "steps.csv")


class RunFailed(RuntimeError):
    """A real run did not complete; the message names its folder and exit code."""


class _Tee(io.TextIOBase):
    def __init__(self, *streams: Any) -> None:
        self.streams = streams

    def write(self, s: str) -> int:
        for st in self.streams:
            st.write(s)
        return len(s)

    def flush(self) -> None:
        for st in self.streams:
            st.flush()


def emulation_unavailable() -> str | None:
    """Why the emulated WAN cannot be built here (None: it can)."""
    try:
        from emulation.capabilities import check_available
        from emulation.plan import EmulationError

        check_available()
    except EmulationError as exc:
        return str(exc).splitlines()[0]
    return None


def launch(run: RealRun) -> Outcome:
    """Start ``run`` (its ``emulate``, if set, falls back to loopback with the reason) and wait
    for it; raise :class:`RunFailed` unless it completed.

    What an experiment adds to the runtime's launcher
    (:class:`aurora.runtime.launcher.Launcher`):

    * **The emulated WAN, or a stated fallback.** With ``emulate`` set, the run goes over the
      emulated WAN (network namespaces behind a shaping router, ``docs/EMULATION.md``). Where that
      is impossible (not root, no ``ip``/``tc``, the build failed) the run goes over loopback
      instead and the reason is returned, so every row says which network it crossed (``wan``
      column).
    * **Its failure as an exception** naming the run's folder and the launcher's last message, so
      a sweep never records a row for a run that did not complete.

    Stable API: ``launch(run: RealRun) -> Outcome``; ``Outcome.dir``, ``.wan``, ``.summary``
    (the run's ``summary.json``), ``.steps`` (its ``steps.csv``); raises :class:`RunFailed`.
    """
    wan = "emulated" if run.emulate else "loopback"
    if run.emulate:
        why = emulation_unavailable()
        if why is not None:
            run, wan = replace(run, emulate=None), f"loopback ({why})"
    code, err = _launch_once(run)
    if code == EXIT_BAD_INPUT and run.emulate and "--emulate" in err:
        reason = err.split("--emulate:", 1)[1].strip().splitlines()[0]
        run, wan = replace(run, emulate=None), f"loopback (emulated WAN failed: {reason})"
        code, err = _launch_once(run)
    folder = run_folder(run)
    if code != EXIT_OK or not (folder / "summary.json").exists():
        last = err.strip().splitlines()[-1] if err.strip() else "(nothing on stderr)"
        raise RunFailed(f"{folder}: aurora real exited {code}: {last}")
    if wan == "emulated" and not json.loads((folder / "summary.json").read_text())["emulated"]:
        wan = "loopback (the strategy has no WAN to shape)"
    return Outcome(dir=folder, wan=wan)


def _launch_once(run: RealRun) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(_Tee(sys.stderr, err)):
        code = Launcher(run).main()
    return code, err.getvalue()


# ------------------------------------------------------------------------------------------
# Resumable rows
# ------------------------------------------------------------------------------------------


def _key_of(values: Sequence[Any]) -> tuple[str, ...]:
    return tuple(str(v) for v in values)


def _read(path: Path) -> pd.DataFrame:
    return pd.read_csv(path) if path.exists() and path.stat().st_size else pd.DataFrame()


def _write(df: pd.DataFrame, path: Path) -> None:
    tmp = path.with_suffix(".csv.tmp")
    df.to_csv(tmp, index=False)
    os.replace(tmp, path)


def _has(df: pd.DataFrame, keys: list[str], key: tuple[str, ...]) -> pd.Series:
    if df.empty or not all(k in df.columns for k in keys):
        return pd.Series(False, index=df.index)
    return pd.Series([_key_of(r) == key for r in df[keys].itertuples(index=False)], index=df.index)


def sweep(
    name: str,
    configs: Sequence[RunConfig],
    measure: Callable[[Any], tuple[dict[str, Any], list[dict[str, Any]]]],
    *,
    root: Path,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Run the configs missing from ``<root>/<name>/rows.csv`` (``measure(config)`` returns the
    row and the per-step rows); return the rows and the per-step rows of ``configs``.

    The run's per-step rows are appended to ``curves.csv``; re-running a finished sweep computes
    nothing. Stable API: ``sweep(name, configs, measure, *, root) -> (rows, curves)``: each
    config has ``key() -> dict`` (the same keys for all), ``measure(config) -> (row,
    per_step_rows)``; the row should carry the key's columns, and each per-step row too (an
    interrupted run's curve is replaced by matching them).
    """
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    rows_path, curves_path = out / "rows.csv", out / "curves.csv"
    keys = list(configs[0].key()) if configs else []
    for cfg in configs:
        key = _key_of(list(cfg.key().values()))
        if _has(_read(rows_path), keys, key).any():
            continue
        print(f"[{name}] {cfg.key()}", flush=True)
        row, curve = measure(cfg)
        curves = _read(curves_path)
        curves = curves[~_has(curves, keys, key)]  # a run interrupted after its curve was written
        _write(pd.concat([curves, pd.DataFrame(curve)], ignore_index=True), curves_path)
        _write(pd.concat([_read(rows_path), pd.DataFrame([row])], ignore_index=True), rows_path)
    wanted = {_key_of(list(c.key().values())) for c in configs}

    def mine(df: pd.DataFrame) -> pd.DataFrame:
        if df.empty:
            return df
        return df[[_key_of(r) in wanted for r in df[keys].itertuples(index=False)]].reset_index(
            drop=True
        )

    return mine(_read(rows_path)), mine(_read(curves_path))


# ------------------------------------------------------------------------------------------
# Statistics
# ------------------------------------------------------------------------------------------


def paired_bootstrap(
    diffs: Sequence[float], *, level: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float, float]:
    """Mean of paired differences and its percentile bootstrap interval (resampling the pairs).

    With n pairs there are only C(2n-1, n) distinct resamples (10 for n = 3), so the interval
    is coarse and, for small n, narrower than a t interval: for n = 3 the 95% interval is
    exactly [min, max] of the differences (each all-equal resample has probability 1/27, above
    2.5%). Read it with n and :func:`t_interval` beside it. One pair: the mean, no interval
    (NaN); no pair: NaN.

    Computed with ``scipy.stats.bootstrap``. Stable API: ``paired_bootstrap(diffs, *, level,
    resamples, seed) -> (mean, low, high)``.
    """
    x = np.asarray([d for d in diffs if np.isfinite(d)], dtype=float)
    if x.size == 0:
        return (float("nan"),) * 3
    if x.size == 1:
        return float(x[0]), float("nan"), float("nan")
    if np.ptp(x) == 0:  # every resample has the same mean
        return float(x[0]), float(x[0]), float(x[0])
    from scipy.stats import bootstrap

    res = bootstrap(
        (x,),
        np.mean,
        confidence_level=level,
        n_resamples=resamples,
        method="percentile",
        random_state=np.random.default_rng(seed),
    )
    ci = res.confidence_interval
    return float(x.mean()), float(ci.low), float(ci.high)


def t_interval(diffs: Sequence[float], *, level: float = 0.95) -> tuple[float, float]:
    """The t interval of the mean of ``diffs`` (NaN with fewer than two; the mean itself when
    they are all equal).

    Stable API: ``t_interval(diffs, *, level) -> (low, high)``.
    """
    x = np.asarray([d for d in diffs if np.isfinite(d)], dtype=float)
    if x.size < 2:
        return float("nan"), float("nan")
    from scipy import stats

    half = float(stats.t.ppf(0.5 + level / 2, x.size - 1) * x.std(ddof=1) / np.sqrt(x.size))
    return float(x.mean()) - half, float(x.mean()) + half
