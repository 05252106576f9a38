"""Verified rollouts: the honest tolerance, what each dishonest Actor gets in before it is excluded,
and what verification costs an honest run.

Parts, each a list of configs (functions below) that :func:`main` runs: ``tolerance`` (offline:
honest log-prob error per engine and the share of each dishonest mode's results the rule refuses,
:func:`measure_tolerance`; the default bounds of
:class:`aurora.policy.verification.VerificationConfig` rest on it), ``detect`` (``aurora real``:
whether and when a cheater is excluded, :func:`detect_runs`), ``sampling`` (offline: the rank
test against selecting and random cheats, :func:`measure_sampling`), ``cost`` and ``fpr``
(``aurora real``: verification off and on, and a long honest run, :func:`cost_runs`,
:func:`fpr_runs`). Rows (resolved config, seed, git SHA, metrics) go to
``results/verification/{tolerance,sampling,runs}.csv`` and a figure to
``results/verification/verification.png``; re-running skips rows already there. CLI only under
``__main__``: ``python -m experiments.verification [--part tolerance|sampling|
detect|cost|fpr|all] [--engines transformers,vllm] [--seeds 0]``."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aurora.provenance import git_sha

NAME = "verification"
CHEATS = ("random", "stale", "othermodel", "forged-lp", "partial:0.1")
"""The dishonest Actors tested (:mod:`aurora.runtime.cheats`)."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One ``aurora real`` run of this experiment."""

    part: str
    """``detect``, ``cost`` or ``fpr``."""
    engine: str
    """The Actors' engine (``transformers`` or ``vllm``)."""
    cheat: str | None
    """The dishonest Actor's mode (None: every Actor honest)."""
    verify: bool
    """Verified rollouts on."""
    steps: int
    """Training steps."""
    seed: int
    """The job's seed (task stream, sampling, the choice of results to check)."""
    honest: int
    """Honest Actors."""
    prompts_per_step: int = 32
    """B."""
    group_size: int = 8
    """G."""

    @property
    def key(self) -> str:
        mode = self.cheat or "honest"
        return f"{self.part}-{self.engine}-{mode}-{'on' if self.verify else 'off'}-s{self.seed}"


def detect_runs(engines: Sequence[str], seeds: Sequence[int]) -> list[RunConfig]:
    """Each dishonest mode beside one honest Actor, default rule.

    One honest and one dishonest Actor (:mod:`aurora.runtime.cheats`) under the default rule,
    per mode and engine: whether and when the cheater was excluded (batches requested, training
    steps published, seconds), how many of its results were admitted before, and how many were
    trained on; whether any honest Actor was.
    """
    return [
        RunConfig(
            part="detect",
            engine=e,
            cheat=c,
            verify=True,
            steps=30 if c == "partial:0.1" else 16,
            seed=s,
            honest=1,
        )
        for e in engines
        for c in CHEATS
        for s in seeds
    ]


def cost_runs(engines: Sequence[str], seeds: Sequence[int], steps: int = 30) -> list[RunConfig]:
    """Two honest Actors, verification off and on, same length and seed.

    Measured: mean step time and generated tokens per second, and their ratio.
    """
    return [
        RunConfig(part="cost", engine=e, cheat=None, verify=v, steps=steps, seed=s, honest=2)
        for e in engines
        for s in seeds
        for v in (False, True)
    ]


def fpr_runs(engines: Sequence[str], steps: int = 150) -> list[RunConfig]:
    """A long honest run with verification on (the false-positive count over it).

    No honest Actor may ever be excluded.
    """
    return [
        RunConfig(part="fpr", engine=e, cheat=None, verify=True, steps=steps, seed=1, honest=2)
        for e in engines
    ]


def topology(cfg: RunConfig) -> dict[str, Any]:
    actors = [{"region": "us", "gpu": "A100", "count": cfg.honest, "name": "honest"}]
    if cfg.cheat is not None:
        actors.append({"region": "us", "gpu": "A100", "count": 1, "name": "cheat"})
    return {
        "name": "verify",
        "trainer": {"region": "us", "model": "qwen3-8b", "gpu": "H100", "gpus": 1},
        "regions": [{"name": "us"}],
        "actors": actors,
        "real": {
            "model": "tiny",
            "engine": cfg.engine,
            "steps": cfg.steps,
            "prompts_per_step": cfg.prompts_per_step,
            "group_size": cfg.group_size,
            "eval_prompts": 50,
            "lease_initial_s": 300.0,
            "actors": None,
        },
    }


