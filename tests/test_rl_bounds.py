"""The Trainer bounds what any one result can do: the dual-clip cap on the importance ratio, the
step guard (finite, no outlier, the culprit groups left out) and no publish of non-finite
weights. Each attack is measured against the objective without the bounds (``ratio_cap=None``,
``guard=None``: the PPO clip alone), so these tests fail without the mechanism."""

import copy
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from aurora.engines import Sampling, TransformersEngine  # noqa: E402
from aurora.models import build_default, load_state  # noqa: E402
from aurora.rl.guard import GuardConfig, StepGuard  # noqa: E402
from aurora.rl.tasks import ArithmeticTask  # noqa: E402
from aurora.rl.trainer import (  # noqa: E402
    Group,
    GRPOConfig,
    Trainer,
    TrainerError,
    clipped_objective,
    group_advantages,
)

TASK = ArithmeticTask()
UNBOUNDED = {"ratio_cap": None, "guard": None}
"""The objective without the bounds (the PPO clip alone, no outlier rule); the guard still
refuses a non-finite step."""


def has_seven(prompt, completion):
    return 1.0 if "7" in completion else 0.0


def make(lr=1e-3, **config):
    model, tok = build_default()
    trainer = Trainer(copy.deepcopy(model), tok, has_seven, GRPOConfig(lr=lr, **config))
    engine = TransformersEngine(copy.deepcopy(model), tok, weights_hash=trainer.weights_hash)
    load_state(engine.model, trainer.published)
    engine._refresh_compute()
    return trainer, engine


def rollout(engine, first=0, count=8, n=8, seed=0):
    prompts = TASK.prompts(first, count)
    s = Sampling(max_new_tokens=TASK.max_new_tokens, temperature=1.0, seed=seed)
    return [
        Group(prompt=p, completions=list(g), version=engine.version)
        for p, g in zip(prompts, engine.generate(prompts, n, s), strict=True)
    ]


def forged(groups, value, group=0, completion=0):
    """``groups`` with every behaviour log-prob of one completion set to ``value``."""
    out = [
        Group(prompt=g.prompt, completions=list(g.completions), version=g.version) for g in groups
    ]
    c = out[group].completions[completion]
    out[group].completions[completion] = type(c)(
        c.prompt_index, c.token_ids, tuple([value] * len(c.token_ids)), c.text, c.finish_reason
    )
    return out


def gradient(trainer, groups, rows=None):
    """The flattened gradient of the step's loss over ``rows`` of ``groups`` (all: the step's)."""
    advs = [group_advantages(trainer.rewards(g)) for g in groups]
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer._accumulate(
        groups, advs, list(rows if rows is not None else range(len(groups))), grad=True
    )
    g = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    trainer.optimizer.zero_grad(set_to_none=True)
    return g.double()


def cos(a, b):
    return float(torch.dot(a, b) / (a.norm() * b.norm()))


def finite(trainer):
    return all(bool(torch.isfinite(p).all()) for p in trainer.params.values())


def signal_group(trainer, groups):
    """Index of a group with mixed rewards (its completions' advantages are not all 0)."""
    return next(i for i, g in enumerate(groups) if len(set(trainer.rewards(g))) > 1)


# ---- the objective ------------------------------------------------------------------------


def test_the_dual_clip_caps_the_ratio_of_a_negative_advantage_with_no_gradient_beyond_it():
    logp = torch.tensor([[-1.0, -1.0, -1.0, -1.0]], requires_grad=True)
    # ratios e^0 = 1, e^0.5, e^59 (a forged -60), inf (a forged -inf)
    behaviour = torch.tensor([[-1.0, -1.5, -60.0, -math.inf]])
    mask, adv = torch.ones(1, 4), torch.tensor([-1.0])
    obj, ratio, _ = clipped_objective(
        logp, behaviour, adv, mask, clip_lo=0.2, clip_hi=0.2, ratio_cap=3.0
    )
    # A = -1: min(-r, -clip(r)) = -max(r, clip(r)): -1, -e^0.5, then the cap: -3, -3
    assert math.isclose(float(obj.detach()), (-1 - math.exp(0.5) - 3 - 3) / 4, rel_tol=1e-6)
    assert ratio[0, 2:].tolist() == pytest.approx([3.0, 3.0])
    obj.backward()
    assert logp.grad[0, 2:].tolist() == [0.0, 0.0]  # beyond the cap: nothing
    assert math.isclose(float(logp.grad[0, 1]), -math.exp(0.5) / 4, rel_tol=1e-6)
    # Without the cap the same tokens make the objective -inf and its gradient unbounded.
    logp.grad = None
    obj, _, _ = clipped_objective(logp, behaviour, adv, mask, clip_lo=0.2, clip_hi=0.2)
    obj.backward()
    assert float(obj.detach()) == -math.inf and not torch.isfinite(logp.grad).all()
    assert abs(float(logp.grad[0, 2])) > 1e24


