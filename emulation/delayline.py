"""NFQUEUE delay line: a fixed one-way propagation delay for kernels without netem.

Theory of operation
-------------------
An iptables rule in the router namespace sends every packet of one link direction to an
NFQUEUE. The kernel keeps the packet and sends this process a *metadata-only* notification (the
packet id, no payload) over netlink; the process holds each id in a FIFO with its due time (the
kernel's receive stamp + the delay) and releases every due packet at once with one batch
verdict. The packets never leave the kernel, and since the delay is the same for every packet
of a queue they leave in the order they came. Failure is closed, not open: the rule has no
``--queue-bypass``, so when this process is gone the direction drops everything rather than
running undelayed while the run claims a delay. Standalone, standard library only, run by path
under any Python 3.9+ inside ``ip netns exec``::

    python delayline.py --queue 1:20.0 --queue 2:20.0 --maxlen 8192"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import errno
import json
import os
import select
import signal
import socket
import struct
import sys
import time
from typing import Any

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET = 0
NFQNL_MSG_CONFIG = 2
NFQNL_MSG_VERDICT_BATCH = 3
NLM_F_REQUEST = 1
NLM_F_ACK = 4
NLMSG_ERROR = 2
NFQA_CFG_CMD = 1
NFQA_CFG_PARAMS = 2
NFQA_CFG_QUEUE_MAXLEN = 3
NFQA_CFG_MASK = 4
NFQA_CFG_FLAGS = 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_GSO = 4
NFQA_PACKET_HDR = 1
NFQA_TIMESTAMP = 4
SO_TIMESTAMPNS = 35
NFQA_VERDICT_HDR = 2
NF_ACCEPT = 1
PR_SET_TIMERSLACK = 29
RCVBUF_BYTES = 16 << 20
"""Netlink receive buffer (bytes): ~16k notifications of backlog before ENOBUFS."""

_NLHDR = struct.Struct("=IHHII")
_U16 = struct.Struct("!H").unpack_from
_U32 = struct.Struct("!I").unpack_from
_ATTR = struct.Struct("=HH").unpack_from
_STAMP = struct.Struct("!QQ").unpack_from
_PACKET_TYPE = (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET


class _Stop(Exception):
    pass


def _attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _message(msg_type: int, queue: int, attrs: list[bytes], flags: int, seq: int) -> bytes:
    # nfgenmsg: family AF_UNSPEC, version NFNETLINK_V0, res_id = queue number (big endian).
    body = struct.pack("!BBH", socket.AF_UNSPEC, 0, queue) + b"".join(attrs)
    kind = (NFNL_SUBSYS_QUEUE << 8) | msg_type
    return _NLHDR.pack(_NLHDR.size + len(body), kind, flags, seq, 0) + body


class DelayLine:
    """Holds the packets of one or more NFQUEUE queues for a fixed delay each.

    Copy mode ``NFQNL_COPY_META``; rule ``-j NFQUEUE --queue-num Q``; the batch verdict is
    ``NFQNL_MSG_VERDICT_BATCH`` (accept all ids up to N). Under load it wakes at most once per
    *quantum* (500 us by default) and releases what is due within half a quantum either side, so
    a wake-up serves many packets; the packets' bytes are never copied to user space.
    ``NFQA_CFG_F_GSO`` lets the kernel hand over GSO super-packets whole instead of segmenting
    them for us. The process exits when its standard input reaches end of file (the builder that
    started it died or closed it), on SIGTERM, or on SIGINT, and prints one JSON line of
    statistics.

    Accuracy: a packet's delay starts when the router received it. The process holds a socket
    with ``SO_TIMESTAMPNS`` set, which makes the kernel stamp every packet it receives, and the
    notification then carries that stamp (``NFQA_TIMESTAMP``); without one, the delay starts
    when this process reads the notification. It ends when the verdict is sent: timers fire
    late, so the process learns that lateness (an EWMA of its own timer wake-ups) and sends each
    verdict that much early. The process asks for SCHED_FIFO (``--rt-priority``; else ``nice``)
    because the roles' compute shares the cores. Measured numbers are in ``docs/EMULATION.md``.
    A lost notification (``ENOBUFS``: the socket's receive buffer overflowed) does not strand
    its packet: the next batch verdict covers every lower id. Counted.

    Why raw netlink rather than NetfilterQueue (libnetfilter_queue): that binding gives one
    Python callback and one verdict system call per packet and needs a C toolchain and
    ``libnetfilter-queue-dev`` to install; batch verdicts, metadata-only copies and the quantum
    are what keep this process cheap (``docs/EMULATION.md``).
    """

    def __init__(self, delays_s: dict[int, float], maxlen: int, quantum_s: float = 5e-4) -> None:
        self.delays = delays_s
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:  # SO_RCVBUFFORCE (root) ignores net.core.rmem_max
            self.sock.setsockopt(socket.SOL_SOCKET, 33, RCVBUF_BYTES)
        except OSError:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
        self.sock.bind((0, 0))
        self.held: dict[int, collections.deque[tuple[float, int]]] = {
            q: collections.deque() for q in delays_s
        }
        self.seq = 0
        self.quantum = min(quantum_s, min(delays_s.values()) / 4)
        """Shortest time between two wake-ups while packets are held (s)."""
        self.kernel_stamps = False
        """Whether the last notification carried the kernel's receive time."""
        self.early = 0.0
        """Expected lateness of a timer wake-up (s), learnt; verdicts go out this early."""
        self.stats: dict[str, Any] = {
            "queues": sorted(delays_s),
            "packets": 0,
            "batches": 0,
            "enobufs": 0,
            "timer_wakeups": 0,
            "kernel_stamped": 0,
            "read_lag_max_us": 0.0,
            "read_lag_sum_us": 0.0,
            "verdict_errors": 0,
            "late_max_us": 0.0,
            "late_sum_us": 0.0,
            "max_held": 0,
        }
        for q in delays_s:
            self._configure(q, maxlen)
        # Any socket that asks for receive timestamps makes the kernel stamp every packet it
        # receives (the netstamp static key, machine-wide, ~tens of ns a packet); then each
        # notification carries NFQA_TIMESTAMP and a packet's delay starts when the router got
        # it, not when this process got round to reading it.
        self.stamper = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with contextlib.suppress(OSError):
            self.stamper.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)

    def _request(self, queue: int, attrs: list[bytes]) -> None:
        self.seq += 1
        self.sock.send(
            _message(NFQNL_MSG_CONFIG, queue, attrs, NLM_F_REQUEST | NLM_F_ACK, self.seq)
        )
        data = self.sock.recv(65536)
        _len, kind, _flags, _seq, _pid = _NLHDR.unpack_from(data)
        if kind == NLMSG_ERROR:
            (err,) = struct.unpack_from("=i", data, _NLHDR.size)
            if err:
                raise OSError(-err, f"NFQUEUE {queue}: {os.strerror(-err)}")

    def _configure(self, queue: int, maxlen: int) -> None:
        self._request(queue, [_attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, 2))])
        self._request(
            queue,
            [
                _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META)),
                _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", maxlen)),
                _attr(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_GSO)),
                _attr(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_GSO)),
            ],
        )

    def _drain(self, buf: bytearray) -> None:
        """Read every pending notification; each packet is due its delay after the kernel
        received it (NFQA_TIMESTAMP), or after this drain began when the kernel gave no stamp.

        The kernel sends one notification per datagram, so this is one ``recv`` per packet:
        the loop is kept to plain locals (it is most of this process's CPU time)."""
        view = memoryview(buf)
        recv_into, dontwait = self.sock.recv_into, socket.MSG_DONTWAIT
        hdr, u16, u32, attr, stamp_of = _NLHDR.unpack_from, _U16, _U32, _ATTR, _STAMP
        held_of, delays = self.held, self.delays
        now = time.monotonic()
        real_minus_mono = time.time() - now
        packets = stamped = 0
        lag_sum = lag_max = 0.0
        stamp = None
        try:
            while True:
                try:
                    n = recv_into(buf, 0, dontwait)
                except BlockingIOError:
                    return
                except OSError as exc:
                    if exc.errno == errno.ENOBUFS:
                        self.stats["enobufs"] += 1
                        continue
                    raise
                off = 0
                while off + 16 <= n:
                    length, kind, _f, _s, _p = hdr(view, off)
                    if length < 16:
                        break
                    end = off + length
                    if kind == _PACKET_TYPE:
                        (queue,) = u16(view, off + 18)
                        pid = stamp = None
                        a = off + 20
                        while a + 4 <= end:  # the attributes: the id first, the stamp later
                            alen, atype = attr(view, a)
                            if alen < 4:
                                break
                            atype &= 0x7FFF
                            if atype == NFQA_PACKET_HDR:
                                (pid,) = u32(view, a + 4)
                            elif atype == NFQA_TIMESTAMP:
                                sec, usec = stamp_of(view, a + 4)
                                stamp = sec + usec * 1e-6
                                break
                            a += (alen + 3) & ~3
                        held = held_of.get(queue)
                        if pid is not None and held is not None:
                            arrived = now
                            if stamp is not None:
                                # the router's receive time (real-time clock) on the monotonic
                                # clock; never after now (a clock step must not add delay)
                                arrived = min(stamp - real_minus_mono, now)
                                stamped += 1
                                lag = now - arrived
                                lag_sum += lag
                                if lag > lag_max:
                                    lag_max = lag
                            held.append((arrived + delays[queue], pid))
                            packets += 1
                    elif kind == NLMSG_ERROR:
                        (err,) = struct.unpack_from("=i", view, off + 16)
                        if err:
                            self.stats["verdict_errors"] += 1
                            self.stats["last_error"] = os.strerror(-err)
                    off += (length + 3) & ~3
        finally:
            stats = self.stats
            stats["packets"] += packets
            stats["kernel_stamped"] += stamped
            stats["read_lag_sum_us"] += lag_sum * 1e6
            stats["read_lag_max_us"] = max(stats["read_lag_max_us"], lag_max * 1e6)
            if packets:
                self.kernel_stamps = stamp is not None

    def _release(self, now: float) -> float | None:
        """Accept every packet due by ``now`` plus the expected wake-up latency plus half a
        quantum (the next wake-up is a quantum away at the soonest: a follower is released at
        most Q/2 early here rather than up to Q late there); return when the head of what is
        left is due (None: nothing held)."""
        horizon = now + self.early + self.quantum / 2
        soonest = None
        for queue, held in self.held.items():
            if len(held) > self.stats["max_held"]:
                self.stats["max_held"] = len(held)
            last = None
            while held and held[0][0] <= horizon:
                due, last = held.popleft()
                late = (now + self.early - due) * 1e6
                self.stats["late_sum_us"] += late
                if late > self.stats["late_max_us"]:
                    self.stats["late_max_us"] = late
            if last is not None:
                self.seq += 1
                hdr = _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, last))
                self.sock.send(_message(NFQNL_MSG_VERDICT_BATCH, queue, [hdr], NLM_F_REQUEST, 0))
                self.stats["batches"] += 1
            if held:
                due = held[0][0] - self.early  # the head on time; its followers within Q/2
                soonest = due if soonest is None else min(soonest, due)
        return soonest

    def run(self, control_fd: int | None) -> None:
        """Serve until ``control_fd`` reaches end of file.

        While packets are held and the kernel stamps them, the socket is not watched: a new
        packet is due no sooner than the shortest delay, and its delay runs from the kernel's
        stamp, so reading it at the next wake-up loses nothing. Wake-ups are then at most one
        per ``quantum`` (each releases every packet due within half a quantum either side),
        which is what keeps the CPU cost down at ~10^4 packets/s. Without stamps every packet
        is read the moment it arrives (its delay runs from the read)."""
        buf = bytearray(1 << 20)
        ctl: list[socket.socket | int] = [] if control_fd is None else [control_fd]
        longest_sleep = max(min(min(self.delays.values()) / 2, 5e-3), 1e-4)
        next_release: float | None = None
        last_wake = 0.0
        while True:
            now = time.monotonic()
            watch = next_release is None or not self.kernel_stamps
            timeout = None
            if next_release is not None:
                timeout = max(next_release, last_wake + self.quantum) - now
                if not watch:
                    timeout = min(timeout, longest_sleep)
                timeout = max(timeout, 0.0)
            ready, _, _ = select.select(([self.sock] if watch else []) + ctl, [], [], timeout)
            last_wake = time.monotonic()
            if not ready and timeout is not None:
                # Woke on the timer: learn how late the timer fires (EWMA, capped at 0.5 ms).
                over = last_wake - now - timeout
                self.early = min(max(0.9 * self.early + 0.1 * over, 0.0), 5e-4)
                self.stats["timer_wakeups"] += 1
            if control_fd is not None and control_fd in ready and not os.read(control_fd, 4096):
                return  # the builder is gone
            self._drain(buf)
            next_release = self._release(time.monotonic())


