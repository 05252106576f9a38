"""Measure an emulated path: UDP echo RTT, TCP goodput over S streams, UDP loss.

Theory of operation
-------------------
A *server* runs in the destination namespace and a *client* in the source namespace, both
started by path (standard library only) with ``ip netns exec``. The server (:func:`serve`) binds
a UDP socket and a TCP listener on ephemeral ports, prints them as one JSON line, and then
answers (echoes, counts datagrams, receives TCP runs) until its standard input reaches end of
file. The client runs one measurement (``rtt``, ``tcp`` or ``blast``: :func:`client_rtt`,
:func:`client_tcp`, :func:`client_blast`) and prints one JSON line. Goodput is measured at the
receiver and before the first stream closes. Loss probes must stay below the link's rate (or
queue drops add to the loss); RTT probes are tiny and one at a time, so they measure the idle
RTT."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import selectors
import socket
import struct
import sys
import time

_HDR = struct.Struct("!II")


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class _Run:
    def __init__(self, streams: int) -> None:
        self.streams = streams
        self.closed = 0
        self.first_close: float | None = None
        self.bytes = 0
        self.first: float | None = None
        self.last = 0.0
        self.samples: list[tuple[float, int]] = []

    def add(self, n: int, now: float) -> None:
        if self.first is None:
            self.first = now
        self.bytes += n
        self.last = now
        if not self.samples or now - self.samples[-1][0] >= 0.02:
            self.samples.append((now, self.bytes))

    def report(self, run_id: int) -> dict:
        first = self.first or self.last
        samples = [(round(t - first, 4), b) for t, b in self.samples]
        samples.append((round(self.last - first, 4), self.bytes))
        return {
            "event": "tcp",
            "run": run_id,
            "streams": self.streams,
            "bytes": self.bytes,
            "seconds": self.last - first,
            "first_close_s": (self.first_close or self.last) - first,
            "first_monotonic": first,
            "samples": samples,
        }


def serve(bind: str, buffer: int = 0) -> int:
    """What it answers:

    * UDP ``E...``: echoed back unchanged (RTT probes);
    * UDP ``D<seq>``: counted (loss probes); the first ``F`` after data prints the count;
    * TCP: a run of S streams, each opened with an 8-byte header (streams in the run, run id); when
      every stream of the run has closed, the server prints the bytes received, cumulative
      samples (every 20 ms) measured at the receiver, which is where goodput is defined, and when
      the first stream closed: the sender stops writing after ``seconds`` but its socket buffers
      (up to 4 MiB a stream) drain for a while after, and once streams start finishing the rest
      are no longer S streams, so goodput is measured before the first close."""
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    udp.bind((bind, 0))
    udp.setblocking(False)
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if buffer:  # accepted sockets inherit it, as the data plane sets its own on each socket
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)
    tcp.bind((bind, 0))
    tcp.listen(64)
    _emit({"event": "ready", "udp": udp.getsockname()[1], "tcp": tcp.getsockname()[1]})
    sel = selectors.DefaultSelector()
    sel.register(udp, selectors.EVENT_READ, "udp")
    sel.register(tcp, selectors.EVENT_READ, "accept")
    sel.register(0, selectors.EVENT_READ, "stdin")
    runs: dict[int, _Run] = {}
    heads: dict[socket.socket, bytes] = {}  # header bytes so far, until a stream has its run
    member: dict[socket.socket, int] = {}  # stream -> run id
    seen = bytearray()
    received = 0
    buf = bytearray(1 << 20)
    while True:
        for key, _ in sel.select():
            what = key.data
            if what == "stdin":
                if not os.read(0, 4096):
                    return 0
            elif what == "udp":
                while True:
                    try:
                        data, peer = udp.recvfrom(65536)
                    except BlockingIOError:
                        break
                    kind = data[:1]
                    if kind == b"E":
                        udp.sendto(data, peer)
                    elif kind == b"D":
                        seq = int.from_bytes(data[1:9], "big")
                        if seq >= len(seen):
                            seen.extend(bytes(seq + 1 - len(seen) + 4096))
                        if not seen[seq]:
                            seen[seq] = 1
                            received += 1
                    elif kind == b"F" and received:
                        total = int.from_bytes(data[1:9], "big")
                        _emit({"event": "udp", "received": received, "sent": total})
                        seen = bytearray()
                        received = 0
            elif what == "accept":
                conn, _ = tcp.accept()
                conn.setblocking(False)
                heads[conn] = b""
                sel.register(conn, selectors.EVENT_READ, "conn")
            else:
                obj = key.fileobj
                assert isinstance(obj, socket.socket)
                conn = obj
                try:
                    n = conn.recv_into(buf)
                except BlockingIOError:
                    continue
                except ConnectionError:
                    n = 0
                now = time.monotonic()
                data_n = n
                if conn in heads:  # still reading the 8-byte header
                    head = heads[conn] + bytes(buf[: min(n, _HDR.size)])
                    data_n = max(n - (_HDR.size - len(heads[conn])), 0)
                    if len(head) < _HDR.size:
                        heads[conn] = head
                        if n:
                            continue
                    else:
                        del heads[conn]
                        streams, run_id = _HDR.unpack(head)
                        runs.setdefault(run_id, _Run(streams))
                        member[conn] = run_id
                run = runs.get(member.get(conn, -1))
                if n:
                    if run is not None and data_n:
                        run.add(data_n, now)
                    continue
                sel.unregister(conn)
                conn.close()
                heads.pop(conn, None)
                run_id = member.pop(conn, -1)
                if run is not None:
                    run.closed += 1
                    if run.first_close is None:
                        run.first_close = now
                    if run.closed >= run.streams:
                        _emit(run.report(run_id))
                        del runs[run_id]


def client_rtt(host: str, port: int, count: int, interval: float, timeout: float) -> dict:
    """``count`` echoes, one at a time, spaced ``interval`` seconds; per-echo RTT in ms (a lost
    echo times out after ``timeout`` seconds and is counted as lost)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect((host, port))
    rtts: list[float] = []
    lost = 0
    for i in range(count):
        msg = b"E" + i.to_bytes(8, "big") + bytes(55)
        t0 = time.perf_counter()
        s.send(msg)
        deadline = t0 + timeout
        while True:
            s.settimeout(max(deadline - time.perf_counter(), 1e-4))
            try:
                data = s.recv(2048)
            except TimeoutError:
                lost += 1
                break
            except OSError:  # refused, or no route (an unlinked or cut region)
                lost += 1
                break
            if data[1:9] == msg[1:9]:
                rtts.append((time.perf_counter() - t0) * 1e3)
                break
        rest = interval - (time.perf_counter() - t0)
        if rest > 0 and i + 1 < count:
            time.sleep(rest)
    return {"event": "rtt", "rtt_ms": rtts, "lost": lost, "count": count}


