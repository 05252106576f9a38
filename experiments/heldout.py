"""A held-out validation of the simulator against real runs: predictions written first, the real
runs made afterwards.

    python -m experiments.heldout predict [--set S]           # writes the set's predictions
    python -m experiments.heldout run --seeds 0,1,2 [--set S] # root, an idle machine: real runs
    python -m experiments.heldout table [--set S]             # predictions beside the runs

Theory of operation
-------------------
``sim_vs_real`` replays each run from inputs recorded in that same run: a match there is partly
circular. Here the simulator predicts configurations it has not been compared on, from inputs
recorded in *other* runs (a set's base traces), each changed only where the held-out case differs
(:data:`SETS`). ``predict`` must run, and be committed, before ``run``: no option may be added
after a held-out miss without a new held-out set. ``table`` reports the prediction, the replay and
the real value side by side, with every miss."""

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
from experiments.common import plain

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "evidence" / "sim_vs_real" / "traces"
"""The stand-in set's base runs' recorded simulator inputs (``sim/`` of each run folder), one
folder a strategy: ``aurora`` and ``prime-full``."""
PREDICTIONS = ROOT / "evidence" / "heldout" / "predictions.csv"
GROUP = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeldOutSet:
    """One held-out set: its base inputs, its cases and where its predictions are kept."""

    name: str
    """``standin`` or ``rl``."""
    backend: str
    """The real runs' backend (``sim_vs_real``'s ``standin`` or ``rl``)."""
    traces: Path
    """The base runs' recorded inputs, one folder a strategy."""
    predictions: Path
    """The committed predictions (CSV)."""
    scale: float
    """The base runs' emulated link scale (a case's rate factor multiplies it)."""
    steps: int
    """Steps of every held-out run."""
    prefix: str
    """The real runs' ``part`` is this plus the case's name."""
    cases: dict[str, dict[str, Any]]
    """Each case: its strategies, rate factor, RTT (ms), Actors and prompts a step."""
    superseded: str | None = None
    """None: the predictions are what this tree's simulator predicts (a test recomputes
    them). Else the simulator change after which they were made: they stand as written, at
    the commit their file records, and are not recomputed."""


def _case(strategies: tuple[str, ...], **changes: Any) -> dict[str, Any]:
    base = {"rate_factor": 1.0, "rtt_ms": 40.0, "actors": 2, "prompts_per_step": 12}
    return {"strategies": strategies, **base, **changes}


_STAGED_ONCE = (
    "the simulator charged an Actor's DeltaStaged report the control delay twice (found with "
    "the stand-in set's transfer miss; fixed after these predictions)"
)

SETS: dict[str, HeldOutSet] = {
    "standin": HeldOutSet(
        name="standin",
        backend="standin",
        traces=TRACES,
        predictions=PREDICTIONS,
        scale=wire_overhead.SCALES["standin"],
        steps=8,
        prefix="heldout-",
        cases={
            "link": _case(("aurora", "prime-full"), rate_factor=2.5, rtt_ms=80.0),
            "actors": _case(("aurora", "prime-full"), actors=4, prompts_per_step=24),
            "norelay": _case(("aurora-norelay", "aurora")),
        },
        superseded=_STAGED_ONCE,
    ),
    "rl": HeldOutSet(
        name="rl",
        backend="rl",
        traces=ROOT / "evidence" / "heldout" / "base-rl",
        predictions=ROOT / "evidence" / "heldout" / "predictions-rl.csv",
        scale=0.005712453842051281,  # the base runs' link_scale (emulation.json)
        steps=12,
        prefix="heldout-rl-",
        cases={
            "link": _case(("aurora", "prime-full"), rate_factor=2.5, rtt_ms=80.0),
            "actors3": _case(("aurora", "prime-full"), actors=3, prompts_per_step=18),
            "norelay": _case(("aurora-norelay",)),
        },
        superseded=_STAGED_ONCE,
    ),
    "standin2": HeldOutSet(
        name="standin2",
        backend="standin",
        traces=TRACES,
        predictions=ROOT / "evidence" / "heldout" / "predictions-standin2.csv",
        scale=wire_overhead.SCALES["standin"],
        steps=8,
        prefix="heldout3-",
        cases={
            "slow": _case(("aurora", "prime-full"), rate_factor=0.5, rtt_ms=20.0),
            "actors3": _case(("aurora", "prime-full"), actors=3, prompts_per_step=18),
        },
    ),
    "rl2": HeldOutSet(
        name="rl2",
        backend="rl",
        traces=ROOT / "evidence" / "heldout" / "base-rl",
        predictions=ROOT / "evidence" / "heldout" / "predictions-rl2.csv",
        scale=0.005712453842051281,
        steps=12,
        prefix="heldout3-rl-",
        cases={
            "rtt120": _case(("aurora", "prime-full"), rtt_ms=120.0),
            "slow": _case(("aurora", "prime-full"), rate_factor=0.5),
        },
    ),
}
"""The held-out sets, each predicted and committed before its runs.

``standin``: the base is the stand-in runs over the emulated US-Canada link
(``evidence/sim_vs_real/traces/``: 2 Actors, 12 prompts x 4 a step, 1 Gbit/s x 0.00143, 40 ms;
generation paced at a fixed rate, so the inputs are the same in the base and held-out runs).

``rl``: the base is the idle-machine rl runs of seed 0 (``evidence/heldout/base-rl/``: the tiny
Qwen3 trained by GRPO, 2 Actors, 12 prompts x 4, 1 Gbit/s x 0.00571, 40 ms). Its cases are
configurations the rl runs were never compared on. What a prediction cannot know: the held-out
run's own delta sizes (its training differs where its batch does) and generation rate (the cores
are shared by the Actors).

``standin2`` and ``rl2``: the same bases, new configurations.

==================  ========  =================================================================
case                set       what differs from the base (aurora and prime-full unless said)
==================  ========  =================================================================
``link``            standin,  the emulated rate x 2.5 and the RTT 80 ms
                    rl
``actors``          standin   4 Actors and 24 prompts a step (the same 24 rollouts per Actor)
``actors3``         rl,       3 Actors and 18 prompts a step (the same 24 rollouts per Actor)
                    standin2
``norelay``         standin,  aurora without the relay in ca (every Actor pulls across the
                    rl        link); standin also reruns aurora with it, as the pair to compare
``slow``            standin2  the emulated rate x 0.5 and the RTT 20 ms
``slow``            rl2       the emulated rate x 0.5
``rtt120``          rl2       the RTT 120 ms
==================  ========  =================================================================

A set whose predictions were made before a later simulator change is marked ``superseded``: its
predictions stand as written (at the commit the file records) and its table still compares
them with its runs, but this tree no longer recomputes them."""
CASES = SETS["standin"].cases
"""The stand-in set's cases."""


