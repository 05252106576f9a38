"""The reliability matrix: one row per fault, measured on real processes, and its table.

Theory of operation
-------------------
Each row of the matrix (``tests/test_reliability.py``) runs ``aurora real`` on the stand-in
compute with one fault injected, and :func:`measure` reads the run's own outputs (rebuilt from
the Ledger's log, :mod:`aurora.runtime.outputs`) into one row with the same columns for every
fault: what was lost, refused or wrongly admitted, and the longest pause of a surviving Actor,
which the test compares with the survivors' pause before the fault. :func:`write_table` turns
the rows the tests wrote into ``docs/RELIABILITY.md``'s table::

    python -m aurora.runtime.reliability results/reliability/rows.json docs/RELIABILITY.md
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from aurora.jobspec import JobSpec

DISTURBANCES = frozenset(
    {
        "Fault",
        "ActorLost",
        "ActorLeft",
        "PreemptionNotice",
        "RelayLost",
        "FallBack",
        "Expired",
        "Refused",
        "Released",
    }
)
"""Records of ``events.csv`` that only a fault leaves (an injected fault, a peer lost or leaving,
a route around a lost relay, a lease ended other than by its admitted result): the first of them
is where a run stops being fault-free."""


def generate_spans(run_dir: Path) -> dict[str, list[tuple[float, float]]]:
    spans: dict[str, list[tuple[float, float]]] = {}
    with open(run_dir / "timeline.csv") as f:
        for r in csv.DictReader(f):
            if r["activity"] == "generate":
                spans.setdefault(r["who"], []).append((float(r["start"]), float(r["end"])))
    return {k: sorted(v) for k, v in spans.items()}


def longest_pause(spans: list[tuple[float, float]]) -> float:
    """Longest gap (s) between the end of one generate span and the start of the next."""
    return max((b[0] - a[1] for a, b in zip(spans, spans[1:], strict=False)), default=0.0)


def _events(run_dir: Path) -> tuple[float, list[tuple[float, str, dict[str, Any]]]]:
    """``events.csv`` as (time, type, record), and its zero: the Ledger log's first record, from
    which ``timeline.csv`` counts (injected faults and dismissed roles are logged apart, by the
    launcher)."""
    with open(run_dir / "events.csv") as f:
        rows = list(csv.DictReader(f))
    ledger = [float(r["time"]) for r in rows if r["kind"] not in ("fault", "launcher")]
    t0 = min(ledger, default=0.0)
    return t0, [(float(r["time"]), r["type"], json.loads(r["record"])) for r in rows]


def lease_length(run_dir: Path) -> float:
    """One lease length L of the run as the Ledger set it (expiry - assignment time, from its
    ``Assign`` records; k x its median completion, claim to result, at least its floor): the
    longest L of the leases that ran out (expired, or refused LATE); where none did, the longest
    given after the first batch (whose leases carry the initial length, set before any
    completion was timed)."""
    _, rows = _events(run_dir)
    length: dict[str, tuple[float, str]] = {}
    for at, kind, rec in rows:
        if kind == "Assign":
            for lease, prompt in zip(rec["leases"], rec["prompts"], strict=True):
                length[lease] = (float(rec["expiry"]) - at, prompt)
    ran_out = {
        rec["lease"]
        for _, kind, rec in rows
        if kind == "Expired" or (kind == "Refused" and rec["reason"] == "LATE")
    }
    expired = [length[x][0] for x in ran_out if x in length]
    if expired:
        return max(expired)
    return max((s for s, prompt in length.values() if not prompt.startswith("b1-")), default=0.0)


def fault_start(run_dir: Path) -> float | None:
    """When the run stopped being fault-free (s on ``timeline.csv``'s clock): its first
    :data:`DISTURBANCES` record; None where the fault left none in the log (a relay serving
    bad bytes is refused by the Actors themselves)."""
    t0, rows = _events(run_dir)
    return min((at - t0 for at, kind, _ in rows if kind in DISTURBANCES), default=None)


def reference_pause(survivors: dict[str, list[tuple[float, float]]], start: float) -> float | None:
    """The longest pause (s) of the survivors that ended before ``start``: what this run's
    load alone makes of a pause; None when there is none."""
    gaps = [
        b[0] - a[1]
        for spans in survivors.values()
        for a, b in zip(spans, spans[1:], strict=False)
        if b[0] <= start
    ]
    return max(gaps, default=None)


def median_generate(run_dir: Path) -> float:
    """The median generate span of the run (s): one generation of a share."""
    durations = [e - s for v in generate_spans(run_dir).values() for s, e in v]
    return statistics.median(durations) if durations else 0.0


def measure(
    run_dir: Path, *, fault: str, how: str, when: str, affected: set[str]
) -> dict[str, Any]:
    """One row of the matrix from a finished run, read from its own outputs (rebuilt from the
    Ledger's log, :mod:`aurora.runtime.outputs`), with the same columns for every fault: steps
    completed, prompts lost, results refused by reason, wrong-version or wrong-hash admits, hash
    mismatches at activation, and the longest pause of any *surviving* Actor between two of its
    batches (the end of one generate span to the start of the next), which the test compares
    with the survivors' longest pause in the same run before the fault (the same load; a
    fault-free run of the same shape where the fault leaves no trace in the Ledger's log) plus
    one lease length as the Ledger set it."""
    s = json.loads((run_dir / "summary.json").read_text())
    spans = generate_spans(run_dir)
    survivors = {a: v for a, v in spans.items() if a not in affected}
    pauses = {a: longest_pause(v) for a, v in survivors.items()}
    start = fault_start(run_dir)
    return {
        "fault": fault,
        "how": how,
        "when": when,
        "steps_completed": s["steps_completed"],
        "steps": JobSpec.decode(s["spec"]).steps,
        "prompts_lost": s["prompts_lost"],
        "prompts_settled_twice": s["prompts_settled_twice"],
        "refused": s["results_refused"],
        "expired": s["leases_expired"],
        "wrong_admits": s["wrong_admits"],
        "hash_mismatches": s["actor_hash_mismatches"] + s["actor_digest_mismatches"],
        "replay_mismatches": s["replay_action_mismatches"],
        "lease_book_ok": s["lease_book_ok"],
        "survivor_pause_s": max(pauses.values()) if pauses else None,
        "fault_start_s": start,
        "reference_pause_s": None if start is None else reference_pause(survivors, start),
        "lease_s": lease_length(run_dir),
        "generate_s": median_generate(run_dir),
        "wall_s": s["wall_s"],
    }


def write_table(rows_path: Path, doc_path: Path) -> None:
    """Write ``doc_path``'s generated table from the rows the tests recorded."""
    rows = json.loads(rows_path.read_text())
    base = next((r for r in rows if r["fault"] == "none"), None)
    lines = [
        "| # | fault | injected how | when | steps | prompts lost | refused (reason: n) | "
        "wrong admits | hash mismatches | survivors' longest pause (s) | bound (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows):
        refused = ", ".join(f"{k}: {v}" for k, v in sorted(r["refused"].items())) or "-"
        bound = r.get("bound_s")
        pause = r["survivor_pause_s"]
        lines.append(
            f"| {i if r['fault'] != 'none' else '-'} | {r['fault']} | {r['how']} | {r['when']} | "
            f"{r['steps_completed']}/{r['steps']} | {r['prompts_lost']} | {refused} | "
            f"{r['wrong_admits']} | {r['hash_mismatches']} | "
            f"{'-' if pause is None else f'{pause:.2f}'} | "
            f"{'-' if bound is None else f'{bound:.2f}'} |"
        )
    text = doc_path.read_text() if doc_path.exists() else ""
    start, end = "<!-- matrix:start -->", "<!-- matrix:end -->"
    table = "\n".join(lines)
    if base is not None:
        table += (
            f"\n\nFault-free run of the same shape: longest pause {base['survivor_pause_s']:.2f} "
            f"s, one lease length {base['lease_s']:.2f} s."
        )
    if start in text and end in text:
        text = (
            text[: text.index(start) + len(start)] + "\n" + table + "\n" + text[text.index(end) :]
        )
    else:
        text += f"\n{start}\n{table}\n{end}\n"
    doc_path.write_text(text)


if __name__ == "__main__":
    write_table(Path(sys.argv[1]), Path(sys.argv[2]))
