"""What publishing one version costs the Trainer, per strategy.

Theory of operation
-------------------
After an optimizer step the new bf16 weights are on the training GPUs. Each strategy gets them
out differently, and only part of that work holds up the next optimizer step (the *blocking*
part); the rest runs beside the next step (the *background* part): see :class:`Publication`.
The host copy is what cannot overlap: the next optimizer step overwrites the weights being
copied. The host keeps two buffers (v-1 and v), so the copy of v+1 also waits until the
background work on v is done with them.

Two pipelines (``SimConfig.publish_pipeline``): ``overlapped``, the paper's design, and
``sequential``, the runtime's Trainer (``aurora/runtime/trainer.py``), where nothing runs beside
the next step; a recorded run's trace (:mod:`sim.runtrace`) is replayed with it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - typing only
    from sim.model import Simulation

GBPS = 1e9 / 8
"""Bytes/s in one Gbit/s."""


@dataclass(frozen=True, kw_only=True)
class Publication:
    """The Trainer-side cost of publishing one version.

    Per strategy:

    * delta (AuroraRL): the Trainer waits while each GPU copies its shard of the bf16 weights
      to host memory (``dense_bytes / (d2h rate x GPUs)``); then, beside the next step, ``D_v``
      is extracted on the CPU from the host copies of v-1 and v (``extract_s``), its segments
      leaving as they are produced (cut-through), or when it ends;
    * dense (PrimeRL): the same copy to host memory; then, in the background, the dense
      checkpoint is written to the store (``dense_bytes / serialize rate``), and the broadcast
      starts when it is written;
    * RDMA (Ideal): the Trainer waits for the broadcast itself, GPU to GPU over the fabric
      (``dense_bytes / RDMA rate``); nothing runs in the background.

    The paper says extraction is "largely overlapped with rollout" (§6.2). The wait for the host
    buffers binds only when a training step is shorter than the extraction. With the
    ``sequential`` pipeline (the runtime's Trainer, one process on CPU or one GPU), after the
    optimizer step the Trainer extracts the version (a delta, or for PrimeRL a dense copy in the
    delta format) while its segments leave as they are cut, then writes it to the store,
    checkpoints itself and announces it to the Ledger (``publish_s``), and only then fetches its
    next batch.
    """

    blocking: str
    """Name of the blocking work in the timeline (``copy``, ``broadcast``)."""
    blocking_s: float
    """Seconds the Trainer waits before its next optimizer step."""
    background: str
    """Name of the background work in the timeline (``extract``, ``serialize``, or empty)."""
    background_s: float
    """Seconds of work beside the next step before the version's bytes are all produced."""
    cut_through: bool
    """Bytes leave while the background work produces them (else when it ends)."""
    sequential: bool = False
    """The blocking work produces the version's bytes (they leave as it does, cut-through) and
    the Trainer then spends ``announce_s`` before it announces the version."""
    announce_s: float = 0.0
    """Sequential only: seconds from the end of extraction to the announcement (store write,
    checkpoint), during which the Trainer does not train."""


def publication(sim: Simulation) -> Publication:
    """The publication cost of ``sim``'s strategy and model."""
    cfg, consts, model = sim.cfg, sim.consts, sim.model
    strat, trainer = cfg.strategy, cfg.topology.trainer
    dense = model.dense_bytes.value
    if strat.rdma:
        return Publication(
            blocking="broadcast",
            blocking_s=dense / (consts.rdma_gbps.value * GBPS),
            background="",
            background_s=0.0,
            cut_through=True,
        )
    if cfg.publish_pipeline == "sequential":
        dense_payload = strat.payload == "dense"
        return Publication(
            blocking="serialize" if dense_payload else "extract",
            blocking_s=(
                dense / consts.serialize_bytes_per_s.value
                if dense_payload
                else model.extract_s.value
            ),
            background="",
            background_s=0.0,
            cut_through=True,
            sequential=True,
            announce_s=model.publish_s.value if model.publish_s is not None else 0.0,
        )
    copy_s = dense / (consts.d2h_bytes_per_s_per_gpu.value * trainer.gpus)
    if strat.payload == "dense":
        return Publication(
            blocking="copy",
            blocking_s=copy_s,
            background="serialize",
            background_s=dense / consts.serialize_bytes_per_s.value,
            cut_through=False,
        )
    return Publication(
        blocking="copy",
        blocking_s=copy_s,
        background="extract",
        background_s=model.extract_s.value,
        cut_through=strat.cut_through,
    )
