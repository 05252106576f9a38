"""Table 6: end-to-end throughput with and without relays, Trainer in Canada and eight Actors in
Australia (Qwen3-8B, 4 x H100 Trainer, A100 Actors).

Without a relay every Actor pulls each delta across the Pacific from the Trainer, sharing the
Trainer's WAN path; with one, the delta crosses once and a seed Actor forwards it cut-through.
The Canada-Australia path is assumed: 1 Gbit/s, 200 ms RTT, loss 1e-5 (the paper states none).
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

NAME = "relay"
PAPER_GAIN_PCT = {"gsm8k": 4.4, "deepscaler": 13.9}
LINK = {"a": "ca", "b": "au", "gbps": 1.0, "rtt_ms": 200, "loss": 1e-5}


def points(full: bool = False, steps: int | None = None) -> list[Point]:
    steps = steps or (60 if full else 15)
    topo = topology_from_dict(
        geo_topology(
            model="qwen3-8b",
            trainer_gpus=4,
            trainer_region="ca",
            actors=[("au", "A100", 8)],
            links=[LINK],
            name="canada-australia",
        ),
        source=NAME,
    )
    return paired_points(
        topo,
        column="relay",
        pairs=(("no relay", "aurora-norelay"), ("relay", "aurora")),
        workloads=PAPER_GAIN_PCT,
        steps=steps,
    )


def figure(rows: pd.DataFrame, path: Path) -> None:
    bar_figure(
        rows,
        x="workload",
        hue="relay",
        value="tokens_per_s",
        ylabel="throughput (tokens/s)",
        title="Table 6: Canada-Australia, Qwen3-8B",
        path=path,
    )


def claims(rows: pd.DataFrame) -> list[Claim]:
    return [
        gain_claim(
            rows,
            where="§6.3 Table 6",
            what="relay over no relay",
            column="relay",
            better="relay",
            baseline="no relay",
            workload=w,
            paper_pct=paper,
        )
        for w, paper in PAPER_GAIN_PCT.items()
    ]


def main(argv: list[str] | None = None) -> pd.DataFrame:
    return experiment_main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
