"""Fig. 16: throughput as Actors are added mid-run, 1 -> 2 -> 3 -> 4 (Qwen3-4B, batch 512,
2 x H100 Trainer in the US, A100 Actors in Canada).

The batch stays 512 rollouts; each new Actor joins with nothing, catches up from a snapshot and
the chain (80-130 s here: longer than a step), and the proportional split spreads the same batch
over more Actors. A step is labelled by the Actors that actually returned rollouts for it (its
``shares``), not by the joins scheduled before it; a label's throughput is the mean over its
steps after the first (the first mixes in the step the newcomer started in).
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

NAME = "scalability"
PAPER = {1: 5_600, 2: 9_300, 3: 11_500, 4: 13_500}
"""Fig. 16: tokens/s with 1..4 Actors."""


def config(phase: int = 8) -> SimConfig:
    topo = geo_topology(model="qwen3-4b", trainer_gpus=2, actors=[("ca", "A100", 1)])
    joins = tuple(
        Fault(kind="join", target=f"ca-new-{i}", region="ca", gpu="A100", at_step=phase * i)
        for i in (1, 2, 3)
    )
    return SimConfig(
        topology=topology_from_dict(topo, source=NAME),
        traces=load_traces(),
        strategy=strategy("aurora-leb128"),
        steps=5 * phase,
        batch_rollouts=512,
        faults=joins,
        record_trace=False,
    )


def points(full: bool = False) -> list[Point]:
    phase = 20 if full else 12
    return [Point(key={"phase": phase}, config=config(phase))]


def working(shares: str) -> int:
    """Actors that returned rollouts for a step (from its ``shares`` column)."""
    return sum(1 for n in json.loads(shares).values() if n > 0)


def measure(cfg: SimConfig) -> dict[str, object]:
    from sim.model import simulate

    rows = simulate(cfg).rows
    steps = [
        {"step": r["step"], "tokens_per_s": r["tokens_per_s"], "actors": working(r["shares"])}
        for r in rows
    ]
    out: dict[str, object] = {"steps_json": json.dumps(steps)}
    for n in PAPER:
        settled = [
            s["tokens_per_s"]
            for prev, s in zip(steps, steps[1:], strict=False)
            if s["actors"] == n and prev["actors"] == n
        ]
        out[f"tokens_per_s_{n}"] = sum(settled) / len(settled) if settled else float("nan")
        out[f"steps_with_{n}"] = len(settled)
    return out


def figure(rows: pd.DataFrame, path: Path) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = pd.DataFrame(json.loads(rows["steps_json"].iloc[0]))
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.plot(steps["step"], steps["tokens_per_s"], marker="o", label="AuroraRL (simulated)")
    for n, value in PAPER.items():
        mine = steps[steps["actors"] == n]["step"]
        if len(mine):
            ax.hlines(value, mine.min(), mine.max(), colors="black", linestyles=":")
            ax.text(mine.min(), value * 1.02, f"{n} working", fontsize=7)
    ax.plot([], [], ":", color="black", label="paper (Fig. 16), over the steps with n Actors")
    ax.set(
        xlabel="training step",
        ylabel="throughput (tokens/s)",
        title="Fig. 16: Actors added mid-run (1 -> 4)",
    )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def claims(rows: pd.DataFrame) -> list[Claim]:
    row = rows.iloc[0]
    out = [
        Claim(
            id=f"fig16.actors.{n}",
            where="§6.8 Fig. 16",
            text=f"tokens/s with {n} Actor(s) working",
            low=v,
            high=v,
            ours=float(row[f"tokens_per_s_{n}"]),
            # One Actor is generation-bound: its tokens/s is the assumed A100 rate (6K).
            kind="input" if n == 1 else "mechanism",
        )
        for n, v in PAPER.items()
    ]
    out.append(
        Claim(
            id="fig16.total_gain",
            where="§6.8 Fig. 16",
            text="gain from 1 to 4 Actors (x)",
            low=2.4,
            high=2.4,
            ours=float(row["tokens_per_s_4"]) / float(row["tokens_per_s_1"]),
            kind="mechanism",
        )
    )
    return out


def main(argv: list[str] | None = None) -> pd.DataFrame:
    return experiment_main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
