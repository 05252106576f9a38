"""The memory-traffic ceiling of applying a sparse delta on one CPU core (docs/DELTA.md).

At density d, a 64-byte line of bf16 weights holds a change with probability 1 - (1 - d)^32;
every such line is read and written whatever the codec. The bound is the time that line traffic
(read + write) takes at the core's memcpy rate (read + write), both measured in the same run; a
codec's bound in GB/s of payload is its payload over that time. This file measures, against it,
a bare store loop (no decompression, no checks, no hint) and the store kernel of
:mod:`aurora.delta.kernels` with and without its prefetch hint; ``test_delta_speed.py`` measures
the whole decode + apply.

    taskset -c 0 python -m pytest benchmarks/test_apply_bound.py --benchmark-enable -s
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterable

import numba
import numpy as np
import pytest

from aurora.delta import kernels

N = 193_000_000  # one Qwen3-8B layer of bf16 weights
DENSITY = 0.02
LINE = 64
ROUNDS = 7


def lines_touched(arrays_and_indices: Iterable[tuple[np.ndarray, np.ndarray]]) -> int:
    """Distinct 64-byte lines holding an element at the given (sorted) indices of each array."""
    total = 0
    for arr, idx in arrays_and_indices:
        if idx.size:
            lines = (arr.__array_interface__["data"][0] + idx * arr.itemsize) // LINE
            total += 1 + int(np.count_nonzero(lines[1:] != lines[:-1]))
    return total


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


@numba.njit(nogil=True, cache=False)
def _bare_store(w, gaps8, escapes, hi, lo):  # type: ignore[no-untyped-def]
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


def _without_hint():  # type: ignore[no-untyped-def]
    """``kernels.store_small_gaps`` compiled with its prefetch hint removed, for comparison."""
    src = inspect.getsource(kernels.store_small_gaps.py_func)
    src = src.replace("_prefetch(out, ca - base)", "pass").replace("@_jit\n", "")
    ns = dict(vars(kernels))
    exec(src, ns)  # the kernel's own source, one call removed
    return numba.njit(nogil=True)(ns["store_small_gaps"])


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
    esc = escapes.astype(np.uint64)
    assert kernels.check_small_gaps(gaps8, gaps8[:0], esc, N) == kernels.OK

    no_hint = _without_hint()

    def kernel(fn):  # type: ignore[no-untyped-def]
        st = np.zeros(7, dtype=np.int64)
        fn(w, 0, N, st, gaps8, gaps8[:0], esc, hi, lo, vals[:0], kernels.SPLIT)

    _bare_store(w, gaps8, escapes, hi, lo)  # compile
    kernel(kernels.store_small_gaps)
    kernel(no_hint)
    runs = {
        "memcpy": lambda: np.copyto(dst, w),
        "bare": lambda: _bare_store(w, gaps8, escapes, hi, lo),
        "prefetch": lambda: kernel(kernels.store_small_gaps),
        "no hint": lambda: kernel(no_hint),
    }

    def run():
        best = dict.fromkeys(runs, 1e9)
        for _ in range(ROUNDS):  # interleaved: a burst of load hits them all alike
            for name, fn in runs.items():
                best[name] = min(best[name], timed(fn))
        return best

    best = benchmark.pedantic(run, rounds=1, iterations=1)
    memcpy = 2 * w.nbytes / best["memcpy"]  # bytes moved per second
    lines = lines_touched([(w, idx)])
    t_lines = 2 * lines * LINE / memcpy
    print(
        f"\nlines touched {lines * 32 / N:.1%} of the layer ({2 * lines * LINE / 1e6:.0f} MB of "
        f"traffic); memcpy {memcpy / 1e9:.1f} GB/s -> the lines take {t_lines * 1e3:.1f} ms; "
        f"bare store loop {best['bare'] * 1e3:.1f} ms ({t_lines / best['bare']:.2f} x bound); "
        f"kernels.store_small_gaps {best['prefetch'] * 1e3:.1f} ms "
        f"({t_lines / best['prefetch']:.2f} x bound), the same without its prefetch hint "
        f"{best['no hint'] * 1e3:.1f} ms ({t_lines / best['no hint']:.2f} x bound)"
    )
    assert np.array_equal(w[idx], vals)
