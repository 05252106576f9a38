"""Sensitivity bands: every claim recomputed with each unstated input moved to the ends of its
plausible range, one input at a time.

The paper does not state the RTT and loss of its links, the Actors' interfaces, what extraction
and the weight copy cost, how long generation takes against training, or the Trainer's MFU; our
defaults for them are single points. Each claim is therefore reported as a band: its value at the
default, and its lowest and highest values when one input at a time is set to either end of its
range (:func:`vary`), with the input responsible. One at a time, not jointly: a band shows which
input a claim hinges on, not the joint worst case. A band with a run that did not reach steady
state says NOT STEADY; an arithmetic or input claim says it meets or misses by construction.

    python -m experiments.bands [--out results] [--workers N] [--cluster ADDRESS]

writes ``results/bands/bands.csv`` and prints it; each variant's runs go to
``results/bands/<experiment>@<input>=<level>/``."""

from __future__ import annotations

import importlib
import math
import textwrap
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd

from aurora.traces import Quantity
from experiments.common import (
    Claim,
    Point,
    files_only,
    parser,
    results_root,
    run_points,
    summary_measure,
    sweep_options,
)
from sim.config import SimConfig

NAME = "bands"
SIMULATED = (
    "throughput",
    "timeline",
    "encoding",
    "streaming",
    "relay",
    "heterogeneity",
    "fault_tolerance",
    "bandwidth_sweep",
    "geo_scaling",
    "scalability",
    "cost",
)
"""Experiments whose claims come from simulated runs (the regime map is a sweep already)."""


def _scaled(q: Quantity, factor: float, why: str) -> Quantity:
    return Quantity(value=q.value * factor, source=f"{q.source} (x{factor:g}: {why})")


def _links(cfg: SimConfig, **change: Callable[[object], object]) -> SimConfig:
    topo = cfg.topology
    links = tuple(
        replace(link, **{field: fn(getattr(link, field)) for field, fn in change.items()})
        for link in topo.links
    )
    return replace(cfg, topology=replace(topo, links=links))


def _nic(cfg: SimConfig, gbps: float) -> SimConfig:
    topo = cfg.topology
    actors = tuple(replace(g, nic_gbps=gbps) for g in topo.actors)
    return replace(cfg, topology=replace(topo, actors=actors))


def _models(cfg: SimConfig, fn: Callable[[object], object]) -> SimConfig:
    t = cfg.traces
    return replace(cfg, traces=replace(t, models={k: fn(m) for k, m in t.models.items()}))


def _extract(cfg: SimConfig, f: float) -> SimConfig:
    return _models(
        cfg,
        lambda m: replace(m, extract_s=_scaled(m.extract_s, f, "band")),  # type: ignore[type-var]
    )


def _mfu(cfg: SimConfig, f: float) -> SimConfig:
    def one(m):  # type: ignore[no-untyped-def]
        rates = {g: _scaled(q, f, "band") for g, q in m.train_tokens_per_s_per_gpu.items()}
        return replace(m, train_tokens_per_s_per_gpu=rates)

    return _models(cfg, one)


def _gen(cfg: SimConfig, f: float) -> SimConfig:
    t = cfg.traces

    def one(g):  # type: ignore[no-untyped-def]
        rates = {m: _scaled(q, f, "band") for m, q in g.tokens_per_s.items()}
        return replace(g, tokens_per_s=rates)

    return replace(cfg, traces=replace(t, gpus={k: one(g) for k, g in t.gpus.items()}))


def _d2h(cfg: SimConfig, gb_s: float) -> SimConfig:
    t = cfg.traces
    q = Quantity(value=gb_s * 1e9, source=f"band: {gb_s:g} GB/s per GPU")
    return replace(
        cfg, traces=replace(t, constants=replace(t.constants, d2h_bytes_per_s_per_gpu=q))
    )


