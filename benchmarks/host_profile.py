"""This host's profile: the rates the simulator needs to predict a real run here, measured once,
apart from any run they predict.

    python benchmarks/host_profile.py                     # compute (0.6B shapes)
    python benchmarks/host_profile.py --emulator          # root: also the emulated links
    python benchmarks/host_profile.py --models qwen3-0.6b-shapes,qwen3-1.7b-shapes

Writes ``evidence/host_profile/<host>.json`` (``--out``), which ``sim.hostprofile`` turns into
the simulator's inputs for a configuration. Everything runs in this process, one thread (the
runtime's roles run one torch thread each), on the code the runtime runs: per model and density
the runtime's costs (:func:`compute`), the pieces separately per byte (:func:`pieces`), and with
``--emulator`` what the emulated WAN delivers (:func:`emulator`). The machine's load average
before and after each part is recorded beside it."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

EVIDENCE = ROOT / "evidence" / "host_profile"
DENSITIES = (0.01, 0.02, 0.03)
"""Shares of bf16 elements changed per step: the transfer regime's 1-3%."""
LINKS = (
    (50.0, 40.0),
    (50.0, 150.0),
    (100.0, 40.0),
    (100.0, 150.0),
    (250.0, 40.0),
    (250.0, 150.0),
)
"""(Mbit/s, RTT ms) of the emulated links measured (the fidelity experiment's settings)."""
TRANSPORT_BUFFER = 8 << 20
"""``TransportConfig.buffer_bytes``: what the data plane asks of SO_SNDBUF / SO_RCVBUF."""


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def host() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                flags = " ".join(f for f in ("avx2", "avx512f", "avx512bw") if f in have)
                break
    except OSError:
        pass
    mem = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    from aurora.provenance import git_sha

    return {
        "hostname": socket.gethostname(),
        "cpu_model": cpu,
        "cpu_flags": flags,
        "cores": os.cpu_count(),
        "memory_bytes": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "git_sha": git_sha(),
        "unix": time.time(),
    }


def _stats(xs: list[float]) -> dict[str, Any]:
    return {
        "values": xs,
        "mean": statistics.fmean(xs),
        "std": statistics.pstdev(xs) if len(xs) > 1 else 0.0,
    }


