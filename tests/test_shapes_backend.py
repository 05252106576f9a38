"""The shapes backend: a published Qwen3's exact tensors, synthetic AdamW-like steps in the
transfer regime, real deltas applied bit-exactly by the stand-in engine's side."""

import numpy as np
import pytest

from aurora.delta import read_delta, synthetic
from aurora.runtime import shapes
from aurora.runtime.cli import backend_for
from aurora.runtime.compute import make_engine, make_trainer
from aurora.topology import load_topology
from tests.test_ledger_service import job_spec

TINY = {**shapes.MODELS["qwen3-0.6b-shapes"], "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    monkeypatch.setitem(shapes.MODELS, "qwen3-test-shapes", TINY)
    shapes.model_shapes.cache_clear()
    yield job_spec(tmp_path, backend="shapes", model="qwen3-test-shapes", seed=3)
    shapes.model_shapes.cache_clear()


@pytest.mark.parametrize(
    ("model", "params", "down"),
    [
        ("qwen3-0.6b-shapes", 596_049_920, (1024, 3072)),
        ("qwen3-1.7b-shapes", 1_720_574_976, (2048, 6144)),
    ],
)
def test_the_shapes_models_have_the_published_checkpoints_tensors(model, params, down):
    s = shapes.model_shapes(model)
    assert sum(int(np.prod(v)) for v in s.values()) == params  # 0.6B / 1.7B as published
    assert len(s) == 310 and "lm_head.weight" not in s  # tied embedding, as in safetensors
    assert s["model.layers.27.mlp.down_proj.weight"] == down
    assert s["model.embed_tokens.weight"] == (151936, down[0])
    assert s["model.layers.0.self_attn.k_proj.weight"] == (8 * 128, down[0])


def test_a_step_changes_the_target_density_and_an_engine_applies_it_bit_exactly(tiny):
    trainer = make_trainer(tiny, workdir=".")
    engine = make_engine(tiny)
    engine.load(trainer.published(), version=0, weights_hash=trainer.weights_hash)
    stats = trainer.train([])
    assert stats["backend"] == "shapes" and "synthetic" in stats["update"]
    pub = trainer.publish(lambda seg: None)
    assert 0.015 < pub.changed / pub.total < 0.025  # the transfer regime's 1-3%
    engine.apply(read_delta(pub.data))
    assert engine.weights_hash == pub.weights_hash
    assert engine.digest() == trainer.digest()


def test_a_restored_trainer_replays_its_steps_to_the_same_weights_and_next_delta(tiny, tmp_path):
    a = make_trainer(tiny, workdir=".")
    for _ in range(2):
        a.train([])
        a.publish(lambda seg: None)
    a.save(str(tmp_path / "ckpt"))
    b = make_trainer(tiny, workdir=".")
    b.load(str(tmp_path / "ckpt"))
    assert (b.version, b.weights_hash, b.digest()) == (a.version, a.weights_hash, a.digest())
    a.train([])
    b.train([])
    assert a.publish(lambda seg: None).data == b.publish(lambda seg: None).data


def test_a_shapes_model_in_the_topology_runs_the_shapes_backend(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(
        "name: t\ntrainer: {region: us, model: qwen3-8b, gpu: H100, gpus: 1}\n"
        "regions: [{name: us}, {name: ca}]\nlinks: [{a: us, b: ca, gbps: 1.0, rtt_ms: 40}]\n"
        "actors: [{region: ca, gpu: A100, count: 2}]\nreal: {model: qwen3-0.6b-shapes}\n"
    )
    assert backend_for(load_topology(path), "rl") == "shapes"
    path.write_text(path.read_text().replace("qwen3-0.6b-shapes", "tiny"))
    assert backend_for(load_topology(path), "rl") == "rl"


def test_torchs_bf16_conversion_gives_the_bits_of_the_synthetic_rounding():
    r = np.random.default_rng(0)
    x = (r.standard_normal(100_000) * 0.02).astype(np.float32)
    ties = (r.integers(0, 2**16, 1000, dtype=np.uint32) << 16) | 0x8000  # exactly half an ulp
    x = np.concatenate([x, ties.view(np.float32)[np.isfinite(ties.view(np.float32))]])
    assert np.array_equal(shapes.bf16_bits(x), synthetic.to_bf16_bits(x))
