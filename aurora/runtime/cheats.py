"""Dishonest Actors, for the tests and the experiment of verified rollouts.

Theory of operation
-------------------
An Actor carrying the ``cheat`` fault hook (:mod:`aurora.runtime.hooks`; the launcher sets it for
the process a test names, nothing else does) wraps its engine in :class:`CheatingEngine`. It stays
a well-behaved peer in every way the control and data planes check (versions, h(v), digests,
timing, payloads that decode); only what its mode names lies (:data:`MODES` says how):

* completions: ``random``, ``stale``, ``othermodel``, ``partial:F``, ``coin-aware``;
* log-probs: ``forged-lp``, ``forge-lp:X``;
* selection (possible tokens, true log-probs, not sampled): ``greedy``, ``chosen``, ``bestof:N``;
* the payload or the report: ``vocab-id``, ``after-eos``, ``throughput-lie``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from aurora.delta import Delta
from aurora.jobspec import JobSpec
from aurora.policy.verification import Measures, TrustBook, VerificationConfig
from aurora.runtime.compute import EngineSide, Generated, Sampling
from aurora.runtime.job import verification_config

MODES = (
    "random",
    "stale",
    "othermodel",
    "forged-lp",
    "partial",
    "forge-lp",
    "vocab-id",
    "after-eos",
    "throughput-lie",
    "coin-aware",
    "greedy",
    "chosen",
    "bestof",
)
"""The cheat modes (``kind`` or ``kind:argument``). Each stays a well-behaved peer in every way
the control and data planes check: it stages and activates each version, reports the right h(v)
and content digest, returns each result on time, on its lease, with a payload that decodes (the
right prompt, ``group_size`` completions, ids in the vocabulary, one finite log-prob per token).
Only the completions lie:

