"""GRPO numerics against hand computations, the Trainer -> engine bit-exact path through real
deltas, log-prob agreement, restart reproducibility and refused input."""

import copy
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from aurora.delta import read_delta  # noqa: E402
from aurora.engines import Sampling, TransformersEngine  # noqa: E402
from aurora.models import TinyQwen3Config, build_default, load_state  # noqa: E402
from aurora.rl.tasks import ArithmeticTask, RewardError  # noqa: E402
from aurora.rl.trainer import (  # noqa: E402
    Group,
    GRPOConfig,
    Trainer,
    TrainerError,
    clipped_objective,
    group_advantages,
)

TASK = ArithmeticTask()
SAMPLING = Sampling(max_new_tokens=TASK.max_new_tokens, temperature=1.0, seed=0)


def has_seven(prompt, completion):
    """A reward a random model earns about half the time, so groups carry signal."""
    return 1.0 if "7" in completion else 0.0


def make(lr=1e-3, reward=has_seven, seed=0, **kw):
    model, tok = build_default()
    trainer = Trainer(copy.deepcopy(model), tok, reward, GRPOConfig(lr=lr), **kw)
    engine = TransformersEngine(
        copy.deepcopy(model), tok, weights_hash=trainer.weights_hash, seed=seed
    )
    load_state(engine.model, trainer.published)
    engine._refresh_compute()
    return trainer, engine


def rollout(engine, first, count=8, n=8, seed=0):
    prompts = TASK.prompts(first, count)
    s = Sampling(max_new_tokens=TASK.max_new_tokens, temperature=1.0, seed=seed)
    return [
        Group(prompt=p, completions=g, version=engine.version)
        for p, g in zip(prompts, engine.generate(prompts, n, s), strict=True)
    ]


def params_of(trainer):
    return {k: v.detach().clone() for k, v in trainer.params.items()}


# ------------------------------------------------------------------------------------------
# The objective, by hand
# ------------------------------------------------------------------------------------------


def test_group_advantages_match_a_hand_computation():
    # mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735
    got = group_advantages([1, 0, 0, 1], eps=0)
    assert np.allclose(got, [0.866025, -0.866025, -0.866025, 0.866025], atol=1e-6)
    got = group_advantages([3.0, 1.0, 2.0], eps=0)  # mean 2, std 1
    assert np.allclose(got, [1.0, -1.0, 0.0])
    assert group_advantages([1, 1, 1]) == [0.0, 0.0, 0.0]
    assert group_advantages([5.0]) == [0.0]
    assert group_advantages([1, 0], scale_by_std=False) == [0.5, -0.5]


def test_the_clipped_objective_matches_a_hand_computation():
    ratios = torch.tensor([[1.5, 0.5, 1.0, 1.1], [1.5, 0.5, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]])
    adv = torch.tensor([1.0, -1.0])
    obj, ratio, bound = clipped_objective(
        ratios.log(), torch.zeros(2, 4), adv, mask, clip_lo=0.2, clip_hi=0.2
    )
    # A=+1: min(1.5,1.2)=1.2, min(0.5,0.8)=0.5, 1.0, 1.1 -> 3.8
    # A=-1: min(-1.5,-1.2)=-1.5, min(-0.5,-0.8)=-0.8 -> -2.3 ; mean over 6 tokens
    assert math.isclose(float(obj), (3.8 - 2.3) / 6, rel_tol=1e-6)
    assert torch.allclose(ratio, ratios)
    assert bound.tolist() == [[True, False, False, False], [False, True, False, False]]
    obj_hi, _, _ = clipped_objective(
        ratios.log(), torch.zeros(2, 4), adv, mask, clip_lo=0.2, clip_hi=0.28
    )
    assert math.isclose(float(obj_hi), (3.88 - 2.3) / 6, rel_tol=1e-6)  # clip-higher: 1.28


def test_an_on_policy_step_has_ratio_one_and_the_hand_computed_loss():
    trainer, engine = make()
    groups = rollout(engine, 0)
    # behaviour = the master's own log-probs: every ratio is exactly 1
    own = trainer.recompute_logprobs(groups)
    groups = [
        Group(
            prompt=g.prompt,
            version=g.version,
            completions=[
                type(c)(c.prompt_index, c.token_ids, tuple(lp), c.text, c.finish_reason)
                for c, lp in zip(g.completions, own_g, strict=True)
            ],
        )
        for g, own_g in zip(groups, own, strict=True)
    ]
    num = den = 0.0
    for g in groups:
        adv = group_advantages([has_seven(g.prompt, c.text) for c in g.completions])
        for c, a in zip(g.completions, adv, strict=True):
            num += a * len(c.token_ids)
            den += len(c.token_ids)
    stats = trainer.step(groups)
    assert math.isclose(stats.loss, -num / den, abs_tol=1e-6)
    assert stats.clip_frac == 0.0 and stats.logp_diff_max == 0.0
    assert stats.tokens == den and not stats.skipped


