"""Engine and Trainer overhead, as ratios against bare torch/transformers in the same run.

    python -m pytest benchmarks/test_rl_speed.py --benchmark-enable -s

* Engine: completion tokens/s of ``TransformersEngine.generate`` (B prompts x G samples of the
  default model, temperature 1, per-token log-probs recorded) against ``model.generate`` of the
  same fp32 compute model on the same left-padded batch (no log-probs), same sampling.
* Trainer: ``Trainer.step`` (rewards, batching, GRPO loss, AdamW step) against a bare
  fp32 forward + backward + AdamW step of the same model on the same token batch.
* Publish: ``Trainer.publish`` (bf16 rounding, extraction, encoding, segments) against the
  bare step.

The two sides of each ratio are timed in alternating rounds and the minimum of each is kept, so
a machine shared with other work (as this one is) shifts both alike.
"""

from __future__ import annotations

import copy
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from aurora.engines import Sampling, TransformersEngine  # noqa: E402
from aurora.models import build_default  # noqa: E402
from aurora.rl.tasks import ArithmeticTask  # noqa: E402
from aurora.rl.trainer import Group, GRPOConfig, Trainer  # noqa: E402

B, G, ROUNDS = 32, 8, 7
TASK = ArithmeticTask()


def interleaved(ref, subj, rounds=ROUNDS):
    """(min seconds of ref, min seconds of subj) over alternating rounds."""
    tr, ts = [], []
    ref()
    subj()  # warm-up: lazy inits, allocator
    for _ in range(rounds):
        t0 = time.perf_counter()
        ref()
        tr.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        subj()
        ts.append(time.perf_counter() - t0)
    return min(tr), min(ts)


@pytest.fixture(scope="module")
def setup():
    model, tok = build_default()
    engine = TransformersEngine(copy.deepcopy(model), tok, seed=0)
    trainer = Trainer(model, tok, TASK.reward, GRPOConfig(lr=1e-4))
    return engine, trainer, tok


def test_engine_tokens_per_s_against_bare_generate(benchmark, setup):
    engine, _, tok = setup
    prompts = TASK.prompts(0, B)
    sampling = Sampling(max_new_tokens=TASK.max_new_tokens, temperature=1.0, seed=0)
    batch = tok(prompts, padding=True, return_tensors="pt")
    batch = {k: v.repeat_interleave(G, 0) for k, v in batch.items()}
    tokens = {}

    def ours():
        out = engine.generate(prompts, G, sampling)
        tokens["ours"] = sum(c.num_tokens for g in out for c in g)

    def bare():
        out = engine._compute.generate(
            **batch,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=TASK.max_new_tokens,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        # completion tokens up to and including the first <eos>, as the engine counts them
        new = out[:, batch["input_ids"].shape[1] :]
        done = (new == tok.eos_token_id).cumsum(1)
        tokens["bare"] = int(((done == 0) | ((done == 1) & (new == tok.eos_token_id))).sum())

    t_bare, t_ours = interleaved(bare, ours)
    benchmark.pedantic(ours, rounds=3)
    ours_tps, bare_tps = tokens["ours"] / t_ours, tokens["bare"] / t_bare
    benchmark.extra_info.update(
        {"engine tok/s": ours_tps, "bare tok/s": bare_tps, "time ratio": t_ours / t_bare}
    )
    print(
        f"\nengine: {ours_tps:,.0f} completion tok/s ({t_ours * 1e3:.1f} ms for {B}x{G}); "
        f"bare model.generate: {bare_tps:,.0f} tok/s ({t_bare * 1e3:.1f} ms); "
        f"engine time / bare time = {t_ours / t_bare:.2f}"
    )


def test_trainer_step_against_a_bare_forward_backward_step(benchmark, setup):
    engine, trainer, tok = setup
    prompts = TASK.prompts(0, B)
    out = engine.generate(prompts, G, Sampling(max_new_tokens=TASK.max_new_tokens, seed=1))
    groups = [Group(prompt=p, completions=g, version=0) for p, g in zip(prompts, out, strict=True)]
    batch = trainer._batch(groups, [[0.0] * G for _ in groups])
    bare_model = copy.deepcopy(trainer.model)
    opt = torch.optim.AdamW(bare_model.parameters(), lr=1e-4, betas=(0.9, 0.99))

    def bare():
        logits = bare_model(input_ids=batch["ids"], attention_mask=batch["attn"]).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1)
        tok_lp = logp.gather(-1, batch["ids"][:, 1:, None]).squeeze(-1)
        loss = -(tok_lp * batch["mask"]).sum() / batch["mask"].sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    # every step must do the full work: rewards that always differ within a group
    trainer.reward = lambda prompt, completion: float(len(completion))
    t_bare, t_step = interleaved(bare, lambda: trainer.step(groups))
    benchmark.pedantic(lambda: trainer.step(groups), rounds=3)
    t_pub = min(_timed(trainer.publish) for _ in range(ROUNDS))  # last: it moves the version
    benchmark.extra_info.update(
        {"step ratio": t_step / t_bare, "publish / bare step": t_pub / t_bare}
    )
    print(
        f"\nTrainer.step: {t_step * 1e3:.1f} ms, bare fwd+bwd+AdamW: {t_bare * 1e3:.1f} ms "
        f"({B * G} sequences): ratio {t_step / t_bare:.2f}; publish {t_pub * 1e3:.1f} ms "
        f"= {t_pub / t_bare:.2f} x the bare step"
    )


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
