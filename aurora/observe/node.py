"""Metrics of one process's own parts: its data-plane node, and an Actor's engine and queue.

Theory of operation
-------------------
Each collector is handed a function that returns the object to read (None until it exists: a
role makes its node only after it joined), and reads it when a scrape asks, on the role's event
loop. Nothing is counted twice: the node's counters are the node's own
(:class:`aurora.transport.config.NodeMetrics`), the Actor's the few it keeps itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from aurora.observe.table import BY_NAME


def _gauge(name: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, BY_NAME[name].help, value=float(value))


def _counter(name: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name[: -len("_total")], BY_NAME[name].help, value=float(value))


class NodeCollector:
    """The data-plane node's counters (Trainer, relay or Actor)."""

    def __init__(self, node: Callable[[], Any]) -> None:
        self.node = node

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        node = self.node()
        if node is None:
            return
        m = node.metrics
        yield _counter("aurora_node_bytes_verified_total", m.bytes_verified)
        yield _counter("aurora_node_source_switches_total", m.source_switches)
        refused = CounterMetricFamily(
            "aurora_node_refused", BY_NAME["aurora_node_refused_total"].help, labels=["kind"]
        )
        for kind, n in sorted(m.refused.items()):
            refused.add_metric([str(kind)], float(n))
        yield refused
        subs = getattr(node, "subscribers", {}) or {}
        yield _gauge(
            "aurora_node_subscribers",
            sum(1 for s in subs.values() if getattr(s, "subscribed", True)),
        )
        yield _gauge("aurora_node_versions_staged", len(getattr(node, "staged", {}) or {}))


class ActorCollector:
    """An Actor process's engine version, queued leases and what it generated."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        a = self.actor
        if a.active is not None:
            yield _gauge("aurora_engine_version", a.active)
        yield _gauge("aurora_engine_queued_leases", sum(len(w.leases) for w in a.queue))
        yield _counter("aurora_engine_tokens_total", a.stats.get("generated", 0))
        yield _counter("aurora_engine_generate_seconds_total", a.stats.get("generate_s", 0.0))
        yield _counter("aurora_engine_activations_total", a.stats.get("activations", 0))