* ``random``: uniformly random token ids (the honest sample's length), the honest log-probs;
* ``stale``: samples from the first version it loaded (v0), never updated, under the current h(v);
* ``othermodel``: samples from another model with the same tokenizer (the tiny Qwen3
  architecture at its random initialisation, not warm-started);
* ``forged-lp``: honest tokens, every log-prob halved (``lp / 2``: it claims each token was
  likelier than it was, which moves GRPO's importance ratio);
* ``partial:F``: ``random`` on a fraction ``F`` of its prompts (by a hash of the prompt id),
  honest on the rest.

* ``coin-aware``: ``random``, but only where it predicts no check will look, from everything an
  Actor is sent and the coin the Trainer once used (``BLAKE2b(seed, actor, lease)`` with the
  job's seed, :func:`old_unit`): a result it predicts unchecked is random throughout; of one
  it predicts checked, only the completions it predicts are not recomputed. It predicts its
  own record too (a replica :class:`~aurora.policy.verification.TrustBook` in which every
  result it predicts checked passed), so it also knows when it is trusted. Against the keyed
  coin its predictions are chance.

Selection: tokens that pi_v could have sampled, with their true log-probs (every recompute
passes), but not sampled from it (what :mod:`aurora.policy.sampling` tests):

* ``greedy``: every completion is the greedy decode (the likeliest token at each position);
* ``chosen``: every completion is the answer it picked (the task's correct answer, then
  ``<eos>``), whether or not pi_v would ever sample it;
* ``bestof:N``: each completion is the best of N honest samples for its slot by the task's
  reward (the first sampled of the best: ties keep the honest sample).

``greedy`` and ``chosen`` teacher-force their tokens through a transformers copy of the
current weights (fp32 arithmetic on the bf16 weights, as the Trainer's recompute) for the true
log-probs at the job's temperature; ``bestof:N`` samples N times with its own engine.

``random`` keeps each completion's end where the honest one had it (``<eos>`` last, or none at
the length limit), so the payload passes the Ledger's check and only a recompute can tell.

Attacks on the Trainer's step and on the Ledger's admission (each result otherwise honest):

* ``forge-lp:X``: every behaviour log-prob of the first completion of each result is ``X``
  (``-60``, ``-25``, ``-inf``...): the importance ratio of those tokens becomes ``e^(lp + |X|)``;
* ``vocab-id``: the last token of the first completion is the id ``V`` (one past the
  vocabulary);
* ``after-eos``: the first completion has ``<eos>`` one token before its end (a token after
  end-of-sequence);
* ``throughput-lie``: honest results, but it reports 2^40 tokens generated in 1e-9 s.

``stale`` and ``othermodel`` generate on a second, transformers engine whatever the Actor's own
engine is (a second vLLM would be a second server); the honest part of a vLLM Actor's results
still comes from vLLM."""
SELECTION = ("greedy", "chosen", "bestof")
"""The modes that return possible tokens with their true log-probs, selected (:data:`MODES`)."""

LIED_THROUGHPUT = (2**40, 1e-9)
"""What ``throughput-lie`` reports: tokens, seconds (the largest count and the shortest time a
``throughput`` message may carry)."""


def parse(mode: str) -> tuple[str, float]:
    """``(kind, argument)`` of a ``cheat`` hook value: the fraction of prompts cheated
    (``partial``), the forged log-prob (``forge-lp``), else 1; ValueError otherwise."""
    kind, _, arg = mode.partition(":")
    if kind not in MODES:
        raise ValueError(f"cheat: unknown mode {mode!r} (known: {', '.join(MODES)})")
    if kind == "forge-lp":
        value = float(arg)  # ValueError for a missing or bad number; -inf allowed
        if not value <= 0:
            raise ValueError(f"cheat: forge-lp:X needs a log-prob X <= 0, got {arg!r}")
        return kind, value
    if kind == "bestof":
        n = int(arg) if arg.isdigit() else 0
        if n < 2:
            raise ValueError(f"cheat: bestof:N needs an integer N >= 2, got {arg!r}")
        return kind, float(n)
    if kind != "partial":
        if arg:
            raise ValueError(f"cheat: {kind} takes no argument")
        return kind, 1.0
    share = float(arg)
    if not 0 < share <= 1:
        raise ValueError(f"cheat: partial:F needs 0 < F <= 1, got {arg!r}")
    return kind, share


def _vocab_size(spec: JobSpec) -> int:
    from aurora.runtime.rlbackend import load_model

    return int(load_model(spec, "config").config.vocab_size)


def _other_model(spec: JobSpec) -> Any:
    """An engine on the job's architecture and tokenizer at a random initialisation (seed 1):
    another model that speaks the same tokens."""
    import torch

    from aurora.engines.transformers import TransformersEngine
    from aurora.runtime.rlbackend import RLEngine, _task

    torch.manual_seed(1)
    if spec.model == "tiny":
        from aurora.models import TinyQwen3Config, build_default

        model, tokenizer = build_default(TinyQwen3Config(init_seed=1))
    else:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec.model))
        tokenizer = AutoTokenizer.from_pretrained(spec.model)
    return RLEngine(
        spec, TransformersEngine(model, tokenizer, seed=spec.seed), _task(spec), model_files={}
    )


def _coin(prompt: str, salt: str) -> float:
    digest = hashlib.blake2b(f"{salt}|{prompt}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def old_unit(seed: int, actor: str, lease: str) -> float:
    """The verification coin as it was (keyed by nothing an Actor is not sent): a number in
    [0, 1) from ``BLAKE2b(seed|actor|lease)``, 53 bits."""
    digest = hashlib.blake2b(f"{seed}|{actor}|{lease}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def old_picks(seed: int, actor: str, lease: str, group_size: int, completions: int) -> set[int]:
    """The completions the old coin had a check recompute: the ``completions`` of the group
    with the smallest ``old_unit(seed, actor, lease#i)``."""
    if group_size <= completions:
        return set(range(group_size))
    ranked = sorted(range(group_size), key=lambda i: old_unit(seed, actor, f"{lease}#{i}"))
    return set(ranked[:completions])


class CoinPredictor:
    """What a ``coin-aware`` Actor believes the Trainer will check (:data:`MODES`): the old
    coin over its own replica of its verification record, under the job's rule (which it is
    sent: the spec)."""

    def __init__(self, seed: int, actor: str, rule: VerificationConfig) -> None:
        self.seed = seed
        """The job's seed (in the spec every Actor is sent)."""
        self.actor = actor
        self.rule = rule
        self.book = TrustBook(rule)
        """Its replica of its own verification record."""

    def unchecked(self, lease: str, version: int, group_size: int) -> set[int]:
        """The completions of its result for ``lease`` (on ``version``) it predicts no check
        recomputes: all of them when it predicts the result unchecked."""
        if old_unit(self.seed, self.actor, lease) >= self.book.fraction(self.actor):
            return set(range(group_size))
        # Predicted checked: honest on the recomputed ones, so (it predicts) a pass.
        honest = Measures(max_delta=0.0, mean_delta=0.0, min_logprob=-1.0, tokens=1)
        self.book.observe(self.actor, honest, version)
        picked = old_picks(self.seed, self.actor, lease, group_size, self.rule.completions)
        return set(range(group_size)) - picked


def lies_on(mode: str, prompt: str) -> bool:
    """Whether an Actor cheating with ``mode`` lies about its result for ``prompt`` (every
    prompt but a ``partial`` one's honest share)."""
    kind, share = parse(mode)
    if kind == "coin-aware":
        raise ValueError("cheat: coin-aware lies by lease and completion, not by prompt")
    if kind == "throughput-lie":
        return False  # its results are honest
    return kind != "partial" or _coin(prompt, "cheat") < share


class CheatingEngine:
    """An :class:`~aurora.runtime.compute.EngineSide` that lies about its completions only
    (:data:`MODES`)."""

    def __init__(self, engine: EngineSide, mode: str, spec: JobSpec, actor: str = "") -> None:
        self.inner = engine
        self.kind, self.share = parse(mode)
        self.spec = spec
        self.vocab = _vocab_size(spec)
        self.eos = spec.eos_id
        self.ends = frozenset(spec.end_ids() or ())
        """Every id a completion ends at (set by the Trainer; empty: not known)."""
        """The job's end-of-sequence id (set by the Trainer; None: not known)."""
        self.shadow: Any = None
        """The engine ``stale`` and ``othermodel`` sample from."""
        self._shadow_loaded = False
        self.cheated = 0
        """Results it lied about."""
        self.predictor = (
            CoinPredictor(spec.seed, actor, verification_config(spec) or VerificationConfig())
            if self.kind == "coin-aware"
            else None
        )
        """``coin-aware``: what it believes the Trainer checks."""
        self._leases: list[str] = []
        """The leases of the prompts of the next :meth:`generate` (:meth:`note_leases`)."""
        self.lied_completions = 0
        """Completions it randomised (``coin-aware``)."""
        if self.kind == "stale":
            from aurora.runtime.rlbackend import make_rl_engine

            self.shadow = make_rl_engine(spec, engine="transformers")
        elif self.kind == "othermodel":
            self.shadow = _other_model(spec)
        self.scorer: Any = None
        """``greedy``, ``chosen`` and ``bestof:N``: a transformers engine following the weights
        (teacher-forced log-probs, the tokenizer)."""
        if self.kind in SELECTION:
            from aurora.runtime.rlbackend import _task, make_rl_engine

            self.scorer = make_rl_engine(spec, engine="transformers")
            self.task = _task(spec)

    @property
    def version(self) -> int | None:
        return self.inner.version

    @property
    def weights_hash(self) -> str | None:
        return self.inner.weights_hash

    @property
    def model_files(self) -> Mapping[str, str]:
        return self.inner.model_files

    def load(self, state: Mapping[str, np.ndarray], *, version: int, weights_hash: str) -> None:
        self.inner.load(state, version=version, weights_hash=weights_hash)
        if self.kind == "stale" and not self._shadow_loaded:
            self.shadow.load(state, version=version, weights_hash=weights_hash)
            self._shadow_loaded = True  # and never updated again
        if self.scorer is not None:
            self.scorer.load(state, version=version, weights_hash=weights_hash)

    def apply(self, delta: Delta) -> None:
        self.inner.apply(delta)
        if self.scorer is not None:
            self.scorer.apply(delta)

    def digest(self) -> str:
        return self.inner.digest()

    def generate(self, prompts: Sequence[tuple[str, int]], sampling: Sampling) -> list[Generated]:
        if self.shadow is not None:
            self.cheated += len(prompts)
            return list(self.shadow.generate(prompts, sampling))
        if self.kind in ("greedy", "chosen"):
            self.cheated += len(prompts)
            return [self._written(pid, index, sampling) for pid, index in prompts]
        if self.kind == "bestof":
            self.cheated += len(prompts)
            return self._best_of(prompts, sampling)
        out = list(self.inner.generate(prompts, sampling))
        if self.kind == "throughput-lie":
            return out
        if self.kind == "coin-aware":
            return self._coin_aware(out)
        lie = {
            "forged-lp": self._halve,
            "forge-lp": self._forge,
            "vocab-id": self._past_vocab,
            "after-eos": self._after_eos,
        }.get(self.kind)
        if lie is not None:
            self.cheated += len(out)
            return [self._rewrite(g, lie) for g in out]
        chosen = [g for g in out if self.kind == "random" or _coin(g.prompt, "cheat") < self.share]
        self.cheated += len(chosen)
        picked = {id(g) for g in chosen}
        return [self._rewrite(g, self._randomise) if id(g) in picked else g for g in out]

    def note_leases(self, leases: Sequence[str]) -> None:
        """The Actor says which lease each prompt of its next :meth:`generate` is for (a
        ``coin-aware`` cheat's input; the Actor knows them, as any Actor does)."""
        self._leases = list(leases)

    def _coin_aware(self, out: list[Generated]) -> list[Generated]:
        assert self.predictor is not None
        if len(self._leases) != len(out):
            raise ValueError("coin-aware: the Actor did not say which lease each prompt is for")
        version = self.inner.version or 0
        rewritten = []
        for lease, gen in zip(self._leases, out, strict=True):
            body = msgpack.unpackb(gen.payload)
            comps = body["completions"]
            lie = self.predictor.unchecked(lease, version, len(comps))
            if not lie:
                rewritten.append(gen)
                continue
            rng = np.random.default_rng(int(_coin(gen.prompt, "tokens") * 2**32))
            body["completions"] = [
                self._randomise(c, rng) if i in lie else c for i, c in enumerate(comps)
            ]
            self.cheated += 1
            self.lied_completions += len(lie)
            rewritten.append(
                Generated(prompt=gen.prompt, payload=msgpack.packb(body), tokens=gen.tokens)
            )
        self._leases = []
        return rewritten

    def claim_throughput(self, tokens: int, seconds: float) -> tuple[int, float]:
        """What the Actor reports as its throughput (``throughput-lie``: the largest lie a
        message carries; else the truth)."""
        return LIED_THROUGHPUT if self.kind == "throughput-lie" else (tokens, seconds)

    def _eos(self) -> int:
        return int(self.eos if self.eos is not None else self.scorer.engine.tokenizer.eos_token_id)

    def _true_logprobs(self, prompt: str, ids: list[int], temperature: float) -> list[float]:
        """Log-probs of ``ids`` after ``prompt`` under the current weights at ``temperature``
        (teacher-forced, fp32 arithmetic on the bf16 weights: the Trainer's recompute)."""
        import torch

        eng = self.scorer.engine
        head = eng.encode([prompt])[0]
        x = torch.tensor([head + ids], device=eng.device)
        with torch.no_grad():
            logits = eng._compute(input_ids=x).logits[0, len(head) - 1 : -1].float()
        lp = torch.log_softmax(logits / temperature, dim=-1)
        return [float(v) for v in lp.gather(1, torch.tensor(ids, device=eng.device)[:, None])[:, 0]]

    def _written(self, pid: str, index: int, sampling: Sampling) -> Generated:
        """``greedy`` or ``chosen``: ``sampling.n`` copies of one completion it wrote."""
        from aurora.engines.base import Sampling as EngineSampling
        from aurora.rl.tasks import solve

        prompt = self.task.prompt(index)
        if self.kind == "greedy":
            (group,) = self.scorer.engine.generate(
                [prompt], 1, EngineSampling(max_new_tokens=sampling.max_new_tokens, temperature=0)
            )
            ids = list(group[0].token_ids)
        else:
            tok = self.scorer.engine.tokenizer
            text = tok(solve(prompt), add_special_tokens=False).input_ids
            ids = [int(t) for t in text][: sampling.max_new_tokens - 1] + [self._eos()]
        comp = {"ids": ids, "lp": self._true_logprobs(prompt, ids, sampling.temperature)}
        payload = msgpack.packb({"prompt": pid, "index": index, "completions": [comp] * sampling.n})
        return Generated(prompt=pid, payload=payload, tokens=len(ids) * sampling.n)

    def _best_of(self, prompts: Sequence[tuple[str, int]], sampling: Sampling) -> list[Generated]:
        """``bestof:N``: N honest calls (the first the honest one; the others under other
        prompt ids, so other sampling seeds); per prompt and slot the first best by reward."""
        calls = [list(self.inner.generate(prompts, sampling))]
        for k in range(1, int(self.share)):
            calls.append(
                list(self.inner.generate([(f"{pid}~{k}", i) for pid, i in prompts], sampling))
            )
        eng = self.scorer.engine
        out = []
        for j, (pid, index) in enumerate(prompts):
            prompt = self.task.prompt(index)
            bodies = [msgpack.unpackb(c[j].payload) for c in calls]
            comps = []
            for slot in range(len(bodies[0]["completions"])):
                cands = [b["completions"][slot] for b in bodies]
                scores = [self.task.reward(prompt, eng.decode(c["ids"])) for c in cands]
                comps.append(cands[scores.index(max(scores))])
            tokens = sum(len(c["ids"]) for c in comps)
            payload = msgpack.packb({"prompt": pid, "index": index, "completions": comps})
            out.append(Generated(prompt=pid, payload=payload, tokens=tokens))
        return out

    def _rewrite(self, gen: Generated, how: Any) -> Generated:
        body = msgpack.unpackb(gen.payload)
        rng = np.random.default_rng(int(_coin(gen.prompt, "tokens") * 2**32))
        first = {"forge-lp", "vocab-id", "after-eos"}  # these lie on one completion
        body["completions"] = [
            how(c, rng) if i == 0 or self.kind not in first else c
            for i, c in enumerate(body["completions"])
        ]
        return Generated(prompt=gen.prompt, payload=msgpack.packb(body), tokens=gen.tokens)

    def _randomise(self, comp: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        """Random ids, an end id kept where the honest completion ended with it (and nowhere
        else): a payload of the right shape."""
        n = len(comp["ids"])
        ids = [int(x) for x in rng.integers(0, self.vocab, n)]
        if self.ends:
            free = [t for t in range(self.vocab) if t not in self.ends]
            ids = [x if x not in self.ends else free[x % len(free)] for x in ids]
            if n and comp["ids"][-1] in self.ends:
                ids[-1] = comp["ids"][-1]
        return {"ids": ids, "lp": comp["lp"]}

    def _forge(self, comp: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        return {"ids": comp["ids"], "lp": [self.share] * len(comp["ids"])}

    def _past_vocab(self, comp: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        return {"ids": [*comp["ids"][:-1], self.vocab], "lp": comp["lp"]}

    def _after_eos(self, comp: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        ids = list(comp["ids"])
        if self.eos is None:
            return comp
        if len(ids) < 2:
            return {"ids": [self.eos, *ids], "lp": [-0.1, *comp["lp"]]}
        ids[-2] = self.eos
        return {"ids": ids, "lp": comp["lp"]}

    @staticmethod
    def _halve(comp: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        return {"ids": comp["ids"], "lp": [float(x) / 2 for x in comp["lp"]]}
