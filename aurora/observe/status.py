"""``aurora status``'s view of a job: a bounded snapshot of the Ledger's state, and its text.

Theory of operation
-------------------
:func:`snapshot` reads a Ledger service (live, when an observer asks, or rebuilt from a finished
run's log) into one JSON-able map: the newest version and batch, Actors by region (count, lives,
largest lag, throughput, leases), the watched Actors one by one (version active and staged, lag,
leases, throughput estimate, stalled, verification state, newest transfer time; bounded like the
metrics, :func:`aurora.observe.ledger.watched_actors`), links (source to region: Actors routed
over it, newest transfer time), relays, the counters, and the newest steps' records. The Ledger
answers an observer's ``status`` with it, made at most every :data:`MIN_INTERVAL_S` (a flood of
requests gets the same map), and the map is the same whether the job runs or has finished.
:func:`render` prints it for a terminal.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from aurora.observe.ledger import OTHER, REGIONS_MAX, folded_regions, watched_actors
from aurora.observe.table import PER_ACTOR_MAX

MIN_INTERVAL_S = 0.5
"""A status request within this of the last snapshot gets that snapshot (s)."""
STEPS_SHOWN = 8
"""Newest steps in a snapshot."""


def snapshot(service: Any, *, per_actor_max: int = PER_ACTOR_MAX) -> dict[str, Any]:
    """The view of ``service`` (a Ledger service with ``metrics``; module docstring)."""
    metrics = service.metrics
    state = service.core.state
    pacer = service.core.pacer
    latest = state.latest
    book = state.book
    trust = state.trust
    regions: dict[str, dict[str, Any]] = {}
    links: dict[tuple[str, str], dict[str, Any]] = {}
    fold = folded_regions(state)
    for rec in state.actors.values():
        region = rec.region if fold is None else fold.get(rec.region, OTHER)
        r = regions.setdefault(
            region,
            {
                "actors": 0,
                "live": 0,
                "lives": Counter(),
                "lag_max": 0,
                "tokens_per_s": 0.0,
                "leases": 0,
            },
        )
        r["actors"] += 1
        r["lives"][rec.life.value] += 1
        if not rec.live:
            continue
        r["live"] += 1
        active = rec.versions.active
        if latest is not None and active is not None:
            r["lag_max"] = max(r["lag_max"], latest - active)
        r["tokens_per_s"] += rec.estimate or 0.0
        held = book.by_actor.get(rec.id)
        r["leases"] += len(held) if held else 0
        link = links.setdefault(
            (rec.source, region),
            {
                "source": rec.source,
                "region": region,
                "actors": 0,
                "version": None,
                "transfer_s": None,
            },
        )
        link["actors"] += 1
        got = metrics.staged.get(rec.id)
        if got is not None and (
            link["version"] is None
            or got[0] > link["version"]
            or (got[0] == link["version"] and got[1] > link["transfer_s"])
        ):
            link["version"], link["transfer_s"] = got
    actors = []
    shown = watched_actors(state, per_actor_max)
    for aid in shown:
        rec = state.actors[aid]
        active = rec.versions.active
        held = book.by_actor.get(aid)
        got = metrics.staged.get(aid)
        actors.append(
            {
                "id": aid,
                "region": rec.region,
                "life": rec.life.value,
                "source": rec.source,
                "active": active,
                "staged": rec.versions.reachable(),
                "lag": (latest - active) if latest is not None and active is not None else None,
                "leases": len(held) if held else 0,
                "tokens_per_s": rec.estimate,
                "stalled": rec.stalled,
                "trust": trust.record(aid).state.value if trust is not None else None,
                "share": metrics.shares.get(aid, 0),
                "transfer_s": got[1] if got is not None else None,
                "transfer_version": got[0] if got is not None else None,
            }
        )
    counters = service.counters
    steps = [{"step": v, **rec} for v, rec in list(metrics.steps.items())[-STEPS_SHOWN:]]
    return {
        "time": float(service.clock()),
        "latest": latest,
        "batch": pacer.requesting if pacer is not None else 0,
        "batches_done": sorted(pacer.done) if pacer is not None else [],
        "steps_total": (service.job.steps if getattr(service, "job", None) else None),
        "finished": bool(getattr(service, "finished", False)),
        "regions": {k: {**v, "lives": dict(v["lives"])} for k, v in sorted(regions.items())},
        "actors_total": sum(1 for r in state.actors.values() if r.live),
        "actors_shown": len(actors),
        "actors": actors,
        "links": sorted(
            sorted(links.values(), key=lambda x: -x["actors"])[:REGIONS_MAX],
            key=lambda x: (x["source"], x["region"]),
        ),
        "relays": dict(sorted(state.relays.items())),
        "leases": {"outstanding": len(book.leased), "pool": book.pool_size},
        "counters": {
            "accepted": counters.accepted,
            "refused": dict(counters.refused),
            "expired": counters.expired,
            "released": counters.released,
            "activations": counters.activations,
            "hash_mismatches": counters.hash_mismatches,
            "verified": counters.verified,
            "evicted": dict(counters.evicted),
        },
        "heldout_reward": dict(metrics.heldout),
        "steps": steps,
    }


class SnapshotCache:
    """The newest snapshot of one service, made again at most every :data:`MIN_INTERVAL_S`, or
    sooner when a version is published, a batch requested or the job finishes (at most once a
    step), so no one is told a job runs after it finished."""

    def __init__(self, service: Any) -> None:
        self.service = service
        self._snap: dict[str, Any] | None = None
        self._at = -1e300
        self._key: tuple[Any, ...] = ()

    def get(self) -> dict[str, Any]:
        now = time.monotonic()
        svc = self.service
        pacer = svc.core.pacer
        key = (svc.core.state.latest, pacer.requesting if pacer else 0, svc.finished)
        if self._snap is None or now - self._at >= MIN_INTERVAL_S or key != self._key:
            self._snap, self._at, self._key = snapshot(svc), now, key
        return self._snap


def _num(x: Any, fmt: str = "{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def render(snap: dict[str, Any]) -> str:
    """``snap`` for a terminal: a header, regions, links, Actors, the newest steps."""
    done = "finished" if snap.get("finished") else "running"
    total = snap.get("steps_total")
    lines = [
        f"v{_num(snap.get('latest'))}"
        + (f" of {total}" if total else "")
        + f"  batch {snap.get('batch')}  {done}  Actors live {snap.get('actors_total')}"
        + f"  leases {snap['leases']['outstanding']} out, {snap['leases']['pool']} waiting",
        "",
        f"{'region':<12} {'live':>5} {'lag max':>7} {'tokens/s':>10} {'leases':>6}  lives",
    ]
    for name, r in snap["regions"].items():
        lives = ", ".join(f"{k} {n}" for k, n in sorted(r["lives"].items()))
        lines.append(
            f"{name:<12} {r['live']:>5} {r['lag_max']:>7} {r['tokens_per_s']:>10,.0f} "
            f"{r['leases']:>6}  {lives}"
        )
    lines += ["", f"{'link':<24} {'Actors':>6} {'version':>7} {'transfer s':>10}"]
    for link in snap["links"]:
        name = f"{link['source']} -> {link['region']}"
        lines.append(
            f"{name:<24} {link['actors']:>6} {_num(link['version']):>7} "
            f"{_num(link['transfer_s'], '{:.3f}'):>10}"
        )
    shown = f"{snap['actors_shown']} of {snap['actors_total']}"
    lines += [
        "",
        f"Actors ({shown}; excluded, stalled and laggards first when not all fit)",
        f"{'actor':<16} {'region':<8} {'life':<11} {'active':>6} {'staged':>6} {'lag':>4} "
        f"{'leases':>6} {'tokens/s':>9} {'share':>5} {'trust':<9} {'stalled':<7}",
    ]
    for a in snap["actors"]:
        lines.append(
            f"{a['id'][:16]:<16} {a['region'][:8]:<8} {a['life']:<11} {_num(a['active']):>6} "
            f"{_num(a['staged']):>6} {_num(a['lag']):>4} {a['leases']:>6} "
            f"{_num(a['tokens_per_s'], '{:,.0f}'):>9} {a['share']:>5} "
            f"{a['trust'] or '-':<9} {'yes' if a['stalled'] else '':<7}"
        )
    c = snap["counters"]
    refused = ", ".join(f"{k} {n}" for k, n in sorted(c["refused"].items())) or "0"
    lines += [
        "",
        f"results admitted {c['accepted']}, refused {refused}; leases expired {c['expired']}, "
        f"released {c['released']}; verified {c['verified']}, excluded "
        f"{len(c['evicted'])}; hash mismatches {c['hash_mismatches']}",
        "",
        f"{'step':>5} {'step s':>8} {'tokens/s':>10} {'delta bytes':>12} {'staleness':>9} "
        f"{'Actors':>6} {'reward':>7}",
    ]
    for s in snap["steps"]:
        lines.append(
            f"{s['step']:>5} {_num(s.get('step_time_s'), '{:.3f}'):>8} "
            f"{_num(s.get('tokens_per_s'), '{:,.0f}'):>10} "
            f"{_num(s.get('delta_bytes'), '{:,.0f}'):>12} "
            f"{_num(s.get('staleness')):>9} {_num(s.get('actors_contributing')):>6} "
            f"{_num(s.get('reward'), '{:.3f}'):>7}"
        )
    return "\n".join(lines)
