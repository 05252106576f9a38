import json
import subprocess
import sys


def test_aurora_replay_prints_every_decision_of_the_golden_trace():
    out = subprocess.run(
        [sys.executable, "-m", "aurora.cli", "replay", "tests/golden/ledger_trace.json"],
        capture_output=True, text=True, check=True,
    ).stdout
    assert "-> Refused" in out and "WRONG_HASH" in out and "-> FallBack" in out
    assert out.rstrip().endswith("settled=1, live leases=11")


def test_aurora_replay_names_the_file_and_row_of_a_bad_event(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"now": 0, "event": {"type": "Nope"}}]))
    run = subprocess.run(
        [sys.executable, "-m", "aurora.cli", "replay", str(bad)], capture_output=True, text=True
    )
    assert run.returncode != 0
    assert f"{bad}: row 0: unknown event type 'Nope'" in run.stderr
