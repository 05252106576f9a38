"""``aurora emulate``: build a topology's emulated WAN, probe it, print ``emulation.json``.

For checking what the emulator gives on a machine before a run (``aurora real --emulate`` uses
the same :func:`emulation.network.build_network`), and for removing what a killed run left
(``--cleanup``). Needs root. Errors print one line and exit with 2 (bad input) or 1 (this
machine cannot emulate what was asked).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "emulate",
        help="build a topology's emulated WAN in network namespaces, probe it, print it",
        description="Build a topology's emulated WAN (each region a network namespace behind "
        "a router that shapes rate, RTT, loss and fluctuation), probe every direction, print "
        "what was built as JSON and remove it. Needs root: run it as root (sudo).",
    )
    p.add_argument("--topology", help="topology YAML (regions, links)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every link rate")
    p.add_argument(
        "--backend",
        choices=("auto", "netns", "mininet"),
        default="auto",
        help="how the namespaces are made: netns (ip netns), mininet, or auto (netns)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the fluctuation draws")
    p.add_argument("--out", help="write emulation.json here (default: print it)")
    p.add_argument(
        "--tcp-window-bytes",
        type=int,
        help="TCP autotuning ceiling in the regions (default: the host's)",
    )
    p.add_argument("--no-verify", action="store_true", help="do not fail on a probe miss")
    p.add_argument(
        "--cleanup",
        action="store_true",
        help="remove networks left by killed runs (their builder is gone) and exit",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from emulation.cleanup import cleanup_leftovers
    from emulation.network import build_network
    from emulation.plan import EmulationError

    if args.cleanup:
        try:
            reports = cleanup_leftovers()
        except PermissionError as exc:
            print(f"aurora emulate: {exc}", file=sys.stderr)
            return 1
        for report in reports:
            print(json.dumps(report))
        print(f"removed {len(reports)} emulated network(s)", file=sys.stderr)
        return 0
    if not args.topology:
        print("aurora emulate: --topology is required (or --cleanup)", file=sys.stderr)
        return 2
    from aurora.topology import load_topology

    try:
        topology = load_topology(args.topology)
        with build_network(
            topology,
            scale=args.scale,
            backend=args.backend,
            seed=args.seed,
            verify=not args.no_verify,
            tcp_window_bytes=args.tcp_window_bytes,
        ) as net:
            if args.no_verify:
                net.probe()
            text = json.dumps(net.describe(), indent=2)
    except ValueError as exc:
        print(f"aurora emulate: {exc}", file=sys.stderr)
        return 2
    except EmulationError as exc:
        print(f"aurora emulate: {exc}", file=sys.stderr)
        return 1
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="aurora")
    add_parser(ap.add_subparsers(dest="command", required=True))
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
