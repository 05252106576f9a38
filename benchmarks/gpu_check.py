"""The GPU check, in one run: vLLM applies real deltas in place; apply and extraction vs memcpy.

Three modes (``benchmarks/gpu_check.sh`` wraps it; docs/GPU.md): the default needs a CUDA GPU and
vLLM, and fails at once if vLLM cannot be imported (``summary["vllm_ran"]``): it never passes
without the thing it was asked to check; ``--no-vllm`` runs the torch parts on the device;
``--dry-run`` runs all of ``--no-vllm`` on the CPU at small sizes (the test suite runs it). Four
parts: a memcpy reference (:func:`memcpy_gbs`), the Trainer-to-Actor chain checked bit for bit
(:func:`run_chain`), a paper-sized delta's apply (:func:`run_apply`) and the device extraction
(:func:`run_extract`), each throughput also as a ratio to memcpy. Exit status 0 when every check
passed; the summary is printed and written as JSON (``--json``). Nothing outside the standard
library and numpy is imported at module level, and on the ``--no-vllm`` path nothing the GPU host
lacks beyond the three wheels ``benchmarks/gpu_host_wheels.sh`` carries there (zstandard, blake3,
cryptography)."""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

PAPER_DELTA_MB = 202.0
"""The paper's Qwen3-8B delta (§6.3), LEB128 indices with raw bf16 values."""
LOGPROB_TOL = 0.15
"""bf16-vs-fp32 tolerance on per-token log-probs (nats), as tests/test_rl_trainer.py states."""