def real_run(cfg: RunConfig, out: Path) -> Path:
    """Run ``cfg`` with ``aurora real`` (in this process's launcher); its run folder."""
    from aurora.runtime.launcher import Launcher, RealRun
    from aurora.topology import topology_from_dict

    launcher = Launcher(
        RealRun(
            topology=topology_from_dict(topology(cfg), source=cfg.key),
            topology_path=cfg.key,
            out=str(out / "runs" / cfg.key),
            seed=cfg.seed,
            backend="rl",
            extra={"verify": cfg.verify, "start_actors": cfg.honest + (cfg.cheat is not None)},
            hooks={"cheat-0": {"cheat": cfg.cheat}} if cfg.cheat else {},
            progress=False,
            stall_s=600.0,
        )
    )
    if launcher.main() != 0:
        raise RuntimeError(f"{cfg.key}: aurora real failed")
    return launcher.dir


def analyse(run_dir: Path, mode: str | None = None, cheater: str = "cheat-0") -> dict[str, Any]:
    """The metrics of one run from its own files (events.csv, trainer/steps.jsonl, summary);
    ``mode``: the cheater's (which of its results were lies)."""
    from aurora.runtime.cheats import lies_on

    with open(run_dir / "events.csv") as f:
        rows = [r | {"rec": json.loads(r["record"])} for r in csv.DictReader(f)]
    summary = json.loads((run_dir / "summary.json").read_text())
    first_request = next(float(r["time"]) for r in rows if r["type"] == "BatchRequested")
    batches = published = 0
    evicted: dict[str, dict[str, Any]] = {}
    admitted_before = 0
    evicted_at = float("inf")
    checks: dict[str, int] = {}
    for r in rows:
        kind, rec = r["type"], r["rec"]
        if kind == "BatchRequested":
            batches += 1
        elif kind == "Published" and int(rec.get("version", 0)) > 0:
            published += 1
        elif kind == "ResultVerified":
            checks[rec["actor"]] = checks.get(rec["actor"], 0) + 1
        elif kind == "Accepted" and rec["actor"] == cheater and cheater not in evicted:
            admitted_before += 1
        elif kind == "Evicted" and rec["actor"] not in evicted:
            if rec["actor"] == cheater:
                evicted_at = float(r["time"])
            evicted[rec["actor"]] = {
                "reason": rec["reason"],
                "batch": batches,
                "after_step": published,
                "after_s": float(r["time"]) - first_request,
            }
    steps = [
        json.loads(line)["stats"]
        for line in (run_dir / "trainer" / "steps.jsonl").read_text().splitlines()
        if line.strip()
    ]
    trained = 0
    for s in steps:
        for part in str(s.get("trained_from") or "").split(","):
            actor, _, n = part.rpartition(":")
            if actor == cheater:
                trained += int(n)
    # The batch whose check caught it (batch k is trained into version k); every result of the
    # cheater in an earlier batch was trained on, none from that batch on.
    caught = next((k for k, s in enumerate(steps, 1) if s.get("verify_failed")), None)
    lies_admitted = lies_trained = 0
    if mode is not None:
        for r in rows:
            if r["type"] != "Accepted" or r["rec"]["actor"] != cheater:
                continue
            prompt = r["rec"]["prompt"]
            if not lies_on(mode, prompt):
                continue
            if mode == "stale" and int(r["rec"]["version"]) == 0:
                continue  # frozen on v0: its results on v0 are honest
            lies_admitted += float(r["time"]) <= evicted_at
            batch = int(prompt[1:].split("-")[0])
            lies_trained += caught is None or batch < caught
    with open(run_dir / "steps.csv") as f:
        times = [float(r["step_time_s"]) for r in csv.DictReader(f)]
    half = times[len(times) // 2 :]
    ex = evicted.get(cheater)
    return {
        "excluded": ex is not None,
        "reason": ex["reason"] if ex else "",
        "caught_in_batch": caught if caught is not None else "",
        "excluded_in_batch": ex["batch"] if ex else "",
        "excluded_after_step": ex["after_step"] if ex else "",
        "excluded_after_s": round(ex["after_s"], 3) if ex else "",
        "cheater_admitted_before_exclusion": admitted_before,
        "cheater_results_trained": trained,
        "lies_admitted_before_exclusion": lies_admitted,
        "lies_trained": lies_trained,
        "honest_excluded": sum(1 for a in evicted if a != cheater),
        "checks": sum(checks.values()),
        "checks_honest": sum(n for a, n in checks.items() if a != cheater),
        "results_admitted": sum(1 for r in rows if r["type"] == "Accepted"),
        "verify_s": round(sum(float(s.get("verify_s", 0.0)) for s in steps), 4),
        "train_s": round(sum(float(s.get("train_s", 0.0)) for s in steps), 4),
        "step_time_s": summary["step_time_s"],
        "step_time_second_half_s": sum(half) / len(half) if half else "",
        "tokens_per_s": summary["tokens_per_s"],
        "wall_s": summary["wall_s"],
        "steps_completed": summary["steps_completed"],
        "prompts_lost": summary["prompts_lost"],
        "replay_action_mismatches": summary["replay_action_mismatches"],
        "lease_book_ok": summary["lease_book_ok"],
        "reward_first": summary["reward_first"],
        "reward_last": summary["reward_last"],
    }


# ---- the offline part: tolerance and per-result detection ------------------------------


@dataclass(frozen=True, kw_only=True)
class ToleranceConfig:
    """One offline measurement of |reported - recomputed| log-probs."""

    engine: str
    """The engine that samples (the Trainer recomputes in fp32 on the CPU)."""
    batches: int = 8
    """Batches of ``prompts`` x ``group_size`` sampled."""
    prompts: int = 32
    """Prompts per batch."""
    group_size: int = 8
    """Completions per prompt."""
    train_steps: int = 10
    """GRPO steps taken for the ``stale`` rows (samples of v0 judged under v_k)."""
    seed: int = 0
    """Sampling and task seed."""


def tolerance_points(engines: Sequence[str], batches: int = 8) -> list[ToleranceConfig]:
    return [ToleranceConfig(engine=e, batches=batches) for e in engines]


def _spec(engine: str, seed: int, tmp: str, prompts: int, group: int) -> Any:
    from aurora.runtime.job import make_spec
    from aurora.topology import topology_from_dict

    topo = topology_from_dict(
        {
            "name": "tol",
            "trainer": {"region": "us", "model": "qwen3-8b", "gpus": 1},
            "regions": [{"name": "us"}],
            "actors": [{"region": "us", "gpu": "A100", "count": 1}],
            "real": {"engine": engine, "group_size": group, "prompts_per_step": prompts},
        }
    )
    spec = make_spec(topo, strategy="aurora", seed=seed, steps=None, store=tmp)
    return dataclasses.replace(spec, verify=True)


def measure_tolerance(cfg: ToleranceConfig) -> list[dict[str, Any]]:
    """Rows (one per mode) of the offline measurement.

    The largest and mean |reported - recomputed| log-prob of honest results of the tiny Qwen3
    per engine (transformers: fp32 arithmetic on the bf16 weights, as the Trainer's recompute;
    vLLM's CPU build: bf16 arithmetic), and per dishonest mode the share of its results the rule
    refuses (``stale``: samples of v0 judged under v_k, k = 1, 2, 5, 10 steps of real GRPO
    training at the ``learn`` rate). This is what the default bounds of
    :class:`aurora.policy.verification.VerificationConfig` rest on.
    """
    import tempfile

    from aurora.policy.verification import (
        VerificationConfig,
        judge,
        measure,
        payload_digest,
        pick_completions,
    )
    from aurora.runtime.cheats import CheatingEngine
    from aurora.runtime.compute import Sampling
    from aurora.runtime.rlbackend import RLTrainer, make_rl_engine

    tmp = tempfile.mkdtemp(prefix="aurora-tol-")
    spec = _spec(cfg.engine, cfg.seed, tmp, cfg.prompts, cfg.group_size)
    trainer = RLTrainer(spec, workdir=tmp)
    engine = make_rl_engine(spec)
    engine.load(trainer.published(), version=0, weights_hash=trainer.weights_hash)
    rule = VerificationConfig()
    # The coin's key: any fixed 32 bytes do offline (no Actor here to hide it from); the
    # seed's, so a rerun picks the same completions.
    key = hashlib.blake2b(f"tolerance {cfg.seed}".encode(), digest_size=32).digest()
    sampling = Sampling(
        n=cfg.group_size, max_new_tokens=trainer.max_new_tokens, temperature=1.0, seed=cfg.seed
    )

    tokens: dict[str, list[float]] = {}

    def judged(
        eng: Any, batch: int, version: int, mode: str = "honest"
    ) -> tuple[list[Any], float, float]:
        """Measures of one batch, each over the completions a check would pick (and every
        checked token's |delta| kept for the mode's quantiles)."""
        prompts = [(f"b{batch}-{i}", i) for i in range(cfg.prompts)]
        t0 = time.perf_counter()
        out = eng.generate(prompts, sampling)
        t1 = time.perf_counter()
        picks = [
            pick_completions(rule, key, "tolerance", pid, payload_digest(g.payload), cfg.group_size)
            for (pid, _), g in zip(prompts, out, strict=True)
        ]
        pairs = trainer.recompute(
            [(i, g.payload, version) for (_, i), g in zip(prompts, out, strict=True)], picks
        )
        t2 = time.perf_counter()
        ms = [measure(*p) for p in pairs if p is not None]
        tokens.setdefault(mode, []).extend(
            abs(a - b)
            for p in pairs
            if p is not None
            for r1, r2 in zip(*p, strict=True)
            for a, b in zip(r1, r2, strict=True)
        )
        return ms, t1 - t0, t2 - t1

    def row(mode: str, ms: list[Any], gen_s: float, rec_s: float, **extra: Any) -> dict[str, Any]:
        import numpy as np

        q = np.quantile(tokens[mode], [0.5, 0.99, 0.999, 0.9999]) if tokens.get(mode) else []
        tokens.pop(mode, None)
        return {
            "token_q50": float(q[0]) if len(q) else "",
            "token_q99": float(q[1]) if len(q) else "",
            "token_q999": float(q[2]) if len(q) else "",
            "token_q9999": float(q[3]) if len(q) else "",
            "engine": cfg.engine,
            "mode": mode,
            "results": len(ms),
            "tokens": sum(m.tokens for m in ms),
            "max_delta": max(m.max_delta for m in ms),
            "max_mean_delta": max(m.mean_delta for m in ms),
            "min_logprob": min(m.min_logprob for m in ms),
            "refused_share": sum(judge(m, rule) is not None for m in ms) / len(ms),
            "generate_s": gen_s,
            "recompute_s": rec_s,
            **extra,
        }

    rows = []
    honest: list[Any] = []
    gen = rec = 0.0
    for b in range(cfg.batches):
        ms, g, r = judged(engine, b + 1, 0)
        if b > 0:  # the first batch pays for warm-up
            gen, rec = gen + g, rec + r
        honest += ms
    rows.append(row("honest", honest, gen, rec))
    for mode in ("random", "othermodel", "forged-lp", "partial:0.1"):
        cheat = CheatingEngine(engine, mode, spec)
        ms: list[Any] = []
        for b in range(2):
            ms += judged(cheat, 100 + b, 0, mode)[0]
        rows.append(row(mode, ms, 0.0, 0.0))
    if cfg.engine == "transformers":  # stale: v0 samples under v_k, k GRPO steps later
        stale = make_rl_engine(spec, engine="transformers")
        stale.load(trainer.published(), version=0, weights_hash=trainer.weights_hash)
        for k in range(1, cfg.train_steps + 1):
            prompts = [(f"b{200 + k}-{i}", i) for i in range(cfg.prompts)]
            out = engine.generate(prompts, sampling)
            trainer.train(
                [(i, g.payload, trainer.version) for (_, i), g in zip(prompts, out, strict=True)]
            )
            trainer.publish(lambda seg: None)
            engine.load(trainer.published(), version=k, weights_hash=trainer.weights_hash)
            if k in (1, 2, 5, 10):
                ms = judged(stale, 300 + k, trainer.version, "stale")[0]
                rows.append(row("stale", ms, 0.0, 0.0, versions_behind=k))
    return rows


# ---- the offline part: ranks of sampled tokens ---------------------------------------------

RANK_CHEATS = ("random", "greedy", "chosen", "bestof:4", "bestof:8")
"""The cheats of the ``sampling`` part: random ids (which the log-prob rule catches too) and the
selections only the ranks can see (:data:`aurora.runtime.cheats.SELECTION`)."""


@dataclass(frozen=True, kw_only=True)
class RankConfig:
    """One offline measurement of the ranks ``u`` per engine."""

    engine: str
    """The engine that samples (the Trainer recomputes in fp32 on the CPU)."""
    batches: int = 100
    """Honest batches of ``prompts`` x ``group_size`` sampled."""
    cheat_batches: int = 8
    """Batches of each cheat (``bestof:N`` and ``chosen``: ``slow_cheat_batches``)."""
    slow_cheat_batches: int = 48
    """Batches of the cheats the rank test catches only after hundreds of checks."""
    prompts: int = 32
    """Prompts per batch."""
    group_size: int = 8
    """Completions per prompt."""
    seed: int = 0
    """Sampling and task seed."""
    secret: int = 7
    """Seed of the V's key (a 32-byte key is derived from it: the experiment has no Trainer)."""


def sampling_points(engines: Sequence[str], batches: int = 100) -> list[RankConfig]:
    # vLLM's CPU build samples ~10x slower than the transformers engine here (the N samples
    # of bestof:N each a call): fewer batches of its slow cheats.
    return [
        RankConfig(engine=e, batches=batches, slow_cheat_batches=48 if e == "transformers" else 16)
        for e in engines
    ]


def _ks(us: Any) -> float:
    """Kolmogorov-Smirnov distance of ``us`` to U(0, 1)."""
    import numpy as np

    x = np.sort(np.asarray(us, dtype=float))
    n = len(x)
    k = np.arange(1, n + 1)
    return float(max(np.max(k / n - x), np.max(x - (k - 1) / n))) if n else 0.0


def measure_sampling(cfg: RankConfig) -> list[dict[str, Any]]:
    """Rows (honest, then one per cheat) of the ``sampling`` part.

    The ranks ``u`` of sampled tokens under the Trainer's distribution
    (:mod:`aurora.policy.sampling`) per engine: honest (mean, z, KS distance, the sequential
    test over the checks in order; the rank gap between correct and wrong completions that
    bounds what selection on the reward gains), and per selecting or random cheat (``random``,
    ``greedy``, ``chosen``, ``bestof:4``, ``bestof:8``) the checks and tokens until the rank
    test and the log-prob rule catch it, and its reward gain per completion.
    """
    import tempfile

    import msgpack
    import numpy as np

    from aurora.policy.sampling import (
        LOCATION_VARIANCE,
        RankStats,
        SamplingRule,
        boundary,
        detection_tokens,
        judge_ranks,
        reward_gain_bound,
    )
    from aurora.policy.verification import VerificationConfig, judge, measure, pick_completions
    from aurora.runtime.cheats import CheatingEngine
    from aurora.runtime.compute import Sampling
    from aurora.runtime.rlbackend import RLTrainer, make_rl_engine

    tmp = tempfile.mkdtemp(prefix="aurora-ranks-")
    spec = _spec(cfg.engine, cfg.seed, tmp, cfg.prompts, cfg.group_size)
    trainer = RLTrainer(spec, workdir=tmp)
    engine = make_rl_engine(spec)
    engine.load(trainer.published(), version=0, weights_hash=trainer.weights_hash)
    spec = dataclasses.replace(spec, eos_id=trainer.eos_id)
    rule = VerificationConfig()
    test = SamplingRule()
    sampling = Sampling(
        n=cfg.group_size, max_new_tokens=trainer.max_new_tokens, temperature=1.0, seed=cfg.seed
    )

    def run(eng: Any, first: int, batches: int) -> list[dict[str, Any]]:
        """Per result, in order: its completions' ranks and rewards, and the check's verdict
        by the log-prob rule (over the completions a check picks)."""
        out = []
        for b in range(batches):
            prompts = [
                (f"b{first + b}-{i}", (first + b) * cfg.prompts + i) for i in range(cfg.prompts)
            ]
            gens = eng.generate(prompts, sampling)
            triples = trainer.recompute(
                [(i, g.payload, 0) for (_, i), g in zip(prompts, gens, strict=True)],
                keys=[pid for pid, _ in prompts],
                secret=hashlib.blake2b(f"ranks|{cfg.secret}".encode(), digest_size=32).digest(),
            )
            for (pid, index), g, t in zip(prompts, gens, triples, strict=True):
                assert t is not None
                rep, rec, us = t
                ids = [c["ids"] for c in msgpack.unpackb(g.payload)["completions"]]
                prompt = trainer.task.prompt(index)
                rewards = [
                    trainer.task.reward(prompt, trainer.trainer.completion_text(c)) for c in ids
                ]
                picks = pick_completions(rule, "ranks", pid, len(us))
                m = measure([rep[j] for j in picks], [rec[j] for j in picks])
                out.append(
                    {
                        "ranks": us,
                        "rewards": rewards,
                        "picks": picks,
                        "logprob_fails": judge(m, rule) is not None,
                    }
                )
        return out

    def sequential(results: list[dict[str, Any]]) -> dict[str, Any]:
        """The checks in order: when the rank test and the log-prob rule first fail."""
        stats = RankStats()
        caught = caught_tokens = lp_caught = verdict = None
        worst = 0.0
        for k, r in enumerate(results, 1):
            stats = stats.add(u for j in r["picks"] for u in r["ranks"][j])
            worst = max(worst, abs(stats.shift) / boundary(stats.tokens, LOCATION_VARIANCE, test))
            if caught is None and (verdict := judge_ranks(stats, test)) is not None:
                caught, caught_tokens = k, stats.tokens
            if lp_caught is None and r["logprob_fails"]:
                lp_caught = k
        return {
            "checks": len(results),
            "checked_tokens": stats.tokens,
            "rank_caught_at_check": caught if caught is not None else "",
            "rank_caught_at_tokens": caught_tokens if caught_tokens is not None else "",
            "rank_verdict": verdict.name if verdict is not None else "",
            "logprob_caught_at_check": lp_caught if lp_caught is not None else "",
            "largest_location_over_boundary": worst,
        }

    def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
        us = np.array([u for r in results for c in r["ranks"] for u in c])
        st = RankStats().add(us.tolist())
        return {
            "tokens": int(len(us)),
            "mean_u_minus_half": float(us.mean() - 0.5),
            "mean_u_se": float(np.sqrt(LOCATION_VARIANCE / len(us))),
            "z": st.z,
            "z_spread": st.z_spread,
            "ks": _ks(us),
            "ks_sqrt_n": _ks(us) * float(np.sqrt(len(us))),
            "reward": float(np.mean([x for r in results for x in r["rewards"]])),
            "mean_length": float(np.mean([len(c) for r in results for c in r["ranks"]])),
        }

    rows = []
    honest = run(engine, 1, cfg.batches)
    base = summary(honest)
    # The rank gap of correct and wrong completions (module docstring of aurora.policy.sampling)
    sums = [
        (sum(u - 0.5 for u in c), x)
        for r in honest
        for c, x in zip(r["ranks"], r["rewards"], strict=True)
    ]
    s1 = [s for s, x in sums if x > 0]
    s0 = [s for s, x in sums if x <= 0]
    gap = float(np.mean(s1) - np.mean(s0)) if s1 and s0 else float("nan")
    extra = {
        "rank_gap_s1_minus_s0": gap,
        "s1": float(np.mean(s1)) if s1 else "",
        "s0": float(np.mean(s0)) if s0 else "",
        "gain_bound_at_1000": reward_gain_bound(1000, test, length=base["mean_length"], gap=gap),
        "gain_bound_at_10000": reward_gain_bound(10000, test, length=base["mean_length"], gap=gap),
    }
    rows.append({"engine": cfg.engine, "mode": "honest", **base, **sequential(honest), **extra})
    for mode in RANK_CHEATS:
        if cfg.engine != "transformers" and mode in ("greedy", "chosen"):
            continue  # written by the cheat's own transformers copy whatever the engine
        cheat = CheatingEngine(engine, mode, spec)
        cheat.load(trainer.published(), version=0, weights_hash=trainer.weights_hash)
        slow = mode.startswith("bestof") or mode == "chosen"
        res = run(cheat, 1000, cfg.slow_cheat_batches if slow else cfg.cheat_batches)
        s = summary(res)
        shift = s["mean_u_minus_half"]
        rows.append(
            {
                "engine": cfg.engine,
                "mode": mode,
                **s,
                **sequential(res),
                "reward_gain": s["reward"] - base["reward"],
                "predicted_tokens": detection_tokens(shift, test) or "",
            }
        )
    return rows


# ---- rows, figure, main -------------------------------------------------------------------


def _append(path: Path, row: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    exists = path.exists()
    old: list[dict[str, Any]] = []
    if exists:
        with open(path) as f:
            old = list(csv.DictReader(f))
    rows = [*old, {k: row.get(k, "") for k in dict.fromkeys([*(old[0] if old else {}), *row])}]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in keys})


