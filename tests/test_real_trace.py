"""A recorded real run's Ledger log, replayed through the policy core alone (``decide``, the
pacer and its batch accounting), gives the actions the run took and requests every batch when
the run did: the runtime makes no decision of its own (the sim/runtime parity check)."""

import json
import pathlib

from aurora.policy.core import LedgerCore
from aurora.policy.events import BatchRequested, event_from_record, to_record
from aurora.policy.leases import LeaseConfig
from aurora.policy.ledger import LedgerConfig
from aurora.policy.pacer import PacerConfig

GOLDEN = pathlib.Path(__file__).parent / "golden" / "real_run_trace.json"


def test_a_recorded_real_run_replays_through_the_core_to_the_actions_and_requests_it_made():
    data = json.loads(GOLDEN.read_text())
    cfg = data["config"]
    core = LedgerCore(
        LedgerConfig(
            trainer_region=cfg["trainer_region"],
            max_lag=cfg["max_lag"],
            relays=cfg["relays"],
            lease=LeaseConfig(initial_s=cfg["lease_initial_s"]),
        ),
        PacerConfig(prompt_prefix="b", **data["pacer"]),
    )
    rows = data["rows"]
    assert rows[0]["now"] >= data["job_at"]  # the pacer existed for every row
    kinds = set()
    differing = 0
    expected_request = None
    for row in rows:
        event = event_from_record(row["event"])
        now = row["now"]
        kinds.add(row["event"]["type"])
        if isinstance(event, BatchRequested):
            # Requested where the pacer, polled after the previous event, said so, or when a
            # timer it asked for fired (then polled at the request's own time).
            asked = expected_request or core.poll(now)
            assert asked == event, (now, asked, event)
        else:
            assert expected_request is None, (now, "the pacer requested a batch the run did not")
        actions = json.loads(json.dumps([to_record(a) for a in core.feed(event, now=now)]))
        differing += actions != row["actions"]
        got = core.poll(now)  # as the runtime polls after every event, at its time
        expected_request = got if isinstance(got, BatchRequested) else None
    assert differing == 0
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
    assert sorted(core.pacer.done) == [8] and core.pacer.next_batch == 9  # 1-7 trained in
    completed = [a for r in rows for a in r["actions"] if a["type"] == "BatchCompleted"]
    assert [a["batch"] for a in completed] == list(range(1, 9))
    core.state.book.check()
    assert core.state.book.pool_size == 0 and not core.state.book.leased
