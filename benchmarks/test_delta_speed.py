"""Delta speed, as ratios against memcpy bandwidth measured in the same run (one core).

    python -m pytest benchmarks/test_delta_speed.py --benchmark-enable -s
    AURORA_BENCH_PARAMS=193e6 ...   # one whole Qwen3-8B layer (needs ~3 GB RAM)

Reports GB/s of dense bf16 scanned (extraction) and GB/s of payload (decode + apply), and
each as a fraction of memcpy. Targets (issue): extraction >= 1.5 GB/s, decode+apply >= 1.25 GB/s.
"""

import os

import numpy as np
import pytest

from aurora.codec_bench import shapes_for
from aurora.delta import apply_delta, codecs, encode_delta, read_delta, synthetic, weights_hash
from aurora.delta.extract import changed

PARAMS = float(os.environ.get("AURORA_BENCH_PARAMS", "50e6"))
RESULTS: dict[str, float] = {}


@pytest.fixture(scope="module")
def step():
    shapes = shapes_for(PARAMS)
    lr = synthetic.lr_for_density(0.02)
    old, new = synthetic.make_step(shapes, lr=lr, seed=0)
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


@pytest.mark.parametrize("codec", ["aurora", "leb128", "aurora-base"])
def test_decode_and_apply(benchmark, step, codec):
    old, new = step
    h0 = weights_hash(old)
    data = encode_delta(old, new, model="m", version=1, base_hash=h0, codec=codec)
    d = read_delta(data)
    state = {k: v.copy() for k, v in old.items()}

    def run():
        apply_delta(d, state, active_version=0, active_hash=h0)

    benchmark(run)
    gbs = len(data) / benchmark.stats["min"] / 1e9
    RESULTS[codec] = gbs
    benchmark.extra_info.update(
        {"GB/s payload": gbs, "vs memcpy": gbs / RESULTS["memcpy"], "payload MB": len(data) / 1e6}
    )


def test_verify_whole_file(benchmark, step):
    old, new = step
    data = encode_delta(old, new, model="m", version=1, base_hash=weights_hash(old))
    benchmark(read_delta, data)
    gbs = len(data) / benchmark.stats["min"] / 1e9
    benchmark.extra_info.update({"GB/s payload": gbs, "vs memcpy": gbs / RESULTS["memcpy"]})
    print(
        "\n"
        + "\n".join(
            f"{k:>12}: {v:6.2f} GB/s ({v / RESULTS['memcpy']:.3f} x memcpy)"
            for k, v in RESULTS.items()
        )
    )


def test_codecs_cover_the_benchmark():
    assert {"aurora", "leb128", "aurora-base"} <= set(codecs.CODECS)
