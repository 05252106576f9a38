"""A committed event trace replayed through decide() gives exactly the committed actions."""

import json
import pathlib

from aurora.policy.events import event_from_record, to_record
from aurora.policy.ledger import LedgerConfig, decide, initial_state
from tests.golden.ledger_scenario import CONFIG, EVENTS

GOLDEN = pathlib.Path(__file__).parent / "golden" / "ledger_trace.json"


def test_golden_ledger_trace_replays_to_the_committed_actions():
    rows = json.loads(GOLDEN.read_text())
    state = initial_state(LedgerConfig(trainer_region="us"))
    got = []
    for row in rows:
        event = event_from_record(row["event"])
        _, actions = decide(state, event, now=row["now"])
        got.append([to_record(a) for a in actions])
    want = [row["actions"] for row in rows]
    assert json.loads(json.dumps(got)) == want


def test_golden_trace_file_matches_the_scenario_source():
    rows = json.loads(GOLDEN.read_text())
    assert CONFIG.trainer_region == "us"
    assert [(r["now"], r["event"]) for r in rows] == [
        (now, json.loads(json.dumps(to_record(e)))) for now, e in EVENTS
    ]
    state = initial_state(CONFIG)
    state.book.check()
    for row in rows:
        decide(state, event_from_record(row["event"]), now=row["now"])
        state.book.check()