def test_a_step_raises_the_log_probs_of_rewarded_completions_and_lowers_the_others():
    trainer, engine = make(lr=1e-3)
    groups = rollout(engine, 0)
    before = trainer.recompute_logprobs(groups)
    trainer.step(groups)
    after = trainer.recompute_logprobs(groups)
    up = down = 0.0
    for g, b, a in zip(groups, before, after, strict=True):
        adv = group_advantages([has_seven(g.prompt, c.text) for c in g.completions])
        for x, lb, la in zip(adv, b, a, strict=True):
            change = sum(la) - sum(lb)
            up += change if x > 0 else 0.0
            down += change if x < 0 else 0.0
    assert up > 0 > down


def test_a_step_with_all_equal_rewards_leaves_the_policy_unchanged():
    trainer, engine = make(lr=1e-3)
    trainer.step(rollout(engine, 0))  # Adam now has momentum
    trainer.publish()
    before = params_of(trainer)
    trainer.reward = lambda prompt, completion: 1.0
    stats = trainer.step(rollout(engine, 8))
    assert stats.skipped and stats.zero_adv_groups == stats.groups
    after = params_of(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert trainer.publish().changed == 0


# ------------------------------------------------------------------------------------------
# Trainer -> engine through real deltas
# ------------------------------------------------------------------------------------------


def test_the_actors_log_probs_equal_the_trainers_recomputation_with_the_same_weights():
    """fp32 compute on the same bf16 weights (the engine's default on this CPU): the incremental
    (KV cache) and full-sequence kernels agree to 2e-4 in log-prob."""
    trainer, engine = make()
    groups = rollout(engine, 0, count=16)
    again = trainer.recompute_logprobs(groups, state=trainer.published)
    worst = max(
        abs(x - y)
        for g, r in zip(groups, again, strict=True)
        for c, lp in zip(g.completions, r, strict=True)
        for x, y in zip(c.logprobs, lp, strict=True)
    )
    assert worst <= 2e-4


def test_a_bf16_compute_engine_agrees_with_the_trainer_within_the_bf16_tolerance():
    """bf16 compute (the GPU default) rounds activations to 8 bits of mantissa: the stated
    tolerance is 0.15 nats per token (docs/journal/early-measurements.md: a worst of
    0.04-0.12)."""
    trainer, _ = make()
    model, tok = build_default()
    engine = TransformersEngine(model, tok, compute_dtype=torch.bfloat16)
    load_state(engine.model, trainer.published)
    groups = rollout(engine, 0, count=4, n=4)
    again = trainer.recompute_logprobs(groups, state=trainer.published)
    worst = max(
        abs(x - y)
        for g, r in zip(groups, again, strict=True)
        for c, lp in zip(g.completions, r, strict=True)
        for x, y in zip(c.logprobs, lp, strict=True)
    )
    assert worst <= 0.15


@pytest.mark.parametrize("fuse", [True, False])
def test_after_several_steps_the_engine_holds_the_trainers_published_bits(fuse):
    trainer, engine = make(lr=1e-3, fuse=fuse)
    for step in range(3):
        trainer.step(rollout(engine, 8 * step, seed=step))
        pub = trainer.publish()
        assert pub.changed > 0
        delta = read_delta(pub.data, expected_hash=pub.weights_hash)
        names = [t.name for t in delta.tensors]
        assert any("qkv_proj" in n for n in names) == fuse
        assert any("gate_up_proj" in n for n in names) == fuse
        assert engine.apply(delta) == trainer.weights_hash
        assert engine.version == trainer.version == step + 1
        assert engine.weights_digest() == trainer.published_digest()
    reference, _ = build_default(dtype=torch.bfloat16)
    load_state(reference, trainer.published)
    x = torch.tensor([engine.tokenizer("123+456=579").input_ids])
    with torch.no_grad():
        assert torch.equal(engine.model(input_ids=x).logits, reference(input_ids=x).logits)


def test_segments_are_handed_out_as_they_are_cut_and_a_failed_hand_out_commits_nothing():
    trainer, engine = make(lr=1e-3, segment_size=4096)
    trainer.step(rollout(engine, 0))
    seen = []

    def broken(seg):
        seen.append(seg)
        if len(seen) == 3:
            raise ConnectionError("peer went away")

    with pytest.raises(ConnectionError):
        trainer.publish(on_segment=broken)
    assert trainer.version == 0
    got = []
    pub = trainer.publish(on_segment=got.append)
    assert [s.data for s in got[:3]] == [s.data for s in seen]
    assert got[-1].trailer and len(got) == len(pub.segments) > 3
    assert b"".join(bytes(s.data) for s in got) == pub.data


# ------------------------------------------------------------------------------------------
# Restart
# ------------------------------------------------------------------------------------------


def test_a_restarted_trainer_produces_the_same_next_delta_bytes(tmp_path):
    trainer, engine = make(lr=1e-3)
    batches, pubs = [], []
    for step in range(3):
        groups = rollout(engine, 8 * step, seed=step)
        batches.append(groups)
        if step == 2:
            trainer.save_checkpoint(tmp_path / "trainer.pt")  # at v2, Adam state of 2 steps
        trainer.step(groups)
        pubs.append(trainer.publish())
        engine.apply(read_delta(pubs[-1].data))
    model, tok = build_default(TinyQwen3Config(init_seed=9))  # other weights: all restored
    restarted = Trainer(model, tok, has_seven, GRPOConfig(lr=1e-3))
    restarted.load_checkpoint(tmp_path / "trainer.pt")
    assert (restarted.version, restarted.weights_hash) == (2, pubs[1].weights_hash)
    restarted.step(batches[2])
    assert restarted.publish().data == pubs[2].data
    assert all(torch.equal(trainer.params[k], restarted.params[k]) for k in trainer.params)


def test_a_checkpoint_of_another_configuration_or_path_is_refused_by_name(tmp_path):
    trainer, _ = make(lr=1e-3)
    trainer.save_checkpoint(tmp_path / "t.pt")
    other, _ = make(lr=2e-3)
    with pytest.raises(TrainerError, match="grpo"):
        other.load_checkpoint(tmp_path / "t.pt")
    with pytest.raises(TrainerError, match="does not exist"):
        other.load_checkpoint(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(TrainerError, match="cannot be read"):
        other.load_checkpoint(tmp_path / "junk.pt")


# ------------------------------------------------------------------------------------------
# Refused input
# ------------------------------------------------------------------------------------------


def test_a_reward_function_that_raises_is_named_and_the_policy_is_untouched():
    def broken_reward(prompt, completion):
        raise KeyError("no answer key")

    trainer, engine = make(reward=broken_reward)
    before = params_of(trainer)
    with pytest.raises(RewardError, match="broken_reward raised KeyError"):
        trainer.step(rollout(engine, 0))
    assert all(torch.equal(before[k], v) for k, v in params_of(trainer).items())


def test_groups_outside_the_lag_bound_or_malformed_are_refused():
    trainer, engine = make()
    groups = rollout(engine, 0, count=2)
    future = [Group(prompt=g.prompt, completions=g.completions, version=1) for g in groups]
    with pytest.raises(TrainerError, match="generated on v1; the Trainer is at v0"):
        trainer.step(future)
    for _ in range(2):
        trainer.publish()
    with pytest.raises(TrainerError, match="accepts v1..v2"):
        trainer.step(groups)  # generated on v0, two versions behind
    with pytest.raises(TrainerError, match="no completions"):
        trainer.step([Group(prompt="1+1=", completions=[], version=2)])
    with pytest.raises(TrainerError, match="at least one group"):
        trainer.step([])


def test_bad_grpo_settings_name_the_field():
    for field, value in [("lr", -1.0), ("clip_eps", 1.5), ("temperature", 0.0), ("max_lag", -1)]:
        with pytest.raises(ValueError, match=f"GRPOConfig.{field}"):
            GRPOConfig(**({"lr": 1e-3} | {field: value}))


def test_the_trainer_and_the_engine_end_a_completion_at_the_same_ids_and_the_rule_agrees():
    # A model whose generation config names a second end id (as Qwen3's names <|im_end|> and
    # <|endoftext|>): the engine stops at either, so the Trainer's reward reads up to either and
    # the payload rule accepts a completion that ends at either (before: the tokenizer's alone,
    # so an honest completion ending at the other was refused, a strike against its Actor).
    from aurora.policy.refusals import completion_fault

    model, tok = build_default()
    model.generation_config.eos_token_id = [tok.eos_token_id, 5]
    trainer = Trainer(copy.deepcopy(model), tok, has_seven, GRPOConfig(lr=1e-3))
    engine = TransformersEngine(copy.deepcopy(model), tok)
    assert trainer.eos_ids == engine.eos_ids == {tok.eos_token_id, 5}
    assert trainer.completion_text([7, 8, 5, 9]) == tok.decode([7, 8])
    assert trainer.completion_text([7, 8, tok.eos_token_id]) == tok.decode([7, 8])
    ends = tuple(sorted(trainer.eos_ids))
    assert completion_fault([7, 5], [-1.0] * 2, eos_ids=ends, max_new_tokens=9, floor=None) is None
    assert "after end-of-sequence" in completion_fault(
        [7, 5, 9], [-1.0] * 3, eos_ids=ends, max_new_tokens=9, floor=None
    )
