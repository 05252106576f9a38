"""A real run's results, rebuilt from the Ledger's log: the same files as ``aurora sim``.

Theory of operation
-------------------
Everything that happened in a run went through the Ledger, and the Ledger logged it before
acting on it (:mod:`aurora.store.ledgerlog`). So the results are not collected from the
processes (some of which may have been killed); they are read back from that one log
(:func:`write_outputs`), and the run's invariants are checked by replaying it through the policy
core alone (:func:`replay_log`): the same actions as recorded, every prompt settled exactly once,
every admitted result and every Actor's weights on the version and hash the Trainer published.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aurora.policy.core import LedgerCore
from aurora.policy.events import event_from_record, to_record
from aurora.policy.ledger import LedgerConfig
from aurora.runtime.hopreport import REPORTS
from aurora.runtime.ledger.config import Job, job_pacing
from aurora.store.files import write_csv
from aurora.store.ledgerlog import LedgerLog


@dataclass
class RunLog:
    """What a run's Ledger log says, replayed."""

    events: list[dict[str, Any]] = field(default_factory=list)
    """Rows of ``events.csv``."""
    mismatched_actions: int = 0
    """Events whose replayed actions differ from the recorded ones (must be 0)."""
    requested: dict[int, tuple[int, float, int]] = field(default_factory=dict)
    """batch -> (version it was generated on, wall time requested, prompts)."""
    accepted: dict[int, Counter[str]] = field(default_factory=dict)
    """batch -> admitted results per Actor."""
    accepted_versions: dict[int, dict[str, int]] = field(default_factory=dict)
    published: dict[int, dict[str, Any]] = field(default_factory=dict)
    activations: list[dict[str, Any]] = field(default_factory=list)
    refused: Counter[str] = field(default_factory=Counter)
    expired: int = 0
    released: int = 0
    wrong_admits: int = 0
    """Admitted results whose version or hash is not their lease's / the published one."""
    settled_twice: int = 0
    prompts_settled: int = 0
    prompts_requested: int = 0
    book_ok: bool = True
    book_error: str = ""
    faults: list[tuple[float, str]] = field(default_factory=list)
    start: float | None = None
    end: float | None = None


def replay_log(db_path: str | Path, *, policy: LedgerConfig) -> RunLog:
    """Replay a run's Ledger log through ``decide`` with the run's policy configuration, and
    check the run's invariants on the way:

    * the log is replayed through the policy core alone (:class:`aurora.policy.core.LedgerCore`:
      ``decide`` and the pacer's batch accounting) and the actions must equal the ones the run
      recorded (the same decisions, made once, in one place);
    * the replayed lease book must pass :meth:`~aurora.policy.leases.LeaseBook.check` (every
      prompt in exactly one place) and every prompt of every requested batch must be settled
      exactly once;
    * every admitted result must carry its lease's version and the h(v) the Trainer published;
    * every Actor's reported weights hash (and content digest) after each activation or
      catch-up must equal what the Trainer published for that version."""
    log = LedgerLog(db_path)
    try:
        recorded = log.actions()
        rows = list(log.events())
    finally:
        log.close()
    core = LedgerCore(policy)
    state = core.state
    out = RunLog()
    results: dict[str, tuple[int, str]] = {}
    settled_prompts: Counter[str] = Counter()
    for row in rows:
        rec = row.record
        out.start = row.now if out.start is None else out.start
        out.end = row.now
        if row.kind == "driver":
            kind = rec.get("type")
            if kind == "Published":
                out.published[int(rec["version"])] = rec
            elif kind == "Activation":
                out.activations.append({**rec, "now": row.now})
            elif kind == "Fault":
                out.faults.append((row.now, str(rec.get("spec", ""))))
            elif kind == "Job" and core.pacer is None:
                # Batch accounting only: the grace and barrier are not judged in a replay.
                core.start_pacing(job_pacing(Job.from_record(rec), staging_grace_s=0.0))
            out.events.append(_event_row(row.now, "driver", rec))
            continue
        event = event_from_record(rec)
        try:
            actions = core.feed(event, now=row.now)
            replayed = [to_record(a) for a in actions]
        except ValueError as exc:
            replayed = [{"type": "Invalid", "reason": str(exc)}]
        if replayed != recorded.get(row.seq, []):
            out.mismatched_actions += 1
        out.events.append(_event_row(row.now, "event", rec))
        if rec["type"] == "BatchRequested" and rec["prompts"]:
            k = int(rec["prompts"][0][1 : rec["prompts"][0].index("-")])
            out.requested[k] = (int(rec["version"]), row.now, len(rec["prompts"]))
            out.prompts_requested += len(rec["prompts"])
        if rec["type"] == "ResultArrived":
            results[rec["lease"]] = (int(rec["version"]), str(rec["weights_hash"]))
        for a in replayed:
            out.events.append(_event_row(row.now, "action", a))
            kind = a["type"]
            if kind == "Accepted":
                k = int(a["prompt"][1 : a["prompt"].index("-")])
                out.accepted.setdefault(k, Counter())[a["actor"]] += 1
                out.accepted_versions.setdefault(k, {})[a["actor"]] = int(a["version"])
                settled_prompts[a["prompt"]] += 1
                version, h = results.get(a["lease"], (-1, ""))
                published = out.published.get(version, {})
                if version != int(a["version"]) or h != published.get("weights_hash"):
                    out.wrong_admits += 1
            elif kind == "Refused":
                out.refused[str(a["reason"])] += 1
            elif kind == "Expired":
                out.expired += 1
            elif kind == "Released":
                out.released += 1
    out.prompts_settled = len(settled_prompts)
    out.settled_twice = sum(1 for n in settled_prompts.values() if n > 1)
    try:
        state.book.check()
    except AssertionError as exc:
        out.book_ok, out.book_error = False, str(exc) or "lease book check failed"
    return out