VARIANTS: dict[str, Callable[[SimConfig], SimConfig]] = {
    "rtt=x0.5": lambda c: _links(c, rtt_ms=lambda v: v * 0.5),
    "rtt=x2": lambda c: _links(c, rtt_ms=lambda v: v * 2),
    "loss=x0.1": lambda c: _links(c, loss=lambda v: v * 0.1),
    "loss=x10": lambda c: _links(c, loss=lambda v: min(v * 10, 0.5)),
    "nic=10": lambda c: _nic(c, 10.0),
    "nic=100": lambda c: _nic(c, 100.0),
    "extract=x0.5": lambda c: _extract(c, 0.5),
    "extract=x2": lambda c: _extract(c, 2.0),
    "d2h=10": lambda c: _d2h(c, 10.0),
    "d2h=50": lambda c: _d2h(c, 50.0),
    # Generation twice as fast halves the window, and the other way round.
    "gen_window=x0.5": lambda c: _gen(c, 2.0),
    "gen_window=x2": lambda c: _gen(c, 0.5),
    "mfu=20%": lambda c: _mfu(c, 20 / 30),
    "mfu=45%": lambda c: _mfu(c, 45 / 30),
}
"""Each input at either end of its range (see the table above)."""


def vary(points: list[Point], variant: str) -> list[Point]:
    """The inputs and their ranges:

    ==================  ====================  ==================================================
    input               range                 applied to
    ==================  ====================  ==================================================
    ``rtt``             x0.5 .. x2            every link's RTT (US-Canada: 20-80 ms)
    ``loss``            x0.1 .. x10           every lossy link (US-Canada: 1e-7 .. 1e-5)
    ``nic``             10 .. 100 Gbit/s      every Actor's interface (default 25)
    ``extract``         x0.5 .. x2            extraction time (Qwen3-8B: 2.5-10 s)
    ``d2h``             10 .. 50 GB/s         the Trainer's GPU-to-host copy, per GPU (default 25)
    ``gen_window``      x0.5 .. x2            generation time per batch (GPU rates x2 .. x0.5)
    ``mfu``             20% .. 45%            training throughput (default 30% MFU)
    ==================  ====================  =================================================="""
    fn = VARIANTS[variant]
    return [replace(p, config=fn(p.config)) for p in points]


def claims_under(
    name: str, variant: str | None, root: Path, full: bool, **sweep: object
) -> list[Claim]:
    """The claims of experiment ``name`` with ``variant`` applied (None: the defaults)."""
    module = importlib.import_module(f"experiments.{name}")
    points = module.points(full)
    where = name if variant is None else f"{name}@{variant}"
    if variant is not None:
        points = vary(points, variant)
    rows = run_points(
        where,
        points,
        getattr(module, "measure", summary_measure),
        root=root,
        **sweep,  # type: ignore[arg-type]
    )
    return list(module.claims(rows))


def bands(
    root: Path,
    *,
    full: bool = False,
    experiments: tuple[str, ...] = SIMULATED,
    variants: tuple[str, ...] = tuple(VARIANTS),
    **sweep: object,
) -> pd.DataFrame:
    """One row per claim: the paper's value, ours at the default, the band and its ends.

    The defaults are ``aurora/traces/paper.yaml`` and ``examples/geo.yaml``. Every variant is
    measured with the experiments' own warm-up rule (MSER,
    :func:`experiments.common.warmup_steps`); an arithmetic or input claim is told by
    ``Claim.kind``. ``bands.csv`` has per claim: the default, the low, the high, and the inputs
    at each end.
    """
    out = []
    for name in experiments:
        default = claims_under(name, None, root, full, **sweep)
        moved = {v: claims_under(name, v, root, full, **sweep) for v in variants}
        for i, claim in enumerate(default):
            values: dict[str, float] = {"default": _num(claim.ours)}
            steady = claim.steady
            for v, cs in moved.items():
                # Claim texts can name a measured place (e.g. the regime cell); ids are stable.
                match = [c for c in cs if c.id == claim.id]
                values[v] = _num(match[0].ours) if match else math.nan
                steady = steady and all(c.steady for c in match)
            finite = {k: x for k, x in values.items() if math.isfinite(x)}
            low_at = min(finite, key=finite.__getitem__) if finite else ""
            high_at = max(finite, key=finite.__getitem__) if finite else ""
            out.append(
                {
                    "experiment": name,
                    "order": i,
                    "id": claim.id,
                    "where": claim.where,
                    "claim": claim.text,
                    "paper": claim.paper,
                    "paper_low": claim.low,
                    "paper_high": claim.high,
                    "default": values["default"],
                    "low": finite.get(low_at, math.nan),
                    "low_at": low_at,
                    "high": finite.get(high_at, math.nan),
                    "high_at": high_at,
                    "kind": claim.kind,
                    "steady": steady,
                    "status": _status(claim, finite.get(low_at), finite.get(high_at), steady),
                }
            )
    return pd.DataFrame(out)


