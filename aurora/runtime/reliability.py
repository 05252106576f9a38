"""The reliability matrix: one row per fault, measured on real processes, and its table.

Theory of operation
-------------------
Each row of the matrix (``tests/test_reliability.py``) runs ``aurora real`` on the stand-in
compute with one fault injected, and :func:`measure` reads the run's own outputs (rebuilt from
the Ledger's log, :mod:`aurora.runtime.outputs`) into one row with the same columns for every
fault: steps completed, prompts lost, results refused by reason, wrong-version or wrong-hash
admits, hash mismatches at activation, and the longest pause of any *surviving* Actor between
two of its batches (the end of one generate span to the start of the next), which the test
compares with a fault-free run of the same shape plus one lease length. :func:`write_table`
turns the rows the tests wrote into ``docs/RELIABILITY.md``'s table::

    python -m aurora.runtime.reliability results/reliability/rows.json docs/RELIABILITY.md
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path

LEASE_K = 2.5
"""Lease length L = k x median completion (the Ledger's default k)."""


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


def lease_length(run_dir: Path) -> float:
    """One lease length of the run: k x the median generate span, at least 1 s."""
    durations = [e - s for v in generate_spans(run_dir).values() for s, e in v]
    return max(1.0, LEASE_K * statistics.median(durations)) if durations else 1.0


def median_generate(run_dir: Path) -> float:
    """The median generate span of the run (s): one generation of a share."""
    durations = [e - s for v in generate_spans(run_dir).values() for s, e in v]
    return statistics.median(durations) if durations else 0.0


def measure(run_dir: Path, *, fault: str, how: str, when: str, affected: set[str]) -> dict:
    """One row of the matrix from a finished run (see the module docstring)."""
    s = json.loads((run_dir / "summary.json").read_text())
    spans = generate_spans(run_dir)
    survivors = {a: v for a, v in spans.items() if a not in affected}
    pauses = {a: longest_pause(v) for a, v in survivors.items()}
    return {
        "fault": fault,
        "how": how,
        "when": when,
        "steps_completed": s["steps_completed"],
        "steps": s["spec"]["steps"],
        "prompts_lost": s["prompts_lost"],
        "prompts_settled_twice": s["prompts_settled_twice"],
        "refused": s["results_refused"],
        "expired": s["leases_expired"],
        "wrong_admits": s["wrong_admits"],
        "hash_mismatches": s["actor_hash_mismatches"] + s["actor_digest_mismatches"],
        "replay_mismatches": s["replay_action_mismatches"],
        "lease_book_ok": s["lease_book_ok"],
        "survivor_pause_s": max(pauses.values()) if pauses else None,
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
