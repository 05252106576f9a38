"""Fig. 8a/8b (and Fig. 10's per-step numbers): end-to-end tokens/s and step time for Qwen3-4B,
8B and 14B under every strategy, on the paper's default US-Canada deployment.

Deployment per model as in §6.1: 2/4/6 x H100 Trainer, 4/8/12 A100 Actors in Canada, the
0.5-1 Gbit/s fluctuating cross-cloud link of ``examples/geo.yaml``. Throughput and step time are
means over the steps after two warm-up steps.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import yaml  # noqa: E402

from aurora.topology import Topology, topology_from_dict  # noqa: E402
from experiments.common import (  # noqa: E402
    Point,
    compare_ranges,
    one,
    parser,
    results_root,
    run_points,
    summary_measure,
    written,
)
from sim.config import SimConfig, strategy  # noqa: E402
from sim.traces import load_traces  # noqa: E402

NAME = "throughput"
GEO = Path(__file__).resolve().parent.parent / "examples" / "geo.yaml"
MODELS = {"qwen3-4b": (2, 4), "qwen3-8b": (4, 8), "qwen3-14b": (6, 12)}
"""Model -> (Trainer H100s, A100 Actors), §6.1."""
STRATEGIES = (
    "ideal-singledc",
    "aurora-leb128",
    "aurora",
    "prime-multistream",
    "prime-async4",
    "prime-async2",
    "prime-full",
)


def deployment(model: str, gpus: int, actors: int) -> Topology:
    """``examples/geo.yaml`` with the model, Trainer GPUs and Actor count of §6.1."""
    base = yaml.safe_load(GEO.read_text())
    base["trainer"] = dict(base["trainer"], model=model, gpus=gpus)
    base["actors"] = [dict(base["actors"][0], count=actors)]
    return topology_from_dict(base, source=str(GEO))


def points(full: bool = False, steps: int | None = None) -> list[Point]:
    steps = steps or (100 if full else 12)
    workloads = ("gsm8k", "math", "deepscaler") if full else ("gsm8k",)
    traces = load_traces()
    out = []
    for model, (gpus, actors) in MODELS.items():
        topology = deployment(model, gpus, actors)
        for workload in workloads:
            for name in STRATEGIES:
                cfg = SimConfig(
                    topology=topology,
                    traces=traces,
                    strategy=strategy(name),
                    steps=steps,
                    workload=workload,
                    record_trace=False,
                )
                out.append(
                    Point(
                        key={"model": model, "workload": workload, "system": name, "steps": steps},
                        config=cfg,
                    )
                )
    return out


def figure(rows: pd.DataFrame, path: Path) -> None:
    rows = rows[rows["workload"] == rows["workload"].iloc[0]]
    models = [m for m in MODELS if m in set(rows["model"])]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(STRATEGIES)
    x = np.arange(len(models))
    for i, name in enumerate(STRATEGIES):
        sub = rows[rows["system"] == name].set_index("model")
        tok = [sub.loc[m, "tokens_per_s"] if m in sub.index else np.nan for m in models]
        step = [sub.loc[m, "step_time_s"] if m in sub.index else np.nan for m in models]
        axes[0].bar(x + i * width, tok, width, label=name)
        axes[1].bar(x + i * width, step, width, label=name)
    for ax, label in zip(axes, ("throughput (tokens/s)", "step time (s)"), strict=True):
        ax.set_xticks(x + width * (len(STRATEGIES) - 1) / 2, models)
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    axes[1].axhline(500, color="black", ls=":", lw=1)
    axes[1].text(len(models) - 1.2, 510, "paper: PrimeRL-Full 14B > 500 s", fontsize=8)
    axes[0].set_title(f"Fig. 8a: throughput ({rows['workload'].iloc[0]})")
    axes[1].set_title("Fig. 8b: step time")
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def claims(rows: pd.DataFrame) -> list[tuple[str, float, float, float]]:
    w = rows["workload"].iloc[0]

    def tps(model: str, system: str) -> float:
        return one(rows, "tokens_per_s", model=model, workload=w, system=system)

    out = []
    models = set(rows["model"])
    if "qwen3-4b" in models:
        out.append(
            (
                "AuroraRL / PrimeRL-Full, Qwen3-4B (x)",
                2.4,
                3.7,
                tps("qwen3-4b", "aurora-leb128") / tps("qwen3-4b", "prime-full"),
            )
        )
    if "qwen3-14b" in models:
        out.append(
            (
                "AuroraRL / PrimeRL-Full, Qwen3-14B (x)",
                7.7,
                9.5,
                tps("qwen3-14b", "aurora-leb128") / tps("qwen3-14b", "prime-full"),
            )
        )
        out.append(
            (
                "PrimeRL-Full step time, Qwen3-14B (s, paper: > 500)",
                500,
                1e9,
                one(rows, "step_time_s", model="qwen3-14b", workload=w, system="prime-full"),
            )
        )
    for m in sorted(models):
        out.append(
            (
                f"gap of AuroraRL to Ideal-SingleDC, {m} (%)",
                1.31,
                8.91,
                100 * (1 - tps(m, "aurora-leb128") / tps(m, "ideal-singledc")),
            )
        )
        for a in ("prime-async2", "prime-async4"):
            out.append(
                (
                    f"{a} gain over PrimeRL-Full, {m} (%)",
                    44,
                    160,
                    100 * (tps(m, a) / tps(m, "prime-full") - 1),
                )
            )
        out.append(
            (
                f"PrimeRL-MultiStream / PrimeRL-Full, {m} (x, paper: up to 2.1)",
                1.0,
                2.1,
                tps(m, "prime-multistream") / tps(m, "prime-full"),
            )
        )
    if "qwen3-8b" in models:
        out.append(
            (
                "Qwen3-8B PrimeRL-Full s/step (Fig. 10: 15 min 48 s / 5)",
                189.6,
                189.6,
                one(rows, "step_time_s", model="qwen3-8b", workload=w, system="prime-full"),
            )
        )
        out.append(
            (
                "Qwen3-8B AuroraRL s/step (Fig. 10: 5 min 9 s / 5)",
                61.8,
                61.8,
                one(rows, "step_time_s", model="qwen3-8b", workload=w, system="aurora-leb128"),
            )
        )
    return out


def main(argv: list[str] | None = None) -> pd.DataFrame:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 12; 100 --full)")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated subset")
    args = p.parse_args(argv)
    root = results_root(args)
    wanted = set(args.models.split(","))
    pts = [pt for pt in points(args.full, args.steps) if pt.key["model"] in wanted]
    rows = run_points(NAME, pts, summary_measure, root=root)
    figure(rows, root / NAME / f"{NAME}.png")
    print("AuroraRL is the paper's system: aurora-leb128 (the paper's encoding).")
    print(compare_ranges(claims(rows)))
    print(written(root, NAME))
    return rows


if __name__ == "__main__":
    main()
