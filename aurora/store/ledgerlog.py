"""The Ledger's durable log: every event in SQLite before its actions are carried out.

The Job Ledger is an event-sourced state machine: its state is whatever
:func:`aurora.policy.ledger.decide` makes of the events so far. So the log stores *events*, not
state: each one is appended (and committed, with the actions decided for it and the payload it
admitted) before any action is carried out, and a restarted Ledger rebuilds its state by
replaying the log through the same :func:`decide` with each event's recorded time; there is no
second state machine to keep in step with the first. Only events that decided are ``policy``
rows; one the policy refused as impossible is kept as an ``invalid`` row (for the record; it
changed nothing and replay skips it). An admitted result's payload is written in the same
transaction as its event, so it is never lost. A checksum chain over the rows
(:func:`chain_step`) makes reading refuse an altered, removed or inserted row; it is not a
signature. The tables and the durability trade are described at :class:`LedgerLog`.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY,
    now REAL NOT NULL,
    kind TEXT NOT NULL CHECK (kind IN ('policy', 'driver', 'invalid')),
    body TEXT NOT NULL,
    chain BLOB NOT NULL
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
    event_seq INTEGER NOT NULL UNIQUE,
    PRIMARY KEY (actor, lease)
);
"""

GENESIS = hashlib.sha256(b"aurora ledger log v2").digest()
"""The chain value before the first row."""


class LogCorrupt(ValueError):
    """A row of the log that is not what was written (one line naming the row)."""


def chain_step(
    prev: bytes, seq: int, now: float, kind: str, body: str, payload: bytes | None
) -> bytes:
    """The chain value of one row (``events.chain``).

    Each row's SHA-256 covers the previous row's chain value, its own seq, time, kind and body,
    and the digest of the payload it admitted. Reading the log (:meth:`LedgerLog.events`)
    recomputes the chain and stops at the first row that does not match, with one line naming it
    (:class:`LogCorrupt`): an altered, removed or inserted row, or an altered payload, is refused
    at start rather than replayed into another state. It detects accidents and edits by whoever
    can write the file but has not recomputed the chain; it is not a signature (whoever can
    write ``ledger.db`` can rewrite the chain too).
    """
    h = hashlib.sha256(prev)
    h.update(struct.pack("<qd", seq, now))
    for part in (kind.encode(), body.encode()):
        h.update(struct.pack("<I", len(part)) + part)
    h.update(hashlib.sha256(payload).digest() if payload is not None else b"\0" * 32)
    return h.digest()


@dataclass(frozen=True, slots=True)
class LoggedEvent:
    seq: int
    now: float
    kind: str
    record: dict[str, Any]


class LedgerLog:
    """Append-only event log of one job's Ledger in the SQLite file ``path``.

    Tables (stdlib :mod:`sqlite3`, WAL journal):

    * ``events(seq, now, kind, body)``: ``kind`` is ``policy`` for an event of
      :mod:`aurora.policy.ledger` (``body`` is its :func:`~aurora.policy.events.to_record` JSON)
      or ``driver`` for what the runtime around ``decide`` needs to rebuild (the job's
      parameters, an Actor's activation report, an injected fault);
    * ``actions(seq, event_seq, body)``: the actions the Ledger carried out for each policy
      event, so a recorded run can be replayed through ``decide`` alone and compared (the parity
      test);
    * ``payloads(actor, lease, body, event_seq)``: the results themselves (token ids,
      log-probs), written in the same transaction as the ``ResultArrived`` event that carries
      them and only when it was admitted, with a plain INSERT: a refused result's payload is
      never kept, and nothing can overwrite an admitted one (a second result for a settled lease
      is refused by the policy and its payload dropped). So an admitted result is never lost and
      the Trainer can fetch a batch again after any restart.

    Durability: WAL with ``synchronous=NORMAL`` survives the death of the process (SIGKILL) at
    any point, which is the failure this log is for; it trades the last transactions on a power
    loss for one fsync per checkpoint instead of one per event (``docs/RUNTIME.md`` has the
    measured cost).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            if str(path) != ":memory:":  # ":memory:": no file at all (the load benchmark's
                self.path.parent.mkdir(parents=True, exist_ok=True)  # in-memory reference)
            self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.executescript(SCHEMA)
            columns = {row[1] for row in self.db.execute("PRAGMA table_info(events)")}
            last = self.db.execute("SELECT chain FROM events ORDER BY seq DESC LIMIT 1").fetchone()
        except (OSError, sqlite3.Error) as exc:
            raise ValueError(f"cannot open the Ledger log {self.path}: {exc}") from None
        if "chain" not in columns:
            raise ValueError(
                f"cannot open the Ledger log {self.path}: written by an older aurora (no checksum "
                "chain); start a new log"
            )
        self._chain: bytes = GENESIS if last is None else bytes(last[0])
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
        actions: list[dict[str, Any]] | None = None,
    ) -> int:
        """Append one event, the result payload it admitted and the actions decided for it, in
        one transaction; returns its sequence number. ``payload`` only for an admitted result:
        a plain INSERT, so an admitted payload is never replaced."""
        body = json.dumps(record, separators=(",", ":"), sort_keys=True)
        with self.db:
            self.db.execute("BEGIN")
            seq = self.db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM events").fetchone()[0]
            chain = chain_step(
                self._chain, seq, now, kind, body, None if payload is None else payload[2]
            )
            self.db.execute(
                "INSERT INTO events (seq, now, kind, body, chain) VALUES (?, ?, ?, ?, ?)",
                (seq, now, kind, body, chain),
            )
            if payload is not None:
                self.db.execute(
                    "INSERT INTO payloads (actor, lease, body, event_seq) VALUES (?, ?, ?, ?)",
                    (*payload, seq),
                )
                self.bytes_written += len(payload[2])
            if actions:
                bodies = [json.dumps(a, separators=(",", ":"), sort_keys=True) for a in actions]
                self.db.executemany(
                    "INSERT INTO actions (event_seq, body) VALUES (?, ?)",
                    [(seq, b) for b in bodies],
                )
                self.bytes_written += sum(map(len, bodies))
        self._chain = chain
        self.bytes_written += len(body)
        return int(seq)

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
        """Every row in order, each checked against the checksum chain first: an altered,
        removed or inserted row (or payload) raises :class:`LogCorrupt` naming it."""
        prev = GENESIS
        expect = 1
        for seq, now, kind, body, chain, payload in self.db.execute(
            "SELECT e.seq, e.now, e.kind, e.body, e.chain, p.body FROM events e"
            " LEFT JOIN payloads p ON p.event_seq = e.seq ORDER BY e.seq"
        ):
            if seq != expect:
                raise LogCorrupt(f"{self.path}: row {expect} is missing (next is {seq})")
            want = chain_step(
                prev, seq, now, kind, str(body), None if payload is None else bytes(payload)
            )
            if not isinstance(chain, bytes) or chain != want:
                raise LogCorrupt(
                    f"{self.path}: row {seq} ({kind}) does not match the checksum chain (altered "
                    "after it was written); refusing to replay it"
                )
            prev = chain
            expect += 1
            try:
                record = json.loads(body)
            except ValueError:
                raise LogCorrupt(f"{self.path}: row {seq} is not JSON") from None
            yield LoggedEvent(seq, now, kind, record)

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
