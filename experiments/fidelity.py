"""The simulator against repeated real runs at a real model's size where the network dominates:
predictions from the host profile and the configuration alone, written before the runs.

    python -m experiments.fidelity predict --set campaign        # writes the predictions file
    git add experiments/predictions/fidelity-campaign.json && git commit   # BEFORE any run
    python -m experiments.fidelity run --set campaign --repeats 5       # root, an idle machine
    python -m experiments.fidelity score --set campaign                 # prediction vs the mean
    python -m experiments.fidelity estimate --set campaign              # wall time, no runs

Every case is ``aurora real`` on the ``shapes`` backend (Qwen3-0.6B's tensors) over the emulated
WAN at ``scale`` 1 (:class:`Case`). :func:`predict` simulates each case from the host profile and
the case alone; :func:`run` refuses to start while the predictions file is not committed
unchanged; :func:`score` judges each prediction against the mean of the real runs, with their
spread beside it. A case counts where the network dominates (:func:`wire_ratio`)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from aurora.provenance import git_sha
from experiments.common import RESULTS, plain

NAME = "fidelity"
ROOT = Path(__file__).resolve().parent.parent
PREDICTIONS = ROOT / "experiments" / "predictions"
MODEL = "qwen3-0.6b-shapes"
DENSITY = 0.02
"""Share of bf16 elements a step changes (the transfer regime; 28.3 MB a version at 0.6B)."""
TOKENS_PER_S = 40.0
"""Stand-in generation per Actor (tokens/s): 8 prompts x 2 completions x 5 tokens a step."""
SEEDS = 5
"""Simulated seeds per case (the loss-recovery draws): the prediction is their mean."""
WARMUP = 1
"""Versions and steps left out of the means (the first waits for every Actor to load v0)."""
WIRE_OVER_EXTRACT = 3.0
"""A case is network-dominated when a version's wire time is at least this x extraction."""
TOLERANCE = 0.10
"""The target: prediction within +-10% of the mean of the real runs."""
STARTUP_S = 75.0
"""Seconds a run spends outside its steps (the Trainer's 0.6B master and v0 snapshot, the
Actors loading it, the emulated network's build and probe), for ``estimate``; measured by the
smoke runs (``startup_s`` in the rows) and replaced by their mean where rows exist."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Region:
    """An Actor region behind its own link to the Trainer's."""

    name: str
    """Region name."""
    mbit: float
    """The link's rate (Mbit/s)."""
    rtt_ms: float
    """The link's round-trip time (ms)."""
    loss: float
    """The link's random packet loss (each direction)."""
    actors: int = 2
    """Actors in the region."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One configuration of the campaign.

    Every case is ``aurora real`` on the ``shapes`` backend (Qwen3-0.6B's tensors, a synthetic
    step changing ``density`` of the bf16 elements: 28 MB per version at 2%) over the emulated
    WAN at ``scale`` 1: the Trainer in ``us``, Actors in one or two remote regions behind their
    own links (rate, RTT, loss), the congestion control named in the topology and set on every
    data socket, the strategy ``aurora`` with its streams, relays and cut-through as the case
    says. Generation is the stand-in's, timed at ``tokens_per_s`` per Actor.
    """

    name: str
    """Case id (rows, predictions, run folders)."""
    regions: tuple[Region, ...]
    """The Actor regions and their links."""
    congestion: str
    """TCP congestion control of every data socket (``reno``, ``cubic``, ``bbr``)."""
    streams: int = 4
    """Parallel TCP streams per transfer."""
    relays: bool = True
    """One relay per remote region (else every Actor fetches across its link)."""
    cut_through: bool = True
    """Relays forward each verified segment at once (else store-and-forward)."""
    steps: int = 6
    """Training steps a run makes (versions 2..steps are measured)."""
    prompts_per_step: int = 8
    """Prompts a step (each a lease of ``group_size`` completions)."""
    group_size: int = 2
    """Completions per prompt."""
    density: float = DENSITY
    """Share of bf16 elements a step changes."""
    tokens_per_s: float = TOKENS_PER_S
    """Stand-in generation per Actor (tokens/s)."""
    model: str = MODEL
    """The ``shapes`` model (``qwen3-tiny-shapes`` only in the harness's own test)."""

    @property
    def actors(self) -> int:
        return sum(r.actors for r in self.regions)


