"""The scenario behind ``ledger_trace.json``: three regions, a standalone relay, a join without
weights, two steps, a late and a forged result, a preemption with notice, a loss without, a
relay failure and a rejoin.

Regenerate (only when a decision is meant to change, and review the diff line by line):
    python -m tests.golden.ledger_scenario > tests/golden/ledger_trace.json
"""

import json

from aurora.policy.events import (
    ActorJoined,
    ActorLost,
    BatchRequested,
    CaughtUp,
    DeltaPublished,
    DeltaStaged,
    PreemptionNotice,
    RelayJoined,
    RelayLost,
    ResultArrived,
    ThroughputObserved,
    Tick,
    VersionActivated,
    to_record,
)
from aurora.policy.ledger import LedgerConfig, decide, initial_state

CONFIG = LedgerConfig(trainer_region="us")

EVENTS = [
    (0.0, DeltaPublished(version=0, weights_hash="h0", delta_bytes=None, snapshot_bytes=16_000)),
    (0.0, RelayJoined(relay="r-ca", region="ca")),
    (0.0, ActorJoined(actor="ca-1", region="ca", active=0)),
    (0.0, ActorJoined(actor="ca-2", region="ca", active=0)),
    (0.0, ActorJoined(actor="jp-1", region="jp", active=0)),
    (0.0, ActorJoined(actor="us-1", region="us", active=0)),
    (1.0, ThroughputObserved(actor="ca-1", tokens=20_000, seconds=10.0)),
    (1.0, ThroughputObserved(actor="ca-2", tokens=10_000, seconds=10.0)),
    (1.0, ThroughputObserved(actor="jp-1", tokens=10_000, seconds=10.0)),
    (1.0, ThroughputObserved(actor="us-1", tokens=20_000, seconds=10.0)),
    (10.0, DeltaPublished(version=1, weights_hash="h1", delta_bytes=202)),
    (12.0, DeltaStaged(actor="us-1", version=1)),
    (13.0, DeltaStaged(actor="ca-1", version=1)),
    (13.0, DeltaStaged(actor="ca-2", version=1)),
    (20.0, BatchRequested(version=1, prompts=tuple(f"s1-{i}" for i in range(12)))),
    (21.0, VersionActivated(actor="us-1", version=1)),
    (21.0, VersionActivated(actor="ca-1", version=1)),
    (21.5, VersionActivated(actor="ca-2", version=1)),
    (22.0, DeltaStaged(actor="jp-1", version=1)),
    (30.0, ActorJoined(actor="eu-1", region="eu", active=None)),
    (40.0, ResultArrived(actor="us-1", lease="L8", version=1, weights_hash="h1")),
    (40.0, ResultArrived(actor="us-1", lease="L9", version=1, weights_hash="forged")),
    (41.0, ResultArrived(actor="ca-2", lease="L6", version=0, weights_hash="h0")),
    (41.0, ResultArrived(actor="jp-1", lease="L7", version=1, weights_hash="h1")),
    (42.0, ResultArrived(actor="us-1", lease="L8", version=1, weights_hash="h1")),
    (45.0, PreemptionNotice(actor="ca-1", deadline=75.0)),
    (50.0, ActorLost(actor="us-1")),
    (55.0, CaughtUp(actor="eu-1", version=1)),
    (60.0, RelayLost(relay="r-ca")),
    (70.0, DeltaPublished(version=2, weights_hash="h2", delta_bytes=210, snapshot_bytes=16_000)),
    (75.0, ResultArrived(actor="ca-2", lease="L13", version=1, weights_hash="h1")),
    (700.0, Tick()),
    (701.0, ResultArrived(actor="ca-2", lease="L7", version=1, weights_hash="h1")),
    (702.0, ResultArrived(actor="ca-2", lease="L99", version=1, weights_hash="h1")),
    (800.0, ActorJoined(actor="us-1", region="us", active=0)),
]


def trace() -> list[dict]:
    state = initial_state(CONFIG)
    rows = []
    for now, event in EVENTS:
        _, actions = decide(state, event, now=now)
        rows.append(
            {"now": now, "event": to_record(event), "actions": [to_record(a) for a in actions]}
        )
    return rows


if __name__ == "__main__":
    print(json.dumps(trace(), indent=1))
