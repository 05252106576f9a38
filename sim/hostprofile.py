"""The simulator's inputs for a real configuration, drawn from a host profile and the
configuration alone: never from a run of that configuration.

Theory of operation
-------------------
``benchmarks/host_profile.py`` measures once what this host's runtime costs (per model and
delta density) and what the emulated WAN delivers on a lossless link of each rate and RTT.
:func:`profile_traces` turns that and a configuration into the simulator's trace, and
:func:`profile_config` into a :class:`sim.config.SimConfig` with the runtime's own pipeline.
Each number says where it came from. A profile value at a density between two measured ones is
interpolated linearly in the density; outside the measured range it is refused. This is the
path for predictions made before any run of the configuration (``sim.runtrace`` replays the
inputs recorded from one run)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from aurora.policy.leases import LeaseConfig
from aurora.strategies import Strategy
from aurora.topology import Topology, build, topology_from_dict
from aurora.traces import PAPER, Traces, load_traces
from sim.config import SimConfig

ACTOR_GPU = "run-actor"
TRAINER_GPU = "run-trainer"
MSS_BYTES = 1448.0
TCP_IP_HEADER_BYTES = 52
"""IPv4 (20) + TCP with timestamps (32) bytes per control message segment."""


def load_profile(path: str | Path) -> dict[str, Any]:
    """A host profile (``benchmarks/host_profile.py``'s JSON); ValueError naming the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable host profile: {exc}") from None
    if not isinstance(data, dict) or "compute" not in data or "host" not in data:
        raise ValueError(f"{path}: a host profile has 'host' and 'compute' (see its writer)")
    data["_path"] = str(path)
    return data


def _at_density(entries: list[dict[str, Any]], density: float, key: str, where: str) -> float:
    """The mean of ``key`` at ``density``, linear between the two nearest measured densities."""
    pts = sorted((float(e["target_density"]), float(e[key]["mean"])) for e in entries)
    if not pts:
        raise ValueError(f"{where}: no measurement")
    lo, hi = pts[0][0], pts[-1][0]
    if not (lo - 1e-12 <= density <= hi + 1e-12):
        raise ValueError(
            f"{where}: density {density:g} is outside the measured {lo:g}-{hi:g} "
            "(measure it: benchmarks/host_profile.py --densities)"
        )
    for (d0, v0), (d1, v1) in zip(pts, pts[1:], strict=False):
        if d0 <= density <= d1:
            return v0 if d1 == d0 else v0 + (v1 - v0) * (density - d0) / (d1 - d0)
    return pts[0][1]


def _q(value: float, source: str) -> dict[str, Any]:
    return {"value": float(value), "source": source}


def result_bytes(*, group_size: int, max_new_tokens: int) -> float:
    """Bytes of one result message on the wire, framed as an Actor sends it: the stand-in's
    payload (``StandinEngine.generate``'s msgpack) in ``wire.control``, plus TCP/IP headers."""
    import msgpack

    from aurora.transport import wire

    comp = {"ids": [3] * max_new_tokens, "lp": [-2.6390573296152584] * max_new_tokens}
    payload = msgpack.packb({"prompt": "s10-0", "index": 0, "completions": [comp] * group_size})
    msg = {
        "op": "result",
        "lease": "s10-0",
        "version": 10,
        "weights_hash": "0" * 64,
        "payload": payload,
        "tokens": group_size * max_new_tokens,
    }
    return float(len(wire.control(msg)) + TCP_IP_HEADER_BYTES)


def profile_traces(
    profile: dict[str, Any],
    *,
    model: str,
    density: float,
    tokens_per_s: float,
    prompts_per_step: int,
    group_size: int,
    actors: int,
    window: tuple[float, str],
    task: str = "arithmetic",
    max_new_tokens: int = 5,
) -> Traces:
    """The simulator's trace for a ``shapes`` run of ``model`` at ``density`` on the profiled
    host (see the module docstring).

    The profile holds, per model and delta density: the ``shapes`` Trainer's step, its
    extraction, the store write, the content digest and the checkpoint; an Actor's decode +
    apply. The configuration gives the model and density, the stand-in's generation rate, batch
    and group size.
    """
    where = profile.get("_path", "host profile")
    comp = profile["compute"].get(model)
    if comp is None:
        raise ValueError(
            f"{where}: no compute profile of {model!r} (have {sorted(profile['compute'])})"
        )
    entries = comp["by_density"]

    def at(key: str) -> float:
        return _at_density(entries, density, key, f"{where}: {model} {key}")

    host = profile["host"]
    measured = (
        f"{where}: measured on {host.get('cpu_model', '?')} ({host.get('cores')} cores) at "
        f"{host.get('git_sha', '?')[:10]}, load {comp.get('load_before')}-{comp.get('load_after')}"
    )
    delta = at("delta_bytes")
    extract, train = at("extract_s"), at("train_s")
    publish = at("store_s") + at("digest_s") + at("checkpoint_s")
    apply_s = at("apply_s")
    tokens = prompts_per_step * group_size * max_new_tokens
    dense = float(comp["dense_bytes"])
    load_s = float(comp.get("engine_load_s") or 0.0)
    paper = load_traces(PAPER).constants
    data = {
        "models": {
            f"run-{model}": {
                "params": _q(comp["params"], f"{model}: its shapes ({comp['tensors']} tensors)"),
                "dense_bytes": _q(dense, f"{model}: 2 bytes (bf16) x params"),
                "delta_bytes_leb128": _q(
                    delta,
                    f"{measured}: mean bytes of a {density:g}-density delta in the "
                    f"{comp.get('codec')} codec (the run's own codec, ratio 1)",
                ),
                "extract_s": _q(extract, f"{measured}: the Trainer's extraction (publish)"),
                "publish_s": _q(
                    publish,
                    f"{measured}: store write + content digest + checkpoint after extraction",
                ),
                "train_tokens_per_s_per_gpu": {
                    TRAINER_GPU: _q(
                        tokens / train,
                        f"{measured}: the synthetic step ({train:.3f} s) over the configuration's "
                        f"{tokens} tokens a step",
                    )
                },
            }
        },
        "gpus": {
            ACTOR_GPU: {
                "tokens_per_s": {
                    f"run-{model}": _q(tokens_per_s, "the configuration: the stand-in's rate")
                },
                "cv": _q(0.0, "the stand-in sleeps tokens / rate: no spread"),
                "drift_per_hour": _q(0.0, "none: runs are minutes long"),
            }
        },
        "workloads": {
            task: {
                "tokens_per_rollout": _q(
                    max_new_tokens, "the configuration: the stand-in's tokens a completion"
                )
            }
        },
        "constants": {
            "rollouts_per_actor": _q(
                prompts_per_step * group_size / actors,
                "the configuration: prompts x group size / Actors",
            ),
            "codec_bytes_vs_leb128": {
                "leb128": _q(1.0, "definition"),
                str(comp.get("codec") or "aurora"): _q(
                    1.0, "delta_bytes_leb128 holds this codec's own bytes"
                ),
            },
            "rdma_gbps": _q(paper.rdma_gbps.value, "not used (no RDMA on real processes)"),
            "tcp_window_bytes": _q(window[0], window[1]),
            "mss_bytes": _q(MSS_BYTES, "1500-byte MTU less IP, TCP and timestamp headers"),
            "apply_bytes_per_s": _q(delta / apply_s, f"{measured}: decode + apply of the delta"),
            "dense_load_bytes_per_s": _q(
                dense / load_s if load_s > 0 else paper.dense_load_bytes_per_s.value,
                f"{measured}: an engine loading the weights" if load_s > 0 else "paper trace",
            ),
            "trainer_restart_s": _q(
                paper.trainer_restart_s.value, "not used (no Trainer crash): paper trace"
            ),
            "d2h_bytes_per_s_per_gpu": _q(
                paper.d2h_bytes_per_s_per_gpu.value,
                "not used: the CPU Trainer's copy is inside its extraction (paper trace)",
            ),
            "serialize_bytes_per_s": _q(
                paper.serialize_bytes_per_s.value, "not used: delta strategies (paper trace)"
            ),
            "result_bytes": _q(
                result_bytes(group_size=group_size, max_new_tokens=max_new_tokens),
                "the configuration: a stand-in result framed as sent, + TCP/IP headers",
            ),
        },
    }
    return build(Traces, data, source=f"{where} (sim.hostprofile)")


def _nearest(profile: dict[str, Any], rate_mbit: float, rtt_ms: float) -> dict[str, Any]:
    """The profile's lossless link measurement nearest ``rate_mbit``/``rtt_ms`` (log scale)."""
    links = (profile.get("emulator") or {}).get("links") or []
    if not links:
        raise ValueError(
            f"{profile.get('_path')}: no emulator measurements (benchmarks/host_profile.py "
            "--emulator, as root)"
        )

    def distance(lk: dict[str, Any]) -> float:
        return abs(math.log(lk["rate_mbit"] / rate_mbit)) + abs(math.log(lk["rtt_ms"] / rtt_ms))

    return min(links, key=distance)


def link_window(profile: dict[str, Any], rate_mbit: float, rtt_ms: float) -> tuple[float, str]:
    """One stream's window (bytes) with the data plane's socket buffers, at the profile's
    lossless link nearest ``rate_mbit``/``rtt_ms``: goodput x RTT where one stream could not
    fill it; where it could, at least that and the regions' 4 MiB ceiling."""
    lk = _nearest(profile, rate_mbit, rtt_ms)
    one = float(lk["one_stream_mbit_transport_buffers"])
    window = one * 1e6 / 8 * lk["rtt_ms"] / 1e3
    full = max(lk["goodput_mbit_cubic"], lk["goodput_mbit_bbr"])
    where = f"{profile.get('_path')}: one cubic stream with the transport's socket buffers"
    if one < 0.9 * full:
        return window, (
            f"{where} on a lossless {lk['rate_mbit']:g} Mbit/s {lk['rtt_ms']:g} ms link: "
            f"{one:.1f} Mbit/s x RTT (window-limited)"
        )
    return max(window, float(4 << 20)), (
        f"{where} filled a lossless {lk['rate_mbit']:g} Mbit/s {lk['rtt_ms']:g} ms link: no "
        "limit seen there (at least its BDP and the 4 MiB ceiling)"
    )


def link_share(profile: dict[str, Any], rate_mbit: float, rtt_ms: float) -> tuple[float, str]:
    """Payload per configured bit of a lossless emulated link near ``rate_mbit``/``rtt_ms``
    (the best of cubic's and bbr's 4-stream goodput over the htb rate)."""
    lk = _nearest(profile, rate_mbit, rtt_ms)
    best = max(lk["goodput_mbit_cubic"], lk["goodput_mbit_bbr"])
    return best / lk["rate_mbit"], (
        f"{profile.get('_path')}: lossless {lk['rate_mbit']:g} Mbit/s {lk['rtt_ms']:g} ms link "
        f"delivered {best:.1f} Mbit/s (4 streams, best of cubic and bbr)"
    )


def profile_topology(
    profile: dict[str, Any],
    topology: Topology,
    *,
    model: str,
    actors: list[tuple[str, str]],
    relays: list[tuple[str, str]],
) -> Topology:
    """The deployment as the run starts it (``actors``: (id, region); ``relays``: (id, region),
    as :func:`aurora.runtime.job.plan_processes` plans them), its emulated links as payload
    rates (see :func:`link_share`) and every region's LAN at the host's loopback rate."""
    emu = profile.get("emulator") or {}
    loop = (emu.get("loopback") or {}).get("gbps")
    links = []
    for lk in topology.links:
        share, _ = link_share(profile, lk.gbps * 1e3, lk.rtt_ms)
        keep = share * (1.0 - lk.loss)
        link: dict[str, Any] = {
            "a": lk.a,
            "b": lk.b,
            "gbps": lk.gbps * keep,
            "rtt_ms": lk.rtt_ms,
            "loss": lk.loss,
        }
        if lk.fluctuation is not None:
            fl = lk.fluctuation
            link["fluctuation"] = {
                "low_gbps": fl.low_gbps * keep,
                "high_gbps": fl.high_gbps * keep,
                "period_s": fl.period_s,
            }
        links.append(link)
    groups: dict[tuple[str, str], int] = {}
    for aid, region in actors:
        prefix = aid.rsplit("-", 1)[0]
        groups[(region, prefix)] = groups.get((region, prefix), 0) + 1
    data: dict[str, Any] = {
        "name": topology.name,
        "trainer": {
            "region": topology.trainer.region,
            "model": f"run-{model}",
            "gpu": TRAINER_GPU,
            "gpus": 1,
            "egress_gbps": topology.trainer.egress_gbps,
        },
        "regions": [
            {"name": r.name, "lan_gbps": float(loop) if loop else r.lan_gbps}
            for r in topology.regions
        ],
        "links": links,
        "actors": [
            {"region": region, "gpu": ACTOR_GPU, "count": n, "name": prefix}
            for (region, prefix), n in groups.items()
        ],
        "relays": [{"region": region, "name": rid} for rid, region in relays],
    }
    if topology.congestion is not None:
        data["congestion"] = topology.congestion
    return topology_from_dict(data, source=f"{profile.get('_path')} (sim.hostprofile)")


def profile_config(
    profile: dict[str, Any],
    topology: Topology,
    *,
    strategy: Strategy,
    actors: list[tuple[str, str]],
    relays: list[tuple[str, str]],
    density: float,
    tokens_per_s: float,
    steps: int,
    seed: int = 0,
    max_new_tokens: int = 5,
    record_trace: bool = True,
) -> SimConfig:
    """The simulator configuration predicting a ``shapes`` run of ``topology`` (its ``real:``
    section: model, batch, group size, snapshot interval, lease) on the profiled host.

    The runtime's own pipeline: ``sequential`` publication, ``control_latency``,
    ``loss_recovery``, the Store on the host. What is taken from the configuration alone: the
    links' rates, RTTs and loss (each link's payload rate is its htb rate times the share the
    profile measured on a lossless link at the nearest rate and RTT, times 1 - loss since the
    emulator drops after the bottleneck), the congestion control, streams, relays, cut-through,
    the Actors and regions, the generation rate and tokens.
    """
    real = topology.real
    windows = [link_window(profile, lk.gbps * 1e3, lk.rtt_ms) for lk in topology.links]
    traces = profile_traces(
        profile,
        model=real.model,
        density=density,
        tokens_per_s=tokens_per_s,
        prompts_per_step=real.prompts_per_step,
        group_size=real.group_size,
        actors=len(actors),
        window=min(windows) if windows else (float(4 << 20), "no WAN link"),
        task=real.task,
        max_new_tokens=max_new_tokens,
    )
    topo = profile_topology(profile, topology, model=real.model, actors=actors, relays=relays)
    return SimConfig(
        topology=topo,
        traces=traces,
        strategy=strategy,
        steps=steps,
        seed=seed,
        workload=real.task,
        batch_rollouts=real.prompts_per_step * real.group_size,
        rollouts_per_lease=real.group_size,
        snapshot_interval=real.snapshot_interval,
        lease=LeaseConfig(initial_s=real.lease_initial_s),
        publish_pipeline="sequential",
        control_latency=True,
        loss_recovery=True,
        store_local=True,
        record_trace=record_trace,
    )


__all__ = [
    "load_profile",
    "link_share",
    "link_window",
    "profile_config",
    "profile_topology",
    "profile_traces",
    "result_bytes",
]