def _ca(mbit: float, rtt: float, loss: float, actors: int = 2) -> tuple[Region, ...]:
    return (Region(name="ca", mbit=mbit, rtt_ms=rtt, loss=loss, actors=actors),)


SETS: dict[str, tuple[Case, ...]] = {
    "smoke": (
        Case(name="bbr-50-80-l0.5-s4", regions=_ca(50, 80, 0.005), congestion="bbr"),
        Case(name="cubic-100-40-l0.1-s4", regions=_ca(100, 40, 0.001), congestion="cubic"),
    ),
    "campaign": (
        # The base: four cubic streams, each loss-limited (0.1% at 80 ms: ~5.6 Mbit/s a stream),
        # well below the 50 Mbit/s link: ~10 s of wire a version.
        Case(name="cubic-50-80-l0.1-s4", regions=_ca(50, 80, 0.001), congestion="cubic"),
        # Streams under a loss-based control: one stream (~32 Mbit/s at 0.05%, 20 ms) against
        # four, which fill the link.
        Case(
            name="cubic-50-20-l0.05-s1",
            regions=_ca(50, 20, 0.0005),
            congestion="cubic",
            streams=1,
        ),
        Case(name="cubic-50-20-l0.05-s4", regions=_ca(50, 20, 0.0005), congestion="cubic"),
        # bbr is not loss-limited: 1% at 80 ms still fills the link.
        Case(name="bbr-50-80-l1-s4", regions=_ca(50, 80, 0.01), congestion="bbr"),
        # No relay: both Actors pull across the link (twice the bytes on it).
        Case(
            name="bbr-50-40-l0.5-norelay",
            regions=_ca(50, 40, 0.005),
            congestion="bbr",
            relays=False,
        ),
        # Store-and-forward at the relay (against the base's cut-through).
        Case(
            name="cubic-50-80-l0.1-sf",
            regions=_ca(50, 80, 0.001),
            congestion="cubic",
            cut_through=False,
        ),
        # Two Actor regions on different links.
        Case(
            name="two-regions-bbr",
            regions=(
                Region(name="ca", mbit=50, rtt_ms=40, loss=0.001, actors=1),
                Region(name="eu", mbit=100, rtt_ms=150, loss=0.005, actors=1),
            ),
            congestion="bbr",
        ),
        # 4 Actors behind the relay (19 GB of processes at 0.6B: an otherwise idle host).
        Case(name="cubic-50-80-l0.1-a4", regions=_ca(50, 80, 0.001, 4), congestion="cubic"),
    ),
}
"""The sets of cases: ``smoke`` validates the harness; ``campaign`` is the held-out set
(predicted and committed before any of its runs)."""


def topology_yaml(case: Case) -> dict[str, Any]:
    regions = [{"name": "us"}] + [{"name": r.name} for r in case.regions]
    return {
        "name": f"fid-{case.name}",
        "trainer": {"region": "us", "model": "qwen3-8b", "gpu": "H100", "gpus": 1},
        "regions": regions,
        "links": [
            {"a": "us", "b": r.name, "gbps": r.mbit / 1e3, "rtt_ms": r.rtt_ms, "loss": r.loss}
            for r in case.regions
        ],
        "actors": [
            {"region": r.name, "gpu": "A100", "count": r.actors, "spot": False}
            for r in case.regions
        ],
        "congestion": case.congestion,
        "real": {
            "model": case.model,
            "steps": case.steps,
            "prompts_per_step": case.prompts_per_step,
            "group_size": case.group_size,
            "actors": case.actors,
            "regime": "transfer",
            "snapshot_interval": 1000,
            "lease_initial_s": 300.0,
        },
    }


def topology(case: Case) -> Any:
    from aurora.topology import topology_from_dict

    return topology_from_dict(topology_yaml(case), source=f"fidelity case {case.name}")


def strategy_of(case: Case) -> Any:
    from sim.config import replace_strategy, strategy

    return replace_strategy(
        strategy("aurora"),
        streams=case.streams,
        relays=case.relays,
        cut_through=case.cut_through,
    )


def profile_path(path: str | None = None) -> Path:
    import socket

    if path:
        return Path(path)
    return ROOT / "evidence" / "host_profile" / f"{socket.gethostname()}.json"