def _event_row(now: float, kind: str, rec: dict[str, Any]) -> dict[str, Any]:
    who = rec.get("actor") or rec.get("relay") or rec.get("region") or ""
    detail = {k: v for k, v in rec.items() if k not in ("type", "actor")}
    text = f"{rec.get('type', '?')} " + " ".join(f"{k}={v}" for k, v in detail.items())
    return {
        "time": now,
        "kind": kind,
        "who": who,
        "type": rec.get("type", ""),
        "what": text.strip()[:300],
        "record": json.dumps(rec, sort_keys=True, default=str),
    }


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    i = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[i]


def write_outputs(
    run_dir: str | Path, *, config: dict[str, Any], name: str, policy: LedgerConfig
) -> dict[str, Any]:
    """Write the run's files and return ``summary.json``'s content.

    Files (in the run's folder): ``steps.csv`` (one row per step, the simulator's columns plus
    reward, loss and delta statistics), ``events.csv`` (every event and action, with wall time),
    ``timeline.csv`` (spans: generate, apply, catch-up per Actor; train, extract per step),
    ``summary.json`` and ``<name>.png`` (tokens/s and reward per step). The launcher's own
    records join them: the faults it injected (``faults.jsonl``) and the roles the job
    dismissed (``dismissed.jsonl``: excluded or revoked, refused at their next connection)."""
    run = Path(run_dir)
    log = replay_log(run / "ledger.db", policy=policy)
    faults = run / "faults.jsonl"
    if faults.exists():
        for line in faults.read_text().splitlines():
            rec = json.loads(line)
            log.faults.append((float(rec["time"]), str(rec["spec"])))
            log.events.append(_event_row(float(rec["time"]), "fault", {"type": "Fault", **rec}))
        log.faults.sort()
    dismissed: dict[str, str] = {}
    path = run / "dismissed.jsonl"
    if path.exists():  # roles the job refused for good, as the launcher saw them stop
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            who = next(str(v) for k, v in rec.items() if k not in ("time", "why"))
            dismissed[who] = str(rec["why"])
            log.events.append(
                _event_row(float(rec["time"]), "launcher", {"type": "Dismissed", **rec})
            )
    if faults.exists() or path.exists():
        log.events.sort(key=lambda r: r["time"])
    t0 = log.start or 0.0
    meta: dict[str, Any] = {}
    meta_path = run / "trainer" / "published.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
    steps = []
    prev = t0
    for v in sorted(x for x in log.published if x > 0):
        pub = log.published[v]
        stats = pub.get("stats") or {}
        at = float(pub.get("at", t0))
        tokens = int(stats.get("tokens", 0))
        step_time = at - prev
        prev = at
        batch_version = log.requested.get(v, (None, 0.0, 0))[0]
        steps.append(
            {
                "step": v,
                "version": v,
                "time_s": at - t0,
                "step_time_s": step_time,
                "tokens": tokens,
                "tokens_per_s": tokens / step_time if step_time > 0 else 0.0,
                "batch_version": batch_version,
                "staleness": (v - 1 - batch_version) if batch_version is not None else "",
                "shares": json.dumps(dict(log.accepted.get(v, {})), sort_keys=True),
                "actor_versions": json.dumps(log.accepted_versions.get(v, {}), sort_keys=True),
                "reward": stats.get("reward", ""),
                "loss": stats.get("loss", ""),
                "train_s": stats.get("train_s", ""),
                "extract_s": stats.get("extract_s", ""),
                "store_s": stats.get("store_s", ""),
                "checkpoint_s": stats.get("checkpoint_s", ""),
                "delta_bytes": pub.get("delta_bytes"),
                "dense_bytes": stats.get("dense_bytes", ""),
                "delta_over_dense": (
                    pub["delta_bytes"] / stats["dense_bytes"]
                    if pub.get("delta_bytes") and stats.get("dense_bytes")
                    else ""
                ),
                "density": stats.get("density", ""),
            }
        )
    columns = {
        k: (json.dumps(v, sort_keys=True) if isinstance(v, dict | list) else v)
        for k, v in config.items()
    }
    write_csv(run / "steps.csv", [columns | row for row in steps])
    write_csv(run / "events.csv", log.events)
    timeline = _timeline(run, t0, log)
    write_csv(run / "timeline.csv", timeline)
    pauses = [
        float(a["pause_ms"])
        for a in log.activations
        if a.get("how") == "activate" and a.get("pause_ms") is not None
    ]
    hash_mismatch = digest_mismatch = digest_checked = 0
    for a in log.activations:
        pub = log.published.get(int(a["version"]), {})
        if a.get("weights_hash") != pub.get("weights_hash"):
            hash_mismatch += 1
        if a.get("digest") and pub.get("digest"):
            # Only versions the job digests (``digest_interval``) carry one on both sides.
            digest_checked += 1
            digest_mismatch += a["digest"] != pub["digest"]
    measured = steps[1:] if len(steps) > 1 else steps
    total_tokens = sum(r["tokens"] for r in measured)
    total_time = sum(r["step_time_s"] for r in measured)
    summary = {
        **config,
        "steps_completed": max((v for v in log.published), default=0),
        "prompts_requested": log.prompts_requested,
        "prompts_settled": log.prompts_settled,
        "prompts_lost": log.prompts_requested - log.prompts_settled,
        "prompts_settled_twice": log.settled_twice,
        "lease_book_ok": log.book_ok,
        "lease_book_error": log.book_error,
        "replay_action_mismatches": log.mismatched_actions,
        "results_refused": dict(log.refused),
        "leases_expired": log.expired,
        "leases_released": log.released,
        "wrong_admits": log.wrong_admits,
        "activations": len(log.activations),
        "actor_hash_mismatches": hash_mismatch,
        "actor_digest_mismatches": digest_mismatch,
        "actor_digests_checked": digest_checked,
        "activation_pause_ms": {
            "p50": _percentile(pauses, 0.5),
            "p99": _percentile(pauses, 0.99),
            "max": max(pauses) if pauses else None,
            "n": len(pauses),
        },
        "tokens_per_s": total_tokens / total_time if total_time > 0 else 0.0,
        "step_time_s": total_time / len(measured) if measured else 0.0,
        "wall_s": (log.end or t0) - t0,
        "reward_first": meta.get("reward_first"),
        "reward_last": meta.get("reward_last"),
        "delta_over_dense": (
            sum(r["delta_bytes"] or 0 for r in steps) / sum(r["dense_bytes"] or 1 for r in steps)
            if steps and all(isinstance(r["dense_bytes"], int) for r in steps)
            else None
        ),
        "faults": [spec for _, spec in log.faults],
        "dismissed": dismissed,
    }
    tmp = run / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, run / "summary.json")
    _figure(run / f"{name}.png", steps)
    return summary


