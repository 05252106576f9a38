"""A synthetic optimizer step built like a real one, for codec measurements without a download.

fp32 master weights ~ N(0, 0.02); one Adam-like step moves each weight by ``lr * u`` with
``u ~ N(0, 1)`` (Adam's normalised update is of order 1 per element); the Trainer publishes bf16
by round-to-nearest-even. Only the bf16 elements whose 16-bit pattern changed are in the delta,
so ``lr`` sets the density; :func:`lr_for_density` finds it by bisection on a sample.

``first=True`` is Adam's *first* step instead: its normalised update m/sqrt(v) is the sign of the
gradient, so every weight moves by exactly ``lr``, and every bf16 element whose half-ULP is below
``lr`` changes: the dense regime of a warm start or of a tiny model learning fast
(``docs/journal/early-measurements.md``: 11-60% changed per step, 99.6% on the first).
"""

from __future__ import annotations

import numpy as np

QWEN3_8B_LAYER = {
    "model.layers.0.self_attn.q_proj.weight": (4096, 4096),
    "model.layers.0.self_attn.k_proj.weight": (1024, 4096),
    "model.layers.0.self_attn.v_proj.weight": (1024, 4096),
    "model.layers.0.self_attn.o_proj.weight": (4096, 4096),
    "model.layers.0.mlp.gate_proj.weight": (12288, 4096),
    "model.layers.0.mlp.up_proj.weight": (12288, 4096),
    "model.layers.0.mlp.down_proj.weight": (4096, 12288),
    "model.layers.0.input_layernorm.weight": (4096,),
    "model.layers.0.post_attention_layernorm.weight": (4096,),
    "model.layers.0.self_attn.q_norm.weight": (128,),
    "model.layers.0.self_attn.k_norm.weight": (128,),
}
"""One Qwen3-8B decoder layer (hidden 4096, 32 q / 8 kv heads of 128, intermediate 12288):
about 193M parameters, the layer the codecs were chosen on
(``docs/journal/early-measurements.md``)."""


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns with round-to-nearest-even (as torch does), as uint16."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def step(
    master: np.ndarray, lr: float, rng: np.random.Generator, first: bool = False
) -> np.ndarray:
    """One Adam-like step of fp32 master weights (returns new fp32 weights); ``first``: Adam's
    first step, ``lr`` times the sign of a random gradient."""
    u = rng.standard_normal(master.shape, dtype=np.float32)
    if first:
        u = np.sign(u)
    new: np.ndarray = (master + np.float32(lr) * u).astype(np.float32)
    return new


def density(master: np.ndarray, lr: float, seed: int = 0, first: bool = False) -> float:
    new = step(master, lr, np.random.default_rng(seed), first)
    return float(np.mean(to_bf16_bits(master) != to_bf16_bits(new)))


def lr_for_density(
    target: float,
    *,
    std: float = 0.02,
    sample: int = 2_000_000,
    seed: int = 0,
    first: bool = False,
) -> float:
    """Learning rate whose step changes ``target`` of the bf16 weights (bisection, 40 rounds);
    densities of 0.5 and more only with ``first`` (a N(0, 1) step saturates below 100%)."""
    if not 0 < target < (1.0 if first else 0.5):
        raise ValueError(f"density must be in (0, {1 if first else 0.5}), got {target}")
    master = np.random.default_rng(seed).standard_normal(sample, dtype=np.float32) * std
    lo, hi = 1e-9, (1.0 if first else 1e-2)
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        if density(master, mid, seed + 1, first) < target:
            lo = mid
        else:
            hi = mid
    return float((lo * hi) ** 0.5)


def make_step(
    shapes: dict[str, tuple[int, ...]],
    *,
    lr: float,
    seed: int = 0,
    std: float = 0.02,
    first: bool = False,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(old bf16, new bf16) as uint16 arrays for a model of ``shapes`` after one step."""
    rng = np.random.default_rng(seed)
    old, new = {}, {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            master = 1.0 + rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        else:
            master = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        old[name] = to_bf16_bits(master)
        new[name] = to_bf16_bits(step(master, lr, rng, first))
        del master
    return old, new
