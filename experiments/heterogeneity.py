"""Table 7: uniform vs throughput-proportional allocation on a mixed pool (Qwen3-4B, 4 x H100
Trainer in Canada, 4 x A100 + 4 x L40 Actors in the US).

``aurora-uniform`` sends no throughput observations to the Ledger, so every Actor keeps the
same prior and gets the same share; ``aurora`` learns each Actor's rate by EMA and splits the
batch in proportion.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from aurora.topology import topology_from_dict
from experiments.common import (
    Claim,
    Point,
    bar_figure,
    experiment_main,
    gain_claim,
    geo_topology,
    paired_points,
)

NAME = "heterogeneity"
PAPER_GAIN_PCT = {"gsm8k": 35.5, "deepscaler": 26.4}
"""Table 7: proportional over uniform, end-to-end."""


def points(full: bool = False, steps: int | None = None) -> list[Point]:
    steps = steps or (60 if full else 15)
    topo = topology_from_dict(
        geo_topology(
            model="qwen3-4b",
            trainer_gpus=4,
            trainer_region="ca",
            actors=[("us", "A100", 4), ("us", "L40", 4)],
            name="canada-us-mixed",
        ),
        source=NAME,
    )
    return paired_points(
        topo,
        column="allocation",
        pairs=(("uniform", "aurora-uniform"), ("proportional", "aurora")),
        workloads=PAPER_GAIN_PCT,
        steps=steps,
    )


def figure(rows: pd.DataFrame, path: Path) -> None:
    bar_figure(
        rows,
        x="workload",
        hue="allocation",
        value="tokens_per_s",
        ylabel="throughput (tokens/s)",
        title="Table 7: mixed A100 + L40 pool",
        path=path,
    )


def claims(rows: pd.DataFrame) -> list[Claim]:
    return [
        gain_claim(
            rows,
            where="§6.4 Table 7",
            what="proportional over uniform",
            column="allocation",
            better="proportional",
            baseline="uniform",
            workload=w,
            paper_pct=paper,
        )
        for w, paper in PAPER_GAIN_PCT.items()
    ]


def main(argv: list[str] | None = None) -> pd.DataFrame:
    return experiment_main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
