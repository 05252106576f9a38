"""The run behind ``real_run_trace.json``: ``aurora real --backend standin`` on the topology of
``tests/test_runtime.py`` with 3 Actors for 8 steps, one Actor preempted after batch 3 and one
joining after batch 4; its Ledger log read back with
:func:`aurora.runtime.outputs.recorded_trace` (every policy event at its wall-clock time, with
the actions the run carried out), the job's registration time and the pacing it registered.

Regenerate (only when a decision or the log's vocabulary is meant to change; about 10 s):
    python -m tests.golden.real_run > tests/golden/real_run_trace.json
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from aurora.jobspec import JobSpec
from aurora.runtime.outputs import recorded_trace
from aurora.store.ledgerlog import LedgerLog

TOPOLOGY = """
name: t
trainer: {region: us, model: qwen3-8b, gpu: H100, gpus: 1, egress_gbps: 10}
regions: [{name: us}, {name: ca}]
links: [{a: us, b: ca, gbps: 1.0, rtt_ms: 40, loss: 0}]
actors:
  - {region: ca, gpu: A100, count: 3}
real: {steps: 8, prompts_per_step: 12, group_size: 4}
"""
FAULTS = ("preempt:ca-a100-1@step=3", "join:ca-new-0:ca:A100@step=4")


def record(folder: Path) -> dict[str, Any]:
    topo = folder / "t.yaml"
    topo.write_text(TOPOLOGY)
    faults = [arg for f in FAULTS for arg in ("--fault", f)]
    subprocess.run(
        [sys.executable, "-m", "aurora.cli", "real", "--topology", str(topo), "--backend"]
        + ["standin", "--out", str(folder / "out"), "--quiet", *faults],
        check=True,
        capture_output=True,
        timeout=300,
    )
    db = folder / "out" / "t-aurora-s0" / "ledger.db"
    log = LedgerLog(db)
    try:
        job = next(r for r in log.events() if r.kind == "driver" and r.record["type"] == "Job")
    finally:
        log.close()
    spec = JobSpec.decode(job.record["spec"])
    strat = spec.strategy
    return {
        "note": (
            "Recorded by python -m tests.golden.real_run (aurora real --backend standin, 3 "
            f"Actors, 8 steps, {' '.join(FAULTS)}): every policy event the Ledger logged, at "
            "its wall-clock time, with the actions it carried out (BatchCompleted included); "
            "job_at is when the Trainer registered the job, pacer the pacing it registered."
        ),
        "config": {
            "trainer_region": spec.trainer_region,
            "max_lag": strat.max_lag,
            "relays": strat.relays,
            "lease_initial_s": spec.lease_initial_s,
        },
        "pacer": {
            "steps": job.record["steps"],
            "prompts_per_batch": job.record["prompts_per_batch"],
            "staging_grace_s": strat.staging_grace_s,
            "start_actors": spec.start_actors,
            "start_wait_s": spec.start_wait_s,
        },
        "job_at": job.now,
        "rows": recorded_trace(db),
    }


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        print(json.dumps(record(Path(d)), indent=0, sort_keys=True))
