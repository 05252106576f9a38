"""Fig. 16: throughput as Actors are added mid-run, 1 -> 2 -> 3 -> 4 (Qwen3-4B, batch 512,
2 x H100 Trainer in the US, A100 Actors in Canada).

The batch stays 512 rollouts; each new Actor joins with nothing, catches up from a snapshot and
the chain, and the proportional split spreads the same batch over more Actors.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from aurora.topology import topology_from_dict  # noqa: E402
from experiments.common import (  # noqa: E402
    compare,
    geo_topology,
    parser,
    results_root,
    written,
)
from sim.config import Fault, SimConfig, strategy  # noqa: E402
from sim.model import simulate  # noqa: E402
from sim.output import provenance  # noqa: E402
from sim.traces import load_traces  # noqa: E402

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
        steps=4 * phase,
        batch_rollouts=512,
        faults=joins,
    )


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = parser(__doc__.split("\n\n")[0]).parse_args(argv)
    root = results_root(args)
    phase = 20 if args.full else 8
    cfg = config(phase)
    out = root / NAME
    out.mkdir(parents=True, exist_ok=True)
    rows = pd.DataFrame(simulate(cfg).rows)
    rows["actors"] = 1 + (rows["step"] - 1) // phase
    for k, v in provenance(cfg).items():
        rows[k if k != "actors" else "initial_actors"] = v
    rows.to_csv(out / "rows.csv", index=False)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.plot(rows["step"], rows["tokens_per_s"], marker="o", label="AuroraRL (simulated)")
    for n, value in PAPER.items():
        ax.hlines(value, phase * (n - 1) + 1, phase * n, colors="black", linestyles=":")
    ax.plot([], [], ":", color="black", label="paper (Fig. 16)")
    ax.set(
        xlabel="training step",
        ylabel="throughput (tokens/s)",
        title="Fig. 16: Actors added mid-run (1 -> 4)",
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{NAME}.png", dpi=150)
    plt.close(fig)
    # Settled phase: the last half of each phase's steps.
    settled = rows[(rows["step"] - 1) % phase >= phase // 2]
    ours = settled.groupby("actors")["tokens_per_s"].mean()
    print(compare([(f"tokens/s with {n} Actor(s)", PAPER[n], ours[n]) for n in PAPER]))
    print(written(root, NAME))
    return rows


if __name__ == "__main__":
    main()
