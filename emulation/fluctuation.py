"""Rate fluctuation of an emulated network's links, on the simulator's schedule and draws.

Theory of operation
-------------------
A fluctuating link gets a new rate at the start and every ``period_s``: a draw in
``[low, high]`` from the simulator's own generator for that link and seed
(:func:`emulation.plan.rate_draws`), so with the same seed both modes see the same sequence.
One thread per fluctuating link changes both directions' htb classes at ``t0 + k x period_s``
(each direction gets the drawn rate; the simulator's link is one resource shared by both) and
records each change on the wall and monotonic clocks. A controller that fails stops and says
why (:meth:`RateFluctuation.errors`) rather than claiming to fluctuate.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

from emulation.commands import batch
from emulation.plan import EmulationError, NetworkPlan, PlanLink, htb_rate, rate_draws


class RateFluctuation:
    """The rate controller of one network's fluctuating links (:meth:`start` once, after the
    htb classes exist; :meth:`stop` before the namespaces go)."""

    def __init__(
        self, plan: NetworkPlan, links: Mapping[int, PlanLink], *, seed: int, scale: float
    ) -> None:
        self.plan = plan
        self.seed = seed
        self.scale = scale
        self._links = links
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._schedule: dict[int, list[dict]] = {}
        self._current_gbps: dict[int, float] = {}
        self._errors: list[str] = []

    def start(self) -> None:
        for index, link in self._links.items():
            if link.fluctuation is None:
                continue
            low, high, period = link.fluctuation
            draws = rate_draws(self.seed, index, low, high)
            first = next(draws)  # the draw for [0, period); the first draw imports numpy
            t0 = time.monotonic()
            self._apply_rate(index, first * self.scale, 0.0, t0)
            t = threading.Thread(
                target=self._fluctuate,
                args=(index, draws, t0, period),
                name=f"aurem-{self.plan.tag}-fluctuation-{index}",
                daemon=True,
            )
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)

    def schedule(self, index: int) -> list[dict]:
        """Rate changes applied so far to link ``index`` (see :meth:`Network.rate_schedule`)."""
        with self._lock:
            return list(self._schedule.get(index, []))

    def wait(self, index: int, count: int, timeout_s: float) -> list[dict] | None:
        """The schedule of link ``index`` once it holds ``count`` changes; None after
        ``timeout_s``."""
        with self._changed:
            if not self._changed.wait_for(
                lambda: len(self._schedule.get(index, [])) >= count, timeout_s
            ):
                return None
            return list(self._schedule[index])

    def current_gbps(self, index: int, default: float) -> float:
        """The rate in force on link ``index`` (``default`` if it does not fluctuate)."""
        return self._current_gbps.get(index, default)

    def errors(self) -> list[str]:
        """Why a controller stopped before :meth:`stop` (empty while all run)."""
        with self._lock:
            return list(self._errors)

    def _fluctuate(self, index: int, draws: Any, t0: float, period: float) -> None:
        k = 1
        while not self._stop.wait(max(t0 + k * period - time.monotonic(), 0.0)):
            try:
                self._apply_rate(index, next(draws) * self.scale, time.monotonic() - t0, t0)
            except EmulationError as exc:
                if not self._stop.is_set():  # never fluctuate no more while claiming to
                    with self._lock:
                        self._errors.append(f"fluctuation of link {index} stopped: {exc}")
                return
            k += 1

    def _apply_rate(self, index: int, gbps: float, t: float, t0: float) -> None:
        lines = []
        for d in self.plan.directions:
            if d.link == index:
                dev = self.plan.region(d.dst).router_if
                lines.append(
                    f"class change dev {dev} parent 1: classid 1:{d.classid:x} htb {htb_rate(gbps)}"
                )
        batch("tc", self.plan.router_namespace, lines)
        with self._changed:
            self._current_gbps[index] = gbps
            self._schedule.setdefault(index, []).append(
                {"t_s": round(t, 4), "gbps": gbps, "unix": time.time(), "monotonic": t0 + t}
            )
            self._changed.notify_all()
