"""Learning check: does the real Trainer + engine improve held-out reward, and at what density?

Each point runs the project's own pieces end to end on the default task (``aurora.rl.loop.
train_local``): the warm-started tiny Qwen3, a ``TransformersEngine`` sampling G completions per
prompt, the GRPO ``Trainer`` taking one step per batch and publishing ``D_{v+1}`` through the
delta format, the engine applying it in place. Held-out exact match is measured before, during
and after; every published delta's density is recorded. The points are listed on :func:`points`.

The claim and its margin (justified in docs/RL.md from the measured noise): over the seeds of the
default point, the mean greedy held-out exact match improves by at least :data:`MARGIN_POINTS`
points and every seed improves; the lr = 0 control does not improve (:func:`verdict`).
``--bounds`` measures what the Trainer's bounds on one result cost an honest run
(:func:`bounds_cost`). Rows go to ``results/learning/`` (:func:`run_points`). CLI only under
``__main__``: ``python -m experiments.learning [--full] [--seeds 0 1 2] [--out DIR]``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from experiments.common import plain, results_root, written

NAME = "learning"
DEFAULT_LR = 5e-4
"""The ``default`` point: the rate ``examples/geo.yaml`` set when these runs were made. They
moved its default run to the ``learn`` regime's rate (``learn-regime``, ``LEARN_LR``: as much
learning in 20 steps, 40% fewer delta bytes; docs/RL.md), and this point stays as the higher of
the two rates compared."""
SWEEP_LRS = (2e-3, 3e-5)
"""``--full``: one rate above the default (docs/journal/early-measurements.md: 2e-3
collapses) and one below."""
TRANSFER_LR = 2e-6
"""An RL-scale learning rate for the ``transfer`` regime (sparse deltas, no learning expected)."""
STEPS = 60
"""GRPO steps of every point but ``transfer``."""
MARGIN_POINTS = 5.0
"""Mean greedy held-out improvement (percentage points) the default point must reach."""
UNBOUNDED = {"ratio_cap": None, "guard": None}
"""GRPOConfig without the bounds on one result (the PPO clip alone, no outlier rule; a step
that is not finite is still never taken)."""


@dataclass(frozen=True, kw_only=True)
class LearningConfig:
    """One run of the learning check."""

    preset: str
    """Which point this is (default, control-lr0, sweep, transfer, ci)."""
    seed: int
    """RL seed: training prompt stream, sampling, Trainer generator."""
    lr: float
    """Trainer learning rate."""
    steps: int
    """GRPO steps (each publishes one delta)."""
    prompts_per_step: int = 32
    """B: prompts per step."""
    group_size: int = 8
    """G: completions per prompt."""
    eval_every: int = 25
    """Steps between held-out evaluations."""
    warm: Any = None
    """``aurora.rl.warmstart.WarmStartConfig`` (None: the default)."""
    heldout_size: int = 500
    """Held-out problems (the task's fixed set)."""
    eval_sampled: bool = True
    """Also measure sampled (temperature 1) held-out reward."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Other GRPOConfig fields."""

    def key(self) -> dict[str, Any]:
        return {"preset": self.preset, "lr": self.lr, "seed": self.seed, "steps": self.steps}


def default_config(seed: int, *, steps: int = STEPS) -> LearningConfig:
    return LearningConfig(preset="default", seed=seed, lr=DEFAULT_LR, steps=steps, eval_every=10)


def regime_config(seed: int, *, steps: int = STEPS) -> LearningConfig:
    """The ``learn`` regime's own rate (a topology without ``real.learning_rate``)."""
    from aurora.runtime.rlbackend import LEARN_LR

    return LearningConfig(preset="learn-regime", seed=seed, lr=LEARN_LR, steps=steps, eval_every=10)


def control_config(seed: int, *, steps: int = STEPS) -> LearningConfig:
    """lr = 0: the weights never change, so held-out greedy reward must not change either."""
    return LearningConfig(preset="control-lr0", seed=seed, lr=0.0, steps=steps, eval_every=10)


def sweep_configs(seed: int, *, steps: int = STEPS) -> list[LearningConfig]:
    return [
        LearningConfig(preset="sweep", seed=seed, lr=lr, steps=steps, eval_every=10)
        for lr in SWEEP_LRS
    ]


def transfer_config(seed: int, *, steps: int = STEPS) -> LearningConfig:
    """TRANSFER REGIME: an RL-scale learning rate, deltas as sparse as the paper's (1-3%);
    the held-out reward is reported but learning is NOT expected at this lr within the run."""
    return LearningConfig(preset="transfer", seed=seed, lr=TRANSFER_LR, steps=steps, eval_every=10)


def smoke_config(seed: int = 0, *, lr: float = DEFAULT_LR, steps: int = 2) -> LearningConfig:
    """The entry point's smoke run (tests/test_rl_learning.py): a one-step warm start, two GRPO
    steps of 4 prompts x 4, 20 held-out problems. Says nothing about learning."""
    from aurora.rl.warmstart import WarmStartConfig

    return LearningConfig(
        preset="smoke" if lr else "smoke-lr0",
        seed=seed,
        lr=lr,
        steps=steps,
        prompts_per_step=4,
        group_size=4,
        eval_every=1,
        warm=WarmStartConfig(threshold=0.0, eval_every=1, validation_size=8, batch_size=8),
        heldout_size=20,
    )


def unbounded_configs(seed: int, *, steps: int = STEPS) -> list[LearningConfig]:
    """The default and ``learn``-regime points without the bounds on one result."""
    return [
        dataclasses.replace(c, preset=f"{c.preset}-unbounded", extra=dict(UNBOUNDED))
        for c in (default_config(seed, steps=steps), regime_config(seed, steps=steps))
    ]


def points(
    *,
    full: bool = False,
    seeds: Sequence[int] = (0, 1, 2),
    smoke: bool = False,
    bounds: bool = False,
) -> list[LearningConfig]:
    """Each over three RL seeds unless said: the default learning rate (:data:`DEFAULT_LR`, the one
    ``examples/geo.yaml`` runs ``aurora real`` at), the ``learn`` regime's learning rate when a
    topology sets none (:data:`aurora.runtime.rlbackend.LEARN_LR`), the same with lr = 0 (a
    control that must not improve), with ``--full`` a learning-rate sweep (one seed) and the
    ``transfer`` regime (one seed): an RL-scale learning rate whose deltas are sparse like the
    paper's, where learning within the run is *not* expected (it shows what the data plane
    carries at the paper's density, not a learning result). Runs are kept short (60 steps of 32
    prompts x 8, held-out every 10 steps) so the whole set fits a shared 2-core machine in
    minutes.

    ``bounds``: the default and ``learn``-regime points again, same seeds, without the bounds
    (``UNBOUNDED``: no ratio cap, no outlier rule), beside the points with them."""
    if smoke:
        return [smoke_config(seeds[0]), smoke_config(seeds[0], lr=0.0)]
    if bounds:
        return [
            c for s in seeds for c in (default_config(s), regime_config(s), *unbounded_configs(s))
        ]
    out = [default_config(s) for s in seeds]
    out += [regime_config(s) for s in seeds]
    out += [control_config(s) for s in seeds]
    if full:
        out += sweep_configs(seeds[0]) + [transfer_config(seeds[0])]
    return out


# ------------------------------------------------------------------------------------------
# One run
# ------------------------------------------------------------------------------------------


def run(cfg: LearningConfig, *, cache_dir: str | Path | None = None) -> dict[str, Any]:
    """Warm start (cached), then ``cfg.steps`` GRPO steps; returns the row and the curve.

    The warm start is the v0 snapshot, cached. Held-out exact match (500 fixed problems, greedy
    and sampled) is measured before the first step, every ``eval_every`` steps and after the
    last; every published delta's density (changed bf16 elements / all) is recorded.
    """
    import copy

    import torch

    from aurora.engines.transformers import TransformersEngine
    from aurora.rl.loop import train_local
    from aurora.rl.tasks import ArithmeticTask
    from aurora.rl.trainer import GRPOConfig, Trainer
    from aurora.rl.warmstart import WarmStartConfig, warm_start

    torch.manual_seed(cfg.seed)
    warm_cfg = cfg.warm or WarmStartConfig()
    t0 = time.perf_counter()
    ws = warm_start(warm_cfg, cache_dir=cache_dir)
    warm_s = time.perf_counter() - t0
    task = ArithmeticTask(
        dataclasses.replace(warm_cfg.task, seed=cfg.seed, heldout_size=cfg.heldout_size)
    )
    engine = TransformersEngine(
        copy.deepcopy(ws.model), ws.tokenizer, weights_hash=ws.weights_hash, seed=cfg.seed
    )
    trainer = Trainer(
        ws.model,
        ws.tokenizer,
        task.reward,
        GRPOConfig(lr=cfg.lr, **cfg.extra),
        weights_hash=ws.weights_hash,
        model_id="tiny-qwen3-arith",
        seed=cfg.seed,
    )
    res = train_local(
        trainer,
        engine,
        task,
        steps=cfg.steps,
        prompts_per_step=cfg.prompts_per_step,
        group_size=cfg.group_size,
        eval_prompts=task.heldout(),
        eval_every=cfg.eval_every,
        eval_sampled=cfg.eval_sampled,
        seed=cfg.seed,
    )
    dens = [p["density"] for p in res.publications]
    first, last = res.evals[0], res.evals[-1]
    row: dict[str, Any] = {
        **cfg.key(),
        "prompts_per_step": cfg.prompts_per_step,
        "group_size": cfg.group_size,
        "greedy_before": first["greedy"],
        "greedy_after": last["greedy"],
        "greedy_gain_points": 100 * (last["greedy"] - first["greedy"]),
        "sampled_before": first.get("sampled", np.nan),
        "sampled_after": last.get("sampled", np.nan),
        "train_reward_first10": float(np.mean([s.reward_mean for s in res.steps[:10]])),
        "train_reward_last10": float(np.mean([s.reward_mean for s in res.steps[-10:]])),
        "density_first": dens[0] if dens else np.nan,
        "density_mean": float(np.mean(dens)) if dens else np.nan,
        "density_late": float(np.mean(dens[len(dens) // 2 :])) if dens else np.nan,
        "delta_bytes_mean": float(np.mean([p["bytes"] for p in res.publications])),
        "model_bf16_bytes": 2 * int(res.publications[0]["total"]) if dens else 0,
        "logp_diff_max_median": float(np.median([s.logp_diff_max for s in res.steps])),
        "logp_diff_max_max": float(np.max([s.logp_diff_max for s in res.steps])),
        "clip_frac_mean": float(np.mean([s.clip_frac for s in res.steps])),
        "capped_frac_mean": float(np.mean([s.capped_frac for s in res.steps])),
        "steps_refused": int(sum(s.refused is not None for s in res.steps)),
        "grad_norm_max_over_median": float(
            np.max([s.grad_norm for s in res.steps if not s.skipped])
            / np.median([s.grad_norm for s in res.steps if not s.skipped])
        )
        if any(not s.skipped for s in res.steps)
        else np.nan,
        "steps_skipped": int(sum(s.skipped for s in res.steps)),
        "step_s_median": float(np.median([s.seconds for s in res.steps])),
        "threads": torch.get_num_threads(),
        "run_s": res.seconds,
        "warm_start_s": warm_s,
        "warm_start_cached": ws.cached,
        "warm_start_steps": ws.info.get("steps"),
        "warm_start_key": warm_cfg.key(),
        "config": json.dumps(
            {**dataclasses.asdict(cfg), "warm": dataclasses.asdict(warm_cfg)}, default=str
        ),
    }
    curve = [{**cfg.key(), **e} for e in res.evals]
    for i, (d, st) in enumerate(zip(dens, res.steps, strict=True)):
        curve.append(
            {
                **cfg.key(),
                "step": i + 1,
                "density": d,
                "train_reward": st.reward_mean,
                "logp_diff_max": st.logp_diff_max,
                "clip_frac": st.clip_frac,
                "capped_frac": st.capped_frac,
                "grad_norm": st.grad_norm,
                "refused": st.refused or "",
                "skipped": st.skipped,
            }
        )
    return {"row": row, "curve": curve}


# ------------------------------------------------------------------------------------------
# Sweep, files, figure
# ------------------------------------------------------------------------------------------


def _key_of(values: Sequence[Any]) -> tuple[str, ...]:
    return tuple(str(v) for v in values)


def _append(path: Path, new: list[dict[str, Any]]) -> pd.DataFrame:
    old = pd.read_csv(path) if path.exists() else pd.DataFrame()
    rows = pd.concat([old, pd.DataFrame(new)], ignore_index=True) if new else old
    if new:
        tmp = path.with_suffix(".csv.tmp")
        rows.to_csv(tmp, index=False)
        os.replace(tmp, path)
    return rows


def run_points(
    configs: Sequence[LearningConfig], root: Path, *, cache_dir: str | Path | None = None
) -> pd.DataFrame:
    """Run the configs not yet in ``rows.csv`` (one at a time, appending after each, so an
    interrupted sweep resumes); return the rows of ``configs``.

    Writes ``results/learning/rows.csv`` (one row per run: config, seed, git SHA, before/after,
    densities, log-prob agreement) and ``results/learning/curves.csv`` (held-out reward by step;
    delta density, training reward and log-prob gap per step); :func:`figure` draws
    ``results/learning/learning.png``. Re-running computes only missing runs.
    """
    from aurora.provenance import git_sha

    out = root / NAME
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "rows.csv"
    keys = list(configs[0].key()) if configs else []
    for cfg in configs:
        old = pd.read_csv(rows_path) if rows_path.exists() else pd.DataFrame()
        done = (
            {_key_of(r) for r in old[keys].itertuples(index=False)}
            if not old.empty and all(k in old.columns for k in keys)
            else set()
        )
        if _key_of(list(cfg.key().values())) in done:
            continue
        print(f"[learning] {cfg.key()}", flush=True)
        got = run(cfg, cache_dir=cache_dir)
        got["row"]["git_sha"] = git_sha()
        _append(out / "curves.csv", got["curve"])
        _append(rows_path, [got["row"]])
    rows = pd.read_csv(rows_path)
    wanted = {_key_of(list(c.key().values())) for c in configs}
    mine = [_key_of(r) in wanted for r in rows[keys].itertuples(index=False)]
    return rows[mine].reset_index(drop=True)


def verdict(
    rows: pd.DataFrame,
    *,
    preset: str = "default",
    control: str = "control-lr0",
    margin: float = MARGIN_POINTS,
    min_seeds: int = 3,
) -> dict[str, Any]:
    """The claim: ``preset`` improves by >= ``margin`` points on average and on every seed
    (at least ``min_seeds``); the ``control`` runs do not improve."""
    d = rows[rows.preset == preset]
    c = rows[rows.preset == control]
    gains = d.greedy_gain_points.to_numpy()
    ctrl = c.greedy_gain_points.to_numpy()
    return {
        "default_mean_gain": float(gains.mean()) if gains.size else np.nan,
        "default_gains": [round(float(g), 1) for g in gains],
        "control_gains": [round(float(g), 1) for g in ctrl],
        "passes": bool(
            gains.size >= min_seeds
            and gains.mean() >= margin
            and (gains > 0).all()
            and ctrl.size >= 1
            and (ctrl <= 0).all()
        ),
    }


def bounds_cost(rows: pd.DataFrame) -> dict[str, Any]:
    """Per learning rate: the held-out gain with and without the bounds on one result (same
    seeds), their per-seed difference, and how many honest steps the bounds changed (refused
    by the guard, or any token capped)."""
    out: dict[str, Any] = {}
    for preset in ("default", "learn-regime"):
        on = rows[rows.preset == preset].sort_values("seed")
        off = rows[rows.preset == f"{preset}-unbounded"].sort_values("seed")
        seeds = sorted(set(on.seed) & set(off.seed))
        a = on.set_index("seed").loc[seeds]
        b = off.set_index("seed").loc[seeds]
        out[preset] = {
            "seeds": seeds,
            "gain_with": [round(float(x), 1) for x in a.greedy_gain_points],
            "gain_without": [round(float(x), 1) for x in b.greedy_gain_points],
            "mean_difference": float((a.greedy_gain_points - b.greedy_gain_points).mean())
            if seeds
            else np.nan,
            "honest_steps_refused": int(a.steps_refused.sum()) if "steps_refused" in a else 0,
            "capped_frac_mean": float(a.capped_frac_mean.mean())
            if "capped_frac_mean" in a
            else np.nan,
        }
    return out


def figure(root: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = root / NAME
    curves = pd.read_csv(out / "curves.csv")
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    labels = {}
    for (preset, lr, seed), g in curves.groupby(["preset", "lr", "seed"]):
        label = f"{preset} lr={lr:g}"
        color = labels.setdefault(label, f"C{len(labels)}")
        ev = g.dropna(subset=["greedy"]) if "greedy" in g else g.iloc[0:0]
        a.plot(
            ev.step,
            100 * ev.greedy,
            color=color,
            alpha=0.8,
            label=label if seed == g.seed.min() else None,
        )
        dn = g.dropna(subset=["density"]) if "density" in g else g.iloc[0:0]
        dn = dn[dn.density > 0]  # lr = 0 and skipped steps publish empty deltas (log axis)
        b.plot(dn.step, 100 * dn.density, color=color, alpha=0.6, lw=0.8)
    a.set_xlabel("GRPO step")
    a.set_ylabel("held-out exact match, greedy (%)")
    a.set_title("learning (one line per seed)")
    a.grid(alpha=0.3)
    handles, names = a.get_legend_handles_labels()
    uniq = dict(zip(names, handles, strict=True))
    a.legend(uniq.values(), uniq.keys(), fontsize=7)
    b.set_xlabel("GRPO step (version)")
    b.set_ylabel("changed bf16 elements per delta (%)")
    if b.has_data():
        b.set_yscale("log")
    b.set_title("delta density")
    b.grid(alpha=0.3, which="both")
    fig.tight_layout()
    path = out / f"{NAME}.png"
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


def summary(rows: pd.DataFrame, claim: dict[str, Any]) -> str:
    cols = [
        "preset",
        "lr",
        "seed",
        "greedy_before",
        "greedy_after",
        "greedy_gain_points",
        "sampled_before",
        "sampled_after",
        "density_first",
        "density_mean",
        "density_late",
        "logp_diff_max_median",
    ]
    table = rows[cols].to_string(index=False, float_format=lambda x: f"{x:.3g}")
    return table + "\n" + json.dumps(claim)


def main(argv: Sequence[str] | None = None) -> pd.DataFrame:
    p = argparse.ArgumentParser(description=plain(__doc__.split("\n\n")[0]))
    p.add_argument("--full", action="store_true", help="also the lr sweep and the transfer regime")
    p.add_argument("--out", default=None, help="results root (default results/)")
    p.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1, 2], help="RL seeds (default 0 1 2)"
    )
    p.add_argument("--smoke", action="store_true", help="a seconds-long run of the pipeline")
    p.add_argument(
        "--bounds", action="store_true", help="the bounds' honest cost: with and without them"
    )
    p.add_argument("--cache", default=None, help="warm-start cache (default ~/.cache/aurora)")
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: a shared 2-core machine)"
    )
    args = p.parse_args(argv)
    root = results_root(args)
    import torch

    # Two intra-op threads on two cores shared with other work spin against each other: a point
    # that takes ~1 min on one thread had not finished after 6 min on two (load average ~40).
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        configs = points(full=args.full, seeds=args.seeds, smoke=args.smoke, bounds=args.bounds)
        rows = run_points(configs, root, cache_dir=args.cache)
    finally:
        torch.set_num_threads(threads)  # main() also runs inside other processes (tests)
    if args.bounds:
        claim = bounds_cost(rows)
    else:
        claim = {"smoke": "the pipeline only; no claim"} if args.smoke else verdict(rows)
    figure(root)
    print(summary(rows, claim))
    print(written(root, NAME))
    return rows


if __name__ == "__main__":
    main()
