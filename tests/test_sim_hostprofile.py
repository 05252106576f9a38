"""The simulator's inputs drawn from a host profile and a configuration alone
(sim/hostprofile.py), from a fixture profile with round numbers."""

from __future__ import annotations

import json

import pytest

from aurora.topology import topology_from_dict
from sim import hostprofile
from sim.config import strategy


def _m(*xs: float) -> dict:
    return {"values": list(xs), "mean": sum(xs) / len(xs), "std": 0.0}


def _entry(density: float, *, scale: float) -> dict:
    return {
        "target_density": density,
        "train_s": _m(0.5, 0.5),
        "extract_s": _m(1.0 * scale, 1.0 * scale),
        "delta_bytes": _m(10e6 * scale),
        "density": _m(density),
        "store_s": _m(0.05),
        "digest_s": _m(0.4),
        "checkpoint_s": _m(0.01),
        "apply_s": _m(0.1 * scale),
        "segments": _m(3.0),
    }


PROFILE = {
    "host": {"cpu_model": "test cpu", "cores": 2, "git_sha": "0" * 40},
    "compute": {
        "qwen3-tiny-shapes": {
            "params": 1000,
            "tensors": 3,
            "dense_bytes": 2000,
            "codec": "aurora",
            "engine_load_s": 0.5,
            "by_density": [_entry(0.01, scale=1.0), _entry(0.03, scale=3.0)],
            "load_before": [0.1, 0.1, 0.1],
            "load_after": [0.2, 0.2, 0.2],
        }
    },
    "emulator": {
        "links": [
            {
                "rate_mbit": 50.0,
                "rtt_ms": 40.0,
                "goodput_mbit_cubic": 47.0,
                "goodput_mbit_bbr": 48.0,
                "one_stream_mbit_transport_buffers": 47.5,
                "payload_share": 0.956,
            },
            {
                "rate_mbit": 250.0,
                "rtt_ms": 150.0,
                "goodput_mbit_cubic": 238.0,
                "goodput_mbit_bbr": 215.0,
                "one_stream_mbit_transport_buffers": 100.0,  # window-limited
                "payload_share": 0.956,
            },
        ],
        "loopback": {"gbps": 10.0},
    },
}


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "host.json"
    path.write_text(json.dumps(PROFILE))
    return hostprofile.load_profile(path)


def _topology(**extra):
    return topology_from_dict(
        {
            "name": "t",
            "trainer": {"region": "us", "model": "qwen3-8b", "gpus": 1},
            "regions": [{"name": "us"}, {"name": "ca"}],
            "links": [{"a": "us", "b": "ca", "gbps": 0.05, "rtt_ms": 40, "loss": 0.01}],
            "actors": [{"region": "ca", "gpu": "A100", "count": 2}],
            "congestion": "cubic",
            "real": {"model": "qwen3-tiny-shapes", "prompts_per_step": 8, "group_size": 2},
            **extra,
        }
    )


