"""The GRPO Trainer: fp32 master weights, AdamW, bf16 published versions as delta checkpoints.

Theory of operation
-------------------
Input is asynchronous and lease-based: :meth:`Trainer.step` takes *groups*, each one prompt's
G completions as an Actor sampled them (token ids and the per-token log-probs of the sampling
distribution, the *behaviour* log-probs) with the version v_g they were generated on. Groups
from versions older than ``version - max_lag`` or newer than ``version`` are refused. The
Trainer never trusts an Actor's text or reward: it decodes the completion's token ids with its
own tokenizer (the text before end-of-sequence) and scores ``reward(prompt, text)`` itself.

The objective (GRPO with the token-level mean; symbols as in docs/RL.md): for group g with
rewards r_1..r_G,

    A_i = (r_i - mean(r)) / (std(r) + eps_A)            (std unbiased; A_i = 0 when G = 1)
    rho_t = exp(log pi_theta(y_t | y_<t) - log pi_b(y_t | y_<t))
    L = -(1 / sum_i |y_i|) * sum_i sum_t min(rho_t A_i, clip(rho_t, 1 - eps_lo, 1 + eps_hi) A_i)
        + beta * (1 / sum_i |y_i|) * sum_i sum_t KL_t

with log pi computed at the sampling temperature (logits / T), pi_b the behaviour policy the
Actor recorded (so the ratio also corrects for bf16-vs-fp32 and version lag), the sums over every
completion token of the batch (the end-of-sequence token included), and KL_t the k3 estimator
``exp(q - p) - (q - p) - 1`` to the frozen starting weights (off: beta = 0 by default). One
AdamW step per call on the fp32 master weights, after clipping the global gradient norm. A batch
whose advantages are all zero carries no signal: with beta = 0 the step is skipped, so the
policy does not drift on Adam's momentum alone.

:meth:`Trainer.publish` rounds the master weights to bf16 and extracts ``D_{v+1}`` against the
last published bf16 weights with :class:`aurora.delta.DeltaEncoder` (exact 16-bit comparison,
fused names, cut into segments while it extracts; each segment can be handed to the data plane
the moment it exists). The Trainer commits the new version only after the trailer, so a failure
leaves it at v with nothing published.

:meth:`Trainer.save_checkpoint` writes everything the next delta depends on (master weights,
AdamW state, generator state, version, h(v), the published bf16 weights, the reference weights
when beta > 0) in one file, atomically; a Trainer restored with :meth:`Trainer.load_checkpoint`
produces the same next delta bytes as one that never stopped.
"""

from __future__ import annotations

import dataclasses
import io
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from aurora.delta import DEFAULT_SEGMENT_SIZE, DeltaEncoder, Segment, weights_hash
from aurora.delta.codecs import DEFAULT_CODEC
from aurora.engines.base import weights_digest_of
from aurora.rl.model import cast_weights
from aurora.rl.tasks import RewardFn, score

CHECKPOINT_FORMAT = 1


@dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    """GRPO and optimizer hyperparameters (defaults and why: docs/RL.md)."""

    lr: float
    """AdamW learning rate (per step). No default: it decides both learning and delta density."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW moment decay rates."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay (0: a zero-advantage batch leaves the weights alone)."""
    adam_eps: float = 1e-8
    """AdamW denominator epsilon."""
    clip_eps: float = 0.2
    """Lower clip of the importance ratio: 1 - clip_eps."""
    clip_eps_high: float | None = None
    """Upper clip 1 + clip_eps_high (DAPO's clip-higher); None: the same as ``clip_eps``."""
    grad_clip: float = 1.0
    """Max global gradient L2 norm (0: no clipping)."""
    kl_coef: float = 0.0
    """beta of the k3 KL penalty to the starting weights (0: off, no reference kept)."""
    temperature: float = 1.0
    """Sampling temperature the Actors use; the Trainer's log-probs use the same."""
    adv_eps: float = 1e-6
    """eps_A added to the group's reward std."""
    scale_by_std: bool = True
    """Divide advantages by the group's std (GRPO); False gives Dr. GRPO's mean-only centring."""
    max_lag: int = 1
    """Oldest accepted generation version is ``version - max_lag`` (1: one-step async)."""
    micro_batch: int = 0
    """Sequences per forward/backward (gradients accumulate); 0: the whole batch at once."""

    def __post_init__(self) -> None:
        checks = {
            "lr": self.lr >= 0,
            "clip_eps": 0 < self.clip_eps < 1,
            "clip_eps_high": self.clip_eps_high is None or self.clip_eps_high > 0,
            "grad_clip": self.grad_clip >= 0,
            "kl_coef": self.kl_coef >= 0,
            "temperature": self.temperature > 0,
            "adv_eps": self.adv_eps >= 0,
            "max_lag": self.max_lag >= 0,
            "micro_batch": self.micro_batch >= 0,
            "weight_decay": self.weight_decay >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"GRPOConfig.{name}: invalid value {getattr(self, name)!r}")


