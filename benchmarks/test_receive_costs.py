"""What a receiver pays per byte, against memcpy measured in the same run (one core): the
segment hash (BLAKE3, which the format uses, against hashlib's BLAKE2b and SHA-256) and the
first write to fresh pages (why receive arenas are pooled and can be prefaulted).

    python -m pytest benchmarks/test_receive_costs.py --benchmark-enable -s
"""

from __future__ import annotations

import hashlib
import os
import time

import blake3
import numpy as np
import pytest

from aurora.delta.arena import reserve

pytestmark = pytest.mark.benchmark(group="receive")
SIZE = 200_000_000
SEGMENT = 4 << 20
REPEATS = 5


def _best_gbps(f) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(REPEATS):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return SIZE / best / 1e9


def test_segment_hash_and_fresh_page_costs_against_memcpy(benchmark):
    data = memoryview(os.urandom(SIZE))
    src = np.frombuffer(data, np.uint8)
    dst = np.empty_like(src)
    dst.fill(0)
    cuts = range(0, SIZE, SEGMENT)

    def fresh_pages() -> None:
        mapping = reserve(SIZE)
        np.frombuffer(mapping, np.uint8).fill(1)  # the first write commits every page
        del mapping

    def measure() -> dict[str, float]:
        return {
            "memcpy": _best_gbps(lambda: np.copyto(dst, src)),
            "blake3": _best_gbps(
                lambda: [blake3.blake3(data[i : i + SEGMENT]).digest() for i in cuts]
            ),
            "blake2b": _best_gbps(
                lambda: [
                    hashlib.blake2b(data[i : i + SEGMENT], digest_size=32).digest() for i in cuts
                ]
            ),
            "sha256": _best_gbps(
                lambda: [hashlib.sha256(data[i : i + SEGMENT]).digest() for i in cuts]
            ),
            "fresh pages": _best_gbps(fresh_pages),
            "committed pages": _best_gbps(lambda: dst.fill(1)),
        }

    r = benchmark.pedantic(measure, rounds=1, iterations=1)
    print()
    for name, gbps in r.items():
        print(f"{name:>16}: {gbps:6.2f} GB/s ({gbps / r['memcpy']:.3f} x memcpy)")
    print(f"first write to fresh memory: {1 / r['fresh pages']:.2f} ms per MB")  # 1 MB / (GB/s)
    assert r["blake3"] > 0
