"""The ``aurora`` command.

    aurora replay TRACE.json      replay a Ledger event trace through aurora.policy and print
                                  every decision (the golden trace in tests/golden is one)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def _replay(args: argparse.Namespace) -> int:
    from aurora.policy.ledger import LedgerConfig, decide, event_from_record, initial_state, to_record

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
    print(f"\n{len(rows)} events; pool={state.book.pool_size}, settled={len(state.book.done)}, "
          f"live leases={len(state.book.leased)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aurora", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("replay", help="replay a Ledger event trace and print every decision")
    p.add_argument("trace", help="JSON list of {now, event} rows (tests/golden/ledger_trace.json)")
    p.add_argument("--trainer-region", default="us", help="the Trainer's region (default: us)")
    p.set_defaults(func=_replay)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
