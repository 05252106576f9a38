"""Recorded inputs of the simulator: model sizes, GPU throughputs, workloads, protocol constants.

Theory of operation
-------------------
The simulator computes nothing it could measure: every time it charges comes from a trace
(generation throughput of a GPU type on a model, training throughput, extraction time, bytes of
a delta or a dense checkpoint) or from the link model (``sim.network``). A trace file is YAML in
which every number is a ``{value: ..., source: ...}`` pair: ``source`` names the section of the
paper the number comes from, a measurement of ours, or says ``assumed:`` with the reason. Only
*inputs* go into traces; the paper's *results* (step times, speedups, tokens/s) must come out of
the model, and each source says which inputs are assumed (:meth:`Traces.sources`).

Loading checks keys, types and that every number has a source; a bad file raises ``ValueError``
naming the file and field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aurora.topology import build, load_yaml

TRACES_DIR = Path(__file__).parent / "traces"
PAPER = TRACES_DIR / "paper.yaml"


@dataclass(frozen=True, kw_only=True)
class Quantity:
    """One recorded number and where it comes from."""

    value: float
    """The number, in the unit its field names."""
    source: str
    """Section of the paper, a measurement of ours, or ``assumed: <reason>``."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.value) and self.value >= 0):
            raise ValueError(f"value must be a finite number >= 0, got {self.value!r}")
        if not self.source.strip():
            raise ValueError("source must say where the number comes from")


@dataclass(frozen=True, kw_only=True)
class Series:
    """One recorded number per version (v = 1, 2, ...) and where the numbers come from."""

    values: tuple[float, ...]
    """The numbers, version 1 first, in the unit the field names."""
    source: str
    """A measurement of ours (the run they were recorded from)."""

    def __post_init__(self) -> None:
        if not self.values:
            raise ValueError("values must hold at least one number")
        for v in self.values:
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"values must be finite numbers >= 0, got {v!r}")
        if not self.source.strip():
            raise ValueError("source must say where the numbers come from")

    def at(self, version: int, default: float) -> float:
        """Version ``version``'s number; ``default`` past either end of the series."""
        return self.values[version - 1] if 1 <= version <= len(self.values) else default


@dataclass(frozen=True, kw_only=True)
class ModelTrace:
    """Sizes and Trainer-side costs of one model."""

    params: Quantity
    """Parameters (count)."""
    dense_bytes: Quantity
    """Bytes of one dense bf16 checkpoint (what PrimeRL-style baselines broadcast)."""
    delta_bytes_leb128: Quantity
    """Bytes of one step's delta checkpoint in the paper's LEB128 encoding."""
    extract_s: Quantity
    """Seconds to scan the weights and encode the delta on the Trainer (CPU)."""
    train_tokens_per_s_per_gpu: dict[str, Quantity]
    """Training throughput per GPU type (tokens/s per GPU), forward + backward + reference."""
    publish_s: Quantity | None = None
    """Seconds from the end of extraction until the Trainer announces the version (writing it
    to the store, checkpointing itself); charged only by the ``sequential`` publication
    pipeline (a recorded run's Trainer). None: 0."""
    dense_payload_bytes: Quantity | None = None
    """Bytes on the wire of one version of a dense strategy, as it ships it (the runtime's
    PrimeRL strategies send a dense copy in the delta format, smaller than raw bf16 when
    tensors compress). None: ``dense_bytes`` (the paper's PrimeRL broadcasts raw bf16)."""
    delta_bytes_by_version: Series | None = None
    """Bytes of each version's delta in the unit of ``delta_bytes_leb128`` (scaled by the
    codec's ratio like it), as a recorded run published them: a run's deltas are not the same
    size from version to version (a real Trainer's first deltas change most of the weights,
    later ones fewer), and a link that carries them one after another is late by the larger
    ones. Versions past the end of the series are ``delta_bytes_leb128``. None: every version
    is ``delta_bytes_leb128`` (the paper's one number per model)."""


@dataclass(frozen=True, kw_only=True)
class GpuTrace:
    """Generation throughput of one GPU type running one Actor."""

    tokens_per_s: dict[str, Quantity]
    """Generated tokens/s per model id at the Actor's batch size."""
    cv: Quantity
    """Coefficient of variation of a batch's throughput (lognormal noise per batch)."""
    drift_per_hour: Quantity
    """Relative throughput change per hour of simulated time (e.g. thermal throttling)."""


@dataclass(frozen=True, kw_only=True)
class WorkloadTrace:
    """One RL task."""

    tokens_per_rollout: Quantity
    """Mean tokens per rollout (prompt + response) processed by generation and training."""


