"""The delta path's hop times on real nodes, the roles' loop-lag reports, the emulator's kernel
counters, and the per-hop table built from a run folder (issue 27: the aurora sim-vs-real gap)."""

from __future__ import annotations

import asyncio
import json

import pandas as pd
import pytest

from aurora.runtime import hopreport
from aurora.transport.node import NodeMetrics
from emulation.counters import difference, parse_qdisc_stats, parse_tcp_counters
from experiments import delta_path
from tests.test_transport import _step, _tree, run


def test_every_node_on_the_path_notes_when_a_version_passes_each_hop():
    _old, _new, h0, segments = _step()

    async def main():
        trainer, relay, actors, nodes = await _tree(2, h0=h0)
        await trainer.publish(1, segments)
        for a in actors:
            await a.wait_for(lambda a=a: 1 in a.staged, 10)
        for n in nodes:
            await n.close()
        return trainer, relay, actors

    trainer, relay, actors = run(main())
    t, r = trainer.metrics.hops[1], relay.metrics.hops[1]
    assert t["out_first"] <= t["out_last"]
    assert r["in_first"] <= r["in_last"] <= r["out_last"]
    assert r["out_first"] <= r["out_last"]
    assert t["out_first"] <= r["in_last"]  # the relay has it only after the Trainer sent it
    for a in actors:
        hops = a.metrics.hops[1]
        assert r["out_first"] <= hops["in_last"] <= hops["staged"]
        assert "out_first" not in hops  # an Actor serves nobody here


def test_a_node_keeps_the_hop_times_of_its_newest_versions_only():
    m = NodeMetrics()
    for v in range(200):
        m.hop(v, "in_last")
    assert len(m.hops) == 64 and min(m.hops) == 136
    first = m.hops[199]["in_last"]
    m.hop(199, "in_last")
    assert m.hops[199]["in_last"] == first  # first time only ...
    m.hop(199, "out_last", latest=True)
    again = m.hops[199]["out_last"]
    m.hop(199, "out_last", latest=True)
    assert m.hops[199]["out_last"] >= again  # ... or the latest, for the last byte out


def test_a_version_is_reported_again_only_when_its_hop_times_change():
    m = NodeMetrics()
    seen: dict = {}
    m.hop(1, "in_first")
    (span,) = hopreport.changed_hops(m, seen)
    assert span["activity"] == "delta-path" and span["version"] == 1
    assert span["start"] == span["end"] == span["in_first"]
    assert hopreport.changed_hops(m, seen) == []
    m.hop(1, "in_last")
    (span,) = hopreport.changed_hops(m, seen)
    assert set(span) >= {"in_first", "in_last"}


def test_the_loop_lag_report_sees_a_loop_blocked_by_a_thread_holding_it():
    sent: list[dict] = []

    async def main():
        task = asyncio.create_task(
            hopreport.report(lambda: None, sent.append, tick_s=0.01, interval_s=0.2)
        )
        await asyncio.sleep(0.05)
        import time

        time.sleep(0.15)  # the loop cannot run: every callback waits 150 ms
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    lags = [s for s in sent if s["activity"] == "loop-lag"]
    assert lags and max(s["max_s"] for s in lags) >= 0.1


QDISC = """qdisc htb 1: root refcnt 2 r2q 10 default 0 direct_packets_stat 0 direct_qlen 1000
 Sent 12345 bytes 67 pkt (dropped 3, overlimits 12 requeues 0)
 backlog 0b 0p requeues 0
qdisc bfifo 10: parent 1:10 limit 24224b
 Sent 1200 bytes 10 pkt (dropped 2, overlimits 0 requeues 1)
 backlog 1514b 1p requeues 1
"""

SNMP = """Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens PassiveOpens AttemptFails EstabResets CurrEstab InSegs OutSegs RetransSegs InErrs OutRsts InCsumErrors
Tcp: 1 200 120000 -1 10 5 0 0 2 900 1000 7 0 1 0
TcpExt: SyncookiesSent TCPTimeouts TCPLossProbes TCPSpuriousRTOs
TcpExt: 0 2 5 1
"""  # noqa: E501


def test_the_emulators_qdisc_and_tcp_counters_are_read_from_the_kernels_text():
    q = parse_qdisc_stats(QDISC)
    assert q["10:"] == {
        "kind": "bfifo",
        "sent_bytes": 1200,
        "sent_packets": 10,
        "dropped": 2,
        "overlimits": 0,
        "requeues": 1,
        "backlog_bytes": 1514,
        "backlog_packets": 1,
    }
    assert q["1:"]["dropped"] == 3
    tcp = parse_tcp_counters(SNMP)
    assert tcp["RetransSegs"] == 7 and tcp["OutSegs"] == 1000
    assert tcp["TCPTimeouts"] == 2 and tcp["TCPLossProbes"] == 5
    later = {"a": {"dropped": 5, "backlog_bytes": 0, "kind": "bfifo"}}
    earlier = {"a": {"dropped": 2, "backlog_bytes": 1514, "kind": "bfifo"}}
    assert difference(later, earlier) == {"a": {"dropped": 3, "backlog_bytes": 0, "kind": "bfifo"}}