def test_the_trace_is_the_profile_at_the_density_and_the_configuration(profile):
    window = (1e6, "test")
    kw = dict(model="qwen3-tiny-shapes", tokens_per_s=40.0, prompts_per_step=8, group_size=2)
    t = hostprofile.profile_traces(profile, density=0.01, actors=2, window=window, **kw)
    m = t.model("run-qwen3-tiny-shapes")
    assert m.delta_bytes_leb128.value == 10e6
    assert m.extract_s.value == 1.0
    assert m.publish_s is not None and m.publish_s.value == pytest.approx(0.05 + 0.4 + 0.01)
    # 8 prompts x 2 completions x 5 tokens in the 0.5 s synthetic step
    assert m.train_tokens_per_s_per_gpu["run-trainer"].value == pytest.approx(80 / 0.5)
    c = t.constants
    assert c.apply_bytes_per_s.value == pytest.approx(10e6 / 0.1)
    assert c.tcp_window_bytes.value == 1e6
    assert c.rollouts_per_actor.value == 8
    assert c.dense_load_bytes_per_s.value == pytest.approx(2000 / 0.5)
    assert c.result_bytes is not None and 100 < c.result_bytes.value < 400
    gpu = t.gpu("run-actor", "run-qwen3-tiny-shapes")
    assert gpu.tokens_per_s["run-qwen3-tiny-shapes"].value == 40.0 and gpu.cv.value == 0.0
    assert t.workload("arithmetic").tokens_per_rollout.value == 5
    assert "test cpu" in m.extract_s.source
    # Between two measured densities: linear in the density.
    mid = hostprofile.profile_traces(profile, density=0.02, actors=2, window=window, **kw)
    mm = mid.model("run-qwen3-tiny-shapes")
    assert mm.delta_bytes_leb128.value == pytest.approx(20e6)
    assert mm.extract_s.value == pytest.approx(2.0)
    with pytest.raises(ValueError, match="outside the measured 0.01-0.03"):
        hostprofile.profile_traces(profile, density=0.05, actors=2, window=window, **kw)
    with pytest.raises(ValueError, match="no compute profile of 'qwen3-0.6b-shapes'"):
        hostprofile.profile_traces(
            profile, density=0.02, actors=2, window=window, **{**kw, "model": "qwen3-0.6b-shapes"}
        )


def test_links_are_payload_rates_of_the_nearest_measured_setting(profile):
    share, source = hostprofile.link_share(profile, 60.0, 50.0)  # nearest: 50 Mbit/s 40 ms
    assert share == pytest.approx(48.0 / 50.0) and "50 Mbit/s 40 ms" in source
    w, why = hostprofile.link_window(profile, 250.0, 150.0)
    assert w == pytest.approx(100e6 / 8 * 0.15) and "window-limited" in why
    w, why = hostprofile.link_window(profile, 50.0, 40.0)
    assert w == 4 << 20 and "no limit" in why
    topo = hostprofile.profile_topology(
        profile,
        _topology(),
        model="qwen3-tiny-shapes",
        actors=[("ca-a100-0", "ca"), ("ca-a100-1", "ca")],
        relays=[("relay-ca", "ca")],
    )
    (link,) = topo.links
    assert link.gbps == pytest.approx(0.05 * 48.0 / 50.0 * (1 - 0.01))
    assert link.loss == 0.01 and link.rtt_ms == 40
    assert topo.congestion == "cubic"
    assert topo.region("ca").lan_gbps == 10.0
    assert [r.id for r in topo.relays] == ["relay-ca"]
    assert topo.actor_ids()[1][0] == "ca-a100-1"


def test_a_profile_config_simulates_the_runtimes_pipeline(profile):
    from experiments.transfer_real import sim_metrics
    from sim.model import simulate

    cfg = hostprofile.profile_config(
        profile,
        _topology(),
        strategy=strategy("aurora"),
        actors=[("ca-a100-0", "ca"), ("ca-a100-1", "ca")],
        relays=[("relay-ca", "ca")],
        density=0.02,
        tokens_per_s=40.0,
        steps=4,
    )
    assert cfg.publish_pipeline == "sequential" and cfg.control_latency and cfg.loss_recovery
    assert cfg.store_local and cfg.batch_rollouts == 16 and cfg.rollouts_per_lease == 2
    got = sim_metrics(simulate(cfg))
    # 20 MB through a 0.05 x 0.96 x 0.99 Gbit/s path takes >= 3.5 s; extraction 2 s overlaps it.
    assert got["transfer_s"] > 20e6 * 8 / (0.05e9 * 0.96 * 0.99)
    assert got["extract_s"] == pytest.approx(2.0)


def test_a_profile_without_its_parts_is_refused(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{}")
    with pytest.raises(ValueError, match="has 'host' and 'compute'"):
        hostprofile.load_profile(path)
    no_emu = dict(PROFILE, emulator=None)
    with pytest.raises(ValueError, match="no emulator measurements"):
        hostprofile.link_share(no_emu, 50.0, 40.0)
