"""Lease-expiry ticks: when a driver must feed ``Tick`` so that expired leases return to the pool.

Theory of operation
-------------------
A lease is expired strictly after its expiry (:mod:`aurora.policy.leases`), so the Ledger needs a
``Tick`` just after each expiry: :meth:`TickTimers.arm` is asked for every ``Assign`` (and, after
a restarted Ledger replays its log, for every live lease) and answers the delay of a new timer,
or None when one is already set for that expiry or it never expires. One timer per distinct
expiry time: a batch's leases share theirs. ``slack_s`` is how long after the expiry the tick
comes: the simulator's clock is exact (1e-6 s), the runtime's timers fire a little early or late
(50 ms). Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import math


class TickTimers:
    """The expiry times a tick is pending for."""

    def __init__(self, slack_s: float) -> None:
        if not (math.isfinite(slack_s) and slack_s > 0):
            raise ValueError(f"slack_s must be > 0 seconds, got {slack_s!r}")
        self.slack_s = slack_s
        """Seconds after an expiry that its tick comes."""
        self.pending: set[float] = set()

    def arm(self, expiry: float, now: float) -> float | None:
        """A lease expires at ``expiry``: the delay (s) of a new timer that feeds ``Tick``, or
        None (one is pending for that time, or the lease never expires)."""
        if expiry in self.pending or not math.isfinite(expiry):
            return None
        self.pending.add(expiry)
        return max(0.0, expiry - now) + self.slack_s

    def fired(self, expiry: float) -> None:
        """The timer armed for ``expiry`` fired (feed ``Tick`` next)."""
        self.pending.discard(expiry)
