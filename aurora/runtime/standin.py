"""A labelled stand-in compute backend: real weights and deltas, fake learning.

Theory of operation
-------------------
Load and fault tests need many Actor processes that settle real leases through the real Ledger,
stage real deltas through the real data plane and apply them into real weights, without paying
for a model on every one of 2 CPU cores. The stand-in keeps that whole path and replaces only
the model: small seeded bf16 weights under transformers' names, a "training step" that changes a
seeded random share of them by one ulp (:class:`StandinTrainer`: each ``D_v`` is a real sparse
delta every Actor must apply bit-exactly), and "generation" of seeded random token ids
(:class:`StandinEngine`). The "reward" is a number, not a learning signal, and every output of a
run on this backend says ``backend: standin``.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from aurora.delta import Delta, DeltaEncoder, Segment, apply_delta, weights_hash
from aurora.delta.codecs import DEFAULT_CODEC
from aurora.runtime.compute import Generated, Published, Sampling

if TYPE_CHECKING:  # pragma: no cover - typing only
    from aurora.jobspec import JobSpec

VOCAB = 17


def standin_shapes(hidden: int = 64, layers: int = 2) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of the stand-in model (a tiny Qwen3-like layout)."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, hidden)}
    kv = hidden // 2
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.self_attn.q_proj.weight": (hidden, hidden),
            f"{p}.self_attn.k_proj.weight": (kv, hidden),
            f"{p}.self_attn.v_proj.weight": (kv, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, hidden),
            f"{p}.mlp.gate_proj.weight": (4 * hidden, hidden),
            f"{p}.mlp.up_proj.weight": (4 * hidden, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, 4 * hidden),
            f"{p}.input_layernorm.weight": (hidden,),
        }
    return shapes


def _seed(*parts: object) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def initial_weights(seed: int, hidden: int = 64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(_seed("weights", seed))
    out = {}
    for name, shape in standin_shapes(hidden).items():
        values = rng.normal(0.0, 0.02, size=shape).astype(np.float32)
        out[name] = (values.view(np.uint32) >> 16).astype(np.uint16)  # truncate to bf16 bits
    return out


class StandinTrainer:
    """The Trainer side. Weights are a small set of bf16 tensors under transformers' names
    (q/k/v and gate/up are there, so fused names are exercised), drawn from a seeded RNG; a
    "training step" changes a seeded random ``density`` of the bf16 elements by one ulp, so
    each ``D_v`` is a real sparse delta that every Actor must apply bit-exactly; the "reward" is
    the share of even token ids: a number, not a learning signal."""

    model_files: Mapping[str, str] = {}
    """No model files: the stand-in has no model (its manifest names no file)."""

    def __init__(self, spec: JobSpec) -> None:
        self.seed = spec.seed
        self.density = spec.standin_density
        self.model = "standin"
        self.version = 0
        self.max_new_tokens = 5
        self.vocab_size: int | None = VOCAB
        self.codec = spec.strategy.codec
        self.dense = spec.strategy.payload == "dense"
        self.segment_size = spec.segment_bytes
        self._published = initial_weights(self.seed, spec.standin_hidden)
        self._next: dict[str, np.ndarray] | None = None
        self.weights_hash = weights_hash(self._published)
        """h(version): the snapshot's hash at v0, then the chain."""

    def published(self) -> Mapping[str, np.ndarray]:
        return self._published

    def train(self, results: Sequence[tuple[int, bytes, int]]) -> dict[str, Any]:
        step = self.version + 1
        rng = np.random.default_rng(_seed("step", self.seed, step))
        new = {}
        for name, arr in self._published.items():
            flat = arr.reshape(-1).copy()
            picks = rng.random(flat.size) < self.density
            flat[picks] += np.uint16(1)  # one bf16 ulp (wraps on the sign bit only for NaNs)
            new[name] = flat.reshape(arr.shape)
        self._next = new
        even = total = 0
        for _index, payload, _version in results:
            for comp in msgpack.unpackb(payload)["completions"]:
                ids = comp["ids"]
                even += sum(1 for t in ids if t % 2 == 0)
                total += len(ids)
        return {"reward": even / total if total else 0.0, "loss": 0.0, "backend": "standin"}

    def publish(self, on_segment: Callable[[Segment], None]) -> Published:
        if self._next is None:
            raise ValueError(f"no step trained for v{self.version + 1}")
        enc = DeltaEncoder(
            self._published,
            self._next,
            model=self.model,
            version=self.version + 1,
            base_hash=self.weights_hash,
            full=self.dense,
            segment_size=self.segment_size,
            codec=self.codec or DEFAULT_CODEC,
        )
        pieces = []
        for seg in enc.segments():
            on_segment(seg)
            pieces.append(bytes(seg.data))
        assert enc.weights_hash is not None
        self._published, self._next = self._next, None
        self.version += 1
        self.weights_hash = enc.weights_hash
        return Published(
            version=self.version,
            weights_hash=enc.weights_hash,
            data=b"".join(pieces),
            changed=sum(t.nnz for t in enc.tensors),
            total=sum(int(a.size) for a in self._published.values()),
        )

    def digest(self) -> str:
        return weights_hash(self._published)

    def evaluate(self) -> float:
        return 0.0

    def save(self, path: str) -> None:
        # Any: mypy would match the arrays against savez's allow_pickle keyword too
        arrays: Mapping[str, Any] = self._published
        with open(path, "wb") as out:
            np.savez(
                out,
                version=self.version,
                weights_hash=np.frombuffer(bytes.fromhex(self.weights_hash), dtype=np.uint8),
                **arrays,
            )

    def load(self, path: str) -> None:
        with np.load(path, allow_pickle=False) as f:
            self.version = int(f["version"])
            self.weights_hash = bytes(f["weights_hash"]).hex()
            self._published = {
                k: f[k].copy() for k in f.files if k not in ("version", "weights_hash")
            }

    def export(self, path: str) -> None:
        from pathlib import Path

        Path(path).mkdir(parents=True, exist_ok=True)
        arrays: Mapping[str, Any] = self._published  # as in save()
        np.savez(f"{path}/standin.npz", **arrays)