def compute(model: str, densities: tuple[float, ...], repeats: int) -> dict[str, Any]:
    """The runtime's own steps at ``model``'s size (see the module docstring).

    Per model and density: the ``shapes`` Trainer's synthetic step (``train``), its extraction
    and encoding of the delta (``publish``, segments as the data plane gets them), the store
    write of the delta with its signed announcement (``CheckpointStore.publish_delta``), the
    content digest of the weights, the Trainer's checkpoint, and an Actor's decode + in-place
    apply of the delta (the activation pause); ``--repeats`` steps each, so each number has its
    spread.
    """
    import torch

    torch.set_num_threads(1)
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from aurora.delta import read_delta, warm_up, weights_hash
    from aurora.delta.synthetic import lr_for_density
    from aurora.runtime.job import make_spec
    from aurora.runtime.shapes import ShapesEngine, ShapesTrainer, dense_bytes, model_shapes
    from aurora.store.checkpoint import CheckpointStore
    from aurora.topology import topology_from_dict

    topo = topology_from_dict(
        {
            "name": "host-profile",
            "trainer": {"region": "us", "model": "qwen3-8b", "gpus": 1},
            "regions": [{"name": "us"}],
            "actors": [{"region": "us", "gpu": "A100"}],
            "real": {"model": model, "regime": "transfer"},
        },
        source="host_profile",
    )
    key = Ed25519PrivateKey.generate()
    signing = key.private_bytes_raw()
    public = key.public_key().public_bytes_raw()
    load0 = loadavg()
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        spec = make_spec(topo, strategy="aurora", seed=0, steps=1, store=tmp, backend="shapes")
        trainer = ShapesTrainer(spec)
        init_s = time.perf_counter() - t
        engine = ShapesEngine(spec)
        t = time.perf_counter()
        engine.load(trainer.published(), version=0, weights_hash=trainer.weights_hash)
        load_s = time.perf_counter() - t
        warm_up()
        store = CheckpointStore(tmp, job=spec.job_id, public_key=public)
        # One step unrecorded: the first one pays one-time costs (page faults of the fresh
        # master, the codec's first compile), which a run's warm-up versions carry instead.
        trainer.train([])
        warm = trainer.publish(lambda seg: None)
        engine.apply(read_delta(warm.data))
        out: dict[str, Any] = {
            "params": sum(int(np.prod(s)) for s in model_shapes(model).values()),
            "tensors": len(model_shapes(model)),
            "dense_bytes": dense_bytes(model),
            "codec": spec.strategy.codec,
            "segment_bytes": spec.segment_bytes,
            "trainer_init_s": init_s,
            "engine_load_s": load_s,
            "by_density": [],
        }
        for density in densities:
            trainer.density, trainer.lr = density, lr_for_density(density)
            got: dict[str, list[float]] = {
                k: []
                for k in (
                    "train_s",
                    "extract_s",
                    "delta_bytes",
                    "density",
                    "store_s",
                    "digest_s",
                    "checkpoint_s",
                    "apply_s",
                    "segments",
                )
            }
            for _ in range(repeats):
                t0 = time.perf_counter()
                trainer.train([])
                t1 = time.perf_counter()
                segs: list[int] = []
                pub = trainer.publish(lambda seg, segs=segs: segs.append(len(seg.data)))
                t2 = time.perf_counter()
                store.publish_delta(pub.data, signing_key=signing)
                t3 = time.perf_counter()
                digest = trainer.digest()
                t4 = time.perf_counter()
                trainer.save(f"{tmp}/ckpt.npz")
                t5 = time.perf_counter()
                delta = read_delta(pub.data)
                engine.apply(delta)
                t6 = time.perf_counter()
                assert engine.weights_hash == trainer.weights_hash and digest
                got["train_s"].append(t1 - t0)
                got["extract_s"].append(t2 - t1)
                got["delta_bytes"].append(float(len(pub.data)))
                got["density"].append(pub.changed / pub.total)
                got["store_s"].append(t3 - t2)
                got["digest_s"].append(t4 - t3)
                got["checkpoint_s"].append(t5 - t4)
                got["apply_s"].append(t6 - t5)
                got["segments"].append(float(len(segs)))
                print(
                    f"host_profile: {model} density {density:.3f}: train {t1 - t0:.2f} s, "
                    f"extract {t2 - t1:.2f} s ({len(pub.data) / 1e6:.1f} MB), store "
                    f"{t3 - t2:.2f} s, digest {t4 - t3:.2f} s, apply {t6 - t5:.2f} s",
                    flush=True,
                )
            out["by_density"].append(
                {"target_density": density, **{k: _stats(v) for k, v in got.items()}}
            )
        out["rates"] = pieces(trainer.published(), pub.data, weights_hash)
    out["load_before"], out["load_after"] = load0, loadavg()
    return out


def pieces(weights: Any, delta_bytes: bytes, weights_hash: Any) -> dict[str, Any]:
    """Bytes per second of each piece on its own, one core: the scan of two bf16 copies for
    changed elements, the codec's encode of one tensor's changes, BLAKE3, decode + apply.

    Per byte: scanning two bf16 copies for changes, the codec's encode, BLAKE3, decode + apply.
    """
    from aurora.delta import H, apply_delta, read_delta
    from aurora.delta.writer import encode_delta

    names = sorted(weights, key=lambda n: -weights[n].size)[:8]
    old = {n: weights[n] for n in names}
    rng = np.random.default_rng(0)
    new = {}
    for n in names:
        flat = old[n].reshape(-1).copy()
        pick = rng.random(flat.size) < 0.02
        flat[pick] ^= np.uint16(1)
        new[n] = flat.reshape(old[n].shape)
    dense = sum(a.nbytes for a in old.values())
    t = time.perf_counter()
    for n in names:
        np.flatnonzero(old[n].reshape(-1) != new[n].reshape(-1))
    scan_s = time.perf_counter() - t
    t = time.perf_counter()
    data = encode_delta(old, new, model="profile", version=1, base_hash="0" * 64)
    encode_s = time.perf_counter() - t
    t = time.perf_counter()
    H(delta_bytes)
    hash_delta_s = time.perf_counter() - t
    t = time.perf_counter()
    weights_hash(old)
    hash_dense_s = time.perf_counter() - t
    state = {n: a.copy() for n, a in old.items()}
    t = time.perf_counter()
    apply_delta(read_delta(data), state, active_version=0, active_hash="0" * 64)
    apply_s = time.perf_counter() - t
    return {
        "tensors": names,
        "dense_bytes": dense,
        "delta_bytes": len(data),
        "scan_dense_bytes_per_s": dense / scan_s,
        "encode_dense_bytes_per_s": dense / encode_s,
        "blake3_bytes_per_s": len(delta_bytes) / hash_delta_s,
        "weights_hash_dense_bytes_per_s": dense / hash_dense_s,
        "decode_apply_delta_bytes_per_s": len(data) / apply_s,
    }