def test_the_cap_leaves_a_positive_advantage_and_ratios_below_it_as_ppo_had_them():
    logp = torch.log(torch.tensor([[0.5, 1.1, 2.0, 5.0], [0.5, 1.1, 2.0, 2.9]]))
    mask, adv = torch.ones(2, 4), torch.tensor([1.0, -1.0])
    capped, _, _ = clipped_objective(
        logp, torch.zeros(2, 4), adv, mask, clip_lo=0.2, clip_hi=0.2, ratio_cap=3.0
    )
    plain, _, _ = clipped_objective(logp, torch.zeros(2, 4), adv, mask, clip_lo=0.2, clip_hi=0.2)
    assert float(capped) == pytest.approx(float(plain))  # nothing of row 2 beyond 3; A>0 clipped


def test_a_cap_at_or_below_the_clip_is_refused():
    with pytest.raises(ValueError, match="ratio_cap"):
        GRPOConfig(lr=1e-3, ratio_cap=1.2)
    with pytest.raises(ValueError, match="ratio_cap"):
        GRPOConfig(lr=1e-3, ratio_cap=math.inf)


# ---- one forged number, the attack --------------------------------------------------


@pytest.mark.parametrize("value", [-25.0, -60.0, -math.inf])
def test_one_forged_behaviour_log_prob_no_longer_steers_the_step_or_breaks_the_model(value):
    """The attack: one completion of one result with its behaviour log-probs forged. Without
    the bounds -25 makes that result the step (cosine ~1 with it alone, the norm x10^8) and
    -60 or -inf make every weight NaN; with them the step is the honest batch's."""
    trainer, engine = make()
    groups = rollout(engine)
    g = signal_group(trainer, groups)
    # the forged completion must have a negative advantage (the PPO clip's open side)
    adv = group_advantages(trainer.rewards(groups[g]))
    c = int(np.argmin(adv))
    attack = forged(groups, value, group=g, completion=c)
    honest = gradient(trainer, groups)
    step = gradient(trainer, attack)
    alone = gradient(trainer, attack, rows=[g])
    assert float(step.norm()) < 2 * float(honest.norm())
    assert cos(step, honest) > 0.95  # the batch's own direction
    assert cos(step, alone) < 0.9
    stats = trainer.step(attack)
    assert not stats.skipped and stats.refused is None and stats.capped_frac > 0
    trainer.publish()
    assert finite(trainer)

    old, _ = make(**UNBOUNDED)
    before = gradient(old, attack)
    if math.isfinite(float(before.norm())):
        assert float(before.norm()) > 1e6 * float(honest.norm())
        assert cos(before, gradient(old, attack, rows=[g])) > 0.999
    else:
        assert torch.isnan(before).any()


@pytest.mark.parametrize("value", [-60.0, -math.inf])
def test_without_the_cap_the_guard_alone_keeps_a_non_finite_step_from_being_taken(value):
    """Without the cap a forged -60 overflows the fp32 gradient norm (-inf: the loss): the
    step the old Trainer took, making every weight NaN. The guard's finiteness check refuses
    it, finds the group and trains on the rest."""
    trainer, engine = make(**UNBOUNDED)
    groups = rollout(engine)
    g = signal_group(trainer, groups)
    c = int(np.argmin(group_advantages(trainer.rewards(groups[g]))))
    stats = trainer.step(forged(groups, value, group=g, completion=c))
    assert stats.refused is not None and stats.dropped == (g,)
    assert any(w in stats.refused for w in ("inf", "nan"))
    assert not stats.skipped and finite(trainer)


def test_non_finite_master_weights_are_never_published():
    trainer, _ = make()
    with torch.no_grad():
        next(iter(trainer.params.values())).fill_(math.nan)  # what the old step made of them
    with pytest.raises(TrainerError, match="non-finite"):
        trainer.publish()
    assert trainer.version == 0


# ---- the step guard -------------------------------------------------------------------------


