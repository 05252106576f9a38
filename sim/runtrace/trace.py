"""A run's measurements as the simulator's trace (``trace.yaml``), each number with its source.

Theory of operation
-------------------
Every number says which run it was recorded from and how (a mean of how many spans, their
spread), or that the run could not measure it and where the value comes from instead (the
paper's trace). Means leave out the warm-up (:data:`WARMUP_STEPS`), as a comparison does. The
replayed Actors share one GPU type whose rate is what the run's Actors measured, and the Trainer
is one device. Which field is recorded from what: docs/SIMULATOR.md.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from aurora.traces import PAPER, load_traces
from sim.runtrace.measurements import TCP_IP_HEADER_BYTES, mean
from sim.runtrace.run import RunFolderError, RunRecord

WARMUP_STEPS = 2
"""The Trainer's first steps and the generation on v0 (the first batches) are left out of the
rates, times and sizes: they carry one-time costs (allocation, kernel selection, caches) that the
simulator has no notion of, and a comparison leaves these steps out too."""
ACTOR_GPU = "run-actor"
"""GPU type of the replayed Actors: one type, whose rate is what the run's Actors measured."""
TRAINER_GPU = "run-trainer"
"""GPU type of the replayed Trainer (one device: the run's Trainer process)."""


def _q(value: float, source: str) -> dict[str, Any]:
    return {"value": float(value), "source": source}


def _by_version(versions: dict[int, dict[str, Any]], run: str) -> dict[str, Any]:
    """``delta_bytes_by_version``: every published version's delta size, the warm-up's
    included (their larger deltas cross the link too, and the steps after them wait for them),
    when the run recorded one for each of versions 1..last; else nothing (the mean serves)."""
    last = max(versions, default=0)
    sizes: list[float] = []
    for v in range(1, last + 1):
        size = versions.get(v, {}).get("delta_bytes")
        if not size:
            return {}
        sizes.append(float(size))
    if not sizes:
        return {}
    return {
        "delta_bytes_by_version": {
            "values": sizes,
            "source": f"{run}: the bytes of each of its {len(sizes)} published deltas "
            f"(v1-v{last}, {min(sizes):.0f}-{max(sizes):.0f}), in the codec it used",
        }
    }


def _paper_value(path: str) -> float:
    """A number from the paper's trace (for inputs a run cannot measure)."""
    obj: Any = load_traces(PAPER)
    for part in path.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return float(obj.value)


