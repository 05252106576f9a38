"""Tensor parallelism: each vLLM rank applies only its slice of a fused delta, bit-exactly.

The reference splits the full tensors the way vLLM's weight loaders do
(``vllm/model_executor/layers/linear.py``: ``QKVParallelLinear``, ``MergedColumnParallelLinear``,
``RowParallelLinear``; ``vocab_parallel_embedding.py``), reimplemented here from their
narrow-and-copy rules: rank r's parameter after applying D_v must equal the loader's shard of v.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from aurora.delta import apply as apply_module  # noqa: E402
from aurora.delta import encode_delta, read_delta, weights_hash  # noqa: E402
from aurora.delta.changes import Materialized  # noqa: E402
from aurora.delta.errors import LayoutError  # noqa: E402
from aurora.delta.torch_apply import apply_delta_torch  # noqa: E402
from aurora.delta.tp import (  # noqa: E402
    Sharding,
    TPRank,
    local_to_global,
    to_rank,
    vllm_shardings,
)

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, VOCAB = 8, 2, 4, 16, 24, 100  # GQA: 4 q per kv head
P = "model.layers.0."
SPLIT = {
    "model.embed_tokens.weight": (VOCAB, HIDDEN),
    P + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
    P + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
    P + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
    P + "self_attn.q_proj.bias": (HEADS * HEAD_DIM,),
    P + "self_attn.k_proj.bias": (KV_HEADS * HEAD_DIM,),
    P + "self_attn.v_proj.bias": (KV_HEADS * HEAD_DIM,),
    P + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
    P + "mlp.gate_proj.weight": (INTER, HIDDEN),
    P + "mlp.up_proj.weight": (INTER, HIDDEN),
    P + "mlp.down_proj.weight": (HIDDEN, INTER),
    P + "input_layernorm.weight": (HIDDEN,),
}


def split_weights(seed):
    r = np.random.default_rng(seed)
    return {k: r.integers(0, 2**16, s, dtype=np.uint16) for k, s in SPLIT.items()}


def t(a):
    return torch.from_numpy(a.view(np.int16).copy())


def vllm_load(split, rank, size):
    """Rank ``rank``'s parameters as vLLM's weight loaders fill them from the split checkpoint."""
    out = {}
    num_heads = HEADS // size
    if size >= KV_HEADS:
        num_kv, replicas = 1, size // KV_HEADS
    else:
        num_kv, replicas = KV_HEADS // size, 1
    for kind in ("weight", "bias"):
        tail = (HIDDEN,) if kind == "weight" else ()
        param = torch.zeros(((num_heads + 2 * num_kv) * HEAD_DIM, *tail), dtype=torch.int16)
        for shard_id, part in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
            loaded = t(split[f"{P}self_attn.{part}.{kind}"])
            if shard_id == "q":
                offset, size_, shard_rank = 0, num_heads * HEAD_DIM, rank
            elif shard_id == "k":
                offset, size_ = num_heads * HEAD_DIM, num_kv * HEAD_DIM
                shard_rank = rank // replicas
            else:
                offset, size_ = (num_heads + num_kv) * HEAD_DIM, num_kv * HEAD_DIM
                shard_rank = rank // replicas
            param.narrow(0, offset, size_).copy_(loaded.narrow(0, shard_rank * size_, size_))
        out[f"{P}self_attn.qkv_proj.{kind}"] = param
    output_sizes = [INTER, INTER]  # MergedColumnParallelLinear
    param = torch.zeros((2 * INTER // size, HIDDEN), dtype=torch.int16)
    for shard_id, part in enumerate(("gate_proj", "up_proj")):
        offset = sum(output_sizes[:shard_id]) // size
        size_ = output_sizes[shard_id] // size
        loaded = t(split[f"{P}mlp.{part}.weight"])
        param.narrow(0, offset, size_).copy_(loaded.narrow(0, rank * size_, size_))
    out[f"{P}mlp.gate_up_proj.weight"] = param
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):  # RowParallelLinear
        loaded = t(split[P + name])
        shard = loaded.shape[1] // size
        out[P + name] = loaded.narrow(1, rank * shard, shard).contiguous()
    padded = -(-VOCAB // 64) * 64  # VocabParallelEmbedding
    per = padded // size
    start, end = min(rank * per, VOCAB), min((rank + 1) * per, VOCAB)
    emb = torch.zeros((per, HIDDEN), dtype=torch.int16)
    emb[: end - start] = t(split["model.embed_tokens.weight"])[start:end]
    out["model.embed_tokens.weight"] = emb
    out[P + "input_layernorm.weight"] = t(split[P + "input_layernorm.weight"])
    return out


def stepped(old, density, seed):
    r = np.random.default_rng(seed)
    new = {}
    for k, v in old.items():
        n = v.copy()
        m = r.random(n.shape) < density
        n[m] = (n[m].astype(np.int32) + r.choice([-2, -1, 1], int(m.sum()))).astype(np.uint16)
        new[k] = n
    return new


def shardings(names):
    return vllm_shardings(
        names,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=INTER,
    )


@pytest.mark.parametrize("fast", [True, False], ids=["compiled", "numpy"])
@pytest.mark.parametrize("codec", ["aurora", "aurora-base", "leb128", "xor-zstd"])
@pytest.mark.parametrize("density", [0.05, 0.8])
def test_each_tp_rank_applies_its_slice_bit_exactly_as_vllm_loads_it(
    codec, density, fast, monkeypatch
):
    monkeypatch.setattr(apply_module, "COMPILED_MIN_CHANGES", 0 if fast else 2**62)
    old = split_weights(0)
    new = stepped(old, density, 1)
    h0 = weights_hash(old)
    d = read_delta(encode_delta(old, new, model="m", version=1, base_hash=h0, codec=codec))
    if density > 0.5 and codec == "aurora-base":
        assert any(td.codec in ("dense-base", "xor-zstd") for td in d.tensors)
    for size in (1, 2, 4):
        for rank in range(size):
            params = vllm_load(old, rank, size)
            tp = TPRank(rank, size, shardings(params))
            apply_delta_torch(d, params, active_version=0, active_hash=h0, tp=tp)
            want = vllm_load(new, rank, size)
            assert set(params) == set(want)
            for name, p in params.items():
                assert torch.equal(p, want[name]), (size, rank, name)


def test_the_remap_and_its_inverse_agree_for_every_kind_rank_and_size():
    shape = (HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM, HIDDEN)
    kinds = {
        "qkv": (Sharding("qkv", (HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM)), shape),
        "merged": (Sharding("merged", (INTER, INTER)), (2 * INTER, HIDDEN)),
        "row": (Sharding("row"), (HIDDEN, INTER)),
        "vocab": (Sharding("vocab"), (VOCAB, HIDDEN)),
        "column": (Sharding("column"), (INTER, HIDDEN)),
    }
    for sh, shp in kinds.values():
        numel = int(np.prod(shp))
        idx = np.arange(0, numel, 3, dtype=np.int64)
        m = Materialized(idx, (idx % 65521).astype(np.uint16), "set", numel, idx.size)
        for size in (1, 2, 4):
            for rank in range(size):
                g = local_to_global(sh, shp, rank, size)
                local = to_rank(m, sh, shp, rank, size)
                want = np.flatnonzero((g >= 0) & (g % 3 == 0))
                assert np.array_equal(local.idx, want)
                assert np.array_equal(local.vals, (g[want] % 65521).astype(np.uint16))


def test_a_rank_refuses_a_slice_of_the_wrong_shape_before_writing():
    old = split_weights(0)
    new = stepped(old, 0.1, 1)
    h0 = weights_hash(old)
    d = read_delta(encode_delta(old, new, model="m", version=1, base_hash=h0))
    params = vllm_load(old, 0, 2)
    before = {k: v.clone() for k, v in params.items()}
    tp = TPRank(0, 4, shardings(params))  # the engine runs TP 2, the adapter says 4
    with pytest.raises(LayoutError, match="rank 0/4 holds"):
        apply_delta_torch(d, params, active_version=0, active_hash=h0, tp=tp)
    assert all(torch.equal(params[k], before[k]) for k in params)
    bad = {k: v for k, v in shardings(params).items() if "qkv" not in k}
    with pytest.raises(LayoutError, match="no tensor-parallel sharding"):
        apply_delta_torch(d, params, active_version=0, active_hash=h0, tp=TPRank(0, 2, bad))
