"""The policy-transfer strategies: how each version travels from the Trainer to the Actors.

A strategy changes only how policy updates travel (payload, codec, streams, relays, lag, cut-
through, allocation feedback); the Trainer, Actors and traces stay the same, as in the paper's
baselines (§6.1). The simulator (:mod:`sim.config`) and the runtime (:mod:`aurora.runtime.job`)
read the same table, so a strategy name means the same thing in both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

PAYLOADS = ("delta", "dense")


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """How policy updates get from the Trainer to the Actors."""

    name: str
    """Name in result rows and on the command line."""
    payload: str
    """``delta`` (sparse delta checkpoint per step) or ``dense`` (full bf16 weights per step)."""
    codec: str = "aurora"
    """Delta codec, whose size comes from the traces' ``codec_bytes_vs_leb128``."""
    streams: int = 4
    """Parallel TCP streams per transfer (S)."""
    relays: bool = True
    """One relay per remote region forwards cut-through; ``False``: every Actor pulls from the
    Trainer over the WAN."""
    proportional: bool = True
    """Split batches by measured throughput (``False``: no throughput feedback, equal shares)."""
    max_lag: int = 1
    """Lag bound: batch k may be generated on version k-1-max_lag or newer."""
    cut_through: bool = True
    """Transfer overlaps extraction and relays forward segments as they arrive (``False``: send
    after extraction ends, relays store and forward)."""
    rdma: bool = False
    """Ideal-SingleDC: every transfer runs at the RDMA fabric rate, no WAN, no extraction."""
    staging_grace_s: float = 10.0
    """Seconds a ready batch waits for Actors still staging its version (``inf``: wait always)."""

    def __post_init__(self) -> None:
        if self.payload not in PAYLOADS:
            raise ValueError(f"payload must be one of {PAYLOADS}, got {self.payload!r}")
        if self.streams < 1:
            raise ValueError(f"streams must be >= 1, got {self.streams}")
        if self.max_lag < 1:
            raise ValueError(f"max_lag must be >= 1, got {self.max_lag}")
        if not self.staging_grace_s >= 0:
            raise ValueError(f"staging_grace_s must be >= 0, got {self.staging_grace_s}")


_AURORA = Strategy(name="aurora", payload="delta")
_PRIME = Strategy(
    name="prime-full",
    payload="dense",
    streams=1,
    # PrimeRL's decentralized deployments spread checkpoints through HTTP relay servers
    # (shardcast): one WAN crossing per region, store-and-forward. The paper's ~200 s per
    # 15.6 GB broadcast (§6.3) is one crossing of its 0.5-1 Gbps link, not eight.
    relays=True,
    cut_through=False,
    staging_grace_s=math.inf,
)

STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        _AURORA,
        # Ablations: one part of AuroraRL removed at a time.
        replace(_AURORA, name="aurora-leb128", codec="leb128"),
        replace(_AURORA, name="aurora-naive", codec="naive"),
        replace(_AURORA, name="aurora-1stream", streams=1),
        replace(_AURORA, name="aurora-norelay", relays=False),
        replace(_AURORA, name="aurora-uniform", proportional=False),
        replace(_AURORA, name="aurora-nocut", cut_through=False),
        # The paper's baselines (§6.1).
        _PRIME,
        replace(_PRIME, name="prime-async2", max_lag=2),
        replace(_PRIME, name="prime-async4", max_lag=4),
        replace(_PRIME, name="prime-multistream", streams=4),
        replace(_PRIME, name="ideal-singledc", rdma=True),
    )
}
"""Named strategies. ``aurora`` uses our default codec; ``aurora-leb128`` is the paper's
encoding."""


def replace_strategy(base: Strategy, **changes: Any) -> Strategy:
    """A variant of ``base`` (e.g. another stream count), validated like any strategy."""
    return replace(base, **changes)


def strategy(name: str) -> Strategy:
    if name not in STRATEGIES:
        raise ValueError(
            f"strategy: unknown strategy {name!r} (expected one of {list(STRATEGIES)})"
        )
    return STRATEGIES[name]
