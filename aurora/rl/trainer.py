"""The GRPO Trainer: fp32 master weights, AdamW, bf16 published versions as delta checkpoints.

Theory of operation
-------------------
Input is asynchronous and lease-based: :meth:`Trainer.step` takes *groups*, each one prompt's G
completions as an Actor sampled them (token ids and behaviour log-probs) with the version they
were generated on; groups older than ``version - max_lag`` or newer than ``version`` are
refused. The Trainer never trusts an Actor's text or reward: it decodes the token ids itself and
scores ``reward(prompt, text)``. A step is GRPO with the token-level mean, a dual-clip cap on the
importance ratio and a step guard (:meth:`Trainer.step` states the objective);
:meth:`Trainer.publish` rounds the master to bf16 and extracts ``D_{v+1}`` exactly, committing
the version only after the trailer; :meth:`Trainer.save_checkpoint` makes a restored Trainer
produce the same next delta bytes as one that never stopped. On a GPU, and across a
``torch.distributed`` group, the same Trainer trains under bf16 autocast and extracts on the
device (:mod:`aurora.rl.device`); the delta bytes are the CPU path's.
"""

from __future__ import annotations

import contextlib
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
from aurora.engines.base import decode_completion, end_ids, weights_digest_of
from aurora.models import cast_weights
from aurora.rl import device as gpu
from aurora.rl.guard import GuardConfig, StepGuard
from aurora.rl.tasks import RewardFn, score

