"""The warm start: supervised pre-training of the default model, cached as the v0 snapshot.

Theory of operation
-------------------
RL post-training starts from a model that is already partly competent (the paper's models are
pretrained). For the built-in tiny Qwen3 that competence comes from a short supervised run on
the task (:func:`pretrain`). Competence arrives abruptly and at a step that varies by seed
(``docs/journal/early-measurements.md``), so the run stops at an accuracy *threshold* of the
bf16-rounded weights on a validation set, not at a step count; not reaching it within
``max_steps`` is an error. The result is cached as the v0 snapshot in the Checkpoint Store's
format, keyed by the whole configuration and the library versions (:func:`warm_start`), and a
run that fails publishes nothing.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aurora.engines.base import Sampling
from aurora.engines.transformers import TransformersEngine
from aurora.models import TinyQwen3Config, build_default, load_state
from aurora.rl.tasks import ArithmeticConfig, ArithmeticTask, score, solve
from aurora.rl.trainer import named_weights, to_bf16_bits
from aurora.store import CheckpointStore
from aurora.store.files import write_atomic

WARMSTART_FORMAT = 1
"""Bumped when the procedure changes, so old caches are not reused."""


class WarmStartError(RuntimeError):
    """The warm start did not reach its threshold (nothing was cached)."""


@dataclass(frozen=True, kw_only=True)
class WarmStartConfig:
    """Supervised pre-training of the default model (the recipe measured in
    ``docs/journal/early-measurements.md``)."""

    model: TinyQwen3Config = field(default_factory=TinyQwen3Config)
    """The model to build and pre-train."""
    task: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    """The task (its operand range; its held-out set is never used here)."""
    data_seed: int = 1_000_003
    """Seed of the supervised problem stream (and, +1, of the validation set)."""
    lr: float = 3e-3
    """AdamW learning rate after warm-up."""
    warmup_steps: int = 100
    """Linear learning-rate warm-up, steps."""
    batch_size: int = 128
    """Problems per step."""
    grad_clip: float = 1.0
    """Max global gradient norm."""
    threshold: float = 0.30
    """Greedy exact-match accuracy on the validation set at which to stop."""
    eval_every: int = 25
    """Steps between validation checks."""
    max_steps: int = 800
    """Give up (error) if the threshold is not reached by then."""
    validation_size: int = 256
    """Validation problems (drawn from the training distribution)."""

    def __post_init__(self) -> None:
        checks = {
            "lr": self.lr >= 0,
            "warmup_steps": self.warmup_steps >= 0,
            "batch_size": self.batch_size >= 1,
            "grad_clip": self.grad_clip > 0,
            "eval_every": self.eval_every >= 1,
            "max_steps": self.max_steps >= 1,
            "validation_size": self.validation_size >= 1,
            "threshold": self.threshold >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"WarmStartConfig.{name}: invalid value {getattr(self, name)!r}")

    def key(self) -> str:
        """Hash of everything the cached weights depend on."""
        import transformers

        blob = {
            "format": WARMSTART_FORMAT,
            "config": dataclasses.asdict(self),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }
        return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class WarmStart:
    """A warm-started default model."""

    model: Any
    """fp32 model holding exactly the bf16 snapshot's values."""
    tokenizer: Any
    state: dict[str, np.ndarray]
    """The v0 snapshot: ``{split name: bf16 bits as uint16}``."""
    weights_hash: str
    """h(v0): the snapshot's weights hash."""
    info: dict[str, Any]
    """steps, validation accuracy, seconds, key."""
    path: Path
    """Root of the Checkpoint Store holding the snapshot."""
    cached: bool
    """True when it was read from the cache."""


