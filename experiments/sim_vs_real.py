"""The simulator against real runs: record each run's trace, replay it, compare.

Theory of operation
-------------------
Each point is one real run of the runtime (``aurora real``, started here through
:class:`aurora.runtime.launcher.Launcher`), on this host's loopback or over the emulated WAN
(``--emulate``, root only). When it has finished, :func:`sim.runtrace.record.record_run` turns its
folder into the simulator's inputs and :func:`sim.runtrace.record.replay_config` into a
:class:`sim.config.SimConfig`, which is simulated. Nothing the run *output* (``steps.csv``) is an
input: the comparison is a prediction. Part 1 (``compare``) compares step time, tokens/s and
transfer per delta (target: within +-10%); part 2 (``timeline``, the Fig. 13 analog) a preemption
and a join (:func:`points`). The measured agreement and each miss are in ``docs/REPRODUCTION.md``
("Simulator vs real runs"). Rows go to ``results/sim_vs_real/`` (:func:`run_points`); a point
whose row exists is not run again (resumable)."""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import math
import os
import shutil
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from aurora.faults import parse_fault
from aurora.provenance import git_sha
from aurora.topology import load_topology
from experiments.common import RESULTS, files_only, plain

NAME = "sim_vs_real"
WARMUP = 2
"""Steps left out of the means (the first batch waits for every Actor to load)."""
TOLERANCE = 0.10
"""The target: prediction within +-10% of the run."""
STANDIN_TOKENS_PER_S = 300.0
"""Generation rate of a stand-in Actor (tokens/s): steps of ~0.4 s, dominated by generation
as in the paper, not by process overheads."""


@dataclass(frozen=True, kw_only=True)
class Point:
    """One real run to make and replay."""

    part: str
    """``compare`` or ``timeline``."""
    network: str
    """``loopback`` or ``emulated``."""
    strategy: str
    seed: int
    backend: str
    steps: int
    actors: int
    prompts_per_step: int
    faults: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    rtt_ms: float = 40.0
    """The US-Canada link's RTT (ms)."""
    scale: float | None = None
    """The emulated link's scale (None: the launcher's regime scale for the model; the
    held-out runs set another rate, :mod:`experiments.heldout`)."""

    @property
    def key(self) -> dict[str, Any]:
        return {
            "part": self.part,
            "network": self.network,
            "strategy": self.strategy,
            "seed": self.seed,
            "backend": self.backend,
            "steps": self.steps,
        }

    @property
    def name(self) -> str:
        return f"svr-{self.part}-{self.network}-{self.backend}-n{self.steps}"


def emulation_available() -> bool:
    """Root with ``ip`` and ``tc``: what ``aurora real --emulate`` needs."""
    return os.geteuid() == 0 and bool(shutil.which("ip")) and bool(shutil.which("tc"))


def networks(choice: str) -> list[str]:
    if choice == "auto":
        return ["loopback", "emulated"] if emulation_available() else ["loopback"]
    nets = ["loopback", "emulated"] if choice == "both" else [choice]
    if "emulated" in nets and not emulation_available():
        raise ValueError("--network emulated needs root with ip and tc (aurora real --emulate)")
    return nets


def timeline_faults(steps: int, actor: str, joiner: str) -> tuple[str, ...]:
    """The Fig. 13 schedule scaled to ``steps``: preempt at 30%, join at 70% (6 and 14 of 20)."""
    return (
        f"preempt:{actor}@step={max(2, round(0.3 * steps))}",
        f"join:{joiner}:ca:A100@step={max(3, round(0.7 * steps))}",
    )


