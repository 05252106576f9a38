"""The ``aurora`` command.

aurora sim --topology T.yaml  simulate a deployment (SimPy, traces, the real policy core) for
                              one or more strategies and print a summary table
aurora delta bench            encode a synthetic Qwen3-8B-layer step with every codec,
                              verify bit-exact apply, print sizes against the paper's
aurora delta inspect FILE     print a delta checkpoint's header and tensor table
aurora replay TRACE.json      replay a Ledger event trace through aurora.policy and print
                              every decision (the golden trace in tests/golden is one)
aurora real --topology T.yaml run the deployment on real processes on this host (Trainer,
                              Ledger, relays, Actors), over loopback
aurora trainer|ledger|relay|actor
                              one role of a real deployment, for separate hosts
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from aurora.faults import EXAMPLES as FAULT_EXAMPLES


def _replay(args: argparse.Namespace) -> int:
    from aurora.policy.ledger import (
        LedgerConfig,
        decide,
        event_from_record,
        initial_state,
        to_record,
    )

    try:
        with open(args.trace) as f:
            rows = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"aurora replay: cannot read {args.trace}: {exc}") from None
    state = initial_state(LedgerConfig(trainer_region=args.trainer_region))
    for i, row in enumerate(rows):
        try:
            event = event_from_record(row["event"])
            _, actions = decide(state, event, now=float(row["now"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise SystemExit(f"aurora replay: {args.trace}: row {i}: {exc}") from None
        fields = {k: v for k, v in row["event"].items() if k != "type"}
        print(f"{row['now']:>9.2f}  {row['event']['type']:<18} {fields}")
        for action in actions:
            rec = to_record(action)
            name = rec.pop("type")
            print(f"{'':>11}-> {name:<14} {rec}")
    print(
        f"\n{len(rows)} events; pool={state.book.pool_size}, settled={len(state.book.done)}, "
        f"live leases={len(state.book.leased)}"
    )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from aurora.delta.errors import DeltaError
    from aurora.store.files import read_delta_file

    try:
        d = read_delta_file(args.file)
    except OSError as exc:
        raise SystemExit(f"aurora delta inspect: cannot read {args.file}: {exc}") from None
    except DeltaError as exc:
        raise SystemExit(
            f"aurora delta inspect: {args.file}: {type(exc).__name__}: {exc}"
        ) from None
    nnz = sum(t.nnz for t in d.tensors)
    numel = sum(t.numel for t in d.tensors)
    print(f"delta checkpoint {args.file}  ({d.size:,} bytes, verified)")
    print(f"  model      {d.model}")
    print(f"  version    v{d.version}  (base v{d.base})")
    print(f"  h(v-1)     {d.base_hash}")
    print(f"  id(D_v)    {d.id}")
    print(f"  h(v)       {d.weights_hash}")
    print(f"  segments   {len(d.leaves)} x {d.segment_size:,} B")
    print(
        f"  changed    {nnz:,} of {numel:,} elements in changed tensors, {len(d.tensors)} tensors, "
        f"{d.size / max(nnz, 1):.3f} B per change"
    )
    print(
        f"\n  {'tensor':<52} {'shape':>14} {'nnz':>11} {'density':>8} {'codec':>13} {'bytes':>11}"
    )
    for t in d.tensors:
        shape = "x".join(map(str, t.shape))
        print(
            f"  {t.name:<52} {shape:>14} {t.nnz:>11,} {t.nnz / t.numel:>8.2%} {t.codec:>13} "
            f"{t.nbytes:>11,}"
        )
    return 0


def _bench(args: argparse.Namespace) -> int:
    from aurora.codec_bench import run_codec_bench

    run_codec_bench(params=args.params, densities=args.density, out=args.out, seed=args.seed)
    return 0


def _sim(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from aurora.faults import parse_fault
    from aurora.topology import load_topology
    from sim.config import SimConfig, strategy
    from sim.model import Simulation, SimulationStalled
    from sim.output import write_result
    from sim.traces import load_traces

    try:
        topology = load_topology(args.topology)
        traces = load_traces(args.traces) if args.traces else load_traces()
        strategies = [strategy(name.strip()) for name in args.strategy.split(",") if name.strip()]
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
                record_trace=args.actors_trace,
            )
            for s in strategies
        ]
    except ValueError as exc:
        raise SystemExit(f"aurora sim: {exc}") from None
    print(
        f"{topology.name}: {topology.trainer.model} on {topology.trainer.gpus} x "
        f"{topology.trainer.gpu}, {sum(g.count for g in topology.actors)} Actors, "
        f"{args.steps} steps, workload {args.workload}, seed {args.seed}"
    )
    header = (
        f"{'strategy':<18} {'step time s':>11} {'tokens/s':>10} {'WAN GB/step':>11} "
        f"{'expired':>7} {'sim h':>6}  output"
    )
    lines = []
    results = []
    for cfg in configs:
        bar = tqdm(total=cfg.steps, desc=cfg.strategy.name, unit="step", leave=False)
        sim = Simulation(cfg, progress=lambda _step, bar=bar: bar.update(1))
        try:
            result = sim.run()
        except (ValueError, SimulationStalled) as exc:
            raise SystemExit(f"aurora sim: {cfg.strategy.name}: {exc}") from None
        finally:
            bar.close()
        out = write_result(
            result, cfg, f"{args.out}/{topology.name}-{cfg.strategy.name}-s{cfg.seed}"
        )
        results.append((cfg.strategy.name, result))
        s = result.summary(warmup=min(2, cfg.steps - 1))
        lines.append(
            f"{cfg.strategy.name:<18} {s['step_time_s']:>11.1f} {s['tokens_per_s']:>10,.0f} "
            f"{s['wan_gb_per_step']:>11.3f} {s['expired_leases']:>7} "
            f"{s['sim_time_s'] / 3600:>6.2f}  {out}"
        )
    figure = _sim_figure(results, f"{args.out}/{topology.name}.png")
    print(header)
    print("\n".join(lines))
    print(f"figure: {figure}")
    print("(means over steps after the first two; rows per step in each output folder)")
    return 0


def _sim_figure(results: list[tuple[str, object]], path: str) -> str:
    """Tokens/s per step and cumulative WAN bytes, one line per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, result in results:
        rows = result.rows  # type: ignore[attr-defined]
        steps = [r["step"] for r in rows]
        a.plot(steps, [r["tokens_per_s"] for r in rows], marker=".", label=name)
        wan, total = [], 0.0
        for r in rows:
            total += r["wan_bytes"] / 1e9
            wan.append(total)
        b.plot([r["time_s"] / 3600 for r in rows], wan, label=name)
    a.set(xlabel="training step", ylabel="throughput (tokens/s)", title="throughput per step")
    b.set(xlabel="simulated time (h)", ylabel="WAN traffic (GB, cumulative)", title="WAN bytes")
    for ax in (a, b):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aurora", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("replay", help="replay a Ledger event trace and print every decision")
    p.add_argument("trace", help="JSON list of {now, event} rows (tests/golden/ledger_trace.json)")
    p.add_argument("--trainer-region", default="us", help="the Trainer's region (default: us)")
    p.set_defaults(func=_replay)
    p = sub.add_parser("sim", help="simulate a deployment and print a summary table")
    p.add_argument("--topology", required=True, help="topology YAML (examples/geo.yaml)")
    p.add_argument(
        "--strategy",
        default="aurora,prime-full,ideal-singledc",
        help="comma-separated strategies (aurora, aurora-leb128, aurora-naive, aurora-1stream, "
        "aurora-norelay, aurora-uniform, aurora-nocut, prime-full, prime-async2, prime-async4, "
        "prime-multistream, ideal-singledc)",
    )
    p.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workload", default="gsm8k", help="workload in the traces (default gsm8k)")
    p.add_argument("--traces", default=None, help="trace YAML (default: sim/traces/paper.yaml)")
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        help="membership or network event, repeatable: " + ", ".join(FAULT_EXAMPLES),
    )
    p.add_argument(
        "--spot-hazard", type=float, default=0.0, help="preemptions per hour per spot Actor"
    )
    p.add_argument(
        "--no-trace",
        dest="actors_trace",
        action="store_false",
        help="skip the event trace and timeline (large deployments)",
    )
    p.add_argument("--out", default="results/sim", help="output folder (default results/sim)")
    p.set_defaults(func=_sim)
    delta = sub.add_parser("delta", help="delta checkpoints").add_subparsers(
        dest="delta_cmd", required=True
    )
    p = delta.add_parser("inspect", help="print a delta checkpoint's header and tensor table")
    p.add_argument("file")
    p.set_defaults(func=_inspect)
    p = delta.add_parser("bench", help="codec sizes on a synthetic Qwen3-8B-layer step")
    p.add_argument(
        "--params",
        type=float,
        default=50e6,
        help="parameters in the synthetic step (default 50e6; 193e6 = one whole layer)",
    )
    p.add_argument(
        "--density",
        type=float,
        nargs="+",
        default=[0.01, 0.02],
        help="share of bf16 weights changed by the step (default 0.01 0.02)",
    )
    p.add_argument(
        "--out", default="results/delta_bench", help="folder for the CSV and a sample delta"
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_bench)
    from aurora import keys
    from aurora.runtime.cli import add_parsers

    keys.add_parser(sub)
    add_parsers(sub)
    from emulation import cli as emulation_cli

    emulation_cli.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
