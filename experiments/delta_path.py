"""Where a delta's time goes on a real run: the path from the Trainer to the Actors, hop by hop,
each role's event-loop lag, and what the emulated link did meanwhile.

    python -m experiments.delta_path RUN_DIR [RUN_DIR ...] [--warmup 2]

Theory of operation
-------------------
``sim_vs_real`` compares one interval per delta, a version's extraction starting to the Ledger
counting its last Actor staged; that one number does not say which hop is slower than modelled.
A run made with the hop reports (:mod:`aurora.runtime.hopreport`) holds a time per hop and
version (:func:`path_rows` lists their sources); :func:`hop_table` gives the median over versions
past ``warmup`` of each consecutive hop, so a hop slower than the model shows as its own row.
:func:`loop_lag` gives each role's event-loop lag, and :func:`link_counters` the emulator's
delay-line lateness, qdisc drops and TCP retransmissions and timeouts during the run."""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from experiments.common import plain

HOPS = (
    "extract_start",
    "trainer_out_first",
    "extract_end",
    "trainer_out_last",
    "relay_in_first",
    "relay_in_last",
    "relay_out_first",
    "relay_out_last",
    "actor_in_last",
    "actor_staged",
    "ledger_staged",
)
"""The times of a version's path, in the order the bytes pass them (cut-through: the Trainer's
first segment leaves before extraction ends)."""
CHAIN = (
    ("extract_start", "extract_end"),
    ("extract_end", "trainer_out_last"),
    ("trainer_out_last", "relay_in_last"),
    ("relay_in_last", "relay_out_last"),
    ("relay_out_last", "actor_in_last"),
    ("actor_in_last", "actor_staged"),
    ("actor_staged", "ledger_staged"),
    ("extract_start", "ledger_staged"),
)
"""Consecutive hops (and the whole path last): each a row of :func:`hop_table`."""


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _latest(spans: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """The last ``delta-path`` span per (sender, version): later reports carry later values."""
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for s in spans:
        if s.get("activity") == "delta-path":
            out[(str(s["who"]), int(s["version"]))] = s
    return out


def _role(who: str) -> str:
    return "trainer" if who == "trainer" else "relay" if who.startswith("relay") else "actor"


def path_rows(run: Path) -> pd.DataFrame:
    """One row per published version: every time of :data:`HOPS` minus ``extract_start`` (s),
    and the version's delta bytes.

    The times and their sources:

    ==================  ========================================================================
    time                source
    ==================  ========================================================================
    ``extract_start``   ``trainer/steps.jsonl``: ``time - extract_s`` (the Trainer starts cutting)
    ``extract_end``     ``trainer/steps.jsonl``: ``time``
    ``trainer_out_*``   ``trainer/hops.jsonl``: first segment taken for sending, last written out
    ``relay_in_*``      ``ledger.spans.jsonl`` (the relay's ``delta-path`` span): bytes start
                        arriving, the version whole and verified
    ``relay_out_*``     the relay's span: first segment taken for an Actor, last one written out
    ``actor_in_last``   the Actors' spans: the version whole and verified (the latest Actor)
    ``actor_staged``    the Actors' spans: staged, i.e. the ``staged`` message handed to the channel
    ``ledger_staged``   ``events.csv``: the Ledger's ``DeltaStaged`` for the latest Actor
    ==================  ========================================================================
    """
    steps = {int(r["version"]): r["stats"] for r in _jsonl(run / "trainer" / "steps.jsonl")}
    spans = _jsonl(run / "ledger.spans.jsonl") + _jsonl(run / "trainer" / "hops.jsonl")
    latest = _latest(spans)
    staged: dict[int, float] = {}
    events = run / "events.csv"
    if events.exists():
        ev = pd.read_csv(events)
        for r in ev[ev["type"] == "DeltaStaged"].itertuples():
            v = int(json.loads(r.record)["version"])
            staged[v] = max(staged.get(v, 0.0), float(r.time))
    rows = []
    for v, st in sorted(steps.items()):
        t: dict[str, float] = {
            "extract_start": st["time"] - st["extract_s"],
            "extract_end": st["time"],
        }
        by_role: dict[str, list[dict[str, Any]]] = {}
        for (who, version), span in latest.items():
            if version == v:
                by_role.setdefault(_role(who), []).append(span)
        for role, hops in (
            ("trainer", ("out_first", "out_last")),
            ("relay", ("in_first", "in_last", "out_first", "out_last")),
            ("actor", ("in_last", "staged")),
        ):
            for hop in hops:
                values = [s[hop] for s in by_role.get(role, []) if hop in s]
                if values:  # a first time: the earliest node; a last: the latest node
                    at_end = "last" in hop or hop == "staged"
                    t[f"{role}_{hop}"] = max(values) if at_end else min(values)
        if v in staged:
            t["ledger_staged"] = staged[v]
        row: dict[str, Any] = {"version": v, "delta_bytes": st.get("delta_bytes")}
        row |= {h: t[h] - t["extract_start"] for h in HOPS if h in t}
        rows.append(row)
    return pd.DataFrame(rows)


def hop_table(rows: pd.DataFrame, warmup: int = 2) -> pd.DataFrame:
    """Median, min and max over versions past ``warmup`` of each hop of :data:`CHAIN` (s).

    For example ``trainer_out_last -> relay_in_last`` is the link's crossing, the last byte's
    propagation and queueing. Each hypothesis for a gap predicts a signature here: (a) a late
    delay line: large ``late_max_us`` / drops / RTOs and a long link hop; (b) the GIL: a long
    ``actor_in_last -> actor_staged`` or ``actor_staged -> ledger_staged`` and loop lag in that
    role; (c) wire overhead: a link hop longer than payload / htb rate by ~1/0.956; (d) control
    behind data: ``ledger_staged`` late although ``actor_staged`` is not; (e) cwnd restart after
    idle: the first segment's hop long, the rest not.
    """
    after = rows[rows["version"] > warmup]
    out = []
    for a, b in CHAIN:
        if a not in after or b not in after:
            continue
        d = (after[b] - after[a]).dropna()
        if len(d):
            out.append(
                {
                    "hop": f"{a} -> {b}",
                    "median_s": float(d.median()),
                    "min_s": float(d.min()),
                    "max_s": float(d.max()),
                    "versions": len(d),
                }
            )
    return pd.DataFrame(out)


def loop_lag(run: Path) -> pd.DataFrame:
    """Each role's event-loop lag over the run: the median of its per-interval p50s, the
    largest p99 and max (s), and the samples behind them.

    p50, p99 and max of each role's ``loop-lag`` spans.
    """
    spans = _jsonl(run / "ledger.spans.jsonl") + _jsonl(run / "trainer" / "hops.jsonl")
    by: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        if s.get("activity") == "loop-lag":
            by.setdefault(str(s["who"]), []).append(s)
    return pd.DataFrame(
        [
            {
                "who": who,
                "p50_s": statistics.median(s["p50_s"] for s in ss),
                "p99_s": max(s["p99_s"] for s in ss),
                "max_s": max(s["max_s"] for s in ss),
                "samples": sum(s["samples"] for s in ss),
            }
            for who, ss in sorted(by.items())
        ]
    )


def link_counters(run: Path) -> dict[str, Any]:
    """From ``emulation.json``: per delay line its packets and lateness (mean and max, us);
    per direction the drops of its qdiscs; per region the TCP retransmissions and timeouts,
    each during the run (after the start-up probe until close).

    From the run's ``emulation.json``.
    """
    path = run / "emulation.json"
    if not path.exists():
        return {}
    em = json.loads(path.read_text())
    out: dict[str, Any] = {}
    for q, s in (em.get("delay_lines") or {}).items():
        out[f"delay_line_{q}"] = {
            "packets": s.get("packets"),
            "late_mean_us": s.get("late_mean_us"),  # the delay line's own mean at exit
            "late_max_us": s.get("late_max_us"),
            "read_lag_max_us": s.get("read_lag_max_us"),
        }
    during = (em.get("counters") or {}).get("during_run") or {}
    for direction, qdiscs in (during.get("qdiscs") or {}).items():
        # The leaf's own drops: the htb root above it counts the same packets again.
        leaf = [q for q in qdiscs.values() if q.get("kind") in ("bfifo", "pfifo")]
        out[f"drops {direction}"] = sum(int(q.get("dropped", 0)) for q in leaf)
        if leaf and leaf[0].get("sent_packets"):
            # Bytes the htb counted per packet (headers included): the wire's share of payload.
            out[f"wire bytes/packet {direction}"] = leaf[0]["sent_bytes"] / leaf[0]["sent_packets"]
    for region, tcp in (during.get("tcp") or {}).items():
        out[f"tcp {region}"] = tcp
    return out


def report(run: Path, warmup: int = 2) -> str:
    rows = path_rows(run)
    parts = [f"# {run}", "", f"versions: {len(rows)} (hops after v{warmup})"]
    table = hop_table(rows, warmup)
    parts.append(table.to_string(index=False, float_format="%.4f") if len(table) else "no hops")
    lag = loop_lag(run)
    parts += ["", "event-loop lag per role (s):"]
    parts.append(lag.to_string(index=False, float_format="%.4f") if len(lag) else "none reported")
    counters = link_counters(run)
    if counters:
        parts += ["", "emulated link during the run:"]
        parts += [f"  {k}: {v}" for k, v in counters.items()]
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=plain((__doc__ or "").split("\n\n")[0]))
    p.add_argument("runs", nargs="+", help="run folders (aurora real's output)")
    p.add_argument("--warmup", type=int, default=2, help="versions left out (default 2)")
    args = p.parse_args(argv)
    for run in args.runs:
        path = Path(run)
        print(report(path, args.warmup))
        path_rows(path).to_csv(path / "delta_path.csv", index=False)
        print()


if __name__ == "__main__":
    main()
