"""experiments.accuracy and experiments.real_runs: the quick mode end to end on real processes
(two strategies, one seed, two steps, on loopback), its rows, resuming, the statistics on known
inputs, the launch fallbacks, and the notebook that reads the rows."""

from __future__ import annotations

import contextlib
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat
import numpy as np
import pandas as pd
import pytest
from nbclient import NotebookClient

from aurora.jobspec import JobSpec
from experiments import accuracy, real_runs
from experiments.real_runs import paired_bootstrap, sweep, t_interval

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``python -m experiments.accuracy --ci`` once (two real runs): its results root and what
    it printed."""
    root = tmp_path_factory.mktemp("results")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        accuracy.main(["--ci", "--out", str(root)])
    return root, out.getvalue()


def test_quick_mode_runs_every_strategy_and_writes_rows_curves_comparison_figure_and_table(quick):
    root, printed = quick
    rows = pd.read_csv(root / "accuracy" / "rows.csv")
    curves = pd.read_csv(root / "accuracy" / "curves.csv")
    assert sorted(rows.strategy) == sorted(["ideal-singledc", "aurora"])
    assert (rows.steps == 2).all() and (rows.seed == 0).all()
    assert sorted(curves.step.unique()) == [1, 2]
    assert len(curves) == 2 * len(rows)
    assert (root / "accuracy" / "accuracy.png").stat().st_size > 10_000
    cmp = pd.read_csv(root / "accuracy" / "comparison.csv")
    assert set(cmp.metric) == set(accuracy.METRICS)
    assert "paired by seed, minus ideal-singledc" in printed
    assert "paper Table 5" in printed
    # The runs are real: held-out evaluated before and after, every activation bit-exact, no
    # batch staler than aurora's lag bound of one version, nothing lost.
    assert rows.heldout_before.between(0, 100).all() and rows.heldout_after.between(0, 100).all()
    assert (rows.hash_mismatches == 0).all() and (rows.activations > 0).all()
    assert (rows.staleness_max <= 1).all() and (rows.prompts_lost == 0).all()
    assert (rows.wan.str.startswith("loopback")).all()


def test_each_row_carries_its_resolved_config_seed_and_git_sha(quick):
    root, _ = quick
    rows = pd.read_csv(root / "accuracy" / "rows.csv")
    for r in rows.itertuples():
        config = json.loads(r.config)
        assert config["strategy"] == r.strategy and config["seed"] == r.seed
        assert config["steps"] == 2 and config["settings"]["eval_prompts"] == 20
        spec = JobSpec.decode(json.loads(r.spec))
        assert spec.seed == r.seed and spec.strategy.name == r.strategy
        assert spec.eval_prompts == 20 and spec.learning_rate == r.learning_rate
        assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?|unknown", r.git_sha)
        assert Path(r.run_dir, "summary.json").exists()


def test_running_the_quick_mode_again_measures_nothing(quick, monkeypatch):
    root, _ = quick

    def fail(*_: Any) -> Any:
        raise AssertionError("a run that is already in rows.csv was run again")

    monkeypatch.setattr(accuracy, "measure", fail)
    before = pd.read_csv(root / "accuracy" / "rows.csv")
    rows, curves = accuracy.run_all(accuracy.ci_runs(), root)
    pd.testing.assert_frame_equal(rows, before)
    assert len(curves) == 4


@dataclass(frozen=True)
class _Cfg:
    strategy: str
    seed: int

    def key(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "seed": self.seed}


def _fake_measure(calls: list[_Cfg]):
    def measure(cfg: _Cfg) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        calls.append(cfg)
        curve = [{**cfg.key(), "step": s, "reward": 10.0 * s + cfg.seed} for s in (1, 2)]
        return {**cfg.key(), "metric": float(cfg.seed)}, curve

    return measure


def test_a_sweep_resumes_at_the_first_missing_run_and_replaces_a_half_written_curve(tmp_path):
    configs = [_Cfg(s, seed) for seed in (0, 1) for s in ("a", "b")]
    calls: list[_Cfg] = []
    sweep("x", configs[:3], _fake_measure(calls), root=tmp_path)
    assert calls == configs[:3]
    # An interrupted run: its curve was written, its row was not.
    curves = pd.read_csv(tmp_path / "x" / "curves.csv")
    extra = pd.DataFrame([{"strategy": "b", "seed": 1, "step": 1, "reward": -1.0}])
    pd.concat([curves, extra]).to_csv(tmp_path / "x" / "curves.csv", index=False)
    calls.clear()
    rows, curves = sweep("x", configs, _fake_measure(calls), root=tmp_path)
    assert calls == [configs[3]]
    assert len(rows) == 4 and len(curves) == 8
    assert (curves.reward >= 0).all()  # the half-written curve was dropped
    # Asking for a subset returns only its rows and runs nothing.
    calls.clear()
    rows, _ = sweep("x", configs[:2], _fake_measure(calls), root=tmp_path)
    assert calls == [] and list(rows.strategy) == ["a", "b"]


def test_the_paired_bootstrap_of_three_pairs_is_their_range_and_of_many_matches_the_t_interval():
    # n = 3: each all-equal resample has probability 1/27 > 2.5%, so the 95% percentile
    # interval is exactly [min, max].
    assert paired_bootstrap([1.0, 2.0, 6.0]) == (3.0, 1.0, 6.0)
    assert paired_bootstrap([-4.0, 0.5, 2.0]) == pytest.approx((-0.5, -4.0, 2.0))
    mean, lo, hi = paired_bootstrap([5.0])
    assert mean == 5.0 and np.isnan(lo) and np.isnan(hi)
    assert paired_bootstrap([2.0, 2.0, 2.0]) == (2.0, 2.0, 2.0)
    assert all(np.isnan(paired_bootstrap([])))
    x = np.random.default_rng(1).normal(3.0, 2.0, 400)
    mean, lo, hi = paired_bootstrap(x)
    tlo, thi = t_interval(x)
    assert mean == pytest.approx(x.mean())
    assert lo == pytest.approx(tlo, abs=0.03) and hi == pytest.approx(thi, abs=0.03)
    assert paired_bootstrap(x, seed=0) == paired_bootstrap(x, seed=0)  # reproducible


def test_the_t_interval_on_known_inputs():
    # mean 3, sd sqrt(7), t(0.975, 2) = 4.302653 -> half-width 4.302653 * sqrt(7/3) = 6.572411
    assert t_interval([1.0, 2.0, 6.0]) == pytest.approx((3 - 6.572411, 3 + 6.572411), abs=1e-5)
    assert all(np.isnan(t_interval([1.0])))


def test_compare_pairs_each_strategy_with_the_reference_by_seed():
    rows = pd.DataFrame(
        [
            {"strategy": s, "seed": seed, **{m: base + off for m in accuracy.METRICS}}
            for seed, base in ((0, 50.0), (1, 60.0), (2, 40.0))
            for s, off in (("ideal-singledc", 0.0), ("aurora", seed - 1.0), ("prime-async4", -5))
        ]
    )
    cmp = accuracy.compare(rows).set_index(["strategy", "metric"])
    a = cmp.loc[("aurora", "heldout_after")]
    assert (a["diff"], a["diff_low"], a["diff_high"], a["pairs"]) == (0.0, -1.0, 1.0, 3)
    p = cmp.loc[("prime-async4", "heldout_after")]
    assert (p["diff"], p["diff_low"], p["diff_high"]) == (-5.0, -5.0, -5.0)
    assert p["mean"] == 45.0 and p["sd"] == pytest.approx(10.0)
    assert np.isnan(cmp.loc[("ideal-singledc", "heldout_after")]["diff"])


def test_launch_falls_back_to_loopback_with_the_reason_when_the_emulated_wan_is_unavailable(
    tmp_path, monkeypatch
):
    from aurora.runtime.launcher import EXIT_BAD_INPUT, EXIT_OK, RealRun, run_folder
    from aurora.topology import load_topology

    launched: list[RealRun] = []

    def fake(run: RealRun, *, fail_emulated: bool) -> tuple[int, str]:
        launched.append(run)
        if run.emulate and fail_emulated:
            return EXIT_BAD_INPUT, "aurora real: --emulate: cannot create a namespace\n"
        run_folder(run).mkdir(parents=True, exist_ok=True)
        (run_folder(run) / "summary.json").write_text(json.dumps({"emulated": False}))
        return EXIT_OK, ""

    run = RealRun(
        topology=load_topology(accuracy.TOPOLOGY),
        topology_path=str(accuracy.TOPOLOGY),
        strategy="aurora",
        out=str(tmp_path),
        emulate="auto",
    )
    monkeypatch.setattr(real_runs, "emulation_unavailable", lambda: "not root")
    monkeypatch.setattr(real_runs, "_launch_once", lambda r: fake(r, fail_emulated=False))
    out = real_runs.launch(run)
    assert out.wan == "loopback (not root)" and launched[-1].emulate is None

    launched.clear()
    monkeypatch.setattr(real_runs, "emulation_unavailable", lambda: None)
    monkeypatch.setattr(real_runs, "_launch_once", lambda r: fake(r, fail_emulated=True))
    out = real_runs.launch(run)
    assert out.wan == "loopback (emulated WAN failed: cannot create a namespace)"
    assert [r.emulate for r in launched] == ["auto", None]


def test_a_run_that_does_not_complete_raises_with_its_folder_and_leaves_no_row(
    tmp_path, monkeypatch
):
    from aurora.runtime.launcher import EXIT_STALLED

    monkeypatch.setattr(
        real_runs, "_launch_once", lambda r: (EXIT_STALLED, "aurora real: no step for 300 s\n")
    )
    runs = [accuracy.AccuracyRun(preset="ci", strategy="aurora", seed=0, steps=2, emulate=False)]
    with pytest.raises(real_runs.RunFailed, match=r"exited 3: aurora real: no step for 300 s"):
        accuracy.run_all(runs, tmp_path)
    assert not (tmp_path / "accuracy" / "rows.csv").exists()


def test_the_notebook_runs_on_the_quick_rows_and_renders_its_figures(quick, monkeypatch):
    root, _ = quick
    monkeypatch.setenv("AURORA_RESULTS", str(root))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(ROOT / "notebooks" / "real_accuracy.ipynb", as_version=4)
    NotebookClient(nb, timeout=120, resources={"metadata": {"path": str(root)}}).execute()
    plotting = [c for c in nb.cells if c.cell_type == "code" and "plt." in c.source]
    assert plotting
    for cell in plotting:
        images = [o for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
        assert images, f"a plotting cell rendered no image:\n{cell.source[:200]}"
