"""The step guard: the Trainer takes an optimizer step only if it is finite and not an outlier.

Theory of operation
-------------------
Before every optimizer step the Trainer hands :meth:`StepGuard.judge` the step's loss and its
global gradient L2 norm before clipping. The step is refused when either is not finite, or when
the norm is an outlier against the last ``window`` steps taken: above
``median * max(min_factor, exp(sigmas * s))``, where ``median`` and ``s = 1.4826 * MAD`` are the
median and the robust spread of the logarithms of those norms (:class:`GuardConfig` says why the
log scale). A refused step leaves the window as it was; a taken one enters it. Clipping still
bounds what a taken step does; the guard keeps a step that is nothing but one result's gradient
(or NaN) from being taken at all. The window is part of the Trainer's checkpoint
(:meth:`StepGuard.state`), so a restarted Trainer judges the next step as one that never stopped
would.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, kw_only=True)
class GuardConfig:
    """The step guard's rule: a norm above ``median * max(min_factor, exp(sigmas * s))`` of
    the last ``window`` taken steps' log-norms is an outlier (``s = 1.4826 * MAD``).

    On the log scale because a gradient norm is a positive scale (honest ones spread by factors,
    not by amounts): if the honest log-norms were Gaussian, ``sigmas = 6`` refuses one honest
    step in ~10^9, and ``min_factor`` keeps the bound from closing in on a window of nearly
    equal norms (the tiny model's honest norms at batch 32 x 8 came within 2x of the trailing
    median over 360 steps). Until ``warmup`` steps are in the window only finiteness is
    judged."""

    window: int = 32
    """Recent taken steps whose gradient norms the bound is computed from."""
    warmup: int = 8
    """Taken steps in the window before a norm can be an outlier (only finiteness before)."""
    sigmas: float = 6.0
    """Robust standard deviations of the log-norm above the median that make an outlier."""
    min_factor: float = 10.0
    """The bound is never below this many times the median norm."""

    def __post_init__(self) -> None:
        if not (1 <= self.warmup <= self.window):
            raise ValueError(f"GuardConfig: need 1 <= warmup <= window, got {self!r}")
        if not (math.isfinite(self.sigmas) and self.sigmas > 0):
            raise ValueError(f"GuardConfig.sigmas must be > 0, got {self.sigmas!r}")
        if not (math.isfinite(self.min_factor) and self.min_factor > 1):
            raise ValueError(f"GuardConfig.min_factor must be > 1, got {self.min_factor!r}")


class StepGuard:
    """The window of recent gradient norms and the judgement of the next step."""

    def __init__(self, config: GuardConfig | None) -> None:
        """``config`` None: only a non-finite loss or gradient norm is refused."""
        self.config = config
        self.norms: deque[float] = deque(maxlen=config.window if config else 1)

    def bound(self) -> float | None:
        """The largest gradient norm the next step may have (None: still warming up, or no
        outlier rule)."""
        cfg = self.config
        if cfg is None or len(self.norms) < cfg.warmup:
            return None
        logs = np.log(np.asarray(self.norms, dtype=np.float64))
        med = float(np.median(logs))
        spread = 1.4826 * float(np.median(np.abs(logs - med)))
        return math.exp(med + max(math.log(cfg.min_factor), cfg.sigmas * spread))

    def judge(self, loss: float, grad_norm: float) -> str | None:
        """Why a step with this loss and pre-clip gradient norm must not be taken, or None."""
        if not math.isfinite(loss):
            return f"loss is {loss}"
        if not math.isfinite(grad_norm):
            return f"gradient norm is {grad_norm}"
        bound = self.bound()
        if bound is not None and grad_norm > bound:
            return f"gradient norm {grad_norm:.4g} is an outlier (bound {bound:.4g})"
        return None

    def taken(self, grad_norm: float) -> None:
        """A step with this gradient norm was taken (a zero norm, a step without signal, is
        not a sample of the honest scale and stays out)."""
        if math.isfinite(grad_norm) and grad_norm > 0:
            self.norms.append(float(grad_norm))

    def state(self) -> list[float]:
        return list(self.norms)

    def load_state(self, norms: list[float]) -> None:
        window = self.config.window if self.config else 1
        self.norms = deque((float(x) for x in norms), maxlen=window)
