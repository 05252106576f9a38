"""A real AdamW step of a tiny Qwen3 (built from a config, no download) round-trips bit-exactly
through every codec, fused and unfused, applied in place into a transformers model."""

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from aurora.delta import apply as apply_module  # noqa: E402
from aurora.delta import (  # noqa: E402
    apply_delta,
    codecs,  # noqa: E402
    encode_delta,
    read_delta,
    weights_hash,
)
from aurora.delta.errors import DeltaError  # noqa: E402
from aurora.delta.hf import bf16_view, bf16_views, publish_bf16, tiny_qwen3  # noqa: E402
from aurora.delta.torch_apply import apply_delta_torch  # noqa: E402


@pytest.fixture(scope="module")
def real_step():
    """Trainer: fp32 master tiny Qwen3, one AdamW step on a next-token loss; bf16 before/after."""
    master = tiny_qwen3(seed=0, dtype=torch.float32)
    params = dict(master.named_parameters())  # tied lm_head appears once
    before = publish_bf16(params)
    opt = torch.optim.AdamW(master.parameters(), lr=1e-4)
    tokens = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    loss = master(input_ids=tokens, labels=tokens).loss
    loss.backward()
    opt.step()
    after = publish_bf16(params)
    return before, after


def actor_model(before):
    """An Actor's bf16 transformers model holding exactly the Trainer's `before` bits."""
    model = tiny_qwen3(seed=123, dtype=torch.bfloat16)
    views = bf16_views(model)
    assert set(views) == set(before)
    for name, bits in before.items():
        views[name][...] = bits
    return model


def test_the_real_step_changes_some_but_not_all_weights(real_step):
    before, after = real_step
    changed = sum(int((before[k] != after[k]).sum()) for k in before)
    total = sum(v.size for v in before.values())
    assert 0 < changed < total


@pytest.mark.parametrize("codec", sorted(codecs.CODECS))
@pytest.mark.parametrize("fuse", [True, False])
def test_a_real_adamw_step_applies_bit_exactly_into_a_transformers_model(real_step, codec, fuse):
    before, after = real_step
    h0 = weights_hash(before)
    d = read_delta(
        encode_delta(
            before,
            after,
            model="tiny-qwen3",
            version=1,
            base_hash=h0,
            codec=codec,
            fuse=fuse,
            segment_size=4096,
        )
    )
    if fuse:
        assert any(t.name.endswith("qkv_proj.weight") for t in d.tensors)
        assert any(t.name.endswith("gate_up_proj.weight") for t in d.tensors)
    model = actor_model(before)
    views = bf16_views(model)
    apply_delta(d, views, active_version=0, active_hash=h0)
    # the model's own parameters now hold the Trainer's bits
    for name, p in model.state_dict().items():
        if name in after:
            assert np.array_equal(bf16_view(p), after[name]), name
    assert weights_hash(bf16_views(model)) == weights_hash(after)


def test_the_applied_model_generates_like_the_trainers_bf16_weights(real_step):
    before, after = real_step
    h0 = weights_hash(before)
    d = read_delta(encode_delta(before, after, model="tiny-qwen3", version=1, base_hash=h0))
    actor = actor_model(before)
    apply_delta(d, bf16_views(actor), active_version=0, active_hash=h0)
    reference = actor_model(after)
    x = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(actor(input_ids=x).logits, reference(input_ids=x).logits)


# ---- the torch path: index_copy_ into the parameters' own storage --------------------------


@pytest.mark.parametrize("fast", [True, False], ids=["compiled", "numpy"])
@pytest.mark.parametrize("codec", sorted(codecs.CODECS))
@pytest.mark.parametrize("fuse", [True, False])
def test_the_torch_path_applies_a_real_step_into_the_model_parameters_by_index(
    real_step, codec, fuse, fast, monkeypatch
):
    monkeypatch.setattr(apply_module, "COMPILED_MIN_CHANGES", 0 if fast else 2**62)
    before, after = real_step
    h0 = weights_hash(before)
    data = encode_delta(
        before, after, model="tiny-qwen3", version=1, base_hash=h0, codec=codec, fuse=fuse
    )
    model = actor_model(before)
    params = dict(model.named_parameters())
    ptrs = {k: p.data_ptr() for k, p in params.items()}
    apply_delta_torch(read_delta(data), params, active_version=0, active_hash=h0)
    assert {k: p.data_ptr() for k, p in model.named_parameters()} == ptrs  # in place
    assert weights_hash(bf16_views(model)) == weights_hash(after)


@pytest.mark.parametrize("codec", ["aurora", "dense-base"])
def test_a_keyboard_interrupt_between_two_torch_writes_leaves_the_parameters_on_their_version(
    real_step, codec, monkeypatch
):
    """SIGINT (a KeyboardInterrupt between two tensor writes) or a device out of memory half way
    through the torch path: the tensors already written get their old bits back (sparse:
    index_copy_ of the gathered bits; dense: the copy), so the parameters are on v0, not on no
    version; the same delta then applies."""
    from aurora.delta import torch_apply

    before, after = real_step
    h0 = weights_hash(before)
    d = read_delta(encode_delta(before, after, model="tiny-qwen3", version=1, base_hash=h0,
                                codec=codec))  # fmt: skip
    model = actor_model(before)
    params = dict(model.named_parameters())
    real, calls = torch_apply._write, []

    def write(*args):
        real(*args)
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(torch_apply, "_write", write)
    with pytest.raises(KeyboardInterrupt):
        apply_delta_torch(d, params, active_version=0, active_hash=h0)
    assert len(calls) == 3 and weights_hash(bf16_views(model)) == h0
    monkeypatch.undo()
    apply_delta_torch(d, params, active_version=0, active_hash=h0)
    assert weights_hash(bf16_views(model)) == weights_hash(after)


def test_the_real_first_adamw_step_is_dense_and_the_writer_picks_dense_encodings(real_step):
    before, after = real_step
    h0 = weights_hash(before)
    changed = sum(int((before[k] != after[k]).sum()) for k in before)
    assert changed > 0.5 * sum(v.size for v in before.values())  # Adam's first step
    d = read_delta(encode_delta(before, after, model="m", version=1, base_hash=h0,
                                codec="aurora-base"))  # fmt: skip
    assert {t.codec for t in d.tensors} & {"dense-base", "xor-zstd"}
    sizes = {
        c: len(encode_delta(before, after, model="m", version=1, base_hash=h0, codec=c))
        for c in codecs.CODECS
    }
    assert d.size <= min(sizes.values())


def test_the_torch_path_refuses_a_bad_record_before_writing_any_parameter(real_step):
    before, after = real_step
    h0 = weights_hash(before)
    d = read_delta(encode_delta(before, after, model="m", version=1, base_hash=h0))
    last = d.tensors[-1]
    bad = replace(d, tensors=(*d.tensors[:-1], replace(last, nnz=last.nnz + 1)))
    model = actor_model(before)
    with pytest.raises(DeltaError):
        apply_delta_torch(bad, dict(model.named_parameters()), active_version=0, active_hash=h0)
    assert weights_hash(bf16_views(model)) == h0
