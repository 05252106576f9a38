"""The metrics' table, the step series, the Ledger's counts and the /metrics server, in-process.

Runs on real processes (a scrape of every role, ``aurora status``, TensorBoard files of ``aurora
sim`` and ``aurora real``) are in ``tests/test_observe_runtime.py``; the real Prometheus server is
in ``tests/test_prometheus.py``.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from aurora.observe import table
from aurora.observe.exporter import MAX_CONNECTIONS, MetricsServer, registry
from aurora.observe.ledger import watched_actors
from aurora.observe.status import render, snapshot
from aurora.observe.steps import from_sim_row, step_record
from aurora.policy.events import ActorJoined, ActorLost, DeltaStaged
from tests.test_control_identity import SPEC
from tests.test_memory_bounds import Clock, _ledger, _publish, _run_versions

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"^aurora_[a-z0-9_]+$")


def test_every_metric_is_named_once_and_follows_prometheus_conventions():
    names = [m.name for m in table.METRICS]
    assert len(names) == len(set(names))
    for m in table.METRICS:
        assert NAME.match(m.name), m.name
        assert m.kind in ("counter", "gauge", "histogram"), m
        assert m.name.endswith("_total") == (m.kind == "counter"), m.name
        assert m.group in table.GROUPS and m.role in ("ledger", "node", "actor"), m
        assert set(m.modes) <= {"sim", "real"} and "real" in m.modes, m
        assert all(re.match(r"^[a-z_]+$", label) for label in m.labels), m
        assert m.help and not m.help.endswith("."), m
    steps = [m.step for m in table.METRICS if m.step is not None]
    assert len(steps) == len(set(steps)) and set(steps) == set(table.STEP_FIELDS)
    # Each group of the issue has series in it.
    assert {m.group for m in table.METRICS} == set(table.GROUPS)


def test_the_docs_page_prints_the_table_as_the_code_names_it():
    page = (ROOT / "docs" / "OBSERVABILITY.md").read_text()
    assert table.markdown() in page


def test_a_step_record_defines_each_series_once_and_the_simulators_rows_go_through_it():
    rec = step_record(
        step=5,
        time_s=110.0,
        prev_time_s=100.0,
        tokens=2000,
        batch_version=3,
        delta_bytes=1234,
        actors_contributing=4,
        actors_excluded=1,
        leases_expired=2,
        results_refused=3,
        stats={"reward": 0.5, "clip_frac": 0.1, "density": 0.02, "loss": float("nan"), "x": 1},
    )
    assert rec == {
        "step_time_s": 10.0,
        "tokens": 2000.0,
        "tokens_per_s": 200.0,
        "staleness": 1.0,
        "delta_bytes": 1234.0,
        "actors_contributing": 4.0,
        "actors_excluded": 1.0,
        "leases_expired": 2.0,
        "results_refused": 3.0,
        "reward": 0.5,
        "clip_fraction": 0.1,
        "changed_fraction": 0.02,
    }
    row = {
        "step": 5,
        "time_s": 110.0,
        "step_time_s": 10.0,
        "tokens": 2000,
        "batch_version": 3,
        "delta_bytes": 1234,
        "shares": json.dumps({"a": 1, "b": 2, "c": 3, "d": 4}),
        "excluded": json.dumps(["e"]),
        "expired": 2,
        "refused": 3,
    }
    sim = from_sim_row(row)
    assert sim == {k: v for k, v in rec.items() if k in sim}
    assert set(rec) - set(sim) == {"reward", "clip_fraction", "changed_fraction"}
    assert {f"{table.BY_NAME[m].group}/{f}" for m, f in _fields().items() if f in sim} == (
        table.tags("sim")
    )


def _fields() -> dict[str, str]:
    return {m.name: m.step for m in table.METRICS if m.step is not None}


def _ledger_run(tmp_path, versions: int = 6):
    clock = Clock()

    async def run():
        svc = _ledger(str(tmp_path / "ledger.db"), clock)
        spec = {**SPEC, "prompts_per_step": 4}
        svc.note({"type": "Job", "steps": 10**6, "prompts_per_batch": 4, "spec": spec})
        _publish(svc, 0)
        for a in ("a1", "a2"):
            svc.feed(ActorJoined(actor=a, region="us", active=0))
        _run_versions(svc, clock, 1, versions)
        return svc

    return asyncio.run(run()), clock


def parse(body: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def test_the_ledgers_counts_match_its_state_and_survive_a_restart(tmp_path):
    svc, clock = _ledger_run(tmp_path)
    got = parse(_expose(svc.metrics))
    assert got["aurora_version", ()] == 6
    assert got["aurora_steps_total", ()] == 6
    assert got["aurora_delta_bytes", ()] == 1000
    assert got["aurora_delta_bytes_total", ()] == 6000
    assert got["aurora_step_seconds", ()] == pytest.approx(1.0)  # the test's clock: 1 s a step
    assert got["aurora_results_accepted_total", ()] == svc.counters.accepted
    assert got["aurora_actor_lag_versions", (("actor", "a1"),)] == 0
    assert got["aurora_actors", (("life", "ready"), ("region", "us"))] == 2
    assert got["aurora_step_actors_contributing", ()] >= 1
    # Every sample carries the Ledger's clock as its timestamp (ms).
    text = _expose(svc.metrics).decode()
    assert f" {int(clock.now * 1000)}\n" in text
    # A restarted Ledger replays its log into the same counts.
    again = _ledger(str(tmp_path / "ledger.db"), clock)
    again.replay()
    assert again.metrics.totals == svc.metrics.totals
    assert again.metrics.steps == svc.metrics.steps
    this_life = {m.name.removesuffix("_total") for m in table.METRICS if m.group == "process"}
    this_life |= {"aurora_ledger_replayed_events"}

    def lasting(samples):
        return {k: v for k, v in samples.items() if k[0].removesuffix("_total") not in this_life}

    again_got = parse(_expose(again.metrics))
    assert lasting(again_got) == lasting(got)
    assert again_got["aurora_ledger_replayed_events", ()] > 0


def _expose(collector) -> bytes:
    from prometheus_client.exposition import generate_latest

    return generate_latest(registry([collector], process=False))


def ten_thousand_actors(
    n: int = 10_000, per_actor_max: int = table.PER_ACTOR_MAX, regions: int = 10
):
    """A Ledger (log in memory, no job: nothing is paced) with ``n`` Actors in 10 regions, three
    versions published; all but the last 10 v Actors stage and activate each version v."""
    from aurora.policy.events import DeltaPublished, VersionActivated

    clock = Clock()

    async def run():
        svc = _ledger(":memory:", clock)
        svc.metrics.per_actor_max = per_actor_max

        def publish(v: int) -> None:
            clock.now += 1.0
            rec = {"type": "Published", "version": v, "weights_hash": f"h{v}", "at": clock.now}
            svc.note(rec | {"delta_bytes": 1000 if v else None, "stats": {"tokens": 100}})
            bytes_ = 1000 if v else None
            svc.feed(
                DeltaPublished(
                    version=v,
                    weights_hash=f"h{v}",
                    delta_bytes=bytes_,
                    snapshot_bytes=None if v else 5000,
                )
            )

        publish(0)
        for i in range(n):
            svc.feed(ActorJoined(actor=f"a{i:05d}", region=f"r{i % regions}", active=0))
        for v in (1, 2, 3):
            publish(v)
            for i in range(n - 10 * v):
                svc.feed(DeltaStaged(actor=f"a{i:05d}", version=v))
                svc.feed(VersionActivated(actor=f"a{i:05d}", version=v))
        svc.feed(ActorLost(actor="a00000"))
        return svc

    return asyncio.run(run())


def test_per_actor_series_stay_bounded_at_ten_thousand_actors():
    """At most PER_ACTOR_MAX Actors get series, the laggards first; the regions still count
    every Actor."""
    n = 10_000
    svc = ten_thousand_actors(n)
    got = parse(_expose(svc.metrics))
    per_actor = {dict(k[1])["actor"] for k in got if "actor" in dict(k[1])}
    assert len(per_actor) == table.PER_ACTOR_MAX
    assert per_actor == set(watched_actors(svc.state))
    laggards = {f"a{i:05d}" for i in range(n - 30, n)}
    assert laggards <= per_actor
    assert got["aurora_actor_lag_versions", (("actor", f"a{n - 1:05d}"),)] == 3
    regions = {dict(k[1])["region"] for k in got if k[0] == "aurora_region_leases"}
    assert regions == {f"r{i}" for i in range(10)}
    assert sum(v for k, v in got.items() if k[0] == "aurora_actors") == n
    assert got["aurora_region_lag_versions_max", (("region", "r9"),)] == 3
    assert len(got) < 20 * table.PER_ACTOR_MAX  # not 10^5 series
    snap = snapshot(svc)
    assert snap["actors_total"] == n - 1 and snap["actors_shown"] == table.PER_ACTOR_MAX
    assert f"Actors (64 of {n - 1}" in render(snap)


def test_watched_actors_puts_excluded_then_stalled_then_laggards_first():
    from aurora.policy.ledger import ActorRecord, LedgerConfig, initial_state
    from aurora.policy.membership import ActorLife
    from aurora.policy.staging import ActorVersions

    state = initial_state(LedgerConfig(trainer_region="us"))
    state.latest = 10
    for i in range(100):
        rec = ActorRecord(
            id=f"a{i:03d}", region="us", life=ActorLife.READY, versions=ActorVersions(10)
        )
        state.actors[rec.id] = rec
    state.actors["a050"].stalled = True
    state.actors["a070"].versions = ActorVersions(4)
    state.actors["a080"].versions = ActorVersions(7)
    state.actors["a090"].estimate = 1.0
    state.actors["a091"].estimate = 2.0
    for rec in state.actors.values():
        if rec.id not in ("a090", "a091"):
            rec.estimate = 100.0
    assert watched_actors(state, cap=5) == ["a050", "a070", "a080", "a090", "a091"]
    assert len(watched_actors(state, cap=200)) == 100


def test_the_metrics_server_serves_get_metrics_only_and_bounds_its_clients():
    class One:
        def describe(self):
            return []

        def collect(self):
            from prometheus_client.core import GaugeMetricFamily

            yield GaugeMetricFamily("aurora_version", "newest version", value=7)

    async def main() -> None:
        server = MetricsServer(registry([One()]))
        port = await server.start("127.0.0.1", 0)

        async def ask(raw: bytes) -> bytes:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(raw)
            await w.drain()
            data = await asyncio.wait_for(r.read(), 5)
            w.close()
            return data

        ok = await ask(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert ok.startswith(b"HTTP/1.1 200") and b"aurora_version 7.0" in ok
        assert b"process_resident_memory_bytes" in ok  # the process collector comes along
        assert (await ask(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")).startswith(b"HTTP/1.1 404")
        post = b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
        assert (await ask(post)).startswith(b"HTTP/1.1 405")
        assert (await ask(b"garbage\r\n\r\n")).startswith(b"HTTP/1.1 400")
        huge = b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n"
        assert (await ask(huge)).startswith(b"HTTP/1.1 400")
        head = await ask(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"aurora_version" not in head
        # Idle connections beyond the cap are closed unanswered; the server still answers after.
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(MAX_CONNECTIONS)]
        await asyncio.sleep(0.1)
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            refused = await asyncio.wait_for(r.read(), 5)
        except ConnectionResetError:
            refused = b""
        assert refused == b""  # closed unanswered
        w.close()
        for _, iw in idle:
            iw.close()
        await asyncio.sleep(0.1)
        assert (await ask(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")).startswith(b"HTTP/1.1 200")
        # A flood of scrapes makes one exposition per MIN_INTERVAL_S, not one per request.
        before = server.scrapes
        for _ in range(20):
            await ask(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert server.scrapes - before <= 3
        await server.close()

    asyncio.run(main())


def test_the_shipped_grafana_dashboard_is_the_tables_and_draws_every_metric():
    from aurora.observe.dashboard import dashboard

    shipped = json.loads((ROOT / "examples" / "grafana-dashboard.json").read_text())
    assert shipped == dashboard(), "regenerate: python -m aurora.observe.dashboard > examples/..."
    exprs = [t["expr"] for p in shipped["panels"] for t in p.get("targets", [])]
    for m in table.METRICS:
        assert any(re.search(rf"\b{m.name}(_bucket)?\b", e) for e in exprs), m.name
    rows = [p["title"] for p in shipped["panels"] if p["type"] == "row"]
    assert rows == list(table.GROUPS)


def test_regions_an_actor_names_in_its_hello_stay_bounded_too():
    """A certified Actor says its own region: 500 Actors naming 500 regions give at most
    REGIONS_MAX region series, the smallest counted together, and a snapshot that fits a
    message."""
    import msgpack

    from aurora.observe.ledger import OTHER, REGIONS_MAX

    svc = ten_thousand_actors(500, regions=500)
    got = parse(_expose(svc.metrics))
    regions = {dict(k[1])["region"] for k in got if k[0] == "aurora_region_leases"}
    assert len(regions) <= REGIONS_MAX and OTHER in regions
    assert sum(v for k, v in got.items() if k[0] == "aurora_actors") == 500
    assert len({k for k in got if "region" in dict(k[1])}) < 10 * REGIONS_MAX
    snap = snapshot(svc)
    assert len(snap["regions"]) <= REGIONS_MAX and len(snap["links"]) <= REGIONS_MAX
    assert len(msgpack.packb(snap)) < 64 << 10
