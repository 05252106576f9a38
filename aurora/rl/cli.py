"""``aurora warmstart``: build (or find) the cached v0 snapshot of the default model.

``aurora/cli.py`` adds it through :func:`add_parser` and :func:`run`; ``python -m aurora.rl.cli``
runs it alone. Prints the cache key, the supervised steps, the validation accuracy,
h(v0) and where the snapshot is; ``--export DIR`` also writes it as a Hugging Face directory.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "warmstart",
        help="build or find the warm-started default model (the cached v0 snapshot)",
        description="Build the warm-started default model (a tiny Qwen3 trained on 3-digit "
        "addition until it reaches the validation threshold) or find it in the cache, and print "
        "where its v0 snapshot is. Needs the torch extra: pip install -e '.[torch]'.",
    )
    p.add_argument(
        "--cache", default=None, help="cache root (default $AURORA_CACHE or ~/.cache/aurora)"
    )
    p.add_argument(
        "--export", default=None, metavar="DIR", help="also write a Hugging Face model directory"
    )
    p.add_argument(
        "--threshold", type=float, default=None, help="greedy validation accuracy to stop at"
    )
    p.add_argument("--max-steps", type=int, default=None, help="give up after this many steps")
    p.add_argument("--eval-every", type=int, default=None, help="steps between validation checks")
    p.add_argument("--batch-size", type=int, default=None, help="problems per supervised step")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from aurora.models import save_pretrained
    from aurora.rl.warmstart import WarmStartConfig, WarmStartError, warm_start

    overrides = {
        k: v
        for k, v in {
            "threshold": args.threshold,
            "max_steps": args.max_steps,
            "eval_every": args.eval_every,
            "batch_size": args.batch_size,
        }.items()
        if v is not None
    }
    try:
        cfg = dataclasses.replace(WarmStartConfig(), **overrides)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        ws = warm_start(cfg, cache_dir=args.cache)
    except WarmStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"warm start {cfg.key()}: {'cached' if ws.cached else 'built'}, "
        f"{ws.info.get('steps')} steps, validation accuracy "
        f"{ws.info.get('validation_accuracy', float('nan')):.1%}, h(v0) {ws.weights_hash[:16]}.., "
        f"snapshot {ws.path / 'snapshots' / 'v00000000.safetensors'}"
    )
    if args.export:
        try:
            out = save_pretrained(ws.model, ws.tokenizer, args.export, state=ws.state)
        except FileExistsError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"exported {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aurora")
    sub = parser.add_subparsers(required=True)
    add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
