"""Evaluation, and the synchronous Trainer + in-process engine loop used by the learning check.

Theory of operation
-------------------
:func:`evaluate` scores an engine on fixed prompts (greedy by default, so one evaluation of the
default model is a deterministic function of its weights) with the task's reward function.

:func:`train_local` is the smallest complete RL loop over the project's real pieces: each step
the engine samples G completions for B training prompts (ids ``step * B ..``), the Trainer takes
one GRPO step on them and publishes ``D_{v+1}`` through the delta format, and the engine applies
the parsed, verified delta in place. It is on-policy (lag 0): the runtime replaces this loop with
leases, Actors on other hosts and one-step asynchrony, and calls the same methods.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from aurora.delta import read_delta
from aurora.engines.base import Engine, Sampling
from aurora.rl.tasks import RewardFn, Task, score
from aurora.rl.trainer import Group, Publication, StepStats, Trainer


def evaluate(
    engine: Engine,
    reward: RewardFn,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    n: int = 1,
    seed: int = 0,
    batch: int = 512,
) -> float:
    """Mean reward of ``n`` completions per prompt (greedy when ``temperature`` is 0)."""
    total, count = 0.0, 0
    sampling = Sampling(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    for lo in range(0, len(prompts), batch):
        chunk = list(prompts[lo : lo + batch])
        for p, group in zip(chunk, engine.generate(chunk, n, sampling), strict=True):
            for c in group:
                total += score(reward, p, c.text)
                count += 1
    return total / max(count, 1)


@dataclass
class LocalRun:
    """What :func:`train_local` measured."""

    steps: list[StepStats] = field(default_factory=list)
    publications: list[dict[str, float]] = field(default_factory=list)
    """Per published version: version, changed, total, density, delta bytes, seconds."""
    evals: list[dict[str, float]] = field(default_factory=list)
    """Per evaluation: step, greedy (and sampled when asked) held-out reward, wall seconds."""
    seconds: float = 0.0


def train_local(
    trainer: Trainer,
    engine: Engine,
    task: Task,
    *,
    steps: int,
    prompts_per_step: int,
    group_size: int,
    eval_prompts: Sequence[str] = (),
    eval_every: int = 0,
    eval_sampled: bool = False,
    seed: int = 0,
    first_prompt: int = 0,
    on_step: Callable[[int, StepStats, Publication], None] | None = None,
) -> LocalRun:
    """Run ``steps`` synchronous GRPO steps of ``trainer`` with ``engine`` sampling; evaluate on
    ``eval_prompts`` before the first step, every ``eval_every`` steps and after the last."""
    run = LocalRun()
    t0 = time.perf_counter()
    mnt = task.max_new_tokens

    def do_eval(step: int) -> None:
        row = {"step": float(step), "seconds": time.perf_counter() - t0}
        row["greedy"] = evaluate(engine, task.reward, eval_prompts, max_new_tokens=mnt)
        if eval_sampled:
            row["sampled"] = evaluate(
                engine,
                task.reward,
                eval_prompts,
                max_new_tokens=mnt,
                temperature=trainer.config.temperature,
                seed=seed + 7919 * step,
            )
        run.evals.append(row)

    if eval_prompts:
        do_eval(0)
    for step in range(steps):
        first = first_prompt + step * prompts_per_step
        prompts = [task.prompt(i) for i in range(first, first + prompts_per_step)]
        sampling = Sampling(
            max_new_tokens=mnt,
            temperature=trainer.config.temperature,
            seed=seed * 1_000_003 + step,
        )
        version = engine.version
        groups = [
            Group(prompt=p, completions=g, version=version)
            for p, g in zip(prompts, engine.generate(prompts, group_size, sampling), strict=True)
        ]
        stats = trainer.step(groups)
        pub = trainer.publish()
        engine.apply(read_delta(pub.data, expected_hash=pub.weights_hash))
        run.steps.append(stats)
        run.publications.append(
            {
                "version": float(pub.version),
                "changed": float(pub.changed),
                "total": float(pub.total),
                "density": pub.density,
                "bytes": float(len(pub.data)),
                "seconds": pub.seconds,
            }
        )
        if on_step is not None:
            on_step(step, stats, pub)
        if eval_prompts and eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            do_eval(step + 1)
    if eval_prompts:
        do_eval(steps)
    run.seconds = time.perf_counter() - t0
    return run