def _base(strategy: str) -> str:
    return "aurora" if strategy.startswith("aurora") else strategy


def predicted_config(case: str, strategy: str, hset: HeldOutSet = SETS["standin"]) -> Any:
    """The simulator configuration predicting ``strategy`` in held-out ``case`` of ``hset``:
    the base run's replay with only the case's differences applied."""
    from sim.config import strategy as named
    from sim.runtrace.record import replay_config

    spec = hset.cases[case]
    cfg = replay_config(hset.traces / _base(strategy), record_trace=True)
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
        steps=hset.steps,
        batch_rollouts=spec["prompts_per_step"] * GROUP,
        rate_schedules=(),
    )


def predict(hset: HeldOutSet = SETS["standin"]) -> pd.DataFrame:
    """One row per (case, strategy): the predicted step time, tokens/s and transfer per delta
    (the same definitions and warm-up as ``sim_vs_real``).

    The replay options in force are those of ``sim_vs_real`` at the commit that wrote the
    predictions (including the measured wire efficiency, ``evidence/wire_overhead.json``); each
    file records that commit.
    """
    from sim.model import simulate

    rows = []
    for case, spec in hset.cases.items():
        for strategy in spec["strategies"]:
            result = simulate(predicted_config(case, strategy, hset))
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


def points(seeds: Sequence[int], hset: HeldOutSet = SETS["standin"]) -> list[sim_vs_real.Point]:
    """The real held-out runs of ``hset`` (emulated link).

    ``run`` makes the real runs through ``sim_vs_real`` (each also replayed from its own
    recording, as there).
    """
    extra = (
        {"standin_tokens_per_s": sim_vs_real.STANDIN_TOKENS_PER_S}
        if hset.backend == "standin"
        else {}
    )
    return [
        sim_vs_real.Point(
            part=f"{hset.prefix}{case}",
            network="emulated",
            strategy=strategy,
            seed=seed,
            backend=hset.backend,
            steps=hset.steps,
            actors=spec["actors"],
            prompts_per_step=spec["prompts_per_step"],
            extra=extra,
            rtt_ms=spec["rtt_ms"],
            scale=hset.scale * spec["rate_factor"],
        )
        for case, spec in hset.cases.items()
        for seed in seeds
        for strategy in spec["strategies"]
    ]


def set_rows(rows: pd.DataFrame, hset: HeldOutSet) -> pd.DataFrame:
    """The rows of ``hset``'s runs among ``sim_vs_real``'s, with their case named."""
    mine = rows["backend"].astype(str).eq(hset.backend) & rows["part"].astype(str).isin(
        [f"{hset.prefix}{c}" for c in hset.cases]
    )
    return rows[mine].assign(case=rows.loc[mine, "part"].str.removeprefix(hset.prefix))


def table(rows: pd.DataFrame, predictions: pd.DataFrame) -> pd.DataFrame:
    """Per case and strategy (``rows`` of one set, their ``case`` named): the prediction, the
    mean replay and the mean real value over the seeds, and the prediction's and the replay's
    error against the real runs."""
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
    p = argparse.ArgumentParser(description=plain((__doc__ or "").split("\n\n")[0]))
    p.add_argument(
        "what",
        choices=("predict", "run", "table"),
        help="predict: write the set's predictions from its base runs; run: make the held-out "
        "real runs; table: compare the runs with the predictions",
    )
    p.add_argument("--set", default="standin", choices=sorted(SETS), help="the held-out set")
    p.add_argument("--seeds", default="0,1,2", help="seeds of the real held-out runs")
    p.add_argument("--out", default="results", help="results root of the real runs")
    args = p.parse_args(argv)
    hset = SETS[args.set]
    if args.what == "predict":
        got = predict(hset)
        hset.predictions.parent.mkdir(parents=True, exist_ok=True)
        got.to_csv(hset.predictions, index=False)
        print(got.to_string(index=False, float_format="%.4g"))
        print(f"predictions: {hset.predictions} (commit them before any held-out run)")
        return
    root = Path(args.out)
    if args.what == "run":
        efficiency = wire_overhead.load()
        pts = points([int(s) for s in args.seeds.split(",")], hset)
        sim_vs_real.run_points(pts, root, wire_efficiency=efficiency)
    rows = set_rows(pd.read_csv(root / sim_vs_real.NAME / "rows.csv"), hset)
    got = table(rows, pd.read_csv(hset.predictions))
    out = root / "heldout" / f"table-{hset.name}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    got.to_csv(out, index=False)
    print(got.to_string(index=False, float_format="%.4g"))
    print(f"table: {out}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
