"""The Ledger's metrics: the job as the Ledger sees it, counted from its own events.

:class:`LedgerMetrics` sits beside a Ledger service and is told, by one line each in the service,
every driver record as it is applied, every event with the actions ``decide`` returned and its
time, and each Trainer connection. The first two run for live events and for a replay of the log
alike, so a restarted Ledger serves the same counts. It keeps only totals and a few bounded
records; everything else is read from the policy state when a scrape asks, on the Ledger's event
loop. Each sample carries the Ledger's clock as its timestamp, so a series can be compared with
the run's event log exactly. Per-Actor series are bounded (:func:`watched_actors`); per-region
aggregates always cover every Actor.
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from aurora.observe.steps import step_record
from aurora.observe.table import BY_NAME, PER_ACTOR_MAX
from aurora.policy.ledger import LIVE

STEPS_KEPT = 16
"""Newest steps whose records are kept (observers are sent each as it is made)."""

PAUSE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Upper bounds of the activation-pause histogram (s)."""

_EVENT_COUNTS = {
    "ActorJoined": "aurora_actor_joins_total",
    "ActorLeft": "aurora_actor_leaves_total",
    "PreemptionNotice": "aurora_actor_preemption_notices_total",
    "ActorLost": "aurora_actors_lost_total",
    "RelayLost": "aurora_relays_lost_total",
}
"""Membership events counted, by the metric that counts them."""


REGIONS_MAX = 64
"""Most regions (and relays, and links) with series of their own. A region is what an Actor's
hello says: a topology names a few, but a certified Actor can say anything, so beyond this many
the regions with the fewest Actors are counted together as :data:`OTHER`."""

OTHER = "(other)"


def folded_regions(state: Any, cap: int = REGIONS_MAX) -> dict[str, str] | None:
    """None when the Actors name at most ``cap`` regions; else region -> itself for the
    ``cap - 1`` with the most Actors (the rest map to :data:`OTHER`)."""
    counts = Counter(rec.region for rec in state.actors.values())
    if len(counts) <= cap:
        return None
    kept = sorted(counts, key=lambda r: (-counts[r], r))[: cap - 1]
    return {r: r for r in kept}


def _top(d: dict[Any, Any], cap: int) -> dict[Any, Any]:
    """``d`` itself, or its ``cap`` entries with the largest values."""
    if len(d) <= cap:
        return d
    return dict(heapq.nlargest(cap, d.items(), key=lambda kv: kv[1]))


def watched_actors(state: Any, cap: int = PER_ACTOR_MAX) -> list[str]:
    """The Actors that get series of their own: every one, by id, when they fit in ``cap``; else
    the ``cap`` most urgent, the most urgent first (excluded, then stalled, then the largest
    lag, then the slowest estimate). Per-region aggregates always cover every Actor, so a scrape
    of 10^4 Actors is a few thousand series, not 10^5."""
    trust = getattr(state, "trust", None)
    excluded = {a for a in state.actors if trust is not None and trust.excluded(a)}
    recs = [r for r in state.actors.values() if r.live or r.id in excluded]
    if len(recs) <= cap:
        return sorted(r.id for r in recs)
    latest = state.latest or 0

    def rank(rec: Any) -> tuple[int, int, int, float, str]:
        active = rec.versions.active
        lag = latest - active if active is not None else latest + 1
        est = rec.estimate if rec.estimate is not None else -1.0
        return (rec.id not in excluded, not rec.stalled, -lag, est, rec.id)

    return [r.id for r in heapq.nsmallest(cap, recs, key=rank)]  # the most urgent first


