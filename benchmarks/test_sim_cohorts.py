"""Cohort mode against exact mode at 10^2-10^5 Actors (10 regions, one relay each): wall time,
peak memory, SimPy events, the rows they produce, and wall time as a ratio to bare SimPy.

Each (Actors, mode) runs in a fresh process, so its peak resident memory is its own. The check
at each size: step time and tokens/s within 1% (in practice equal: cohort mode feeds the Ledger
the same events at the same simulated times) and no prompt lost (every batch admitted all its
prompts, nothing expired). Exact mode at 10^5 is not run by default (about 10 minutes, 3.5 GB):
``--exact-max 100000`` runs it; the figure otherwise extrapolates it from 10^4 (linear in
Actors x steps) and says so.

    python -m pytest benchmarks/test_sim_cohorts.py --benchmark-enable -s
    python benchmarks/test_sim_cohorts.py 10000 50 cohort      # one run, one JSON line
    python benchmarks/test_sim_cohorts.py 100000 5 cohort --core   # + time in the policy core
    python benchmarks/test_sim_cohorts.py 100000 50 cohort --no-noise   # diagnostic: noise off
    python benchmarks/test_sim_cohorts.py --figure docs/img/sim_cohorts.jsonl out.png
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
pytestmark = pytest.mark.benchmark(group="sim")


def time_the_core() -> dict[str, list[float]]:
    """Wrap the entry points of ``LedgerCore`` the simulator calls (``feed``, ``poll``,
    ``staged``, ``early``) to add up the process time spent in them: ``{name:
    [calls, seconds]}``, ``feed`` per event type (the policy core's share of a run)."""
    from aurora.policy.core import LedgerCore

    spent: dict[str, list[float]] = {}
    clock = time.process_time

    def wrap(name: str) -> None:
        inner = getattr(LedgerCore, name)

        def timed(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            t = clock()
            try:
                return inner(self, *args, **kwargs)
            finally:
                key = f"feed:{type(args[0]).__name__}" if name == "feed" else name
                entry = spent.setdefault(key, [0, 0.0])
                entry[0] += 1
                entry[1] += clock() - t

        setattr(LedgerCore, name, timed)

    for name in ("feed", "poll", "staged", "early"):
        wrap(name)
    return spent


def without_noise(cfg):  # type: ignore[no-untyped-def]
    """``cfg`` with every GPU's throughput noise off (``cv`` 0): a diagnostic, not the model.

    Every member of a cohort then generates for the same time, so a cohort's finishes all fall
    at one instant and are reported in member order, one SimPy event per cohort: what is left
    is the per-member work itself (the policy core's and the simulator's), without the cost
    of finishes spread in time (one SimPy event each) and met in random order (each member's
    objects cold in the caches). The decisions are not the model's, only their count per
    member is the same; the rows differ."""
    from aurora.traces import Quantity

    gpus = {
        name: dataclasses.replace(g, cv=Quantity(value=0.0, source="diagnostic: noise off"))
        for name, g in cfg.traces.gpus.items()
    }
    return dataclasses.replace(cfg, traces=dataclasses.replace(cfg.traces, gpus=gpus))


def measure(actors: int, steps: int, mode: str, *, noise: bool = True) -> dict[str, object]:
    """One run here: wall, peak memory, events, the bare-SimPy reference, the run's summary
    (``noise=False``: :func:`without_noise`)."""
    from test_sim_speed import config, simpy_events_per_s

    from sim.model import Simulation

    ref = simpy_events_per_s()
    cfg = dataclasses.replace(config(actors, steps), cohorts=mode == "cohort")
    if not noise:
        cfg = without_noise(cfg)
    t = time.perf_counter()
    sim = Simulation(cfg)
    result = sim.run()
    wall = time.perf_counter() - t
    summary = result.summary()
    pacer = sim.driver.pacer
    return {
        "actors": actors,
        "steps": steps,
        "mode": mode if noise else f"{mode}, noise off (diagnostic)",
        "wall_s": wall,
        # What one Actor's step costs (us): 10^5 x 50 in 120 s is 24.0 us; the fifth pass of
        # docs/journal/simulator-speed.md compares this across sizes, where the data does and does
        # not fit in cache.
        "us_per_member_step": wall / (actors * steps) * 1e6,
        "events": result.events,
        "simpy_events_per_s": ref,
        "wall_in_simpy_1e6": wall / (1e6 / ref),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_time_s": summary["step_time_s"],
        "tokens_per_s": summary["tokens_per_s"],
        "expired": summary["expired_leases"],
        "batches_complete": pacer.next_batch - 1 if pacer is not None else -1,
        "pool_left": sim.ledger.book.pool_size,
        "splits": sim.actors.cohorts.splits,
        "rows_digest": hashlib.sha256(json.dumps(result.rows, sort_keys=True).encode()).hexdigest(),
    }


def run_fresh(actors: int, steps: int, mode: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, __file__, str(actors), str(steps), mode],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _agree(exact: dict[str, object], cohort: dict[str, object]) -> None:
    for key in ("step_time_s", "tokens_per_s"):
        a, b = float(exact[key]), float(cohort[key])  # type: ignore[arg-type]
        assert math.isclose(a, b, rel_tol=0.01), (key, a, b)
    for m in (exact, cohort):
        assert m["expired"] == 0 and m["pool_left"] == 0, m


@pytest.mark.parametrize("actors", [100, 1_000, 10_000])
def test_cohort_mode_agrees_with_exact_mode_with_fewer_simpy_events(benchmark, actors):
    steps = 50
    exact = run_fresh(actors, steps, "exact")
    cohort = benchmark.pedantic(run_fresh, args=(actors, steps, "cohort"), rounds=1, iterations=1)
    _agree(exact, cohort)
    assert exact["rows_digest"] == cohort["rows_digest"]
    assert int(cohort["events"]) < int(exact["events"]) / 2  # type: ignore[call-overload]
    print(
        f"\n{actors:,} Actors x {steps} steps: exact {exact['wall_s']:.1f} s "
        f"({exact['wall_in_simpy_1e6']:.1f} x bare SimPy 10^6 events, "
        f"{exact['peak_rss_mb']:.0f} MB)"
        f", cohort {cohort['wall_s']:.1f} s ({cohort['wall_in_simpy_1e6']:.1f} x, "
        f"{cohort['peak_rss_mb']:.0f} MB); rows identical: "
        f"{exact['rows_digest'] == cohort['rows_digest']}"
    )


def test_cohort_mode_at_100k_actors(benchmark):
    m = benchmark.pedantic(run_fresh, args=(100_000, 50, "cohort"), rounds=1, iterations=1)
    print(
        f"\n100,000 Actors x 50 steps, cohort: {m['wall_s']:.1f} s = "
        f"{m['wall_in_simpy_1e6']:.1f} x bare SimPy 10^6 events; peak {m['peak_rss_mb']:.0f} MB; "
        "target <= 120 s, <= 8 GiB"
    )
    assert m["expired"] == 0 and m["pool_left"] == 0
    assert float(m["peak_rss_mb"]) <= 8 * 1024  # type: ignore[arg-type]


def figure(results: list[dict[str, object]], path: str) -> None:
    """Wall time and peak memory against Actors, both modes. Exact mode at sizes it did not
    run is extrapolated from its largest run by cohort mode's own growth between the same
    sizes (cohort mode grows faster than linearly from 10^4 to 10^5: the Ledger's lease
    history), drawn dashed and labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    runs = {
        mode: {int(r["actors"]): r for r in results if r["mode"] == mode}  # type: ignore[call-overload]
        for mode in ("exact", "cohort")
    }
    for ax, key in ((ax_t, "wall_s"), (ax_m, "peak_rss_mb")):
        for mode, style in (("exact", "o-"), ("cohort", "s-")):
            xs = sorted(runs[mode])
            ax.plot(xs, [float(runs[mode][x][key]) for x in xs], style, label=mode)  # type: ignore[arg-type]
        ex, co = runs["exact"], runs["cohort"]
        top = max(ex)
        missing = [x for x in sorted(co) if x > top]
        if missing:
            ys = [float(ex[top][key]) * float(co[x][key]) / float(co[top][key]) for x in missing]  # type: ignore[arg-type]
            ax.plot([top, *missing], [float(ex[top][key]), *ys], "k--", label="exact, extrapolated")  # type: ignore[arg-type]
    ax_t.axhline(120, color="r", lw=0.8, label="target 120 s")
    ax_m.axhline(8 * 1024, color="r", lw=0.8, label="limit 8 GiB")
    for ax, name in ((ax_t, "wall time (s)"), (ax_m, "peak memory (MB)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("Actors (x 50 steps, 10 regions)")
        ax.set_ylabel(name)
        ax.legend(fontsize=8)
    fig.suptitle("aurora sim: exact vs cohort mode, one process on a shared 2-core machine")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    if sys.argv[1] == "--figure":
        rows = [json.loads(line) for line in Path(sys.argv[2]).read_text().splitlines() if line]
        figure(rows, sys.argv[3])
    else:
        core = time_the_core() if "--core" in sys.argv else None
        cpu = time.process_time()
        m = measure(
            int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], noise="--no-noise" not in sys.argv
        )
        if core is not None:
            m["cpu_s"] = time.process_time() - cpu
            m["core_s"] = sum(s for _, s in core.values())
            m["core_us_per_call"] = {k: 1e6 * s / n for k, (n, s) in core.items()}
            m["core_calls"] = {k: n for k, (n, _) in core.items()}
        print(json.dumps(m))
