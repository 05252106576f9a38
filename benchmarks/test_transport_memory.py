"""Memory over a long run: a Trainer, a relay and an Actor in one process pass 40 versions of a
12 MB delta; the Actor activates each. Reported: the process's resident memory after every ten
versions, and its growth from version 10 to 40 in units of one delta (it stays flat when the
Actor's arenas are reused and the relay and Trainer keep only ``cache_versions`` versions).

    python -m pytest benchmarks/test_transport_memory.py --benchmark-enable -s
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from aurora.delta import DeltaEncoder, weights_hash
from aurora.delta.announce import public_key_of
from aurora.runtime.actor import activate
from aurora.runtime.publisher import TrainerNode
from aurora.transport import Node, TransportConfig

pytestmark = pytest.mark.benchmark(group="transport")
SECRET = b"memory-benchmark-secret"
KEY = bytes(range(32))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


async def _run(versions: int) -> tuple[list[int], int, int]:
    rng = np.random.default_rng(0)
    weights = {"w": rng.integers(0, 2**16, 2_000_000, dtype=np.uint16)}
    h0 = h = weights_hash(weights)
    cfg = TransportConfig(
        secret=SECRET,
        streams=3,
        stall_s=0.2,
        cache_versions=4,
        job="soak",
        public_key=public_key_of(KEY),
    )
    trainer = TrainerNode("trainer", cfg, signing_key=KEY)
    relay = Node("relay", cfg, sources=[("127.0.0.1", await trainer.serve())])
    actor = Node("actor", cfg, sources=[("127.0.0.1", await relay.serve())], active=(0, h0))
    await relay.subscribe()
    await actor.subscribe()
    await asyncio.sleep(0.05)
    rss, size = [], 0
    for v in range(1, versions + 1):
        flips = rng.integers(0, 2, weights["w"].size, dtype=np.uint16)
        new = {"w": weights["w"] ^ flips}
        enc = DeltaEncoder(
            weights,
            new,
            model="soak",
            version=v,
            base_hash=h,
            codec="naive",
            segment_size=1 << 20,
        )
        segments = list(enc.segments())
        size = sum(len(s.data) for s in segments)
        await trainer.publish(v, segments)
        await actor.wait_for(lambda v=v: v in actor.staged, 30)
        activate(actor, v)
        weights, h = new, enc.weights_hash
        if v % 10 == 0:
            rss.append(_rss_bytes())
    reused = actor._arenas.reused
    for n in (actor, relay, trainer):
        await n.close()
    return rss, size, reused


def test_memory_stays_flat_over_many_versions(benchmark):
    versions = 40
    rss, size, reused = benchmark.pedantic(
        lambda: asyncio.run(_run(versions)), rounds=1, iterations=1
    )
    growth = (rss[-1] - rss[0]) / size
    print(
        f"\nresident memory after 10, 20, 30, 40 versions: "
        f"{', '.join(f'{r / 1e6:.0f} MB' for r in rss)}; growth from 10 to 40 = "
        f"{growth:.2f} deltas of {size / 1e6:.0f} MB; the Actor reused an arena {reused} times"
    )
    assert reused == versions - 1
