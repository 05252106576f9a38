"""Runtime overhead: what ``aurora real`` costs on top of the compute it runs.

Theory of operation
-------------------
The same job (the rl backend: the tiny Qwen3, the arithmetic task, one Actor so that one engine
and one Trainer share the two cores exactly as in the bare loop) is run twice in one benchmark:
**bare**, in this process with no runtime at all (:func:`bare`), and **real**, ``aurora real`` on
loopback (:func:`real`). Three ratios, real / bare (1.0 = no overhead): ``generate``, ``train``
and ``step`` (:func:`real_numbers`). The bare loop is measured before and after the real run and
averaged, so drift in the machine's load falls on both sides. The first step of each side is
warm-up and not counted.

    python -m pytest benchmarks/test_runtime_overhead.py --benchmark-enable -s
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aurora.jobspec import JobSpec

STEPS = int(os.environ.get("AURORA_OVERHEAD_STEPS", "8"))
PROMPTS = 32  # the default run's batch (examples/geo.yaml: real.prompts_per_step)
GROUP = 8

TOPOLOGY = f"""
name: overhead
trainer: {{region: us, model: qwen3-8b, gpu: H100, gpus: 1, egress_gbps: 10}}
regions: [{{name: us}}]
actors: [{{region: us, gpu: A100, count: 1}}]
real: {{steps: {STEPS}, prompts_per_step: {PROMPTS}, group_size: {GROUP}, actors: 1,
        learning_rate: 5.0e-4, eval_prompts: 20}}
