"""The fidelity harness (experiments/fidelity.py): predictions from a profile and the case
alone, written and refused-until-committed before any run; scoring against repeated runs; and,
as root, one tiny case end to end on the emulated WAN (skips without it)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from pathlib import Path

import pandas as pd
import pytest

from experiments import fidelity
from tests.test_sim_hostprofile import PROFILE

ROOT = Path(__file__).resolve().parent.parent
TINY = fidelity.Case(
    name="tiny-bbr",
    regions=(fidelity.Region(name="ca", mbit=50.0, rtt_ms=40, loss=0.01, actors=2),),
    congestion="bbr",
    steps=4,
    model="qwen3-tiny-shapes",
)


@pytest.fixture
def profile_file(tmp_path):
    path = tmp_path / "host.json"
    path.write_text(json.dumps(PROFILE))
    return path


def test_predictions_come_from_the_profile_and_the_case_with_their_spread(profile_file):
    got = fidelity.predict([TINY], profile_file, seeds=3)
    p = got["cases"]["tiny-bbr"]
    assert got["seeds"] == 3 and len(got["profile_sha256"]) == 64 and got["git_sha"]
    for m in ("transfer_s", "step_time_s", "extract_s"):
        assert math.isfinite(p[m]) and p[m] > 0 and p[f"{m}_sd"] >= 0
    assert p["config"]["congestion"] == "bbr"
    # 20 MB (the fixture's 2% delta) over 48 Mbit/s x 0.99 is 3.4 s against 2 s of extraction.
    assert p["wire_over_extract"] == pytest.approx(20e6 * 8 / (48e6 * 0.99) / 2.0, rel=1e-6)
    assert not p["network_dominated"]


def test_a_run_is_refused_until_its_predictions_are_committed(tmp_path, monkeypatch):
    monkeypatch.setattr(fidelity, "PREDICTIONS", tmp_path)
    with pytest.raises(SystemExit, match="no predictions"):
        fidelity.run([TINY], repeats=1, root=tmp_path, set_name="none", uncommitted=False)
    path = tmp_path / "fidelity-x.json"
    path.write_text("{}")
    monkeypatch.setattr(fidelity, "ROOT", tmp_path)  # not a repository: nothing is committed
    with pytest.raises(SystemExit, match="not committed unchanged"):
        fidelity.run([TINY], repeats=1, root=tmp_path, set_name="x", uncommitted=False)
    assert not fidelity.committed(path)


def test_committed_means_in_head_and_unchanged():
    assert fidelity.committed(ROOT / "pyproject.toml")


def test_a_score_is_the_prediction_against_the_mean_with_the_runs_spread():
    pred = {
        "cases": {
            "a": {
                "transfer_s": 10.5,
                "step_time_s": 4.0,
                "extract_s": 1.0,
                "network_dominated": True,
                "wire_over_extract": 5.0,
            }
        }
    }
    rows = pd.DataFrame(
        {
            "set": ["s"] * 3,
            "case": ["a"] * 3,
            "transfer_s": [9.0, 10.0, 11.0],
            "step_time_s": [5.0, 5.0, 5.0],
            "extract_s": [1.0, 1.1, 0.9],
            "load_before": ["0.1"] * 3,
            "load_after": ["0.2"] * 3,
        }
    )
    got = fidelity.score(rows, pred, "s").set_index("metric")
    assert got.loc["transfer_s", "real_mean"] == 10.0
    assert got.loc["transfer_s", "real_sd"] == pytest.approx(1.0)
    assert got.loc["transfer_s", "error"] == pytest.approx(0.05)
    assert got.loc["transfer_s", "within_10pct"] and got.loc["transfer_s", "within_runs"]
    assert got.loc["step_time_s", "error"] == pytest.approx(-0.2)
    assert not got.loc["step_time_s", "within_10pct"]


def test_the_campaign_estimate_counts_start_up_and_steps():
    pred = {"cases": {TINY.name: {"step_time_s": 2.0}}}
    text = fidelity.estimate([TINY], pred, None, 5)
    each = fidelity.STARTUP_S + 4 * 2.0
    assert f"{each:6.0f} s a run x 5" in text and f"{5 * each / 3600:.2f} h" in text


def test_every_campaign_case_is_a_valid_deployment():
    for cases in fidelity.SETS.values():
        for case in cases:
            topo = fidelity.topology(case)
            assert topo.congestion == case.congestion
            assert len(topo.links) == len(case.regions)


def _emulation_or_skip():
    from experiments.sim_vs_real import emulation_available

    if not emulation_available():
        pytest.skip("needs root with ip and tc (the emulated WAN)")
    try:
        from emulation.capabilities import probe_capabilities

        probe_capabilities()
    except Exception as exc:  # EmulationUnavailable
        pytest.skip(f"cannot emulate a network here: {exc}")


def test_a_tiny_case_runs_end_to_end_on_the_emulated_wan(tmp_path, monkeypatch):
    _emulation_or_skip()
    spec = importlib.util.spec_from_file_location(
        "host_profile", ROOT / "benchmarks/host_profile.py"
    )
    assert spec and spec.loader
    host_profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_profile)
    measured = host_profile.compute("qwen3-tiny-shapes", (0.01, 0.03), 2)
    profile = dict(PROFILE, compute={"qwen3-tiny-shapes": measured})
    path = tmp_path / "host.json"
    path.write_text(json.dumps(profile))
    monkeypatch.setattr(fidelity, "PREDICTIONS", tmp_path)
    # The tiny model's 2% delta is a few KB: a 2 Mbit/s link carries it in tens of ms.
    case = dataclasses.replace(
        TINY,
        density=0.02,
        regions=(fidelity.Region(name="ca", mbit=2.0, rtt_ms=40, loss=0.01, actors=2),),
    )
    got = fidelity.predict([case], path, seeds=2)
    (tmp_path / "fidelity-tiny.json").write_text(json.dumps(got))
    rows = fidelity.run([case], repeats=1, root=tmp_path, set_name="tiny", uncommitted=True)
    (row,) = rows.to_dict("records")
    assert row["case"] == "tiny-bbr" and row["repeat"] == 0 and not row["predictions_committed"]
    assert row["prompts_lost"] == 0 and row["hash_mismatches"] == 0
    assert math.isfinite(row["transfer_s"]) and math.isfinite(row["step_time_s"])
    assert len(row["load_before"].split()) == 3
    assert json.loads(row["tcp"])["tcp_congestion_control"]
    score = fidelity.score(rows, got, "tiny")
    assert set(score["metric"]) == {"transfer_s", "step_time_s", "extract_s"}