class Sample(Protocol):
    """One completion as an Actor reports it (:class:`aurora.engines.base.Completion` is one)."""

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def logprobs(self) -> Sequence[float]: ...


@dataclass(frozen=True)
class Group:
    """One prompt's completions, generated on ``version``."""

    prompt: str
    completions: Sequence[Sample]
    version: int
    prompt_ids: Sequence[int] | None = None
    """Token ids the Actor was given (default: the Trainer tokenizes ``prompt``)."""


@dataclass(frozen=True)
class StepStats:
    version: int
    """Published version the step trained on top of (the step's result becomes version+1)."""
    loss: float
    reward_mean: float
    reward_std: float
    groups: int
    completions: int
    tokens: int
    zero_adv_groups: int
    """Groups whose rewards were all equal (no signal)."""
    skipped: bool
    """True when no group had signal and the optimizer step was skipped."""
    clip_frac: float
    """Share of tokens whose ratio was clipped (where the clip binds)."""
    ratio_max: float
    logp_diff_max: float
    """max |log pi_theta - log pi_b| over tokens: off-policyness (version lag, bf16 vs fp32)."""
    kl: float
    grad_norm: float
    max_lag: int
    seconds: float


@dataclass(frozen=True)
class Publication:
    """D_{v+1} as published."""

    version: int
    base: int
    base_hash: str
    delta_id: str
    weights_hash: str
    """h(version)."""
    data: bytes
    """The whole delta file."""
    segments: tuple[Segment, ...]
    changed: int
    """bf16 elements that changed."""
    total: int
    """bf16 elements of the model."""
    seconds: float

    @property
    def density(self) -> float:
        return self.changed / self.total if self.total else 0.0


class TrainerError(ValueError):
    """Input the Trainer refuses."""


def named_weights(model: Any) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of the model's floating-point weights, tied ones once under the first
    name (the naming of :func:`aurora.delta.hf.bf16_views`, so the states line up)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if not t.is_floating_point() or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out[name] = t
    return out


