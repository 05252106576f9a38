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


def test_a_key_written_twice_is_refused_naming_the_key_the_line_and_the_file(tmp_path):
    twice = tmp_path / "twice.yaml"
    text = Path(GEO).read_text()
    twice.write_text(text + "\nactors:\n  - {region: ca, gpu: A100, count: 1}\n")
    first = next(i for i, line in enumerate(text.splitlines(), 1) if line.startswith("actors:"))
    with pytest.raises(
        SystemExit,
        match=rf"aurora sim: .*twice.yaml: line \d+: duplicate key 'actors' "
        rf"\(first at line {first}\)",
    ):
        cli.main(["--topology", str(twice), "--out", str(tmp_path)])
    flow = tmp_path / "flow.yaml"
    flow.write_text("name: x\ntrainer: {region: us, model: qwen3-8b, gpus: 4, gpus: 8}\n")
    with pytest.raises(SystemExit, match=r"flow.yaml: line 2: duplicate key 'gpus'"):
        cli.main(["--topology", str(flow), "--out", str(tmp_path)])


def test_a_trace_file_with_a_key_written_twice_is_refused_naming_it(tmp_path):
    from aurora.traces import PAPER, load_traces

    bad = tmp_path / "traces.yaml"
    bad.write_text(PAPER.read_text() + "\nconstants: {}\n")
    with pytest.raises(ValueError, match=r"traces.yaml: line \d+: duplicate key 'constants'"):
        load_traces(bad)


def test_rollouts_per_lease_sets_the_lease_granularity_and_keeps_the_tokens(tmp_path):
    def leases_per_step(folder: Path) -> set[int]:
        rows = pd.read_csv(folder / "steps.csv")
        return {sum(json.loads(shares).values()) for shares in rows["shares"]}

    for n, leases in ((16, 256), (512, 8)):
        out = tmp_path / str(n)
        assert sim("--strategy", "aurora", "--rollouts-per-lease", str(n), "--out", str(out)) == 0
        folder = out / "us-canada-aurora-s0"
        # 8 Actors x 512 rollouts a step: 256 leases of 16 rollouts, or 8 of 512.
        assert leases_per_step(folder) == {leases}
        tokens = pd.read_csv(folder / "steps.csv")["tokens"]
        assert set(tokens) == {8 * 512 * 308}
    with pytest.raises(SystemExit, match=r"rollouts_per_lease \(500\) must divide the batch"):
        sim("--rollouts-per-lease", "500", "--out", str(tmp_path))


def test_the_default_granularity_is_per_prompt_leases_as_before(tmp_path):
    """Without the option, the runs are the same bytes as with 16 (SimConfig's default)."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert sim("--strategy", "aurora", "--out", str(a)) == 0
    assert sim("--strategy", "aurora", "--rollouts-per-lease", "16", "--out", str(b)) == 0
    for name in ("steps.csv", "events.csv", "summary.json"):
        assert (a / "us-canada-aurora-s0" / name).read_bytes() == (
            b / "us-canada-aurora-s0" / name
        ).read_bytes()


def test_a_tie_between_strategies_says_why_from_the_runs_own_rows(tmp_path, capsys):
    assert sim("--strategy", "aurora,prime-full,ideal-singledc", "--out", str(tmp_path)) == 0
    out = capsys.readouterr().out
    (note,) = [line for line in out.splitlines() if line.startswith("aurora = ideal-singledc")]
    assert "Trainer-bound" in note and "transfer is hidden" in note
    assert "prime-full =" not in out and "= prime-full" not in out


class _Run:
    def __init__(self, step_times: list[float], busy: list[float]) -> None:
        self.rows = [{"step": i + 1, "step_time_s": t} for i, t in enumerate(step_times)]
        self.trainer_busy = {i + 1: b for i, b in enumerate(busy)}


def test_a_tie_that_is_not_trainer_bound_says_so():
    runs = {
        "a": _Run([50.0] * 6, [20.0] * 6),
        "b": _Run([50.1] * 6, [20.0] * 6),
        "c": _Run([90.0] * 6, [90.0] * 6),
    }
    summaries = [(n, {"step_time_s": r.rows[0]["step_time_s"]}, r) for n, r in runs.items()]
    (note,) = cli.tie_notes(summaries)
    assert note.startswith("a = b:") and "not Trainer-bound" in note and "40%" in note
    runs["b"] = _Run([50.1] * 6, [50.1] * 6)
    runs["a"] = _Run([50.0] * 6, [50.0] * 6)
    summaries = [(n, {"step_time_s": r.rows[0]["step_time_s"]}, r) for n, r in runs.items()]
    (note,) = cli.tie_notes(summaries)
    assert "Trainer-bound (training takes 50.0 s" in note


def test_progress_bars_go_to_a_terminal_only(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    argv = ["--topology", GEO, "--steps", "3", "--out", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-m", "sim.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0
    assert done.stderr == ""  # no bar, no carriage returns, in a pipe
    assert "\r" not in done.stdout and "step/s" not in done.stdout
