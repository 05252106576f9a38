"""Run every experiment (quick by default, ``--full`` for paper scale) and write the tables of
paper-vs-ours numbers to ``results/REPRODUCTION-tables.md`` for docs/REPRODUCTION.md.

    python -m experiments.all [--full] [--out results]
"""

from __future__ import annotations

import contextlib
import importlib
import io
from pathlib import Path

from tqdm import tqdm

from experiments.common import parser, results_root

EXPERIMENTS = (
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


def main(argv: list[str] | None = None) -> Path:
    args = parser(__doc__.split("\n\n")[0]).parse_args(argv)
    root = results_root(args)
    flags = (["--full"] if args.full else []) + ["--out", str(root)]
    sections = []
    for name in tqdm(EXPERIMENTS, desc="experiments", unit="exp"):
        module = importlib.import_module(f"experiments.{name}")
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            module.main(flags)
        sections.append(
            f"## {name}\n\n`python -m experiments.{name}`\n\n```\n{buf.getvalue()}```\n"
        )
    path = root / "REPRODUCTION-tables.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# Paper vs simulated, every experiment\n\n" + "\n".join(sections))
    print(f"tables: {path}")
    return path


if __name__ == "__main__":
    main()
