"""Data-plane goodput on loopback, against raw TCP measured in the same run.

The sender (a Trainer node with the delta cached) runs in its own process; the receiver
subscribes with S streams and the clock stops when the delta is verified whole and staged.
The reference is one raw TCP connection moving the same bytes between two processes.

    python -m pytest benchmarks/test_transport_speed.py --benchmark-enable -s
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import socket
import sys
import time
from pathlib import Path

import pytest

from aurora.transport import Node, TransportConfig

sys.path.insert(0, str(Path(__file__).parent))
from _transport_peer import SECRET  # noqa: E402
from _transport_peer import segments as peer_segments

pytestmark = pytest.mark.benchmark(group="transport")


def _serve(streams: int, q) -> None:  # type: ignore[no-untyped-def]
    segments, h0 = peer_segments(200)

    async def main() -> None:
        node = Node("trainer", TransportConfig(secret=SECRET, streams=streams))
        port = await node.serve()
        await node.publish(1, segments)
        q.put((port, h0, sum(len(s.data) for s in segments)))
        await asyncio.sleep(3600)

    asyncio.run(main())


def _raw_sender(q, size: int) -> None:  # type: ignore[no-untyped-def]
    srv = socket.create_server(("127.0.0.1", 0))
    q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    block = b"\0" * (4 << 20)
    sent = 0
    while sent < size:
        conn.sendall(block)
        sent += len(block)
    conn.close()


def raw_tcp_bytes_per_s(size: int = 200_000_000) -> float:
    q: mp.Queue = mp.Queue()
    p = mp.Process(target=_raw_sender, args=(q, size), daemon=True)
    p.start()
    sock = socket.create_connection(("127.0.0.1", q.get()))
    buf = bytearray(4 << 20)
    got = 0
    t = time.perf_counter()
    while (n := sock.recv_into(buf)) > 0:
        got += n
    dt = time.perf_counter() - t
    p.join()
    return got / dt


@pytest.mark.parametrize("streams", [1, 4])
def test_loopback_goodput_of_one_verified_delta(benchmark, streams):
    q: mp.Queue = mp.Queue()
    p = mp.Process(target=_serve, args=(streams, q), daemon=True)
    p.start()
    port, h0, size = q.get()

    async def receive() -> float:
        node = Node(
            "actor",
            TransportConfig(secret=SECRET, streams=streams),
            sources=[("127.0.0.1", port)],
            active=(0, h0),
        )
        t = time.perf_counter()
        await node.subscribe()
        await node.wait_for(lambda: 1 in node.staged, 120)
        dt = time.perf_counter() - t
        await node.close()
        return dt

    try:
        dt = benchmark.pedantic(lambda: asyncio.run(receive()), rounds=1, iterations=1)
    finally:
        p.terminate()
    ref = raw_tcp_bytes_per_s()
    goodput = size / dt
    print(
        f"\nS={streams}: {size / 1e6:.0f} MB verified in {dt:.2f} s = {goodput / 1e9:.2f} GB/s "
        f"= {goodput / ref:.2f} x raw loopback TCP ({ref / 1e9:.2f} GB/s); target 1 GB/s"
    )
    assert goodput > 0
