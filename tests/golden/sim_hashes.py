"""Hashes of the simulator's outputs for a set of golden configurations, to show that a refactor
leaves them byte-identical: each run's step rows, event trace, timeline, fed events and decisions
(also without ``BatchCompleted``, the action the unified policy core added), and every file
``aurora sim`` writes for examples/geo.yaml, plain and with ``--fault preempt:ca-a100-1@step=6``
(``git_sha`` left out: it names the tree). Run it in two trees and diff the output:

    cd TREE && PYTHONPATH=TREE python -m tests.golden.sim_hashes > a.json

About 10 s on two cores.
"""

import csv
import hashlib
import io
import json
import pathlib
import subprocess
import sys
import tempfile
from typing import Any

from aurora.faults import parse_fault
from aurora.policy.events import to_record
from aurora.strategies import STRATEGIES, strategy
from aurora.topology import load_topology
from aurora.traces import load_traces
from sim.config import SimConfig
from sim.model import Result, simulate
from tests.test_sim import tiny_config

GEO = pathlib.Path(__file__).resolve().parents[2] / "examples" / "geo.yaml"


def _h(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def digest(res: Result) -> dict[str, Any]:
    decisions = [[to_record(a) for a in acts] for acts in res.decisions]
    plain = [[a for a in acts if a["type"] != "BatchCompleted"] for acts in decisions]
    return {
        "rows": _h(res.rows),
        "trace": _h([list(t) for t in res.trace]),
        "timeline": _h(res.timeline),
        "fed": _h([(now, to_record(e)) for now, e in res.fed]),
        "decisions": _h(decisions),
        "decisions_without_completion": _h(plain),
        "completions": sum(len(a) - len(b) for a, b in zip(decisions, plain, strict=True)),
    }


def geo(name: str, steps: int = 12, **kw: Any) -> SimConfig:
    return SimConfig(
        topology=load_topology(GEO),
        traces=load_traces(),
        strategy=strategy(name),
        steps=steps,
        **kw,
    )


def faults(*specs: str) -> tuple[Any, ...]:
    return tuple(parse_fault(s) for s in specs)


CONFIGS = {
    "tiny": lambda: tiny_config(),
    "tiny-seq": lambda: tiny_config(publish_pipeline="sequential"),
    "tiny-ctl": lambda: tiny_config(control_latency=True),
    "tiny-seq-ctl": lambda: tiny_config(publish_pipeline="sequential", control_latency=True),
    "parity": lambda: geo(
        "aurora", 8, faults=faults("preempt:ca-a100-3@step=3", "join:new-1:ca:A100@step=5")
    ),
    "preempt6": lambda: geo("aurora", 10, faults=faults("preempt:ca-a100-1@step=6")),
    "mixed-faults": lambda: geo(
        "aurora",
        10,
        faults=faults(
            "preempt_notice:ca-a100-2@t=120,notice=30",
            "leave:ca-a100-3@step=4",
            "relay_fail:ca-a100-0@t=130",
            "link_cut:us-ca@t=60,for=20",
            "trainer_crash@t=500",
        ),
    ),
    "prime-relayfail": lambda: geo("prime-full", 6, faults=faults("relay_fail:ca-a100-0@t=130")),
    "seq-ctl": lambda: geo("aurora", 8, publish_pipeline="sequential", control_latency=True),
    "ctl-cut": lambda: geo(
        "aurora",
        8,
        control_latency=True,
        faults=faults("link_cut:us-ca@t=60,for=20", "preempt:ca-a100-1@step=3"),
    ),
    **{f"geo-{name}": (lambda name=name: geo(name)) for name in STRATEGIES},
}


def _file_hash(path: pathlib.Path) -> str:
    text = path.read_text()
    if path.suffix == ".csv":
        rows = list(csv.DictReader(io.StringIO(text)))
        for r in rows:
            r.pop("git_sha", None)
        text = json.dumps(rows)
    elif path.suffix == ".json":
        summary = json.loads(text)
        summary.pop("git_sha", None)
        text = json.dumps(summary, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cli_files(extra: list[str]) -> dict[str, str]:
    # The CLI runs cohort mode unless told --exact (a tree without the flag has only exact
    # mode): the reference is exact mode's byte order of same-instant trace lines.
    usage = subprocess.run(
        [sys.executable, "-m", "aurora.cli", "sim", "--help"], capture_output=True, text=True
    ).stdout
    if "--exact" in usage:
        extra = ["--exact", *extra]
    with tempfile.TemporaryDirectory() as d:
        subprocess.run(
            [sys.executable, "-m", "aurora.cli", "sim", "--topology", str(GEO), "--out", d, *extra],
            check=True,
            capture_output=True,
        )
        return {
            str(p.relative_to(d)): _file_hash(p)
            for p in sorted(pathlib.Path(d).rglob("*"))
            if p.is_file() and p.suffix != ".png"
        }


def main() -> dict[str, Any]:
    out: dict[str, Any] = {name: digest(simulate(make())) for name, make in CONFIGS.items()}
    out["cli-default"] = cli_files([])
    out["cli-preempt6"] = cli_files(["--fault", "preempt:ca-a100-1@step=6"])
    return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=1, sort_keys=True))
