"""Load: one Trainer and Ledger with many Actor processes on loopback.

The Actors run the labelled stand-in compute (:mod:`aurora.runtime.standin`): real processes,
real leases settled by the real Ledger, real deltas staged and applied, random tokens instead of
a model, so the numbers are the runtime's own (the model would only slow each Actor down). The
same run is made twice, with the Ledger's log in SQLite (WAL) and in memory, and the benchmark
reports leases settled per second, ``decide`` and log-append latency (p50/p99) and SQLite's
write amplification (bytes in the database files / bytes of the records appended).

    python -m pytest benchmarks/test_runtime_load.py --benchmark-enable -s

``AURORA_LOAD_ACTORS`` (default 64) sets the number of Actor processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ACTORS = int(os.environ.get("AURORA_LOAD_ACTORS", "64"))
STEPS = 12

TOPOLOGY = """
name: load
trainer: {{region: us, model: qwen3-8b, gpu: H100, gpus: 1, egress_gbps: 10}}
regions: [{{name: us}}, {{name: ca}}]
links: [{{a: us, b: ca, gbps: 1.0, rtt_ms: 40, loss: 0}}]
actors:
  - {{region: us, gpu: A100, count: {half}}}
  - {{region: ca, gpu: A100, count: {rest}}}
real: {{steps: {steps}, prompts_per_step: {prompts}, group_size: 4, actors: {n}}}
"""


def run(tmp: Path, memory: bool) -> dict:
    topo = tmp / "load.yaml"
    topo.write_text(
        TOPOLOGY.format(
            half=ACTORS // 2, rest=ACTORS - ACTORS // 2, steps=STEPS, prompts=8 * ACTORS, n=ACTORS
        )
    )
    out = tmp / ("memory" if memory else "sqlite")
    extra = {"standin_tokens_per_s": 0, "ledger_in_memory": memory, "start_wait_s": 300}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "aurora.cli",
            "real",
            "--topology",
            str(topo),
            "--backend",
            "standin",
            "--out",
            str(out),
            "--quiet",
            "--extra",
            json.dumps(extra),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = out / "load-aurora-s0"
    stats = json.loads((run_dir / "ledger.stats.json").read_text())
    stats["wall_s"] = wall
    if not memory:
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["prompts_lost"] == 0 and summary["wrong_admits"] == 0
        stats["summary"] = {k: summary[k] for k in ("tokens_per_s", "step_time_s", "wall_s")}
    return stats


@pytest.mark.benchmark(group="runtime-load")
def test_ledger_load_with_many_actor_processes(benchmark, tmp_path):
    results = {}

    def both() -> None:
        results["sqlite"] = run(tmp_path, memory=False)
        results["memory"] = run(tmp_path, memory=True)

    benchmark.pedantic(both, rounds=1, iterations=1)
    print(f"\n{ACTORS} Actor processes, {STEPS} steps, {8 * ACTORS} prompts per step")
    for name, s in results.items():
        busy = s["decide_total_s"] + s["log_total_s"]
        print(
            f"{name:>7}: {s['accepted']} leases settled, {s['events']} events; "
            f"decide p50 {s['decide_p50_s'] * 1e6:.0f} us p99 {s['decide_p99_s'] * 1e6:.0f} us; "
            f"log append p50 {s['log_p50_s'] * 1e6:.0f} us p99 {s['log_p99_s'] * 1e6:.0f} us; "
            f"Ledger busy {busy:.2f} s -> {s['accepted'] / busy:,.0f} leases/s of Ledger time; "
            f"run {s['wall_s']:.1f} s"
        )
    sq = results["sqlite"]
    print(
        f"SQLite: {sq['db_file_bytes']:,} B in the database files for {sq['log_bytes']:,} B of "
        f"records: write amplification {sq['db_file_bytes'] / sq['log_bytes']:.2f}x"
    )
    ratio = (sq["decide_total_s"] + sq["log_total_s"]) / (
        results["memory"]["decide_total_s"] + results["memory"]["log_total_s"]
    )
    print(f"Ledger time per event, SQLite / in memory: {ratio:.2f}x")
