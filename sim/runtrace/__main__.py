"""Traces recorded from real runs: a finished ``aurora real`` run folder as the simulator's inputs.

``python -m sim.runtrace RUN_DIR [--out DIR]`` writes the run's simulator inputs into
``RUN_DIR/sim/`` (or ``DIR``) and replays them once, printing the mean step time and tokens/s
after the warm-up.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from sim.runtrace.record import record_run, replay_config


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sim.runtrace RUN_DIR [--out DIR]``: record a run's trace and replay it."""
    p = argparse.ArgumentParser(prog="python -m sim.runtrace", description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a finished aurora real run folder (results/real/NAME-...)")
    p.add_argument("--out", default=None, help="where to write the trace (default RUN/sim)")
    args = p.parse_args(argv)
    try:
        dest = record_run(args.run, args.out)
        cfg = replay_config(dest)
    except ValueError as exc:
        print(f"sim.runtrace: {exc}", file=sys.stderr)
        return 2
    from sim.model import simulate

    s = simulate(cfg).summary(warmup=2)
    print(f"trace: {dest}/trace.yaml  topology: {dest}/topology.yaml  replay: {dest}/replay.json")
    print(
        f"replayed {cfg.strategy.name}: {s['steps']} steps, mean step {s['step_time_s']:.3f} s, "
        f"{s['tokens_per_s']:.1f} tokens/s (after 2 warm-up steps)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
