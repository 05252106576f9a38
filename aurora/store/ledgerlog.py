"""The Ledger's durable log: every event in SQLite before its actions are carried out.

Theory of operation
-------------------
The Job Ledger is an event-sourced state machine: its state is whatever
:func:`aurora.policy.ledger.decide` makes of the events so far. So the log stores *events*, not
state: each one is appended (and committed) before :func:`decide` sees it, and a restarted Ledger
rebuilds its state by replaying the log through the same :func:`decide` with each event's
recorded time; there is no second state machine to keep in step with the first.

Tables (stdlib :mod:`sqlite3`, WAL journal):

* ``events(seq, now, kind, body)``: ``kind`` is ``policy`` for an event of
  :mod:`aurora.policy.ledger` (``body`` is its :func:`~aurora.policy.events.to_record` JSON) or
  ``driver`` for what the runtime around ``decide`` needs to rebuild (the job's parameters, an
  Actor's activation report, an injected fault);
* ``actions(seq, event_seq, body)``: the actions the Ledger carried out for each policy event, so
  a recorded run can be replayed through ``decide`` alone and compared (the parity test);
* ``payloads(actor, lease, body)``: the results themselves (token ids, log-probs), written in the
  same transaction as the ``ResultArrived`` event that carries them, so an admitted result is
  never lost and the Trainer can fetch a batch again after any restart.

Durability: WAL with ``synchronous=NORMAL`` survives the death of the process (SIGKILL) at any
point, which is the failure this log is for; it trades the last transactions on a power loss for
one fsync per checkpoint instead of one per event (``docs/RUNTIME.md`` has the measured cost).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY,
    now REAL NOT NULL,
    kind TEXT NOT NULL CHECK (kind IN ('policy', 'driver')),
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS actions (
    seq INTEGER PRIMARY KEY,
    event_seq INTEGER NOT NULL,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS payloads (
    actor TEXT NOT NULL,
    lease TEXT NOT NULL,
    body BLOB NOT NULL,
    PRIMARY KEY (actor, lease)
);
"""


@dataclass(frozen=True, slots=True)
class LoggedEvent:
    seq: int
    now: float
    kind: str
    record: dict[str, Any]


class LedgerLog:
    """Append-only event log of one job's Ledger in the SQLite file ``path``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            if str(path) != ":memory:":  # ":memory:": no file at all (the load benchmark's
                self.path.parent.mkdir(parents=True, exist_ok=True)  # in-memory reference)
            self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.executescript(SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise ValueError(f"cannot open the Ledger log {self.path}: {exc}") from None
        self.bytes_written = 0
        """Bytes of event, action and payload bodies appended by this process (the numerator
        of the write amplification the load benchmark reports)."""

    def append(
        self,
        now: float,
        kind: str,
        record: dict[str, Any],
        *,
        payload: tuple[str, str, bytes] | None = None,
    ) -> int:
        """Append one event (and the result payload it carries) in one transaction; returns
        its sequence number."""
        body = json.dumps(record, separators=(",", ":"), sort_keys=True)
        with self.db:
            self.db.execute("BEGIN")
            cur = self.db.execute(
                "INSERT INTO events (now, kind, body) VALUES (?, ?, ?)", (now, kind, body)
            )
            if payload is not None:
                self.db.execute(
                    "INSERT OR REPLACE INTO payloads (actor, lease, body) VALUES (?, ?, ?)",
                    payload,
                )
                self.bytes_written += len(payload[2])
        self.bytes_written += len(body)
        assert cur.lastrowid is not None
        return cur.lastrowid

    def record_actions(self, event_seq: int, actions: list[dict[str, Any]]) -> None:
        """Record the actions carried out for event ``event_seq`` (for the parity check)."""
        if not actions:
            return
        bodies = [json.dumps(a, separators=(",", ":"), sort_keys=True) for a in actions]
        with self.db:
            self.db.execute("BEGIN")
            self.db.executemany(
                "INSERT INTO actions (event_seq, body) VALUES (?, ?)",
                [(event_seq, b) for b in bodies],
            )
        self.bytes_written += sum(map(len, bodies))

    def events(self) -> Iterator[LoggedEvent]:
        for seq, now, kind, body in self.db.execute(
            "SELECT seq, now, kind, body FROM events ORDER BY seq"
        ):
            yield LoggedEvent(seq, now, kind, json.loads(body))

    def actions(self) -> dict[int, list[dict[str, Any]]]:
        """Recorded actions by the sequence number of the event that caused them."""
        out: dict[int, list[dict[str, Any]]] = {}
        for event_seq, body in self.db.execute("SELECT event_seq, body FROM actions ORDER BY seq"):
            out.setdefault(event_seq, []).append(json.loads(body))
        return out

    def published(self, version: int) -> dict[str, Any] | None:
        """The last ``Published`` driver record of ``version`` (what the Trainer announced), or
        None. A scan of the events table: for the rare look-up of a version the Ledger no longer
        keeps in memory."""
        row = self.db.execute(
            "SELECT body FROM events WHERE kind = 'driver'"
            " AND json_extract(body, '$.type') = 'Published'"
            " AND json_extract(body, '$.version') = ? ORDER BY seq DESC LIMIT 1",
            (version,),
        ).fetchone()
        return None if row is None else dict(json.loads(row[0]))

    def payload(self, actor: str, lease: str) -> bytes | None:
        row = self.db.execute(
            "SELECT body FROM payloads WHERE actor = ? AND lease = ?", (actor, lease)
        ).fetchone()
        return None if row is None else bytes(row[0])

    def close(self) -> None:
        self.db.close()