def test_the_hop_table_of_a_run_folder_splits_the_path_into_consecutive_hops(tmp_path):
    (tmp_path / "trainer").mkdir()
    t0 = 1000.0
    steps, spans, hops, events = [], [], [], []
    for v in range(1, 6):
        s = t0 + 10 * v
        steps.append({"version": v, "stats": {"time": s + 0.01, "extract_s": 0.01}})
        hops.append(
            {
                "activity": "delta-path",
                "version": v,
                "who": "trainer",
                "out_first": s + 0.005,
                "out_last": s + 0.011,
                "start": s,
                "end": s,
            }
        )
        spans.append(
            {
                "activity": "delta-path",
                "version": v,
                "who": "relay-ca",
                "in_first": s + 0.03,
                "in_last": s + 0.08,
                "out_first": s + 0.031,
                "out_last": s + 0.081,
                "start": s,
                "end": s,
            }
        )
        for i, late in enumerate((0.0, 0.004)):
            spans.append(
                {
                    "activity": "delta-path",
                    "version": v,
                    "who": f"ca-a100-{i}",
                    "in_last": s + 0.082 + late,
                    "staged": s + 0.083 + late,
                    "start": s,
                    "end": s,
                }
            )
            events.append(
                {
                    "time": s + 0.103 + late,
                    "kind": "event",
                    "who": f"ca-a100-{i}",
                    "type": "DeltaStaged",
                    "what": "",
                    "record": json.dumps({"actor": f"ca-a100-{i}", "version": v}),
                }
            )
        spans.append(
            {
                "activity": "loop-lag",
                "who": "relay-ca",
                "start": s,
                "end": s + 1,
                "samples": 50,
                "max_s": 0.03,
                "p50_s": 0.001,
                "p99_s": 0.02,
            }
        )
    write = lambda path, rows: path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # noqa: E731
    write(tmp_path / "trainer" / "steps.jsonl", steps)
    write(tmp_path / "trainer" / "hops.jsonl", hops)
    write(tmp_path / "ledger.spans.jsonl", spans)
    pd.DataFrame(events).to_csv(tmp_path / "events.csv", index=False)
    table = delta_path.hop_table(delta_path.path_rows(tmp_path), warmup=2).set_index("hop")
    assert table.loc["trainer_out_last -> relay_in_last", "median_s"] == pytest.approx(0.069)
    # The path ends with the latest Actor (the second, 4 ms later).
    assert table.loc["relay_out_last -> actor_in_last", "median_s"] == pytest.approx(0.005)
    assert table.loc["actor_staged -> ledger_staged", "median_s"] == pytest.approx(0.02)
    assert table.loc["extract_start -> ledger_staged", "median_s"] == pytest.approx(0.107)
    assert table.loc["extract_start -> ledger_staged", "versions"] == 3
    lag = delta_path.loop_lag(tmp_path).set_index("who")
    assert lag.loc["relay-ca", "max_s"] == 0.03 and lag.loc["relay-ca", "samples"] == 250


def test_the_replay_carries_payload_at_the_measured_share_of_each_links_rate():
    from aurora.topology import topology_from_dict
    from aurora.traces import load_traces
    from experiments import sim_vs_real, wire_overhead
    from sim.config import RateSchedule, SimConfig, strategy

    topo = topology_from_dict(wire_overhead.TOPOLOGY, source="test")
    cfg = SimConfig(
        topology=topo,
        traces=load_traces(),
        strategy=strategy("aurora"),
        steps=2,
        rate_schedules=(RateSchedule(link="us-ca", points=((0.0, 1.0), (5.0, 0.5))),),
    )
    slower = sim_vs_real.payload_rate(cfg, 0.956)
    assert [lk.gbps for lk in slower.topology.links] == [pytest.approx(0.956)]
    assert slower.rate_schedules[0].points == ((0.0, pytest.approx(0.956)), (5.0, 0.478))
    assert slower.traces == cfg.traces and slower.strategy == cfg.strategy


def test_the_committed_wire_efficiency_is_a_measurement_near_first_principles():
    got = json.loads(wire_overhead_path().read_text())
    assert got["measurements"] and all(0 < m["efficiency"] < 1 for m in got["measurements"])
    # A 1448-byte MSS in a 1514-byte frame: headers are the only overhead of a bulk transfer.
    assert got["efficiency"] == pytest.approx(1448 / 1514, abs=0.01)


def wire_overhead_path():
    from experiments import wire_overhead

    return wire_overhead.EVIDENCE