# ------------------------------------------------------------------------------------------
# Predictions (from the host profile and the case alone)
# ------------------------------------------------------------------------------------------


def sim_config(case: Case, profile: dict[str, Any], seed: int) -> Any:
    from aurora.runtime.job import plan_processes
    from sim.hostprofile import profile_config

    topo = topology(case)
    plan = plan_processes(topo, relays=case.relays)
    return profile_config(
        profile,
        topo,
        strategy=strategy_of(case),
        actors=[(a.id, a.region) for a in plan.actors],
        relays=list(plan.relays),
        density=case.density,
        tokens_per_s=case.tokens_per_s,
        steps=case.steps,
        seed=seed,
    )


def wire_ratio(case: Case, profile: dict[str, Any]) -> dict[str, float]:
    """A version's wire time on the slowest path under the case's TCP model, and that over
    the profile's extraction time (the network-dominated criterion).

    A case counts where the network dominates: the predicted wire time of a version (its bytes
    over the slowest path's rate under the case's TCP model) is at least ``WIRE_OVER_EXTRACT``
    times the profile's extraction time.
    """
    from sim.tcp import tcp_cap

    cfg = sim_config(case, profile, 0)
    model = cfg.traces.model(cfg.topology.trainer.model)
    size = model.delta_bytes_leb128.value
    window = cfg.traces.constants.tcp_window_bytes.value
    worst = 0.0
    for lk in cfg.topology.links:
        cap = tcp_cap(
            streams=case.streams,
            rtt_s=lk.rtt_ms / 1e3,
            loss=lk.loss,
            window_bytes=window,
            mss_bytes=cfg.traces.constants.mss_bytes.value,
            congestion=case.congestion,
        )
        copies = 1 if case.relays else sum(r.actors for r in case.regions if r.name == lk.b)
        worst = max(worst, copies * size / min(cap, lk.gbps * 1e9 / 8))
    return {"wire_s": worst, "wire_over_extract": worst / model.extract_s.value}


def predict(cases: Sequence[Case], profile_file: Path, *, seeds: int = SEEDS) -> dict[str, Any]:
    """Each case's simulator inputs come from the host profile (``benchmarks/host_profile.py``:
    this host's extraction, step, store, digest and apply costs per density, and what its
    emulated links deliver) and the case alone (:func:`sim.hostprofile.profile_config`); it is
    simulated with ``SEEDS`` seeds (the loss-recovery draws differ), and the mean and spread go
    to ``experiments/predictions/fidelity-<set>.json`` with the profile's digest and the commit;
    the wire ratio of each case is reported."""
    from experiments.transfer_real import sim_metrics
    from sim.hostprofile import load_profile
    from sim.model import simulate

    profile = load_profile(profile_file)
    out: dict[str, Any] = {
        "written_at_unix": time.time(),
        "git_sha": git_sha(),
        "profile": str(
            profile_file.relative_to(ROOT) if profile_file.is_relative_to(ROOT) else profile_file
        ),
        "profile_sha256": hashlib.sha256(profile_file.read_bytes()).hexdigest(),
        "seeds": seeds,
        "cases": {},
    }
    for case in cases:
        runs = [sim_metrics(simulate(sim_config(case, profile, seed))) for seed in range(seeds)]
        pred: dict[str, Any] = {"config": dataclasses.asdict(case), **wire_ratio(case, profile)}
        for m in ("extract_s", "transfer_s", "tail_s", "pause_ms", "step_time_s"):
            xs = [r[m] for r in runs if math.isfinite(r[m])]
            pred[m] = statistics.fmean(xs) if xs else math.nan
            pred[f"{m}_sd"] = statistics.pstdev(xs) if len(xs) > 1 else 0.0
        pred["network_dominated"] = pred["wire_over_extract"] >= WIRE_OVER_EXTRACT
        out["cases"][case.name] = pred
        print(
            f"{NAME}: {case.name}: transfer {pred['transfer_s']:.2f} s "
            f"(sd {pred['transfer_s_sd']:.2f}), step {pred['step_time_s']:.2f} s, "
            f"wire/extract {pred['wire_over_extract']:.1f}",
            flush=True,
        )
    return out


def predictions_file(name: str) -> Path:
    return PREDICTIONS / f"{NAME}-{name}.json"


