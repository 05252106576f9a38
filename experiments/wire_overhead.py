"""How much of an emulated link's configured rate is payload: the measured input behind the replay's
link rate.

    python -m experiments.wire_overhead [--out evidence/wire_overhead.json]   # root, ip, tc

Theory of operation
-------------------
The emulator shapes each direction with an htb class at the configured rate, and htb counts
every byte of every packet it sends, headers included; the simulator's links carry payload at
their configured rate. So a replay that takes the htb rate as the payload rate is too fast by
the header share (1448 / 1514 = 0.956 for full-size packets on a 1500-byte MTU from first
principles). This measures it (:func:`measure`); ``sim_vs_real`` multiplies the emulated links'
rates by the median (``--wire-efficiency``). The input comes from a transfer that is not a run of
the comparison, so nothing in it is fitted to the comparison's output."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aurora.provenance import git_sha
from experiments.common import plain

EVIDENCE = Path(__file__).resolve().parent.parent / "evidence" / "wire_overhead.json"
"""Where the measurement is committed (``sim_vs_real`` reads it)."""
SCALES = {"standin": 0.0014336588143589741, "rl": 0.005712}
"""The link scales of ``sim_vs_real``'s emulated runs (``emulation.json``'s ``scale``)."""
TOPOLOGY = {
    "name": "wire-overhead",
    "trainer": {"region": "us", "model": "qwen3-8b", "gpus": 1},
    "regions": [{"name": "us"}, {"name": "ca"}],
    "links": [{"a": "us", "b": "ca", "gbps": 1.0, "rtt_ms": 40, "loss": 0}],
    "actors": [{"region": "ca", "gpu": "A100", "count": 2}],
}
"""The link of ``sim_vs_real``'s emulated runs (1 Gbit/s x scale, 40 ms RTT, no loss)."""


def measure(seconds: float = 4.0) -> dict[str, Any]:
    """Every (scale, streams) measurement and their median efficiency.

    Headers counted by htb: Ethernet, IP and TCP (with TCP's timestamp option). A bulk TCP
    transfer across the emulated US-Canada link of ``sim_vs_real`` at the two link scales its
    runs use (stand-in and the tiny Qwen3), with 1 and 4 streams: the payload received divided
    by the bytes the htb class counted (:func:`emulation.measure.payload_efficiency`).
    """
    from aurora.topology import topology_from_dict
    from emulation.measure import payload_efficiency
    from emulation.network import build_network

    topo = topology_from_dict(TOPOLOGY, source="wire_overhead")
    rows = []
    for backend, scale in SCALES.items():
        with build_network(topo, scale=scale, verify=False) as net:
            for streams in (1, 4):
                got = payload_efficiency(net, "us", "ca", streams=streams, seconds=seconds)
                rows.append({"backend": backend, "scale": scale, **got})
    return {
        "efficiency": statistics.median(r["efficiency"] for r in rows),
        "first_principles": 1448 / 1514,
        "measurements": rows,
        "git_sha": git_sha(),
        "kernel": platform.release(),
        "load_average": os.getloadavg(),
        "unix": time.time(),
    }


def load(path: Path = EVIDENCE) -> float | None:
    """The committed median efficiency, or None when it has not been measured."""
    if not path.exists():
        return None
    return float(json.loads(path.read_text())["efficiency"])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=plain((__doc__ or "").split("\n\n")[0]))
    p.add_argument("--out", default=str(EVIDENCE), help="where to write the JSON")
    p.add_argument("--seconds", type=float, default=4.0, help="each transfer's length")
    args = p.parse_args(argv)
    got = measure(args.seconds)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(got, indent=2) + "\n")
    for r in got["measurements"]:
        print(
            f"{r['backend']:<8} x{r['scale']:.4g}  {r['streams']} stream(s): payload "
            f"{r['payload_bytes']:,} B / counted {r['counted_bytes']:,} B = "
            f"{r['efficiency']:.4f}  ({r['bytes_per_packet']:.0f} B a packet)"
        )
    print(f"median {got['efficiency']:.4f} (first principles 1448/1514 = 0.9564); {args.out}")
    return got


if __name__ == "__main__":
    main()