def points(
    *,
    full: bool,
    nets: Sequence[str],
    steps: int | None = None,
    timeline_steps: int | None = None,
    parts: Sequence[str] = ("compare", "timeline"),
    seeds: Sequence[int] | None = None,
) -> list[Point]:
    """Part 1 (``part=compare``): ``aurora`` and ``prime-full`` on 2 Actors in a remote region, per
    network and seed: mean step time, tokens/s, the time from a version's extraction starting
    until the Ledger counts its last Actor staged ("transfer per delta", the same definition on
    both sides: both are read from the Ledger's events), and the ``aurora``/``prime-full``
    throughput ratio. Target: within +-10%.

    Part 2 (``part=timeline``, the Fig. 13 analog on real processes): 4 spot Actors, one
    preempted without notice after 30% of the steps (step 6 of 20), a replacement joining after
    70% (step 14): tokens/s per step and per Actor, the dip, the survivors' throughput, the
    joiner's catch-up and the recovery, beside the simulator's replay of the same run.

    Quick (the default) uses the labelled stand-in compute (``--backend standin``: real Ledger,
    leases, data plane, deltas and applies; generation is ``tokens / standin_tokens_per_s``);
    ``--full`` uses the real model backend (``rl``, the tiny Qwen3) and more seeds."""
    backend = "rl" if full else "standin"
    extra = {} if full else {"standin_tokens_per_s": STANDIN_TOKENS_PER_S}
    seeds = tuple(seeds) if seeds else ((0, 1, 2) if full else (0,))
    n = steps or (12 if full else 8)
    out = []
    if "compare" in parts:
        out += [
            Point(
                part="compare",
                network=net,
                strategy=strat,
                seed=seed,
                backend=backend,
                steps=n,
                actors=2,
                prompts_per_step=12,
                extra=extra,
            )
            for net in nets
            for seed in seeds
            for strat in ("aurora", "prime-full")
        ]
    if "timeline" in parts:
        tn = timeline_steps or 20
        net = "emulated" if "emulated" in nets else nets[0]
        out.append(
            Point(
                part="timeline",
                network=net,
                strategy="aurora",
                seed=0,
                backend=backend,
                steps=tn,
                actors=4,
                prompts_per_step=24,
                faults=timeline_faults(tn, "ca-a100-1", "ca-new-0"),
                extra=extra,
            )
        )
    return out


def topology_yaml(p: Point) -> dict[str, Any]:
    """Trainer in us, the Actors in ca behind the paper's US-Canada link (1 Gbit/s, 40 ms; the
    emulator scales the rate to the paper's transfer-to-generation regime for this model)."""
    return {
        "name": p.name,
        "trainer": {"region": "us", "model": "qwen3-8b", "gpu": "H100", "gpus": 1},
        "regions": [{"name": "us"}, {"name": "ca"}],
        "links": [{"a": "us", "b": "ca", "gbps": 1.0, "rtt_ms": p.rtt_ms, "loss": 0}],
        "actors": [
            {"region": "ca", "gpu": "A100", "count": p.actors, "spot": p.part == "timeline"}
        ],
        "real": {
            "steps": p.steps,
            "prompts_per_step": p.prompts_per_step,
            "group_size": 4,
            "actors": p.actors,
        },
    }


# ------------------------------------------------------------------------------------------
# One real run (a small local wrapper around the launcher)
# ------------------------------------------------------------------------------------------


