"""Fig. 12: end-to-end throughput gain of four parallel TCP streams over one, with sparse deltas
in place (Qwen3-8B and Qwen3-14B, the paper's default US-Canada deployment)."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from experiments.common import (
    WARMUP,
    Claim,
    Point,
    bar_figure,
    experiment_main,
    one,
    steady,
    summary_config,
)
from experiments.throughput import MODELS, deployment
from sim.config import replace_strategy, strategy

NAME = "streaming"
PAPER_GAIN_PCT = {
    ("qwen3-8b", "gsm8k"): 8.2,
    ("qwen3-8b", "deepscaler"): 11.7,
    ("qwen3-14b", "gsm8k"): 12.4,
    ("qwen3-14b", "deepscaler"): 16.3,
}


def points(full: bool = False, steps: int | None = None) -> list[Point]:
    steps = steps or (60 if full else 12)
    out = []
    for model, workload in PAPER_GAIN_PCT:
        for streams in (1, 4):
            strat = replace_strategy(
                strategy("aurora-leb128"), streams=streams, name=f"aurora-leb128-s{streams}"
            )
            cfg = summary_config(
                topology=deployment(model, *MODELS[model]),
                strategy=strat,
                steps=steps,
                workload=workload,
            )
            out.append(
                Point(
                    key={
                        "model": model,
                        "workload": workload,
                        "streams": streams,
                        "steps": steps,
                        "warmup": WARMUP,
                    },
                    config=cfg,
                )
            )
    return out


def figure(rows: pd.DataFrame, path: Path) -> None:
    rows = rows.copy()
    rows["case"] = rows["model"] + " " + rows["workload"]
    rows["S"] = rows["streams"].map(lambda s: f"S={s}")
    bar_figure(
        rows,
        x="case",
        hue="S",
        value="tokens_per_s",
        ylabel="throughput (tokens/s)",
        title="Fig. 12: one vs four TCP streams",
        path=path,
    )


def claims(rows: pd.DataFrame) -> list[Claim]:
    out = []
    for (model, workload), paper in PAPER_GAIN_PCT.items():
        four = one(rows, "tokens_per_s", model=model, workload=workload, streams=4)
        single = one(rows, "tokens_per_s", model=model, workload=workload, streams=1)
        out.append(
            Claim(
                id=f"fig12.streams.{model}.{workload}",
                where="§6.3 Fig. 12",
                text=f"4 streams over 1, end to end, {model} {workload} (%)",
                low=paper,
                high=paper,
                ours=100 * (four / single - 1),
                kind="mechanism",
                steady=steady(rows, model=model, workload=workload),
            )
        )
    return out


def main(argv: list[str] | None = None) -> pd.DataFrame:
    return experiment_main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
