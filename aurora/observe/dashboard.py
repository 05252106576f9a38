"""The Grafana dashboard of the table: one row per group, one panel per metric.

Theory of operation
-------------------
:func:`dashboard` turns :data:`aurora.observe.table.METRICS` into a Grafana dashboard (JSON
model, schema 39): a row per group, a time-series panel per metric, so the dashboard can never
name a series the roles do not serve. A gauge is drawn as it is, a counter as its per-second
rate over a minute, the histogram as its p50 and p99; per-Actor series are keyed by ``actor``,
per-node ones by the ``id`` the scrape targets carry (``RUN/prometheus/targets.json``). The data
source is a variable (``${datasource}``), chosen on import. ``examples/grafana-dashboard.json`` is
its output (``python -m aurora.observe.dashboard > examples/grafana-dashboard.json``); a test
holds the file to the table.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from aurora.observe.table import GROUPS, METRICS, Metric

WIDTH, HEIGHT, PER_ROW = 8, 7, 3
"""Panel size in Grafana's grid (24 wide) and panels per line."""

UNITS = {"seconds": "s", "bytes": "bytes", "ratio": "percentunit", "fraction": "percentunit"}


def _unit(m: Metric) -> str:
    if m.kind == "counter":
        return "Bps" if "bytes" in m.name else "ops"
    for word, unit in UNITS.items():
        if word in m.name:
            return unit
    return "short"


def _targets(m: Metric) -> list[dict[str, Any]]:
    labels = ", ".join(f"{{{{{label}}}}}" for label in m.labels) or (
        "{{id}}" if m.role in ("node", "actor") else m.name
    )
    if m.kind == "histogram":
        return [
            {
                "expr": f"histogram_quantile({q}, sum(rate({m.name}_bucket[5m])) by (le))",
                "legendFormat": f"p{int(q * 100)}",
                "refId": ref,
            }
            for q, ref in ((0.5, "A"), (0.99, "B"))
        ]
    expr = f"rate({m.name}[1m])" if m.kind == "counter" else m.name
    return [{"expr": expr, "legendFormat": labels, "refId": "A"}]


def _panel(m: Metric, pid: int, x: int, y: int) -> dict[str, Any]:
    what = " (per second)" if m.kind == "counter" else ""
    return {
        "id": pid,
        "type": "timeseries",
        "title": m.name.removeprefix("aurora_") + what,
        "description": f"{m.help} [{m.kind}, served by the {m.role}]",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": HEIGHT, "w": WIDTH, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": _unit(m)}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": _targets(m),
    }


def dashboard() -> dict[str, Any]:
    """The dashboard's JSON model (module docstring)."""
    panels: list[dict[str, Any]] = []
    y, pid = 0, 1
    for group in GROUPS:
        rows = [m for m in METRICS if m.group == group]
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": group,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        pid, y = pid + 1, y + 1
        for i, m in enumerate(rows):
            x = (i % PER_ROW) * WIDTH
            if i and i % PER_ROW == 0:
                y += HEIGHT
            panels.append(_panel(m, pid, x, y))
            pid += 1
        y += HEIGHT
    return {
        "title": "AuroraRL job",
        "uid": "aurorarl-job",
        "description": "Every metric of aurora/observe/table.py (docs/OBSERVABILITY.md)",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "tags": ["aurorarl"],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                }
            ]
        },
        "panels": panels,
    }


def main() -> int:
    json.dump(dashboard(), sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