def run_real(p: Point, root: Path, log: str | None = None) -> Path:
    """Make the real run of ``p`` under ``root/runs`` (unless a complete one is there) and
    record its trace; return the run folder. ``log``: the run writes its step series
    (``aurora real --log``)."""
    from aurora.runtime.launcher import Launcher, RealRun, run_folder
    from sim.runtrace.loopback import LOOPBACK, probe_loopback
    from sim.runtrace.record import record_run

    runs = root / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    topo_path = runs / f"{p.name}.yaml"
    topo_path.write_text(yaml.safe_dump(topology_yaml(p), sort_keys=False))
    run = RealRun(
        topology=load_topology(topo_path),
        topology_path=str(topo_path),
        strategy=p.strategy,
        seed=p.seed,
        out=str(runs),
        faults=tuple(parse_fault(f) for f in p.faults),
        backend=p.backend,
        extra=dict(p.extra),
        progress=False,
        emulate="auto" if p.network == "emulated" else None,
        scale=p.scale,
        stall_s=120.0,
        log=log,
    )
    folder = run_folder(run)
    if not _complete(folder, p.steps):
        if folder.exists():
            shutil.rmtree(folder)
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            code = Launcher(run).main()
        (runs / f"{folder.name}.log").write_text(log.getvalue())
        if code != 0 or not _complete(folder, p.steps):
            raise RuntimeError(f"{folder}: aurora real exited {code}; see {folder}/logs")
        if p.network == "loopback":
            (folder / LOOPBACK).write_text(json.dumps(probe_loopback(), indent=2) + "\n")
    if p.network == "loopback" and not (folder / LOOPBACK).exists():
        (folder / LOOPBACK).write_text(json.dumps(probe_loopback(), indent=2) + "\n")
    record_run(folder)
    return folder


def _complete(folder: Path, steps: int) -> bool:
    s = folder / "summary.json"
    if not s.exists():
        return False
    summary = json.loads(s.read_text())
    return summary.get("exit_code") == 0 and summary.get("steps_completed") == steps


# ------------------------------------------------------------------------------------------
# The comparison
# ------------------------------------------------------------------------------------------


def real_steps(folder: Path) -> pd.DataFrame:
    return pd.read_csv(folder / "steps.csv")


def _mean_after(rows: pd.DataFrame, column: str) -> float:
    return float(rows[rows["step"] > WARMUP][column].mean())


def _throughput(rows: pd.DataFrame) -> float:
    """Tokens over seconds of the steps after warm-up (tokens/s)."""
    sel = rows[rows["step"] > WARMUP]
    return float(sel["tokens"].sum() / sel["step_time_s"].sum())


def real_transfers(folder: Path) -> dict[int, float]:
    """Per version: seconds from its extraction starting to the Ledger counting its last
    Actor staged (read from the Ledger's events)."""
    start: dict[int, float] = {}
    last: dict[int, float] = {}
    with open(folder / "events.csv", newline="") as f:
        for r in csv.DictReader(f):
            rec = json.loads(r["record"])
            if r["type"] == "Published" and rec.get("stats", {}).get("time"):
                st = rec["stats"]
                start[int(rec["version"])] = float(st["time"]) - float(st.get("extract_s", 0))
            elif r["type"] == "DeltaStaged" and r["kind"] == "event":
                v = int(rec["version"])
                last[v] = max(last.get(v, 0.0), float(r["time"]))
    return {v: last[v] - start[v] for v in sorted(start) if v in last and v > 0}


def sim_transfers(result: Any) -> dict[int, float]:
    """The same interval in the replay: the Trainer's extract (or serialize) span start to
    the last ``DeltaStaged`` the Ledger was fed."""
    start: dict[int, float] = {}
    for s in result.timeline:
        if s["who"] == "trainer" and s["activity"] in ("extract", "serialize", "train"):
            v = int(s["version"])
            t = s["end"] if s["activity"] == "train" else s["start"]
            # The train span's end stands in when extraction took no time (no span).
            if s["activity"] != "train" or v not in start:
                start[v] = t
    last: dict[int, float] = {}
    for t, ev in result.fed:
        if type(ev).__name__ == "DeltaStaged":
            last[ev.version] = max(last.get(ev.version, 0.0), t)
    return {v: last[v] - start[v] for v in sorted(start) if v in last and v > 0}


def joins(events: Sequence[tuple[float, str, str, int | None]]) -> dict[str, float]:
    """Per joiner: seconds from its ``ActorJoined`` to its ``CaughtUp`` as the Ledger saw
    them (``events``: time, type, actor, version)."""
    joined: dict[str, float] = {}
    out: dict[str, float] = {}
    for t, kind, actor, _v in events:
        if kind == "ActorJoined":
            joined[actor] = t
        elif kind == "CaughtUp" and actor in joined and actor not in out:
            out[actor] = t - joined[actor]
    return out