def default_cache() -> Path:
    """``$AURORA_CACHE`` or ``~/.cache/aurora``."""
    return Path(os.environ.get("AURORA_CACHE") or Path.home() / ".cache" / "aurora")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.mkdir(parents=True, exist_ok=True)
    with open(path / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def warm_start(
    config: WarmStartConfig | None = None,
    *,
    cache_dir: str | Path | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> WarmStart:
    """The warm-started default model: from the cache, or pre-trained and cached now.
    ``on_step(step, loss)`` is called after each supervised step (progress, tests).

    The result is cached as the v0 snapshot in the Checkpoint Store's format
    (:meth:`aurora.store.CheckpointStore.publish_snapshot`: safetensors, BF16, its weights hash
    in the metadata, written atomically) under ``<cache>/warmstart/<key>/`` where ``key`` hashes
    the whole configuration and the library versions, so it is rebuilt only when one of them
    changes. A file lock serialises processes that warm-start at once (the second one finds the
    snapshot). A run that fails or is interrupted publishes nothing: no half-written snapshot."""
    cfg = config or WarmStartConfig()
    root = Path(cache_dir) if cache_dir is not None else default_cache()
    path = root / "warmstart" / cfg.key()
    with _locked(path):
        store = CheckpointStore(path)
        model, tokenizer = build_default(cfg.model)
        if 0 in store.list().snapshots:
            state, h = store.snapshot(0)
            load_state(model, state)
            info_path = path / "warmstart.json"
            info = json.loads(info_path.read_text()) if info_path.exists() else {}
            return WarmStart(model, tokenizer, state, h, info, path, cached=True)
        t0 = time.perf_counter()
        steps, acc = pretrain(model, tokenizer, cfg, on_step=on_step)
        state = to_bf16_bits(named_weights(model))
        load_state(model, state)  # the master starts exactly at the published v0
        info = {
            "key": cfg.key(),
            "steps": steps,
            "validation_accuracy": acc,
            "seconds": time.perf_counter() - t0,
            "config": dataclasses.asdict(cfg),
        }
        write_atomic(path / "warmstart.json", [json.dumps(info, indent=2).encode()])
        h = store.publish_snapshot(0, state)  # last: its presence marks a complete cache entry
        return WarmStart(model, tokenizer, state, h, info, path, cached=False)


def _sft_batch(tokenizer: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
    """Right-padded ``<bos> prompt answer <eos>`` rows; labels only on answer and ``<eos>``."""
    full = tokenizer([p + solve(p) for p in prompts]).input_ids
    lens = [len(x) for x in tokenizer(prompts).input_ids]
    eos = tokenizer.eos_token_id
    rows = [list(f) + [eos] for f in full]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, n) in enumerate(zip(rows, lens, strict=True)):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
        labels[i, n : len(r)] = torch.tensor(r[n:])
    return {"input_ids": ids, "attention_mask": attn, "labels": labels}


def pretrain(
    model: Any,
    tokenizer: Any,
    cfg: WarmStartConfig,
    *,
    on_step: Callable[[int, float], None] | None = None,
) -> tuple[int, float]:
    """Supervised steps until the bf16 weights reach ``cfg.threshold`` greedy validation
    accuracy; returns (steps, accuracy). Raises :class:`WarmStartError` past ``max_steps``.

    Cross-entropy on the answer tokens (digits and ``<eos>``) of problems from a data stream of
    their own (``data_seed``), AdamW with a linear warm-up and gradient clipping. Every
    ``eval_every`` steps the bf16-rounded weights (what the Actors will hold) are evaluated
    greedily on a validation set drawn from the training distribution (never the task's
    held-out set, which stays untouched for the RL evaluation), and the first time they reach
    ``threshold`` the run stops."""
    data = ArithmeticTask(dataclasses.replace(cfg.task, seed=cfg.data_seed))
    validation = ArithmeticTask(dataclasses.replace(cfg.task, seed=cfg.data_seed + 1)).prompts(
        0, cfg.validation_size
    )
    probe = TransformersEngine(copy.deepcopy(model), tokenizer)
    greedy = Sampling(max_new_tokens=data.max_new_tokens, temperature=0.0)

    def accuracy() -> float:
        probe.load(to_bf16_bits(named_weights(model)), version=0, weights_hash="0" * 64)
        out = probe.generate(validation, 1, greedy)
        return float(
            np.mean(
                [score(data.reward, p, g[0].text) for p, g in zip(validation, out, strict=True)]
            )
        )

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(cfg.warmup_steps, 1))
    )
    model.train()
    acc = 0.0
    for step in range(1, cfg.max_steps + 1):
        batch = _sft_batch(tokenizer, data.prompts((step - 1) * cfg.batch_size, cfg.batch_size))
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step(step, loss.item())
        if step % cfg.eval_every == 0:
            acc = accuracy()
            if acc >= cfg.threshold:
                model.eval()
                return step, acc
    raise WarmStartError(
        f"warm start did not reach {cfg.threshold:.0%} greedy validation accuracy in "
        f"{cfg.max_steps} steps (last {acc:.1%}); raise WarmStartConfig.max_steps or lr"
    )
