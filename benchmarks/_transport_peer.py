"""One side of a data-plane transfer, run inside a network namespace by the benchmarks.

python benchmarks/_transport_peer.py serve HOST PORT MB STREAMS   (prints "ready" when up)
python benchmarks/_transport_peer.py receive HOST PORT MB STREAMS (prints seconds, bytes)
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import numpy as np

from aurora.delta.format import DeltaEncoder, weights_hash
from aurora.transport import Node, TransportConfig

SECRET = b"benchmark-secret-0123"


def segments(mb: float):
    n = int(mb * 1e6 / 6)  # naive codec, every weight changed: 6 bytes per change
    rng = np.random.default_rng(0)
    old = {"w": rng.integers(0, 2**16, n, dtype=np.uint16)}
    new = {"w": old["w"] ^ 1}
    h0 = weights_hash(old)
    enc = DeltaEncoder(
        old, new, model="bench", version=1, base_hash=h0, codec="naive", segment_size=4 << 20
    )
    return list(enc.segments()), h0


async def serve(host: str, port: int, mb: float, streams: int) -> None:
    segs, _ = segments(mb)
    node = Node("trainer", TransportConfig(secret=SECRET, streams=streams))
    await node.serve(host, port)
    await node.publish(1, segs)
    print("ready", flush=True)
    await asyncio.sleep(3600)


async def receive(host: str, port: int, mb: float, streams: int) -> None:
    segs, h0 = segments(mb)
    size = sum(len(s.data) for s in segs)
    node = Node(
        "actor",
        TransportConfig(secret=SECRET, streams=streams),
        sources=[(host, port)],
        active=(0, h0),
    )
    t = time.monotonic()
    await node.subscribe()
    await node.wait_for(lambda: 1 in node.staged, 600)
    staged = time.monotonic() - t
    received = node.versions[1].received_at - t
    print(json.dumps({"received_s": received, "staged_s": staged, "bytes": size}), flush=True)
    await node.close()


if __name__ == "__main__":
    role, host, port, mb, streams = sys.argv[1:6]
    fn = serve if role == "serve" else receive
    asyncio.run(fn(host, int(port), float(mb), int(streams)))