def _timeline(run: Path, t0: float, log: RunLog) -> list[dict[str, Any]]:
    rows = []
    spans = run / "ledger.spans.jsonl"
    if spans.exists():
        for line in spans.read_text().splitlines():
            with_ = json.loads(line)
            if with_.get("activity") in REPORTS:
                continue  # measurements of the path and the loops, not work on a timeline
            rows.append(
                {
                    "role": "actor",
                    "who": with_.get("who", ""),
                    "activity": with_.get("activity", ""),
                    "version": with_.get("version", ""),
                    "start": float(with_["start"]) - t0,
                    "end": float(with_["end"]) - t0,
                }
            )
    for v, pub in sorted(log.published.items()):
        stats = pub.get("stats") or {}
        if v == 0 or "time" not in stats:
            continue
        end_extract = float(stats["time"]) - t0
        start_extract = end_extract - float(stats.get("extract_s", 0.0))
        start_train = start_extract - float(stats.get("train_s", 0.0))
        rows.append(
            {
                "role": "trainer",
                "who": "trainer",
                "activity": "train",
                "version": v,
                "start": start_train,
                "end": start_extract,
            }
        )
        rows.append(
            {
                "role": "trainer",
                "who": "trainer",
                "activity": "extract",
                "version": v,
                "start": start_extract,
                "end": end_extract,
            }
        )
    rows.sort(key=lambda r: (r["start"], r["who"]))
    return rows


def _figure(path: Path, steps: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    xs = [r["step"] for r in steps]
    a.plot(xs, [r["tokens_per_s"] for r in steps], marker=".")
    a.set(xlabel="training step", ylabel="tokens/s", title="throughput per step")
    rewards = [r["reward"] if r["reward"] != "" else float("nan") for r in steps]
    b.plot(xs, rewards, marker=".", color="tab:green")
    b.set(xlabel="training step", ylabel="mean reward (training batch)", title="reward per step")
    for ax in (a, b):
        ax.grid(True, alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def recorded_trace(db_path: str | Path) -> list[dict[str, Any]]:
    """The policy events of a run's log with the actions the run carried out for each: the
    input of the parity check (``tests/golden/real_run_trace.json`` is one)."""
    log = LedgerLog(db_path)
    try:
        recorded = log.actions()
        return [
            {"now": row.now, "event": row.record, "actions": recorded.get(row.seq, [])}
            for row in log.events()
            if row.kind == "policy"
        ]
    finally:
        log.close()
