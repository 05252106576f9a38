"""What a result's completions may look like, and how refusals count against an Actor.

One payload rule (:func:`completion_fault`), applied by the Ledger before it settles a lease and
by the Trainer again (:func:`aurora.runtime.messages.decode_result_payload` calls it): a
completion ends at its first end-of-sequence id or at exactly ``max_new_tokens``, and every
reported log-prob is at least :func:`logprob_floor`, below which an honest sampler's token falls
with probability ``FALSE_REFUSAL`` at most. Every refused result of an Actor (a payload the
Ledger refuses before admission, or an admitted result the Trainer refuses) is one strike
(:class:`StrikeBook`); at ``max_refusals`` the Actor is excluded from the job for good. Three
strikes are never an honest Actor's, while each refused result costs the job one lease at most.
Exclusion is final: one state machine per Actor (``TRANSITIONS``), an illegal move raises
:class:`~aurora.policy.IllegalTransition` and changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from enum import Enum

from aurora.policy._fsm import step

FALSE_REFUSAL = 1e-9
"""Highest probability that one honest token's reported log-prob is below the floor."""

ENGINE_GAP_NATS = 1.0
"""How far an engine's reported log-prob may sit below the one of the distribution it sampled
from (nats): 5x the largest difference measured between two honest computations."""


def logprob_floor(vocab_size: int) -> float:
    """Lowest plausible reported log-prob of a sampled token (nats):
    ``ln(FALSE_REFUSAL / V) - ENGINE_GAP_NATS``; -24.6 for V = 17, -33.7 for V = 151,936.

    An honest sampler draws, at one position, a token of probability below ``e^L`` with
    probability at most ``V e^L`` (the tokens below it hold that much mass at most), whatever
    the temperature, since it reports the log-prob of the distribution it drew from. The floor
    puts that at ``FALSE_REFUSAL`` per token, ``ENGINE_GAP_NATS`` lower still for the gap
    between the probabilities an engine samples with and those it reports
    (docs/VERIFICATION.md)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    return math.log(FALSE_REFUSAL / vocab_size) - ENGINE_GAP_NATS


def completion_fault(
    ids: Sequence[int],
    logprobs: Sequence[float],
    *,
    eos_ids: Collection[int] | None,
    max_new_tokens: int | None,
    floor: float | None,
) -> str | None:
    """Why one completion (its token ids and reported log-probs, already within the wire's
    bounds) breaks the payload rule, or None. ``eos_ids``: every id a completion ends at (the
    model's: a tokenizer's ``<eos>`` and its generation config's). ``eos_ids``,
    ``max_new_tokens`` or ``floor`` None: that part is not known here and not checked.

    * **end of sequence**: a completion is its tokens up to and including the first
      end-of-sequence id (any of the model's: the ids every engine stops at), or exactly
      ``max_new_tokens`` tokens without one. An honest engine stops at ``<eos>`` or at the
      length limit; tokens after ``<eos>`` would be trained on with the reward of the text
      before it, and a short completion without ``<eos>`` is text no sampler produced;
    * **plausible behaviour log-probs**: every reported log-prob is at least ``floor``
      (:func:`logprob_floor` of the vocabulary size).
    """
    if not ids:
        return "no tokens (an engine samples at least one)"
    if eos_ids is not None:
        ends = frozenset(eos_ids)
        end = next((i for i, t in enumerate(ids) if t in ends), -1)
        if end >= 0 and end != len(ids) - 1:
            return f"{len(ids) - 1 - end} token(s) after end-of-sequence (position {end})"
        if end < 0 and max_new_tokens is not None and len(ids) != max_new_tokens:
            return f"{len(ids)} tokens without end-of-sequence, below the limit {max_new_tokens}"
    if floor is not None:
        for t, lp in enumerate(logprobs):
            if not lp >= floor:  # NaN fails too
                return f"log-prob {lp:.4g} at position {t} below the plausible floor {floor:.4g}"
    return None


class Standing(Enum):
    COUNTING = "counting"
    EXCLUDED = "excluded"


TRANSITIONS: dict[Standing, dict[str, Standing]] = {
    Standing.COUNTING: {"strike": Standing.COUNTING, "exclude": Standing.EXCLUDED},
    Standing.EXCLUDED: {},
}
"""Legal moves of one Actor's refusal record: exclusion is final."""

MACHINE = "refusals"

DEFAULT_MAX_REFUSALS = 3
"""Refused results that exclude an Actor."""


@dataclass
class StrikeBook:
    """Every Actor's refused results.

    Every refused result of an Actor (a payload the Ledger refuses before admission, or an
    admitted result the Trainer refuses: a step it would have made non-finite or an outlier) is
    one strike; at ``max_refusals`` the Actor is excluded from the job for good. An honest
    Actor's payload is refused with probability ``FALSE_REFUSAL`` per token, so three strikes
    are never an honest Actor's, while each refused result costs the job one lease at most (its
    prompt is leased again).
    """

    max_refusals: int = DEFAULT_MAX_REFUSALS
    """The refusal that reaches this count excludes the Actor."""
    counts: dict[str, int] = field(default_factory=dict)
    standing: dict[str, Standing] = field(default_factory=dict)
    struck: set[tuple[str, str]] = field(default_factory=set)
    """(Actor, lease) of every refusal counted: a lease counts once (a restarted Trainer tells
    its refusals again), and each Actor has at most ``max_refusals`` here."""

    def __post_init__(self) -> None:
        if isinstance(self.max_refusals, bool) or not isinstance(self.max_refusals, int):
            raise ValueError(f"max_refusals must be an int >= 1, got {self.max_refusals!r}")
        if self.max_refusals < 1:
            raise ValueError(f"max_refusals must be an int >= 1, got {self.max_refusals!r}")

    def excluded(self, actor: str) -> bool:
        return self.standing.get(actor) is Standing.EXCLUDED

    def strike(self, actor: str, lease: str) -> bool:
        """Count ``actor``'s refused result for ``lease``; True when this one excludes it. An
        excluded Actor raises :class:`~aurora.policy.IllegalTransition`, a lease counted before
        ``ValueError`` (nothing changes either way)."""
        state = self.standing.get(actor, Standing.COUNTING)
        n = self.counts.get(actor, 0) + 1
        state = step(MACHINE, TRANSITIONS, state, "exclude" if n >= self.max_refusals else "strike")
        if (actor, lease) in self.struck:
            raise ValueError(f"{MACHINE}: {actor!r}'s result for {lease!r} was counted already")
        self.struck.add((actor, lease))
        self.counts[actor] = n
        self.standing[actor] = state
        return state is Standing.EXCLUDED
