"""One side of a data-plane transfer, run inside a network namespace by the benchmarks.

python benchmarks/_transport_peer.py serve HOST PORT MB STREAMS   (prints "ready" when up)
python benchmarks/_transport_peer.py receive HOST PORT MB STREAMS (prints seconds, bytes)
python benchmarks/_transport_peer.py serve-chain HOST PORT MB STREAMS VERSIONS GAP_S
    (once a subscriber is up, publishes D_1..D_VERSIONS GAP_S apart; a JSON line per publish)
python benchmarks/_transport_peer.py receive-chain HOST PORT MB STREAMS VERSIONS
    (one subscription for the whole chain; a JSON line per version received)
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import numpy as np

from aurora.delta import DeltaEncoder, weights_hash
from aurora.delta.announce import public_key_of
from aurora.runtime.actor import activate
from aurora.runtime.publisher import TrainerNode
from aurora.transport import Node, TransportConfig

SECRET = b"benchmark-secret-0123"
KEY = bytes(range(32))
"""The Trainer's signing key in the benchmarks (raw Ed25519)."""
TRUST = {"job": "bench", "public_key": public_key_of(KEY)}


def chain(mb: float, versions: int):
    """Deltas D_1..D_versions of about ``mb`` MB each, and h(0)."""
    n = int(mb * 1e6 / 6)  # naive codec, every weight changed: 6 bytes per change
    rng = np.random.default_rng(0)
    weights = {"w": rng.integers(0, 2**16, n, dtype=np.uint16)}
    h0 = h = weights_hash(weights)
    deltas = []
    for v in range(1, versions + 1):
        new = {"w": weights["w"] ^ v}
        enc = DeltaEncoder(
            weights,
            new,
            model="bench",
            version=v,
            base_hash=h,
            codec="naive",
            segment_size=4 << 20,
        )
        deltas.append(list(enc.segments()))
        weights, h = new, enc.weights_hash
    return deltas, h0


def segments(mb: float):
    deltas, h0 = chain(mb, 1)
    return deltas[0], h0


async def serve(host: str, port: int, mb: float, streams: int) -> None:
    segs, _ = segments(mb)
    node = TrainerNode(
        "trainer", TransportConfig(secret=SECRET, streams=streams, **TRUST), signing_key=KEY
    )
    await node.serve(host, port)
    await node.publish(1, segs)
    print("ready", flush=True)
    await asyncio.sleep(3600)


async def receive(host: str, port: int, mb: float, streams: int) -> None:
    segs, h0 = segments(mb)
    size = sum(len(s.data) for s in segs)
    node = Node(
        "actor",
        # An Actor commits memory for the deltas it expects when it starts (before the clock).
        TransportConfig(secret=SECRET, streams=streams, prefault_bytes=size + (1 << 20), **TRUST),
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


async def relay(host: str, port: int, streams: int, listen: int, n: int) -> None:
    node = Node(
        "relay", TransportConfig(secret=SECRET, streams=streams, **TRUST), sources=[(host, port)]
    )
    await node.serve("0.0.0.0", listen)
    print("ready", flush=True)
    while sum(1 for s in node.subscribers.values() if s.subscribed) < n:
        await asyncio.sleep(0.01)
    print(json.dumps({"start_wall": time.time()}), flush=True)
    await node.subscribe()
    await asyncio.sleep(3600)


async def receive_wall(host: str, port: int, mb: float, streams: int, name: str) -> None:
    segs, h0 = segments(mb)
    node = Node(
        name,
        TransportConfig(secret=SECRET, streams=streams, **TRUST),
        sources=[(host, port)],
        active=(0, h0),
    )
    await node.subscribe()
    await node.wait_for(lambda: 1 in node.staged, 600)
    print(json.dumps({"staged_wall": time.time()}), flush=True)
    await node.close()


async def serve_chain(host: str, port: int, mb: float, streams: int, n: int, gap: float) -> None:
    deltas, _ = chain(mb, n)
    node = TrainerNode(
        "trainer", TransportConfig(secret=SECRET, streams=streams, **TRUST), signing_key=KEY
    )
    await node.serve(host, port)
    print("ready", flush=True)
    while not any(s.subscribed for s in node.subscribers.values()):
        await asyncio.sleep(0.01)
    await asyncio.sleep(gap)  # every stream connected and idle, as in a running job
    for v, segs in enumerate(deltas, 1):
        print(json.dumps({"v": v, "published": time.monotonic()}), flush=True)
        await node.publish(v, segs)
        await asyncio.sleep(gap)
    await asyncio.sleep(3600)


async def receive_chain(host: str, port: int, mb: float, streams: int, n: int) -> None:
    deltas, h0 = chain(mb, n)
    sizes = [sum(len(s.data) for s in segs) for segs in deltas]
    size = max(sizes)
    node = Node(
        "actor",
        TransportConfig(secret=SECRET, streams=streams, prefault_bytes=size + (1 << 20), **TRUST),
        sources=[(host, port)],
        active=(0, h0),
    )
    await node.subscribe()
    for v in range(1, n + 1):
        await node.wait_for(lambda v=v: v in node.staged, 600)
        # time.monotonic is one clock for every process of the machine
        at = node.versions[v].received_at
        print(json.dumps({"v": v, "received": at, "bytes": sizes[v - 1]}), flush=True)
        activate(node, v)
    await node.close()


if __name__ == "__main__":
    role, host, port, mb, streams = sys.argv[1:6]
    if role == "serve":
        asyncio.run(serve(host, int(port), float(mb), int(streams)))
    elif role == "receive":
        asyncio.run(receive(host, int(port), float(mb), int(streams)))
    elif role == "relay":
        asyncio.run(relay(host, int(port), int(streams), int(sys.argv[6]), int(sys.argv[7])))
    elif role == "serve-chain":
        n, gap = int(sys.argv[6]), float(sys.argv[7])
        asyncio.run(serve_chain(host, int(port), float(mb), int(streams), n, gap))
    elif role == "receive-chain":
        asyncio.run(receive_chain(host, int(port), float(mb), int(streams), int(sys.argv[6])))
    elif role == "receive-wall":
        asyncio.run(receive_wall(host, int(port), float(mb), int(streams), sys.argv[6]))
    else:
        raise SystemExit(f"unknown role {role!r}")
