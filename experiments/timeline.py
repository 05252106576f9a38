"""Fig. 10: five consecutive Qwen3-8B steps, PrimeRL-Full vs AuroraRL, as a Gantt chart of
train / copy / extract / serialize / transfer / apply / generate per role (the paper's default
deployment).

Besides the five-step times, the measure reports what §6.3 says about them: PrimeRL-Full's dense
broadcast per step (from the Trainer publishing a version to the last Actor holding it) and
AuroraRL's "7-12 s of extraction-plus-transfer" (the same interval for a delta).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

from aurora.traces import load_traces
from experiments.common import Claim, Point, experiment_main, one
from experiments.throughput import MODELS, deployment
from sim.config import SimConfig, strategy

NAME = "timeline"
SYSTEMS = {"PrimeRL-Full": "prime-full", "AuroraRL": "aurora-leb128"}
PAPER_FIVE_STEPS_S = {"PrimeRL-Full": 15 * 60 + 48, "AuroraRL": 5 * 60 + 9}
COLORS = {
    "train": "tab:blue",
    "copy": "tab:cyan",
    "extract": "tab:orange",
    "serialize": "tab:brown",
    "transfer": "tab:red",
    "catch-up": "tab:pink",
    "apply": "tab:green",
    "generate": "tab:gray",
}
FIRST = 4
"""First of the five steps shown (after warm-up)."""


def points(full: bool = False) -> list[Point]:
    return [
        Point(
            key={"system": system},
            config=SimConfig(
                topology=deployment("qwen3-8b", *MODELS["qwen3-8b"]),
                traces=load_traces(),
                strategy=strategy(name),
                steps=FIRST + 5,
            ),
        )
        for system, name in SYSTEMS.items()
    ]


def measure(cfg: SimConfig) -> dict[str, object]:
    """Five steps' time, publish-to-held per version, and the spans in those steps (JSON)."""
    from sim.model import simulate

    result = simulate(cfg)
    times = {r["step"]: r["time_s"] for r in result.rows}
    t0, t1 = times[FIRST - 1], times[FIRST + 4]
    published = {
        int(what.split("v")[1]): t for t, who, what in result.trace if what.startswith("publish v")
    }
    held: dict[int, float] = {}
    for t, _who, what in result.trace:
        if what.startswith("received v"):
            v = int(what.split()[1][1:])
            held[v] = max(held.get(v, 0.0), t)
    delivery = [held[v] - published[v] for v in range(FIRST, FIRST + 5) if v in held]
    # The transfer itself: from the first byte leaving the Trainer to the last Actor holding it.
    first_byte: dict[int, float] = {}
    for s in result.timeline:
        if s["activity"] == "transfer" and s["who"].startswith("trainer->"):
            first_byte[s["version"]] = min(first_byte.get(s["version"], s["start"]), s["start"])
    moving = [held[v] - first_byte[v] for v in range(FIRST, FIRST + 5) if v in held]
    spans = [s for s in result.timeline if s["end"] > t0 and s["start"] < t1]
    return {
        "five_steps_s": t1 - t0,
        "t0": t0,
        "publish_to_held_s": sum(delivery) / len(delivery) if delivery else float("nan"),
        "publish_to_held_max_s": max(delivery) if delivery else float("nan"),
        "transfer_s": sum(moving) / len(moving) if moving else float("nan"),
        "spans": json.dumps(spans),
    }


def figure(rows: pd.DataFrame, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(11, 7))
    for ax, system in zip(axes, SYSTEMS, strict=True):
        row = rows[rows["system"] == system].iloc[0]
        t0, t1 = row["t0"], row["t0"] + row["five_steps_s"]
        window = pd.DataFrame(json.loads(row["spans"]))
        lanes = ["trainer", "trainer-host"]
        lanes += sorted(set(window["who"]) - set(lanes))
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
            f"{system}: five steps in {row['five_steps_s']:.0f} s "
            f"(paper {PAPER_FIVE_STEPS_S[system]} s)",
            fontsize=10,
        )
        ax.invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    # Below the charts, so that it covers no bar.
    fig.legend(handles, COLORS.keys(), fontsize=8, ncol=len(COLORS), loc="lower center")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=150)
    plt.close(fig)


def claims(rows: pd.DataFrame) -> list[Claim]:
    def v(column: str, system: str) -> float:
        return one(rows, column, system=system)

    full, aurora = v("five_steps_s", "PrimeRL-Full"), v("five_steps_s", "AuroraRL")
    out = [
        Claim(
            id=f"fig10.five_steps.{s}",
            where="§6.3 Fig. 10",
            text=f"{s}: five Qwen3-8B steps (s)",
            low=p,
            high=p,
            ours=v("five_steps_s", s),
            kind="mechanism",
        )
        for s, p in PAPER_FIVE_STEPS_S.items()
    ]
    out.append(
        Claim(
            id="fig10.speedup",
            where="§6.3 Fig. 10",
            text="speedup AuroraRL over PrimeRL-Full, five steps (x)",
            low=3.1,
            high=3.1,
            ours=full / aurora,
            kind="mechanism",
        )
    )
    out.append(
        Claim(
            id="fig10.dense_broadcast",
            where="§6.3 Fig. 10",
            text="PrimeRL-Full broadcast, first byte to last Actor (s, ~200)",
            low=200,
            high=200,
            ours=v("transfer_s", "PrimeRL-Full"),
            kind="mechanism",
        )
    )
    out.append(
        Claim(
            id="fig10.extract_plus_transfer",
            where="§6.3 Fig. 10",
            text="AuroraRL extraction + transfer, publish to last Actor (s)",
            low=7,
            high=12,
            ours=v("publish_to_held_s", "AuroraRL"),
            kind="mechanism",
        )
    )
    return out


def main(argv: list[str] | None = None) -> pd.DataFrame:
    return experiment_main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