def real_join_events(folder: Path) -> list[tuple[float, str, str, int | None]]:
    out = []
    with open(folder / "events.csv", newline="") as f:
        for r in csv.DictReader(f):
            if r["kind"] == "event" and r["type"] in ("ActorJoined", "CaughtUp"):
                rec = json.loads(r["record"])
                out.append((float(r["time"]), r["type"], rec["actor"], rec.get("version")))
    return out


def sim_join_events(result: Any) -> list[tuple[float, str, str, int | None]]:
    return [
        (t, type(ev).__name__, ev.actor, getattr(ev, "version", None))
        for t, ev in result.fed
        if type(ev).__name__ in ("ActorJoined", "CaughtUp") and t > 0
    ]


def per_actor_rates(rows: pd.DataFrame) -> pd.DataFrame:
    """Tokens/s per step and per Actor: the step's tokens split by each Actor's admitted
    results (``shares``), over the step's time."""
    out = []
    for _, r in rows.iterrows():
        shares = json.loads(r["shares"]) if isinstance(r["shares"], str) else {}
        total = sum(shares.values()) or 1
        for actor, n in shares.items():
            out.append(
                {
                    "step": int(r["step"]),
                    "actor": actor,
                    "tokens_per_s": float(r["tokens"]) * n / total / float(r["step_time_s"]),
                }
            )
    return pd.DataFrame(out)


def payload_rate(cfg: Any, efficiency: float) -> Any:
    """``cfg`` with every link's rate (and recorded rate schedule) times ``efficiency``: the
    payload an emulated link carries when its htb class counts headers too
    (:mod:`experiments.wire_overhead`), and times 1 - loss on a lossy link (the emulator drops
    after the bottleneck, so a lost packet was carried and is sent again)."""
    import dataclasses

    def link(lk: Any) -> Any:
        share = efficiency * (1.0 - lk.loss) if lk.loss > 0 else efficiency
        fl = lk.fluctuation
        if fl is not None:
            fl = dataclasses.replace(
                fl, low_gbps=fl.low_gbps * share, high_gbps=fl.high_gbps * share
            )
        return dataclasses.replace(lk, gbps=lk.gbps * share, fluctuation=fl)

    topo = dataclasses.replace(cfg.topology, links=tuple(link(lk) for lk in cfg.topology.links))
    schedules = tuple(
        dataclasses.replace(s, points=tuple((t, g * efficiency) for t, g in s.points))
        for s in cfg.rate_schedules
    )
    return dataclasses.replace(cfg, topology=topo, rate_schedules=schedules)