"""


def bare(spec: JobSpec, workdir: Path) -> dict[str, list[float]]:
    """The job's compute in one plain loop; per step: tokens, generate, train, publish (s).

    No runtime at all: the Trainer's compute (:class:`RLTrainer`) and the Actor's engine
    (:func:`make_rl_engine`) built from the run's own ``job.json`` spec, and a plain loop
    ``generate -> train -> publish`` for the same number of steps and prompts.
    """
    from aurora.runtime.compute import Sampling
    from aurora.runtime.rlbackend import RLTrainer, make_rl_engine

    trainer = RLTrainer(spec, workdir=str(workdir))
    engine = make_rl_engine(spec)
    engine.load(trainer.published(), version=trainer.version, weights_hash=trainer.weights_hash)
    sampling = Sampling(
        n=GROUP,
        max_new_tokens=spec.max_new_tokens or trainer.max_new_tokens,
        temperature=spec.temperature,
        seed=spec.seed,
    )
    out: dict[str, list[float]] = {"tokens": [], "generate": [], "train": [], "publish": []}
    for step in range(STEPS):
        prompts = [(f"p{step}-{i}", step * PROMPTS + i) for i in range(PROMPTS)]
        t0 = time.perf_counter()
        gens = engine.generate(prompts, sampling)
        t1 = time.perf_counter()
        trainer.train(
            [
                (index, g.payload, trainer.version)
                for (_, index), g in zip(prompts, gens, strict=True)
            ]
        )
        t2 = time.perf_counter()
        trainer.publish(lambda segment: None)
        t3 = time.perf_counter()
        # The engine follows the Trainer (dense load: the bare loop has no delta path to cost).
        engine.load(trainer.published(), version=trainer.version, weights_hash=trainer.weights_hash)
        out["tokens"].append(sum(g.tokens for g in gens))
        out["generate"].append(t1 - t0)
        out["train"].append(t2 - t1)
        out["publish"].append(t3 - t2)
    return out


def real(tmp: Path) -> Path:
    """Trainer and Ledger, one Actor, every byte through the data plane, every result through the
    Ledger's SQLite log."""
    topo = tmp / "overhead.yaml"
    topo.write_text(TOPOLOGY)
    out = tmp / "real"
    proc = subprocess.run(
        [sys.executable, "-m", "aurora.cli", "real", "--topology", str(topo)]
        + ["--out", str(out), "--quiet"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "overhead-aurora-s0"


def real_numbers(run_dir: Path) -> dict[str, float]:
    """The three ratios (real / bare):

    * ``generate``: the Actor's tokens per second *inside its generate spans* against the engine
      generating alone: what the runtime's own threads (data plane, control plane) take from the
      engine while it generates;
    * ``train``: the Trainer's ``train_s`` per step against the bare ``RLTrainer.train``;
    * ``step``: the run's steps per second against the bare sequential loop's. Above 1.0 is
      possible: the runtime overlaps the Actor's generation of batch v+1 with the Trainer's step v
      (one-step-off asynchrony), which the bare loop cannot. On a machine with fewer cores than
      the processes that then compute at once, the overlap instead slows both (they share cores),
      so the benchmark also reports the share of each step inside ``aurora real`` that is the
      Trainer's own compute: the rest is the runtime's work on the critical path (store write,
      checkpoint before the announcement) and the wait for the batch."""
    import pandas as pd

    lines = (run_dir / "ledger.spans.jsonl").read_text().splitlines()
    spans = [json.loads(line) for line in lines if line]
    gen = [s for s in spans if s["activity"] == "generate" and s["version"] >= 1]  # v0: warm-up
    rows = pd.read_csv(run_dir / "steps.csv")
    later = rows[rows.step >= 2]
    return {
        "gen_tokens_per_s": sum(s["tokens"] for s in gen) / sum(s["end"] - s["start"] for s in gen),
        "train_s": float(later.train_s.median()),
        "step_s": float(later.step_time_s.mean()),
        "extract_s": float(later.extract_s.median()),
        "store_s": float(later.store_s.median()),
        "checkpoint_s": float(later.checkpoint_s.median()),
        # Per step, the Trainer's own compute and the rest: the runtime's work on its critical
        # path (store, checkpoint) and any wait for the batch (Actors, Ledger, data plane).
        "compute_share": float((later.train_s + later.extract_s).sum() / later.step_time_s.sum()),
    }


@pytest.mark.benchmark(group="runtime-overhead")
def test_runtime_overhead_against_the_bare_compute(benchmark, tmp_path):
    results: dict[str, object] = {}

    def measure() -> None:
        run_dir = real(tmp_path)
        spec = JobSpec.decode(json.loads((run_dir / "job.json").read_text())["spec"])
        results["before"] = bare(spec, tmp_path / "bare1")
        results["real"] = real_numbers(run_dir)
        results["after"] = bare(spec, tmp_path / "bare2")
        results["summary"] = json.loads((run_dir / "summary.json").read_text())

    benchmark.pedantic(measure, rounds=1, iterations=1)
    b1, b2 = results["before"], results["after"]
    r = results["real"]
    assert isinstance(b1, dict) and isinstance(b2, dict) and isinstance(r, dict)

    def rate(b: dict) -> float:
        return sum(b["tokens"][1:]) / sum(b["generate"][1:])

    def step(b: dict) -> float:
        return statistics.mean(
            g + t + p
            for g, t, p in zip(b["generate"][1:], b["train"][1:], b["publish"][1:], strict=True)
        )

    bare_rate = (rate(b1) + rate(b2)) / 2
    bare_train = statistics.median(b1["train"][1:] + b2["train"][1:])
    bare_step = (step(b1) + step(b2)) / 2
    summary = results["summary"]
    assert isinstance(summary, dict)
    assert summary["prompts_lost"] == 0 and summary["actor_hash_mismatches"] == 0
    print(f"\n1 Actor, {STEPS} steps x {PROMPTS} prompts x {GROUP} completions, loopback")
    print(
        f"bare engine {bare_rate:,.0f} tok/s (before {rate(b1):,.0f}, after {rate(b2):,.0f}); "
        f"inside aurora real {r['gen_tokens_per_s']:,.0f} tok/s in generate spans: "
        f"ratio {r['gen_tokens_per_s'] / bare_rate:.3f}"
    )
    print(
        f"bare train step {bare_train:.3f} s; aurora real train_s {r['train_s']:.3f} s: "
        f"ratio {bare_train / r['train_s']:.3f} (throughput, 1.0 = no overhead)"
    )
    bare_publish = statistics.median(b1["publish"][1:] + b2["publish"][1:])
    print(
        f"Trainer after training, per step: extract {r['extract_s'] * 1e3:.0f} ms "
        f"(bare publish {bare_publish * 1e3:.0f} ms), store + digest {r['store_s'] * 1e3:.0f} ms, "
        f"checkpoint before announce {r['checkpoint_s'] * 1e3:.0f} ms; activation pause p50 "
        f"{summary['activation_pause_ms']['p50']:.0f} ms"
    )
    print(
        f"inside aurora real the Trainer's own compute (train + extract) is "
        f"{r['compute_share']:.1%} of the step; the rest is the runtime's work on its critical "
        "path and waiting for the batch"
    )
    print(
        f"bare loop {bare_step:.3f} s/step; aurora real {r['step_s']:.3f} s/step: "
        f"ratio {bare_step / r['step_s']:.3f} (throughput)"
    )