class LedgerMetrics:
    """Counts of one Ledger and a Prometheus collector over it.

    It is told every driver record as it is applied (``Published``, ``Activation``...), every
    event with the actions ``decide`` returned and its time, and each Trainer connection. It
    keeps only totals, the newest steps' records (:func:`aurora.observe.steps.step_record`, made
    at each publication) and, per Actor, the newest version it staged with the time that took:
    everything else is read from the policy state when a scrape asks (:meth:`collect`, on the
    Ledger's event loop, so the state is never read half changed).

    ``service`` is the Ledger service (:class:`aurora.runtime.ledger.service.LedgerService`):
    read for its ``core``, ``counters``, ``timings``, ``replayed`` and ``clock``."""

    def __init__(self, service: Any, *, per_actor_max: int = PER_ACTOR_MAX) -> None:
        self.service = service
        self.per_actor_max = per_actor_max
        self.published_at: OrderedDict[int, float] = OrderedDict()
        """version -> when the Ledger noted it published (its clock; newest few)."""
        self.extract_start: OrderedDict[int, float] = OrderedDict()
        """version -> when the Trainer started extracting it (its clock; newest few)."""
        self.steps: OrderedDict[int, dict[str, float]] = OrderedDict()
        """version -> its step record (newest :data:`STEPS_KEPT`)."""
        self.last_stats: dict[str, Any] = {}
        self.totals: Counter[str] = Counter()
        self.delta_bytes: int | None = None
        self.dense_bytes: int | None = None
        self.shares: Counter[str] = Counter()
        """Admitted results per Actor in the newest step's batch."""
        self.excluded: OrderedDict[int, int] = OrderedDict()
        """batch -> exclusions from it (newest few)."""
        self.staged: dict[str, tuple[int, float]] = {}
        """Actor -> (newest version it staged, seconds from extraction start to staged)."""
        self.pauses = [0] * (len(PAUSE_BUCKETS_S) + 1)
        self.pause_sum = 0.0
        self.heldout: dict[str, float] = {}
        self._expired_at_step = 0
        self._refused_at_step = 0

    # -- hooks -----------------------------------------------------------------------------

    def driver(self, rec: dict[str, Any]) -> None:
        """A driver record was applied (live or replayed)."""
        kind = rec.get("type")
        if kind == "Published":
            self._published(rec)
        elif kind == "Activation":
            if rec.get("how") == "catch_up":
                self.totals["catch_ups"] += 1
            elif isinstance(rec.get("pause_ms"), int | float):
                s = max(0.0, float(rec["pause_ms"]) / 1e3)
                self.pauses[bisect.bisect_left(PAUSE_BUCKETS_S, s)] += 1
                self.pause_sum += s

    def after(self, event: Any, actions: Iterable[Any], now: float) -> None:
        """``event`` was decided at ``now`` into ``actions`` (live or replayed)."""
        name = type(event).__name__
        counted = _EVENT_COUNTS.get(name)
        if counted is not None:
            self.totals[counted] += 1
        elif name == "DeltaStaged":
            start = self.extract_start.get(event.version)
            if start is not None:
                self.staged[event.actor] = (event.version, max(0.0, now - start))
        pacer = self.service.core.pacer
        for action in actions:
            if type(action).__name__ == "Exclude" and pacer is not None:
                k = pacer.requesting
                self.excluded[k] = self.excluded.get(k, 0) + 1
                while len(self.excluded) > STEPS_KEPT:
                    self.excluded.popitem(last=False)

    def trainer_connected(self) -> None:
        self.totals["trainer_connects"] += 1

    def finished(self, msg: dict[str, Any]) -> None:
        """The Trainer's last word: held-out rewards before and after training."""
        for at in ("first", "last"):
            value = msg.get(f"reward_{at}")
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.heldout[at] = float(value)

    def _published(self, rec: dict[str, Any]) -> None:
        v = int(rec["version"])
        at = float(rec.get("at") or 0.0)
        stats = rec.get("stats") or {}
        self.published_at[v] = at
        t, ext = stats.get("time"), stats.get("extract_s")
        start = float(t) - float(ext or 0.0) if isinstance(t, int | float) else at
        self.extract_start[v] = start
        for d in (self.published_at, self.extract_start):
            while len(d) > STEPS_KEPT:
                d.popitem(last=False)
        if v == 0:
            return
        pacer = self.service.core.pacer
        results = pacer.results.get(v, []) if pacer is not None else []
        self.shares = Counter(a.actor for a in results)
        counters = self.service.counters
        expired, refused = counters.expired, sum(counters.refused.values())
        tokens = int(stats.get("tokens", 0) or 0)
        delta = rec.get("delta_bytes")
        prev = self.published_at.get(v - 1, at)
        step = step_record(
            step=v,
            time_s=at,
            prev_time_s=prev,
            tokens=tokens,
            batch_version=pacer.target.get(v) if pacer is not None else None,
            delta_bytes=delta,
            actors_contributing=len(self.shares),
            actors_excluded=self.excluded.get(v, 0),
            leases_expired=expired - self._expired_at_step,
            results_refused=refused - self._refused_at_step,
            stats=stats,
        )
        self._expired_at_step, self._refused_at_step = expired, refused
        self.steps[v] = step
        while len(self.steps) > STEPS_KEPT:
            self.steps.popitem(last=False)
        self.last_stats = {k: x for k, x in stats.items() if isinstance(x, int | float)}
        self.totals["steps"] += 1
        self.totals["tokens"] += tokens
        if isinstance(delta, int):
            self.delta_bytes = delta
            self.totals["delta_bytes"] += delta
        if isinstance(stats.get("dense_bytes"), int):
            self.dense_bytes = int(stats["dense_bytes"])

    def step(self, version: int) -> dict[str, float]:
        """The step record of ``version`` (empty when not kept)."""
        return dict(self.steps.get(version, {}))

    # -- the collector -----------------------------------------------------------------------

    def describe(self) -> list[Metric]:
        return []  # no description pass: collect() reads live state

    def collect(self) -> Iterator[Metric]:
        svc = self.service
        now = float(svc.clock())
        out = _Families(now)
        state = svc.core.state
        pacer = svc.core.pacer
        latest = state.latest
        counters = svc.counters
        # training
        if latest is not None:
            out.gauge("aurora_version", latest)
        last = self.steps[next(reversed(self.steps))] if self.steps else {}
        for name, key in (
            ("aurora_step_seconds", "step_time_s"),
            ("aurora_step_tokens", "tokens"),
            ("aurora_tokens_per_second", "tokens_per_s"),
            ("aurora_reward", "reward"),
            ("aurora_loss", "loss"),
            ("aurora_kl", "kl"),
            ("aurora_entropy", "entropy"),
            ("aurora_clip_fraction", "clip_fraction"),
            ("aurora_grad_norm", "grad_norm"),
            ("aurora_delta_changed_fraction", "changed_fraction"),
            ("aurora_staleness", "staleness"),
            ("aurora_step_leases_expired", "leases_expired"),
            ("aurora_step_results_refused", "results_refused"),
            ("aurora_step_actors_contributing", "actors_contributing"),
            ("aurora_step_actors_excluded", "actors_excluded"),
        ):
            if key in last:
                out.gauge(name, last[key])
        out.counter("aurora_tokens_total", self.totals["tokens"])
        out.counter("aurora_steps_total", self.totals["steps"])
        for at, value in sorted(self.heldout.items()):
            out.gauge("aurora_heldout_reward", value, at=at)
        if "train_s" in self.last_stats:
            out.gauge("aurora_train_seconds", self.last_stats["train_s"])
        # delta path
        if self.delta_bytes is not None:
            out.gauge("aurora_delta_bytes", self.delta_bytes)
        out.counter("aurora_delta_bytes_total", self.totals["delta_bytes"])
        if self.dense_bytes is not None:
            out.gauge("aurora_delta_dense_bytes", self.dense_bytes)
        if "extract_s" in self.last_stats:
            out.gauge("aurora_extract_seconds", self.last_stats["extract_s"])
        out.histogram("aurora_activation_pause_seconds", self.pauses, self.pause_sum)
        out.counter("aurora_catch_ups_total", self.totals["catch_ups"])
        # scheduling, membership, verification: one pass over every Actor
        book = state.book
        out.gauge("aurora_leases_outstanding", len(book.leased))
        out.gauge("aurora_leases_pool", book.pool_size)
        out.counter("aurora_leases_expired_total", counters.expired)
        out.counter("aurora_leases_released_total", counters.released)
        out.counter("aurora_results_accepted_total", counters.accepted)
        for reason, n in sorted(counters.refused.items()):
            out.counter("aurora_results_refused_total", n, reason=reason)
        if pacer is not None:
            k = pacer.requesting
            out.gauge("aurora_batch", k)
            n = pacer.config.prompts_per_batch
            got = len(pacer.results.get(k, ())) if k not in pacer.done else n
            out.gauge("aurora_batch_completion_ratio", got / n if n else 0.0)
        # One pass over every Actor (10^4 of them at a scrape: kept to dict look-ups).
        by_life: Counter[tuple[str, Any]] = Counter()
        regions: dict[str, list[Any]] = {}  # region -> [min active, tokens/s, leases, shares]
        fanout: Counter[str] = Counter()
        links: dict[tuple[str, str], tuple[int, float]] = {}
        total_shares = sum(self.shares.values())
        relays = set(state.relays) | set(state.region_relay.values())
        held_by, share_of, staged = book.by_actor, self.shares, self.staged
        fold = folded_regions(state)
        for rec in state.actors.values():
            region, aid = rec.region, rec.id
            if fold is not None:
                region = fold.get(region, OTHER)
            by_life[region, rec.life] += 1
            if rec.life not in LIVE:
                continue
            r = regions.get(region)
            if r is None:
                r = regions[region] = [None, 0.0, 0, 0]
            active = rec.versions.active
            if active is not None and (r[0] is None or active < r[0]):
                r[0] = active
            r[1] += rec.estimate or 0.0
            held = held_by.get(aid)
            if held:
                r[2] += len(held)
            r[3] += share_of.get(aid, 0)
            source = rec.source
            if source in relays:
                fanout[source] += 1
            got = staged.get(aid)
            if got is not None:
                have = links.get((source, region))
                if have is None or got > have:
                    links[source, region] = got
        for (region, life), n in sorted(by_life.items(), key=lambda x: (x[0][0], x[0][1].value)):
            out.gauge("aurora_actors", n, region=region, life=life.value)
        for region, (low, tokens_s, held_n, share_n) in sorted(regions.items()):
            lag = latest - low if latest is not None and low is not None else 0
            out.gauge("aurora_region_lag_versions_max", lag, region=region)
            out.gauge("aurora_region_throughput_tokens_per_second", tokens_s, region=region)
            out.gauge("aurora_region_leases", held_n, region=region)
            if total_shares:
                out.gauge("aurora_region_share_ratio", share_n / total_shares, region=region)
        for relay, n in sorted(_top(fanout, REGIONS_MAX).items()):
            out.gauge("aurora_relay_fanout", n, relay=relay)
        for (source, region), (_, secs) in sorted(_top(links, REGIONS_MAX).items()):
            out.gauge("aurora_link_transfer_seconds", secs, source=source, region=region)
        relays_by_region = Counter(state.relays.values())
        for region, n in sorted(relays_by_region.items()):
            out.gauge("aurora_relays", n, region=region)
        trust = state.trust
        for aid in watched_actors(state, self.per_actor_max):
            rec = state.actors[aid]
            active = rec.versions.active
            if active is not None:
                out.gauge("aurora_actor_version_active", active, actor=aid)
                if latest is not None:
                    out.gauge("aurora_actor_lag_versions", latest - active, actor=aid)
                reach = rec.versions.reachable()
                if reach is not None:
                    out.gauge("aurora_actor_version_staged", reach, actor=aid)
            if rec.estimate is not None:
                out.gauge("aurora_actor_throughput_tokens_per_second", rec.estimate, actor=aid)
            held = book.by_actor.get(aid)
            out.gauge("aurora_actor_leases", len(held) if held else 0, actor=aid)
            out.gauge("aurora_actor_stalled", int(rec.stalled), actor=aid)
            if total_shares:
                out.gauge(
                    "aurora_actor_share_ratio", self.shares.get(aid, 0) / total_shares, actor=aid
                )
            got = self.staged.get(aid)
            if got is not None:
                out.gauge("aurora_actor_transfer_seconds", got[1], actor=aid)
            if trust is not None:
                out.gauge("aurora_actor_excluded", int(trust.excluded(aid)), actor=aid)
        for metric in _EVENT_COUNTS.values():
            out.counter(metric, self.totals[metric])
        out.counter("aurora_trainer_connects_total", self.totals["trainer_connects"])
        out.gauge("aurora_ledger_replayed_events", svc.replayed)
        out.counter("aurora_verification_checked_total", counters.verified)
        out.counter("aurora_verification_failed_total", len(counters.evicted))
        if trust is not None:
            by_trust = Counter(r.state.value for r in trust.records.values())
            for st, n in sorted(by_trust.items()):
                out.gauge("aurora_actors_by_trust", n, state=st)
        decide, log = svc.timings["decide"], svc.timings["log"]
        out.counter("aurora_ledger_events_total", decide.count)
        out.counter("aurora_ledger_decide_seconds_total", decide.total)
        out.counter("aurora_ledger_log_seconds_total", log.total)
        yield from out.families()


