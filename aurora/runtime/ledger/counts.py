"""What the Ledger counts about itself: run totals and per-event latencies, in fixed memory.

Theory of operation
-------------------
:class:`Counters` holds the run's totals (refusals by reason, expiries, admissions, hash and
digest mismatches of activations, exclusions), updated by the same code for live events and for
replay, so a restarted Ledger counts what the one before it counted. :class:`LatencyHistogram`
times each event's ``decide`` and log append in log-spaced buckets: a Ledger that handles
millions of events keeps a few hundred counts, not the samples. Both feed the summary
(``ledger.stats.json``), the live line and ``/metrics``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class LatencyHistogram:
    """Count, sum and quantiles of a stream of durations (s) in fixed memory.

    The Ledger times every event it handles (tens a step, millions over a long job); keeping the
    samples grew its process by ~3 KB a step (two floats in a deque per event, bounded only at
    2^18 each: 16 MiB). Log-spaced buckets, ``2^(1/64)`` apart, hold counts instead: a quantile
    is exact to within 1.1% of its value, at most a few hundred buckets are ever occupied
    (1 ns .. 100 s spans ~2,400), and the count and sum stay exact."""

    PER_OCTAVE = 64

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.min = math.inf
        self.max = -math.inf
        self._buckets: dict[int, int] = {}

    def __len__(self) -> int:
        return self.count

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        self.min = min(self.min, seconds)
        self.max = max(self.max, seconds)
        key = math.floor(math.log2(seconds) * self.PER_OCTAVE) if seconds > 0 else -(1 << 30)
        self._buckets[key] = self._buckets.get(key, 0) + 1

    def quantile(self, q: float) -> float | None:
        """The value of rank ``round(q * (count - 1))`` in sorted order (within 1.1%), clamped
        to the smallest and largest value seen; None when empty."""
        if not self.count:
            return None
        rank = min(self.count - 1, round(q * (self.count - 1)))
        seen = 0
        for key in sorted(self._buckets):
            seen += self._buckets[key]
            if seen > rank:
                if key == -(1 << 30):
                    return max(0.0, self.min)
                mid = float(2.0 ** ((key + 0.5) / self.PER_OCTAVE))
                return min(self.max, max(self.min, mid))
        return self.max


@dataclass
class Counters:
    """Totals over the run, for the summary and the live line."""

    refused: dict[str, int] = field(default_factory=dict)
    expired: int = 0
    released: int = 0
    accepted: int = 0
    hash_mismatches: int = 0
    digest_mismatches: int = 0
    activations: int = 0
    verified: int = 0
    """Results the Trainer recomputed (verified rollouts)."""
    evicted: dict[str, str] = field(default_factory=dict)
    """Actor -> why it was excluded for good (a failed verification's reason, or
    ``REFUSED``: its refused results)."""
