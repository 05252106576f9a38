"""The simulator: exact traces, determinism, policy parity, analytic checks, faults, configs."""

from __future__ import annotations

import copy
import filecmp
import math
from dataclasses import replace
from pathlib import Path

import pytest
import simpy
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from aurora.policy.core import LedgerCore
from aurora.policy.events import BatchCompleted, BatchRequested
from aurora.policy.ledger import LedgerConfig
from aurora.policy.pacer import PacerConfig
from aurora.topology import load_topology, topology_from_dict
from aurora.traces import PAPER, load_traces
from sim.config import Fault, SimConfig, strategy
from sim.model import Simulation, SimulationStalled, simulate
from sim.network import Network, Resource, tcp_cap
from sim.output import write_result

ROOT = Path(__file__).resolve().parent.parent
GEO = ROOT / "examples" / "geo.yaml"


def q(value: float, source: str = "test") -> dict:
    return {"value": value, "source": source}


def tiny_traces():
    """Round numbers, no noise: every time in a trace can be checked by hand."""
    data = yaml.safe_load(PAPER.read_text())
    data["models"] = {
        "toy": {
            "params": q(1e6),
            "dense_bytes": q(1e8),
            "delta_bytes_leb128": q(1e6),
            "extract_s": q(1.0),
            "train_tokens_per_s_per_gpu": {"H100": q(400)},
        }
    }
    data["gpus"] = {
        "A100": {"tokens_per_s": {"toy": q(1000)}, "cv": q(0), "drift_per_hour": q(0)},
    }
    data["workloads"] = {"toy": {"tokens_per_rollout": q(100)}}
    data["constants"]["rollouts_per_actor"] = q(20)
    data["constants"]["apply_bytes_per_s"] = q(1e8)
    data["constants"]["d2h_bytes_per_s_per_gpu"] = q(1e9)
    data["constants"]["codec_bytes_vs_leb128"]["aurora"] = q(1.0)
    path = Path(__file__).parent / "_tiny_traces.yaml"
    return load_traces_from(data, path)


def load_traces_from(data: dict, path: Path):
    from aurora.topology import build
    from aurora.traces import Traces

    return build(Traces, data, source=str(path))


TINY_TOPOLOGY = {
    "name": "tiny",
    "trainer": {"region": "us", "model": "toy", "gpus": 1, "egress_gbps": 100},
    "regions": [{"name": "us"}, {"name": "ca", "lan_gbps": 100}],
    "links": [{"a": "us", "b": "ca", "gbps": 0.08, "rtt_ms": 20}],
    "actors": [{"region": "ca", "gpu": "A100", "count": 2, "nic_gbps": 8}],
}


def tiny_config(**kw) -> SimConfig:
    base = dict(
        topology=topology_from_dict(TINY_TOPOLOGY),
        traces=tiny_traces(),
        strategy=strategy("aurora"),
        steps=3,
        workload="toy",
        rollouts_per_lease=10,
        segment_bytes=100_000,
    )
    base.update(kw)
    return SimConfig(**base)


# ------------------------------------------------------------------------------------------
# Exact traces
# ------------------------------------------------------------------------------------------


