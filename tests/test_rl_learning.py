"""The learning check (``experiments/learning.py``): its claim, the learning rates it measures,
and its entry point. The learning runs themselves take minutes (docs/RL.md has their numbers
and the command); here the claim's logic is checked on given rows and the pipeline runs once on
a seconds-long smoke configuration."""

from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from experiments import learning  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def rows(default: list[float], control: list[float]) -> pd.DataFrame:
    return pd.DataFrame(
        [{"preset": "default", "seed": i, "greedy_gain_points": g} for i, g in enumerate(default)]
        + [
            {"preset": "control-lr0", "seed": i, "greedy_gain_points": g}
            for i, g in enumerate(control)
        ]
    )


def test_the_claim_needs_the_mean_margin_every_seed_improving_three_seeds_and_a_flat_control():
    assert learning.verdict(rows([8.0, 6.0, 5.0], [0.0, 0.0, 0.0]))["passes"]
    assert not learning.verdict(rows([4.0, 5.0, 5.0], [0.0, 0.0, 0.0]))["passes"]  # mean < 5
    assert not learning.verdict(rows([14.0, 6.0, -1.0], [0.0, 0.0, 0.0]))["passes"]  # a seed lost
    assert not learning.verdict(rows([8.0, 6.0], [0.0, 0.0]))["passes"]  # two seeds only
    assert not learning.verdict(rows([8.0, 6.0, 5.0], [0.0, 0.4, 0.0]))["passes"]  # control moved
    assert not learning.verdict(rows([8.0, 6.0, 5.0], []))["passes"]  # no control


def test_the_measured_learning_rates_are_the_ones_aurora_real_trains_at():
    from aurora.runtime.rlbackend import LEARN_LR
    from aurora.topology import load_topology

    geo = load_topology(ROOT / "examples" / "geo.yaml")
    # aurora real --topology examples/geo.yaml trains at the learn regime's rate: a measured point.
    assert geo.real.learning_rate is None and geo.real.regime == "learn"
    assert learning.regime_config(0).lr == LEARN_LR
    assert {c.preset for c in learning.points()} == {"default", "learn-regime", "control-lr0"}
    assert all(c.lr == 0.0 for c in learning.points() if c.preset == "control-lr0")


def test_the_smoke_run_writes_rows_curves_and_a_figure_and_a_rerun_computes_nothing(
    tmp_path, monkeypatch
):
    argv = ["--smoke", "--out", str(tmp_path), "--cache", str(tmp_path / "cache")]
    got = learning.main(argv)
    assert sorted(got.preset) == ["smoke", "smoke-lr0"]
    control = got[got.preset == "smoke-lr0"].iloc[0]
    assert control.density_mean == 0.0 and control.greedy_after == control.greedy_before
    # both start from the same cached v0 snapshot (built by the first, found by the second)
    assert got.greedy_before.nunique() == 1 and sorted(got.warm_start_cached) == [False, True]
    saved = pd.read_csv(tmp_path / "learning" / "rows.csv")
    assert {"git_sha", "seed", "lr", "config", "density_mean", "logp_diff_max_median"} <= set(
        saved.columns
    )
    curves = pd.read_csv(tmp_path / "learning" / "curves.csv")
    per_step = curves.dropna(subset=["density"])
    assert len(per_step) == 2 * 2 and per_step.logp_diff_max.notna().all()
    assert len(curves.dropna(subset=["greedy"])) == 2 * 3  # before, after step 1, after step 2
    assert (tmp_path / "learning" / "learning.png").stat().st_size > 10_000

    def no_run(*_a, **_k):
        raise AssertionError("a finished run was computed again")

    monkeypatch.setattr(learning, "run", no_run)
    again = learning.main(argv)
    assert again.equals(got)
