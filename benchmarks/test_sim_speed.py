"""Simulator speed: wall time and events per second against bare SimPy in the same run.

Each size runs in a fresh process (so its peak resident memory is its own) and is reported as
ratios against references measured in the same run: events/s against bare SimPy's event rate
(:func:`simpy_events_per_s`, an upper bound no SimPy model reaches), and wall time in units of
the time bare SimPy takes for 10^6 events, so a number can be compared across machines and loads.
Targets: 800 steps x 12 Actors at >= 0.03x bare SimPy; 10^5 Actors x 50 steps in <= 120 s with
its memory reported. Profiles are in docs/journal/simulator-speed.md.

    python -m pytest benchmarks/test_sim_speed.py --benchmark-enable -s
    python benchmarks/test_sim_speed.py 100000 50      # one size alone
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import simpy

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.benchmark(group="sim")


def simpy_events_per_s(n: int = 200_000) -> float:
    """The reference: 200,000 timeouts of one process."""
    env = simpy.Environment()

    def ticker(env: simpy.Environment):
        for _ in range(n):
            yield env.timeout(1)

    env.process(ticker(env))
    t = time.perf_counter()
    env.run()
    return n / (time.perf_counter() - t)


def config(actors: int, steps: int):  # type: ignore[no-untyped-def]
    """800 x 12: examples/geo.yaml with 12 Actors. 100 and more: 10 regions of Actors behind
    one relay each, one lease per Actor per step."""
    import yaml

    from aurora.topology import topology_from_dict
    from aurora.traces import load_traces
    from sim.config import SimConfig, strategy

    if actors < 100:
        data = yaml.safe_load((ROOT / "examples" / "geo.yaml").read_text())
        data["actors"][0]["count"] = actors
        return SimConfig(
            topology=topology_from_dict(data),
            traces=load_traces(),
            strategy=strategy("aurora"),
            steps=steps,
            record_trace=False,
        )
    regions = 10
    data = {
        "name": "scale",
        "trainer": {"region": "us", "model": "qwen3-8b", "gpus": 3 * actors // 10},
        "regions": [{"name": "us"}] + [{"name": f"r{i}"} for i in range(regions)],
        "links": [
            {"a": "us", "b": f"r{i}", "gbps": 10.0, "rtt_ms": 50, "loss": 1e-6}
            for i in range(regions)
        ],
        "actors": [
            {"region": f"r{i}", "gpu": "A100", "count": actors // regions} for i in range(regions)
        ],
        # One relay forwards each delta to actors/10 Actors: it needs that many copies of its
        # 158 MB per step, so its interface grows with them (400 Gbit/s per 1000).
        "relays": [{"region": f"r{i}", "nic_gbps": 0.4 * actors / regions} for i in range(regions)],
    }
    return SimConfig(
        topology=topology_from_dict(data),
        traces=load_traces(),
        strategy=strategy("aurora"),
        steps=steps,
        rollouts_per_lease=512,
        record_trace=False,
    )


def measure(actors: int, steps: int) -> dict[str, float]:
    """Run one size here; wall, events, peak memory and the bare-SimPy reference."""
    from sim.model import simulate

    ref = simpy_events_per_s()
    t = time.perf_counter()
    result = simulate(config(actors, steps))
    wall = time.perf_counter() - t
    assert len(result.rows) == steps
    return {
        "actors": actors,
        "steps": steps,
        "wall_s": wall,
        "events": result.events,
        "events_per_s": result.events / wall,
        "simpy_events_per_s": ref,
        "ratio": result.events / wall / ref,
        "wall_in_simpy_1e6": wall / (1e6 / ref),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _in_a_fresh_process(actors: int, steps: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, str(actors), str(steps)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _report(name: str, m: dict[str, float], target: str) -> None:
    print(
        f"\n{name}: {m['wall_s']:.2f} s wall = {m['wall_in_simpy_1e6']:.1f} x (bare SimPy, 10^6 "
        f"events); {m['events']:,.0f} events, {m['events_per_s']:,.0f}/s = {m['ratio']:.3f} x "
        f"bare SimPy ({m['simpy_events_per_s']:,.0f}/s); peak memory {m['peak_rss_mb']:,.0f} MB; "
        f"target: {target}"
    )


@pytest.mark.parametrize(
    ("actors", "steps", "target"),
    [
        (12, 800, ">= 0.03 x bare SimPy (about 1.5 s on 2 quiet cores)"),
        (10_000, 50, "(reference for 10^5)"),
        (100_000, 50, "<= 120 s, memory reported"),
    ],
)
def test_simulator_speed(benchmark, actors, steps, target):
    m = benchmark.pedantic(_in_a_fresh_process, args=(actors, steps), rounds=1, iterations=1)
    _report(f"{actors:,} Actors x {steps} steps", m, target)


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]), int(sys.argv[2]))))