def client_tcp(
    host: str,
    port: int,
    streams: int,
    seconds: float,
    cc: str,
    run_id: int,
    buffer: int = 0,
    abort: bool = False,
) -> dict:
    """S streams for ``seconds`` with congestion control ``cc`` set per socket (``TCP_CONGESTION``;
    a netns cannot change its default away from the host's)."""
    socks = []
    for _ in range(streams):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if buffer:  # as aurora.transport.wire.tune_socket: no autotuning past it
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)
        if cc:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
        s.connect((host, port))
        s.sendall(_HDR.pack(streams, run_id))
        s.setblocking(False)
        socks.append(s)
    sel = selectors.DefaultSelector()
    for s in socks:
        sel.register(s, selectors.EVENT_WRITE)
    chunk = b"x" * (1 << 18)
    sent = 0
    start = time.monotonic()
    deadline = start + seconds
    while (now := time.monotonic()) < deadline:
        for key, _ in sel.select(deadline - now):
            with contextlib.suppress(BlockingIOError):
                sent += key.fileobj.send(chunk)  # type: ignore[union-attr]
    used = socks[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0")
    if abort:  # reset: the buffers are not drained (a slow path drains for minutes)
        for s in socks:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        return {"event": "tcp_sent", "sent": sent, "seconds": seconds, "cc": used.decode()}
    for s in socks:
        s.setblocking(True)
        s.shutdown(socket.SHUT_WR)
    for s in socks:  # wait for the server to close: every byte has arrived
        s.settimeout(max(60.0, 10 * seconds))
        while s.recv(4096):
            pass
        s.close()
    return {"event": "tcp_sent", "sent": sent, "seconds": seconds, "cc": used.decode()}


def client_blast(host: str, port: int, packets: int, pps: float, size: int) -> dict:
    """``packets`` UDP datagrams of ``size`` bytes at ``pps``, then end markers."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    s.connect((host, port))
    pad = bytes(max(size - 9, 0))
    start = time.perf_counter()
    for i in range(packets):
        due = start + i / pps
        if (wait := due - time.perf_counter()) > 0.001:
            time.sleep(wait)
        with contextlib.suppress(ConnectionRefusedError, BlockingIOError):
            s.send(b"D" + i.to_bytes(8, "big") + pad)
    took = time.perf_counter() - start
    for _ in range(20):  # several end markers: one may be lost
        s.send(b"F" + packets.to_bytes(8, "big"))
        time.sleep(0.005)
    return {"event": "blast", "sent": packets, "seconds": took}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Probe an emulated path.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("serve")
    p.add_argument("--bind", default="0.0.0.0")
    p.add_argument("--buffer", type=int, default=0, help="SO_RCVBUF of accepted sockets")
    p = sub.add_parser("rtt")
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("--count", type=int, default=10)
    p.add_argument("--interval", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=2.0)
    p = sub.add_parser("tcp")
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--cc", default="")
    p.add_argument("--run", type=int, default=1)
    p.add_argument("--buffer", type=int, default=0, help="SO_SNDBUF/SO_RCVBUF (0: autotuned)")
    p.add_argument("--abort", action="store_true", help="reset the streams at the end")
    p = sub.add_parser("blast")
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("--packets", type=int, default=10000)
    p.add_argument("--pps", type=float, default=5000)
    p.add_argument("--size", type=int, default=200)
    a = ap.parse_args(argv)
    # Measure the link, not this machine's scheduler: a receiver that waits for a core reads
    # in bursts, which moves bytes between measurement windows.
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, -5)
    if a.cmd == "serve":
        return serve(a.bind, a.buffer)
    if a.cmd == "rtt":
        _emit(client_rtt(a.host, a.port, a.count, a.interval, a.timeout))
    elif a.cmd == "tcp":
        _emit(client_tcp(a.host, a.port, a.streams, a.seconds, a.cc, a.run, a.buffer, a.abort))
    else:
        _emit(client_blast(a.host, a.port, a.packets, a.pps, a.size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