def measure(
    p: Point, root: Path, *, wire_efficiency: float | None = None, log: str | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run, record, replay and compare one point: its row and its per-step rows. An emulated
    run's replay carries payload at ``wire_efficiency`` of each link's htb rate when given.
    ``log``: the real run and its replay write their step series under the same tags
    (``RUN/tb`` and ``RUN/sim/tb``: one TensorBoard overlays them).

    The recorded inputs: per-rollout generation rate and tokens, the Trainer's step, extraction
    and publication seconds, delta sizes, the links as the emulator set them or the loopback as
    probed, the faults as they struck.
    """
    from sim.model import simulate
    from sim.runtrace.record import replay_config

    folder = run_real(p, root, log)
    real = real_steps(folder)
    cfg = replay_config(folder / "sim")
    if wire_efficiency is not None and p.network == "emulated":
        cfg = payload_rate(cfg, wire_efficiency)
    result = simulate(cfg)
    if log is not None:
        from aurora.observe.steplog import write_rows

        write_rows(log, folder / "sim", result.rows, name=f"{folder.name}-sim")
    sim = pd.DataFrame(result.rows)
    rt, st = real_transfers(folder), sim_transfers(result)
    # Past the warm-up, as the step means and as the replay's inputs (sim/runtrace/trace.py takes
    # delta sizes, extraction and generation from versions after WARMUP_STEPS): the first
    # versions' larger deltas and cold connections are in neither side's model.
    common = [v for v in rt if v in st and v > WARMUP]
    summary = json.loads((folder / "summary.json").read_text())
    row: dict[str, Any] = {
        **p.key,
        "real_step_time_s": _mean_after(real, "step_time_s"),
        "sim_step_time_s": _mean_after(sim, "step_time_s"),
        "real_tokens_per_s": _throughput(real),
        "sim_tokens_per_s": _throughput(sim),
        "real_transfer_s": statistics.fmean(rt[v] for v in common) if common else math.nan,
        "sim_transfer_s": statistics.fmean(st[v] for v in common) if common else math.nan,
        "transfers": len(common),
        "link_scale": summary.get("link_scale"),
        "wire_efficiency": wire_efficiency if p.network == "emulated" else None,
        "run": str(folder),
        "faults": ";".join(p.faults),
        "actors": p.actors,
        "prompts_per_step": p.prompts_per_step,
        "config": json.dumps(summary.get("spec", {}), sort_keys=True, default=str),
        "git_sha": git_sha(),
        "run_git_sha": summary.get("git_sha"),
    }
    rj, sj = joins(real_join_events(folder)), joins(sim_join_events(result))
    joiners = [a for a in rj if a in sj]
    row["real_catch_up_s"] = statistics.fmean(rj[a] for a in joiners) if joiners else math.nan
    row["sim_catch_up_s"] = statistics.fmean(sj[a] for a in joiners) if joiners else math.nan
    for m in ("step_time_s", "tokens_per_s", "transfer_s", "catch_up_s"):
        row[f"err_{m}"] = row[f"sim_{m}"] / row[f"real_{m}"] - 1 if row[f"real_{m}"] else math.nan
    if p.part == "timeline":
        row |= timeline_metrics(real, p, "real") | timeline_metrics(sim, p, "sim")
    steps = []
    for who, rows in (("real", real), ("sim", sim)):
        pa = per_actor_rates(rows)
        for _, r in rows.iterrows():
            step = int(r["step"])
            mine = pa[pa["step"] == step] if len(pa) else pa
            steps.append(
                {
                    **p.key,
                    "source": who,
                    "step": step,
                    "step_time_s": float(r["step_time_s"]),
                    "tokens_per_s": float(r["tokens_per_s"]),
                    "per_actor": json.dumps(
                        {
                            a: round(x, 3)
                            for a, x in zip(mine["actor"], mine["tokens_per_s"], strict=True)
                        }
                        if len(mine)
                        else {},
                        sort_keys=True,
                    ),
                    "transfer_s": (rt if who == "real" else st).get(step, math.nan),
                }
            )
    return row, steps


def _fault_step(p: Point, kind: str) -> int:
    return next(int(f.split("@step=")[1]) for f in p.faults if f.startswith(kind + ":"))


def timeline_metrics(rows: pd.DataFrame, p: Point, who: str) -> dict[str, float]:
    """Tokens/s before the preemption, at it (the dip), between it and the join (the
    survivors), and after the join (the recovery)."""
    pre, join = _fault_step(p, "preempt"), _fault_step(p, "join")
    tps = rows.set_index("step")["tokens_per_s"]

    def mean(lo: int, hi: int) -> float:
        sel = tps[(tps.index >= lo) & (tps.index <= hi)]
        return float(sel.mean()) if len(sel) else math.nan

    # Faults at step k strike when batch k is handed out: batch k is the one that dips.
    return {
        f"{who}_before_tps": mean(WARMUP + 1, pre - 1),
        f"{who}_dip_tps": float(tps.get(pre, math.nan)),
        f"{who}_survivors_tps": mean(pre + 1, join - 1),
        f"{who}_recovered_tps": mean(join + 2, p.steps),
    }


# ------------------------------------------------------------------------------------------
# Rows, table, figures
# ------------------------------------------------------------------------------------------


def run_points(
    pts: Sequence[Point],
    root: Path,
    *,
    wire_efficiency: float | None = None,
    log: str | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Measure the points missing from ``root/sim_vs_real/rows.csv``; return every row of
    ``pts`` and their per-step rows (``wire_efficiency``: see :func:`measure`).

    Rows go to ``results/sim_vs_real/{rows,steps,timeline}.csv`` (config, seed, git SHA each),
    the runs to ``results/sim_vs_real/runs/``; a point whose row exists is not run again, a run
    whose folder is complete is not launched again (resumable).
    """
    out = root / NAME
    out.mkdir(parents=True, exist_ok=True)
    rows_path, steps_path = out / "rows.csv", out / "steps.csv"
    old = pd.read_csv(rows_path) if rows_path.exists() else pd.DataFrame()
    keys = list(pts[0].key) if pts else []

    def done(p: Point) -> bool:
        if old.empty:
            return False
        sel = old
        for k, v in p.key.items():
            sel = sel[sel[k].astype(str) == str(v)]
        return len(sel) > 0

    for p in pts:
        if done(p):
            continue
        print(f"{NAME}: {p.part} {p.network} {p.strategy} seed {p.seed} ({p.backend})", flush=True)
        row, steps = measure(p, out, wire_efficiency=wire_efficiency, log=log)
        # Re-read before appending (another sweep may have written meanwhile), write after each
        # point: an interrupted sweep resumes where it stopped.
        for path, new in ((rows_path, [row]), (steps_path, steps)):
            cur = pd.read_csv(path) if path.exists() else pd.DataFrame()
            pd.concat([cur, pd.DataFrame(new)], ignore_index=True).to_csv(path, index=False)
    wanted = {tuple(str(v) for v in p.key.values()) for p in pts}

    def mine(df: pd.DataFrame) -> pd.DataFrame:
        if df.empty:
            return df
        sel = [tuple(str(x) for x in r) in wanted for r in df[keys].itertuples(index=False)]
        return df[sel].reset_index(drop=True)

    return mine(pd.read_csv(rows_path)), mine(pd.read_csv(steps_path))


def ratios(rows: pd.DataFrame) -> pd.DataFrame:
    """The aurora / prime-full throughput ratio, real and predicted, per network and seed."""
    comp = rows[rows["part"] == "compare"]
    out = []
    for (net, seed, backend), g in comp.groupby(["network", "seed", "backend"]):
        a, f = g[g["strategy"] == "aurora"], g[g["strategy"] == "prime-full"]
        if len(a) and len(f):
            real = float(a["real_tokens_per_s"].iloc[0] / f["real_tokens_per_s"].iloc[0])
            sim = float(a["sim_tokens_per_s"].iloc[0] / f["sim_tokens_per_s"].iloc[0])
            out.append(
                {
                    "network": net,
                    "seed": seed,
                    "backend": backend,
                    "real_ratio": real,
                    "sim_ratio": sim,
                    "err_ratio": sim / real - 1,
                }
            )
    return pd.DataFrame(out)


def _verdict(err: float) -> str:
    if not math.isfinite(err):
        return "-"
    return "within 10%" if abs(err) <= TOLERANCE else f"off by {err:+.0%}"


def table(rows: pd.DataFrame) -> str:
    """The printed comparison: each metric, real vs predicted, per run."""
    lines = [
        f"{'part':<9}{'network':<10}{'strategy':<11}{'seed':>4} {'metric':<16}"
        f"{'real':>10}{'sim':>10}{'error':>8}  verdict"
    ]
    for _, r in rows.iterrows():
        for m, label in (
            ("step_time_s", "step time (s)"),
            ("tokens_per_s", "tokens/s"),
            ("transfer_s", "transfer/delta s"),
            ("catch_up_s", "catch-up (s)"),
        ):
            real, sim = r[f"real_{m}"], r[f"sim_{m}"]
            if not (isinstance(real, float) and math.isfinite(real)):
                continue
            lines.append(
                f"{r['part']:<9}{r['network']:<10}{r['strategy']:<11}{int(r['seed']):>4} "
                f"{label:<16}{real:>10.4g}{sim:>10.4g}{sim / real - 1:>+8.1%}  "
                f"{_verdict(sim / real - 1)}"
            )
    rat = ratios(rows)
    for _, r in rat.iterrows():
        lines.append(
            f"{'compare':<9}{r['network']:<10}{'ratio':<11}{int(r['seed']):>4} "
            f"{'aurora/prime-full':<16}{r['real_ratio']:>10.4g}{r['sim_ratio']:>10.4g}"
            f"{r['err_ratio']:>+8.1%}  {_verdict(r['err_ratio'])}"
        )
    tl = rows[rows["part"] == "timeline"]
    for _, r in tl.iterrows():
        for m in ("before", "dip", "survivors", "recovered"):
            real, sim = r[f"real_{m}_tps"], r[f"sim_{m}_tps"]
            lines.append(
                f"{'timeline':<9}{r['network']:<10}{r['strategy']:<11}{int(r['seed']):>4} "
                f"{m + ' tok/s':<16}{real:>10.4g}{sim:>10.4g}{sim / real - 1:>+8.1%}  "
                f"{_verdict(sim / real - 1)}"
            )
    return "\n".join(lines)


def figure(rows: pd.DataFrame, steps: pd.DataFrame, path: Path) -> None:
    """Per-step step time, real (solid) and predicted (dashed), per compared run; bars of
    the means; the timeline run's tokens/s per step and per Actor."""
    import matplotlib.pyplot as plt

    comp = rows[rows["part"] == "compare"]
    tl = rows[rows["part"] == "timeline"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    ax = axes[0]
    for i, (_, r) in enumerate(comp.iterrows()):
        sel = steps
        for k in ("part", "network", "strategy", "seed", "backend", "steps"):
            sel = sel[sel[k].astype(str) == str(r[k])]
        label = f"{r['strategy']} {r['network']} s{int(r['seed'])} n{int(r['steps'])}"
        for src, style in (("real", "-"), ("sim", "--")):
            s = sel[sel["source"] == src]
            ax.plot(s["step"], s["step_time_s"], style, color=f"C{i}", label=f"{label} {src}")
    ax.set_xlabel("step")
    ax.set_ylabel("step time (s)")
    ax.set_yscale("log")
    ax.set_title("step time: real (solid) vs replay (dashed)")
    if len(comp):
        ax.legend(fontsize=6)
    ax = axes[1]
    labels = [
        f"{r['strategy']}\n{r['network']} s{int(r['seed'])} n{int(r['steps'])}"
        for _, r in comp.iterrows()
    ]
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], comp["real_step_time_s"], 0.4, label="real")
    ax.bar([i + 0.2 for i in x], comp["sim_step_time_s"], 0.4, label="simulator (replay)")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel(f"mean step time after {WARMUP} steps (s)")
    ax.set_title("mean step time")
    ax.legend(fontsize=8)
    ax = axes[2]
    for _, r in tl.iterrows():
        sel = steps
        for k in ("part", "network", "strategy", "seed", "backend", "steps"):
            sel = sel[sel[k].astype(str) == str(r[k])]
        for src, style in (("real", "-"), ("sim", "--")):
            s = sel[sel["source"] == src]
            ax.plot(s["step"], s["tokens_per_s"], style, color="black", label=f"total {src}")
            per = [json.loads(x) for x in s["per_actor"]]
            actors = sorted({a for d in per for a in d})
            for j, a in enumerate(actors):
                ys = [d.get(a, 0.0) for d in per]
                ax.plot(s["step"], ys, style, color=f"C{j}", lw=1, label=f"{a} {src}")
        for f in str(r["faults"]).split(";"):
            if "@step=" in f:
                ax.axvline(int(f.split("@step=")[1]), color="grey", ls=":", lw=1)
        ax.set_title(f"preempt + join ({r['network']}): tokens/s per step and per Actor")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s")
    if len(tl):
        ax.legend(fontsize=5, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> pd.DataFrame:
    p = argparse.ArgumentParser(description=plain((__doc__ or NAME).split("\n\n")[0]))
    p.add_argument("--full", action="store_true", help="the rl backend (tiny Qwen3), 3 seeds")
    p.add_argument("--out", default=None, help="results root (default results/)")
    p.add_argument(
        "--network",
        choices=("auto", "loopback", "emulated", "both"),
        default="auto",
        help="auto: loopback, and the emulated WAN where root, ip and tc allow",
    )
    p.add_argument("--steps", type=int, default=None, help="steps of each compared run")
    p.add_argument("--timeline-steps", type=int, default=None, help="steps of the timeline run")
    p.add_argument(
        "--part", choices=("compare", "timeline", "all"), default="all", help="what to run"
    )
    p.add_argument(
        "--wire-efficiency",
        default="measured",
        help="payload share of an emulated link's htb rate in the replay: 'measured' (the "
        "committed evidence/wire_overhead.json), 'none' (the htb rate is payload), or a number",
    )
    p.add_argument(
        "--seeds",
        default=None,
        help="comma-separated seeds of the compared runs (default: 0; --full 0,1,2)",
    )
    p.add_argument(
        "--log",
        choices=("tensorboard", "wandb"),
        default=None,
        help="each real run and its replay write their step series under the same tags "
        "(RUN/tb and RUN/sim/tb; docs/OBSERVABILITY.md)",
    )
    args = p.parse_args(argv)
    files_only()
    root = Path(args.out) if args.out else RESULTS
    if args.log is not None:
        from aurora.observe.steplog import check

        check(args.log)
    parts = ("compare", "timeline") if args.part == "all" else (args.part,)
    pts = points(
        full=args.full,
        nets=networks(args.network),
        steps=args.steps,
        timeline_steps=args.timeline_steps,
        parts=parts,
        seeds=[int(x) for x in args.seeds.split(",")] if args.seeds else None,
    )
    efficiency = None
    if args.wire_efficiency == "measured":
        from experiments import wire_overhead

        efficiency = wire_overhead.load()
        if efficiency is None:
            raise ValueError(
                f"--wire-efficiency measured: no {wire_overhead.EVIDENCE}; run python -m "
                "experiments.wire_overhead (root) or pass --wire-efficiency none"
            )
    elif args.wire_efficiency != "none":
        efficiency = float(args.wire_efficiency)
    rows, steps = run_points(pts, root, wire_efficiency=efficiency, log=args.log)
    # One figure per backend, from every row of it on file (quick and --full runs both kept).
    backend = "rl" if args.full else "standin"
    png = root / NAME / (f"{NAME}.png" if backend == "standin" else f"{NAME}_{backend}.png")
    every = pd.read_csv(root / NAME / "rows.csv")
    every_steps = pd.read_csv(root / NAME / "steps.csv")
    figure(every[every["backend"] == backend], every_steps[every_steps["backend"] == backend], png)
    print(table(rows))
    print(f"rows: {root / NAME / 'rows.csv'}  steps: {root / NAME / 'steps.csv'}  figure: {png}")
    sys.stdout.flush()
    return rows


if __name__ == "__main__":
    try:
        main()
    except (RuntimeError, ValueError) as exc:  # a failed run or bad input: one line
        print(f"sim_vs_real: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
