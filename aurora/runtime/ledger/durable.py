"""The Ledger's durable log: what it records beyond policy events, and the replay that rebuilds it.

Theory of operation
-------------------
The SQLite log (:class:`~aurora.store.ledgerlog.LedgerLog`) holds two kinds of rows. Policy rows
are the events :meth:`~aurora.runtime.ledger.driver.LedgerDriver.feed` decided, with their time;
driver rows (:meth:`DurableLedger.note`) are what the runtime around ``decide`` must rebuild: the
job the Trainer registered, each version it published (h(v), content digest, the signed
announcement), Actors' activations, revocations, the end of the run. Restart:
:meth:`DurableLedger.replay` feeds the log back through the core with the recorded times, which
rebuilds the state exactly (the lease book, versions, estimates, the pacer's counters), and sets
a timer for every lease still live. Memory stays bounded: only the newest versions' records are
kept; an older one is read back from the log when an activation or a catch-up names it.
"""

from __future__ import annotations

import logging
from typing import Any

from aurora.policy.events import event_from_record
from aurora.runtime.ledger.config import Job, job_pacing
from aurora.runtime.ledger.driver import LedgerDriver

log = logging.getLogger("aurora.runtime.ledger")

ANNOUNCEMENTS_KEPT = 16
"""Newest signed announcements the Ledger keeps to hand to a (re)joining peer."""

PUBLISHED_KEPT = 64
"""Newest versions whose announced record (h(v), content digest) the Ledger keeps in memory;
an older one is read back from the log when an activation or a catch-up names it."""


class DurableLedger(LedgerDriver):
    """The log's driver records and their replay, over :class:`LedgerDriver` (module
    docstring); the attributes below are set by the Ledger's ``__init__`` too."""

    published: dict[int, dict[str, Any]]
    revoked: set[str]
    replayed: int

    def replay(self) -> int:
        """Rebuild the state from the log (a restarted Ledger); returns the events replayed."""
        n = 0
        for row in self.log.events():  # LogCorrupt (one line) at the first altered row
            if row.kind == "driver":
                self._apply_driver(row.record)
            elif row.kind == "policy":
                try:
                    event = event_from_record(row.record)
                    actions = self.core.feed(event, now=row.now)
                except (ValueError, TypeError, ArithmeticError) as exc:
                    # Only events that decided were logged as policy rows: this log is not
                    # what this Ledger wrote (or another policy reads it). Stop, never guess.
                    raise ValueError(
                        f"{self.config.log_path}: row {row.seq}, event "
                        f"{str(row.record.get('type'))[:40]}, does not decide on replay: {exc}"
                    ) from None
                self._after(event, actions, replaying=True)
                self.metrics.after(event, actions, row.now)
            n += 1
        self.replayed = n
        if n:
            log.info("ledger: replayed %d events from %s", n, self.config.log_path)
            self._schedule_next_expiry()
        return n

    def note(self, record: dict[str, Any]) -> None:
        """Log a driver record (something the runtime around ``decide`` must rebuild)."""
        self.log.append(self.clock(), "driver", record)
        self._apply_driver(record)

    def _apply_driver(self, rec: dict[str, Any]) -> None:
        kind = rec.get("type")
        if kind == "Job" and self.job is None:
            self.job = Job.from_record(rec)
            self.core.start_pacing(
                job_pacing(self.job, staging_grace_s=self.config.staging_grace_s)
            )
        elif kind == "Published":
            # Only what later checks read: a long run keeps one small record per version (the
            # full record, stats included, is in the log). Batch v's results were trained into
            # v, and the Trainer checkpoints v before announcing it, so no one asks for them
            # again: their index goes (the payloads stay in the log).
            v = int(rec["version"])
            self.published[v] = {
                "weights_hash": rec.get("weights_hash"),
                "digest": rec.get("digest"),
                "announcement": rec.get("announcement"),
            }
            old = self.published.get(v - ANNOUNCEMENTS_KEPT)
            if old is not None:
                old["announcement"] = None
            # Older records leave memory (~300 B each, every step of the job): the log has them
            # all, and :meth:`_announced` reads one back when an old version is named.
            self.published.pop(v - PUBLISHED_KEPT, None)
        elif kind == "Activation":
            self._check_activation(rec)
        elif kind == "Revoked":
            # Verified before it was logged (:meth:`_on_revocations`).
            self.revoked.update(str(i) for i in rec["ids"])
        elif kind == "Finished":
            self.finished = True
        self.metrics.driver(rec)

    def _announced(self, v: int) -> dict[str, Any] | None:
        """What the Trainer announced for version ``v`` (h(v), content digest): from memory for
        the newest :data:`PUBLISHED_KEPT` versions, else from the log."""
        rec = self.published.get(v)
        if rec is None and self.state.latest is not None and v <= self.state.latest:
            rec = self.log.published(v)
        return rec

    def _check_activation(self, rec: dict[str, Any]) -> None:
        self.counters.activations += 1
        v = int(rec["version"])
        announced = self._announced(v)
        if announced is None:
            return
        if rec.get("weights_hash") != announced.get("weights_hash"):
            self.counters.hash_mismatches += 1
        if rec.get("digest") and announced.get("digest") and rec["digest"] != announced["digest"]:
            self.counters.digest_mismatches += 1
