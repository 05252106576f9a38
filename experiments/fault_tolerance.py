"""Fig. 13: throughput per step when a spot Actor is preempted at step 6 and a fresh Actor joins
at step 14 (Qwen3-4B, four A100 Actors in Canada, 2 x H100 Trainer in the US).

The preemption has no notice (the paper's Actor "aborts"); its leases expire back to the pool
and the survivors take them. The new Actor starts with nothing: snapshot plus delta chain from
the Checkpoint Store, then the version predicate admits it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

from aurora.topology import topology_from_dict
from aurora.traces import load_traces
from experiments.common import Claim, Point, experiment_main, geo_topology
from sim.config import Fault, SimConfig, strategy

NAME = "fault_tolerance"
PAPER = (
    ("fig13.before", "tokens/s before the preemption (steps 3-5)", 13_400, 13_400, (3, 5)),
    ("fig13.at", "tokens/s at the preemption step (6)", 4_700, 4_700, (6, 6)),
    ("fig13.three", "tokens/s with three Actors (steps 8-13)", 11_000, 12_000, (8, 13)),
    ("fig13.after", "tokens/s after the new Actor (steps 16+)", 13_500, 13_500, (16, 10**9)),
)
"""(id, claim, paper low, high, steps averaged)."""


def config(steps: int = 20, seed: int = 0) -> SimConfig:
    topo = geo_topology(
        model="qwen3-4b", trainer_gpus=2, actors=[("ca", "A100", 4)], name="us-canada-spot"
    )
    topo["actors"][0]["spot"] = True
    return SimConfig(
        topology=topology_from_dict(topo, source=NAME),
        traces=load_traces(),
        strategy=strategy("aurora-leb128"),
        steps=steps,
        seed=seed,
        record_trace=False,
        faults=(
            Fault(kind="preempt", target="ca-a100-3", at_step=6),
            Fault(kind="join", target="ca-new-0", region="ca", gpu="A100", at_step=14),
        ),
    )


def points(full: bool = False) -> list[Point]:
    steps = 30 if full else 20
    return [Point(key={"steps": steps, "seed": 0}, config=config(steps=steps))]


def measure(cfg: SimConfig) -> dict[str, object]:
    """Tokens/s averaged over the steps of each claim, and every step's (JSON, for the figure)."""
    from sim.model import simulate

    rows = simulate(cfg).rows
    tps = {r["step"]: r["tokens_per_s"] for r in rows}
    out: dict[str, object] = {}
    for cid, _text, _low, _high, (a, b) in PAPER:
        values = [v for s, v in tps.items() if a <= s <= b]
        out[cid] = sum(values) / len(values)
    out["tokens_per_s_by_step"] = json.dumps(tps)
    return out


def figure(rows: pd.DataFrame, path: Path) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    tps = {int(k): v for k, v in json.loads(rows["tokens_per_s_by_step"].iloc[0]).items()}
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.plot(list(tps), list(tps.values()), marker="o", label="AuroraRL (simulated)")
    ax.axvline(6, color="red", ls=":", label="preemption (step 6)")
    ax.axvline(14, color="green", ls=":", label="new Actor (step 14)")
    for step, value in ((5, 13_400), (6, 4_700), (10, 11_500), (16, 13_500)):
        ax.scatter([step], [value], marker="x", color="black", zorder=5)
    ax.scatter([], [], marker="x", color="black", label="paper (Fig. 13, read from text)")
    ax.set(xlabel="training step", ylabel="throughput (tokens/s)", title="Fig. 13: Qwen3-4B")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def claims(rows: pd.DataFrame) -> list[Claim]:
    row = rows.iloc[0]
    return [
        Claim(
            id=cid,
            where="§6.5 Fig. 13",
            text=text,
            low=low,
            high=high,
            ours=float(row[cid]),
            kind="mechanism",
        )
        for cid, text, low, high, _steps in PAPER
    ]


def main(argv: list[str] | None = None) -> pd.DataFrame:
    return experiment_main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
