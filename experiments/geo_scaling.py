"""Fig. 15: throughput as four A100 Actors spread over 1-4 regions (Qwen3-4B, 2 x H100 Trainer in
the US): Canada; Canada + Japan; + Netherlands; + Iceland.

PrimeRL-Full broadcasts dense weights to every region (one relay each, store-and-forward);
AuroraRL sends one delta per region. The inter-continental paths are assumed (the paper gives
no rates): 1 Gbit/s each; RTT US-Japan 150 ms, US-Netherlands 90 ms, US-Iceland 100 ms; loss
1e-5 (1e-6 to Canada, as in examples/geo.yaml).
"""

from __future__ import annotations

import pandas as pd

from aurora.topology import topology_from_dict
from experiments.common import (
    Point,
    bar_figure,
    compare,
    geo_topology,
    one,
    parser,
    results_root,
    run_points,
    summary_config,
    summary_measure,
    written,
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
    steps = steps or (60 if full else 12)
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
            out.append(Point(key={"layout": layout, "system": name, "steps": steps}, config=cfg))
    return out


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = parser(__doc__.split("\n\n")[0]).parse_args(argv)
    root = results_root(args)
    rows = run_points(NAME, points(args.full), summary_measure, root=root)
    bar_figure(
        rows,
        x="layout",
        hue="system",
        value="tokens_per_s",
        ylabel="throughput (tokens/s)",
        title="Fig. 15: Actors across 1-4 regions",
        path=root / NAME / f"{NAME}.png",
        paper=PAPER,
    )
    tps = {
        (lay, s): one(rows, "tokens_per_s", layout=lay, system=s)
        for lay, s in [(lay, s) for lay in LAYOUTS for s in ("aurora-leb128", "prime-full")]
    }
    table = [(f"PrimeRL-Full tokens/s, {lay}", v, tps[(lay, s)]) for (lay, s), v in PAPER.items()]
    table.append(
        (
            "PrimeRL-Full 1-DC / 4-DC (x)",
            7_137 / 1_219,
            tps[("1-DC", "prime-full")] / tps[("4-DC", "prime-full")],
        )
    )
    table.append(
        (
            "AuroraRL drop from 1-DC to 4-DC (%)",
            PAPER_AURORA_DROP_PCT,
            100 * (1 - tps[("4-DC", "aurora-leb128")] / tps[("1-DC", "aurora-leb128")]),
        )
    )
    print(compare(table))
    print(written(root, NAME))
    return rows


if __name__ == "__main__":
    main()