CHECKPOINT_FORMAT = 1
BF16_MAX = 3.3895313892515355e38
"""Largest finite bf16 value: a master weight beyond it rounds to inf when published."""
GPU_COMPUTE_DTYPE = torch.bfloat16
"""Autocast dtype of the forward and backward on a GPU (the master weights stay fp32)."""


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
    ratio_cap: float | None = 3.0
    """Dual-clip c: the importance ratio is capped at c before the objective (a token beyond
    it adds ``c A`` and no gradient). 3 is verl's default ``clip_ratio_c``. None: no cap (the
    PPO clip alone, unbounded for a negative advantage)."""
    guard: GuardConfig | None = dataclasses.field(default_factory=GuardConfig)
    """The step guard's outlier rule (:mod:`aurora.rl.guard`); None: only a non-finite loss or
    gradient refuses a step."""

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
            "ratio_cap": self.ratio_cap is None
            or (
                math.isfinite(self.ratio_cap)
                and self.ratio_cap
                > 1 + (self.clip_eps if self.clip_eps_high is None else self.clip_eps_high)
            ),
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
    """Global gradient L2 norm before clipping (of the step taken, or of the one refused)."""
    max_lag: int
    seconds: float
    capped_frac: float = 0.0
    """Share of tokens whose ratio the dual clip capped (beyond ``ratio_cap``)."""
    refused: str | None = None
    """Why the step guard refused the step, or the groups in ``dropped`` (None: it did not)."""
    dropped: tuple[int, ...] = ()
    """Indices of the groups the guard left out of the step (each alone non-finite or beyond
    its bound)."""


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
    ratio_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-level-mean clipped surrogate (to maximise) over ``mask``; also the ratio and which
    tokens the clip binds on. Shapes: ``[B, T]`` for logp, behaviour and mask, ``[B]`` for A.
    ``ratio_cap`` c (dual clip): the log-ratio is capped at log c before the exponential, so a
    ratio beyond c (an infinite one included) is c, with no gradient through it."""
    log_ratio = logp - behaviour
    if ratio_cap is not None:
        log_ratio = torch.clamp(log_ratio, max=math.log(ratio_cap))
    ratio = torch.exp(log_ratio)
    a = advantages[:, None]
    unclipped = ratio * a
    clipped = torch.clamp(ratio, 1 - clip_lo, 1 + clip_hi) * a
    surrogate = torch.minimum(unclipped, clipped)
    n = mask.sum().clamp(min=1)
    return (surrogate * mask).sum() / n, ratio, (clipped < unclipped) & mask.bool()


class Trainer:
    """GRPO on a transformers causal LM (the module docstring; :meth:`step` states the
    objective).

    Input is asynchronous and lease-based: :meth:`Trainer.step` takes *groups*, each one prompt's
    G completions as an Actor sampled them (token ids and the per-token log-probs of the sampling
    distribution, the *behaviour* log-probs) with the version v_g they were generated on. Groups
    from versions older than ``version - max_lag`` or newer than ``version`` are refused. The
    Trainer never trusts an Actor's text or reward: it decodes the completion's token ids with its
    own tokenizer (the text before end-of-sequence) and scores ``reward(prompt, text)`` itself.

    On a GPU (the model handed in on a CUDA device) the same Trainer runs the forward and backward
    under ``torch.autocast`` in bf16 while the master weights and AdamW state stay fp32, and
    extracts D_{v+1} on the device, copying only the changed indices and values to the host
    (:mod:`aurora.rl.device`); the delta bytes are those the CPU path writes for the same weights
    (``device_extract=True`` runs that path on CPU tensors, which is how the tests check it).
    In a ``torch.distributed`` group of more than one process (one per GPU) the model is sharded
    with FSDP2 (``fully_shard``): every rank calls :meth:`Trainer.step` with the same groups and
    :meth:`Trainer.publish` in lockstep, takes its share of the batch's rows, and gradients are
    summed across ranks, so the step is the single-process step up to summation order; each rank
    keeps its rows of the published weights and extracts there, and every rank produces the same
    delta. With neither, nothing of this runs: the CPU path is unchanged, byte for byte.
    """

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
        device_extract: bool | None = None,
    ) -> None:
        """``model`` becomes the fp32 master (converted in place). The published version
        ``version`` is its weights rounded to bf16, with chain hash ``weights_hash`` (default:
        their snapshot hash, as ``CheckpointStore.publish_snapshot`` computes it).
        ``device_extract`` forces extraction on the model's device (True) or on the host
        (False); None: on the device unless the model is on the CPU in one process."""
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
        self.sharded = gpu.is_distributed()
        """FSDP2: the master and AdamW state are sharded over the process group's ranks."""
        self.autocast = self.device.type == "cuda"
        """bf16 autocast in the forward and backward (GPU only; the CPU computes in fp32)."""
        self.extract_on_device = (
            device_extract
            if device_extract is not None
            else (self.device.type != "cpu" or self.sharded)
        )
        """Extract D_{v+1} where the weights live (:mod:`aurora.rl.device`); always when
        sharded."""
        if self.sharded and not self.extract_on_device:
            raise TrainerError("device_extract=False: a sharded Trainer extracts on the device")
        self.reference: Any | None = None
        if config.kl_coef > 0:
            import copy

            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        if self.sharded:
            names = list(named_weights(self.model))
            gpu.shard(self.model)
            if self.reference is not None:
                gpu.shard(self.reference)
            sd = self.model.state_dict(keep_vars=True)
            self.params = {n: sd[n] for n in names}
        else:
            self.params = named_weights(self.model)
        self._world = _world_size() if self.sharded else 1
        self._shapes = {k: tuple(v.shape) for k, v in self.params.items()}
        self._rows = {k: gpu.local_part(v)[1] for k, v in self.params.items()}
        """This process's flat rows of each tensor (the whole tensor unless sharded)."""
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
        self._published_dev: dict[str, torch.Tensor] | None = None
        self._published_host: dict[str, np.ndarray] | None = None
        if self.extract_on_device:
            self._published_dev = {k: gpu.local_bf16(v) for k, v in self.params.items()}
        else:
            self._published_host = to_bf16_bits(self.params)
        self.version = version
        self.weights_hash = weights_hash or _snapshot_hash(self.published)
        self.steps = 0
        self.guard = StepGuard(config.guard)
        """The window of recent gradient norms the step guard judges by (checkpointed)."""
        eos = tokenizer.eos_token_id
        self.eos_id = int(eos)
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.eos_ids = end_ids(tokenizer, gen_eos)
        """Every id a completion ends at: the ids the engines stop at (the tokenizer's and the
        model's generation config's)."""

    @property
    def published(self) -> dict[str, np.ndarray]:
        """``{split name: uint16 bf16 bits}`` of the last published version. After a publish on
        the device it is copied to the host when first asked for (gathered from every rank when
        sharded: then a collective every rank must call)."""
        if self._published_host is None:
            assert self._published_dev is not None
            self._published_host = {
                k: gpu.to_host(gpu.gather_whole(t, self._shapes[k])).reshape(self._shapes[k])
                for k, t in self._published_dev.items()
            }
        return self._published_host

    @published.setter
    def published(self, state: Mapping[str, np.ndarray]) -> None:
        self._published_host = dict(state)
        self._published_dev = None  # rebuilt from the host copy when next needed

    def _device_published(self) -> dict[str, torch.Tensor]:
        """The published bits of this process's rows, flat ``int16`` on the device."""
        if self._published_dev is None:
            out = {}
            for k, v in self.published.items():
                r = self._rows[k]
                flat = np.ascontiguousarray(v).reshape(-1)[r.start : r.start + r.numel]
                out[k] = torch.from_numpy(flat.view(np.int16).copy()).to(self.device)
            self._published_dev = out
        return self._published_dev

    def _host_new(self) -> dict[str, np.ndarray]:
        """The master rounded to bf16, on the host (the CPU path; gathered when sharded)."""
        if not self.sharded:
            return to_bf16_bits(self.params)
        return {
            k: gpu.to_host(gpu.full_bf16(v)).reshape(self._shapes[k])
            for k, v in self.params.items()
        }

    # -- inputs --------------------------------------------------------------------------------

    def completion_text(self, token_ids: Sequence[int]) -> str:
        """The text the reward sees: the tokens before the first end-of-sequence, decoded."""
        return decode_completion(self.tokenizer, self.eos_ids, token_ids)

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
        ctx = (
            torch.autocast("cuda", dtype=GPU_COMPUTE_DTYPE)
            if self.autocast
            else contextlib.nullcontext()
        )
        with ctx:
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1, :].float()
        logp = torch.log_softmax(logits / self.config.temperature, dim=-1)
        return logp.gather(-1, ids[:, 1:, None]).squeeze(-1)

    # -- the step ------------------------------------------------------------------------------

    def step(self, groups: Sequence[Group]) -> StepStats:
        """One GRPO update of the master weights from ``groups`` (one optimizer step, if the
        step guard passes it).

        The objective (GRPO with the token-level mean; symbols as in docs/RL.md): for group g with
        rewards r_1..r_G,

            A_i = (r_i - mean(r)) / (std(r) + eps_A)        (std unbiased; A_i = 0 when G = 1)
            rho_t = exp(min(log pi_theta(y_t | y_<t) - log pi_b(y_t | y_<t), log c))
            L = -(1 / sum_i |y_i|)
                  * sum_i sum_t min(rho_t A_i, clip(rho_t, 1 - eps_lo, 1 + eps_hi) A_i)
                + beta * (1 / sum_i |y_i|) * sum_i sum_t KL_t

        with log pi computed at the sampling temperature (logits / T), pi_b the behaviour policy the
        Actor recorded (so the ratio also corrects for bf16-vs-fp32 and version lag), the sums over
        every completion token of the batch (the end-of-sequence token included), and KL_t the k3
        estimator ``exp(q - p) - (q - p) - 1`` to the frozen starting weights (off: beta = 0 by
        default). The cap ``c`` (``ratio_cap``, 3) is dual-clip PPO: the PPO clip alone keeps the
        unbounded ``rho A`` for a negative advantage, so one forged behaviour log-prob (pi_b an
        Actor reports) could make the loss and the step anything; capped in log space before the
        exponential, a token beyond ``c`` adds ``c A`` and no gradient, and nothing overflows. One
        AdamW step per call on the fp32 master weights, after clipping the global gradient norm, and
        only if :class:`~aurora.rl.guard.StepGuard` passes it (finite loss and gradient, gradient
        norm no outlier against recent steps); when it does not, each group's own gradient is
        computed, the groups that are non-finite or alone beyond the guard's bound are left out
        (``StepStats.dropped``) and the step is computed again without them, else not taken. A batch
        whose advantages are all zero carries no signal: with beta = 0 the step is skipped, so the
        policy does not drift on Adam's momentum alone.
        """
        t0 = time.perf_counter()
        self._check(groups)
        rewards = [self.rewards(g) for g in groups]
        cfg = self.config
        advantages = [
            group_advantages(r, eps=cfg.adv_eps, scale_by_std=cfg.scale_by_std) for r in rewards
        ]
        zero = sum(1 for a in advantages if all(x == 0 for x in a))
        skip = zero == len(groups) and cfg.kl_coef == 0
        keep = list(range(len(groups)))
        self.optimizer.zero_grad(set_to_none=True)
        acc = self._accumulate(groups, advantages, keep, grad=not skip)
        grad_norm, norm_t = 0.0, None
        refused: str | None = None
        dropped: tuple[int, ...] = ()
        if not skip:
            grad_norm, norm_t = self._grad_norm()
            refused = self.guard.judge(acc["loss"], grad_norm)
            if refused is not None:
                dropped = () if self.sharded else self._culprits(groups, advantages, acc)
                keep = [i for i in keep if i not in dropped]
                skip = True
                if dropped and any(any(x != 0 for x in advantages[i]) for i in keep):
                    # The step without them, as if they had never been in the batch.
                    self.optimizer.zero_grad(set_to_none=True)
                    acc = self._accumulate(groups, advantages, keep, grad=True)
                    grad_norm, norm_t = self._grad_norm()
                    again = self.guard.judge(acc["loss"], grad_norm)
                    skip = again is not None
                    if again is not None:
                        refused = f"{refused}; without groups {list(dropped)}: {again}"
        if not skip:
            params = [p for p in self.model.parameters() if p.grad is not None]
            if cfg.grad_clip > 0 and norm_t is not None:
                torch.nn.utils.clip_grads_with_norm_(params, cfg.grad_clip, norm_t)
            self.optimizer.step()
            self.guard.taken(grad_norm)
            self.steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        flat = [x for r in rewards for x in r]
        stats = acc  # of the step taken (without the dropped groups), or of the one refused
        total_tokens = stats["tokens"]
        return StepStats(
            version=self.version,
            loss=stats["loss"],
            reward_mean=float(np.mean(flat)),
            reward_std=float(np.std(flat)),
            groups=len(groups),
            completions=len(flat),
            tokens=int(total_tokens),
            zero_adv_groups=zero,
            skipped=skip,
            clip_frac=stats["clipped"] / max(total_tokens, 1.0),
            ratio_max=stats["ratio_max"],
            logp_diff_max=stats["diff_max"],
            kl=stats["kl"],
            grad_norm=grad_norm if math.isfinite(grad_norm) else float("nan"),
            max_lag=max(self.version - g.version for g in groups),
            seconds=time.perf_counter() - t0,
            capped_frac=stats["capped"] / max(total_tokens, 1.0),
            refused=refused,
            dropped=dropped,
        )

    def _accumulate(
        self,
        groups: Sequence[Group],
        advantages: Sequence[Sequence[float]],
        rows: Sequence[int],
        *,
        grad: bool,
        tokens: float | None = None,
    ) -> dict[str, float]:
        """Forward (and with ``grad``, backward: gradients accumulate into ``.grad``) the loss
        of ``groups[i]`` for ``i`` in ``rows``, its token-level mean taken over ``tokens``
        (default: theirs). Returns the loss and the statistics of those tokens."""
        cfg = self.config
        batch = self._batch([groups[i] for i in rows], [advantages[i] for i in rows])
        total_tokens = float(batch["mask"].sum()) if tokens is None else tokens
        b = batch["ids"].shape[0]
        chunk = cfg.micro_batch or b
        clip_hi = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
        loss_sum = kl_sum = clipped = capped = 0.0
        ratio_max = diff_max = 0.0
        cap = math.log(cfg.ratio_cap) if cfg.ratio_cap is not None else math.inf
        for sl, empty in self._chunks(b, chunk):
            mask, beh = batch["mask"][sl], batch["behaviour"][sl]
            if empty:  # this rank has no row here but must join the collectives
                mask = torch.zeros_like(mask)
            with torch.set_grad_enabled(grad):
                logp = self._logp(self.model, batch["ids"][sl], batch["attn"][sl])
                surrogate, _, bound = clipped_objective(
                    logp,
                    beh,
                    batch["adv"][sl],
                    mask,
                    clip_lo=cfg.clip_eps,
                    clip_hi=clip_hi,
                    ratio_cap=cfg.ratio_cap,
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
            if grad:
                # FSDP2 averages gradients over the ranks; each rank's loss is its share of
                # the batch's, so scaling by the world size makes the average the sum
                (loss * self._world if self.sharded else loss).backward()
            loss_sum += loss.item()
            clipped += float(bound.sum())
            m = mask.bool()
            if m.any():
                log_ratio = (logp.detach() - beh)[m]
                capped += float((log_ratio > cap).sum())
                ratio_max = max(ratio_max, _exp(float(log_ratio.max())))
                diff_max = max(diff_max, float(log_ratio.abs().max()))
        if self.sharded:
            loss_sum, kl_sum, clipped, capped, ratio_max, diff_max = _all_reduce_stats(
                self.device, loss_sum, kl_sum, clipped, capped, ratio_max, diff_max
            )
        return {
            "loss": loss_sum,
            "kl": kl_sum,
            "clipped": clipped,
            "capped": capped,
            "ratio_max": ratio_max,
            "diff_max": diff_max,
            "tokens": total_tokens,
        }

    def _grad_norm(self) -> tuple[float, torch.Tensor | None]:
        """Global L2 norm of the accumulated gradients before clipping, as a float and as the
        tensor clipping takes (a ``DTensor`` when sharded); ``(0.0, None)`` without any."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return 0.0, None
        total = torch.nn.utils.get_total_norm(grads, 2.0)
        return _scalar(total), total

    def _culprits(
        self,
        groups: Sequence[Group],
        advantages: Sequence[Sequence[float]],
        whole: Mapping[str, float],
    ) -> tuple[int, ...]:
        """After the guard refused a step: the groups whose own gradient (their share of the
        batch's loss, each alone) is not finite or beyond the guard's bound. One backward
        per group, only when a step was refused."""
        bound = self.guard.bound()
        out = []
        for i in range(len(groups)):
            self.optimizer.zero_grad(set_to_none=True)
            acc = self._accumulate(groups, advantages, [i], grad=True, tokens=whole["tokens"])
            norm = self._grad_norm()[0]
            if not (math.isfinite(acc["loss"]) and math.isfinite(norm)) or (
                bound is not None and norm > bound
            ):
                out.append(i)
        self.optimizer.zero_grad(set_to_none=True)
        return tuple(out)

    def _chunks(self, b: int, chunk: int) -> list[tuple[slice, bool]]:
        """Row slices this process computes: every row in ``chunk``-row pieces; when sharded,
        its contiguous share of the rows, in as many pieces as every other rank (an empty piece
        is one padding row with no weight: FSDP's collectives need every rank in every pass)."""
        if not self.sharded:
            return [(slice(lo, lo + chunk), False) for lo in range(0, b, chunk)]
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        lo, hi = rank * b // world, (rank + 1) * b // world
        most = -(-b // world)  # rows of the rank with the most
        pieces = max(1, -(-most // chunk))
        out = []
        for k in range(pieces):
            a, z = lo + k * chunk, min(lo + (k + 1) * chunk, hi)
            out.append((slice(a, z), False) if a < z else (slice(0, 1), True))
        return out

    @torch.no_grad()
    def recompute_logprobs(
        self,
        groups: Sequence[Group],
        *,
        state: Mapping[str, np.ndarray] | None = None,
        model: Any | None = None,
    ) -> list[list[list[float]]]:
        """Per-token log-probs of each completion under the master weights, or under ``state``
        (bf16 bits, e.g. :attr:`published`), or with ``model`` (a copy holding some version's
        weights, e.g. a verifier's), computed in fp32 (under the bf16 autocast on a GPU):
        ``out[g][i][t]``."""
        if model is None:
            model = self.model
        if state is not None and self.sharded:
            raise TrainerError("recompute_logprobs(state=...) is not available when sharded")
        if state is not None:
            import copy

            from aurora.models import load_state

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

    @torch.no_grad()
    def recompute_ranks(
        self,
        groups: Sequence[Group],
        noise: Sequence[Sequence[Sequence[float]]],
        *,
        model: Any | None = None,
    ) -> tuple[list[list[list[float]]], list[list[list[float]]]]:
        """As :meth:`recompute_logprobs` with ``model``, and with each sampled token's rank
        ``u`` under the sampling distribution (:func:`aurora.rl.ranks.rank_transform`;
        ``noise[g][i][t]`` is its V): ``(logps, ranks)``, each ``out[g][i][t]``. One forward."""
        from aurora.rl.ranks import rank_transform

        if model is None:
            model = self.model
        was = model.training
        model.eval()
        try:
            zeros = [[0.0] * len(g.completions) for g in groups]
            batch = self._batch(groups, zeros)
            ids = batch["ids"]
            ctx = (
                torch.autocast("cuda", dtype=GPU_COMPUTE_DTYPE)
                if self.autocast
                else contextlib.nullcontext()
            )
            with ctx:
                logits = model(input_ids=ids, attention_mask=batch["attn"]).logits[:, :-1, :]
        finally:
            model.train(was)
        temp = self.config.temperature
        logps: list[list[list[float]]] = []
        ranks: list[list[list[float]]] = []
        row = 0
        for g, vs in zip(groups, noise, strict=True):
            lp_g, u_g = [], []
            for _, v in zip(g.completions, vs, strict=True):
                m = batch["mask"][row].bool()
                rows = logits[row][m].float()
                toks = ids[row, 1:][m]
                lp = torch.log_softmax(rows / temp, dim=-1).gather(1, toks[:, None])[:, 0]
                lp_g.append([float(x) for x in lp])
                u = rank_transform(rows, toks, torch.tensor(v, dtype=torch.float64), temp)
                u_g.append([float(x) for x in u])
                row += 1
            logps.append(lp_g)
            ranks.append(u_g)
        return logps, ranks

    # -- publishing ----------------------------------------------------------------------------

    def publish(self, on_segment: Callable[[Segment], None] | None = None) -> Publication:
        """Round the master to bf16 and extract D_{v+1} against the published bf16 weights.

        ``on_segment`` receives each segment as soon as it is cut (cut-through); if it raises,
        nothing is committed. Returns the whole delta, its id and h(v+1). Master weights that
        are not finite (or would round to infinity in bf16) are never published: TrainerError,
        before anything is extracted.

        The extraction runs against the last published bf16 weights with
        :class:`aurora.delta.DeltaEncoder` (exact 16-bit comparison, fused names, cut into segments
        while it extracts; each segment can be handed to the data plane the moment it exists). The
        Trainer commits the new version only after the trailer, so a failure leaves it at v with
        nothing published.
        """
        t0 = time.perf_counter()
        self._check_publishable()
        if self.extract_on_device and not self.dense:
            return self._publish_on_device(on_segment, t0)
        new = self._host_new()
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
        pub = self._cut(enc, on_segment, total=sum(int(v.size) for v in new.values()), t0=t0)
        self.published, self.version, self.weights_hash = new, pub.version, pub.weights_hash
        return pub

    def _check_publishable(self) -> None:
        """TrainerError unless every master weight is finite and within bf16's range (every
        rank checks its rows; when sharded, all agree before any raises)."""
        bad = 0
        for t in self.params.values():
            local = t.detach()
            to_local = getattr(local, "to_local", None)
            if callable(to_local):
                local = to_local()
            if local.numel() and not bool((local.abs() <= BF16_MAX).all()):  # NaN fails too
                bad += 1
        if self.sharded:
            import torch.distributed as dist

            flag = torch.tensor([bad], device=self.device)
            dist.all_reduce(flag)
            bad = int(flag.item())
        if bad:
            raise TrainerError(
                f"{bad} weight tensor(s) of the master hold non-finite values: "
                f"v{self.version + 1} is not published"
            )

    def _publish_on_device(
        self, on_segment: Callable[[Segment], None] | None, t0: float
    ) -> Publication:
        """:meth:`publish` with extraction on the device (:class:`gpu.DeviceDeltaEncoder`)."""
        host = self._published_host
        old = self._device_published()

        def host_old(name: str) -> np.ndarray:
            if host is not None:
                return host[name]
            return gpu.to_host(gpu.gather_whole(old[name], self._shapes[name]))

        enc = gpu.DeviceDeltaEncoder(
            old,
            lambda name: gpu.local_bf16(self.params[name]),
            self._shapes,
            host_old=host_old,
            rows=self._rows,
            model=self.model_id,
            version=self.version + 1,
            base_hash=self.weights_hash,
            codec=self.codec,
            fuse=self.fuse,
            segment_size=self.segment_size,
        )
        total = sum(math.prod(s) for s in self._shapes.values())
        pub = self._cut(enc, on_segment, total=total, t0=t0)
        self._published_dev, self._published_host = enc.new, None
        self.version, self.weights_hash = pub.version, pub.weights_hash
        return pub

    def _cut(
        self,
        enc: Any,
        on_segment: Callable[[Segment], None] | None,
        *,
        total: int,
        t0: float,
    ) -> Publication:
        """Run an encoder (host or device) to its last segment, handing each to ``on_segment`` as
        it is cut, and describe the result as D_{v+1} on the current version."""
        segments = []
        for seg in enc.segments():
            if on_segment is not None:
                on_segment(seg)
            segments.append(seg)
        assert enc.delta_id is not None and enc.weights_hash is not None
        return Publication(
            version=self.version + 1,
            base=self.version,
            base_hash=self.weights_hash,
            delta_id=enc.delta_id,
            weights_hash=enc.weights_hash,
            data=b"".join(bytes(s.data) for s in segments),
            segments=tuple(segments),
            changed=sum(t.nnz for t in enc.tensors),
            total=total,
            seconds=time.perf_counter() - t0,
        )

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
        """Everything the next delta depends on, in one file written atomically: master weights,
        AdamW state, generator state, version, h(v), the published bf16 weights, the reference
        weights when beta > 0. A Trainer restored with :meth:`load_checkpoint` produces the same
        next delta bytes as one that never stopped.
        """
        from aurora.store.files import write_atomic

        if self.sharded:
            master, optim, reference = self._gather_state()
        else:
            master = {k: v.detach().cpu().clone() for k, v in self.params.items()}
            optim = self.optimizer.state_dict()
            reference = (
                {k: v.detach().cpu().clone() for k, v in named_weights(self.reference).items()}
                if self.reference is not None
                else None
            )
        blob = {
            "format": CHECKPOINT_FORMAT,
            "config": self._config_record(),
            "version": self.version,
            "weights_hash": self.weights_hash,
            "steps": self.steps,
            "master": master,
            "optimizer": optim,
            "generator": self.generator.get_state(),
            "guard": self.guard.state(),
            "published": {
                k: torch.from_numpy(v.view(np.int16).copy()) for k, v in self.published.items()
            },
            "reference": reference,
        }
        out = Path(path)
        if self.sharded:
            import torch.distributed as dist

            blob["sharded"] = True
            if dist.get_rank() != 0:  # rank 0 holds the gathered state and writes the file
                dist.barrier()
                return out
        buf = io.BytesIO()
        torch.save(blob, buf)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, [buf.getvalue()])
        if self.sharded:
            import torch.distributed as dist

            dist.barrier()
        return out

    def _gather_state(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
        """Whole (unsharded) model, optimizer and reference state on rank 0's CPU (empty on the
        other ranks): a collective every rank calls."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        master, optim = get_state_dict(self.model, self.optimizer, options=opts)
        reference = (
            get_model_state_dict(self.reference, options=opts)
            if self.reference is not None
            else None
        )
        return dict(master), dict(optim), reference

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
        if bool(blob.get("sharded")) != self.sharded:
            raise TrainerError(
                f"checkpoint {p}: sharded is {bool(blob.get('sharded'))}, this Trainer has "
                f"{self.sharded} (FSDP and single-process checkpoints differ in layout)"
            )
        mine = self._config_record()
        theirs = blob["config"]
        for key in mine:
            if mine[key] != theirs.get(key):
                raise TrainerError(
                    f"checkpoint {p}: {key} is {theirs.get(key)!r}, this Trainer has {mine[key]!r}"
                )
        master = blob["master"]
        if not set(self.params) <= set(master) or (
            not self.sharded and set(master) != set(self.params)
        ):
            raise TrainerError(f"checkpoint {p} holds weights of a different model")
        for k in self.params:
            if tuple(master[k].shape) != self._shapes[k]:
                raise TrainerError(f"checkpoint {p}: weight {k} has shape {tuple(master[k].shape)}")
        if self.sharded:
            self._scatter_state(blob)
        else:
            with torch.no_grad():
                for k, v in master.items():
                    self.params[k].data.copy_(v)
            self.optimizer.load_state_dict(blob["optimizer"])
        self.generator.set_state(blob["generator"])
        self.published = {k: v.numpy().view(np.uint16).copy() for k, v in blob["published"].items()}
        if self.reference is not None and blob["reference"] is not None and not self.sharded:
            ref = named_weights(self.reference)
            with torch.no_grad():
                for k, v in blob["reference"].items():
                    ref[k].data.copy_(v)
        self.version = int(blob["version"])
        self.weights_hash = str(blob["weights_hash"])
        self.steps = int(blob["steps"])
        self.guard.load_state([float(x) for x in blob.get("guard") or ()])

    def _scatter_state(self, blob: Mapping[str, Any]) -> None:
        """Each rank takes its shards of the whole state in ``blob`` (every rank read it)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=blob["master"],
            optim_state_dict=blob["optimizer"],
            options=opts,
        )
        if self.reference is not None and blob["reference"] is not None:
            set_model_state_dict(self.reference, blob["reference"], options=opts)


def _exp(x: float) -> float:
    """``e^x``, inf beyond the float range (a ratio of a forged log-prob)."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _snapshot_hash(state: Mapping[str, np.ndarray]) -> str:
    return weights_hash(state)


def _world_size() -> int:
    import torch.distributed as dist

    return int(dist.get_world_size())


def _scalar(t: torch.Tensor) -> float:
    """A 0-d tensor (an FSDP ``DTensor`` gathered first) as a float."""
    full = getattr(t, "full_tensor", None)
    return float(full() if callable(full) else t)


def _all_reduce_stats(device: torch.device, *stats: float) -> tuple[float, ...]:
    """Sums (loss, kl, clipped and capped tokens) and maxima (ratio, log-prob gap) over the
    ranks."""
    import torch.distributed as dist

    sums = torch.tensor(stats[:4], dtype=torch.float64, device=device)
    maxes = torch.tensor(stats[4:], dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    return (*sums.tolist(), *maxes.tolist())


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