def _done(path: Path, column: str) -> set[str]:
    if not path.exists():
        return set()
    with open(path) as f:
        return {r[column] for r in csv.DictReader(f)}


def figure(out: Path) -> Path | None:
    """Bars: steps to exclusion per mode and engine; the honest cost ratio per engine."""
    runs = out / "runs.csv"
    if not runs.exists():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(runs) as f:
        rows = list(csv.DictReader(f))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    det = [r for r in rows if r["part"] == "detect"]
    labels = [f"{r['cheat']}\n{r['engine']}" for r in det]
    a.bar(
        range(len(det)),
        [float(r["excluded_after_step"] or "nan") for r in det],
        color=["tab:red" if r["excluded"] == "True" else "tab:gray" for r in det],
    )
    a.set_xticks(range(len(det)), labels, fontsize=7)
    a.set_ylabel("training steps before exclusion")
    a.set_title("dishonest Actor excluded after")
    cost = [r for r in rows if r["part"] == "cost"]
    engines = sorted({r["engine"] for r in cost})
    ratios = []
    for e in engines:
        on = [float(r["step_time_s"]) for r in cost if r["engine"] == e and r["verify"] == "True"]
        off = [float(r["step_time_s"]) for r in cost if r["engine"] == e and r["verify"] == "False"]
        ratios.append(sum(off) / sum(on) if on and off else float("nan"))
    b.bar(engines, ratios)
    b.axhline(0.9, color="tab:red", ls="--", label="10% cost bound")
    b.set_ylim(0, 1.1)
    b.set_ylabel("throughput with / without verification")
    b.legend()
    fig.tight_layout()
    path = out / f"{NAME}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _rows(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