def emulator(seconds: float) -> dict[str, Any]:
    """What the emulated WAN delivers on lossless links (see the module docstring).

    Root only: what the emulated WAN delivers on a lossless link at each rate and RTT the
    fidelity experiment uses (4 streams, cubic and bbr), the payload share of the htb rate, one
    stream's window with the transport's socket buffers, and the loopback inside a region.
    """
    from aurora.topology import topology_from_dict
    from emulation.measure import payload_efficiency
    from emulation.network import build_network
    from sim.runtrace.loopback import probe_loopback

    out: dict[str, Any] = {"links": [], "load_before": loadavg()}
    for mbit, rtt in LINKS:
        topo = topology_from_dict(
            {
                "name": "host-profile",
                "trainer": {"region": "us", "model": "m", "gpus": 1},
                "regions": [{"name": "us"}, {"name": "ca"}],
                "links": [{"a": "us", "b": "ca", "gbps": mbit / 1e3, "rtt_ms": rtt}],
                "actors": [{"region": "ca", "gpu": "A100"}],
            },
            source="host_profile",
        )
        with build_network(topo, verify=False, tcp_window_bytes=4 << 20) as net:
            row: dict[str, Any] = {"rate_mbit": mbit, "rtt_ms": rtt, "load_before": loadavg()}
            row["rtt_measured_ms"] = statistics.median(
                net.ping("us", "ca", count=20, interval_s=0.02)["rtt_ms"]
            )
            for cc in ("cubic", "bbr"):
                got = net.tcp("us", "ca", streams=4, seconds=seconds, cc=cc, skip_fraction=0.3)
                row[f"goodput_mbit_{cc}"] = got["gbps"] * 1e3
            eff = payload_efficiency(net, "us", "ca", streams=4, seconds=min(seconds, 4.0))
            row["payload_share"] = eff["efficiency"]
            one = net.tcp(
                "us",
                "ca",
                streams=1,
                seconds=seconds,
                cc="cubic",
                skip_fraction=0.3,
                buffer_bytes=TRANSPORT_BUFFER,
            )
            row["one_stream_mbit_transport_buffers"] = one["gbps"] * 1e3
            row["one_stream_window_bytes"] = one["gbps"] * 1e9 / 8 * rtt / 1e3
            row["mechanism"] = net.describe()["links"][0]["mechanism"]
            row["load_after"] = loadavg()
            print(f"host_profile: link {mbit:g} Mbit/s {rtt:g} ms: {row}", flush=True)
            out["links"].append(row)
    out["loopback"] = probe_loopback()
    out["load_after"] = loadavg()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--models", default="qwen3-0.6b-shapes")
    p.add_argument("--densities", default=",".join(str(d) for d in DENSITIES))
    p.add_argument("--repeats", type=int, default=3, help="steps per density")
    p.add_argument("--emulator", action="store_true", help="also the emulated links (root)")
    p.add_argument("--emulator-only", action="store_true", help="only the emulated links")
    p.add_argument("--seconds", type=float, default=8.0, help="per emulated transfer")
    p.add_argument("--out", default=None, help="the JSON file (default evidence/host_profile/)")
    args = p.parse_args(argv)
    path = Path(args.out) if args.out else EVIDENCE / f"{socket.gethostname()}.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    profile: dict[str, Any] = {
        "what": "rates of this host measured by benchmarks/host_profile.py (sim/hostprofile.py "
        "reads them); every part records the load average before and after it",
        "host": host(),
        "compute": dict(old.get("compute", {})),
        "emulator": old.get("emulator"),
    }
    if not args.emulator_only:
        densities = tuple(float(x) for x in args.densities.split(","))
        for model in args.models.split(","):
            profile["compute"][model] = compute(model, densities, args.repeats)
    if args.emulator or args.emulator_only:
        profile["emulator"] = emulator(args.seconds)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=1, sort_keys=True) + "\n")
    print(f"host_profile: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
