"""What the runtime needs from the compute: a Trainer side and an engine side.

Theory of operation
-------------------
The roles of :mod:`aurora.runtime` move weights, leases and results; they never look inside a
model. They call the compute through the two small interfaces below, which a *backend* provides:
``rl``, the real thing (:mod:`aurora.rl`'s task, model and GRPO Trainer, :mod:`aurora.engines`);
``standin`` (:mod:`aurora.runtime.standin`), a labelled stand-in for load and fault tests with
real weights and deltas but random tokens and steps, so nothing it reports is a learning result;
``shapes`` (:mod:`aurora.runtime.shapes`), a published model's exact tensors with a synthetic
step: the real data path at a real model's size. Weights cross this boundary as bf16 bit
patterns (``uint16`` numpy arrays under the transformers names), deltas as
:class:`aurora.delta.Delta`, results as msgpack bytes (the Actor's completions with their token
ids and log-probs; the Trainer computes rewards itself).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from aurora.delta import Delta, Segment
from aurora.jobspec import JobSpec


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How Actors sample (identical on every Actor of a job)."""

    n: int
    """Completions per prompt (the GRPO group size G)."""
    max_new_tokens: int
    """Longest completion (tokens)."""
    temperature: float = 1.0
    """Sampling temperature; log-probs are those of the distribution actually sampled."""
    seed: int = 0
    """Base seed; each lease's sampling is seeded from it and the prompt id."""


@dataclass(frozen=True, slots=True)
class Published:
    """``D_v`` as the Trainer published it."""

    version: int
    weights_hash: str
    """h(v)."""
    data: bytes
    """The whole delta file."""
    changed: int
    """bf16 elements that changed."""
    total: int
    """bf16 elements of the model."""


@dataclass(frozen=True, slots=True)
class Generated:
    """The completions of one prompt, packed for the Ledger (``payload``)."""

    prompt: str
    payload: bytes
    tokens: int
    """Completion tokens generated (throughput accounting)."""


class EngineSide(Protocol):
    """An Actor's inference engine, as the runtime uses it (its attributes are read only: a
    plain attribute or a property serves)."""

    @property
    def version(self) -> int | None:
        """The version of the loaded weights (None before the first load)."""

    @property
    def weights_hash(self) -> str | None:
        """h(v) of the loaded weights: the snapshot's hash, then chained per applied delta."""

    @property
    def model_files(self) -> Mapping[str, str]:
        """The manifest of the model files it was built from (config, tokenizer, chat template:
        :mod:`aurora.store.manifest`); the Actor refuses to run unless they are the ones the
        Trainer signed. Empty where the backend loads no model."""

    def load(self, state: Mapping[str, np.ndarray], *, version: int, weights_hash: str) -> None:
        """Replace the weights (a snapshot, as bf16 bit patterns)."""

    def apply(self, delta: Delta) -> None:
        """Apply a verified delta in place (its base is the loaded version)."""

    def digest(self) -> str:
        """Content hash of the weights as they are (``aurora.delta.weights_hash``)."""

    def generate(self, prompts: Sequence[tuple[str, int]], sampling: Sampling) -> list[Generated]:
        """Sample ``sampling.n`` completions of each ``(prompt id, task index)``."""


class TrainerSide(Protocol):
    """The Trainer's model, optimizer and task, as the runtime uses them (its attributes are
    read only: a plain attribute or a property serves)."""

    @property
    def version(self) -> int:
        """The version of the published weights (0 before the first step)."""

    max_new_tokens: int
    """The task's longest completion (tokens), used when the job does not set one."""
    vocab_size: int | None
    """Token ids a result may carry are below this (None: not known; not checked)."""

    @property
    def model_files(self) -> Mapping[str, str]:
        """The manifest of the model files it loaded (:mod:`aurora.store.manifest`), signed
        with every snapshot; empty where the backend loads no model."""

    def published(self) -> Mapping[str, np.ndarray]:
        """The last published bf16 weights (bit patterns): the base of the next delta."""

    def train(self, results: Sequence[tuple[int, bytes, int]]) -> dict[str, Any]:
        """One optimizer step on ``(task index, payload, version generated on)`` of a batch;
        returns its statistics (reward, loss, ...)."""

    def publish(self, on_segment: Callable[[Segment], None]) -> Published:
        """Extract ``D_{version+1}`` from :meth:`published` to the trained weights, handing
        each segment to ``on_segment`` the moment it is cut (cut-through); afterwards the new
        weights are the published ones and :attr:`version` is one more."""

    def digest(self) -> str:
        """Content hash of the published bf16 weights."""

    def evaluate(self) -> float:
        """Held-out reward of the published weights."""

    def save(self, path: str) -> None:
        """Checkpoint everything a restart needs (master weights, optimizer, RNG, version) into
        exactly the file ``path`` (the caller renames it into place)."""

    def load(self, path: str) -> None:
        """Restore from :meth:`save`."""

    def export(self, path: str) -> None:
        """Write the published policy as a Hugging Face model directory."""


def make_trainer(job: JobSpec, *, workdir: str) -> TrainerSide:
    """The Trainer side of the job's backend."""
    backend = job.backend
    if backend == "standin":
        from aurora.runtime.standin import StandinTrainer

        return StandinTrainer(job)
    if backend == "shapes":
        from aurora.runtime.shapes import ShapesTrainer

        return ShapesTrainer(job)
    if backend == "rl":
        from aurora.runtime.rlbackend import RLTrainer

        return RLTrainer(job, workdir=workdir)
    raise ValueError(f"unknown compute backend {backend!r} (expected rl, standin or shapes)")


def make_engine(
    job: JobSpec, *, engine: str | None = None, engine_url: str | None = None
) -> EngineSide:
    """The engine side of the job's backend (``engine`` overrides its kind; ``engine_url``
    drives a running ``vllm serve`` instead of starting an engine)."""
    backend = job.backend
    if backend == "standin":
        from aurora.runtime.standin import StandinEngine

        if engine_url:
            raise ValueError("--engine-url: a job on the standin backend has no model to serve")
        return StandinEngine(job)
    if backend == "shapes":
        from aurora.runtime.shapes import ShapesEngine

        return ShapesEngine(job)
    if backend == "rl":
        from aurora.runtime.rlbackend import make_rl_engine

        return make_rl_engine(job, engine=engine, engine_url=engine_url)
    raise ValueError(f"unknown compute backend {backend!r} (expected rl, standin or shapes)")
