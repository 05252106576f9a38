"""Experiments run with a tiny budget into a temporary results folder; the notebook reads them."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pandas as pd
from nbclient import NotebookClient

from experiments import bandwidth_sweep, throughput

ROOT = Path(__file__).resolve().parent.parent


def test_bandwidth_sweep_writes_rows_a_figure_and_the_paper_table(tmp_path, capsys):
    rows = bandwidth_sweep.main(["--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "Qwen3-8B Full at 10 Gbps" in out and "ours/paper" in out
    assert (tmp_path / "bandwidth_sweep" / "bandwidth_sweep.png").stat().st_size > 10_000
    # Dense over a 40x slower link takes 40x longer; the delta is ~77x smaller than dense.
    full = rows[rows.system.str.startswith("Full")].set_index("gbps").transfer_s
    assert full[0.25] / full[10.0] == __import__("pytest").approx(40, rel=0.01)
    # A second run finds every row and computes nothing new.
    again = bandwidth_sweep.main(["--out", str(tmp_path)])
    assert len(again) == len(rows)
    assert list(pd.read_csv(tmp_path / "bandwidth_sweep" / "rows.csv").columns)[:3] == [
        "model",
        "gbps",
        "system",
    ]


def test_throughput_smoke_and_the_notebook_reads_the_results(tmp_path, capsys, monkeypatch):
    rows = throughput.main(["--out", str(tmp_path), "--steps", "4"])
    out = capsys.readouterr().out
    assert "AuroraRL / PrimeRL-Full, Qwen3-4B" in out
    assert {"git_sha", "seed", "tokens_per_s", "step_time_s"} <= set(rows.columns)
    assert set(rows.system) == set(throughput.STRATEGIES)
    bandwidth_sweep.main(["--out", str(tmp_path)])
    monkeypatch.setenv("AURORA_RESULTS", str(tmp_path))
    nb = nbformat.read(ROOT / "notebooks" / "analysis.ipynb", as_version=4)
    NotebookClient(nb, timeout=120, resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "throughput rows" in text and "dense / delta" in text
