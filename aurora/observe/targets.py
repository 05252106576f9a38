"""Where each role of an ``aurora real --metrics`` run serves ``/metrics``: one port per role,
written for Prometheus's file-based discovery (``RUN/prometheus/targets.json``) with a minimal
``prometheus.yml`` beside it that scrapes them (docs/OBSERVABILITY.md)."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

SCRAPE_INTERVAL = "5s"
"""The written config's scrape interval (the dashboard's rates assume at most 15 s)."""


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def prometheus_config(targets: Path, *, interval: str = SCRAPE_INTERVAL) -> str:
    """A ``prometheus.yml`` that scrapes every target in ``targets`` (file_sd)."""
    return (
        "global:\n"
        f"  scrape_interval: {interval}\n"
        f"  scrape_timeout: {interval}\n"
        "scrape_configs:\n"
        "  - job_name: aurora\n"
        "    file_sd_configs:\n"
        f"      - files: ['{targets}']\n"
        "        refresh_interval: 5s\n"
    )


def write_targets(
    launcher: Any,
    *,
    faults: tuple[Any, ...] = (),
    ports: dict[str, int] | None = None,
    reach: Callable[[str], str] | None = None,
) -> dict[str, int]:
    """Pick a ``/metrics`` port for every process ``launcher`` may start (the Trainer, a
    standalone Ledger, relays, Actors, Actors that join by a fault), write the file_sd targets
    and a ``prometheus.yml``; return role id -> port. Again with the ``ports`` it returned and
    ``reach`` (region -> the address this host reaches it at) once the regions are network
    namespaces (``--emulate``)."""
    host = launcher.run.metrics_host
    local = "127.0.0.1" if host in ("0.0.0.0", "") else host
    trainer_region = launcher.topo.trainer.region
    roles: list[tuple[str, str, str]] = [("trainer", "trainer", trainer_region)]
    if launcher.standalone_ledger:
        roles.append(("ledger", "ledger", trainer_region))
    roles += [(rid, "relay", region) for rid, region in launcher.plan.relays]
    roles += [(a.id, "actor", a.region) for a in launcher.plan.actors]
    roles += [(f.target, "actor", f.region) for f in faults if f.kind == "join"]
    chosen: dict[str, int] = {}
    entries = []
    for pid, role, region in roles:
        if pid in chosen:
            continue
        chosen[pid] = ports[pid] if ports is not None else free_port(local)
        address = reach(region) if reach is not None else local
        entries.append(
            {
                "targets": [f"{address}:{chosen[pid]}"],
                "labels": {"role": role, "id": pid, "region": region},
            }
        )
    folder = Path(launcher.dir) / "prometheus"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "targets.json").write_text(json.dumps(entries, indent=2) + "\n")
    (folder / "prometheus.yml").write_text(prometheus_config(folder.resolve() / "targets.json"))
    return chosen
