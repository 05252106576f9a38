"""Data-plane goodput on loopback, against raw TCP measured in the same run.

The sender (a Trainer node with the deltas encoded ahead) runs in its own process; the receiver
subscribes with S streams, tells the sender to publish and stops the clock when the delta is
verified whole and staged. The reference is one raw TCP connection moving the same bytes
between two processes, into one reused buffer.

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

from aurora.runtime.actor import activate
from aurora.runtime.publisher import TrainerNode
from aurora.transport import Node, TransportConfig

sys.path.insert(0, str(Path(__file__).parent))
from _transport_peer import KEY, SECRET, TRUST, chain  # noqa: E402

pytestmark = pytest.mark.benchmark(group="transport")


def _serve(streams: int, versions: int, q, go) -> None:  # type: ignore[no-untyped-def]
    deltas, h0 = chain(200, versions)

    async def main() -> None:
        node = TrainerNode(
            "trainer", TransportConfig(secret=SECRET, streams=streams, **TRUST), signing_key=KEY
        )
        port = await node.serve()
        q.put((port, h0, [sum(len(s.data) for s in d) for d in deltas]))
        loop = asyncio.get_running_loop()
        for v, segments in enumerate(deltas, 1):
            await loop.run_in_executor(None, go.get)  # the receiver's clock starts
            await node.publish(v, segments)
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


@pytest.mark.parametrize("prefault", [False, True], ids=["fresh", "prefaulted"])
@pytest.mark.parametrize("streams", [1, 4])
def test_loopback_goodput_of_one_verified_delta(benchmark, streams, prefault):
    """D_1 arrives into fresh memory, or into memory the receiver committed when it was made
    (``prefault_bytes``, as an Actor configured for its model's delta size does); D_2..D_4 arrive
    the way every later step's delta does: into the arena that the previous one, applied and
    released, gave back to the pool."""
    versions = 4
    q: mp.Queue = mp.Queue()
    go: mp.Queue = mp.Queue()
    p = mp.Process(target=_serve, args=(streams, versions, q, go), daemon=True)
    p.start()
    port, h0, sizes = q.get()
    cpu: list[float] = []
    """Seconds of this (receiving) process's CPU per delta: less disturbed by other jobs on the
    host than wall time."""

    async def receive() -> list[float]:
        node = Node(
            "actor",
            TransportConfig(
                secret=SECRET,
                streams=streams,
                prefault_bytes=(sizes[0] + (1 << 20)) * prefault,
                **TRUST,
            ),
            sources=[("127.0.0.1", port)],
            active=(0, h0),
        )
        await node.subscribe()
        times = []
        for v in range(1, versions + 1):
            t, c = time.perf_counter(), time.process_time()
            go.put(v)
            await node.wait_for(lambda v=v: v in node.staged, 120)
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
            activate(node, v)  # applied: its arena goes back to the pool
        assert node._arenas.reused >= versions - 1
        await node.close()
        return times

    try:
        times = benchmark.pedantic(lambda: asyncio.run(receive()), rounds=1, iterations=1)
    finally:
        p.terminate()
    ref = raw_tcp_bytes_per_s()
    first = sizes[0] / times[0]
    warm = [n / t for n, t in zip(sizes[1:], times[1:], strict=True)]
    memory = "prefaulted" if prefault else "fresh"
    print(
        f"\nS={streams}: first {sizes[0] / 1e6:.0f} MB delta, {memory} memory: {first / 1e9:.2f} "
        f"GB/s = {first / ref:.2f} x raw; "
        f"next {len(warm)}, reused arena: {min(warm) / 1e9:.2f}-{max(warm) / 1e9:.2f} GB/s "
        f"= {min(warm) / ref:.2f}-{max(warm) / ref:.2f} x raw loopback TCP "
        f"({ref / 1e9:.2f} GB/s); target 1 GB/s; receiver CPU "
        f"{min(c / n * 1e9 for c, n in zip(cpu[1:], sizes[1:], strict=True)):.2f}-"
        f"{max(c / n * 1e9 for c, n in zip(cpu[1:], sizes[1:], strict=True)):.2f} s per GB"
    )
    assert min(warm) > 0