def _parse_queue(text: str) -> tuple[int, float]:
    num, _, ms = text.partition(":")
    try:
        queue, delay_ms = int(num), float(ms)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected QUEUE:DELAY_MS, got {text!r}") from None
    if not (0 <= queue < 65536 and delay_ms >= 0):
        raise argparse.ArgumentTypeError(f"queue must be 0-65535 and delay >= 0, got {text!r}")
    return queue, delay_ms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--queue",
        type=_parse_queue,
        action="append",
        required=True,
        help="QUEUE:DELAY_MS (one-way delay of that NFQUEUE); repeat for more",
    )
    ap.add_argument(
        "--quantum-us",
        type=float,
        default=500.0,
        help="shortest time between wake-ups while packets are held (us)",
    )
    ap.add_argument(
        "--maxlen",
        type=int,
        default=8192,
        help="packets the kernel may hold per queue before dropping",
    )
    ap.add_argument(
        "--no-control", action="store_true", help="do not exit at end of file on standard input"
    )
    ap.add_argument(
        "--nice",
        type=int,
        default=-10,
        help="scheduling niceness when not real-time (negative: ahead of compute)",
    )
    ap.add_argument(
        "--rt-priority",
        type=int,
        default=0,
        help="SCHED_FIFO priority (1-99; 0: normal scheduling with --nice)",
    )
    args = ap.parse_args(argv)
    # A late wake-up is added delay: ask for hrtimer precision.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
    sched = "other"
    if args.rt_priority > 0:
        try:  # the wire must not wait for the roles' compute; kernel RT throttling still
            # leaves 5% of each second to everything else if this ever spins
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(args.rt_priority))
            sched = f"fifo:{args.rt_priority}"
        except OSError:
            pass
    if sched == "other" and args.nice:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, args.nice)
            sched = f"nice:{args.nice}"
    try:
        line = DelayLine({q: ms / 1e3 for q, ms in args.queue}, args.maxlen, args.quantum_us / 1e6)
    except OSError as exc:
        print(f"delay line: cannot bind NFQUEUE: {exc}", file=sys.stderr)
        return 2

    def stop(_sig: int, _frame: object) -> None:
        raise _Stop

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print("ready", flush=True)
    with contextlib.suppress(_Stop):
        line.run(None if args.no_control else sys.stdin.fileno())
    stats = dict(line.stats)
    stats["late_mean_us"] = stats.pop("late_sum_us") / max(stats["packets"], 1)
    stats["read_lag_mean_us"] = stats.pop("read_lag_sum_us") / max(stats["kernel_stamped"], 1)
    stats["early_us"] = line.early * 1e6
    stats["scheduling"] = sched
    print(json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
