"""A real model's size on real processes: Qwen3 weights by shape, a synthetic AdamW-like step.

Theory of operation
-------------------
The data path (extraction, codecs, the Checkpoint Store, signed announcements, S streams, relays,
cut-through, the Actors' in-place apply) depends on the model only through its tensors: their
names, shapes and how many bf16 elements change per step. This backend gives the real runtime
exactly that, at a real model's size, without a download or a GPU: a published Qwen3
checkpoint's exact parameter names and shapes (:data:`MODELS`), fp32 master weights drawn from
the job seed and published as bf16, and a synthetic AdamW-like step that changes
``shapes_density`` of the bf16 elements (:class:`ShapesTrainer`); generation and reward are the
stand-in's (:class:`ShapesEngine`), not a learning signal. Every step's statistics and the run's
outputs say ``backend: shapes``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import cache
from typing import Any

import numpy as np

from aurora.delta import synthetic, warm_up, weights_hash
from aurora.jobspec import JobSpec
from aurora.runtime.standin import StandinEngine, StandinTrainer, _seed

MODELS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b-shapes": {  # Qwen/Qwen3-0.6B config.json
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "tie_word_embeddings": True,
        "attention_bias": False,
    },
    "qwen3-1.7b-shapes": {  # Qwen/Qwen3-1.7B config.json
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "tie_word_embeddings": True,
        "attention_bias": False,
    },
    "qwen3-tiny-shapes": {  # the same layout at a test's size (not a published model)
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 192,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "tie_word_embeddings": True,
        "attention_bias": False,
    },
}
"""Published hyper-parameters of each model this backend builds (only the ones that decide the
tensors' names and shapes matter; the rest are copied for completeness), and a tiny one of the
same layout for end-to-end tests of the harnesses that run these (``experiments.fidelity``)."""
NOISE_POOL = 1 << 24
"""N(0, 1) draws the Trainer keeps (64 MiB) and takes each step's noise from."""
NOISE_BLOCK = 1 << 20
"""Elements that share one offset into the noise pool (a step draws ~600 offsets at 0.6B)."""
DEFAULT_DENSITY = 0.02
"""Share of bf16 elements a step changes (the transfer regime: 1-3%)."""


@cache
def model_shapes(model: str) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of ``model`` (one of :data:`MODELS`), from transformers' own
    Qwen3 on the meta device."""
    if model not in MODELS:
        raise ValueError(f"unknown shapes model {model!r} (known: {', '.join(MODELS)})")
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**MODELS[model])
    with torch.device("meta"):
        net = Qwen3ForCausalLM(config)
    return {name: tuple(p.shape) for name, p in net.named_parameters()}


def dense_bytes(model: str) -> int:
    """bf16 bytes of ``model``'s weights."""
    return sum(2 * math.prod(s) for s in model_shapes(model).values())


def _master(shapes: Mapping[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    """fp32 master weights N(0, 0.02), norms 1 + N(0, 0.02), from torch's seeded generator
    (numpy's normals took 36 s for 0.6G elements on this loaded machine, torch's 17 s)."""
    import torch

    gen = torch.Generator().manual_seed(_seed("shapes-weights", seed) % (1 << 63))
    out = {}
    for name, shape in shapes.items():
        x = torch.randn(shape, generator=gen, dtype=torch.float32) * 0.02
        if name.endswith("norm.weight"):
            x += 1.0
        out[name] = x.numpy()
    return out


def bf16_bits(master: np.ndarray) -> np.ndarray:
    """bf16 bit patterns of fp32 weights, round to nearest even (torch's conversion; the same
    bits as ``synthetic.to_bf16_bits``, in one pass instead of five)."""
    import torch

    t = torch.from_numpy(master).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16)


class ShapesTrainer(StandinTrainer):
    """The Trainer side: fp32 master weights of the model's shapes, a synthetic AdamW-like step;
    extraction and publishing are the stand-in's, i.e. the real
    :class:`aurora.delta.DeltaEncoder` on the whole model.

    * **weights**: the exact parameter names and shapes of a published Qwen3 checkpoint
      (:data:`MODELS`: the hyper-parameters of its ``config.json``, written here), read from
      ``transformers.Qwen3ForCausalLM`` built from a ``Qwen3Config`` on torch's ``meta`` device
      (no memory, no weights); the embedding is tied, so ``lm_head`` is not a separate tensor,
      as in the published ``model.safetensors``. Values are fp32 master weights N(0, 0.02)
      (norms 1 + N(0, 0.02)) drawn from the job seed, published as bf16 (round to nearest even);
    * **a step**: as ``aurora.delta.synthetic.step``, the update an AdamW step makes per element
      (its normalised update m / sqrt(v) is of order 1: ``lr * N(0, 1)``) on the fp32 master,
      with the learning rate bisected so ``shapes_density`` (default 2%, the transfer regime's
      1-3%) of the bf16 elements change. The N(0, 1) draws come from a 16M-draw pool at random
      offsets per block of 1M elements (each element's update is still N(0, 1)). It is not
      AdamW on gradients: no model is evaluated.

    Every step's statistics say ``backend: shapes`` and name the model, the update and the
    generation rate."""

    def __init__(self, spec: JobSpec) -> None:
        super().__init__(replace(spec, standin_hidden=8))  # its tiny weights are replaced below
        self.model = spec.model
        self.shapes = model_shapes(self.model)
        self.density = spec.shapes_density if spec.shapes_density is not None else DEFAULT_DENSITY
        self.lr = synthetic.lr_for_density(self.density)
        self.rate = spec.standin_tokens_per_s
        self._reset()

    def _reset(self) -> None:
        pool = np.random.default_rng(_seed("shapes-noise", self.seed))
        self.noise = pool.standard_normal(NOISE_POOL, dtype=np.float32)
        self.master = _master(self.shapes, self.seed)
        self._published = {k: bf16_bits(v) for k, v in self.master.items()}
        self._next = None
        self.version = 0
        self.weights_hash = weights_hash(self._published)

    def _advance(self, step: int) -> dict[str, np.ndarray]:
        """The master after step ``step`` (in place) and its bf16 bits. Each block of
        :data:`NOISE_BLOCK` elements takes its N(0, 1) noise from the job's noise pool at an
        offset drawn per step: every element's update is N(0, 1) as in ``synthetic.step``
        (drawing 0.6G fresh normals per step took 13 s on this loaded machine, more than the
        rest of a step together)."""
        import torch

        rng = np.random.default_rng(_seed("shapes-step", self.seed, step))
        noise = torch.from_numpy(self.noise)
        new = {}
        for name, m in self.master.items():
            flat = torch.from_numpy(m.reshape(-1))  # the master's own memory
            for a in range(0, flat.numel(), NOISE_BLOCK):
                b = min(a + NOISE_BLOCK, flat.numel())
                off = int(rng.integers(0, self.noise.size - (b - a) + 1))
                flat[a:b].add_(noise[off : off + b - a], alpha=self.lr)  # fp32, as numpy's
            new[name] = bf16_bits(m)
        return new

    def train(self, results: Sequence[tuple[int, bytes, int]]) -> dict[str, Any]:
        t = time.perf_counter()
        if self._next is None:  # a step trained but not yet published is not trained twice
            self._next = self._advance(self.version + 1)
        stats = super_stats(results)
        return {
            **stats,
            "backend": "shapes",
            "model": self.model,
            "update": f"synthetic AdamW-like lr*N(0,1) on fp32 master, lr {self.lr:.3g}",
            "target_density": self.density,
            "generation": f"stand-in, {self.rate:g} tokens/s per Actor (0: untimed)",
            "step_compute_s": time.perf_counter() - t,
        }

    def save(self, path: str) -> None:
        with open(path, "wb") as out:
            np.savez(
                out,
                version=self.version,
                seed=self.seed,
                weights_hash=np.frombuffer(bytes.fromhex(self.weights_hash), dtype=np.uint8),
            )

    def load(self, path: str) -> None:
        """A checkpoint stores the seed and the version, and this replays the steps (each step's
        noise is seeded by the job seed and the version, so the replay is bit-exact) instead of
        the fp32 master being written (2.4 GB at 0.6B)."""
        with np.load(path, allow_pickle=False) as f:
            version, seed = int(f["version"]), int(f["seed"])
            h = bytes(f["weights_hash"]).hex()
        if seed != self.seed:
            raise ValueError(f"{path}: checkpoint of seed {seed}, this job's is {self.seed}")
        self._reset()
        for step in range(1, version + 1):  # bit-exact replay of every published step
            self._published = self._advance(step)
        self.version = version
        self.weights_hash = h

    def export(self, path: str) -> None:
        from pathlib import Path

        Path(path).mkdir(parents=True, exist_ok=True)
        # Any: mypy would match the arrays against savez's allow_pickle keyword too
        arrays: Mapping[str, Any] = self._published
        np.savez(f"{path}/{self.model}.npz", **arrays)


def super_stats(results: Sequence[tuple[int, bytes, int]]) -> dict[str, Any]:
    """The stand-in's reward (share of even token ids) of a batch."""
    import msgpack

    even = total = 0
    for _index, payload, _version in results:
        for comp in msgpack.unpackb(payload)["completions"]:
            ids = comp["ids"]
            even += sum(1 for t in ids if t % 2 == 0)
            total += len(ids)
    return {"reward": even / total if total else 0.0, "loss": 0.0}


class ShapesEngine(StandinEngine):
    """The engine side: the model's bf16 weights, applied in place by the compiled loops (warmed
    up when the weights load), the stand-in's timed generation
    (:class:`aurora.runtime.standin.StandinEngine`): random token ids, timed at
    ``standin_tokens_per_s`` tokens per second per Actor (0: as fast as possible). Rewards are
    the stand-in's share of even ids: not a learning signal."""

    def load(self, state: Mapping[str, np.ndarray], *, version: int, weights_hash: str) -> None:
        super().load(state, version=version, weights_hash=weights_hash)
        warm_up()
