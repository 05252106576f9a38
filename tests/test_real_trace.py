"""A recorded real run's Ledger log, replayed through ``decide`` alone, gives the actions the run
took: the runtime makes no decision of its own (the sim/runtime parity check)."""

import json
import pathlib

from aurora.policy.leases import LeaseConfig
from aurora.policy.ledger import LedgerConfig, decide, event_from_record, initial_state, to_record

GOLDEN = pathlib.Path(__file__).parent / "golden" / "real_run_trace.json"


def test_a_recorded_real_run_replays_through_decide_to_the_actions_it_took():
    data = json.loads(GOLDEN.read_text())
    cfg = data["config"]
    state = initial_state(
        LedgerConfig(
            trainer_region=cfg["trainer_region"],
            max_lag=cfg["max_lag"],
            relays=cfg["relays"],
            lease=LeaseConfig(initial_s=cfg["lease_initial_s"]),
        )
    )
    kinds = set()
    for row in data["rows"]:
        event = event_from_record(row["event"])
        kinds.add(row["event"]["type"])
        _, actions = decide(state, event, now=row["now"])
        assert json.loads(json.dumps([to_record(a) for a in actions])) == row["actions"], row
    # The run exercised joins, a loss, catch-ups, staging, activation, results and expiry.
    assert {
        "ActorJoined",
        "ActorLost",
        "CaughtUp",
        "DeltaStaged",
        "VersionActivated",
        "ResultArrived",
        "Tick",
        "BatchRequested",
        "RelayJoined",
    } <= kinds
    state.book.check()
    assert state.book.pool_size == 0 and not state.book.leased