def _num(x: float | None) -> float:
    return math.nan if x is None else float(x)


def _status(claim: Claim, low: float | None, high: float | None, steady: bool = True) -> str:
    """Whether the paper's value is inside our band, and which side of it we are on; a band
    whose runs did not all reach steady state, or whose claim is arithmetic or an input (it
    agrees or not by construction), says so."""
    if claim.low is None or low is None or high is None:
        return "-"
    where = _side(claim, low, high)
    if not steady:
        return f"{where}; NOT STEADY"
    if claim.kind != "mechanism":
        return f"{where}; {claim.kind}, by construction"
    return where


def _side(claim: Claim, low: float, high: float) -> str:
    assert claim.low is not None
    p_low = claim.low
    p_high = claim.low if claim.high is None else claim.high
    if p_low == p_high:
        p_low, p_high = p_low * 0.8, p_high * 1.2  # a single value: within 20%
    if high < p_low:
        return "below"
    if low > p_high:
        return "above"
    return "band meets paper"


def table(df: pd.DataFrame) -> str:
    lines = [
        f"{'where':<16} {'claim':<58} {'paper':>11} {'ours':>9} {'band':>21}  {'kind':<10}  status"
    ]
    for r in df.itertuples(index=False):
        band = f"{r.low:.3g}..{r.high:.3g}"
        lines.append(
            f"{r.where:<16} {r.claim[:58]:<58} {r.paper:>11} {r.default:>9.3g} {band:>21}  "
            f"{r.kind:<10}  {r.status} ({r.low_at} .. {r.high_at})"
        )
    footer = status_footer(df["status"]) if len(df) else ""
    return "\n".join(lines + ([footer] if footer else []))


STATUS_WORDS = {
    "band meets paper": "some setting of one unstated input, within its plausible range, "
    "gives the paper's value (a single value: within 20%)",
    "below": "even the band's highest value is under the paper's",
    "above": "even the band's lowest value is over the paper's",
    "NOT STEADY": "a run of the band had not reached steady state",
    "arithmetic, by construction": "the value is stated inputs through a formula, so it meets "
    "or misses the paper by construction and is not evidence either way",
    "input, by construction": "the value is a stated input coming back out",
}
"""What each status word of :func:`table` means."""


def status_footer(statuses: Any) -> str:
    """A footer explaining the status words that occur in ``statuses``."""
    text = " ".join(str(s) for s in statuses)
    used = [(w, m) for w, m in STATUS_WORDS.items() if w in text]
    if not used:
        return ""
    line = "status: " + "; ".join(f'"{w}": {m}' for w, m in used) + "."
    return textwrap.fill(line, width=100, subsequent_indent="  ")


def main(argv: list[str] | None = None) -> pd.DataFrame:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--experiments", default=",".join(SIMULATED), help="comma-separated subset")
    args = p.parse_args(argv)
    files_only()
    root = results_root(args) / NAME
    try:
        df = bands(
            root,
            full=args.full,
            experiments=tuple(args.experiments.split(",")),
            **sweep_options(args),
        )
    except ValueError as exc:  # a bad option, e.g. --cluster without the cluster extra
        raise SystemExit(f"python -m experiments.bands: {exc}") from None
    root.mkdir(parents=True, exist_ok=True)
    df.to_csv(root / "bands.csv", index=False)
    print(table(df))
    print(f"rows: {root / 'bands.csv'}")
    return df


if __name__ == "__main__":
    main()