def trace_data(rec: RunRecord, m: dict[str, Any]) -> dict[str, Any]:
    """The run's measurements in the simulator's trace format (YAML-ready)."""
    spec = rec.spec
    run = f"recorded from run {rec.name}"
    model = model_id(rec)
    dense_payload = spec.strategy.payload == "dense"
    versions = m["versions"]
    vs = sorted(versions)
    if len([v for v in vs if v > WARMUP_STEPS]) >= 2:
        vs = [v for v in vs if v > WARMUP_STEPS]  # past the warm-up (module docstring)
    trained = [v for v in vs if versions[v]["train_s"] > 0]
    tokens = sum(versions[v]["tokens"] for v in trained)
    train_s = sum(versions[v]["train_s"] for v in trained)
    extract = [versions[v]["extract_s"] for v in vs]
    publish = [versions[v]["publish_s"] for v in vs]
    deltas = [float(versions[v]["delta_bytes"]) for v in vs if versions[v]["delta_bytes"]]
    dense = [float(versions[v]["dense_bytes"]) for v in vs if versions[v]["dense_bytes"]]
    if not dense:
        raise RunFolderError(f"{rec.path}: no dense_bytes in the Trainer's statistics")
    dense_bytes = mean(dense)
    g = m["generation"]
    codec = spec.strategy.codec or "aurora"
    what_delta = "dense copies in the delta format" if dense_payload else f"{codec}-codec deltas"
    models = {
        model: {
            "params": _q(dense_bytes / 2, f"{run}: dense bf16 bytes / 2"),
            "dense_bytes": _q(dense_bytes, f"{run}: the Trainer's dense_bytes (bf16 weights)"),
            "delta_bytes_leb128": _q(
                mean(deltas),
                f"{run}: mean bytes of its {len(deltas)} published versions ({what_delta}; "
                f"std {statistics.pstdev(deltas):.0f}, {min(deltas):.0f}-{max(deltas):.0f}); "
                "the size in the run's own codec, so codec_bytes_vs_leb128 of that codec is 1",
            ),
            "extract_s": _q(
                mean(extract),
                f"{run}: mean of the Trainer's extract_s over {len(extract)} versions "
                f"(std {statistics.pstdev(extract):.3f} s; "
                + ("encoding a dense copy" if dense_payload else "extracting the delta")
                + ", segments leaving as they are cut)",
            ),
            "publish_s": _q(
                max(mean(publish), 0.0),
                f"{run}: mean seconds from the end of extraction to the Ledger's Published "
                f"(store write, checkpoint, digest, announcement) over {len(publish)} versions "
                f"(std {statistics.pstdev(publish):.3f} s)",
            ),
            **(
                {
                    "dense_payload_bytes": _q(
                        mean(deltas),
                        f"{run}: mean bytes of its {len(deltas)} published dense copies in the "
                        "delta format (what crossed the data plane per version)",
                    )
                }
                if dense_payload
                else {}
            ),
            **({} if dense_payload else _by_version(versions, run)),
            "train_tokens_per_s_per_gpu": {
                TRAINER_GPU: _q(
                    tokens / train_s,
                    f"{run}: {tokens} generated tokens trained in {train_s:.2f} s over "
                    f"{len(trained)} steps (train_s, one Trainer process)",
                )
            },
        }
    }
    rate_stats = g["rate_per_span"]
    per_actor = ", ".join(
        f"{a} {d['tokens_per_s']:.0f} tok/s ({d['spans']} spans, cv "
        f"{d['rate_per_span'].get('std', 0) / max(d['rate_per_span'].get('mean', 1), 1e-9):.2f}, "
        f"{d['tokens_per_rollout']:.2f} tok/rollout)"
        for a, d in m["actors"].items()
    )
    gpus = {
        ACTOR_GPU: {
            "tokens_per_s": {
                model: _q(
                    g["tokens_per_s"],
                    f"{run}: {g['tokens']} tokens generated in {g['seconds']:.2f} s of "
                    f"{rate_stats['n']} generate spans, pooled over the Actors ({per_actor})",
                )
            },
            "cv": _q(
                g["cv"],
                f"{run}: std/mean of the {rate_stats['n']} per-span rates "
                f"({rate_stats.get('min', 0):.0f}-{rate_stats.get('max', 0):.0f} tok/s)",
            ),
            "drift_per_hour": _q(0.0, "not measured: the run is minutes long"),
        }
    }
    workloads = {
        spec.task: {
            "tokens_per_rollout": _q(
                g["tokens_per_rollout"],
                f"{run}: {g['tokens']} generated tokens over {g['rollouts']} rollouts "
                "(results on v1 and later x group size)",
            )
        }
    }
    actors = sum(1 for _ in rec.job["actors"])
    rollouts_per_step = spec.prompts_per_step * spec.group_size
    applied = m["apply"]
    if applied["seconds"] > 0:
        apply_q = _q(
            applied["bytes"] / applied["seconds"],
            f"{run}: {applied['bytes']} bytes applied in {applied['seconds']:.3f} s over "
            f"{applied['n']} apply spans (the Actor's pause to activate a staged version)",
        )
    else:
        apply_q = _q(
            _paper_value("constants.apply_bytes_per_s"),
            "not measured in this run (no apply span): the paper trace's value",
        )
    loads = m["snapshot_loads"]
    load_b = sum(x["bytes"] for x in loads)
    load_s = sum(x["seconds"] for x in loads)
    load_q = (
        _q(
            load_b / load_s,
            f"{run}: {load_b} snapshot bytes loaded in {load_s:.3f} s over "
            f"{len(loads)} catch-up spans (fetch excluded: the span is the load and apply)",
        )
        if load_s > 0
        else _q(
            _paper_value("constants.dense_load_bytes_per_s"),
            "not measured in this run (no catch-up span): the paper trace's value",
        )
    )
    reads = m["store_reads"]
    read_b = sum(x["bytes"] for x in reads)
    read_s = sum(x["seconds"] for x in reads)
    store_q = (
        {
            "store_read_bytes_per_s": _q(
                read_b / read_s,
                f"{run}: {read_b} bytes of {len(reads)} first catch-ups (to v0, before the "
                f"first batch) read from the Checkpoint Store in {read_s:.3f} s (CatchUp to "
                "CaughtUp, less a control round trip and the load span)",
            )
        }
        if read_s > 0
        else {}
    )
    msgs = m["result_messages"]
    if msgs.get("n"):
        store_q["result_bytes"] = _q(
            msgs["mean"],
            f"{run}: mean bytes of its {msgs['n']} result messages on the wire (each payload "
            f"as the Ledger logged it, framed as the Actor sends it, + {TCP_IP_HEADER_BYTES} B "
            f"of IPv4/TCP headers; {msgs['min']}-{msgs['max']} B)",
        )
    if dense_payload:
        serialize_q = _q(
            dense_bytes / mean(extract),
            f"{run}: dense bytes / mean seconds to encode one dense copy ({mean(extract):.3f} s)",
        )
    else:
        serialize_q = _q(
            _paper_value("constants.serialize_bytes_per_s"),
            "not measured (this run published deltas; only dense strategies use it): the paper "
            "trace's value",
        )
    tcp = (rec.emulation or {}).get("tcp") or {}
    wmem = str(tcp.get("tcp_wmem", "")).split()
    window_q = (
        _q(float(wmem[-1]), f"{run}: the emulated regions' tcp_wmem ceiling ({tcp['tcp_wmem']!r})")
        if wmem
        else _q(
            _paper_value("constants.tcp_window_bytes"),
            "not measured (loopback: the window never binds at its RTT): the paper trace's value",
        )
    )
    paper = "from aurora/traces/paper.yaml"
    constants = {
        "rollouts_per_actor": _q(
            rollouts_per_step / actors,
            f"{run}: prompts_per_step x group_size / Actors started "
            f"({spec.prompts_per_step} x {spec.group_size} / {actors})",
        ),
        "codec_bytes_vs_leb128": {
            "leb128": _q(1.0, "definition"),
            codec: _q(1.0, f"{run}: delta_bytes_leb128 holds the run's own {codec} sizes"),
        },
        "rdma_gbps": _q(
            _paper_value("constants.rdma_gbps"), f"not used (no RDMA in a real run): {paper}"
        ),
        "tcp_window_bytes": window_q,
        "mss_bytes": _q(
            1448.0, "1500-byte MTU less IP, TCP and timestamp headers (the veths' MTU)"
        ),
        "apply_bytes_per_s": apply_q,
        "dense_load_bytes_per_s": load_q,
        "trainer_restart_s": _q(
            _paper_value("constants.trainer_restart_s"),
            f"not measured (no trainer_crash in this run): {paper}",
        ),
        "d2h_bytes_per_s_per_gpu": _q(
            _paper_value("constants.d2h_bytes_per_s_per_gpu"),
            "not used: the CPU Trainer's weights are in host memory (its bf16 copy is inside "
            f"extract_s) and replays use the sequential publication pipeline: {paper}",
        ),
        "serialize_bytes_per_s": serialize_q,
        **store_q,
    }
    if dense_payload:
        constants["codec_bytes_vs_leb128"].pop(codec, None)
    return {"models": models, "gpus": gpus, "workloads": workloads, "constants": constants}


def model_id(rec: RunRecord) -> str:
    """The model's id in the replay (``run-<model>``, e.g. ``run-tiny``)."""
    name = rec.spec.model if rec.spec.backend == "rl" else "standin"
    return "run-" + Path(name).name
