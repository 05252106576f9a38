"""Fig. 14: per-step policy transfer cost against link bandwidth, dense vs delta vs ideal RDMA.

The paper sweeps a tc-shaped link from 250 Mbit/s to 10 Gbit/s and times one policy transfer:
PrimeRL-Full's dense checkpoint, AuroraRL's delta, and an ideal 400 Gbit/s RDMA broadcast. Here
each point is :meth:`sim.model.Simulation.measure_fanout`: one published version, bytes ready,
through the strategy's whole transfer path (TCP streams, relay, last hop) to one Actor in a
remote region. The tc-shaped link has no loss and a 1 ms RTT (assumed: tc limits only the rate;
the paper's sweep ran between its own machines), so the rate, not TCP, is the limit.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pandas as pd

from aurora.topology import topology_from_dict
from aurora.traces import Quantity, Traces, load_traces
from experiments.common import (
    Claim,
    Point,
    experiment_main,
    fanout_measure,
    one,
)
from sim.config import SimConfig, strategy

NAME = "bandwidth_sweep"
measure = fanout_measure
BANDWIDTHS_GBPS = (0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SYSTEMS = {
    "Full (PrimeRL-Full)": "prime-full",
    "Delta (AuroraRL, LEB128)": "aurora-leb128",
    "Delta (AuroraRL, aurora codec)": "aurora",
    "Ideal RDMA 400 Gbps": "ideal-singledc",
}
PAPER = [
    ("Qwen3-8B Full at 10 Gbps (s)", "qwen3-8b", "Full (PrimeRL-Full)", 10.0, 17.3),
    ("Qwen3-8B Full at 250 Mbps (s)", "qwen3-8b", "Full (PrimeRL-Full)", 0.25, 566.0),
    ("Qwen3-8B Delta at 10 Gbps (s)", "qwen3-8b", "Delta (AuroraRL, LEB128)", 10.0, 0.25),
    ("Qwen3-8B ideal 400 Gbps RDMA broadcast (s)", "qwen3-8b", "Ideal RDMA 400 Gbps", 10.0, 0.32),
]
"""The numbers §6.6 states: (claim, model, system, Gbps, seconds)."""


def traces_with_400g_rdma() -> Traces:
    t = load_traces()
    rdma = Quantity(value=400, source="paper §6.6: an ideal 400 Gbps RDMA broadcast")
    return replace(t, constants=replace(t.constants, rdma_gbps=rdma))


def topology(model: str, gbps: float, gpus: int) -> dict:
    return {
        "name": f"tc-{gbps:g}g",
        "trainer": {"region": "us", "model": model, "gpus": gpus},
        "regions": [{"name": "us"}, {"name": "ca"}],
        "links": [{"a": "us", "b": "ca", "gbps": gbps, "rtt_ms": 1.0, "loss": 0.0}],
        "actors": [{"region": "ca", "gpu": "A100", "count": 1}],
    }


def points(full: bool = False) -> list[Point]:
    models = {"qwen3-4b": 2, "qwen3-8b": 4, "qwen3-14b": 6} if full else {"qwen3-8b": 4}
    traces = traces_with_400g_rdma()
    out = []
    for model, gpus in models.items():
        for gbps in BANDWIDTHS_GBPS:
            for system, name in SYSTEMS.items():
                cfg = SimConfig(
                    topology=topology_from_dict(topology(model, gbps, gpus), source=NAME),
                    traces=traces,
                    strategy=strategy(name),
                    steps=1,
                )
                out.append(Point(key={"model": model, "gbps": gbps, "system": system}, config=cfg))
    return out


def figure(rows: pd.DataFrame, path: Path) -> None:
    import matplotlib.pyplot as plt

    models = sorted(rows["model"].unique())
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        sub = rows[rows["model"] == model]
        for system in SYSTEMS:
            s = sub[sub["system"] == system].sort_values("gbps")
            ax.plot(s["gbps"], s["transfer_s"], marker="o", label=system)
        for _claim, m, _system, gbps, value in PAPER:
            if m == model:
                ax.scatter([gbps], [value], marker="x", s=80, color="black", zorder=5)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link bandwidth (Gbit/s)")
        ax.set_ylabel("policy transfer per step (s)")
        ax.set_title(f"{model}: transfer cost vs bandwidth")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].scatter([], [], marker="x", color="black", label="paper (Fig. 14)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def claims(rows: pd.DataFrame) -> list[Claim]:
    return [
        Claim(
            id=f"fig14.{m}.{system.split()[0].lower()}.{gbps:g}",
            where="§6.6 Fig. 14",
            text=claim,
            low=paper,
            high=paper,
            ours=one(rows, "transfer_s", model=m, system=system, gbps=gbps),
            # A 1 ms lossless link at a fixed rate: bytes / rate, nothing a model adds.
            kind="arithmetic",
        )
        for claim, m, system, gbps, paper in PAPER
    ]


def main(argv: list[str] | None = None) -> pd.DataFrame:
    return experiment_main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
