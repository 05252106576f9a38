"""Fig. 10: five consecutive Qwen3-8B steps, PrimeRL-Full vs AuroraRL, as a Gantt chart of
train / extract / transfer / apply / generate per role (the paper's default deployment)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from experiments.common import compare, parser, results_root, written  # noqa: E402
from experiments.throughput import MODELS, deployment  # noqa: E402
from sim.config import SimConfig, strategy  # noqa: E402
from sim.model import simulate  # noqa: E402
from sim.output import provenance  # noqa: E402
from sim.traces import load_traces  # noqa: E402

NAME = "timeline"
SYSTEMS = {"PrimeRL-Full": "prime-full", "AuroraRL": "aurora-leb128"}
PAPER_FIVE_STEPS_S = {"PrimeRL-Full": 15 * 60 + 48, "AuroraRL": 5 * 60 + 9}
COLORS = {
    "train": "tab:blue",
    "extract": "tab:orange",
    "transfer": "tab:red",
    "catch-up": "tab:pink",
    "apply": "tab:green",
    "generate": "tab:gray",
}
FIRST = 4
"""First of the five steps shown (after warm-up)."""


def run(system: str) -> tuple[pd.DataFrame, pd.DataFrame, SimConfig]:
    cfg = SimConfig(
        topology=deployment("qwen3-8b", *MODELS["qwen3-8b"]),
        traces=load_traces(),
        strategy=strategy(SYSTEMS[system]),
        steps=FIRST + 5,
    )
    result = simulate(cfg)
    return pd.DataFrame(result.timeline), pd.DataFrame(result.rows), cfg


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = parser(__doc__.split("\n\n")[0]).parse_args(argv)
    root = results_root(args)
    out = root / NAME
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(2, 1, figsize=(11, 6.5))
    spans, ours = [], {}
    for ax, system in zip(axes, SYSTEMS, strict=True):
        timeline, rows, cfg = run(system)
        rows = rows.set_index("step")
        t0 = rows.loc[FIRST - 1, "time_s"]
        t1 = rows.loc[FIRST + 4, "time_s"]
        ours[system] = t1 - t0
        window = timeline[(timeline["end"] > t0) & (timeline["start"] < t1)].copy()
        window["system"] = system
        for k, v in provenance(cfg).items():
            window[k] = v
        spans.append(window)
        lanes = ["trainer"] + sorted(set(window["who"]) - {"trainer"})
        lanes = [lane for lane in lanes if not lane.startswith("store")][:12]
        for i, lane in enumerate(lanes):
            for _, s in window[window["who"] == lane].iterrows():
                ax.barh(
                    i,
                    min(s["end"], t1) - max(s["start"], t0),
                    left=max(s["start"], t0) - t0,
                    color=COLORS.get(s["activity"], "black"),
                    edgecolor="white",
                    lw=0.3,
                )
        ax.set_yticks(range(len(lanes)), lanes, fontsize=7)
        ax.set_xlabel(f"time since step {FIRST} began (s)")
        ax.set_title(
            f"{system}: five steps in {ours[system]:.0f} s (paper {PAPER_FIVE_STEPS_S[system]} s)"
        )
        ax.invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    axes[0].legend(handles, COLORS.keys(), fontsize=7, ncol=6, loc="upper right")
    fig.tight_layout()
    fig.savefig(out / f"{NAME}.png", dpi=150)
    plt.close(fig)
    spans_df = pd.concat(spans, ignore_index=True)
    spans_df.to_csv(out / "rows.csv", index=False)
    table = [(f"{s}: five steps (s)", p, ours[s]) for s, p in PAPER_FIVE_STEPS_S.items()]
    table.append(
        (
            "speedup AuroraRL over PrimeRL-Full (x)",
            948 / 309,
            ours["PrimeRL-Full"] / ours["AuroraRL"],
        )
    )
    print(compare(table))
    print(written(root, NAME))
    return spans_df


if __name__ == "__main__":
    main()
