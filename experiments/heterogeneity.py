"""Table 7: uniform vs throughput-proportional allocation on a mixed pool (Qwen3-4B, 4 x H100
Trainer in Canada, 4 x A100 + 4 x L40 Actors in the US).

``aurora-uniform`` sends no throughput observations to the Ledger, so every Actor keeps the
same prior and gets the same share; ``aurora`` learns each Actor's rate by EMA and splits the
batch in proportion.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from aurora.topology import topology_from_dict
from experiments.common import (
    RESULTS,
    Point,
    bar_figure,
    compare,
    geo_topology,
    one,
    parser,
    run_points,
    summary_measure,
)
from sim.config import SimConfig, strategy
from sim.traces import load_traces

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
    return [
        Point(
            key={"workload": w, "allocation": alloc, "steps": steps},
            config=SimConfig(
                topology=topo,
                traces=load_traces(),
                strategy=strategy(name),
                steps=steps,
                workload=w,
                record_trace=False,
            ),
        )
        for w in PAPER_GAIN_PCT
        for alloc, name in (("uniform", "aurora-uniform"), ("proportional", "aurora"))
    ]


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = parser(__doc__.split("\n\n")[0]).parse_args(argv)
    root = Path(args.out) if args.out else RESULTS
    rows = run_points(NAME, points(args.full), summary_measure, root=root)
    bar_figure(
        rows,
        x="workload",
        hue="allocation",
        value="tokens_per_s",
        ylabel="throughput (tokens/s)",
        title="Table 7: mixed A100 + L40 pool",
        path=root / NAME / f"{NAME}.png",
    )
    table = []
    for w, paper in PAPER_GAIN_PCT.items():
        prop = one(rows, "tokens_per_s", workload=w, allocation="proportional")
        uni = one(rows, "tokens_per_s", workload=w, allocation="uniform")
        table.append((f"proportional over uniform, {w} (%)", paper, 100 * (prop / uni - 1)))
    print(compare(table))
    print(f"rows: {root / NAME / 'rows.csv'}  figure: {root / NAME / (NAME + '.png')}")
    return rows


if __name__ == "__main__":
    main()
