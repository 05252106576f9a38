"""``aurora sim`` (sim/cli.py), tried as a new user would (issue 17, defect 8)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from sim import cli
from sim.model import Simulation

ROOT = Path(__file__).resolve().parent.parent
GEO = str(ROOT / "examples" / "geo.yaml")


def sim(*args: str) -> int:
    return cli.main(["--topology", GEO, "--steps", "3", *args])


def test_the_command_prints_a_table_and_writes_rows_and_a_figure(tmp_path, capsys):
    assert sim("--strategy", "aurora,prime-full", "--out", str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "aurora " in out and "prime-full" in out and "figure:" in out
    assert (tmp_path / "us-canada.png").stat().st_size > 10_000
    rows = pd.read_csv(tmp_path / "us-canada-aurora-s0" / "steps.csv")
    assert list(rows["step"]) == [1, 2, 3]
    assert {"git_sha", "seed", "strategy", "tokens_per_s", "wan_bytes"} <= set(rows.columns)


def test_a_faulted_run_has_its_own_folder_and_figure_and_records_its_faults(tmp_path):
    assert sim("--strategy", "aurora", "--out", str(tmp_path)) == 0
    plain = (tmp_path / "us-canada-aurora-s0" / "steps.csv").read_bytes()
    fault = "preempt:ca-a100-1@step=2"
    assert sim("--strategy", "aurora", "--out", str(tmp_path), "--fault", fault) == 0
    assert (tmp_path / "us-canada-aurora-s0" / "steps.csv").read_bytes() == plain
    faulted = [p for p in tmp_path.iterdir() if p.name.startswith("us-canada-aurora-s0-faults-")]
    assert len(faulted) == 1
    figures = {p.name for p in tmp_path.glob("*.png")}
    assert figures == {"us-canada.png", f"us-canada-{faulted[0].name.split('s0-')[1]}.png"}
    rows = pd.read_csv(faulted[0] / "steps.csv")
    assert set(rows["faults"]) == {fault}
    summary = json.loads((faulted[0] / "summary.json").read_text())
    assert summary["faults"] == fault and summary["spot_hazard_per_hour"] == 0.0


def test_an_unwritable_out_fails_at_once_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(Simulation, "run", lambda self: pytest.fail("simulated first"))
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as err:
        sim("--out", str(blocker / "sub"))
    message = str(err.value)
    assert message.startswith(f"aurora sim: --out {blocker / 'sub'}: cannot write there")
    assert "\n" not in message


def test_a_stalled_run_leaves_its_partial_output_and_fails(tmp_path, capsys):
    rc = cli.main(
        [
            "--topology",
            GEO,
            "--steps",
            "6",
            "--strategy",
            "aurora",
            "--out",
            str(tmp_path),
            "--fault",
            "region_loss:ca@step=3",
        ]
    )
    assert rc == 1
    err = capsys.readouterr().err
    assert "aurora sim: aurora: no step completed" in err and "partial output in" in err
    folder = next(tmp_path.glob("us-canada-aurora-s0-faults-*"))
    assert list(pd.read_csv(folder / "steps.csv")["step"]) == [1, 2]
    summary = json.loads((folder / "summary.json").read_text())
    assert "live Actors none" in summary["stalled"] and summary["steps_requested"] == 6


def test_a_spot_hazard_needs_spot_actors_and_returning_ones_finish(tmp_path):
    with pytest.raises(SystemExit, match="aurora sim: spot_hazard_per_hour: 1.5 .* no spot"):
        sim("--spot-hazard", "1.5", "--out", str(tmp_path))
    spot = tmp_path / "spot.yaml"
    spot.write_text(Path(GEO).read_text().replace("spot: false", "spot: true"))
    rc = cli.main(
        [
            "--topology",
            str(spot),
            "--steps",
            "20",
            "--strategy",
            "aurora",
            "--out",
            str(tmp_path),
            "--spot-hazard",
            "1.5",
            "--spot-return",
            "600",
        ]
    )
    assert rc == 0
    folder = next(tmp_path.glob("us-canada-aurora-s0-faults-*"))
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["spot_return_s"] == 600.0


def test_bad_input_is_one_line_naming_it(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\n")
    with pytest.raises(SystemExit, match=r"aurora sim: .*bad.yaml: trainer: required field"):
        cli.main(["--topology", str(bad)])
    for spec, why in (
        ("preempt", "expected KIND:TARGET@step=N"),
        ("region_loss:mars@step=2", "unknown region 'mars'"),
        ("preempt:ca-a100-1@step=31", r"after the last step of the run \(30\)"),
        ("preempt:ca-a100-1@t=-5", "t must be >= 0 seconds"),
    ):
        with pytest.raises(SystemExit, match=why):
            cli.main(["--topology", GEO, "--fault", spec, "--out", str(tmp_path)])


def test_the_help_names_every_fault_kind():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    text = subprocess.run(
        [sys.executable, "-m", "sim.cli", "--help"], capture_output=True, text=True, env=env
    ).stdout
    for kind in (
        "preempt",
        "preempt_notice",
        "leave",
        "join",
        "region_loss",
        "relay_fail",
        "trainer_crash",
        "link_cut",
    ):
        assert kind in text
    assert "--spot-return" in text
