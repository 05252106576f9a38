"""What a run records: the human-readable event trace, Gantt spans, and one row per step.

Recording costs time and memory at scale, so the trace and the spans are kept only when
``SimConfig.record_trace`` is set; step rows are always kept (one per step).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    from sim.model import Simulation


class Recorder:
    """The trace, the timeline and the step rows of one run."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.env = sim.env
        self.on = sim.cfg.record_trace
        self.trace: list[tuple[float, str, str]] = []
        self.timeline: list[dict[str, Any]] = []
        self.rows: list[dict[str, Any]] = []
        # Per-step accounting, reset with each row.
        self.expired = 0
        self.refused = 0
        self.excluded: dict[int, list[str]] = {}
        """Actors excluded from each batch (by batch number)."""
        self._carried_at_last_row: list[float] = []
        self._json_keys: dict[str, str] = {}
        """``'"<actor>": '`` per Actor id: ``json.dumps`` of the key (:meth:`_by_actor`)."""

    def _by_actor(self, values: dict[str, int], keys: list[str]) -> str:
        """``json.dumps(values, sort_keys=True)`` for a dict of int values whose sorted keys are
        ``keys``: the same string, with each key encoded once per run instead of once per step
        (two such dicts of 10^5 Actors per step took 0.3 s of a step's 6 s; the test
        ``test_rows_by_actor_are_json_dumps`` holds it to ``json.dumps``)."""
        enc = self._json_keys
        parts = []
        for k in keys:
            e = enc.get(k)
            if e is None:
                enc[k] = e = json.dumps(k) + ": "
            parts.append(e + int.__repr__(values[k]))
        return "{" + ", ".join(parts) + "}"

    def log(self, who: str, what: str) -> None:
        if self.on:
            self.trace.append((round(self.env.now, 6), who, what))

    def span(self, role: str, who: str, activity: str, version: int, start: float) -> None:
        if self.on:
            self.timeline.append(
                {
                    "role": role,
                    "who": who,
                    "activity": activity,
                    "version": version,
                    "start": start,
                    "end": self.env.now,
                }
            )

    def row(self, v: int) -> None:
        """Close step ``v``: tokens, time, shares, versions and bytes per link since the last."""
        sim = self.sim
        pacer = sim.driver.pacer
        now = self.env.now
        prev = self.rows[-1]["time_s"] if self.rows else 0.0
        results = pacer.results.get(v, [])
        tokens = len(results) * sim.tokens_per_lease
        step_time = now - prev
        sim.net.settle()
        resources = sim.transfers.resources
        if not self._carried_at_last_row:
            self._carried_at_last_row = [0.0] * len(resources)
        carried = [r.carried for r in resources]
        by_res = {
            r.name: carried[i] - self._carried_at_last_row[i] for i, r in enumerate(resources)
        }
        self._carried_at_last_row = carried
        target = pacer.target.get(v, 0)
        shares: dict[str, int] = {}
        versions: dict[str, int] = {}
        for a in results:
            shares[a.actor] = shares.get(a.actor, 0) + 1
            versions[a.actor] = a.version
        by_actor = sorted(shares)  # the keys of both dicts
        self.rows.append(
            {
                "step": v,
                "version": v,
                "time_s": now,
                "step_time_s": step_time,
                "tokens": tokens,
                "tokens_per_s": tokens / step_time if step_time > 0 else 0.0,
                "batch_version": target,
                "staleness": v - 1 - target,
                "shares": self._by_actor(shares, by_actor),
                "actor_versions": self._by_actor(versions, by_actor),
                "excluded": json.dumps(sorted(self.excluded.get(v, []))),
                "expired": self.expired,
                "refused": self.refused,
                "delta_bytes": round(sim.bytes_of(v)),  # the real run's steps.csv column
                "wan_bytes": sum(b for n, b in by_res.items() if n.startswith("wan:")),
                "trainer_bytes": by_res["trainer"],
                "link_bytes": json.dumps({n: round(b) for n, b in by_res.items()}, sort_keys=True),
            }
        )
        self.expired = 0
        self.refused = 0
        if sim.progress is not None:
            sim.progress(v)
