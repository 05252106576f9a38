"""Fig. 13: throughput per step when a spot Actor is preempted at step 6 and a fresh Actor joins
at step 14 (Qwen3-4B, four A100 Actors in Canada, 2 x H100 Trainer in the US).

The preemption has no notice (the paper's Actor "aborts"); its leases expire back to the pool
and the survivors take them. The new Actor starts with nothing: snapshot plus delta chain from
the Checkpoint Store, then the version predicate admits it.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from aurora.topology import topology_from_dict  # noqa: E402
from experiments.common import (  # noqa: E402
    compare_ranges,
    geo_topology,
    parser,
    results_root,
    written,
)
from sim.config import Fault, SimConfig, strategy  # noqa: E402
from sim.model import simulate  # noqa: E402
from sim.output import provenance  # noqa: E402
from sim.traces import load_traces  # noqa: E402

NAME = "fault_tolerance"


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
        faults=(
            Fault(kind="preempt", target="ca-a100-3", at_step=6),
            Fault(kind="join", target="ca-new-0", region="ca", gpu="A100", at_step=14),
        ),
    )


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = parser(__doc__.split("\n\n")[0]).parse_args(argv)
    root = results_root(args)
    cfg = config(steps=30 if args.full else 20)
    out = root / NAME
    out.mkdir(parents=True, exist_ok=True)
    result = simulate(cfg)
    rows = pd.DataFrame(result.rows)
    for k, v in provenance(cfg).items():
        rows[k] = v
    rows.to_csv(out / "rows.csv", index=False)  # one run: rewritten whole, deterministic
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.plot(rows["step"], rows["tokens_per_s"], marker="o", label="AuroraRL (simulated)")
    ax.axvline(6, color="red", ls=":", label="preemption (step 6)")
    ax.axvline(14, color="green", ls=":", label="new Actor (step 14)")
    for step, value in ((5, 13_400), (6, 4_700), (10, 11_500), (16, 13_500)):
        ax.scatter([step], [value], marker="x", color="black", zorder=5)
    ax.scatter([], [], marker="x", color="black", label="paper (Fig. 13, read from text)")
    ax.set(xlabel="training step", ylabel="throughput (tokens/s)", title="Fig. 13: Qwen3-4B")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{NAME}.png", dpi=150)
    plt.close(fig)
    t = rows.set_index("step")["tokens_per_s"]
    print(
        compare_ranges(
            [
                ("tokens/s before the preemption (steps 3-5)", 13_400, 13_400, t[3:5].mean()),
                ("tokens/s at the preemption step (6)", 4_700, 4_700, t[6]),
                ("tokens/s with three Actors (steps 8-13)", 11_000, 12_000, t[8:13].mean()),
                ("tokens/s after the new Actor (steps 16+)", 13_500, 13_500, t[16:].mean()),
            ]
        )
    )
    print(written(root, NAME))
    return rows


if __name__ == "__main__":
    main()