def _sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn: Any, device: Any, repeat: int = 5) -> float:
    best = math.inf
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def memcpy_gbs(device: str, mb: int) -> float:
    """Device-to-device copy rate (GB/s of bytes copied), best of 5.

    The memcpy reference: a device-to-device copy of ``--memcpy-mb`` MB, best of 5; every
    throughput is also printed as a ratio to it (GB/s of payload over GB/s of memcpy, counting
    bytes copied once, not read + written).
    """
    import torch

    n = mb * 1_000_000 // 2
    src = torch.ones(n, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = _best(lambda: dst.copy_(src), device)
    return 2 * n / t / 1e9


# -- 2. the chain ------------------------------------------------------------------------------


def _tiny_config(dry_run: bool) -> Any:
    from aurora.models import TinyQwen3Config

    if dry_run:
        return TinyQwen3Config()
    # head_dim 64: every vLLM attention backend has kernels for it (some lack 32)
    return TinyQwen3Config(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64
    )


class _WorkerActor:
    """The dry run's Actor: vLLM's worker-side apply on vLLM-shaped parameters on ``device``,
    sampling with the transformers engine on the same weights."""

    def __init__(self, model: Any, tokenizer: Any, published: Any, h: str, device: str) -> None:
        import torch

        from aurora.delta.tp import local_shape
        from aurora.engines import TransformersEngine
        from aurora.engines.base import canonical_state
        from aurora.engines.vllm_layout import ModelShape, rank_layout
        from aurora.engines.vllm_messages import snapshot_bytes
        from aurora.engines.vllm_receiver import DeltaReceiver

        shape = ModelShape.of(model.config)
        canon = canonical_state(published)
        tp = rank_layout(list(canon), shape, 0, 1)
        self.params = {
            k: torch.zeros(
                local_shape(tp.shardings[k], tuple(v.shape), 0, 1),
                dtype=torch.bfloat16,
                device=device,
            )
            for k, v in canon.items()
        }
        self.receiver = DeltaReceiver(self.params, shape)
        self.receiver.init({"version": 0, "weights_hash": h})
        self.receiver.update(
            {"snapshot": snapshot_bytes(published), "version": 0, "weights_hash": h}
        )
        self.sampler = TransformersEngine(copy.deepcopy(model), tokenizer, weights_hash=h, seed=0)
        self.sampler.load(published, version=0, weights_hash=h)
        self.shape = shape
        self.version, self.weights_hash = 0, h

    def generate(self, prompts: list[str], n: int, sampling: Any) -> Any:
        return self.sampler.generate(prompts, n, sampling)

    def apply(self, delta: Any) -> str:
        from aurora.engines.vllm_messages import delta_bytes

        h = self.receiver.update({"delta": delta_bytes(delta), "expected_hash": delta.weights_hash})
        self.sampler.apply(delta)
        self.version, self.weights_hash = delta.version, h
        return h

    def weights_digest(self) -> str:
        from aurora.engines import weights_digest_of
        from aurora.engines.vllm_layout import assemble_ranks
        from aurora.engines.vllm_messages import rank_state_message, ranks_from_messages

        msg = rank_state_message(self.receiver)
        return str(weights_digest_of(assemble_ranks(ranks_from_messages([msg]), self.shape)))


def _varied(prompt: str, completion: str) -> float:
    """A reward that differs between almost any two completions, so every group carries signal
    and every step changes weights (the task's own reward is 0 for an untrained model, and a
    step on a batch without signal is skipped)."""
    return (sum(map(ord, completion)) % 97) / 96


def run_chain(
    device: str,
    deltas: int,
    dry_run: bool,
    use_vllm: bool,
    prompts: int = 8,
    n: int = 4,
    eager: bool = False,
) -> dict[str, Any]:
    """A tiny Qwen3 (built from its config, ``save_pretrained`` to a temporary directory: no
    download) trained by the GRPO Trainer on the device (bf16 autocast over the fp32 master,
    extraction on the device) and an Actor that runs it: ``vllm.LLM`` with the ``aurora_delta``
    weight-transfer backend when vLLM and a GPU are present, otherwise (``--dry-run``) the same
    worker-side apply (:class:`aurora.engines.vllm_receiver.DeltaReceiver`, what the backend
    wraps) on parameters laid out as vLLM's (fused q/k/v and gate/up, padded vocabulary) on the
    device, sampling with the transformers engine. For each of ``--deltas`` steps: the Actor
    samples groups, the Trainer steps on them and publishes D_{v+1}, the Actor applies it in
    place; the check is that the Actor's h(v) equals the Trainer's, the bits it holds (read back
    from every rank) hash as the Trainer's published weights, and the Actor's per-token
    log-probs match a transformers model on the same weights (the Trainer's
    ``recompute_logprobs`` of its published bf16 weights: fp32 on the CPU, bf16 autocast on a
    GPU) within the bf16 tolerance (0.15 nats per token, ``tests/test_rl_trainer.py``)."""
    from aurora.delta import read_delta
    from aurora.engines import Sampling
    from aurora.models import build_default, save_pretrained
    from aurora.rl.tasks import ArithmeticTask
    from aurora.rl.trainer import Group, GRPOConfig, Trainer

    task = ArithmeticTask()
    model, tok = build_default(_tiny_config(dry_run))
    trainer = Trainer(
        copy.deepcopy(model).to(device),
        tok,
        _varied,
        GRPOConfig(lr=2e-4),
        device_extract=True,
    )
    if use_vllm:
        from aurora.engines.vllm import VLLMEngine

        d = Path(tempfile.mkdtemp(prefix="aurora-gpu-check-")) / "m"
        save_pretrained(model, tok, d, state=trainer.published)
        t0 = time.perf_counter()
        # as production runs it: torch.compile and CUDA graphs on, unless --eager; the in-place
        # apply must reach the weights the captured graphs read
        actor: Any = VLLMEngine.launch(
            d,
            weights_hash=trainer.weights_hash,
            seed=0,
            gpu_memory_utilization=0.3,
            enforce_eager=eager,
        )
        start_s = time.perf_counter() - t0
    else:
        actor = _WorkerActor(model, tok, trainer.published, trainer.weights_hash, device)
        start_s = 0.0
    out: dict[str, Any] = {
        "actor": type(actor).__name__,
        "vllm_eager": eager if use_vllm else None,
        "start_s": round(start_s, 1),
        "steps": [],
    }
    ok = actor.weights_digest() == trainer.published_digest()
    out["v0_digest_equal"] = ok
    for k in range(deltas):
        texts = task.prompts(k * prompts, prompts)
        s = Sampling(max_new_tokens=task.max_new_tokens, temperature=1.0, seed=k)
        groups = [
            Group(prompt=p, completions=g, version=actor.version)
            for p, g in zip(texts, actor.generate(texts, n, s), strict=True)
        ]
        # log-probs the Actor reported vs a transformers model on the same weights
        again = trainer.recompute_logprobs(groups, state=trainer.published)
        worst = max(
            abs(x - y)
            for g, r in zip(groups, again, strict=True)
            for c, lp in zip(g.completions, r, strict=True)
            for x, y in zip(c.logprobs, lp, strict=True)
        )
        stats = trainer.step(groups)
        pub = trainer.publish()
        t0 = time.perf_counter()
        h = actor.apply(read_delta(pub.data))
        _sync(device)
        apply_s = time.perf_counter() - t0
        hash_ok = h == trainer.weights_hash == actor.weights_hash
        digest_ok = actor.weights_digest() == trainer.published_digest()
        step = {
            "version": pub.version,
            "reward": round(stats.reward_mean, 4),
            "changed": pub.changed,
            "density": round(pub.density, 4),
            "bytes": len(pub.data),
            "publish_s": round(pub.seconds, 4),
            "apply_s": round(apply_s, 4),
            "hash_equal": hash_ok,
            "digest_equal": digest_ok,
            "logprob_max_diff": round(worst, 4),
        }
        out["steps"].append(step)
        print(f"  v{pub.version}: {step}", flush=True)
        ok = ok and hash_ok and digest_ok and worst <= LOGPROB_TOL and pub.changed > 0
    out["ok"] = bool(ok) and len(out["steps"]) == deltas
    if use_vllm:
        actor.close()
    return out


# -- 3./4. throughput --------------------------------------------------------------------------


def _layer(scale: int, density: float) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(old, new) bf16 bits of one Qwen3-8B decoder layer (its shapes divided by ``scale``)
    after one synthetic step changing ``density`` of the elements."""
    from aurora.delta import synthetic

    shapes = {k: tuple(max(1, d // scale) for d in v) for k, v in synthetic.QWEN3_8B_LAYER.items()}
    lr = synthetic.lr_for_density(density, sample=200_000)
    return synthetic.make_step(shapes, lr=lr, seed=1)


def run_apply(
    device: str,
    old: dict[str, np.ndarray],
    new: dict[str, np.ndarray],
    delta_mb: float,
    max_layers: int,
    memcpy: float,
) -> dict[str, Any]:
    """A delta of ``delta_mb`` MB (the layer's LEB128 records under as many layer names as it
    takes, at most ``max_layers``) applied by index into bf16 parameters on the device.

    A Qwen3-8B-sized delta in the paper's format (LEB128 indices, raw values): one synthetic
    Qwen3-8B decoder layer stepped to ``--density`` (:mod:`aurora.delta.synthetic`), its records
    repeated under the names of as many layers as make ``--delta-mb`` MB (202: the paper's
    Qwen3-8B delta), applied by index into bf16 parameters on the device
    (:func:`aurora.delta.apply_delta_torch`: decode on the CPU, indices and values moved once
    per tensor, ``index_copy_`` into the parameter viewed as int16). Reported: seconds, payload
    GB/s, and the bf16 bytes written per second against memcpy.
    """
    import dataclasses

    import torch

    from aurora.delta import DeltaEncoder, apply_delta_torch, encode_records, read_delta

    enc = DeltaEncoder(old, new, model="q8b", version=1, base_hash="00" * 32, codec="leb128")
    one = b"".join(s.data for s in enc.segments())
    layer_bytes = len(one)
    layers = max(1, min(max_layers, math.ceil(delta_mb * 1e6 / layer_bytes)))
    records, params = [], {}
    for i in range(layers):
        for td in enc.tensors:
            name = td.name.replace("layers.0.", f"layers.{i}.")
            records.append(dataclasses.replace(td, name=name))
        for k, v in old.items():
            t = torch.from_numpy(v.view(np.int16).copy()).to(device).view(torch.bfloat16)
            params[k.replace("layers.0.", f"layers.{i}.")] = t
    data = encode_records(records, model="q8b", version=1, base_hash="00" * 32)
    delta = read_delta(data)
    _sync(device)
    t0 = time.perf_counter()
    apply_delta_torch(delta, params, active_version=0, active_hash="00" * 32)
    _sync(device)
    secs = time.perf_counter() - t0
    # bit-exact: every layer now holds the new weights
    exact = all(
        torch.equal(
            params[k.replace("layers.0.", f"layers.{i}.")].view(torch.int16).cpu(),
            torch.from_numpy(v.view(np.int16)),
        )
        for i in (0, layers - 1)
        for k, v in new.items()
    )
    changed = sum(t.nnz for t in delta.tensors)
    gbs = len(data) / secs / 1e9
    written = 2 * changed / secs / 1e9
    return {
        "layers": layers,
        "delta_mb": round(len(data) / 1e6, 2),
        "changed": changed,
        "seconds": round(secs, 4),
        "payload_gbs": round(gbs, 4),
        "bf16_written_gbs": round(written, 4),
        "written_vs_memcpy": round(written / memcpy, 5),
        "seconds_for_paper_202mb": round(secs * PAPER_DELTA_MB * 1e6 / len(data), 3),
        "bit_exact": bool(exact),
    }


def run_extract(
    device: str, old: dict[str, np.ndarray], new: dict[str, np.ndarray], memcpy: float
) -> dict[str, Any]:
    """:class:`DeviceDeltaEncoder` on one layer whose old and new bf16 weights are on the
    device; its bytes must equal the host encoder's.

    :class:`aurora.rl.device.DeviceDeltaEncoder` on the same layer's old and new bf16 weights on
    the device: seconds on the device (compare, nonzero, gather, sparse copy to the host) as
    GB/s of weights compared (2 bytes per element) against memcpy, and the whole publish of the
    layer (with encoding on the host).
    """
    import torch

    from aurora.delta import DeltaEncoder
    from aurora.rl.device import DeviceDeltaEncoder

    dev_old = {
        k: torch.from_numpy(v.view(np.int16).reshape(-1).copy()).to(device) for k, v in old.items()
    }
    dev_new = {
        k: torch.from_numpy(v.view(np.int16).reshape(-1).copy()).to(device) for k, v in new.items()
    }
    kw: dict[str, Any] = dict(model="q8b", version=1, base_hash="00" * 32)
    best: tuple[float, float, bytes] | None = None
    for _ in range(3):
        enc = DeviceDeltaEncoder(
            dev_old,
            dev_new.__getitem__,
            {k: v.shape for k, v in old.items()},
            host_old=old.__getitem__,
            **kw,
        )
        _sync(device)
        t0 = time.perf_counter()
        data = b"".join(s.data for s in enc.segments())
        total = time.perf_counter() - t0
        if best is None or enc.extract_s < best[0]:
            best = (enc.extract_s, total, data)
    assert best is not None
    host = b"".join(s.data for s in DeltaEncoder(old, new, **kw).segments())
    numel = sum(v.size for v in old.values())
    compared = 2 * numel / best[0] / 1e9  # GB/s of bf16 weights compared
    return {
        "params": numel,
        "extract_s": round(best[0], 4),
        "publish_s": round(best[1], 4),
        "compared_gbs": round(compared, 3),
        "compared_vs_memcpy": round(compared / memcpy, 4),
        "delta_mb": round(len(best[2]) / 1e6, 3),
        "bytes_equal_host": best[2] == host,
    }


def main(argv: list[str] | None = None) -> int:
    """Modes:

    * default: on a CUDA GPU with vLLM installed. vLLM runs the chain once, with torch.compile and
      CUDA graphs on as production runs it (``--eager`` turns them off). If vLLM cannot be
      imported the check fails at once: it never passes without the thing it was asked to check
      (``summary["vllm_ran"]``).
    * ``--no-vllm``: the torch parts on the device, for a host without vLLM (the project's H200
      image): the device apply, the device extraction and the Trainer on CUDA, with the chain's
      Actor being vLLM's worker-side apply (:func:`run_chain`).
    * ``--dry-run``: all of ``--no-vllm`` on the CPU at small sizes (the test suite runs it).

    ``--device cpu`` without ``--dry-run`` runs the chain on vLLM's CPU build when that is
    installed (``--eager`` then; compile on CPU is not what production runs)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, small sizes, no vLLM")
    p.add_argument(
        "--no-vllm",
        action="store_true",
        help="the torch parts only (a host without vLLM): the chain's Actor is vLLM's "
        "worker-side apply on vLLM-shaped parameters",
    )
    p.add_argument(
        "--eager", action="store_true", help="vLLM without torch.compile and CUDA graphs"
    )
    p.add_argument("--device", default=None, help="default: cuda (cpu with --dry-run)")
    p.add_argument("--deltas", type=int, default=5, help="consecutive deltas applied (>= 5)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step of the chain")
    p.add_argument("--group", type=int, default=4, help="completions per prompt")
    p.add_argument("--density", type=float, default=0.01, help="changed share of the 8B layer")
    p.add_argument("--delta-mb", type=float, default=PAPER_DELTA_MB, help="apply benchmark size")
    p.add_argument("--scale", type=int, default=None, help="divide the 8B layer's dims (1; 16)")
    p.add_argument("--max-layers", type=int, default=None, help="layers at most (36; 2)")
    p.add_argument("--memcpy-mb", type=int, default=None, help="memcpy size (1024; 64)")
    p.add_argument("--json", default=None, help="write the summary here")
    args = p.parse_args(argv)
    import torch

    device = args.device or ("cpu" if args.dry_run else "cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(
            f"gpu_check: --device {device}: no CUDA GPU is visible (use --dry-run)", file=sys.stderr
        )
        return 2
    scale = args.scale or (16 if args.dry_run else 1)
    max_layers = args.max_layers or (2 if args.dry_run else 36)
    # vLLM runs unless told otherwise, and then it must run: a check that asked for vLLM and
    # passed without it would certify nothing about it
    use_vllm = not (args.dry_run or args.no_vllm)
    vllm_version = None
    if use_vllm:
        try:
            import vllm

            vllm_version = str(vllm.__version__)
        except Exception as exc:  # ImportError, or a broken dependency's RuntimeError
            print(
                f"gpu_check: FAIL: vLLM was asked for but cannot be imported ({type(exc).__name__}:"
                f" {str(exc)[:160]}); pass --no-vllm to run the torch parts only",
                file=sys.stderr,
            )
            return 1
    torch.manual_seed(0)
    summary: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "vllm": vllm_version,
        "mode": "dry-run" if args.dry_run else ("vllm" if use_vllm else "no-vllm"),
        "dry_run": args.dry_run,
    }
    t_all = time.perf_counter()
    memcpy = memcpy_gbs(device, args.memcpy_mb or (64 if args.dry_run else 1024))
    summary["memcpy_gbs"] = round(memcpy, 2)
    print(f"memcpy: {memcpy:.1f} GB/s on {summary['device']}", flush=True)
    print(f"chain: {args.deltas} deltas", flush=True)
    t0 = time.perf_counter()
    summary["chain"] = run_chain(
        device, args.deltas, args.dry_run, use_vllm, args.prompts, args.group, args.eager
    )
    # True only when vLLM itself generated and applied every delta of the chain
    summary["vllm_ran"] = (
        summary["chain"]["actor"] == "VLLMEngine" and len(summary["chain"]["steps"]) == args.deltas
    )
    summary["chain"]["seconds"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    old, new = _layer(scale, args.density)
    summary["layer_s"] = round(time.perf_counter() - t0, 1)
    summary["apply"] = run_apply(device, old, new, args.delta_mb, max_layers, memcpy)
    print(f"apply: {summary['apply']}", flush=True)
    summary["extract"] = run_extract(device, old, new, memcpy)
    print(f"extract: {summary['extract']}", flush=True)
    summary["seconds"] = round(time.perf_counter() - t_all, 1)
    ok = (
        summary["chain"]["ok"]
        and (summary["vllm_ran"] or not use_vllm)
        and summary["apply"]["bit_exact"]
        and summary["extract"]["bytes_equal_host"]
        and args.deltas >= 5
    )
    summary["ok"] = bool(ok)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print("gpu_check: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
