"""A delta's path through the real processes, hop by hop, and each role's event-loop lag.

Theory of operation
-------------------
The simulator and a real run disagree on how long a delta takes from the Trainer to the Actors
(``docs/journal/sim-vs-real.md``, "The aurora gap"); an end-to-end interval cannot say where the
time goes. Every data-plane node notes wall-clock times (``time.time()``, s) of each version at
its hops (:attr:`aurora.transport.config.NodeMetrics.hops`: ``in_first``, ``in_last``,
``staged``, ``out_first``, ``out_last``). A role runs :func:`report` beside its work, which sends
those times as ``delta-path`` spans and how late its own short sleeps woke as ``loop-lag`` spans.
``experiments/delta_path.py`` joins them with the Trainer's extraction times and the Ledger's
``DeltaStaged`` events into one row per version and hop. Cost: one wake-up every ``tick_s`` (50
a second by default) and a few small messages a second.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

from aurora.transport.config import NodeMetrics

REPORTS = ("delta-path", "loop-lag")
"""The span activities this module sends (not work: a timeline leaves them out)."""
TICK_S = 0.02
"""How often the lag probe wakes (s): the resolution of the loop-lag samples."""
INTERVAL_S = 1.0
"""How often a role reports (s)."""


def changed_hops(metrics: NodeMetrics, seen: dict[int, dict[str, float]]) -> list[dict[str, Any]]:
    """A ``delta-path`` span for each version whose hop times differ from ``seen`` (which is
    updated), oldest version first."""
    out = []
    for version, times in list(metrics.hops.items()):
        if seen.get(version) != times:
            seen[version] = dict(times)
            # start and end (the first and last hop so far): every reader of the spans file
            # takes a span as an interval.
            span = {"op": "span", "activity": "delta-path", "version": version, **times}
            out.append(span | {"start": min(times.values()), "end": max(times.values())})
    for version in [v for v in seen if v not in metrics.hops]:
        del seen[version]  # forgotten by the node: bounded here too
    return out


def lag_span(lags: list[float], start: float, end: float) -> dict[str, Any]:
    """A ``loop-lag`` span: wake-up lateness (s) over ``[start, end]``, its max, p50, p99 and
    the number of samples."""
    ordered = sorted(lags)
    return {
        "op": "span",
        "activity": "loop-lag",
        "start": start,
        "end": end,
        "samples": len(ordered),
        "max_s": ordered[-1] if ordered else 0.0,
        "p50_s": statistics.median(ordered) if ordered else 0.0,
        "p99_s": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0,
    }


async def report(
    metrics: Callable[[], NodeMetrics | None],
    send: Callable[[dict[str, Any]], None],
    *,
    tick_s: float = TICK_S,
    interval_s: float = INTERVAL_S,
) -> None:
    """Until cancelled: measure this loop's lag every ``tick_s`` and, every ``interval_s``,
    ``send`` the lag span and the delta-path spans that changed. ``metrics`` gives the node's
    metrics (None before the node exists).

    Every ``interval_s`` it sends one ``delta-path`` span per version whose times changed since
    the last report (the latest values: a relay's ``out_last`` moves with each subscriber it
    serves), and one ``loop-lag`` span: how late its own short sleeps woke over the interval. A
    late wake-up is time the event loop could not run a callback: a busy loop, a thread holding
    the GIL (generation and training run in ``to_thread``), or the OS not scheduling the
    process. Actors and relays send the spans to the Ledger, which writes them to
    ``ledger.spans.jsonl`` with the sender's id; the Trainer, whose Ledger session carries no
    spans, appends them to ``trainer/hops.jsonl``."""
    seen: dict[int, dict[str, float]] = {}
    loop = asyncio.get_running_loop()
    lags: list[float] = []
    start = time.time()
    last = loop.time()
    try:
        while True:
            asked = loop.time()
            await asyncio.sleep(tick_s)
            now = loop.time()
            lags.append(max(0.0, now - asked - tick_s))
            if now - last < interval_s:
                continue
            last = now
            wall = time.time()
            send(lag_span(lags, start, wall))
            lags, start = [], wall
            m = metrics()
            if m is not None:
                for span in changed_hops(m, seen):
                    send(span)
    finally:  # cancelled at the end of the role: what changed since the last report
        m = metrics()
        if m is not None:
            for span in changed_hops(m, seen):
                send(span)
