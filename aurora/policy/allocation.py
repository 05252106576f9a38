"""Adaptive job allocation (paper, "Adaptive job allocation"; algorithm 1).

Theory of operation
-------------------
The Trainer splits a batch of ``B`` prompts across the eligible Actors ``E`` in proportion to
their throughput estimates ``tau_a`` (tokens/s) so that all of them finish at about the same
time: ``B_a = floor(B * tau_a / T)`` with ``T = sum(tau_a for a in E)``. The floors leave up to
``|E| - 1`` prompts over; the paper does not say where they go, and dropping them would lose
prompts, so they go one each to the Actors with the largest fractional parts (Hamilton's
largest-remainder method). Ties are broken by the larger estimate, then by the Actor id, so the
split is a pure function of its inputs. Every share is then within 1 of its exact proportional
value and the shares sum to exactly ``B``.

Estimates move by an exponential moving average of the observed tokens/s after each settlement
(:func:`ema_update`); an Actor reports its own tokens/s, and a report counts only as far as its
admitted results show it (:func:`bounded_throughput`: no more tokens than they hold, at most
:data:`THROUGHPUT_SLACK` times the rate at which the Ledger saw them delivered), so a claim of
2^40 tokens in a nanosecond cannot take a batch (with nothing admitted since its last report, a
report may only lower its estimate). An Actor excluded from a step by the version
predicate has its estimate decayed by ``alpha`` (:func:`exclusion_decay`), so a rejoining Actor
starts with a small share and earns it back by demonstrating throughput. An Actor without an
estimate (just joined) gets :func:`prior`: the median of the known estimates, or
:data:`DEFAULT_PRIOR_TOKENS_PER_S` when no Actor has one yet.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

DEFAULT_PRIOR_TOKENS_PER_S = 1000.0
"""Estimate for an Actor when nobody has an estimate yet (tokens/s). Any positive value gives an
even split among brand-new Actors; 1000 tokens/s is the order of one A100 on a 4-8B model."""

DEFAULT_EMA_BETA = 0.3
"""Weight of the newest observation in the EMA (0 < beta <= 1). 0.3 reacts within ~3 settlements
to a throttled GPU while smoothing per-batch noise in generated lengths."""

THROUGHPUT_SLACK = 2.0
"""How much faster than the Ledger saw its admitted results delivered an Actor may claim to
generate. The Ledger's span runs from a lease's claim (or the Actor's previous admitted result,
if later: it was busy until then) to the admission, so it holds the generation and one round
trip: 2 lets the round trip be as long as the generation before an honest claim is cut. A liar
beside an equally fast honest Actor then takes at most 2/3 of a batch, and only by delivering
admitted results that fast."""

DEFAULT_EXCLUSION_ALPHA = 0.5
"""Multiplier applied to an excluded Actor's estimate, once per excluded step (0 < alpha <= 1)."""


def _check_estimate(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(
            f"estimate for Actor {name!r} must be a positive finite number, got {value!r}"
        )


def prior(estimates: Mapping[str, float], default: float = DEFAULT_PRIOR_TOKENS_PER_S) -> float:
    """Estimate (tokens/s) given to an Actor that has none: the median of the known estimates,
    so a newcomer gets a typical share; ``default`` when there are none."""
    known = sorted(estimates.values())
    if not known:
        return default
    mid = len(known) // 2
    return known[mid] if len(known) % 2 else 0.5 * (known[mid - 1] + known[mid])


def split(batch: int, estimates: Mapping[str, float], eligible: Iterable[str]) -> dict[str, int]:
    """Split ``batch`` prompts over the ``eligible`` Actors in proportion to ``estimates``.

    Returns ``{actor: share}`` for every eligible Actor (shares may be 0), summing to exactly
    ``batch`` when any Actor is eligible, and ``{}`` when none is. Actors missing from
    ``estimates`` get :func:`prior`. Raises ``ValueError`` for a negative batch or a
    non-positive / non-finite estimate.
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
        raise ValueError(f"batch must be a non-negative int, got {batch!r}")
    for name, value in estimates.items():
        _check_estimate(name, value)
    actors = sorted(set(eligible))
    if not actors:
        return {}
    # The prior (a median of every known estimate) only if some eligible Actor lacks one.
    fallback = prior(estimates) if any(a not in estimates for a in actors) else 0.0
    tau = [float(estimates.get(a, fallback)) for a in actors]
    total = math.fsum(tau)
    exact = [batch * t / total for t in tau]
    floors = [math.floor(e) for e in exact]
    left = batch - sum(floors)
    assert 0 <= left <= len(actors), (left, len(actors))
    shares = dict(zip(actors, floors, strict=True))
    # Largest remainder first; ties to the faster Actor, then to the smaller id (deterministic):
    # sorted by the last key first, since each sort keeps the order of what it finds equal and
    # ``actors`` is in id order.
    order = sorted(range(len(actors)), key=[-t for t in tau].__getitem__)
    order.sort(key=[f - e for e, f in zip(exact, floors, strict=True)].__getitem__)
    for i in order[:left]:
        shares[actors[i]] += 1
    return shares


def ema_update(estimate: float | None, observed: float, beta: float = DEFAULT_EMA_BETA) -> float:
    """Blend an observed throughput (tokens/s) into an estimate: ``beta*observed + (1-beta)*est``.

    ``estimate=None`` (first observation) returns ``observed``.
    """
    if not (0.0 < beta <= 1.0):
        raise ValueError(f"ema beta must be in (0, 1], got {beta!r}")
    if not (math.isfinite(observed) and observed > 0):
        raise ValueError(f"observed throughput must be a positive finite number, got {observed!r}")
    if estimate is None:
        return float(observed)
    _check_estimate("<estimate>", estimate)
    return beta * observed + (1.0 - beta) * estimate


def bounded_throughput(
    tokens: int,
    seconds: float,
    *,
    shown_tokens: int,
    shown_seconds: float,
    estimate: float | None = None,
    slack: float = THROUGHPUT_SLACK,
) -> tuple[int, float] | None:
    """The ``(tokens, seconds)`` an Actor's throughput report counts for: its claim with at most
    ``shown_tokens`` tokens (those of its results admitted since its previous report) in at
    least ``shown_seconds / slack`` seconds (the span in which the Ledger saw them delivered:
    :data:`THROUGHPUT_SLACK`). With nothing shown (no admitted result since: its leases expired,
    say), the claim counts only if it is no faster than its ``estimate`` (tokens/s): a report
    may always lower an Actor's own share, never raise it unshown. None: not counted."""
    if not (math.isfinite(slack) and slack >= 1.0):
        raise ValueError(f"throughput slack must be a finite number >= 1, got {slack!r}")
    if tokens <= 0 or not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"a throughput report needs tokens, seconds > 0: {tokens!r}, {seconds!r}")
    if shown_tokens <= 0 or not (math.isfinite(shown_seconds) and shown_seconds > 0):
        if estimate is not None and tokens / seconds <= estimate:
            return int(tokens), float(seconds)
        return None
    return min(int(tokens), int(shown_tokens)), max(float(seconds), shown_seconds / slack)


def exclusion_decay(estimate: float, alpha: float = DEFAULT_EXCLUSION_ALPHA) -> float:
    """The estimate of an Actor excluded from a step: ``alpha * estimate``."""
    if not (0.0 < alpha <= 1.0):
        raise ValueError(f"exclusion alpha must be in (0, 1], got {alpha!r}")
    _check_estimate("<estimate>", estimate)
    return alpha * estimate
