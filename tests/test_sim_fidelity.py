"""The audit's checks of the simulator (issue 17): costs come from the inputs, not from the
structure of the model; more resources never hurt."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from aurora.topology import topology_from_dict
from aurora.traces import load_traces
from sim.config import SimConfig, strategy
from sim.model import simulate

GEO = Path(__file__).resolve().parent.parent / "examples" / "geo.yaml"


def _geo(**edits) -> dict:
    data = yaml.safe_load(GEO.read_text())
    for key, value in edits.items():
        data[key] = value
    return data


def _tokens_per_s(data: dict, name: str, steps: int = 10) -> float:
    cfg = SimConfig(
        topology=topology_from_dict(data),
        traces=load_traces(),
        strategy=strategy(name),
        steps=steps,
        record_trace=False,
    )
    return simulate(cfg).summary()["tokens_per_s"]


def test_the_trainers_step_is_its_training_plus_the_copy_of_its_weights_to_the_host():
    # Extraction (5 s) runs on the host copy beside the next step: it does not lengthen it.
    traces = load_traces()
    m = traces.model("qwen3-8b")
    train_s = 8 * 512 * 308 / (4 * m.train_tokens_per_s_per_gpu["H100"].value)
    copy_s = m.dense_bytes.value / (4 * traces.constants.d2h_bytes_per_s_per_gpu.value)
    cfg = SimConfig(
        topology=topology_from_dict(_geo()), traces=traces, strategy=strategy("aurora"), steps=8
    )
    rows = simulate(cfg).rows
    for row in rows[2:]:
        assert row["step_time_s"] == pytest.approx(train_s + copy_s, rel=1e-6)


def test_with_no_latency_and_unlimited_bandwidth_every_strategy_is_within_2pct_of_ideal():
    fast = _geo(
        trainer=dict(_geo()["trainer"], egress_gbps=1e6),
        links=[{"a": "us", "b": "ca", "gbps": 1e6, "rtt_ms": 1e-6, "loss": 0.0}],
        actors=[dict(_geo()["actors"][0], nic_gbps=1e6)],
    )
    ideal = _tokens_per_s(fast, "ideal-singledc")
    for name in (
        "aurora",
        "aurora-leb128",
        "aurora-1stream",
        "aurora-norelay",
        "aurora-nocut",
        "prime-full",
        "prime-async2",
        "prime-async4",
        "prime-multistream",
    ):
        assert _tokens_per_s(fast, name) == pytest.approx(ideal, rel=0.02), name


@pytest.mark.parametrize("name", ["aurora", "prime-full", "prime-async2"])
def test_more_bandwidth_actors_or_trainer_gpus_never_hurt(name):
    base = _geo(links=[{"a": "us", "b": "ca", "gbps": 0.5, "rtt_ms": 40, "loss": 1e-6}])
    t0 = _tokens_per_s(base, name, steps=8)
    wider = _geo(links=[{"a": "us", "b": "ca", "gbps": 2.0, "rtt_ms": 40, "loss": 1e-6}])
    more_actors = dict(base, actors=[dict(base["actors"][0], count=12)])
    more_gpus = dict(base, trainer=dict(base["trainer"], gpus=8))
    for variant in (wider, more_actors, more_gpus):
        # Per-batch throughput noise (cv 5%) is drawn per Actor and batch: 1% of slack.
        assert _tokens_per_s(variant, name, steps=8) >= t0 * 0.99
