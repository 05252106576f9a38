"""``aurora delta bench``: every codec on a synthetic step shaped like Qwen3-8B layers.

For each density, builds one Adam-like step (``synthetic``), writes it with each codec through
the real file format (fused names, segments, trailer), reads it back, verifies and applies it,
checks the result is bit-identical to the Trainer's bf16 weights, and reports bytes per changed
weight beside the paper's numbers. Writes ``results/delta_bench/codecs.csv`` and one sample
delta file you can ``aurora delta inspect``.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import numpy as np

from aurora.delta import DeltaEncoder, apply_delta, codecs, read_delta, synthetic, weights_hash
from aurora.provenance import git_sha
from aurora.store.files import write_atomic

PAPER_BYTES_PER_NNZ = {"naive": 414 / 202 * 3.08, "leb128": 3.08}
"""Paper, Fig. 11: naive int32/64 414 MB vs LEB128 202 MB for one Qwen3-8B step. The per-change
size of the paper's format at 2% density is 3.08 B (2 B value + 1.08 B LEB128 gap, see
docs/journal/early-measurements.md); the naive figure scales it by 414/202."""


BENCH_CODECS = tuple(c for c in codecs.CODECS if c not in ("dense", "dense-base"))
"""Every codec but the whole-tensor ones, which are 20-60x larger at the 1-2% this bench runs
(:func:`density_sweep` measures them where they matter)."""


def shapes_for(params: float) -> dict[str, tuple[int, ...]]:
    """Qwen3-8B layer tensors with the row count scaled so the total is about ``params``."""
    full = synthetic.QWEN3_8B_LAYER
    total = sum(int(np.prod(s)) for s in full.values())
    scale = min(1.0, params / total)
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in full.items():
        if len(shape) == 2:
            rows = max(8, int(round(shape[0] * scale / 8)) * 8)
            out[name] = (rows, shape[1])
        else:
            out[name] = shape
    return out


def run_codec_bench(
    *, params: float, densities: list[float], out: str, seed: int = 0
) -> list[dict]:
    shapes = shapes_for(params)
    n = sum(int(np.prod(s)) for s in shapes.values())
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    rows = []
    sha = git_sha()
    print(f"synthetic Qwen3-8B-shaped step: {n / 1e6:.1f}M bf16 params, seed {seed}")
    for target in densities:
        lr = synthetic.lr_for_density(target, seed=seed)
        old, new = synthetic.make_step(shapes, lr=lr, seed=seed)
        h0 = weights_hash(old)
        h_new = weights_hash(new)
        nnz = sum(int(np.count_nonzero(old[k] != new[k])) for k in old)
        print(f"\ndensity {nnz / n:.3%} ({nnz:,} changed)   lr={lr:.3g}")
        print(
            f"  {'codec':<14} {'bytes':>12} {'B/change':>9} {'vs leb128':>9} {'paper@2%':>8}"
            "  bit-exact"
        )
        sizes = {}
        for name in BENCH_CODECS:
            enc = DeltaEncoder(
                old, new, model="synthetic-qwen3-8b", version=1, base_hash=h0, codec=name
            )
            data = b"".join(s.data for s in enc.segments())
            d = read_delta(data, expected_hash=enc.weights_hash)
            state = {k: v.copy() for k, v in old.items()}
            apply_delta(d, state, active_version=0, active_hash=h0)
            exact = weights_hash(state) == h_new
            assert exact, f"{name} did not round-trip bit-exactly"
            sizes[name] = len(data)
            if name == codecs.DEFAULT_CODEC and target == densities[-1]:
                write_atomic(outdir / "sample_v1.delta", [data])
            rows.append(
                {
                    "codec": name,
                    "params": n,
                    "density": nnz / n,
                    "nnz": nnz,
                    "bytes": len(data),
                    "bytes_per_nnz": len(data) / nnz,
                    "bit_exact": exact,
                    "seed": seed,
                    "lr": lr,
                    "git_sha": sha,
                }
            )
        for name, size in sizes.items():
            paper = PAPER_BYTES_PER_NNZ.get(name)
            print(
                f"  {name:<14} {size:>12,} {size / nnz:>9.3f} {size / sizes['leb128']:>9.2f} "
                f"{(f'{paper:.2f}' if paper else '-'):>8}  yes"
            )
    with open(outdir / "codecs.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(
        f"\nwrote {outdir / 'codecs.csv'} and {outdir / 'sample_v1.delta'} "
        f"(try: aurora delta inspect {os.path.join(out, 'sample_v1.delta')})"
    )
    return rows


SWEEP_DENSITIES = (1e-4, 1e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0)
"""0.01% to 100% of the elements changed (``docs/journal/delta-measurements.md``)."""


def density_sweep(
    shape: tuple[int, ...] = (4096, 4096),
    densities: tuple[float, ...] = SWEEP_DENSITIES,
    seed: int = 0,
) -> list[dict]:
    """Bytes of one tensor's change with every encoding, and the writer's choice, per density.

    Below 50% the step is the Adam-like N(0, 1) one; from 50% Adam's first step (every weight
    moves by exactly lr, ``synthetic.step(first=True)``); 100% is the first step at lr 1e-3, two
    ULPs of the largest weights (the CPU demo's RL lr, 5e-4, changed 99.6% on its first step).
    Sizes are exact; each decodes bit-exactly (checked).
    """
    from aurora.delta.extract import FusedTensor, Part
    from aurora.delta.writer import encode_tensor

    numel = int(np.prod(shape))
    t = FusedTensor("w", shape, (Part("w", 0, numel, shape),))
    rows = []
    for target in densities:
        first = target >= 0.5
        lr = 1e-3 if target >= 1.0 else synthetic.lr_for_density(target, seed=seed, first=first)
        old, new = synthetic.make_step({"w": shape}, lr=lr, seed=seed, first=first)
        o, n = old["w"].reshape(-1), new["w"].reshape(-1)
        idx = np.flatnonzero(o != n)
        row: dict = {"density": idx.size / numel, "numel": numel, "nnz": int(idx.size)}

        def whole_old(o: np.ndarray = o) -> np.ndarray:
            return o

        for name, c in codecs.CODECS.items():
            streams = c.encode(idx, n[idx], o[idx], numel, whole_old)
            got = c.decode(streams, idx.size, numel, o, name)
            assert np.array_equal(got[0], idx) and np.array_equal(got[1], n[idx]), name
            row[name] = sum(map(len, streams))
        for family in codecs.FAMILIES:
            td = encode_tensor(t, idx, n[idx], o[idx], family, whole_old)
            row[f"writer {family}"] = f"{td.codec} {td.nbytes}"
        rows.append(row)
    return rows


def print_density_sweep(rows: list[dict]) -> None:
    names = list(codecs.CODECS)
    print(f"bytes per element of a {rows[0]['numel']:,}-element bf16 tensor (2 B raw)")
    print(f"{'density':>8} " + " ".join(f"{n:>13}" for n in names) + "  writer: aurora / -base")
    for r in rows:
        cells = " ".join(f"{r[n] / r['numel']:>13.4f}" for n in names)
        picks = " / ".join(r[f"writer {f}"].split()[0] for f in codecs.FAMILIES)
        print(f"{r['density']:>8.4%} {cells}  {picks}")