def test_tiny_run_follows_the_exact_event_trace():
    # 2 Actors x 20 rollouts x 100 tokens at 1000 tok/s: every batch takes 2 s per Actor.
    # Training 4000 tokens at 400 tok/s: 10 s; then the Trainer copies its 100 MB of bf16
    # weights to the host at 1 GB/s (0.1 s) before the next step. D_v is 1 MB over a 10 MB/s
    # WAN (+10 ms one-way), extracted beside the next step in 1 s at 1 MB/s, cut-through: the
    # first 0.1 MB segment leaves 0.1 s after publication, the last byte 1.01 s after it
    # (extraction ends at 1.0 s, then 0.1 MB at 10 MB/s), and lands 10 ms later. The relay
    # forwards as segments arrive: its Actor holds v one segment (0.1 MB at 1 GB/s) after the
    # relay. Apply takes 1 MB / 100 MB/s = 10 ms.
    result = simulate(tiny_config())
    assert result.trace == [
        (0, "ca-a100-0", "join on v0"),
        (0, "ca", "relay is ca-a100-0"),
        (0, "ca-a100-1", "join on v0"),
        (0, "trainer", "request batch 1 on v0"),
        (0, "ca-a100-0", "assign 2 on v0"),
        (0, "ca-a100-1", "assign 2 on v0"),
        (2.0, "trainer", "batch 1 complete"),
        (2.0, "trainer", "train step 1"),
        (2.0, "trainer", "request batch 2 on v0"),
        (2.0, "ca-a100-0", "assign 2 on v0"),
        (2.0, "ca-a100-1", "assign 2 on v0"),
        (4.0, "trainer", "batch 2 complete"),
        (12.1, "trainer", "publish v1"),
        (12.1, "trainer", "train step 2"),
        (13.12, "ca-a100-0", "received v1 from trainer"),
        (13.1201, "ca-a100-1", "received v1 from ca-a100-0"),
        (13.1201, "trainer", "request batch 3 on v1"),
        (13.1201, "ca-a100-0", "commit v1"),
        (13.1201, "ca-a100-0", "assign 2 on v1"),
        (13.1201, "ca-a100-1", "commit v1"),
        (13.1201, "ca-a100-1", "assign 2 on v1"),
        (13.1301, "ca-a100-1", "activate v1"),
        (13.1301, "ca-a100-0", "activate v1"),
        (15.1301, "trainer", "batch 3 complete"),
        (22.2, "trainer", "publish v2"),
        (22.2, "trainer", "train step 3"),
        (23.22, "ca-a100-0", "received v2 from trainer"),
        (23.2201, "ca-a100-1", "received v2 from ca-a100-0"),
        (32.3, "trainer", "publish v3"),
    ]


def test_same_seed_gives_byte_identical_output(tmp_path):
    cfg = geo_config("aurora", steps=6, seed=7)
    a = write_result(simulate(cfg), cfg, tmp_path / "a")
    b = write_result(simulate(cfg), cfg, tmp_path / "b")
    for name in ("steps.csv", "events.csv", "timeline.csv", "summary.json"):
        assert filecmp.cmp(a / name, b / name, shallow=False), name
    c = simulate(replace(cfg, seed=8))
    assert c.rows != simulate(cfg).rows  # the seed matters (throughput noise, link rate)


def test_replaying_the_fed_events_through_the_core_gives_the_same_actions_and_requests():
    cfg = SimConfig(
        topology=load_topology(GEO),
        traces=load_traces(),
        strategy=strategy("aurora"),
        steps=8,
        faults=(
            Fault(kind="preempt", target="ca-a100-3", at_step=3),
            Fault(kind="join", target="new-1", region="ca", gpu="A100", at_step=5),
        ),
    )
    sim = Simulation(cfg)
    result = sim.run()
    core = LedgerCore(
        LedgerConfig(trainer_region="us", max_lag=1, relays=True),
        PacerConfig(
            steps=8,
            prompts_per_batch=sim.prompts_per_batch,
            staging_grace_s=cfg.strategy.staging_grace_s,
            prompt_prefix="s",
        ),
    )
    replayed = []
    requests = 0
    for now, event in result.fed:
        if isinstance(event, BatchRequested):
            # The pacer, asked when the batch was requested, requests exactly it.
            assert core.poll(now) == event, (now, event)
            requests += 1
        replayed.append(core.feed(event, now=now))
    assert replayed == result.decisions
    assert len(result.fed) > 500 and requests == 8
    completed = [a.batch for acts in replayed for a in acts if isinstance(a, BatchCompleted)]
    assert completed == list(range(1, 9))


# ------------------------------------------------------------------------------------------
# Network model
# ------------------------------------------------------------------------------------------


def _run_flows(specs):
    env = simpy.Environment()
    net = Network(env)
    done = {}
    for name, size, path, kw in specs:
        net.start(name, size, path, on_done=lambda f: done.__setitem__(f.label, env.now), **kw)
    env.run()
    return done


def test_single_transfer_over_a_constant_link_takes_bytes_over_rate_plus_half_an_rtt():
    link = Resource("wan", 1e9 / 8)  # 1 Gbit/s
    rtt = 0.040
    done = _run_flows([("d", 202e6, (link,), {"latency": rtt / 2})])
    expected = 202e6 / (1e9 / 8) + rtt / 2
    assert done["d"] == pytest.approx(expected, rel=0.01)
    assert link.carried == pytest.approx(202e6)


