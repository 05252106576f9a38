"""What one result can do to a step, with and without the Trainer's bounds, and what honest
behaviour log-probs look like (docs/RL.md, "What one result can do").

Three parts, each a list of configs that :func:`main` runs: ``logprobs`` (offline: the behaviour
log-probs each engine reports for honest samples of the warm-started tiny Qwen3, against the
bound ``V e^L`` and the plausible floor, :func:`measure_logprobs`), ``attack`` (offline: one
forged result's effect on a step's gradient with and without ``ratio_cap`` and the guard,
:func:`measure_attack`) and ``honest`` (``aurora real``: whether the bounds ever touched an
honest result, :func:`honest_run`). Rows (resolved config, seed, git SHA, metrics) go to
``results/bounds/{logprobs,attack,honest}.csv``; re-running skips rows already there. The honest
cost of the bounds on learning is ``python -m experiments.learning --bounds``. CLI only under
``__main__``: ``python -m experiments.bounds [--part logprobs|attack|all] [--engines
transformers,vllm] [--seeds 0,1,2] [--steps 20]``."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aurora.provenance import git_sha

NAME = "bounds"
FORGED = (-20.0, -25.0, -60.0, -math.inf)
"""The forged behaviour log-probs to test (-25, -60, -inf) and one above the tiny model's
plausible floor (-20: admitted by the payload check, so only the objective's cap stands)."""


@dataclass(frozen=True, kw_only=True)
class LogprobConfig:
    """One engine's honest sample."""

    engine: str
    """``transformers`` or ``vllm``."""
    batches: int = 32
    """Batches sampled."""
    prompts: int = 32
    """Prompts per batch."""
    group_size: int = 8
    """Completions per prompt."""
    temperature: float = 1.0
    """Sampling temperature."""
    seed: int = 0
    """Sampling and task seed."""

    @property
    def key(self) -> str:
        return f"{self.engine}-T{self.temperature:g}-b{self.batches}-s{self.seed}"


@dataclass(frozen=True, kw_only=True)
class AttackConfig:
    """One forged result against one step."""

    forged: float
    """The forged behaviour log-prob on every token of one completion (nats)."""
    bounds: bool
    """The Trainer's bounds on (``ratio_cap`` 3 and the guard's outlier rule) or off."""
    seed: int = 0
    """Sampling and task seed (which batch, which completion)."""
    prompts: int = 32
    group_size: int = 8

    @property
    def key(self) -> str:
        return f"{self.forged:g}-{'on' if self.bounds else 'off'}-s{self.seed}"


@dataclass(frozen=True, kw_only=True)
class HonestConfig:
    """One ``aurora real`` run of honest Actors only."""

    engine: str
    """The Actors' engine."""
    seed: int
    """The job's seed."""
    steps: int = 20
    """Training steps."""
    actors: int = 2
    """Honest Actors."""
    prompts_per_step: int = 32
    group_size: int = 8

    @property
    def key(self) -> str:
        return f"{self.engine}-{self.steps}-s{self.seed}"


def honest_run(cfg: HonestConfig, out: Path) -> dict[str, Any]:
    """What the bounds did to one honest run.

    Two honest Actors per run, per engine and seed: whether the bounds ever touched an honest
    result (results refused by reason, Actors excluded, steps the guard refused or left groups
    out of, the largest share of capped tokens, the largest pre-clip gradient norm against the
    run's median).
    """
    from aurora.runtime.launcher import Launcher, RealRun
    from aurora.topology import topology_from_dict

    topo = {
        "name": f"honest-{cfg.engine}",
        "trainer": {"region": "us", "model": "qwen3-8b", "gpu": "H100", "gpus": 1},
        "regions": [{"name": "us"}],
        "actors": [{"region": "us", "gpu": "A100", "count": cfg.actors}],
        "real": {
            "model": "tiny",
            "engine": cfg.engine,
            "steps": cfg.steps,
            "prompts_per_step": cfg.prompts_per_step,
            "group_size": cfg.group_size,
            "eval_prompts": 50,
            "lease_initial_s": 120.0,
        },
    }
    launcher = Launcher(
        RealRun(
            topology=topology_from_dict(topo, source=NAME),
            topology_path=NAME,
            out=str(out / "runs" / cfg.key),
            backend="rl",
            seed=cfg.seed,
            extra={"start_actors": cfg.actors},
            progress=False,
            stall_s=600.0,
        )
    )
    code = launcher.main()
    d = launcher.dir
    with open(d / "events.csv") as f:
        rows = [r | {"rec": json.loads(r["record"])} for r in csv.DictReader(f)]
    steps = [
        json.loads(line)["stats"]
        for line in (d / "trainer" / "steps.jsonl").read_text().splitlines()
    ]
    refused: dict[str, int] = {}
    for r in rows:
        if r["type"] == "Refused":
            why = r["rec"]["reason"]
            refused[why] = refused.get(why, 0) + 1
    norms = [float(s["grad_norm"]) for s in steps if not s.get("skipped") and s.get("grad_norm")]
    norms.sort()
    summary = json.loads((d / "summary.json").read_text())
    return {
        "exit_code": code,
        "steps_completed": summary.get("steps_completed"),
        "refused": json.dumps(refused, sort_keys=True),
        "payload_refusals": refused.get("BAD_PAYLOAD", 0) + refused.get("TRAINER_REFUSED", 0),
        "evicted": sum(r["type"] == "Evicted" for r in rows),
        "steps_guard_refused": sum(bool(s.get("refused")) for s in steps),
        "steps_skipped": sum(int(s.get("skipped") or 0) for s in steps),
        "capped_frac_max": max((float(s.get("capped_frac") or 0.0) for s in steps), default=0.0),
        "grad_norm_max_over_median": norms[-1] / norms[len(norms) // 2] if norms else "",
        "prompts_lost": summary.get("prompts_lost"),
        "run_s": summary.get("wall_s"),
    }


def _spec(engine: str, seed: int, tmp: str, cfg: Any) -> Any:
    from aurora.runtime.job import make_spec
    from aurora.topology import topology_from_dict

    topo = topology_from_dict(
        {
            "name": "bounds",
            "trainer": {"region": "us", "model": "qwen3-8b", "gpus": 1},
            "regions": [{"name": "us"}],
            "actors": [{"region": "us", "gpu": "A100", "count": 1}],
            "real": {
                "engine": engine,
                "group_size": cfg.group_size,
                "prompts_per_step": cfg.prompts,
                "temperature": getattr(cfg, "temperature", 1.0),
            },
        }
    )
    return make_spec(topo, strategy="aurora", seed=seed, steps=None, store=tmp)


def measure_logprobs(cfg: LogprobConfig) -> dict[str, Any]:
    """The honest behaviour log-probs of one engine.

    Each engine (transformers: fp32 arithmetic on the bf16 weights; vLLM's CPU build: bf16
    arithmetic) samples ``batches`` of ``prompts`` x ``group_size`` completions of the
    warm-started tiny Qwen3 at temperature 1; per engine the reported (behaviour) log-probs of
    every sampled token: how many, the lowest, low quantiles, the share below -5/-10/-15 nats
    beside the bound ``V e^L`` an honest sampler obeys, and how many fall below the plausible
    floor (:func:`aurora.policy.refusals.logprob_floor`: none may).
    """
    import msgpack
    import numpy as np

    from aurora.policy.refusals import logprob_floor
    from aurora.runtime.compute import Sampling
    from aurora.runtime.rlbackend import RLTrainer, make_rl_engine

    tmp = tempfile.mkdtemp(prefix="aurora-bounds-")
    spec = _spec(cfg.engine, cfg.seed, tmp, cfg)
    trainer = RLTrainer(spec, workdir=tmp)
    engine = make_rl_engine(spec)
    engine.load(trainer.published(), version=0, weights_hash=trainer.weights_hash)
    sampling = Sampling(
        n=cfg.group_size,
        max_new_tokens=trainer.max_new_tokens,
        temperature=cfg.temperature,
        seed=cfg.seed,
    )
    lps: list[float] = []
    for b in range(cfg.batches):
        prompts = [(f"b{b + 1}-{i}", b * cfg.prompts + i) for i in range(cfg.prompts)]
        for gen in engine.generate(prompts, sampling):
            for c in msgpack.unpackb(gen.payload)["completions"]:
                lps.extend(float(x) for x in c["lp"])
    a = np.asarray(lps)
    vocab = int(trainer.vocab_size or 0)
    floor = logprob_floor(vocab)
    row: dict[str, Any] = {
        "tokens": int(a.size),
        "vocab": vocab,
        "floor": floor,
        "below_floor": int((a < floor).sum()),
        "min_lp": float(a.min()),
        "q1e-4": float(np.quantile(a, 1e-4)),
        "q1e-3": float(np.quantile(a, 1e-3)),
        "q1e-2": float(np.quantile(a, 1e-2)),
        "median": float(np.median(a)),
    }
    for cut in (-5.0, -10.0, -15.0):
        row[f"share_below_{-cut:g}"] = float((a < cut).mean())
        row[f"bound_below_{-cut:g}"] = vocab * math.exp(cut)  # V e^L, per token
    return row


def measure_attack(cfg: AttackConfig) -> dict[str, Any]:
    """One forged result against one step.

    One batch of 32 x 8 honest completions (transformers engine, v0), one completion with a
    negative advantage given the forged behaviour log-prob ``X`` on every token; the step's
    gradient with and without the bounds (``ratio_cap``, the guard): its L2 norm before clipping
    against the honest batch's, its cosine with the forged result's own gradient and with the
    honest batch's, and what the step did (taken, refused, groups left out, weights finite after
    it and a publish).
    """
    import copy

    import numpy as np
    import torch

    from aurora.engines import Sampling, TransformersEngine
    from aurora.rl.tasks import ArithmeticTask
    from aurora.rl.trainer import Group, GRPOConfig, Trainer, group_advantages
    from aurora.rl.warmstart import WarmStartConfig, warm_start
    from aurora.runtime.rlbackend import LEARN_LR

    ws = warm_start()
    task = ArithmeticTask(dataclasses.replace(WarmStartConfig().task, seed=cfg.seed))
    extra = {} if cfg.bounds else {"ratio_cap": None, "guard": None}

    def trainer() -> Trainer:
        return Trainer(
            copy.deepcopy(ws.model),
            ws.tokenizer,
            task.reward,
            GRPOConfig(lr=LEARN_LR, **extra),
            weights_hash=ws.weights_hash,
        )

    engine = TransformersEngine(copy.deepcopy(ws.model), ws.tokenizer, weights_hash=ws.weights_hash)
    prompts = task.prompts(0, cfg.prompts)
    sampling = Sampling(max_new_tokens=task.max_new_tokens, temperature=1.0, seed=cfg.seed)
    groups = [
        Group(prompt=p, completions=list(g), version=0)
        for p, g in zip(prompts, engine.generate(prompts, cfg.group_size, sampling), strict=True)
    ]
    t = trainer()
    advs = [group_advantages(t.rewards(g)) for g in groups]
    g = next(i for i, a in enumerate(advs) if any(x != 0 for x in a))
    c = int(np.argmin(advs[g]))
    attack = [Group(prompt=x.prompt, completions=list(x.completions), version=0) for x in groups]
    comp = attack[g].completions[c]
    attack[g].completions[c] = type(comp)(
        comp.prompt_index,
        comp.token_ids,
        tuple([cfg.forged] * len(comp.token_ids)),
        comp.text,
        comp.finish_reason,
    )

    def gradient(batch: list[Group], rows: list[int]) -> Any:
        adv = [group_advantages(t.rewards(x)) for x in batch]
        t.optimizer.zero_grad(set_to_none=True)
        t._accumulate(batch, adv, rows, grad=True)
        out = torch.cat([p.grad.flatten() for p in t.model.parameters() if p.grad is not None])
        t.optimizer.zero_grad(set_to_none=True)
        return out.double()

    def cos(a: Any, b: Any) -> float:
        value = float(torch.dot(a, b) / (a.norm() * b.norm()))
        return value if math.isfinite(value) else float("nan")

    every = list(range(len(groups)))
    honest, step, alone = gradient(groups, every), gradient(attack, every), gradient(attack, [g])
    stats = t.step(attack)
    published = True
    try:
        t.publish()
    except ValueError:
        published = False
    return {
        "honest_grad_norm": float(honest.norm()),
        "attack_grad_norm": float(step.norm()),
        "norm_ratio": float(step.norm() / honest.norm()),
        "cos_with_forged_result": cos(step, alone),
        "cos_with_honest_batch": cos(step, honest),
        "step_taken": not stats.skipped,
        "refused": stats.refused or "",
        "dropped_groups": len(stats.dropped),
        "capped_frac": stats.capped_frac,
        "weights_finite": all(bool(torch.isfinite(p).all()) for p in t.params.values()),
        "published": published,
        "forged_group": g,
        "forged_tokens": len(comp.token_ids),
    }


def _append(path: Path, row: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    old: list[dict[str, Any]] = []
    if path.exists():
        with open(path) as f:
            old = list(csv.DictReader(f))
    rows = [*old, row]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in keys})


def _done(path: Path) -> set[str]:
    if not path.exists():
        return set()
    with open(path) as f:
        return {r["key"] for r in csv.DictReader(f)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="What one forged result can do to a Trainer step, with and without the "
        "bounds; honest behaviour log-probs per engine; honest real runs under the bounds."
    )
    p.add_argument(
        "--part",
        default="all",
        choices=["logprobs", "attack", "honest", "all"],
        help="which measurement to run (default: all)",
    )
    p.add_argument("--engines", default="transformers", help="comma-separated: transformers, vllm")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--batches", type=int, default=32, help="prompts per attacked step")
    p.add_argument("--steps", type=int, default=20, help="steps of each honest run")
    p.add_argument("--out", default=f"results/{NAME}", help="folder for the rows")
    args = p.parse_args(argv)
    out = Path(args.out)
    engines = [e for e in args.engines.split(",") if e]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    sha = git_sha()
    jobs: list[tuple[str, Any]] = []
    if args.part in ("logprobs", "all"):
        jobs += [("logprobs", LogprobConfig(engine=e, batches=args.batches)) for e in engines]
    if args.part in ("attack", "all"):
        jobs += [
            ("attack", AttackConfig(forged=x, bounds=b, seed=s))
            for s in seeds
            for x in FORGED
            for b in (False, True)
        ]
    if args.part in ("honest", "all"):
        jobs += [
            ("honest", HonestConfig(engine=e, seed=s, steps=args.steps))
            for e in engines
            for s in seeds
        ]
    for part, cfg in jobs:
        path = out / f"{part}.csv"
        if cfg.key in _done(path):
            continue
        if part == "logprobs":
            got = measure_logprobs(cfg)
        elif part == "attack":
            got = measure_attack(cfg)
        else:
            got = honest_run(cfg, out)
        row = {"key": cfg.key, **dataclasses.asdict(cfg), **got, "git_sha": sha}
        _append(path, row)
        print(json.dumps(row, default=str), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