@dataclass(frozen=True, kw_only=True)
class Constants:
    """Protocol and system constants."""

    rollouts_per_actor: Quantity
    """Rollouts per Actor per step (the batch B is this times the number of Actors)."""
    codec_bytes_vs_leb128: dict[str, Quantity]
    """Size of each codec's delta relative to ``leb128`` (1.0 for leb128 itself)."""
    rdma_gbps: Quantity
    """Fabric rate of the Ideal-SingleDC baseline (Gbit/s)."""
    tcp_window_bytes: Quantity
    """Largest TCP window one stream reaches (bytes): the socket buffer limit."""
    mss_bytes: Quantity
    """TCP maximum segment size (bytes), for the Mathis loss limit."""
    apply_bytes_per_s: Quantity
    """Rate at which an Actor decodes and applies a delta (bytes of payload per second)."""
    dense_load_bytes_per_s: Quantity
    """Rate at which an Actor loads a dense checkpoint into its engine (bytes/s)."""
    trainer_restart_s: Quantity
    """Seconds from a Trainer crash until it trains again (reschedule, reload, warm-up)."""
    d2h_bytes_per_s_per_gpu: Quantity
    """Rate at which each training GPU copies its shard of the bf16 weights to host memory
    (bytes/s); the Trainer waits for this copy before its next optimizer step."""
    serialize_bytes_per_s: Quantity
    """Rate at which a dense checkpoint is written to the store before it can be served
    (bytes/s); runs beside the next training step."""
    result_bytes: Quantity | None = None
    """Bytes one result (one lease's completions: token ids, log-probs, lease, version,
    weights hash, framing, TCP/IP headers) puts on its Actor's link to the Ledger. With
    ``SimConfig.control_latency`` an Actor region's reports cross that link one after another
    at its rate, so a step's results queue behind each other (bytes that matter only on a thin
    link). None: a report takes only the latency."""
    store_read_bytes_per_s: Quantity | None = None
    """Rate at which an Actor reads a catch-up (snapshot and deltas) out of a Checkpoint Store
    on its own host (``SimConfig.store_local``: files, their signatures checked), bytes/s.
    None: its region's LAN rate."""


@dataclass(frozen=True, kw_only=True)
class Traces:
    """Everything the simulator charges time or bytes from."""

    models: dict[str, ModelTrace]
    """Per model id."""
    gpus: dict[str, GpuTrace]
    """Per GPU type."""
    workloads: dict[str, WorkloadTrace]
    """Per task (dataset) name."""
    constants: Constants
    """Protocol and system constants."""

    def model(self, name: str, *, where: str = "model") -> ModelTrace:
        if name not in self.models:
            raise ValueError(f"{where}: unknown model {name!r} (traces have {sorted(self.models)})")
        return self.models[name]

    def gpu(self, name: str, model: str, *, where: str = "gpu") -> GpuTrace:
        if name not in self.gpus:
            raise ValueError(
                f"{where}: unknown GPU type {name!r} (traces have {sorted(self.gpus)})"
            )
        if model not in self.gpus[name].tokens_per_s:
            raise ValueError(f"{where}: no throughput of GPU {name!r} on model {model!r} in traces")
        return self.gpus[name]

    def workload(self, name: str) -> WorkloadTrace:
        if name not in self.workloads:
            raise ValueError(
                f"workload: unknown workload {name!r} (traces have {sorted(self.workloads)})"
            )
        return self.workloads[name]

    def codec_ratio(self, codec: str) -> float:
        """Size of ``codec``'s delta relative to ``leb128``'s; an unknown codec raises."""
        ratio = self.constants.codec_bytes_vs_leb128.get(codec)
        if ratio is None:
            raise ValueError(
                f"codec: no size ratio for {codec!r} in traces "
                f"(have {sorted(self.constants.codec_bytes_vs_leb128)})"
            )
        return ratio.value

    def delta_bytes(self, model: str, codec: str) -> float:
        return self.model(model).delta_bytes_leb128.value * self.codec_ratio(codec)

    def delta_bytes_by_version(self, model: str, codec: str) -> tuple[float, ...]:
        """Each version's delta bytes in ``codec`` (v = 1 first); empty when the trace has one
        number for every version."""
        series = self.model(model).delta_bytes_by_version
        if series is None:
            return ()
        ratio = self.codec_ratio(codec)
        return tuple(b * ratio for b in series.values)

    def sources(self) -> list[tuple[str, float, str]]:
        """Every number as (field path, value, source) (``docs/SIMULATOR.md``, "Trace sources")."""
        out: list[tuple[str, float, str]] = []

        def walk(obj: Any, path: str) -> None:
            if isinstance(obj, Quantity):
                out.append((path, obj.value, obj.source))
            elif isinstance(obj, dict):
                for k in sorted(obj):
                    walk(obj[k], f"{path}.{k}" if path else k)
            elif hasattr(obj, "__dataclass_fields__"):
                for k in obj.__dataclass_fields__:
                    walk(getattr(obj, k), f"{path}.{k}" if path else k)

        walk(self, "")
        return out


def load_traces(path: str | Path = PAPER) -> Traces:
    """Read a trace file; a bad file raises ``ValueError`` naming the file and field."""
    return build(Traces, load_yaml(path, "trace"), source=str(path))
