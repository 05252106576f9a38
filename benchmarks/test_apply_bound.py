"""The memory-traffic ceiling of applying a sparse delta on one CPU core (docs/DELTA.md).

At density d, a 64-byte line of bf16 weights holds a change with probability 1 - (1 - d)^32;
every such line is read and written whatever the codec. This measures, in the same run, the
memcpy rate of the core, that bound expressed in GB/s of `aurora` payload (2.36 B per change at
2%), and a fused numba loop that does only the escape fix-up, the running sum and the store.

    python -m pytest benchmarks/test_apply_bound.py --benchmark-enable -s
"""

from __future__ import annotations

import time

import numpy as np
import pytest

numba = pytest.importorskip("numba", reason="the fused-loop ceiling needs numba")

N = 193_000_000  # one Qwen3-8B layer of bf16 weights
DENSITY = 0.02
AURORA_BYTES_PER_CHANGE = 2.36  # measured at 2% by `aurora delta bench` (docs/DELTA.md)


@numba.njit(nogil=True, cache=False)
def _fused_store(w, gaps8, escapes, hi, lo):  # type: ignore[no-untyped-def]
    cur = 0
    j = 0
    for i in range(gaps8.size):
        g = np.int64(gaps8[i])
        if g == 0:
            g = escapes[j]
            j += 1
        cur += g
        w[cur] = (np.uint16(hi[i]) << 8) | np.uint16(lo[i])
    return cur


def _best(fn, rounds: int = 5) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@pytest.mark.benchmark(group="apply-bound")
def test_the_cpu_apply_ceiling_at_two_percent(benchmark):
    rng = np.random.default_rng(0)
    w = np.ones(N, dtype=np.uint16)
    dst = np.empty_like(w)
    idx = np.sort(rng.choice(N, int(N * DENSITY), replace=False))
    gaps = np.diff(idx, prepend=0)
    gaps8 = np.where((gaps > 0) & (gaps < 256), gaps, 0).astype(np.uint8)
    escapes = gaps[gaps8 == 0].astype(np.int64)
    vals = rng.integers(0, 2**16, idx.size, dtype=np.uint16)
    hi, lo = (vals >> 8).astype(np.uint8), (vals & 0xFF).astype(np.uint8)
    _fused_store(w, gaps8, escapes, hi, lo)  # compile

    memcpy = 2 * w.nbytes / _best(lambda: np.copyto(dst, w))  # bytes moved per second
    lines = np.unique(idx // 32).size
    traffic = 2 * lines * 64  # every touched line read and written
    payload = idx.size * AURORA_BYTES_PER_CHANGE
    bound = payload / (traffic / memcpy)
    fused = benchmark.pedantic(
        lambda: _best(lambda: _fused_store(w, gaps8, escapes, hi, lo)), rounds=1, iterations=1
    )
    print(
        f"\nlines touched {lines * 32 / N:.1%} of the layer ({traffic / 1e6:.0f} MB of traffic); "
        f"memcpy {memcpy / 1e9:.1f} GB/s -> bound {bound / 1e9:.2f} GB/s of payload; "
        f"fused store loop {idx.size / fused / 1e6:.0f} M changes/s = "
        f"{payload / fused / 1e9:.2f} GB/s of payload; target 1.25 GB/s"
    )
    assert lines > 0
