"""Sampling, not only log-probs, on the tiny model (transformers engine, one process): the
selecting cheats (greedy, chosen, best of N) pass the payload checks and every log-prob
recompute, and the ranks of their tokens are what tells them apart; an honest engine's ranks
pass the test."""

from __future__ import annotations

import dataclasses

import pytest

from aurora.policy.sampling import RankStats, SamplingRule, Skew, judge_ranks
from aurora.policy.verification import VerificationConfig, judge, measure

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def rl(tmp_path_factory):
    from aurora.runtime.job import make_spec
    from aurora.runtime.rlbackend import RLTrainer, make_rl_engine
    from aurora.topology import topology_from_dict

    tmp = tmp_path_factory.mktemp("rl")
    topo = topology_from_dict(
        {
            "name": "t",
            "trainer": {"region": "us", "model": "qwen3-8b", "gpus": 1},
            "regions": [{"name": "us"}],
            "actors": [{"region": "us", "gpu": "A100", "count": 1}],
            "real": {"group_size": 4, "prompts_per_step": 16},
        }
    )
    spec = make_spec(topo, strategy="aurora", seed=0, steps=None, store=str(tmp))
    spec = dataclasses.replace(spec, verify=True)
    trainer = RLTrainer(spec, workdir=str(tmp))
    spec = dataclasses.replace(spec, eos_id=trainer.eos_id)
    engine = make_rl_engine(spec)
    engine.load(trainer.published(), version=0, weights_hash=trainer.weights_hash)
    return spec, trainer, engine


def checks(trainer, engine, batches: int) -> tuple[list, RankStats]:
    """The log-prob verdict of every result of ``batches`` batches of 16 prompts x 4, and the
    rank sums over all their tokens."""
    from aurora.runtime.compute import Sampling

    sampling = Sampling(n=4, max_new_tokens=trainer.max_new_tokens, temperature=1.0, seed=0)
    cfg = VerificationConfig()
    verdicts, stats = [], RankStats()
    for b in range(batches):
        prompts = [(f"b{b}-{i}", 16 * b + i) for i in range(16)]
        out = engine.generate(prompts, sampling)
        triples = trainer.recompute(
            [(i, g.payload, 0) for (_, i), g in zip(prompts, out, strict=True)],
            keys=[f"actor|{pid}" for pid, _ in prompts],
            secret=bytes(range(32)),
        )
        for t in triples:
            m = measure(*t)
            verdicts.append(judge(m, cfg))
            stats = stats.merge(m.ranks)
    return verdicts, stats


def test_an_honest_engines_ranks_pass_and_its_log_probs_too(rl):
    _, trainer, engine = rl
    verdicts, stats = checks(trainer, engine, 6)
    assert verdicts == [None] * len(verdicts)
    assert stats.tokens > 1000 and judge_ranks(stats, SamplingRule()) is None


@pytest.mark.parametrize("mode", ["greedy", "chosen", "bestof:4"])
def test_a_selecting_cheat_passes_every_log_prob_recompute(rl, mode):
    from aurora.runtime.cheats import CheatingEngine
    from aurora.runtime.messages import decode_result_payload

    spec, trainer, engine = rl
    cheat = CheatingEngine(engine, mode, spec)
    cheat.load(trainer.published(), version=0, weights_hash=trainer.weights_hash)
    verdicts, _ = checks(trainer, cheat, 2)
    assert cheat.cheated == 32 and verdicts == [None] * 32  # true log-probs: all pass
    from aurora.runtime.compute import Sampling

    sampling = Sampling(n=4, max_new_tokens=trainer.max_new_tokens, temperature=1.0, seed=0)
    for g in cheat.generate([("b9-0", 900)], sampling):
        decode_result_payload(
            g.payload,
            prompt="b9-0",
            index=900,
            group_size=4,
            max_new_tokens=trainer.max_new_tokens,
            vocab_size=trainer.vocab_size,
        )


def test_greedy_tokens_fail_the_rank_test_within_the_stated_tokens(rl):
    # Greedy moves u by ~0.11 a token on this model (docs/journal/verification-sampling.md):
    # detection_tokens(0.11) = 230; 4 batches hold ~900 tokens.
    from aurora.runtime.cheats import CheatingEngine

    spec, trainer, engine = rl
    cheat = CheatingEngine(engine, "greedy", spec)
    cheat.load(trainer.published(), version=0, weights_hash=trainer.weights_hash)
    _, stats = checks(trainer, cheat, 4)
    assert judge_ranks(stats, SamplingRule()) is Skew.LIKELY, (stats.z, stats.tokens)


def test_a_cheat_mode_bestof_needs_an_integer_of_at_least_two():
    from aurora.runtime.cheats import parse

    assert parse("bestof:8") == ("bestof", 8.0) and parse("greedy") == ("greedy", 1.0)
    for bad in ("bestof", "bestof:1", "bestof:x", "bestof:2.5", "greedy:2"):
        with pytest.raises(ValueError, match="cheat"):
            parse(bad)
