"""Fig. 15: throughput as four A100 Actors spread over 1-4 regions (Qwen3-4B, 2 x H100 Trainer in
the US): Canada; Canada + Japan; + Netherlands; + Iceland.

PrimeRL-Full broadcasts dense weights to every region (one relay each, store-and-forward);
AuroraRL sends one delta per region. The inter-continental paths are assumed (the paper gives
no rates): 1 Gbit/s each; RTT US-Japan 150 ms, US-Netherlands 90 ms, US-Iceland 100 ms; loss
1e-5 (1e-6 to Canada, as in examples/geo.yaml).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from aurora.topology import topology_from_dict
from experiments.common import (
    WARMUP,
    Claim,
    Point,
    bar_figure,
    experiment_main,
    geo_topology,
    one,
    steady,
    summary_config,
)
from sim.config import strategy

NAME = "geo_scaling"
REGIONS = {"jp": 150, "nl": 90, "is": 100}
"""Assumed RTTs from the US (ms)."""
LAYOUTS = {
    "1-DC": [("ca", 4)],
    "2-DC": [("ca", 2), ("jp", 2)],
    "3-DC": [("ca", 2), ("jp", 1), ("nl", 1)],
    "4-DC": [("ca", 1), ("jp", 1), ("nl", 1), ("is", 1)],
}
PAPER = {("1-DC", "prime-full"): 7_137, ("4-DC", "prime-full"): 1_219}
PAPER_AURORA_DROP_PCT = 13.7


def points(full: bool = False, steps: int | None = None) -> list[Point]:
    steps = steps or (60 if full else 24)
    links = [
        {"a": "us", "b": r, "gbps": 1.0, "rtt_ms": rtt, "loss": 1e-5} for r, rtt in REGIONS.items()
    ]
    out = []
    for layout, actors in LAYOUTS.items():
        regions = {r for r, _ in actors}
        topo = geo_topology(
            model="qwen3-4b",
            trainer_gpus=2,
            actors=[(r, "A100", n) for r, n in actors],
            links=[lk for lk in links if lk["b"] in regions],
            name=f"geo-{layout}",
        )
        for name in ("aurora-leb128", "prime-full"):
            cfg = summary_config(
                topology=topology_from_dict(topo, source=NAME),
                strategy=strategy(name),
                steps=steps,
            )
            out.append(
                Point(
                    key={"layout": layout, "system": name, "steps": steps, "warmup": WARMUP},
                    config=cfg,
                )
            )
    return out


def figure(rows: pd.DataFrame, path: Path) -> None:
    bar_figure(
        rows,
        x="layout",
        hue="system",
        value="tokens_per_s",
        ylabel="throughput (tokens/s, log)",
        title="Fig. 15: Actors across 1-4 regions",
        path=path,
        paper=PAPER,
        logy=True,  # PrimeRL-Full's 2-4 DC bars are 1/60 of AuroraRL's
    )


def claims(rows: pd.DataFrame) -> list[Claim]:
    def tps(layout: str, system: str) -> float:
        return one(rows, "tokens_per_s", layout=layout, system=system)

    out = [
        Claim(
            id=f"fig15.full.{lay}",
            where="§6.7 Fig. 15",
            text=f"PrimeRL-Full tokens/s, {lay}",
            low=v,
            high=v,
            ours=tps(lay, s),
            kind="mechanism",
            steady=steady(rows, layout=lay, system=s),
        )
        for (lay, s), v in PAPER.items()
    ]
    out.append(
        Claim(
            id="fig15.full_collapse",
            where="§6.7 Fig. 15",
            text="PrimeRL-Full 1-DC / 4-DC (x)",
            low=7_137 / 1_219,
            high=7_137 / 1_219,
            ours=tps("1-DC", "prime-full") / tps("4-DC", "prime-full"),
            kind="mechanism",
            steady=steady(rows, system="prime-full"),
        )
    )
    out.append(
        Claim(
            id="fig15.aurora_drop",
            where="§6.7 Fig. 15",
            text="AuroraRL drop from 1-DC to 4-DC (%)",
            low=PAPER_AURORA_DROP_PCT,
            high=PAPER_AURORA_DROP_PCT,
            ours=100 * (1 - tps("4-DC", "aurora-leb128") / tps("1-DC", "aurora-leb128")),
            kind="mechanism",
            steady=steady(rows, system="aurora-leb128"),
        )
    )
    for lay in LAYOUTS:
        out.append(
            Claim(
                id=f"fig15.aurora_over_full.{lay}",
                where="§6.7 Fig. 15",
                text=f"AuroraRL / PrimeRL-Full, {lay} (x; paper 1.9-9 over 1-4 DC)",
                low=1.9,
                high=9.0,
                ours=tps(lay, "aurora-leb128") / tps(lay, "prime-full"),
                kind="mechanism",
                steady=steady(rows, layout=lay),
            )
        )
    return out


def main(argv: list[str] | None = None) -> pd.DataFrame:
    return experiment_main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