def test_two_flows_share_a_bottleneck_fairly_and_the_survivor_speeds_up():
    link = Resource("wan", 100.0)
    done = _run_flows([("a", 100.0, (link,), {}), ("b", 300.0, (link,), {})])
    # Both at 50 B/s until a finishes at 2 s; b then has 200 B left at 100 B/s.
    assert done == {"a": pytest.approx(2.0), "b": pytest.approx(4.0)}


def test_a_capped_flow_leaves_its_unused_share_to_the_others():
    link = Resource("wan", 100.0)
    done = _run_flows([("slow", 100.0, (link,), {"cap": 10.0}), ("fast", 90.0, (link,), {})])
    assert done["fast"] == pytest.approx(1.0)  # 90 B/s: the slow flow only takes 10
    assert done["slow"] == pytest.approx(10.0)


def test_parallel_streams_beat_one_stream_on_a_lossy_long_rtt_path():
    kw = dict(rtt_s=0.040, loss=1e-6, window_bytes=4 << 20, mss_bytes=1448)
    one, four = tcp_cap(streams=1, **kw), tcp_cap(streams=4, **kw)
    assert four == pytest.approx(4 * one)
    link = Resource("wan", 0.75e9 / 8)
    t1 = _run_flows([("x", 202e6, (link,), {"cap": one})])["x"]
    link = Resource("wan", 0.75e9 / 8)
    t4 = _run_flows([("x", 202e6, (link,), {"cap": four})])["x"]
    assert t4 < t1 / 1.5  # one stream is loss-limited well below the link
    assert t4 == pytest.approx(202e6 / (0.75e9 / 8))  # four streams fill the link
    assert tcp_cap(streams=1, rtt_s=0.04, loss=0, window_bytes=4e6, mss_bytes=1448) == 1e8


# ------------------------------------------------------------------------------------------
# Model behaviour
# ------------------------------------------------------------------------------------------


def geo_config(name="aurora", steps=12, **kw) -> SimConfig:
    return SimConfig(
        topology=load_topology(GEO),
        traces=load_traces(),
        strategy=strategy(name),
        steps=steps,
        **kw,
    )


def test_n_actors_behind_a_relay_cost_one_cross_region_transfer_per_step():
    relay = simulate(geo_config("aurora"))
    direct = simulate(geo_config("aurora-norelay"))
    delta = load_traces().delta_bytes("qwen3-8b", "aurora")
    for row in relay.rows[1:]:
        assert row["wan_bytes"] == pytest.approx(delta, rel=1e-6)
    for row in direct.rows[1:]:
        assert row["wan_bytes"] == pytest.approx(8 * delta, rel=1e-6)


def test_with_no_faults_no_prompt_expires_or_is_refused():
    for name in ("aurora", "prime-full", "prime-async4", "aurora-norelay"):
        result = simulate(geo_config(name))
        assert all(r["expired"] == 0 and r["refused"] == 0 for r in result.rows), name
        assert all(r["staleness"] <= strategy(name).max_lag for r in result.rows), name


def test_strategies_rank_as_the_transfer_costs_say():
    t = {
        n: simulate(geo_config(n)).summary()["tokens_per_s"]
        for n in ("aurora", "prime-full", "prime-async2", "prime-multistream", "ideal-singledc")
    }
    assert t["ideal-singledc"] >= t["aurora"] > t["prime-multistream"] > t["prime-full"]
    assert t["prime-async2"] > t["prime-full"]


