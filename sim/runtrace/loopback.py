"""The host's loopback, probed: what a loopback run's links are when it is replayed.

Theory of operation
-------------------
A run whose roles all ran on one host crossed that host's loopback on every "WAN link" and
inside every region, so its replay needs the loopback's rate and round trip.
:func:`probe_loopback` measures one TCP stream's goodput and the median round trip of small
messages; whoever runs a loopback run writes the result beside it as :data:`LOOPBACK`, where
:func:`sim.runtrace.run.read_run` finds it.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from typing import Any

LOOPBACK = "loopback.json"
"""A loopback run's probe of the host's loopback (written beside the run by whoever ran it)."""


def probe_loopback(*, seconds: float = 1.0, chunk: int = 1 << 16) -> dict[str, Any]:
    """Measure this host's loopback: one TCP stream's goodput (Gbit/s) for ``seconds`` and the
    median round trip of 50 small messages (ms). What a loopback run's links are."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    received = [0]

    def sink() -> None:
        conn, _ = srv.accept()
        with conn:
            while data := conn.recv(1 << 20):
                received[0] += len(data)

    t = threading.Thread(target=sink, daemon=True)
    t.start()
    payload = b"\0" * chunk
    with socket.create_connection(("127.0.0.1", port)) as c:
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            c.sendall(payload)
        c.shutdown(socket.SHUT_WR)
        t.join(10)
        elapsed = time.perf_counter() - start
    srv.close()
    gbps = received[0] * 8 / elapsed / 1e9
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def echo() -> None:
        conn, _ = srv.accept()
        with conn:
            while data := conn.recv(64):
                conn.sendall(data)

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    rtts = []
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(50):
            s = time.perf_counter()
            c.sendall(b"x")
            c.recv(64)
            rtts.append((time.perf_counter() - s) * 1e3)
    t.join(5)
    srv.close()
    return {
        "gbps": gbps,
        "rtt_ms": statistics.median(rtts),
        "seconds": elapsed,
        "bytes": received[0],
        "how": "one TCP stream of 64 KiB sends for 1 s; 50 one-byte echoes (median)",
    }