F = TypeVar("F", GaugeMetricFamily, CounterMetricFamily, HistogramMetricFamily)


class _Families:
    """Metric families of one scrape, each built on first use from the table's row."""

    def __init__(self, now: float) -> None:
        self.now = now
        self._fams: dict[str, Metric] = {}

    def _family(self, name: str, make: type[F], labels: Iterable[str]) -> F:
        fam = self._fams.get(name)
        if fam is None:
            row = BY_NAME[name]
            if tuple(labels) != row.labels:
                raise ValueError(f"{name}: labels {tuple(labels)} are not the table's {row.labels}")
            base = name[: -len("_total")] if row.kind == "counter" else name
            new = self._fams[name] = make(base, row.help, labels=list(row.labels))
            return new
        if not isinstance(fam, make):
            raise TypeError(f"{name} is a {type(fam).__name__}, not a {make.__name__}")
        return fam

    def gauge(self, name: str, value: float, **labels: str) -> None:
        fam = self._family(name, GaugeMetricFamily, labels)
        fam.add_metric(list(labels.values()), float(value), timestamp=self.now)

    def counter(self, name: str, value: float, **labels: str) -> None:
        fam = self._family(name, CounterMetricFamily, labels)
        fam.add_metric(list(labels.values()), float(value), timestamp=self.now)

    def histogram(self, name: str, counts: list[int], total: float) -> None:
        fam = self._family(name, HistogramMetricFamily, ())
        buckets, running = [], 0
        for bound, n in zip([*PAUSE_BUCKETS_S, float("inf")], counts, strict=True):
            running += n
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
        fam.add_metric([], buckets, total, timestamp=self.now)

    def families(self) -> list[Metric]:
        return list(self._fams.values())