def _g(x: str, digits: int = 3) -> str:
    return f"{float(x):.{digits}g}" if x not in ("", None) else "-"


def tables(out: Path) -> str:
    """The markdown tables of docs/journal/verification-measurements.md, from the rows under
    ``out``."""
    tol = _rows(out / "tolerance.csv")
    lines = [
        "| engine | results checked | tokens | 99.9% / 99.99% token \\|delta\\| | max token "
        "\\|delta\\| | max mean \\|delta\\| | lowest recomputed log-prob | refused | "
        "recompute / generate time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in tol if r["mode"] == "honest"):
        ratio = float(r["recompute_s"]) / float(r["generate_s"])
        lines.append(
            f"| {r['engine']} | {r['results']} | {r['tokens']} | {_g(r.get('token_q999', ''))} / "
            f"{_g(r.get('token_q9999', ''))} | {_g(r['max_delta'])} | "
            f"{_g(r['max_mean_delta'])} | {_g(r['min_logprob'])} | {r['refused_share']} | "
            f"{ratio:.2f} |"
        )
    lines += [
        "",
        "| mode | engine | versions behind | results | refused | max \\|delta\\| "
        "| max mean \\|delta\\| |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in tol if r["mode"] != "honest"):
        lines.append(
            f"| {r['mode']} | {r['engine']} | {r.get('versions_behind') or '-'} | {r['results']} | "
            f"{float(r['refused_share']):.0%} | {_g(r['max_delta'])} | {_g(r['max_mean_delta'])} |"
        )
    ranks = _rows(out / "sampling.csv")
    lines += [
        "",
        "| engine | mode | tokens | mean u - 1/2 (se) | z | z spread | KS x sqrt(n) | reward "
        "(gain) | checks | caught by ranks at check (tokens) | caught by log-probs at check |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ranks:
        gain = f" ({float(r['reward_gain']):+.3f})" if r.get("reward_gain") else ""
        at = (
            f"{r['rank_caught_at_check']} ({r['rank_caught_at_tokens']}, {r['rank_verdict']})"
            if r["rank_caught_at_check"]
            else f"not in {r['checks']} (predicted {r.get('predicted_tokens') or '-'} tokens)"
        )
        lines.append(
            f"| {r['engine']} | {r['mode']} | {r['tokens']} | {float(r['mean_u_minus_half']):+.4f} "
            f"({float(r['mean_u_se']):.4f}) | {float(r['z']):.2f} | {float(r['z_spread']):.2f} | "
            f"{float(r['ks_sqrt_n']):.2f} | {float(r['reward']):.3f}{gain} | {r['checks']} | {at} "
            f"| {r['logprob_caught_at_check'] or '-'} |"
        )
    runs = _rows(out / "runs.csv")
    lines += [
        "",
        "| cheat | engine | seed | steps | excluded | reason | caught checking batch | "
        "training steps before exclusion | s after batch 1 | lies admitted before exclusion | "
        "lies trained | honest Actors excluded | checks (honest) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in runs if r["part"] == "detect"):
        lines.append(
            f"| {r['cheat']} | {r['engine']} | {r['seed']} | {r['steps']} | {r['excluded']} | "
            f"{r['reason']} | {r['caught_in_batch']} | {r['excluded_after_step']} | "
            f"{r['excluded_after_s']} | {r['lies_admitted_before_exclusion']} | "
            f"{r['lies_trained']} | {r['honest_excluded']} | {r['checks']} ({r['checks_honest']}) |"
        )
    lines += [
        "",
        "| part | engine | seed | steps | verify | step time (s) | second half (s) | tokens/s | "
        "checks | results | verify s | train s | honest excluded |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in runs if r["part"] in ("cost", "fpr")):
        lines.append(
            f"| {r['part']} | {r['engine']} | {r['seed']} | {r['steps']} | {r['verify']} | "
            f"{_g(r['step_time_s'])} | {_g(r.get('step_time_second_half_s', ''))} | "
            f"{_g(r['tokens_per_s'])} | {r['checks']} | "
            f"{r['results_admitted']} | {r['verify_s']} | {r['train_s']} | {r['honest_excluded']} |"
        )
    return "\n".join(lines)


def reanalyse(out: Path) -> None:
    """Recompute every row of ``runs.csv`` from its run folder (after ``analyse`` changed)."""
    path = out / "runs.csv"
    rows = _rows(path)
    fresh = []
    for row in rows:
        (run_dir,) = (out / "runs" / row["key"]).glob("*-s*")
        cheat = row["cheat"] or None
        fresh.append({**row, **analyse(run_dir, cheat)})
    path.unlink()
    for row in fresh:
        _append(path, row)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Verified rollouts: the honest tolerance, how each dishonest Actor is "
        "caught, what checking costs an honest run, and false positives."
    )
    p.add_argument(
        "--part",
        default="all",
        choices=["tolerance", "sampling", "detect", "cost", "fpr", "all", "tables", "reanalyse"],
        help="which measurement to run (default all); tables: print them from the rows",
    )
    p.add_argument(
        "--engines", default="transformers", help="comma-separated engines (transformers, vllm)"
    )
    p.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    p.add_argument(
        "--tolerance-batches", type=int, default=8, help="batches sampled per engine (default 8)"
    )
    p.add_argument(
        "--sampling-batches", type=int, default=100, help="honest batches per engine (default 100)"
    )
    p.add_argument("--cost-steps", type=int, default=30, help="steps of each cost run (default 30)")
    p.add_argument(
        "--fpr-steps", type=int, default=150, help="steps of each false-positive run (default 150)"
    )
    p.add_argument(
        "--out", default="results/verification", help="output folder (default results/verification)"
    )
    args = p.parse_args(argv)
    out = Path(args.out)
    engines = [e for e in args.engines.split(",") if e]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    sha = git_sha()
    if args.part == "reanalyse":
        reanalyse(out)
    if args.part in ("tolerance", "all"):
        path = out / "tolerance.csv"
        done = _done(path, "engine")
        for tc in tolerance_points(engines, args.tolerance_batches):
            if tc.engine in done:
                continue
            for r in measure_tolerance(tc):
                _append(path, {**dataclasses.asdict(tc), **r, "git_sha": sha})
                print(json.dumps(r, default=str), flush=True)
    if args.part in ("sampling", "all"):
        path = out / "sampling.csv"
        done = _done(path, "engine")
        for rc in sampling_points(engines, args.sampling_batches):
            if rc.engine in done:
                continue
            for r in measure_sampling(rc):
                _append(path, {**dataclasses.asdict(rc), **r, "git_sha": sha})
                print(json.dumps(r, default=str), flush=True)
    configs: list[RunConfig] = []
    if args.part in ("detect", "all"):
        configs += detect_runs(engines, seeds)
    if args.part in ("cost", "all"):
        configs += cost_runs(engines, seeds, args.cost_steps)
    if args.part in ("fpr", "all"):
        configs += fpr_runs(engines, args.fpr_steps)
    path = out / "runs.csv"
    done = _done(path, "key")
    for cfg in configs:
        if cfg.key in done:
            continue
        t0 = time.time()
        run_dir = real_run(cfg, out)
        row = {
            "key": cfg.key,
            **dataclasses.asdict(cfg),
            **analyse(run_dir, cfg.cheat),
            "git_sha": sha,
        }
        row["run_s"] = round(time.time() - t0, 1)
        _append(path, row)
        print(json.dumps(row, default=str), flush=True)
    fig = figure(out)
    if fig is not None:
        print(f"figure: {fig}")
    print(tables(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
