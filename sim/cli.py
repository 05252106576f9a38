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
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aurora.faults import EXAMPLES as FAULT_EXAMPLES
from aurora.faults import FAULT_KINDS
from aurora.faults import SYNTAX as FAULT_SYNTAX

DEFAULT_STRATEGIES = "aurora,prime-full,ideal-singledc"


def add_parser(subparsers: Any) -> None:
    """Add ``sim`` to an ``argparse`` subparsers object."""
    from aurora.strategies import STRATEGIES

    p = subparsers.add_parser(
        "sim",
        help="simulate a deployment and print a summary table",
        description=__doc__.split("\n\n")[0],
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
    from sim.model import Simulation, SimulationStalled
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
        f"{args.steps} steps, workload {args.workload}, seed {args.seed}{what}"
    )
    header = (
        f"{'strategy':<18} {'step time s':>11} {'tokens/s':>10} {'WAN GB/step':>11} "
        f"{'expired':>7} {'sim h':>6}  output"
    )
    lines, results, stalled = [], [], []
    for cfg in configs:
        name = cfg.strategy.name
        bar = tqdm(total=cfg.steps, desc=name, unit="step", leave=False)
        try:
            result = Simulation(cfg, progress=lambda _step, bar=bar: bar.update(1)).run()
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
        results.append((name, result))
        s = result.summary(warmup=min(2, len(result.rows) - 1))
        lines.append(
            f"{name:<18} {s['step_time_s']:>11.1f} {s['tokens_per_s']:>10,.0f} "
            f"{s['wan_gb_per_step']:>11.3f} {s['expired_leases']:>7} "
            f"{s['sim_time_s'] / 3600:>6.2f}  {written}"
            + ("  STALLED" if problem is not None else "")
        )
    print(header)
    print("\n".join(lines))
    if results:
        figure = figure_of(results, out / f"{topology.name}{suffix}.png", title=what.lstrip(", "))
        print(f"figure: {figure}")
    print("(means over steps after the first two; rows per step in each output folder)")
    for line in stalled:
        print(f"aurora sim: {line}", file=sys.stderr)
    return 1 if stalled else 0


def figure_of(results: list[tuple[str, Any]], path: Path, title: str = "") -> Path:
    """Tokens/s per step and cumulative WAN bytes, one line per strategy."""
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")  # a file, not a window (only when nothing chose a backend)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    # Strategies often coincide (AuroraRL runs at Ideal-SingleDC's rate when Trainer-bound):
    # each gets its own line style and marker, and later lines are drawn thinner, so one drawn
    # exactly over another still shows.
    styles = ("-", "--", ":", "-.")
    markers = ("o", "s", "^", "D", "v", "P", "X", "*")
    for i, (name, result) in enumerate(results):
        rows = result.rows
        steps = [r["step"] for r in rows]
        every = max(len(rows) // 8, len(results))
        look = {
            "ls": styles[i % len(styles)],
            "marker": markers[i % len(markers)],
            "lw": max(2.6 - 0.4 * i, 1.0),
            "ms": max(7 - i, 3),
            # Markers on staggered steps, so coinciding lines show every marker.
            "markevery": (i % every, every),
            "mfc": "none",
            "label": name,
        }
        a.plot(steps, [r["tokens_per_s"] for r in rows], **look)
        wan, total = [], 0.0
        for r in rows:
            total += r["wan_bytes"] / 1e9
            wan.append(total)
        b.plot([r["time_s"] / 3600 for r in rows], wan, **look)
    a.set(xlabel="training step", ylabel="throughput (tokens/s)", title="throughput per step")
    a.xaxis.set_major_locator(MaxNLocator(integer=True))
    b.set(xlabel="simulated time (h)", ylabel="WAN traffic (GB, cumulative)", title="WAN bytes")
    for ax in (a, b):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
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
