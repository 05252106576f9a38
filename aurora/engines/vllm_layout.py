"""vLLM's tensor-parallel layout of a Llama/Qwen-style decoder, and the way back from it.

Theory of operation
-------------------
vLLM's loaders stack q/k/v and gate/up along the output dimension in the delta format's order
and give each tensor-parallel rank a slice: ``qkv_proj`` by heads, ``gate_up_proj`` by parts,
``o_proj``/``down_proj`` by columns, the vocabulary padded to a multiple of 64 (the rules are
:mod:`aurora.delta.tp`'s). :class:`ModelShape` is what those slices depend on,
:func:`rank_layout` is one rank's layout, and :func:`assemble_ranks` puts every rank's slices
back into the canonical fused tensors, refusing ranks that disagree or an element no rank holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from aurora.delta.tp import Sharding, TPRank, local_shape, local_to_global, vllm_shardings
from aurora.engines.base import EngineError


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
