"""Table 8: tokens per dollar, AuroraRL on commodity GPUs vs Ideal-SingleDC on an RDMA cluster.

As in §6.9: 1 x H100 ~ 2 x A100 on this workload, so AuroraRL's 4 x H100 + 8 x A100 (Qwen3-8B)
compares with one 8 x H100 RDMA block and 6 x H100 + 12 x A100 (Qwen3-14B) rounds up to two.
Throughput is simulated (means after warm-up) on the paper's default deployment; Ideal-SingleDC
is the same job with the transfer at RDMA cost. Prices are inputs, each with its source.
"""

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
from sim.config import strategy

NAME = "cost"
PRICES_PER_GPU_HOUR = {
    "H100 RDMA": (39.0 / 16, "paper §1/Table 1: $39/h for 16 x H100 with RDMA (Hyperbolic)"),
    "H100": (31.0 / 16, "paper §1/Table 1: $31/h for 16 x H100 on commodity Ethernet (Hyperbolic)"),
    "A100": (1.29, "assumed: on-demand A100 list price of a GPU cloud (the paper gives none)"),
}
RDMA_BLOCKS = {"qwen3-8b": 1, "qwen3-14b": 2}
PAPER_GAIN = {"qwen3-8b": 1.21, "qwen3-14b": 1.59}


def dollars_per_hour(model: str, system: str) -> float:
    gpus, actors = MODELS[model]
    if system == "ideal-singledc":
        return RDMA_BLOCKS[model] * 8 * PRICES_PER_GPU_HOUR["H100 RDMA"][0]
    return gpus * PRICES_PER_GPU_HOUR["H100"][0] + actors * PRICES_PER_GPU_HOUR["A100"][0]


def points(full: bool = False, steps: int | None = None) -> list[Point]:
    steps = steps or (60 if full else 12)
    return [
        Point(
            key={"model": model, "system": name, "steps": steps, "warmup": WARMUP},
            config=summary_config(
                topology=deployment(model, *MODELS[model]),
                strategy=strategy(name),
                steps=steps,
            ),
        )
        for model in RDMA_BLOCKS
        for name in ("aurora-leb128", "ideal-singledc")
    ]


def _with_dollars(rows: pd.DataFrame) -> pd.DataFrame:
    rows = rows.copy()
    rows["dollars_per_hour"] = [
        dollars_per_hour(m, s) for m, s in zip(rows.model, rows.system, strict=True)
    ]
    rows["tokens_per_dollar"] = rows["tokens_per_s"] * 3600 / rows["dollars_per_hour"]
    return rows


def figure(rows: pd.DataFrame, path: Path) -> None:
    bar_figure(
        _with_dollars(rows),
        x="model",
        hue="system",
        value="tokens_per_dollar",
        ylabel="tokens per dollar",
        title="Table 8: cost-efficiency",
        path=path,
    )


def claims(rows: pd.DataFrame) -> list[Claim]:
    rows = _with_dollars(rows)
    out = []
    for model, paper in PAPER_GAIN.items():
        a = one(rows, "tokens_per_dollar", model=model, system="aurora-leb128")
        i = one(rows, "tokens_per_dollar", model=model, system="ideal-singledc")
        out.append(
            Claim(
                id=f"table8.tokens_per_dollar.{model}",
                where="§6.9 Table 8",
                text=f"tokens/$ AuroraRL over Ideal-SingleDC, {model} (x)",
                low=paper,
                high=paper,
                ours=a / i,
                # Equal throughputs: the ratio is the price ratio of the two deployments.
                kind="arithmetic",
                steady=steady(rows, model=model),
            )
        )
    return out


def main(argv: list[str] | None = None) -> pd.DataFrame:
    rows = experiment_main(sys.modules[__name__], argv)
    for name, (price, source) in PRICES_PER_GPU_HOUR.items():
        print(f"  price {name}: ${price:.3f}/GPU-h  ({source})")
    return rows


if __name__ == "__main__":
    main()
