"""Entry points of the congestion-control experiments: Fig. 8a re-scored per algorithm
(experiments/congestion.py), the TCP grid's figures and table (experiments/tcp_loss.py) and the
fidelity harness's estimate (experiments/fidelity.py)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from experiments import congestion, fidelity, tcp_loss, throughput
from tests.test_sim_hostprofile import PROFILE


def test_the_paper_single_stream_needs_a_loss_based_control():
    assert congestion.single_stream("reno") / 1e6 == pytest.approx(354.7, abs=0.1)
    assert congestion.single_stream("cubic") / 1e6 == pytest.approx(838.9, abs=0.1)  # window
    assert congestion.single_stream("bbr") == congestion.single_stream("cubic")
    paper = congestion.PAPER_SINGLE_STREAM_BPS
    assert congestion.loss_for("reno", paper) == pytest.approx(1.07e-6, rel=0.02)
    assert congestion.loss_for("cubic", paper) == pytest.approx(3.4e-6, rel=0.03)
    assert congestion.loss_for("bbr", paper) is None


def test_congestion_rescore_runs_and_labels_every_claim(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(throughput, "MODELS", {"qwen3-4b": (2, 4)})
    original = throughput.points
    monkeypatch.setattr(throughput, "points", lambda full=False, steps=None: original(full, 12))
    rows = congestion.main(["--out", str(tmp_path), "--workers", "1"])
    assert set(rows["congestion"]) == {"reno", "cubic", "bbr"}
    out = capsys.readouterr().out
    for cc in ("reno", "cubic", "bbr"):
        assert f"[{cc}] AuroraRL / PrimeRL-Full (x), qwen3-4b gsm8k" in out
    assert "343 Mbit/s needs loss" in out
    assert (tmp_path / "congestion" / "congestion.png").exists()


def _rows() -> pd.DataFrame:
    out = []
    for cc in ("reno", "bbr"):
        for loss in (0.001, 0.01):
            for rep in (0, 1):
                model = tcp_loss.model_mbit(cc, rtt_ms=40, loss=loss, streams=1, eff=0.956)
                out.append(
                    {
                        "cc": cc,
                        "rtt_ms": 40.0,
                        "loss": loss,
                        "streams": 1,
                        "repeat": rep,
                        "seconds": 20.0,
                        "buffer_bytes": tcp_loss.TRANSPORT_BUFFER,
                        "measured_mbit": model * (1.05 if rep else 0.95),
                        "model_mbit": model,
                        "wire_efficiency": 0.956,
                        "window_bytes": 4 << 20,
                        "load_before": "0.1 0.1 0.1",
                        "load_after": "0.2 0.2 0.2",
                    }
                )
    return pd.DataFrame(out)


def test_the_tcp_grid_redraws_its_figures_and_table_from_rows(tmp_path, capsys):
    _rows().to_csv(tmp_path / "rows.csv", index=False)
    assert tcp_loss.main(["--figures", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "tcp_loss_reno.png").exists() and (tmp_path / "tcp_loss_bbr.png").exists()
    table = tcp_loss.points_table(_rows())
    assert list(table["runs"]) == [2, 2, 2, 2]
    assert table["error"].abs().max() == pytest.approx(0.0, abs=1e-12)
    assert "reno" in capsys.readouterr().out


def test_the_tcp_grid_lasts_at_least_200_rtts():
    assert tcp_loss.seconds_for(150, 20) == pytest.approx(30.0)
    assert tcp_loss.seconds_for(40, 20) == 20


def test_the_fidelity_estimate_runs_from_a_profile(tmp_path, capsys):
    path = tmp_path / "host.json"
    path.write_text(json.dumps(PROFILE))
    case = fidelity.Case(
        name="t",
        regions=(fidelity.Region(name="ca", mbit=50, rtt_ms=40, loss=0.001),),
        congestion="cubic",
        model="qwen3-tiny-shapes",
    )
    pred = fidelity.predict([case], path, seeds=1)
    text = fidelity.estimate([case], pred, None, 5)
    assert "1 cases x 5 repeats" in text
