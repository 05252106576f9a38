"""Delta speed on one core, as ratios against references measured in the same run.

    taskset -c 0 python -m pytest benchmarks/test_delta_speed.py --benchmark-enable -s
    AURORA_BENCH_PARAMS=50e6 ...   # a smaller step (default: one Qwen3-8B layer, 193M weights)

Reports GB/s of dense bf16 scanned (extraction) against memcpy, and for each codec the
decode+apply rate in GB/s of payload against the cache-line bound (``_bound.py``: the line
traffic of the changed elements at the memcpy rate, measured interleaved with the applies),
for the compiled CPU path (``apply_delta``, numba) and the torch path (``apply_delta_torch``
into CPU tensors sharing the same memory), and where the compiled path's time goes: parsing
(zstd and the index checks, every record before the first write) and the store. Target:
>= 0.6 of the bound.
"""

import os

import numpy as np
import pytest
from test_apply_bound import LINE, lines_touched, timed

from aurora.codec_bench import shapes_for
from aurora.delta import apply_delta, encode_delta, kernels, read_delta, synthetic, weights_hash
from aurora.delta.apply import (
    COMPILED_MIN_CHANGES,
    parts_of,
    prepare_delta,
    store_prepared,
    use_compiled,
)
from aurora.delta.extract import changed

PARAMS = float(os.environ.get("AURORA_BENCH_PARAMS", "193e6"))
ROUNDS = int(os.environ.get("AURORA_BENCH_ROUNDS", "5"))
CODECS = ("aurora", "leb128", "aurora-base")
RESULTS: dict[str, float] = {}


@pytest.fixture(scope="module")
def step():
    shapes = shapes_for(PARAMS)
    old, new = synthetic.make_step(shapes, lr=synthetic.lr_for_density(0.02), seed=0)
    return old, new


def test_memcpy_reference(benchmark, step):
    old, _ = step
    src = np.concatenate([v.reshape(-1) for v in old.values()])
    dst = np.empty_like(src)
    benchmark(np.copyto, dst, src)
    RESULTS["memcpy"] = src.nbytes / benchmark.stats["min"] / 1e9
    benchmark.extra_info["GB/s"] = RESULTS["memcpy"]


def test_extraction_scan(benchmark, step):
    old, new = step
    nbytes = sum(v.nbytes for v in old.values())

    def run():
        for k in old:
            changed(old[k], new[k])

    benchmark(run)
    gbs = nbytes / benchmark.stats["min"] / 1e9
    RESULTS["extract"] = gbs
    benchmark.extra_info.update({"GB/s dense bf16": gbs, "vs memcpy": gbs / RESULTS["memcpy"]})
    print(f"\nextraction {gbs:.2f} GB/s of dense bf16 = {gbs / RESULTS['memcpy']:.3f} x memcpy")


