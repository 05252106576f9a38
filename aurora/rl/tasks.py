"""Verifiable tasks and rule-based rewards.

Theory of operation
-------------------
A *reward function* is a plain function ``(prompt: str, completion: str) -> float``: the Trainer
calls it on the prompt text and on the completion text it decoded itself from the Actor's token
ids (an Actor's own reward or text is never trusted). Users plug in their own; :func:`score` is
the one place a reward function is called, so a function that raises or returns something that
is not a finite number fails with a :class:`RewardError` naming the function and the prompt. A
*task* (:class:`Task`) is a reward function plus a seeded training stream of prompts and a fixed
held-out set. The default is :class:`ArithmeticTask`; :func:`answer_reward` scores free-form
reasoning of a real model against a data set's answers (:func:`extract_answer`, GSM8K style).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import numpy as np

RewardFn = Callable[[str, str], float]
"""``(prompt, completion) -> reward``."""


class RewardError(RuntimeError):
    """A reward function raised or returned something that is not a finite number."""


def reward_name(fn: RewardFn) -> str:
    """How errors name a reward function: its qualified name (module too when it has one)."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module else str(name)


def score(fn: RewardFn, prompt: str, completion: str) -> float:
    """``fn(prompt, completion)`` as a float; any failure becomes a :class:`RewardError` naming
    the function and the prompt (the one place rewards are computed)."""
    try:
        value = fn(prompt, completion)
    except Exception as exc:
        raise RewardError(
            f"reward function {reward_name(fn)} raised {type(exc).__name__}: {exc} "
            f"(prompt {prompt!r}, completion {completion!r})"
        ) from exc
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    out = float(value) if ok else math.nan
    if not math.isfinite(out):
        raise RewardError(
            f"reward function {reward_name(fn)} returned {value!r}, not a finite number "
            f"(prompt {prompt!r})"
        )
    return out


class Task(Protocol):
    """What the Trainer, the Actors and the evaluation need from a task: a reward function
    plus prompts.

    * a training stream indexed by an integer prompt id, ``task.prompt(i)``, rebuilt by any
      process from ``(seed, i)`` alone, so a Ledger can hand out prompt ids as leases and the
      Trainer and every Actor derive the same text without shipping it;
    * a fixed held-out set, ``task.heldout()``, disjoint from the training stream, drawn from
      its own seed so that runs with different training seeds are evaluated on the same
      problems."""

    name: str
    max_new_tokens: int
    """Completion length limit (tokens) that every answer fits in."""

    def reward(self, prompt: str, completion: str) -> float: ...

    def prompt(self, prompt_id: int) -> str:
        """Training prompt ``prompt_id`` (any int >= 0) of the seeded stream."""
        ...

    def heldout(self) -> Sequence[str]:
        """The fixed held-out prompts."""
        ...


# ------------------------------------------------------------------------------------------
# Arithmetic
# ------------------------------------------------------------------------------------------

_OPS: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}
_PROBLEM = re.compile(r"^(\d+)([+\-*])(\d+)=$")


def solve(prompt: str) -> str:
    """The exact answer of an arithmetic prompt ``a<op>b=`` as text."""
    m = _PROBLEM.match(prompt)
    if m is None:
        raise ValueError(f"not an arithmetic prompt of the form 'a+b=': {prompt!r}")
    return str(_OPS[m[2]](int(m[1]), int(m[3])))


def arithmetic_reward(prompt: str, completion: str) -> float:
    """1.0 iff the completion (the text before ``<eos>``) is exactly the answer, else 0.0."""
    return 1.0 if completion == solve(prompt) else 0.0


@dataclass(frozen=True, kw_only=True)
class ArithmeticConfig:
    """The default task: ``a<op>b=`` with a rule-checked exact answer."""

    seed: int = 0
    """Seed of the training stream: prompt ``i`` is drawn from ``(seed, i)`` alone."""
    heldout_seed: int = 0
    """Seed of the held-out set (kept apart from ``seed`` so every training seed is evaluated
    on the same problems)."""
    heldout_size: int = 500
    """Distinct held-out problems; 500 gives one evaluation a standard error of about
    +-2.2 points near 50% accuracy."""
    min_digits: int = 1
    """Fewest digits of an operand."""
    max_digits: int = 3
    """Most digits of an operand."""
    op: str = "+"
    """One of ``+ - *``."""

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"op: {self.op!r} is not one of {sorted(_OPS)}")
        if not 1 <= self.min_digits <= self.max_digits <= 9:
            raise ValueError(
                f"min_digits/max_digits: need 1 <= {self.min_digits} <= {self.max_digits} <= 9"
            )
        if self.heldout_size < 1:
            raise ValueError(f"heldout_size: must be >= 1, got {self.heldout_size}")


