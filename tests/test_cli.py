import json
import subprocess
import sys


def test_aurora_replay_prints_every_decision_of_the_golden_trace():
    out = subprocess.run(
        [sys.executable, "-m", "aurora.cli", "replay", "tests/golden/ledger_trace.json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "-> Refused" in out and "WRONG_HASH" in out and "-> FallBack" in out
    assert out.rstrip().endswith("settled=2, live leases=10")


def test_aurora_replay_names_the_file_and_row_of_a_bad_event(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"now": 0, "event": {"type": "Nope"}}]))
    run = subprocess.run(
        [sys.executable, "-m", "aurora.cli", "replay", str(bad)], capture_output=True, text=True
    )
    assert run.returncode != 0
    assert f"{bad}: row 0: unknown event type 'Nope'" in run.stderr


def test_aurora_delta_bench_and_inspect_run_on_a_tiny_budget(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "aurora.cli",
            "delta",
            "bench",
            "--params",
            "2e5",
            "--density",
            "0.02",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "aurora-base" in out and "leb128" in out
    rows = (tmp_path / "codecs.csv").read_text().splitlines()
    assert rows[0].startswith("codec,params,density") and len(rows) == 7
    shown = subprocess.run(
        [sys.executable, "-m", "aurora.cli", "delta", "inspect", str(tmp_path / "sample_v1.delta")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "version    v1  (base v0)" in shown and "qkv_proj" in shown and "verified" in shown


def test_aurora_delta_inspect_names_the_defect_of_a_corrupt_file(tmp_path):
    bad = tmp_path / "bad.delta"
    bad.write_bytes(b"AURDELTA" + b"\x00" * 40)
    run = subprocess.run(
        [sys.executable, "-m", "aurora.cli", "delta", "inspect", str(bad)],
        capture_output=True,
        text=True,
    )
    assert run.returncode != 0 and "UnsupportedFormatError" in run.stderr