def test_a_preempted_actors_leases_return_and_survivors_keep_generating():
    cfg = geo_config(
        "aurora", steps=8, faults=(Fault(kind="preempt", target="ca-a100-2", at_s=150.0),)
    )
    result = simulate(cfg)
    lost_at = [t for t, who, what in result.trace if who == "ca-a100-2" and what == "lost"]
    assert lost_at == [150.0]  # in the middle of batch 3 (121 s to 177 s)
    expired = [(t, who) for t, who, what in result.trace if what.startswith("expired")]
    assert expired and all(who == "ca-a100-2" for _, who in expired)
    # The expired prompts were leased again to survivors at the expiry tick.
    t_exp = expired[0][0]
    reassigned = [who for t, who, what in result.trace if t == t_exp and what.startswith("assign")]
    assert reassigned and "ca-a100-2" not in reassigned
    # Survivors never stopped: their generation spans cover the run without waiting for the
    # lost Actor (each survivor starts a new batch within a second of the batch request).
    requests = [t for t, who, what in result.trace if what.startswith("request batch")]
    for survivor in ("ca-a100-0", "ca-a100-5"):
        starts = sorted(
            s["start"]
            for s in result.timeline
            if s["who"] == survivor and s["activity"] == "generate"
        )
        for t in requests[1:]:
            assert any(t <= s <= t + 1.0 for s in starts), (survivor, t)
    assert len(result.rows) == 8


def test_a_joining_actor_catches_up_from_a_snapshot_and_gets_work():
    cfg = geo_config(
        "aurora",
        steps=10,
        faults=(Fault(kind="join", target="new-1", region="ca", gpu="A100", at_step=4),),
    )
    result = simulate(cfg)
    mine = [what for _, who, what in result.trace if who == "new-1"]
    assert mine[0] == "join on nothing"
    assert any(w.startswith("catch up to") and "snapshot v0" in w for w in mine)
    assert any(w.startswith("caught up to") for w in mine)
    assert any(w.startswith("assign") for w in mine)


def test_relay_loss_mid_run_falls_back_and_the_run_completes():
    for name in ("aurora", "prime-full"):
        cfg = geo_config(
            name, steps=6, faults=(Fault(kind="relay_fail", target="ca-a100-0", at_s=130.0),)
        )
        result = simulate(cfg)
        assert len(result.rows) == 6
        assert any("fall back" in what for _, _, what in result.trace), name


def test_trainer_crash_delays_training_by_the_restart_time():
    base = simulate(geo_config("aurora", steps=6))
    crashed = simulate(
        geo_config("aurora", steps=6, faults=(Fault(kind="trainer_crash", at_s=50.0),))
    )
    restart = load_traces().constants.trainer_restart_s.value
    assert crashed.sim_time > base.sim_time + restart * 0.5
    assert any(what == "restarted" for _, _, what in crashed.trace)


def test_losing_every_actor_stops_with_a_clear_error():
    cfg = geo_config("aurora", steps=6, faults=(Fault(kind="region_loss", target="ca", at_step=3),))
    with pytest.raises(SimulationStalled, match="live Actors none"):
        simulate(cfg)


def test_spot_hazard_preempts_and_returning_actors_rejoin():
    topo = yaml.safe_load(GEO.read_text())
    topo["actors"][0]["spot"] = True
    cfg = SimConfig(
        topology=topology_from_dict(topo),
        traces=load_traces(),
        strategy=strategy("aurora"),
        steps=30,
        spot_hazard_per_hour=2.0,
        spot_return_s=300.0,
    )
    result = simulate(cfg)
    assert any(what == "left" for _, _, what in result.trace)
    assert any(what == "join on nothing" for _, _, what in result.trace)
    assert len(result.rows) == 30


# ------------------------------------------------------------------------------------------
# Configuration errors
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["trainer"].pop("gpus"), "trainer.gpus: required field is missing"),
        (lambda d: d["trainer"].update(gpus="four"), "trainer.gpus: expected an integer"),
        (lambda d: d["links"][0].update(gbps=-1), "links[0]: gbps must be > 0"),
        (lambda d: d["links"][0].update(loss=2), "links[0]: loss must be a probability"),
        (lambda d: d["actors"][0].update(region="mars"), "actors[0].region: unknown region 'mars'"),
        (lambda d: d["actors"][0].update(colour="red"), "actors[0]: unknown field(s) ['colour']"),
        (lambda d: d.pop("links"), "no link between the Trainer's region 'us' and 'ca'"),
        (lambda d: d["regions"].append({"name": "us"}), "duplicate region names ['us']"),
    ],
)
def test_a_bad_topology_names_the_file_and_the_field(tmp_path, edit, message):
    data = yaml.safe_load(GEO.read_text())
    edit(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError) as err:
        load_topology(path)
    assert str(path) in str(err.value)
    assert message in str(err.value)


