"""A held-out validation of the simulator against real runs: predictions written first, the real
runs made afterwards (issue 27).

    python -m experiments.heldout predict                 # writes evidence/heldout/predictions.csv
    python -m experiments.heldout run --seeds 0,1,2       # root, an idle machine: the real runs
    python -m experiments.heldout table                   # predictions beside the runs, misses

Theory of operation
-------------------
``sim_vs_real`` replays each run from inputs recorded in that same run, on configurations that
were also used while the replay options were developed: a match there is partly circular. Here
the simulator predicts configurations it has not been compared on, from inputs recorded in
*other* runs: the committed traces of the base stand-in runs over the emulated US-Canada link
(``evidence/sim_vs_real/traces/``: 2 Actors, 12 prompts x 4 a step, 1 Gbit/s x 0.00143,
40 ms), each changed only where the held-out case differs, by the case's own configuration:

======================  =========================================================================
case                    what differs from the base (aurora and prime-full unless said)
======================  =========================================================================
``link``                the emulated rate x 2.5 (x 0.00358) and the RTT 80 ms
``actors``              4 Actors and 24 prompts a step (the same 24 rollouts per Actor)
``norelay``             aurora without the relay in ca (every Actor pulls across the link), and
                        aurora with it, on the base configuration, as the pair to compare
======================  =========================================================================

The replay options in force are those of ``sim_vs_real`` at the commit that wrote the
predictions (including the measured wire efficiency, ``evidence/wire_overhead.json``); the file
records that commit. ``predict`` must run, and be committed, before ``run``: no option may be
added after a held-out miss without a new held-out set. ``run`` makes the real runs through
``sim_vs_real`` (each also replayed from its own recording, as there), and ``table`` reports the
prediction, the replay and the real value side by side, with every miss.

The stand-in backend (generation paced at a fixed rate, not CPU-bound) keeps the inputs the same
between the base runs and the held-out ones; the tiny Qwen3's generation rate depends on what
else the cores do, which a prediction from another run cannot know.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from aurora.provenance import git_sha
from experiments import sim_vs_real, wire_overhead

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "evidence" / "sim_vs_real" / "traces"
"""The base runs' recorded simulator inputs (``sim/`` of each run folder), one folder a
strategy: ``aurora`` and ``prime-full``."""
PREDICTIONS = ROOT / "evidence" / "heldout" / "predictions.csv"
BASE_SCALE = wire_overhead.SCALES["standin"]
CASES: dict[str, dict[str, Any]] = {
    "link": {
        "strategies": ("aurora", "prime-full"),
        "rate_factor": 2.5,
        "rtt_ms": 80.0,
        "actors": 2,
        "prompts_per_step": 12,
    },
    "actors": {
        "strategies": ("aurora", "prime-full"),
        "rate_factor": 1.0,
        "rtt_ms": 40.0,
        "actors": 4,
        "prompts_per_step": 24,
    },
    "norelay": {
        "strategies": ("aurora-norelay", "aurora"),
        "rate_factor": 1.0,
        "rtt_ms": 40.0,
        "actors": 2,
        "prompts_per_step": 12,
    },
}
"""Each held-out case: what differs from the base runs (see the module docstring)."""
STEPS = 8
GROUP = 4


def _base(strategy: str) -> str:
    return "aurora" if strategy.startswith("aurora") else strategy


def predicted_config(case: str, strategy: str, traces: Path = TRACES) -> Any:
    """The simulator configuration predicting ``strategy`` in held-out ``case``: the base
    run's replay with only the case's differences applied."""
    from sim.config import strategy as named
    from sim.runtrace import replay_config

    spec = CASES[case]
    cfg = replay_config(traces / _base(strategy), record_trace=True)
    efficiency = wire_overhead.load()
    if efficiency is not None:
        cfg = sim_vs_real.payload_rate(cfg, efficiency)
    topo = cfg.topology
    links = tuple(
        dataclasses.replace(lk, gbps=lk.gbps * spec["rate_factor"], rtt_ms=spec["rtt_ms"])
        for lk in topo.links
    )
    actors = tuple(dataclasses.replace(g, count=spec["actors"]) for g in topo.actors)
    topo = dataclasses.replace(topo, links=links, actors=actors)
    return dataclasses.replace(
        cfg,
        topology=topo,
        strategy=named(strategy),
        steps=STEPS,
        batch_rollouts=spec["prompts_per_step"] * GROUP,
        rate_schedules=(),
    )


def predict(traces: Path = TRACES) -> pd.DataFrame:
    """One row per (case, strategy): the predicted step time, tokens/s and transfer per delta
    (the same definitions and warm-up as ``sim_vs_real``)."""
    from sim.model import simulate

    rows = []
    for case, spec in CASES.items():
        for strategy in spec["strategies"]:
            result = simulate(predicted_config(case, strategy, traces))
            sim = pd.DataFrame(result.rows)
            transfers = sim_vs_real.sim_transfers(result)
            after = [t for v, t in transfers.items() if v > sim_vs_real.WARMUP]
            rows.append(
                {
                    "case": case,
                    "strategy": strategy,
                    "pred_step_time_s": sim_vs_real._mean_after(sim, "step_time_s"),
                    "pred_tokens_per_s": sim_vs_real._throughput(sim),
                    "pred_transfer_s": statistics.fmean(after) if after else float("nan"),
                    "rate_factor": spec["rate_factor"],
                    "rtt_ms": spec["rtt_ms"],
                    "actors": spec["actors"],
                    "prompts_per_step": spec["prompts_per_step"],
                    "wire_efficiency": wire_overhead.load(),
                    "git_sha": git_sha(),
                }
            )
    return pd.DataFrame(rows)


def points(seeds: Sequence[int]) -> list[sim_vs_real.Point]:
    """The real held-out runs (stand-in backend, emulated link)."""
    return [
        sim_vs_real.Point(
            part=f"heldout-{case}",
            network="emulated",
            strategy=strategy,
            seed=seed,
            backend="standin",
            steps=STEPS,
            actors=spec["actors"],
            prompts_per_step=spec["prompts_per_step"],
            extra={"standin_tokens_per_s": sim_vs_real.STANDIN_TOKENS_PER_S},
            rtt_ms=spec["rtt_ms"],
            scale=BASE_SCALE * spec["rate_factor"],
        )
        for case, spec in CASES.items()
        for seed in seeds
        for strategy in spec["strategies"]
    ]


def table(rows: pd.DataFrame, predictions: pd.DataFrame) -> pd.DataFrame:
    """Per case and strategy: the prediction, the mean replay and the mean real value over the
    seeds, and the prediction's and the replay's error against the real runs."""
    rows = rows.assign(case=rows["part"].str.removeprefix("heldout-"))
    out = []
    for (case, strategy), g in rows.groupby(["case", "strategy"], sort=False):
        pred = predictions[(predictions.case == case) & (predictions.strategy == strategy)]
        for metric in ("step_time_s", "tokens_per_s", "transfer_s"):
            real = float(g[f"real_{metric}"].mean())
            replay = float(g[f"sim_{metric}"].mean())
            p = float(pred[f"pred_{metric}"].iloc[0]) if len(pred) else float("nan")
            out.append(
                {
                    "case": case,
                    "strategy": strategy,
                    "metric": metric,
                    "seeds": len(g),
                    "real": real,
                    "predicted": p,
                    "pred_error": p / real - 1,
                    "replay": replay,
                    "replay_error": replay / real - 1,
                }
            )
    return pd.DataFrame(out)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("what", choices=("predict", "run", "table"))
    p.add_argument("--seeds", default="0,1,2", help="seeds of the real held-out runs")
    p.add_argument("--out", default="results", help="results root of the real runs")
    args = p.parse_args(argv)
    if args.what == "predict":
        got = predict()
        PREDICTIONS.parent.mkdir(parents=True, exist_ok=True)
        got.to_csv(PREDICTIONS, index=False)
        print(got.to_string(index=False, float_format="%.4g"))
        print(f"predictions: {PREDICTIONS} (commit them before any held-out run)")
        return
    root = Path(args.out)
    if args.what == "run":
        efficiency = wire_overhead.load()
        pts = points([int(s) for s in args.seeds.split(",")])
        sim_vs_real.run_points(pts, root, wire_efficiency=efficiency)
    rows = pd.read_csv(root / sim_vs_real.NAME / "rows.csv")
    rows = rows[rows["part"].astype(str).str.startswith("heldout-")]
    got = table(rows, pd.read_csv(PREDICTIONS))
    out = root / "heldout" / "table.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    got.to_csv(out, index=False)
    print(got.to_string(index=False, float_format="%.4g"))
    print(f"table: {out}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
