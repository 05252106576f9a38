"""What a run measured, per Actor, per version and per join: what its trace is derived from.

Theory of operation
-------------------
Generation rates come from the Actors' generate spans past the warm-up (generation on v0
carries the engine's one-time costs), pooled and per Actor with their spread; the Trainer's
train, extract and publish seconds and each version's sizes from the Ledger's ``Published``
records; apply and snapshot-load rates from the apply and catch-up spans; the Checkpoint
Store's read rate from the Actors' first catch-ups (the Ledger's ``CatchUp`` to ``CaughtUp``,
less a control round trip and the load span); each result message's bytes as the Actor frames
it; and, per joining Actor, when the fault struck and when it joined and caught up.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from aurora.faults import parse_fault
from sim.runtrace.run import RunRecord


def mean(xs: Sequence[float]) -> float:
    """The mean of ``xs`` (NaN when empty)."""
    return statistics.fmean(xs) if xs else math.nan


def cv(xs: Sequence[float]) -> float:
    """Coefficient of variation of ``xs`` (0 for fewer than two or a mean of 0)."""
    return statistics.pstdev(xs) / statistics.fmean(xs) if len(xs) > 1 and mean(xs) > 0 else 0.0


def stats(xs: Sequence[float]) -> dict[str, float]:
    """n, mean, std, min, max of ``xs`` (for the provenance record)."""
    if not xs:
        return {"n": 0}
    return {
        "n": len(xs),
        "mean": statistics.fmean(xs),
        "std": statistics.pstdev(xs),
        "min": min(xs),
        "max": max(xs),
    }


def measurements(rec: RunRecord) -> dict[str, Any]:
    """Everything the trace is derived from, per Actor, per version and per join."""
    spec = rec.spec
    group = spec.group_size
    gen = [s for s in rec.spans if s.get("activity") == "generate" and s["end"] > s["start"]]
    min_v = 1 if any(int(s["version"]) >= 1 for s in gen) else 0
    # Past the warm-up: the first batches (on v0) carry the engine's one-time costs.
    gen = [s for s in gen if int(s["version"]) >= min_v]
    results = Counter(r["actor"] for r in rec.arrived if int(r["version"]) >= min_v)
    per_actor: dict[str, dict[str, Any]] = {}
    for actor in sorted({s["who"] for s in gen}):
        mine = [s for s in gen if s["who"] == actor]
        tokens = sum(int(s.get("tokens", 0)) for s in mine)
        seconds = sum(s["end"] - s["start"] for s in mine)
        rollouts = results[actor] * group
        per_actor[actor] = {
            "spans": len(mine),
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else math.nan,
            "rate_per_span": stats(
                [int(s.get("tokens", 0)) / (s["end"] - s["start"]) for s in mine]
            ),
            "rollouts": rollouts,
            "tokens_per_rollout": tokens / rollouts if rollouts else math.nan,
        }
    span_rates = [int(s.get("tokens", 0)) / (s["end"] - s["start"]) for s in gen]
    gen_tokens = sum(int(s.get("tokens", 0)) for s in gen)
    gen_seconds = sum(s["end"] - s["start"] for s in gen)
    rollouts = sum(results.values()) * group

    versions: dict[int, dict[str, Any]] = {}
    for v, pub in sorted(rec.published.items()):
        st = pub["stats"]
        if v == 0 or "time" not in st:
            continue
        end_extract = float(st["time"]) - rec.t0
        versions[v] = {
            "train_s": float(st.get("train_s", 0.0)),
            "extract_s": float(st.get("extract_s", 0.0)),
            "publish_s": pub["at"] - end_extract,
            "tokens": int(st.get("tokens", 0)),
            "delta_bytes": pub["delta_bytes"],
            "dense_bytes": st.get("dense_bytes"),
            "density": st.get("density"),
            "snapshot_bytes": pub["snapshot_bytes"],
        }
    sizes = {v: p["delta_bytes"] for v, p in rec.published.items() if p["delta_bytes"]}
    applies = [
        (sizes[int(s["version"])], s["end"] - s["start"])
        for s in rec.spans
        if s.get("activity") == "apply" and int(s["version"]) in sizes and s["end"] > s["start"]
    ]
    snapshots = {v: p["snapshot_bytes"] for v, p in rec.published.items() if p["snapshot_bytes"]}
    loads = []
    for s in rec.spans:
        if s.get("activity") != "catch-up" or s["end"] <= s["start"]:
            continue
        # A catch-up from nothing loads the newest snapshot at or below its target.
        base = max((v for v in snapshots if v <= int(s["version"])), default=None)
        if base is not None:
            loads.append((snapshots[base], s["end"] - s["start"], s["who"]))
    # Store reads of the Actors' first catch-up (to v0, before the first batch): from the
    # Ledger's CatchUp to its CaughtUp, less a control round trip and the load span.
    one_way = _control_one_way_s(rec)
    first_loads = {x[2]: x[1] for x in reversed(loads)}
    store_reads = []
    for actor, plans in rec.plans.items():
        t_plan, size = plans[0]
        caught = [t for t, _v in rec.caught_up.get(actor, []) if t >= t_plan]
        if t_plan < 0 and caught and caught[0] <= 0 and actor in first_loads:
            fetch = caught[0] - t_plan - 2 * one_way.get(actor, 0.0) - first_loads[actor]
            store_reads.append({"actor": actor, "bytes": size, "seconds": max(fetch, 0.0)})
    messages = result_messages(rec, gen_tokens / max(1, len(rec.arrived)))
    joins = []
    for when, spec_text in rec.faults:
        f = parse_fault(spec_text)
        if f.kind != "join":
            continue
        joined = [t for t in rec.joined.get(f.target, []) if t >= when - 1e-6]
        caught_to = [(t, v) for t, v in rec.caught_up.get(f.target, []) if t >= when - 1e-6]
        joins.append(
            {
                "actor": f.target,
                "fault": spec_text,
                "struck_s": when,
                "joined_s": joined[0] if joined else None,
                "caught_up_s": caught_to[0][0] if caught_to else None,
                "caught_up_to": caught_to[0][1] if caught_to else None,
            }
        )
    return {
        "actors": per_actor,
        "generation": {
            "tokens": gen_tokens,
            "seconds": gen_seconds,
            "tokens_per_s": gen_tokens / gen_seconds if gen_seconds > 0 else math.nan,
            "rate_per_span": stats(span_rates),
            "cv": cv(span_rates),
            "rollouts": rollouts,
            "tokens_per_rollout": gen_tokens / rollouts if rollouts else math.nan,
        },
        "versions": versions,
        "apply": {
            "n": len(applies),
            "bytes": sum(b for b, _ in applies),
            "seconds": sum(s for _, s in applies),
        },
        "snapshot_loads": [{"bytes": b, "seconds": s, "actor": a} for b, s, a in loads],
        "store_reads": store_reads,
        "result_messages": messages,
        "joins": joins,
    }


TCP_IP_HEADER_BYTES = 52
"""IPv4 (20) + TCP with timestamps (32) bytes per segment; asyncio sets TCP_NODELAY, so each
control message an Actor writes leaves as its own segment."""


def result_messages(rec: RunRecord, tokens_per_result: float) -> dict[str, Any]:
    """Bytes of the run's result messages on the wire, rebuilt as the Actor frames them
    (:func:`aurora.transport.wire.control` of ``{op, lease, version, weights_hash, payload,
    tokens}``) with each payload the Ledger logged, plus one segment's TCP/IP headers."""
    from aurora.store.ledgerlog import LedgerLog
    from aurora.transport import wire

    db = rec.path / "ledger.db"
    if not db.exists() or not rec.arrived:
        return {"n": 0}
    log = LedgerLog(db)
    sizes = []
    try:
        for r in rec.arrived:
            body = log.payload(r["actor"], r["lease"])
            if body is None:
                continue
            msg = {
                "op": "result",
                "lease": r["lease"],
                "version": r["version"],
                "weights_hash": r["weights_hash"],
                "payload": body,
                "tokens": round(tokens_per_result),
            }
            sizes.append(len(wire.control(msg)) + TCP_IP_HEADER_BYTES)
    finally:
        log.close()
    return stats(sizes) | {"how": "wire.control(msg) + 52 B of IPv4/TCP headers per message"}


def _control_one_way_s(rec: RunRecord) -> dict[str, float]:
    """Per Actor: one-way delay (s) of its control connection to the Ledger (half the RTT of
    its region's link to the Trainer's, as emulated; 0 on loopback)."""
    if rec.emulation is None:
        return {}
    trainer = rec.spec.trainer_region
    rtt = {}
    for lk in rec.emulation["links"]:
        if trainer in (lk["a"], lk["b"]):
            other = lk["b"] if lk["a"] == trainer else lk["a"]
            rtt[other] = float(lk["rtt_ms"]) / 2e3
    region = {a["id"]: a["region"] for a in rec.job["actors"]}
    for _when, text in rec.faults:
        f = parse_fault(text)
        if f.kind == "join":
            region[f.target] = f.region
    return {a: rtt.get(r, 0.0) for a, r in region.items()}
