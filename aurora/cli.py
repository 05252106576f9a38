"""The ``aurora`` command: one subcommand per way in (see ``build_parser`` for the list).

``main`` turns what a user can cause into one line on stderr: a missing optional extra names its
install command (:mod:`aurora.extras`) instead of ending in a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def _replay(args: argparse.Namespace) -> int:
    from aurora.policy.events import event_from_record, to_record
    from aurora.policy.ledger import LedgerConfig, decide, initial_state

    try:
        with open(args.trace) as f:
            rows = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"aurora replay: cannot read {args.trace}: {exc}") from None
    state = initial_state(LedgerConfig(trainer_region=args.trainer_region))
    settled = 0  # counted from the decisions: the book forgets settled batches as it goes
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
            settled += name == "Accepted"
            print(f"{'':>11}-> {name:<14} {rec}")
    print(
        f"\n{len(rows)} events; pool={state.book.pool_size}, settled={settled}, "
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


DESCRIPTION = (
    "AuroraRL: RL post-training of LLMs over decentralized networks. Simulate a deployment "
    "(sim), run it on real processes (real, or one role per host: trainer, ledger, relay, "
    "actor), inspect its artifacts (delta, replay, export) and manage its keys (keys). "
    "The README and docs/ say more."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aurora", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "replay",
        help="replay a Ledger event trace and print every decision",
        description="Replay a recorded Job Ledger event trace through the policy core "
        "(aurora/policy) and print every event with the actions decided for it.",
    )
    p.add_argument("trace", help="JSON list of {now, event} rows (tests/golden/ledger_trace.json)")
    p.add_argument("--trainer-region", default="us", help="the Trainer's region (default: us)")
    p.set_defaults(func=_replay)
    from sim import cli as sim_cli

    sim_cli.add_parser(sub)
    delta = sub.add_parser(
        "delta",
        help="delta checkpoints: inspect a file, benchmark the codecs",
        description="Delta checkpoints, the file each policy version travels and is stored as.",
    ).add_subparsers(dest="delta_cmd", required=True, metavar="COMMAND")
    p = delta.add_parser(
        "inspect",
        help="print a delta checkpoint's header and tensor table",
        description="Read a delta checkpoint file, verify it (segment hashes, Merkle root, "
        "every record) and print its header and one line per changed tensor.",
    )
    p.add_argument("file", help="the delta checkpoint file (e.g. STORE/deltas/v00000003.delta)")
    p.set_defaults(func=_inspect)
    p = delta.add_parser(
        "bench",
        help="codec sizes on a synthetic Qwen3-8B-layer step",
        description="Build a synthetic optimizer step shaped like Qwen3-8B layers, write it as a "
        "delta checkpoint with every codec, check a bit-exact apply and print bytes per changed "
        "weight beside the paper's LEB128 format.",
    )
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
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic step (default 0)")
    p.set_defaults(func=_bench)
    from aurora import keys
    from aurora.runtime.cli import add_parsers

    keys.add_parser(sub)
    add_parsers(sub)
    from aurora.rl import cli as rl_cli
    from emulation import cli as emulation_cli

    emulation_cli.add_parser(sub)
    rl_cli.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except Exception as exc:
        from aurora.extras import explain

        line = explain(exc)
        if line is None:
            raise
        print(f"aurora {args.command}: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
