"""Every experiment runs with its quick budget into a temporary results folder, writes rows and a
figure and prints the paper's numbers beside ours; the notebook reads the results."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pandas as pd
import pytest
from nbclient import NotebookClient

from experiments import all as run_all
from experiments import bandwidth_sweep, heterogeneity, throughput

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("results")
    run_all.main(["--out", str(root)])
    return root


@pytest.mark.parametrize("name", run_all.EXPERIMENTS)
def test_each_experiment_writes_rows_with_config_and_a_figure(results, name):
    rows = pd.read_csv(results / name / "rows.csv")
    assert len(rows) > 0
    assert {"git_sha", "seed", "strategy", "model"} <= set(rows.columns)
    assert (results / name / f"{name}.png").stat().st_size > 10_000


def test_the_tables_put_the_paper_beside_ours_for_every_experiment(results):
    text = (results / "REPRODUCTION-tables.md").read_text()
    for name in run_all.EXPERIMENTS:
        assert f"## {name}" in text
    assert text.count("paper") >= len(run_all.EXPERIMENTS)


def test_rerunning_a_sweep_computes_nothing_new(results, monkeypatch):
    before = pd.read_csv(results / "heterogeneity" / "rows.csv")
    monkeypatch.setattr(heterogeneity, "summary_measure", lambda cfg: pytest.fail("recomputed"))
    again = heterogeneity.main(["--out", str(results)])
    assert len(again) == len(before)


def test_bandwidth_sweep_scales_dense_transfer_inversely_with_the_link(results):
    rows = pd.read_csv(results / "bandwidth_sweep" / "rows.csv")
    full = rows[rows.system.str.startswith("Full")].set_index("gbps").transfer_s
    assert full[0.25] / full[10.0] == pytest.approx(40, rel=0.01)
    delta = rows[rows.system.str.contains("LEB128")].set_index("gbps").transfer_s
    assert (full / delta).min() > 50  # 15.6 GB dense vs 202 MB delta


def test_throughput_ranks_the_strategies(results):
    rows = pd.read_csv(results / "throughput" / "rows.csv")
    t = rows[rows.model == "qwen3-8b"].set_index("system").tokens_per_s
    assert t["ideal-singledc"] >= t["aurora-leb128"] > t["prime-multistream"] > t["prime-full"]
    assert set(rows.system) == set(throughput.STRATEGIES)


def test_the_analysis_notebook_runs_on_the_results(results, monkeypatch):
    monkeypatch.setenv("AURORA_RESULTS", str(results))
    nb = nbformat.read(ROOT / "notebooks" / "analysis.ipynb", as_version=4)
    NotebookClient(nb, timeout=120, resources={"metadata": {"path": str(results)}}).execute()
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "throughput rows" in text and "dense / delta" in text


def test_an_experiment_runs_with_a_tiny_budget(tmp_path):
    rows = bandwidth_sweep.main(["--out", str(tmp_path)])
    assert len(rows) == len(bandwidth_sweep.BANDWIDTHS_GBPS) * len(bandwidth_sweep.SYSTEMS)