def test_a_topology_that_is_not_yaml_or_missing_is_a_value_error(tmp_path):
    (tmp_path / "x.yaml").write_text("a: [1, 2\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_topology(tmp_path / "x.yaml")
    with pytest.raises(ValueError, match="cannot read topology file"):
        load_topology(tmp_path / "missing.yaml")


def test_every_trace_number_has_a_source_and_results_are_not_inputs():
    traces = load_traces()
    rows = traces.sources()
    assert len(rows) > 30
    assert all(src.strip() for _, _, src in rows)
    data = yaml.safe_load(PAPER.read_text())
    data["models"]["qwen3-8b"]["extract_s"] = {"value": 5.0, "source": " "}
    with pytest.raises(ValueError, match="models.qwen3-8b.extract_s: source must say"):
        load_traces_from(data, Path("x.yaml"))
    data["models"]["qwen3-8b"]["extract_s"] = 5.0
    with pytest.raises(ValueError, match="extract_s: expected a mapping for Quantity"):
        load_traces_from(data, Path("x.yaml"))


def test_a_config_naming_an_unknown_gpu_or_strategy_fails_before_simulating():
    topo = yaml.safe_load(GEO.read_text())
    topo["actors"][0]["gpu"] = "TPUv9"
    with pytest.raises(ValueError, match=r"actors\[0\].gpu: unknown GPU type 'TPUv9'"):
        SimConfig(
            topology=topology_from_dict(topo),
            traces=load_traces(),
            strategy=strategy("aurora"),
            steps=1,
        )
    with pytest.raises(ValueError, match="unknown strategy 'fastest'"):
        strategy("fastest")
    with pytest.raises(ValueError, match="set exactly one of at_s and at_step"):
        Fault(kind="preempt", target="a")


def test_simulation_state_is_independent_between_runs():
    cfg = geo_config("aurora", steps=4)
    a = Simulation(cfg).run()
    b = Simulation(copy.deepcopy(cfg)).run()
    assert a.rows == b.rows and math.isfinite(a.sim_time)


_KINDS = ["preempt", "preempt_notice", "leave", "join", "relay_fail", "trainer_crash", "link_cut"]


@settings(max_examples=60, deadline=None)
@given(
    strategy_name=st.sampled_from(["aurora", "aurora-norelay", "prime-async2"]),
    faults=st.lists(
        st.tuples(st.sampled_from(_KINDS), st.integers(0, 7), st.floats(5, 600)),
        max_size=4,
    ),
    seed=st.integers(0, 3),
)
def test_random_fault_schedules_finish_and_never_lose_a_prompt(strategy_name, faults, seed):
    schedule = []
    for i, (kind, who, at) in enumerate(faults):
        target = "" if kind == "trainer_crash" else f"ca-a100-{who}"
        if kind == "join":
            schedule.append(Fault(kind="join", target=f"new-{i}", region="ca", gpu="A100", at_s=at))
        elif kind == "link_cut":
            schedule.append(Fault(kind=kind, target="us-ca", at_s=at, duration_s=10 + 5 * who))
        else:
            schedule.append(Fault(kind=kind, target=target, at_s=at))
    cfg = geo_config(
        strategy_name,
        steps=6,
        seed=seed,
        faults=tuple(schedule),
        record_trace=False,
        stall_after_s=3_600.0,
    )
    sim = Simulation(cfg)
    result = sim.run()  # at most 4 of 8 Actors go: the run must finish, never stall
    sim.ledger.book.check()  # every prompt in exactly one place: pool, leased or settled once
    assert len(result.rows) == 6
    assert all(r["staleness"] <= strategy(strategy_name).max_lag for r in result.rows)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.text(min_size=0, max_size=8),
        st.integers(min_value=-(2**70), max_value=2**70),
        max_size=12,
    )
)
def test_rows_by_actor_are_json_dumps(values):
    """A step row's per-Actor columns are written as ``json.dumps(..., sort_keys=True)`` would
    write them, for any key (escapes, non-ASCII) and any int, with the key cache warm or cold."""
    import json

    from sim.recorder import Recorder

    rec = Recorder.__new__(Recorder)
    rec._json_keys = {}
    for _ in range(2):
        assert rec._by_actor(values, sorted(values)) == json.dumps(values, sort_keys=True)