@dataclass(frozen=True)
class ArithmeticTask:
    """Seeded arithmetic problems; implements :class:`Task`.

    The default task, the one measured in ``docs/journal/early-measurements.md``: the prompt
    ``a+b=`` with each operand's digit count uniform in 1..3 and then its value uniform among
    the numbers with that many digits; the completion must be exactly the digits of ``a+b``
    followed by end-of-sequence (the completion text is what precedes ``<eos>``; a completion
    cut off by the token limit has ``max_new_tokens`` characters, one more than the longest
    answer, so it never matches). The reward is 1 for an exact match and 0 otherwise."""

    config: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    name: str = "arithmetic"

    @staticmethod
    def reward(prompt: str, completion: str) -> float:
        return arithmetic_reward(prompt, completion)

    @property
    def max_new_tokens(self) -> int:
        """Characters of the longest possible answer, plus one for ``<eos>``."""
        hi = 10**self.config.max_digits - 1
        longest = max(len(solve(f"{a}{self.config.op}{b}=")) for a in (0, hi) for b in (0, hi))
        return longest + 1

    def _draw(self, rng: np.random.Generator) -> tuple[int, int]:
        c = self.config
        out = []
        for _ in range(2):
            d = int(rng.integers(c.min_digits, c.max_digits + 1))
            lo = 0 if d == 1 else 10 ** (d - 1)
            out.append(int(rng.integers(lo, 10**d)))
        return out[0], out[1]

    def _text(self, ab: tuple[int, int]) -> str:
        return f"{ab[0]}{self.config.op}{ab[1]}="

    @cached_property
    def _heldout(self) -> tuple[tuple[int, int], ...]:
        rng = np.random.default_rng([self.config.heldout_seed, 1])
        space = 1
        for _ in range(2):
            space *= 10**self.config.max_digits - (
                0 if self.config.min_digits == 1 else 10 ** (self.config.min_digits - 1)
            )
        if self.config.heldout_size > space // 4:
            raise ValueError(
                f"heldout_size: {self.config.heldout_size} problems would take more than a "
                f"quarter of the {space} possible ones, leaving too few to train on"
            )
        seen: dict[tuple[int, int], None] = {}
        while len(seen) < self.config.heldout_size:
            seen.setdefault(self._draw(rng))
        return tuple(seen)

    @cached_property
    def _heldout_set(self) -> frozenset[tuple[int, int]]:
        return frozenset(self._heldout)

    def prompt(self, prompt_id: int) -> str:
        if isinstance(prompt_id, bool) or not isinstance(prompt_id, (int, np.integer)):
            raise TypeError(f"prompt id must be an int, got {prompt_id!r}")
        if prompt_id < 0:
            raise ValueError(f"prompt id must be >= 0, got {prompt_id}")
        rng = np.random.default_rng([self.config.seed, 0, int(prompt_id)])
        ab = self._draw(rng)
        while ab in self._heldout_set:  # the held-out problems are never trained on
            ab = self._draw(rng)
        return self._text(ab)

    def prompts(self, first: int, count: int) -> list[str]:
        """Training prompts ``first .. first+count-1``."""
        return [self.prompt(i) for i in range(first, first + count)]

    def heldout(self) -> list[str]:
        return [self._text(ab) for ab in self._heldout]


# ------------------------------------------------------------------------------------------
# GSM8K-style answers on any text
# ------------------------------------------------------------------------------------------

_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?"
_MARKED = (
    re.compile(r"####\s*(" + _NUMBER + ")"),
    re.compile(r"\\boxed\{\s*(" + _NUMBER + r")\s*\}"),
    re.compile(r"answer is\s*:?\s*(" + _NUMBER + ")", re.IGNORECASE),
)
_ANY_NUMBER = re.compile(_NUMBER)


def normalize_number(text: str) -> str:
    """``"$1,234.50"`` -> ``"1234.5"``; ``"7.0"`` -> ``"7"``; other text is stripped only."""
    t = text.strip().replace(",", "").replace("$", "").rstrip(".")
    if re.fullmatch(r"-?\d+(?:\.\d+)?", t):
        if "." in t:
            t = t.rstrip("0").rstrip(".")
        if t in ("-0", ""):
            t = "0"
    return t


def extract_answer(text: str) -> str | None:
    """The final answer of free-form text, GSM8K style: ``#### N``, then ``\\boxed{N}``, then
    "the answer is N" (the last of each kind wins), else the last number; None if there is no
    number at all."""
    for pattern in _MARKED:
        found = pattern.findall(text)
        if found:
            return normalize_number(found[-1])
    numbers = _ANY_NUMBER.findall(text)
    return normalize_number(numbers[-1]) if numbers else None


def answer_reward(reference: Callable[[str], str] | Mapping[str, str]) -> RewardFn:
    """A reward function: 1.0 iff :func:`extract_answer` of the completion equals the reference
    answer of the prompt (``reference(prompt)`` or ``reference[prompt]``), numbers compared after
    :func:`normalize_number`."""
    lookup: Callable[[str], str]
    if isinstance(reference, Mapping):
        table = reference

        def lookup(prompt: str) -> str:
            try:
                return table[prompt]
            except KeyError:
                raise KeyError(f"no reference answer for prompt {prompt!r}") from None
    else:
        lookup = reference

    def gsm8k_style_reward(prompt: str, completion: str) -> float:
        got = extract_answer(completion)
        return 1.0 if got is not None and got == normalize_number(str(lookup(prompt))) else 0.0

    return gsm8k_style_reward


gsm8k_arithmetic_reward: RewardFn = answer_reward(solve)
"""The GSM8K-style reward on the arithmetic task: lenient where :func:`arithmetic_reward` is exact
(``"The answer is 579."`` scores 1)."""
