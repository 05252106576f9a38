"""The engine protocol and the transformers engine: sampling, log-probs, in-place deltas, hashes."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from aurora.delta import chain_hash, encode_delta, read_delta, weights_hash  # noqa: E402
from aurora.delta.errors import BaseMismatchError  # noqa: E402
from aurora.delta.hf import bf16_views  # noqa: E402
from aurora.engines import Engine, Sampling, TransformersEngine, weights_digest_of  # noqa: E402
from aurora.engines.base import canonical_state  # noqa: E402
from aurora.engines.transformers import EngineError  # noqa: E402
from aurora.models import build_default, save_pretrained  # noqa: E402

PROMPTS = ["1+2=", "123+456=", "45+6="]


@pytest.fixture(scope="module")
def base():
    return build_default(dtype=torch.bfloat16)


@pytest.fixture
def engine(base):
    model, tok = base
    return TransformersEngine(copy.deepcopy(model), tok)


def test_the_transformers_engine_implements_the_protocol(engine):
    assert isinstance(engine, Engine)


def test_generate_returns_n_completions_per_prompt_with_a_log_prob_per_token(engine):
    out = engine.generate(PROMPTS, 4, Sampling(max_new_tokens=5, seed=1))
    assert [len(g) for g in out] == [4, 4, 4]
    for i, group in enumerate(out):
        for c in group:
            assert c.prompt_index == i
            assert 1 <= c.num_tokens <= 5 and len(c.logprobs) == c.num_tokens
            assert all(lp <= 0 for lp in c.logprobs)
            ends = c.token_ids[-1] == engine.tokenizer.eos_token_id
            assert c.finish_reason == ("stop" if ends else "length")
            assert engine.tokenizer.eos_token_id not in c.token_ids[:-1]
            assert c.text == engine.decode(c.token_ids)


def test_a_seeded_call_is_reproducible_and_seeds_differ(engine):
    a = engine.generate(PROMPTS, 8, Sampling(max_new_tokens=5, seed=3))
    b = engine.generate(PROMPTS, 8, Sampling(max_new_tokens=5, seed=3))
    c = engine.generate(PROMPTS, 8, Sampling(max_new_tokens=5, seed=4))
    assert a == b
    assert [x.token_ids for g in a for x in g] != [x.token_ids for g in c for x in g]


def test_log_probs_are_those_of_the_distribution_at_the_temperature_used(engine):
    """Each recorded log-prob equals log_softmax(logits / T) of a full forward pass (fp32
    compute on the bf16 weights, the engine's default on this CPU)."""
    for temperature in (1.0, 0.5):
        out = engine.generate(PROMPTS, 2, Sampling(max_new_tokens=5, temperature=temperature))
        for p, group in zip(PROMPTS, out, strict=True):
            prompt = engine.tokenizer(p).input_ids
            for c in group:
                ids = torch.tensor([prompt + list(c.token_ids)])
                with torch.no_grad():
                    logits = engine._compute(input_ids=ids).logits[0, len(prompt) - 1 : -1]
                lp = torch.log_softmax(logits.float() / temperature, -1)
                want = lp.gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
                assert np.allclose(c.logprobs, want.numpy(), atol=2e-4, rtol=0)


def test_greedy_takes_the_argmax_and_padding_does_not_change_a_prompts_completion(engine):
    greedy = Sampling(max_new_tokens=5, temperature=0.0)
    together = engine.generate(PROMPTS, 1, greedy)
    for i, p in enumerate(PROMPTS):
        alone = engine.generate([p], 1, greedy)[0][0]
        assert alone.token_ids == together[i][0].token_ids
        assert np.allclose(alone.logprobs, together[i][0].logprobs, atol=2e-4)


def test_prompts_may_be_token_ids(engine):
    ids = [engine.tokenizer(p).input_ids for p in PROMPTS]
    s = Sampling(max_new_tokens=5, seed=9)
    assert engine.generate(ids, 2, s) == engine.generate(PROMPTS, 2, s)


def test_a_prompt_longer_than_the_model_allows_is_refused_by_name(engine):
    with pytest.raises(EngineError, match="max_position_embeddings 64"):
        engine.generate(["1+" * 30 + "1="], 1, Sampling(max_new_tokens=5))
    with pytest.raises(EngineError, match="cannot be tokenized"):
        engine.generate(["12/3="], 1, Sampling(max_new_tokens=5))


def test_sampling_settings_are_checked():
    with pytest.raises(ValueError, match="max_new_tokens"):
        Sampling(max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        Sampling(max_new_tokens=1, temperature=-1)


# ------------------------------------------------------------------------------------------
# Weights: load, apply, hashes
# ------------------------------------------------------------------------------------------


def perturbed(state, seed, fraction=0.1):
    rng = np.random.default_rng(seed)
    out = {}
    for k, v in state.items():
        bits = v.copy().reshape(-1)
        idx = rng.random(bits.size) < fraction
        bits[idx] ^= 1  # flip the lowest mantissa bit: a one-ulp change
        out[k] = bits.reshape(v.shape)
    return out


def test_the_initial_hash_is_the_snapshot_hash_and_the_digest_uses_the_fused_layout(engine):
    state = engine.state()
    assert engine.weights_hash == weights_hash(state)
    fused = canonical_state(state)
    assert "model.layers.0.self_attn.qkv_proj.weight" in fused
    assert fused["model.layers.0.self_attn.qkv_proj.weight"].shape == (128 + 64 + 64, 128)
    assert engine.weights_digest() == weights_hash(fused) == weights_digest_of(state)


@pytest.mark.parametrize("fuse", [True, False])
def test_apply_moves_weights_version_and_hash_chain_in_place(engine, fuse):
    v0 = engine.state()
    h0 = engine.weights_hash
    storage = engine.model.model.layers[0].self_attn.q_proj.weight.data_ptr()
    v1 = perturbed(v0, 1)
    d = read_delta(encode_delta(v0, v1, model="m", version=1, base_hash=h0, fuse=fuse))
    assert engine.apply(d) == chain_hash(h0, d.id) == engine.weights_hash
    assert engine.version == 1
    assert engine.model.model.layers[0].self_attn.q_proj.weight.data_ptr() == storage
    assert engine.weights_digest() == weights_digest_of(v1)
    # the compute copy follows: greedy output equals a fresh engine loaded with v1
    fresh = TransformersEngine(copy.deepcopy(engine.model), engine.tokenizer)
    fresh.load(v1, version=1, weights_hash="ab" * 32)
    greedy = Sampling(max_new_tokens=5, temperature=0.0)
    assert engine.generate(PROMPTS, 1, greedy) == fresh.generate(PROMPTS, 1, greedy)


def test_a_delta_on_another_base_is_refused_and_the_weights_stay(engine):
    v0 = engine.state()
    d2 = read_delta(
        encode_delta(v0, perturbed(v0, 2), model="m", version=2, base_hash=engine.weights_hash)
    )
    digest = engine.weights_digest()
    with pytest.raises(BaseMismatchError, match="based on v1"):
        engine.apply(d2)
    wrong = read_delta(
        encode_delta(v0, perturbed(v0, 2), model="m", version=1, base_hash="cd" * 32)
    )
    with pytest.raises(BaseMismatchError, match="h="):
        engine.apply(wrong)
    assert engine.weights_digest() == digest and engine.version == 0


def test_load_replaces_every_weight_and_refuses_a_foreign_snapshot(engine):
    v1 = perturbed(engine.state(), 5)
    engine.load(v1, version=7, weights_hash="ef" * 32)
    assert (engine.version, engine.weights_hash) == (7, "ef" * 32)
    assert engine.weights_digest() == weights_digest_of(v1)
    with pytest.raises(EngineError, match="snapshot names differ"):
        engine.load({"x": np.zeros(2, np.uint16)}, version=8, weights_hash="00" * 32)


def test_an_engine_loads_a_saved_directory(base, tmp_path):
    model, tok = base
    save_pretrained(model, tok, tmp_path / "m")
    eng = TransformersEngine.from_pretrained(str(tmp_path / "m"))
    assert eng.weights_hash == weights_hash(bf16_views(model))