def to_bf16_bits(weights: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Round to bf16 (round to nearest even) and return the bit patterns as uint16 copies."""
    return {
        k: t.detach()
        .to("cpu", torch.bfloat16)
        .contiguous()
        .view(torch.int16)
        .numpy()
        .view(np.uint16)
        .copy()
        for k, t in weights.items()
    }


def group_advantages(
    rewards: Sequence[float], *, eps: float = 1e-6, scale_by_std: bool = True
) -> list[float]:
    """(r_i - mean) / (std + eps) within one group (unbiased std); all 0 when G = 1 or all equal."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.size < 2:
        return [0.0] * int(r.size)
    centred = r - r.mean()
    if not scale_by_std:
        return [float(x) for x in centred]
    return [float(x) for x in centred / (r.std(ddof=1) + eps)]


def clipped_objective(
    logp: torch.Tensor,
    behaviour: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_lo: float,
    clip_hi: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-level-mean clipped surrogate (to maximise) over ``mask``; also the ratio and which
    tokens the clip binds on. Shapes: ``[B, T]`` for logp, behaviour and mask, ``[B]`` for A."""
    ratio = torch.exp(logp - behaviour)
    a = advantages[:, None]
    unclipped = ratio * a
    clipped = torch.clamp(ratio, 1 - clip_lo, 1 + clip_hi) * a
    surrogate = torch.minimum(unclipped, clipped)
    n = mask.sum().clamp(min=1)
    return (surrogate * mask).sum() / n, ratio, (clipped < unclipped) & mask.bool()


class Trainer:
    """GRPO on a transformers causal LM; see the module docstring."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        reward: RewardFn,
        config: GRPOConfig,
        *,
        version: int = 0,
        weights_hash: str | None = None,
        model_id: str = "policy",
        codec: str = DEFAULT_CODEC,
        fuse: bool = True,
        segment_size: int = DEFAULT_SEGMENT_SIZE,
        seed: int = 0,
        dense: bool = False,
    ) -> None:
        """``model`` becomes the fp32 master (converted in place). The published version
        ``version`` is its weights rounded to bf16, with chain hash ``weights_hash`` (default:
        their snapshot hash, as ``CheckpointStore.publish_snapshot`` computes it)."""
        self.config = config
        self.model = cast_weights(model, torch.float32)
        self.model.train()
        self.tokenizer = tokenizer
        self.reward = reward
        self.model_id, self.codec, self.fuse, self.segment_size = (
            model_id,
            codec,
            fuse,
            segment_size,
        )
        self.device = next(model.parameters()).device
        self.params = named_weights(self.model)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=config.lr,
            betas=config.betas,
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )
        self.dense = dense
        """Publish every element of every tensor (a dense copy in the delta format, the PrimeRL
        baselines' broadcast) instead of the changed ones."""
        self.generator = torch.Generator().manual_seed(seed)
        """The Trainer's own randomness (none of the default objective uses it; checkpointed so
        an extension that samples resumes the same trajectory)."""
        self.published = to_bf16_bits(self.params)
        self.version = version
        self.weights_hash = weights_hash or _snapshot_hash(self.published)
        self.steps = 0
        self.reference: Any | None = None
        if config.kl_coef > 0:
            import copy

            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        eos = tokenizer.eos_token_id
        self.eos_id = int(eos)

    # -- inputs --------------------------------------------------------------------------------

    def completion_text(self, token_ids: Sequence[int]) -> str:
        """The text the reward sees: the tokens before the first end-of-sequence, decoded."""
        ids = list(token_ids)
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def rewards(self, group: Group) -> list[float]:
        """The Trainer's own rewards for a group (never the Actor's)."""
        return [
            score(self.reward, group.prompt, self.completion_text(c.token_ids))
            for c in group.completions
        ]

    def _check(self, groups: Sequence[Group]) -> None:
        if not groups:
            raise TrainerError("step() needs at least one group")
        for k, g in enumerate(groups):
            if not g.completions:
                raise TrainerError(f"group {k} (prompt {g.prompt!r}) has no completions")
            if g.version > self.version or g.version < self.version - self.config.max_lag:
                raise TrainerError(
                    f"group {k} was generated on v{g.version}; the Trainer is at "
                    f"v{self.version} and accepts v{self.version - self.config.max_lag}.."
                    f"v{self.version} (max_lag {self.config.max_lag})"
                )
            for c in g.completions:
                if len(c.token_ids) != len(c.logprobs) or not c.token_ids:
                    raise TrainerError(
                        f"group {k}: a completion has {len(c.token_ids)} tokens and "
                        f"{len(c.logprobs)} log-probs (need as many, at least one)"
                    )

    def _batch(
        self, groups: Sequence[Group], advantages: Sequence[Sequence[float]]
    ) -> dict[str, torch.Tensor]:
        """Right-padded [prompt | completion] rows with a mask over completion positions."""
        rows, starts, behaviour, adv = [], [], [], []
        for g, advs in zip(groups, advantages, strict=True):
            p = (
                list(g.prompt_ids)
                if g.prompt_ids is not None
                else self.tokenizer(g.prompt).input_ids
            )
            for c, a in zip(g.completions, advs, strict=True):
                rows.append(list(p) + [int(t) for t in c.token_ids])
                starts.append(len(p))
                behaviour.append([float(x) for x in c.logprobs])
                adv.append(a)
        b, width = len(rows), max(map(len, rows))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.full((b, width), int(pad), dtype=torch.long)
        attn = torch.zeros((b, width), dtype=torch.long)
        # targets are next tokens: position t predicts ids[t+1]; width-1 prediction slots
        mask = torch.zeros((b, width - 1), dtype=torch.float32)
        beh = torch.zeros((b, width - 1), dtype=torch.float32)
        for i, (r, s, lp) in enumerate(zip(rows, starts, behaviour, strict=True)):
            ids[i, : len(r)] = torch.tensor(r)
            attn[i, : len(r)] = 1
            mask[i, s - 1 : len(r) - 1] = 1
            beh[i, s - 1 : len(r) - 1] = torch.tensor(lp)
        return {
            "ids": ids.to(self.device),
            "attn": attn.to(self.device),
            "mask": mask.to(self.device),
            "behaviour": beh.to(self.device),
            "adv": torch.tensor(adv, dtype=torch.float32, device=self.device),
        }

    def _logp(self, model: Any, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """log pi(y_t) at the sampling temperature for every next-token slot, [B, T-1]."""
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1, :].float()
        logp = torch.log_softmax(logits / self.config.temperature, dim=-1)
        return logp.gather(-1, ids[:, 1:, None]).squeeze(-1)

    # -- the step ------------------------------------------------------------------------------

    def step(self, groups: Sequence[Group]) -> StepStats:
        """One GRPO update of the master weights from ``groups`` (one optimizer step)."""
        t0 = time.perf_counter()
        self._check(groups)
        rewards = [self.rewards(g) for g in groups]
        cfg = self.config
        advantages = [
            group_advantages(r, eps=cfg.adv_eps, scale_by_std=cfg.scale_by_std) for r in rewards
        ]
        zero = sum(1 for a in advantages if all(x == 0 for x in a))
        batch = self._batch(groups, advantages)
        total_tokens = float(batch["mask"].sum())
        skip = zero == len(groups) and cfg.kl_coef == 0
        b = batch["ids"].shape[0]
        chunk = cfg.micro_batch or b
        clip_hi = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
        loss_sum = kl_sum = clipped = 0.0
        ratio_max = diff_max = 0.0
        self.optimizer.zero_grad(set_to_none=True)
        for lo in range(0, b, chunk):
            sl = slice(lo, lo + chunk)
            mask, beh = batch["mask"][sl], batch["behaviour"][sl]
            with torch.set_grad_enabled(not skip):
                logp = self._logp(self.model, batch["ids"][sl], batch["attn"][sl])
                surrogate, ratio, bound = clipped_objective(
                    logp, beh, batch["adv"][sl], mask, clip_lo=cfg.clip_eps, clip_hi=clip_hi
                )
                # the chunk's share of the batch's token-level mean
                share = float(mask.sum()) / max(total_tokens, 1.0)
                loss = -surrogate * share
                if self.reference is not None:
                    with torch.no_grad():
                        ref = self._logp(self.reference, batch["ids"][sl], batch["attn"][sl])
                    d = ref - logp
                    kl = ((torch.exp(d) - d - 1) * mask).sum() / max(total_tokens, 1.0)
                    loss = loss + cfg.kl_coef * kl
                    kl_sum += float(kl)
            if not skip:
                loss.backward()
            loss_sum += loss.item()
            clipped += float(bound.sum())
            m = mask.bool()
            if m.any():
                ratio_max = max(ratio_max, float(ratio.detach()[m].max()))
                diff_max = max(diff_max, float((logp.detach() - beh)[m].abs().max()))
        grad_norm = 0.0
        if not skip:
            params = [p for p in self.model.parameters() if p.grad is not None]
            if cfg.grad_clip > 0:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
            else:
                grad_norm = float(
                    torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
                )
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.steps += 1
        flat = [x for r in rewards for x in r]
        return StepStats(
            version=self.version,
            loss=loss_sum,
            reward_mean=float(np.mean(flat)),
            reward_std=float(np.std(flat)),
            groups=len(groups),
            completions=len(flat),
            tokens=int(total_tokens),
            zero_adv_groups=zero,
            skipped=skip,
            clip_frac=clipped / max(total_tokens, 1.0),
            ratio_max=ratio_max,
            logp_diff_max=diff_max,
            kl=kl_sum,
            grad_norm=grad_norm if math.isfinite(grad_norm) else float("nan"),
            max_lag=max(self.version - g.version for g in groups),
            seconds=time.perf_counter() - t0,
        )

    @torch.no_grad()
    def recompute_logprobs(
        self, groups: Sequence[Group], *, state: Mapping[str, np.ndarray] | None = None
    ) -> list[list[list[float]]]:
        """Per-token log-probs of each completion under the master weights, or under ``state``
        (bf16 bits, e.g. :attr:`published`) computed in fp32: ``out[g][i][t]``."""
        model = self.model
        if state is not None:
            import copy

            from aurora.rl.model import load_state

            model = copy.deepcopy(self.model)
            load_state(model, state)
        was = model.training
        model.eval()
        try:
            zeros = [[0.0] * len(g.completions) for g in groups]
            batch = self._batch(groups, zeros)
            logp = self._logp(model, batch["ids"], batch["attn"])
        finally:
            model.train(was)
        out, row = [], 0
        for g in groups:
            per = []
            for _ in g.completions:
                m = batch["mask"][row].bool()
                per.append([float(x) for x in logp[row][m]])
                row += 1
            out.append(per)
        return out

    # -- publishing ----------------------------------------------------------------------------

    def publish(self, on_segment: Callable[[Segment], None] | None = None) -> Publication:
        """Round the master to bf16 and extract D_{v+1} against the published bf16 weights.

        ``on_segment`` receives each segment as soon as it is cut (cut-through); if it raises,
        nothing is committed. Returns the whole delta, its id and h(v+1).
        """
        t0 = time.perf_counter()
        new = to_bf16_bits(self.params)
        enc = DeltaEncoder(
            self.published,
            new,
            model=self.model_id,
            version=self.version + 1,
            base_hash=self.weights_hash,
            codec=self.codec,
            fuse=self.fuse,
            segment_size=self.segment_size,
            full=self.dense,
        )
        segments = []
        for seg in enc.segments():
            if on_segment is not None:
                on_segment(seg)
            segments.append(seg)
        assert enc.delta_id is not None and enc.weights_hash is not None
        pub = Publication(
            version=self.version + 1,
            base=self.version,
            base_hash=self.weights_hash,
            delta_id=enc.delta_id,
            weights_hash=enc.weights_hash,
            data=b"".join(bytes(s.data) for s in segments),
            segments=tuple(segments),
            changed=sum(t.nnz for t in enc.tensors),
            total=sum(int(v.size) for v in new.values()),
            seconds=time.perf_counter() - t0,
        )
        self.published, self.version, self.weights_hash = new, pub.version, pub.weights_hash
        return pub

    def published_digest(self) -> str:
        """Content hash of the published bf16 weights, as :meth:`Engine.weights_digest`."""
        return weights_digest_of(self.published)

    # -- checkpoints ---------------------------------------------------------------------------

    def _config_record(self) -> dict[str, Any]:
        return {
            "grpo": {
                k: list(v) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(self.config).items()
            },
            "model_id": self.model_id,
            "codec": self.codec,
            "fuse": self.fuse,
            "segment_size": self.segment_size,
        }

    def save_checkpoint(self, path: str | Path) -> Path:
        """Everything the next delta depends on, in one file written atomically."""
        from aurora.store.files import write_atomic

        blob = {
            "format": CHECKPOINT_FORMAT,
            "config": self._config_record(),
            "version": self.version,
            "weights_hash": self.weights_hash,
            "steps": self.steps,
            "master": {k: v.detach().cpu().clone() for k, v in self.params.items()},
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
            "published": {
                k: torch.from_numpy(v.view(np.int16).copy()) for k, v in self.published.items()
            },
            "reference": (
                {k: v.detach().cpu().clone() for k, v in named_weights(self.reference).items()}
                if self.reference is not None
                else None
            ),
        }
        buf = io.BytesIO()
        torch.save(blob, buf)
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, [buf.getvalue()])
        return out

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore a checkpoint written by :meth:`save_checkpoint` of a Trainer with the same
        model shape and configuration (a difference is refused, naming the field)."""
        p = Path(path)
        if not p.exists():
            raise TrainerError(f"checkpoint {p} does not exist")
        try:
            blob = torch.load(p, map_location=self.device, weights_only=True)
        except Exception as exc:
            raise TrainerError(f"checkpoint {p} cannot be read: {exc}") from None
        if not isinstance(blob, dict) or blob.get("format") != CHECKPOINT_FORMAT:
            raise TrainerError(f"checkpoint {p} is not a Trainer checkpoint of format 1")
        mine = self._config_record()
        theirs = blob["config"]
        for key in mine:
            if mine[key] != theirs.get(key):
                raise TrainerError(
                    f"checkpoint {p}: {key} is {theirs.get(key)!r}, this Trainer has {mine[key]!r}"
                )
        master = blob["master"]
        if set(master) != set(self.params):
            raise TrainerError(f"checkpoint {p} holds weights of a different model")
        with torch.no_grad():
            for k, v in master.items():
                if v.shape != self.params[k].shape:
                    raise TrainerError(f"checkpoint {p}: weight {k} has shape {tuple(v.shape)}")
                self.params[k].data.copy_(v)
        self.optimizer.load_state_dict(blob["optimizer"])
        self.generator.set_state(blob["generator"])
        self.published = {k: v.numpy().view(np.uint16).copy() for k, v in blob["published"].items()}
        if self.reference is not None and blob["reference"] is not None:
            ref = named_weights(self.reference)
            with torch.no_grad():
                for k, v in blob["reference"].items():
                    ref[k].data.copy_(v)
        self.version = int(blob["version"])
        self.weights_hash = str(blob["weights_hash"])
        self.steps = int(blob["steps"])


def _snapshot_hash(state: Mapping[str, np.ndarray]) -> str:
    return weights_hash(state)


__all__ = [
    "GRPOConfig",
    "Group",
    "Publication",
    "Sample",
    "StepStats",
    "Trainer",
    "TrainerError",
    "clipped_objective",
    "group_advantages",
    "named_weights",
    "to_bf16_bits",
]
