"""The two sides of the attack-memory benchmark (``test_transport_attack_memory.py``), each run
in a fresh process so that its peak resident memory is its own.

* ``victim``: a Trainer and a relay in one process (what is measured). The relay's sources are
  [the attacker's garbage source, the Trainer] when attacked, [the Trainer] otherwise. Like the
  Ledger in a real run, the process hands each version's signed announcement to the relay
  before publishing it. It publishes ``versions`` deltas of ``mb`` MB, each once the honest
  Actor has staged the previous one, and reports its peak RSS (VmHWM).
* ``outside``: the honest Actor (subscribed to the relay), and when attacking: the garbage
  source (self-consistent segments of deltas nobody announced, ``garbage_mb`` of them), four
  subscribers that never read on the Trainer and four on the relay, and a connection that
  floods the Trainer with 1 MB of ``subscribe`` frames every second.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

import numpy as np

from aurora.delta import DeltaEncoder, Segment, leaf_hash, weights_hash
from aurora.delta.announce import describe_parts, public_key_of, sign
from aurora.runtime.actor import activate
from aurora.runtime.publisher import TrainerNode
from aurora.transport import Node, TransportConfig, wire

SECRET = b"attack-benchmark-secret"
KEY = bytes(range(32))
TRUST = {"job": "attack", "public_key": public_key_of(KEY)}
SLOW_READERS = 4


def _cfg(**kw: object) -> TransportConfig:
    return TransportConfig(
        secret=SECRET,
        streams=2,
        stall_s=0.2,
        progress_s=1.0,
        cache_versions=2,
        send_timeout_s=5.0,
        **TRUST,
        **kw,  # type: ignore[arg-type]
    )


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _weights(mb: float) -> dict[str, np.ndarray]:
    n = int(mb * 1e6 / 6)  # naive codec, every weight changed: 6 bytes per change
    return {"w": np.random.default_rng(0).integers(0, 2**16, n, dtype=np.uint16)}


def victim(attacked: bool, mb: float, versions: int, to_outside, from_outside, result) -> None:  # type: ignore[no-untyped-def]
    async def main() -> int:
        trainer = TrainerNode("trainer", _cfg(), signing_key=KEY)
        tport = await trainer.serve()
        sources = [("127.0.0.1", tport)]
        if attacked:
            sources.insert(0, ("127.0.0.1", from_outside.get()))  # the garbage source
        relay = Node("relay", _cfg(), sources=sources)
        rport = await relay.serve()
        await relay.subscribe()
        to_outside.put((tport, rport))
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, from_outside.get) == "ready"
        weights = _weights(mb)
        h = weights_hash(weights)
        for v in range(1, versions + 1):
            new = {"w": weights["w"] ^ np.uint16(v)}
            enc = DeltaEncoder(
                weights,
                new,
                model="attack",
                version=v,
                base_hash=h,
                codec="naive",
                segment_size=4 << 20,
            )
            segments = list(enc.segments())
            signed = sign(describe_parts("attack", segments[0].data, segments[-1].data), KEY)
            relay.announce(signed)  # as the Ledger would
            await trainer.publish(v, segments, announcement=signed)
            del segments, enc
            weights, h = new, trainer.announcements[v].weights_hash
            staged = await loop.run_in_executor(None, from_outside.get)
            assert staged == v, staged
        rss = _peak_rss()
        await relay.close()
        await trainer.close()
        return rss

    result.put(asyncio.run(main()))


async def _garbage_source(total_mb: float) -> tuple[asyncio.base_events.Server, int]:
    junk = bytes(1 << 20)
    checksum = leaf_hash(junk).hex()

    async def handle(reader, writer):  # type: ignore[no-untyped-def]
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await wire.server_handshake(
                lambda: wire.read_frame(reader, wire.HANDSHAKE_MAX_FRAME),
                writer.write,
                secret=SECRET,
            )
            await wire.read_frame(reader, wire.CONTROL_MAX_FRAME)  # subscribe
            for i in range(int(total_mb)):
                key = os.urandom(16).hex()  # a delta nobody announced, every MiB another
                seg = Segment(key, i, i << 20, junk, checksum)
                for piece in wire.segment_frame(1 + i % 3, seg):
                    writer.write(piece)
                await writer.drain()
            await asyncio.sleep(3600)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _slow_reader(port: int, name: str) -> asyncio.StreamWriter:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await wire.client_handshake(
        lambda: wire.read_frame(reader, wire.MAX_FRAME),
        writer.write,
        secret=SECRET,
        hello={"id": name, "session": os.urandom(16), "stream": 0, "streams": 1},
    )
    writer.write(wire.control({"op": "subscribe", "from": 0}))
    writer.transport.pause_reading()  # and never read again
    return writer


async def _flood(port: int) -> None:
    frames = wire.control({"op": "subscribe", "from": 0}) * 40_000  # 1 MB
    while True:
        with contextlib.suppress(Exception):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            await wire.client_handshake(
                lambda r=reader: wire.read_frame(r, wire.MAX_FRAME),
                writer.write,
                secret=SECRET,
                hello={"id": "flood", "session": os.urandom(16), "stream": 0, "streams": 1},
            )
            writer.transport.pause_reading()
            writer.write(frames)
            await asyncio.wait_for(writer.drain(), 2)
        await asyncio.sleep(1.0)


def outside(attacked: bool, mb: float, garbage_mb: float, to_victim, from_victim) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        keep = []
        if attacked:
            server, gport = await _garbage_source(garbage_mb)
            keep.append(server)
            to_victim.put(gport)
        loop = asyncio.get_running_loop()
        tport, rport = await loop.run_in_executor(None, from_victim.get)
        h0 = weights_hash(_weights(mb))
        staged: asyncio.Queue[int] = asyncio.Queue()
        actor = Node(
            "actor",
            _cfg(),
            sources=[("127.0.0.1", rport)],
            active=(0, h0),
            on_staged=lambda d, ann: staged.put_nowait(d.version),
        )
        await actor.subscribe()
        if attacked:
            for i in range(SLOW_READERS):
                keep.append(await _slow_reader(tport, f"slow-t{i}"))
                keep.append(await _slow_reader(rport, f"slow-r{i}"))
            keep.append(asyncio.ensure_future(_flood(tport)))
        to_victim.put("ready")
        while True:
            v = await staged.get()
            activate(actor, v)
            to_victim.put(v)

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
