"""The inference engine protocol every Actor programs against.

An engine holds one version of the policy as bf16 weights and does two things with it:
:meth:`Engine.generate` samples ``n`` completions per prompt, each with the log-probability of
every sampled token under the *sampling* distribution (logits divided by the temperature, no
other processing, so the Trainer can recompute the same quantity for the importance ratio), and
:meth:`Engine.apply` moves the weights from v-1 to v in place with a verified delta ``D_v``
(base version and hash checked, the whole delta decoded before a byte is written), only at a safe
point between :meth:`generate` calls. Two hashes answer two questions: :attr:`Engine.weights_hash`
is h(v), the chain value the Ledger and the signed announcements speak of, and
:meth:`Engine.weights_digest` hashes the bytes the engine actually holds, in the canonical fused
layout (:func:`canonical_state`). Nothing above this interface may depend on a particular
engine: the runtime sees only :class:`Engine`, :class:`Sampling` and :class:`Completion`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from aurora.delta import Delta, weights_hash
from aurora.delta.extract import fused_layout


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How to sample."""

    max_new_tokens: int
    """Most tokens per completion (the end-of-sequence token counts as one)."""
    temperature: float = 1.0
    """Logits are divided by it; 0 means greedy (log-probs then those of temperature 1)."""
    seed: int | None = None
    """Seed of this call's sampling; None draws from the engine's own generator."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")


@dataclass(frozen=True)
class Completion:
    """One sampled completion of one prompt."""

    prompt_index: int
    """Index of its prompt in the ``prompts`` argument of :meth:`Engine.generate`."""
    token_ids: tuple[int, ...]
    """Sampled tokens, the end-of-sequence token included when it was sampled."""
    logprobs: tuple[float, ...]
    """log p(token) under the sampling distribution (logits / temperature), one per token."""
    text: str
    """Decoded text of the tokens before the end-of-sequence token."""
    finish_reason: Literal["stop", "length"]
    """``stop``: ended with end-of-sequence; ``length``: hit ``max_new_tokens``."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@runtime_checkable
class Engine(Protocol):
    """What an Actor needs from an inference engine (transformers today, vLLM later).

    * :meth:`generate` returns, per completion, its token ids, the log-probability of each
      sampled token under the sampling distribution, its text and its token count.
    * :meth:`apply` goes through the delta package's apply path (:class:`aurora.delta.Delta`).
      Callers apply only at a safe point (between :meth:`generate` calls); an engine that can be
      called from several threads serialises the two.

    Two hashes, for two questions:

    * :attr:`weights_hash` is h(v): the snapshot's hash when the engine loaded it, then
      ``chain_hash(h(v-1), id(D_v))`` after each applied delta (:func:`aurora.delta.chain_hash`).
      It costs nothing and is what a result carries.
    * :meth:`weights_digest` hashes the bytes the engine actually holds, in the canonical fused
      layout (:func:`canonical_state`: q/k/v and gate/up stacked as the delta format names
      them), with :func:`aurora.delta.weights_hash`. It is the same for an engine with split
      weights (transformers) and one with fused weights (vLLM) holding the same bits, so anyone
      can check bit-identity with the Trainer's published weights (:func:`weights_digest_of`).
    """

    version: int
    """The policy version v the weights are at."""
    weights_hash: str
    """h(v): the snapshot hash at load, then ``chain_hash(h(v-1), id(D_v))`` per applied delta."""

    def generate(
        self, prompts: Sequence[str] | Sequence[Sequence[int]], n: int, sampling: Sampling
    ) -> list[list[Completion]]:
        """``n`` completions per prompt (text, or token ids including any BOS), grouped by
        prompt: ``result[i][j]`` is sample j of prompt i."""
        ...

    def apply(self, delta: Delta) -> str:
        """Apply the verified ``D_{version+1}`` in place; returns the new h(v). Refuses (and
        leaves the weights untouched) a delta whose base is not the current version and hash."""
        ...

    def load(self, state: Mapping[str, np.ndarray], *, version: int, weights_hash: str) -> None:
        """Replace all weights with ``state`` (bf16 bit patterns by split name, a snapshot) and
        declare them version ``version`` with chain hash ``weights_hash``."""
        ...

    def weights_digest(self) -> str:
        """Content hash of the weights held now, in the canonical fused layout."""
        ...


def canonical_state(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``{split name: bits}`` -> ``{fused name: bits}``: q/k/v and gate/up concatenated along the
    output dimension in the delta format's (vLLM's) order; other tensors unchanged."""
    layout = fused_layout({k: tuple(v.shape) for k, v in state.items()}, fuse=True)
    out: dict[str, np.ndarray] = {}
    for t in layout:
        if len(t.parts) == 1:
            out[t.name] = np.asarray(state[t.parts[0].name])
        else:
            out[t.name] = np.concatenate([np.asarray(state[p.name]) for p in t.parts], axis=0)
    return out


def weights_digest_of(state: Mapping[str, np.ndarray]) -> str:
    """:meth:`Engine.weights_digest` of split bf16 weights (e.g. the Trainer's published ones)."""
    return weights_hash(canonical_state(state))


class EngineError(ValueError):
    """A request the engine refuses (prompt too long, unknown token, wrong weights)."""


def encode_prompts(
    tokenizer: Any, prompts: Sequence[str] | Sequence[Sequence[int]]
) -> list[list[int]]:
    """Token ids of each prompt (text through the tokenizer, BOS included; ids as given)."""
    out = []
    for p in prompts:
        if isinstance(p, str):
            try:
                out.append([int(t) for t in tokenizer(p).input_ids])
            except Exception as exc:
                raise EngineError(f"prompt {p!r} cannot be tokenized: {exc}") from None
        else:
            out.append([int(t) for t in p])
    return out


def end_ids(tokenizer: Any, *more: Any) -> frozenset[int]:
    """The ids a completion ends at: the tokenizer's end-of-sequence and every id in ``more``
    (a model's generation config's ``eos_token_id``: an id, a list, or None). Every engine
    stops at these and the Trainer reads rewards up to them, so the payload rule (a completion
    ends at its first one: :func:`aurora.policy.refusals.completion_fault`) is checked against
    the same set (``JobSpec.eos_ids``)."""
    ids: set[Any] = {tokenizer.eos_token_id}
    for e in more:
        ids |= set(e) if isinstance(e, (list, tuple, set, frozenset)) else {e}
    return frozenset(int(e) for e in ids if e is not None)


def decode_completion(tokenizer: Any, eos_ids: Any, token_ids: Sequence[int]) -> str:
    """Text of a completion: the tokens before the first end-of-sequence token."""
    ids = list(token_ids)
    for i, t in enumerate(ids):
        if t in eos_ids:
            ids = ids[:i]
            break
    return str(tokenizer.decode(ids, skip_special_tokens=False))