def committed(path: Path) -> bool:
    """Whether ``path`` is in git's HEAD and unchanged in the work tree."""
    if not path.resolve().is_relative_to(ROOT):
        return False
    rel = str(path.resolve().relative_to(ROOT))
    tracked = subprocess.run(
        ["git", "-C", str(ROOT), "cat-file", "-e", f"HEAD:{rel}"], capture_output=True
    )
    if tracked.returncode != 0:
        return False
    diff = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--", rel])
    return diff.returncode == 0


# ------------------------------------------------------------------------------------------
# Real runs
# ------------------------------------------------------------------------------------------


def run_one(case: Case, repeat: int, root: Path) -> tuple[Path, dict[str, Any]]:
    """One real run of ``case`` (job seed ``repeat``), unless a complete one exists; its folder
    and what was measured around it (load, wall time)."""
    from aurora.runtime.job import strategy_spec
    from aurora.runtime.launcher import Launcher, RealRun, run_folder
    from aurora.topology import load_topology
    from experiments.transfer_real import PeakMemory, _complete

    runs = root / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    topo_path = runs / f"fid-{case.name}.yaml"
    topo_path.write_text(yaml.safe_dump(topology_yaml(case), sort_keys=False))
    strat = dataclasses.asdict(
        dataclasses.replace(
            strategy_spec("aurora"),
            streams=case.streams,
            relays=case.relays,
            cut_through=case.cut_through,
        )
    )
    run = RealRun(
        topology=load_topology(topo_path),
        topology_path=str(topo_path),
        strategy="aurora",
        seed=repeat,
        out=str(runs),
        backend="shapes",
        extra={
            "standin_tokens_per_s": case.tokens_per_s,
            "shapes_density": case.density,
            "strategy": strat,
        },
        progress=False,
        emulate="auto",
        scale=1.0,
        stall_s=600.0,
    )
    folder = run_folder(run)
    meta_path = folder / "fidelity.json"
    if _complete(folder, case.steps) and meta_path.exists():
        return folder, json.loads(meta_path.read_text())
    if folder.exists():
        shutil.rmtree(folder)
    before, t0 = os.getloadavg(), time.time()
    log = io.StringIO()
    with PeakMemory() as mem, contextlib.redirect_stdout(log):
        code = Launcher(run).main()
    (runs / f"{folder.name}.log").write_text(log.getvalue())
    (folder / "peak_memory.json").write_text(json.dumps(mem.peak, indent=2) + "\n")
    if code != 0 or not _complete(folder, case.steps):
        raise RuntimeError(f"{folder}: aurora real exited {code}; see {folder}/logs")
    meta = {
        "load_before": [round(x, 2) for x in before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "wall_s": time.time() - t0,
        "git_sha": git_sha(),
    }
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return folder, meta


def run_row(case: Case, repeat: int, folder: Path, meta: dict[str, Any]) -> dict[str, Any]:
    from experiments.transfer_real import real_metrics

    m = real_metrics(folder)
    emu = json.loads((folder / "emulation.json").read_text())
    steps = pd.read_csv(folder / "steps.csv")
    first = float(steps["time_s"].iloc[0] - steps["step_time_s"].iloc[0]) if len(steps) else 0.0
    during = (emu.get("counters") or {}).get("during_run") or {}
    tcp = during.get("tcp") or {}
    counters = {
        f"{region}_{k}": v
        for region, c in tcp.items()
        for k, v in c.items()
        if k in ("RetransSegs", "TCPLossProbes", "TCPTimeouts")
    }
    spec = json.loads((folder / "job.json").read_text())["spec"]
    return {
        "case": case.name,
        "repeat": repeat,
        "congestion": spec.get("congestion"),
        "transfer_s": m["transfer_s"],
        "step_time_s": m["step_time_s"],
        "extract_s": m["extract_s"],
        "tail_s": m["tail_s"],
        "pause_ms": m["pause_ms"],
        "delta_mb": m["delta_mb"],
        "density": m["density"],
        "prompts_lost": m["prompts_lost"],
        "hash_mismatches": m["hash_mismatches"],
        "peak_rss_gb": json.dumps(m["peak_rss_gb"], sort_keys=True),
        "links_probed": json.dumps(
            [
                {
                    "a": lk["a"],
                    "b": lk["b"],
                    "mbit": lk["gbps"] * 1e3,
                    "measured_mbit": (lk.get("measured_gbps") or 0) * 1e3,
                    "measured_rtt_ms": lk.get("measured_rtt_ms"),
                    "mechanism": lk.get("mechanism"),
                }
                for lk in emu.get("links", [])
            ]
        ),
        "tcp": json.dumps(emu.get("tcp", {}), sort_keys=True),
        "counters": json.dumps(counters, sort_keys=True),
        "startup_s": meta["wall_s"] - float(steps["time_s"].iloc[-1]) + first
        if len(steps)
        else math.nan,
        "wall_s": meta["wall_s"],
        "load_before": " ".join(f"{x:.2f}" for x in meta["load_before"]),
        "load_after": " ".join(f"{x:.2f}" for x in meta["load_after"]),
        "run": str(folder),
        "run_git_sha": meta["git_sha"],
        "config": json.dumps(dataclasses.asdict(case), sort_keys=True),
    }


def run(
    cases: Sequence[Case], *, repeats: int, root: Path, set_name: str, uncommitted: bool
) -> pd.DataFrame:
    """``--uncommitted`` lets a smoke test run with an uncommitted predictions file, and every row
    is then marked so. It makes ``repeats`` runs of each case (job seed = repeat) and appends
    one row per run to ``results/fidelity/rows.csv`` (the machine's load before and after, the
    link as probed, the TCP counters of the run)."""
    path = predictions_file(set_name)
    if not path.exists():
        raise SystemExit(f"{path}: no predictions; run `predict --set {set_name}` first")
    if not committed(path) and not uncommitted:
        raise SystemExit(
            f"{path}: not committed unchanged; commit the predictions before any run "
            "(--uncommitted for a smoke test, marked so in its rows)"
        )
    out = root / NAME
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "rows.csv"
    for repeat in range(repeats):  # one repeat of every case, then the next: load spreads evenly
        for case in cases:
            old = pd.read_csv(rows_path) if rows_path.exists() else pd.DataFrame()
            if len(old) and ((old["case"] == case.name) & (old["repeat"] == repeat)).any():
                continue
            print(
                f"{NAME}: {case.name} repeat {repeat} (load {os.getloadavg()[0]:.2f})", flush=True
            )
            folder, meta = run_one(case, repeat, out)
            row = {
                "set": set_name,
                **run_row(case, repeat, folder, meta),
                "predictions_committed": committed(path),
                "git_sha": git_sha(),
            }
            pd.concat([old, pd.DataFrame([row])], ignore_index=True).to_csv(rows_path, index=False)
            print(
                f"{NAME}: {case.name} repeat {repeat}: transfer {row['transfer_s']:.2f} s, "
                f"step {row['step_time_s']:.2f} s, extract {row['extract_s']:.2f} s, "
                f"load {row['load_before']} -> {row['load_after']}",
                flush=True,
            )
    return pd.read_csv(rows_path)


# ------------------------------------------------------------------------------------------
# Score
# ------------------------------------------------------------------------------------------

METRICS = ("transfer_s", "step_time_s", "extract_s")


def score(rows: pd.DataFrame, pred: dict[str, Any], set_name: str) -> pd.DataFrame:
    """Per case and metric: the real runs' mean, sd, min, max and count; the prediction and
    its error against the mean; whether it is within the tolerance and within the runs'
    range.

    Judged:

    * ``transfer_s``: a version's extraction starting to the Ledger counting its last Actor staged
      (versions past the first), the same interval on both sides;
    * ``step_time_s``: steps past the first.
    """
    out = []
    rows = rows[rows["set"] == set_name] if "set" in rows else rows
    for name, p in pred["cases"].items():
        g = rows[rows["case"] == name]
        if not len(g):
            continue
        for m in METRICS:
            xs = [float(x) for x in g[m] if math.isfinite(float(x))]
            mean = statistics.fmean(xs)
            sd = statistics.stdev(xs) if len(xs) > 1 else math.nan
            err = p[m] / mean - 1
            out.append(
                {
                    "case": name,
                    "metric": m,
                    "runs": len(xs),
                    "real_mean": mean,
                    "real_sd": sd,
                    "real_min": min(xs),
                    "real_max": max(xs),
                    "predicted": p[m],
                    "predicted_sd": p.get(f"{m}_sd", math.nan),
                    "error": err,
                    "within_10pct": abs(err) <= TOLERANCE,
                    "within_runs": min(xs) <= p[m] <= max(xs),
                    "network_dominated": p.get("network_dominated"),
                    "wire_over_extract": p.get("wire_over_extract"),
                    "load": " / ".join(
                        f"{a} -> {b}"
                        for a, b in zip(g["load_before"], g["load_after"], strict=True)
                    ),
                }
            )
    return pd.DataFrame(out)


def estimate(cases: Sequence[Case], pred: dict[str, Any] | None, rows: pd.DataFrame | None,
             repeats: int) -> str:  # fmt: skip
    """Wall time of ``repeats`` runs of every case: each run's start-up (the smoke runs' mean,
    else :data:`STARTUP_S`) plus its steps at the predicted step time."""
    startup = STARTUP_S
    if rows is not None and "startup_s" in rows and rows["startup_s"].notna().any():
        startup = float(rows["startup_s"].dropna().mean())
    lines, total = [], 0.0
    for case in cases:
        p = (pred or {}).get("cases", {}).get(case.name)
        step = p["step_time_s"] if p else math.nan
        each = startup + case.steps * step
        total += repeats * each
        lines.append(
            f"  {case.name:28s} {each:6.0f} s a run x {repeats} = {repeats * each / 60:5.1f} min"
        )
    lines.append(
        f"  total {len(cases)} cases x {repeats} repeats = {total / 3600:.2f} h (start-up "
        f"{startup:.0f} s a run)"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=plain((__doc__ or NAME).split("\n\n")[0]))
    p.add_argument(
        "what",
        choices=("predict", "run", "score", "estimate"),
        help="predict: write the set's predictions (commit them before any run); run: the real "
        "runs (root, the emulated WAN), then score; score: predictions against the runs' mean; "
        "estimate: the wall time of the runs, running nothing",
    )
    p.add_argument(
        "--set",
        default="smoke",
        choices=sorted(SETS),
        help="which cases: smoke (two, to try the harness) or campaign (default smoke)",
    )
    p.add_argument("--repeats", type=int, default=5, help="real runs per case")
    p.add_argument("--cases", default=None, help="only these cases (comma-separated)")
    p.add_argument("--profile", default=None, help="host profile JSON (default: this host's)")
    p.add_argument("--out", default=None, help="results root (default results/)")
    p.add_argument(
        "--uncommitted", action="store_true", help="run with predictions not yet committed"
    )
    args = p.parse_args(argv)
    cases = SETS[args.set]
    if args.cases:
        want = set(args.cases.split(","))
        cases = tuple(c for c in cases if c.name in want)
    root = Path(args.out) if args.out else RESULTS
    path = predictions_file(args.set)
    if args.what == "predict":
        got = predict(cases, profile_path(args.profile))
        PREDICTIONS.mkdir(exist_ok=True)
        path.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")
        print(f"predictions: {path} (commit them before any run of the set)")
        return 0
    pred = json.loads(path.read_text()) if path.exists() else None
    rows_path = root / NAME / "rows.csv"
    if args.what == "estimate":
        rows = pd.read_csv(rows_path) if rows_path.exists() else None
        if pred is None:  # not written yet: this tree's prediction from the profile, not kept
            pred = predict(cases, profile_path(args.profile), seeds=1)
        print(estimate(cases, pred, rows, args.repeats))
        return 0
    if args.what == "run":
        from experiments.sim_vs_real import emulation_available

        if not emulation_available():
            print(f"{NAME}: run needs root with ip and tc (the emulated WAN)", file=sys.stderr)
            return 2
        run(cases, repeats=args.repeats, root=root, set_name=args.set, uncommitted=args.uncommitted)
    if pred is None:
        raise SystemExit(f"{path}: no predictions")
    got = score(pd.read_csv(rows_path), pred, args.set)
    out = root / NAME / f"score-{args.set}.csv"
    got.to_csv(out, index=False)
    with pd.option_context("display.width", 220, "display.max_columns", 30):
        print(got.drop(columns=["load"]).to_string(index=False, float_format="%.3g"))
    print(f"score: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