@pytest.mark.benchmark(group="decode+apply")
def test_decode_and_apply_against_the_cache_line_bound(benchmark, step):
    torch = pytest.importorskip("torch")
    from aurora.delta.torch_apply import apply_delta_torch

    torch.set_num_threads(1)  # one core, like the compiled path (pinned with taskset -c 0)

    old, new = step
    h0 = weights_hash(old)
    files = {c: encode_delta(old, new, model="m", version=1, base_hash=h0, codec=c) for c in CODECS}
    deltas = {c: read_delta(data) for c, data in files.items()}
    state = {k: v.copy() for k, v in old.items()}
    tparams = {k: torch.from_numpy(v.view(np.int16)) for k, v in state.items()}  # same memory
    lines = lines_touched(
        (arr, m.idx[(m.idx >= off) & (m.idx < off + n)] - off)
        for target, change in prepare_delta(deltas["aurora"], state)
        for m in [change.materialize()]
        for arr, off, n in parts_of(target, state)
    )
    big = np.concatenate([v.reshape(-1) for v in old.values()])
    dst = np.empty_like(big)

    prepared: dict = {}

    def reset():
        for k in state:
            np.copyto(state[k], old[k])

    def run():
        best: dict[str, float] = {}

        def note(name, seconds):
            best[name] = min(best.get(name, float("inf")), seconds)

        for _ in range(ROUNDS):  # interleaved: a burst of load hits every measurement alike
            note("memcpy", timed(lambda: np.copyto(dst, big)))
            for c, d in deltas.items():
                reset()
                note(c, timed(lambda d=d: apply_delta(d, state, active_version=0, active_hash=h0)))
                reset()
                t = timed(lambda c=c, d=d: prepared.__setitem__(c, prepare_delta(d, state)))
                note(c + " parse", t)
                note(c + " store", timed(lambda c=c: store_prepared(prepared[c], state)))
                reset()
                t = timed(
                    lambda d=d: apply_delta_torch(d, tparams, active_version=0, active_hash=h0)
                )
                note(c + " torch", t)
        return best

    best = benchmark.pedantic(run, rounds=1, iterations=1)
    reset()
    apply_delta(deltas["aurora"], state, active_version=0, active_hash=h0)
    assert all(np.array_equal(state[k], new[k]) for k in new)
    memcpy = 2 * big.nbytes / best["memcpy"]  # bytes moved (read + write) per second
    t_lines = 2 * lines * LINE / memcpy
    nnz = sum(t.nnz for t in deltas["aurora"].tensors)
    n = sum(v.size for v in old.values())
    path = (
        f"numba {kernels.VERSION} (fused gap/prefix-sum/check/store with prefetch and undo log)"
        if use_compiled([deltas["aurora"]])
        else f"numpy (fewer than {COMPILED_MIN_CHANGES:,} changes)"
    )
    print(
        f"\napply path: {path}; torch {torch.__version__} index_copy_ on CPU, 1 thread\n"
        f"{n / 1e6:.0f}M weights, {nnz / n:.2%} changed; lines touched {lines * 32 / n:.1%} "
        f"({2 * lines * LINE / 1e6:.0f} MB of traffic); memcpy {memcpy / 1e9:.1f} GB/s "
        f"-> the lines take {t_lines * 1e3:.1f} ms; best of {ROUNDS} interleaved rounds"
    )
    print(f"{'codec':<12} {'payload MB':>10} {'bound GB/s':>10} {'numba GB/s':>10} {'x bound':>8}"
          f" {'parse ms':>8} {'store ms':>8} {'torch GB/s':>10} {'x bound':>8}")  # fmt: skip
    for c, data in files.items():
        size = len(data)
        row = (size / t_lines, size / best[c], t_lines / best[c], size / best[c + " torch"])
        benchmark.extra_info[c] = {"GB/s": row[1] / 1e9, "x bound": row[2]}
        print(
            f"{c:<12} {size / 1e6:>10.2f} {row[0] / 1e9:>10.2f} {row[1] / 1e9:>10.2f} "
            f"{row[2]:>8.2f} {best[c + ' parse'] * 1e3:>8.1f} {best[c + ' store'] * 1e3:>8.1f} "
            f"{row[3] / 1e9:>10.2f} {t_lines / best[c + ' torch']:>8.2f}"
        )


def test_verify_whole_file(benchmark, step):
    old, new = step
    data = encode_delta(old, new, model="m", version=1, base_hash=weights_hash(old))
    benchmark(read_delta, data)
    gbs = len(data) / benchmark.stats["min"] / 1e9
    benchmark.extra_info.update({"GB/s payload": gbs, "vs memcpy": gbs / RESULTS["memcpy"]})
    print(f"\nverify (hash every segment) {gbs:.2f} GB/s of payload")


def test_bytes_against_density_for_every_encoding():
    """Sizes are exact (no timing): the table of docs/journal/delta-measurements.md."""
    from aurora.codec_bench import density_sweep, print_density_sweep

    rows = density_sweep()
    print()
    print_density_sweep(rows)
    dense_wins = [r["density"] for r in rows if r["writer aurora-base"].startswith("dense")]
    assert dense_wins and min(dense_wins) > 0.1  # the writer's DENSE_TRY_DENSITY holds
