"""torch / transformers side of the delta: zero-copy uint16 views of bf16 parameters.

The codec works on numpy ``uint16`` arrays. A contiguous bf16 CPU tensor is viewed as int16 by
torch and as uint16 by numpy without a copy, so :func:`bf16_views` of a model hands the delta
layer the model's own storage, and :func:`aurora.delta.apply.apply_delta` writes the new bits
straight into the parameters, in place. Tied parameters (``lm_head`` sharing the embedding) are
listed once, under the first name, so a change is neither sent nor applied twice.

This module imports torch; so does :mod:`aurora.delta.torch_apply` (lazily, the index-based apply
that also reaches GPU tensors); the rest of ``aurora.delta`` needs numpy (and numba, imported on
the first apply).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch


def bf16_view(t: torch.Tensor) -> np.ndarray:
    """uint16 numpy view sharing memory with a contiguous bf16 CPU tensor."""
    if t.dtype != torch.bfloat16:
        raise ValueError(f"expected a bf16 tensor, got {t.dtype}")
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("expected a contiguous CPU tensor (copy GPU weights with .cpu() first)")
    return t.detach().view(torch.int16).numpy().view(np.uint16)


def bf16_views(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """``{split name: uint16 view}`` of every bf16 parameter and buffer, tied ones once."""
    out: dict[str, np.ndarray] = {}
    seen: set[int] = set()
    for name, t in list(model.state_dict(keep_vars=True).items()):
        if t.dtype != torch.bfloat16:
            continue
        ptr = t.data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        out[name] = bf16_view(t.data)
    return out


def publish_bf16(master: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """What the Trainer publishes: its fp32 master weights rounded to bf16 (as uint16 copies)."""
    return {
        name: t.detach()
        .to(torch.bfloat16)
        .contiguous()
        .view(torch.int16)
        .numpy()
        .view(np.uint16)
        .copy()
        for name, t in master.items()
    }


def tiny_qwen3(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A tiny Qwen3 built from a config (no download): 2 layers, hidden 64, 4 q / 2 kv heads."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    # transformers types its wrapped PreTrainedModel.to as taking the model, not a dtype
    model: torch.nn.Module = Qwen3ForCausalLM(cfg).to(dtype)  # type: ignore[arg-type]
    return model
