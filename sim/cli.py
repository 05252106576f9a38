"""``aurora sim``: simulate a deployment for one or more strategies and print a summary table.

``add_parser(subparsers)`` adds the subcommand to the ``aurora`` command; ``run(args)`` carries
it out and returns the exit status (0, or 1 when a run stalled). ``python -m sim.cli ARGS`` runs
it alone.

Each strategy's run is written to ``<out>/<topology>-<strategy>-s<seed>[-<variant>]/``
(``steps.csv``, ``events.csv``, ``timeline.csv``, ``summary.json``) and the figure to
``<out>/<topology>[-<variant>].png``; ``<variant>`` names a run with faults or a spot hazard
(``faults-`` and a digest of them), so it never overwrites the plain run. Every error a user can
cause (a bad file, a fault the deployment cannot carry out, an unwritable ``--out``) is one line
naming it, before anything is simulated. A run that stalls keeps what it produced.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aurora.faults import EXAMPLES as FAULT_EXAMPLES
from aurora.faults import FAULT_KINDS
from aurora.faults import SYNTAX as FAULT_SYNTAX

DEFAULT_STRATEGIES = "aurora,prime-full,ideal-singledc"
ROLLOUTS_PER_LEASE = 16
"""The lease granularity ``aurora sim`` uses unless told: per-prompt leases of a 16-completion
GRPO group (``SimConfig.rollouts_per_lease``'s default)."""
TIE = 0.005
"""Strategies whose mean step times differ by less than this share are reported as a tie."""
BOUND = 0.98
"""A run is Trainer-bound when its Trainer is busy at least this share of each step."""


def add_parser(subparsers: Any) -> None:
    """Add ``sim`` to an ``argparse`` subparsers object."""
    from aurora.strategies import STRATEGIES

    p = subparsers.add_parser(
        "sim",
        help="simulate a deployment and print a summary table",
        description="Simulate a deployment (a topology YAML) for one or more strategies with "
        "SimPy, recorded traces and the real policy core, print a summary table (step time, "
        "tokens/s, WAN bytes per step) and write per-step rows, the event trace, a timeline "
        "and a figure. Needs only the core install.",
        epilog=(
            f"fault kinds: {', '.join(FAULT_KINDS)}. Spelling: {FAULT_SYNTAX}. "
            f"Examples: {'  '.join(FAULT_EXAMPLES)}. See docs/SIMULATOR.md."
        ),
    )
    p.add_argument("--topology", required=True, help="topology YAML (examples/geo.yaml)")
    p.add_argument(
        "--strategy",
        default=DEFAULT_STRATEGIES,
        help=f"comma-separated strategies (default {DEFAULT_STRATEGIES}; one of "
        f"{', '.join(STRATEGIES)})",
    )
    p.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    p.add_argument(
        "--rollouts-per-lease",
        type=int,
        default=ROLLOUTS_PER_LEASE,
        metavar="N",
        help=f"rollouts per lease: a prompt and its group of completions (default "
        f"{ROLLOUTS_PER_LEASE}, per-prompt leases); a larger N means fewer, longer leases and "
        "a faster simulation of many Actors (512: one lease per Actor per step); must divide "
        "the batch",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of every random draw (default 0)")
    p.add_argument("--workload", default="gsm8k", help="workload in the traces (default gsm8k)")
    p.add_argument("--traces", default=None, help="trace YAML (default: aurora/traces/paper.yaml)")
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="SPEC",
        help=f"a membership or network event, repeatable; kinds: {', '.join(FAULT_KINDS)}; "
        f"e.g. {', '.join(FAULT_EXAMPLES)}",
    )
    p.add_argument(
        "--spot-hazard",
        type=float,
        default=0.0,
        metavar="PER_HOUR",
        help="preemptions per hour of each spot Actor (spot: true in the topology)",
    )
    p.add_argument(
        "--spot-notice",
        type=float,
        default=30.0,
        metavar="S",
        help="warning a hazard preemption gives (s, default 30; 0: none)",
    )
    p.add_argument(
        "--spot-return",
        type=float,
        default=None,
        metavar="S",
        help="a preempted spot Actor comes back (fresh, from a snapshot) this many seconds "
        "later (default: it does not)",
    )
    p.add_argument(
        "--no-trace",
        dest="actors_trace",
        action="store_false",
        help="skip the event trace and timeline (large deployments)",
    )
    p.add_argument(
        "--exact",
        dest="cohorts",
        action="store_false",
        help="one SimPy process per Actor, the reference (default: the Actors of each group "
        "that join together run as one cohort process; the same events reach the Ledger at "
        "the same times; see docs/SIMULATOR.md)",
    )
    p.add_argument("--out", default="results/sim", help="output folder (default results/sim)")
    p.add_argument(
        "--log",
        choices=["tensorboard", "wandb"],
        default=None,
        help="also write each step's series to TensorBoard event files (<run folder>/tb) or to "
        "W&B in offline mode, under the same tags as aurora real --log (docs/OBSERVABILITY.md)",
    )
    p.set_defaults(func=run)


def variant(cfg: Any) -> str:
    """A name for what sets a run apart from the plain one (faults, spot hazard), or ''."""
    parts = [f.spec() for f in cfg.faults]
    if cfg.spot_hazard_per_hour > 0:
        parts.append(
            f"hazard={cfg.spot_hazard_per_hour:g}/h,notice={cfg.spot_notice_s},"
            f"return={cfg.spot_return_s}"
        )
    if not parts:
        return ""
    return "faults-" + hashlib.sha256(";".join(parts).encode()).hexdigest()[:8]


def _writable(out: Path) -> None:
    """Raise ``ValueError`` naming ``out`` unless a file can be written in it."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot write there: {exc.strerror or exc}") from None


def run(args: argparse.Namespace) -> int:
    """Carry out ``aurora sim``: 0 when every run finished, 1 when one stalled."""
    from tqdm import tqdm

    from aurora.faults import parse_fault
    from aurora.topology import load_topology
    from aurora.traces import load_traces
    from sim.config import SimConfig, strategy
    from sim.model import Result, Simulation, SimulationStalled
    from sim.output import write_result

    try:
        topology = load_topology(args.topology)
        traces = load_traces(args.traces) if args.traces else load_traces()
        names = [name.strip() for name in args.strategy.split(",") if name.strip()]
        if not names:
            raise ValueError("--strategy: no strategy given")
        strategies = [strategy(name) for name in names]
        faults = tuple(parse_fault(f) for f in args.fault)
        configs = [
            SimConfig(
                topology=topology,
                traces=traces,
                strategy=s,
                steps=args.steps,
                seed=args.seed,
                workload=args.workload,
                faults=faults,
                spot_hazard_per_hour=args.spot_hazard,
                spot_notice_s=args.spot_notice if args.spot_notice > 0 else None,
                spot_return_s=args.spot_return,
                record_trace=args.actors_trace,
                cohorts=args.cohorts,
                rollouts_per_lease=args.rollouts_per_lease,
            )
            for s in strategies
        ]
        out = Path(args.out)
        _writable(out)
        if getattr(args, "log", None):
            from aurora.observe.steplog import check

            check(args.log)
    except ValueError as exc:
        raise SystemExit(f"aurora sim: {exc}") from None
    tag = variant(configs[0])
    suffix = f"-{tag}" if tag else ""
    what = f", faults {' '.join(args.fault)}" if args.fault else ""
    if args.spot_hazard > 0:
        what += f", spot hazard {args.spot_hazard:g}/h"
    print(
        f"{topology.name}: {topology.trainer.model} on {topology.trainer.gpus} x "
        f"{topology.trainer.gpu}, {sum(g.count for g in topology.actors)} Actors, "
        f"{args.steps} steps, workload {args.workload}, seed {args.seed}, "
        f"{args.rollouts_per_lease} rollouts per lease{what}"
    )
    header = (
        f"{'strategy':<18} {'step time s':>11} {'tokens/s':>10} {'WAN GB/step':>11} "
        f"{'expired':>7} {'sim h':>6}  output"
    )
    lines, results, stalled = [], [], []
    summaries: list[tuple[str, dict[str, float], Any]] = []
    for cfg in configs:
        name = cfg.strategy.name
        # Bars only on a terminal: piped or redirected output gets the table alone.
        bar = tqdm(
            total=cfg.steps,
            desc=name,
            unit="step",
            leave=False,
            disable=not sys.stderr.isatty(),
        )
        result: Result | None
        try:
            # mypy cannot type a lambda with a default argument (which binds the current value)
            sim = Simulation(cfg, progress=lambda _step, bar=bar: bar.update(1))  # type: ignore[misc]
            result = sim.run()
            problem = None
        except SimulationStalled as exc:
            result, problem = exc.result, str(exc)
        except ValueError as exc:
            raise SystemExit(f"aurora sim: {name}: {exc}") from None
        finally:
            bar.close()
        folder = out / f"{topology.name}-{name}-s{cfg.seed}{suffix}"
        if result is None:
            stalled.append(f"{name}: {problem}")
            continue
        written = write_result(result, cfg, folder, stalled=problem)
        if getattr(args, "log", None):  # docs/OBSERVABILITY.md
            from aurora.observe.steplog import write_rows

            meta = {"mode": "sim", "strategy": name, "seed": cfg.seed}
            write_rows(args.log, folder, result.rows, name=folder.name, config=meta)
        if problem is not None:
            stalled.append(f"{name}: {problem} (partial output in {written})")
        if not result.rows:
            lines.append(f"{name:<18} {'stalled before its first step':>45}  {written}")
            continue
        s = result.summary(warmup=min(2, len(result.rows) - 1))
        results.append((name, result))
        summaries.append((name, s, result))
        lines.append(
            f"{name:<18} {s['step_time_s']:>11.1f} {s['tokens_per_s']:>10,.0f} "
            f"{s['wan_gb_per_step']:>11.3f} {s['expired_leases']:>7} "
            f"{s['sim_time_s'] / 3600:>6.2f}  {written}"
            + ("  STALLED" if problem is not None else "")
        )
    print(header)
    print("\n".join(lines))
    notes = tie_notes(summaries)
    for note in notes:
        print(note)
    if results:
        figure = figure_of(
            results, out / f"{topology.name}{suffix}.png", title=what.lstrip(", "), notes=notes
        )
        print(f"figure: {figure}")
    print("(means over steps after the first two; rows per step in each output folder)")
    for line in stalled:
        print(f"aurora sim: {line}", file=sys.stderr)
    return 1 if stalled else 0


def tie_notes(summaries: list[tuple[str, dict[str, float], Any]], warmup: int = 2) -> list[str]:
    """One line per group of strategies whose mean step times tie (within :data:`TIE`), saying
    why, from the runs' own rows: Trainer-bound when the Trainer worked at least :data:`BOUND`
    of each step (its own time, ``Result.trainer_busy``), so whatever a strategy sends is
    hidden behind training; otherwise the share it worked, and that the step is set elsewhere."""
    ranked = sorted(
        (s["step_time_s"], name, result)
        for name, s, result in summaries
        if math.isfinite(s["step_time_s"]) and s["step_time_s"] > 0
    )
    groups: list[list[tuple[float, str, Any]]] = []
    for item in ranked:
        if groups and item[0] <= groups[-1][0][0] * (1 + TIE):
            groups[-1].append(item)
        else:
            groups.append([item])
    notes = []
    for group in groups:
        if len(group) < 2:
            continue
        shares = []
        for _step_time, _name, result in group:
            rows = result.rows[warmup:] if len(result.rows) > warmup else result.rows
            span = sum(r["step_time_s"] for r in rows)
            busy = sum(result.trainer_busy.get(r["step"], 0.0) for r in rows)
            shares.append((busy / span if span > 0 else 0.0, busy / max(len(rows), 1)))
        names = " = ".join(name for _t, name, _r in group)
        step = group[0][0]
        low = min(shares)
        if low[0] >= BOUND:
            notes.append(
                f"{names}: the same step time ({step:.1f} s): Trainer-bound (training takes "
                f"{low[1]:.1f} s of each step), so the transfer is hidden behind training"
            )
        else:
            notes.append(
                f"{names}: the same step time ({step:.1f} s), not Trainer-bound (the Trainer "
                f"works {low[0]:.0%} of each step): generation or transfer sets it, alike"
            )
    return notes


PAPER_NAMES = {
    "aurora": "AuroraRL",
    "aurora-leb128": "AuroraRL, the paper's LEB128",
    "prime-full": "PrimeRL-Full",
    "prime-async2": "PrimeRL-Async2",
    "prime-async4": "PrimeRL-Async4",
    "prime-multistream": "PrimeRL-MultiStream",
    "ideal-singledc": "Ideal-SingleDC",
}
"""How the paper names a strategy, for a figure's legend."""


def _gb(value: float) -> str:
    return f"{value:.3g} GB" if value >= 0.01 else f"{value * 1e3:.3g} MB"


def figure_of(
    results: list[tuple[str, Any]], path: Path, title: str = "", notes: Sequence[str] = ()
) -> Path:
    """Tokens/s per step and cumulative WAN bytes, one line per strategy.

    Strategies often coincide (AuroraRL runs at Ideal-SingleDC's rate when the run is
    Trainer-bound): each gets its own line style and marker on staggered steps, later lines
    thinner, so one drawn exactly over another still shows, and ``notes`` (the tie lines of the
    summary) are written under the panels. The WAN panel is logarithmic, with each total written
    at its line's end, so a delta's few GB show beside a dense broadcast's hundreds; a strategy
    that sends nothing over the WAN says so in the legend."""
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")  # a file, not a window (only when nothing chose a backend)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2 + 0.22 * len(notes)))
    styles = ("-", "--", ":", "-.")
    markers = ("o", "s", "^", "D", "v", "P", "X", "*")
    for i, (name, result) in enumerate(results):
        rows = result.rows
        steps = [r["step"] for r in rows]
        every = max(len(rows) // 8, len(results))
        label = f"{name} ({PAPER_NAMES[name]})" if name in PAPER_NAMES else name
        look = {
            "ls": styles[i % len(styles)],
            "marker": markers[i % len(markers)],
            "lw": max(2.6 - 0.4 * i, 1.0),
            "ms": max(7 - i, 3),
            # Markers on staggered steps, so coinciding lines show every marker.
            "markevery": (i % every, every),
            "mfc": "none",
            "color": f"C{i}",
        }
        a.plot(steps, [r["tokens_per_s"] for r in rows], label=label, **look)
        hours, wan, total = [], [], 0.0
        for r in rows:
            total += r["wan_bytes"] / 1e9
            if total > 0:  # a log axis has no zero
                hours.append(r["time_s"] / 3600)
                wan.append(total)
        if not wan:
            b.plot([], [], label=f"{label}: 0 B over the WAN", **look)
            continue
        b.plot(hours, wan, label=label, **look)
        b.annotate(
            _gb(wan[-1]),
            (hours[-1], wan[-1]),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
            color=f"C{i}",
        )
    a.set(xlabel="training step", ylabel="throughput (tokens/s)", title="throughput per step")
    a.xaxis.set_major_locator(MaxNLocator(integer=True))
    b.set(
        xlabel="simulated time (h)",
        ylabel="WAN traffic, cumulative (GB, log scale)",
        title="bytes over the WAN",
        yscale="log",
    )
    b.margins(x=0.15)
    for ax in (a, b):
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    bottom = 0.0
    if notes:
        bottom = 0.05 + 0.045 * len(notes)
        fig.text(0.01, 0.02, "\n".join(notes), fontsize=8, va="bottom", wrap=True)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sim.cli ARGS``: the ``sim`` subcommand alone."""
    parser = argparse.ArgumentParser(prog="aurora")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["sim", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