class StandinEngine:
    """The engine side. Its "generation" samples ``max_new_tokens`` random ids per completion
    from a seed made of the job seed, the prompt id and the version, and takes
    ``tokens / tokens_per_s`` seconds when a rate is set (0: as fast as possible)."""

    model_files: Mapping[str, str] = {}
    """No model files: the stand-in has no model."""

    def __init__(self, spec: JobSpec) -> None:
        self.seed = spec.seed
        self.rate = spec.standin_tokens_per_s
        self.version: int | None = None
        self.weights_hash: str | None = None
        self.state: dict[str, np.ndarray] = {}

    def load(self, state: Mapping[str, np.ndarray], *, version: int, weights_hash: str) -> None:
        self.state = {k: np.array(v, dtype=np.uint16, copy=True) for k, v in state.items()}
        self.version, self.weights_hash = version, weights_hash

    def apply(self, delta: Delta) -> None:
        assert self.version is not None and self.weights_hash is not None
        self.weights_hash = apply_delta(
            delta,
            self.state,
            active_version=self.version,
            active_hash=self.weights_hash,
            # Off the main thread (an Actor applies in a worker) no signal can interrupt the
            # stores, which then skip their undo log (aurora.delta.apply).
            interruptible=threading.current_thread() is threading.main_thread(),
        )
        self.version = delta.version

    def digest(self) -> str:
        return weights_hash(self.state)

    def generate(self, prompts: Sequence[tuple[str, int]], sampling: Sampling) -> list[Generated]:
        out = []
        tokens = 0
        for prompt, index in prompts:
            rng = np.random.default_rng(_seed("gen", self.seed, prompt, self.version))
            comps = []
            for _ in range(sampling.n):
                ids = rng.integers(3, VOCAB, size=sampling.max_new_tokens).tolist()
                comps.append({"ids": ids, "lp": [-float(np.log(VOCAB - 3))] * len(ids)})
            n = sampling.n * sampling.max_new_tokens
            tokens += n
            payload = msgpack.packb({"prompt": prompt, "index": index, "completions": comps})
            out.append(Generated(prompt=prompt, payload=payload, tokens=n))
        if self.rate > 0:
            time.sleep(tokens / self.rate)
        return out