def test_a_group_that_makes_the_step_non_finite_is_left_out_and_the_rest_trains_as_without_it():
    trainer, engine = make()
    twin, _ = make()
    groups = rollout(engine)
    bad = [Group(prompt=groups[0].prompt, completions=list(groups[0].completions), version=0)]
    c = bad[0].completions[0]
    bad[0].completions[0] = type(c)(
        c.prompt_index, c.token_ids, (math.nan,) * len(c.token_ids), c.text, c.finish_reason
    )
    stats = trainer.step(bad + groups[1:])
    assert stats.dropped == (0,) and "loss is nan" in stats.refused and not stats.skipped
    twin_stats = twin.step(groups[1:])
    assert stats.grad_norm == twin_stats.grad_norm
    assert all(torch.equal(trainer.params[k], twin.params[k]) for k in trainer.params)
    assert finite(trainer)


def test_with_the_cap_off_the_guard_catches_the_forged_result_once_it_knows_the_honest_scale():
    trainer, engine = make(lr=1e-4, ratio_cap=None)
    twin, _ = make(lr=1e-4, ratio_cap=None)
    for step in range(8):  # the guard's warm-up: 8 honest steps
        batch = rollout(engine, first=8 * step, seed=step)
        trainer.step(batch)
        twin.step(batch)
    assert trainer.guard.bound() is not None
    groups = rollout(engine, first=100, seed=100)
    g = signal_group(trainer, groups)
    c = int(np.argmin(group_advantages(trainer.rewards(groups[g]))))
    stats = trainer.step(forged(groups, -25.0, group=g, completion=c))
    assert stats.dropped == (g,) and "outlier" in stats.refused and not stats.skipped
    twin.step([x for i, x in enumerate(groups) if i != g])
    assert all(torch.equal(trainer.params[k], twin.params[k]) for k in trainer.params)


def test_a_step_with_nothing_left_after_the_guard_is_not_taken():
    trainer, engine = make()
    groups = rollout(engine)
    groups = [groups[signal_group(trainer, groups)]]  # one group, with signal
    before = {k: v.detach().clone() for k, v in trainer.params.items()}
    stats = trainer.step(forged(groups, math.nan))
    assert stats.skipped and stats.dropped == (0,)
    assert all(torch.equal(before[k], v) for k, v in trainer.params.items())
    assert trainer.publish().changed == 0


def test_the_guard_bound_is_robust_to_the_window_and_never_below_ten_times_the_median():
    guard = StepGuard(GuardConfig(window=32, warmup=8))
    assert guard.judge(1.0, math.nan) is not None and guard.judge(math.inf, 1.0) is not None
    for x in [1.0, 1.1, 0.9, 1.2, 1.0, 0.8, 1.05]:
        guard.taken(x)
    assert guard.bound() is None and guard.judge(1.0, 1e9) is None  # warming up: finite is all
    guard.taken(1.0)
    assert guard.bound() == pytest.approx(10.0, rel=0.05)  # tight window: the 10x floor
    assert guard.judge(1.0, 9.0) is None and "outlier" in guard.judge(1.0, 11.0)
    wide = StepGuard(GuardConfig(window=32, warmup=8))
    for x in [0.1, 1.0, 10.0, 0.1, 1.0, 10.0, 0.1, 1.0]:
        wide.taken(x)
    assert wide.bound() > 1000  # a spread-out honest scale widens the bound (6 robust sigmas)
    guard.taken(0.0)  # a step without signal is not a sample of the scale
    assert len(guard.norms) == 8
    again = StepGuard(GuardConfig())
    again.load_state(guard.state())
    assert again.bound() == guard.bound()


def test_a_restarted_trainer_keeps_the_guard_window(tmp_path):
    trainer, engine = make(lr=1e-4)
    for step in range(3):
        trainer.step(rollout(engine, first=8 * step, seed=step))
    trainer.save_checkpoint(tmp_path / "t.pt")
    other, _ = make(lr=1e-4)
    other.load_checkpoint(tmp_path / "t.pt")
    assert other.guard.state() == trainer.guard.state() and len(other.guard.norms) == 3


@pytest.mark.parametrize("value", [math.nan, math.inf, 3.4e38])
def test_weights_that_are_not_finite_in_bf16_are_never_published(value):
    trainer, _ = make()
    with torch.no_grad():
        next(iter(trainer.params.values())).view(-1)[0] = value
    with pytest.raises(TrainerError, match="not published"):
        trainer.publish()
    assert trainer.version == 0
