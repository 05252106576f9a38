"""Per-prompt leases and the acceptance predicate (paper, "Per-prompt leases, not collective
micro-batches").

Theory of operation
-------------------
Work is a pool of prompts. Dispatch claims prompts from the pool as leases, one per prompt, for a
given Actor and policy version ``v_j`` with expiry ``now + L``. ``L = k * median completion time``
of recently settled leases (``k`` = 2.5, within the paper's 2-3x); before :attr:`LeaseConfig.
min_samples` completions exist, ``L`` is :attr:`LeaseConfig.initial_s`. A lease ends exactly once:

* **settled** - a result ``r`` arrived and the acceptance predicate admitted it:
  ``t_r <= expiry_j and v_r == v_j and h_r == h(v_j)`` (:func:`admits`). This is the only
  correctness check in the data plane.
* **expired** - ``now > expiry`` (found by :meth:`LeaseBook.expire_due` on a tick, or by a late
  result); the prompt goes back to the pool.
* **released** - the holder left gracefully (preemption notice), or sent a result that the
  predicate refused; the prompt goes back to the pool at once instead of waiting for expiry.

Each prompt is in exactly one of: pool, leased (one live lease), done (one settled lease). So no
prompt is lost and none is settled twice; :meth:`LeaseBook.check` asserts it. Returned prompts keep
their original order number, so they are re-leased before newer prompts.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import Enum
from statistics import median
from typing import NamedTuple

from aurora.policy._fsm import step


class LeaseState(Enum):
    CLAIMED = "claimed"
    SETTLED = "settled"
    EXPIRED = "expired"
    RELEASED = "released"


TRANSITIONS: dict[LeaseState, dict[str, LeaseState]] = {
    LeaseState.CLAIMED: {
        "settle": LeaseState.SETTLED,
        "expire": LeaseState.EXPIRED,
        "release": LeaseState.RELEASED,
    },
    LeaseState.SETTLED: {},
    LeaseState.EXPIRED: {},
    LeaseState.RELEASED: {},
}
"""Legal moves of one lease: a lease ends exactly once."""

MACHINE = "lease"
_FROM_CLAIMED = TRANSITIONS[LeaseState.CLAIMED]
"""The only state with moves, looked up by trigger alone: every result ends a lease, and hashing
an ``Enum`` member runs Python code (~1 us) where hashing the trigger string does not."""
_SETTLED = _FROM_CLAIMED["settle"]


class Refusal(Enum):
    """Why a result was not admitted."""

    UNKNOWN_LEASE = "unknown lease"
    WRONG_ACTOR = "result from an Actor that does not hold the lease"
    DUPLICATE = "lease already settled"
    LATE = "result after the lease expired"
    WRONG_VERSION = "result generated on another policy version"
    WRONG_HASH = "result generated on weights whose hash differs from h(v)"


class Lease(NamedTuple):
    """One prompt leased to one Actor for one policy version.

    A named tuple, not a frozen dataclass: one is made per prompt (3 x 10^5 in an 800-step run),
    and a frozen dataclass's ``__init__`` (one ``object.__setattr__`` per field) costs ~2 us
    against ~0.5 us for a tuple. Immutable all the same."""

    id: str
    """Lease id, unique within a :class:`LeaseBook`."""
    prompt: str
    """Prompt id."""
    actor: str
    """Holder."""
    version: int
    """Policy version v_j the rollout must be generated on."""
    weights_hash: str
    """h(v_j): the weights hash the result must carry."""
    claimed_at: float
    """Claim time, seconds."""
    expiry: float
    """Expiry time, seconds: a result after it is late."""


@dataclass(kw_only=True, slots=True)
class Verdict:  # not frozen: one is made per result, and frozen init costs ~1 us (10^5 results/s)
    """Outcome of settling one result."""

    lease: str
    """The lease id the result named."""
    refusal: Refusal | None
    """None when admitted."""
    prompt: str | None = None
    """The prompt of the lease, when the lease is known."""
    returned_to_pool: bool = False
    """True when refusing the result sent the prompt back to the pool."""

    @property
    def admitted(self) -> bool:
        return self.refusal is None


def admits(lease: Lease, *, t_r: float, v_r: int, h_r: str) -> Refusal | None:
    """The acceptance predicate: admit r for j iff t_r <= expiry_j, v_r = v_j, h_r = h(v_j)."""
    if t_r > lease.expiry:
        return Refusal.LATE
    if v_r != lease.version:
        return Refusal.WRONG_VERSION
    if h_r != lease.weights_hash:
        return Refusal.WRONG_HASH
    return None


@dataclass(frozen=True, kw_only=True)
class LeaseConfig:
    """Lease length policy."""

    k: float = 2.5
    """L = k x running median completion time; the paper uses 2-3x."""
    initial_s: float = 600.0
    """L (seconds) until min_samples completions are known: generous, since a first batch of a
    large model on a slow Actor can take minutes and an early expiry wastes the whole batch."""
    min_samples: int = 8
    """Completions needed before the median is trusted."""
    min_s: float = 1.0
    """Lower bound on L (seconds), so that a burst of very fast completions cannot make leases
    expire before a round trip over a WAN."""
    window: int = 256
    """Number of most recent completion times the median is taken over."""

    def __post_init__(self) -> None:
        if not (2.0 <= self.k <= 3.0):
            raise ValueError(f"LeaseConfig.k must be within the paper's 2-3, got {self.k!r}")
        for name in ("initial_s", "min_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"LeaseConfig.{name} must be positive seconds, got {value!r}")
        if self.min_samples < 1 or self.window < self.min_samples:
            raise ValueError(
                f"LeaseConfig needs 1 <= min_samples <= window, got "
                f"{self.min_samples}, {self.window}"
            )


class LeaseBook:
    """The prompt pool and every lease; all lease transitions go through here."""

    def __init__(self, config: LeaseConfig | None = None) -> None:
        self.config = config or LeaseConfig()
        self.leases: dict[str, Lease] = {}
        self.states: dict[str, LeaseState] = {}
        self.batch_of: dict[str, int] = {}  # prompt -> version of the batch it came in
        self._order: dict[str, int] = {}  # prompt -> arrival number (pool priority)
        self._arrivals = 0  # arrival numbers handed out (never reused: see forget_settled)
        self._pool: list[tuple[int, str]] = []  # heap of (arrival number, prompt)
        self.leased: dict[str, str] = {}  # prompt -> live lease id
        self.done: dict[str, str] = {}  # prompt -> settled lease id
        self.by_actor: dict[str, set[str]] = {}  # actor -> live lease ids
        self._completions: deque[float] = deque(maxlen=self.config.window)
        self._next_lease = 0
        # Batch version -> its prompts, and the ids of their leases, still in the book: an index
        # so that forget_settled visits only the batches it forgets, not every lease of the book.
        self._batch_prompts: dict[int, list[str]] = {}
        self._batch_leases: dict[int, list[str]] = {}

    # -- pool -----------------------------------------------------------------------------
    def add(self, prompts: Iterable[str], batch_version: int) -> None:
        """Put new prompts into the pool. Raises ValueError for a prompt id seen before."""
        prompts = list(prompts)
        order = self._order
        if len(set(prompts)) != len(prompts) or not order.keys().isdisjoint(prompts):
            seen = set()
            for p in prompts:
                if p in order or p in seen:
                    raise ValueError(f"prompt id {p!r} was already submitted")
                seen.add(p)
        # Arrival numbers are never reused: forget_settled drops old prompts, and a number
        # taken from the book's size could then sort a new batch before returned older prompts.
        numbers = range(self._arrivals, self._arrivals + len(prompts))
        self._arrivals += len(prompts)
        order.update(zip(prompts, numbers, strict=True))
        self.batch_of.update(dict.fromkeys(prompts, batch_version))
        pool = self._pool
        for item in zip(numbers, prompts, strict=True):
            heapq.heappush(pool, item)
        self._batch_prompts.setdefault(batch_version, []).extend(prompts)

    def _push(self, prompt: str) -> None:
        heapq.heappush(self._pool, (self._order[prompt], prompt))

    @property
    def pool_size(self) -> int:
        return len(self._pool)  # one entry per prompt in the pool: claim pops what it takes

    def pool(self) -> list[str]:
        """Prompts waiting for a lease, in the order they will be claimed."""
        return [p for _, p in sorted(self._pool)]

    # -- lease length ---------------------------------------------------------------------
    def lease_length(self) -> float:
        """L in seconds: k x median of recent completion times, or the initial length."""
        if len(self._completions) < self.config.min_samples:
            return self.config.initial_s
        return max(self.config.min_s, self.config.k * median(self._completions))

    # -- transitions ----------------------------------------------------------------------
    def claim(
        self, actor: str, count: int, *, version: int, weights_hash: str, now: float
    ) -> list[Lease]:
        """Lease up to ``count`` prompts from the head of the pool to ``actor``."""
        if count < 0:
            raise ValueError(f"lease count must be >= 0, got {count}")
        length = self.lease_length()
        expiry = now + length
        out: list[Lease] = []
        pool, leases, states = self._pool, self.leases, self.states
        leased, batch_of, batch_leases = self.leased, self.batch_of, self._batch_leases
        if not count or not pool:
            return out
        add = self.by_actor.setdefault(actor, set()).add
        claimed, pop, append = LeaseState.CLAIMED, heapq.heappop, out.append
        first = self._next_lease + 1
        taken = min(count, len(pool))
        batch: int | None = None
        of_batch: list[str] = []
        for n in range(first, first + taken):
            prompt = pop(pool)[1]
            lid = f"L{n}"
            lease = Lease(lid, prompt, actor, version, weights_hash, now, expiry)
            leases[lid] = lease
            states[lid] = claimed
            leased[prompt] = lid
            add(lid)
            if batch_of[prompt] != batch:  # a claim's prompts mostly come from one batch
                batch = batch_of[prompt]
                of_batch = batch_leases.setdefault(batch, [])
            of_batch.append(lid)
            append(lease)
        self._next_lease = first + taken - 1
        return out

    def _end(self, lease_id: str, trigger: str) -> Lease:
        old = self.states[lease_id]
        new = _FROM_CLAIMED.get(trigger) if old is LeaseState.CLAIMED else None
        if new is None:
            new = step(MACHINE, TRANSITIONS, old, trigger)  # raises IllegalTransition
        lease = self.leases[lease_id]
        self.states[lease_id] = new
        del self.leased[lease.prompt]
        self.by_actor[lease.actor].discard(lease_id)
        if new is LeaseState.SETTLED:
            self.done[lease.prompt] = lease_id
        else:
            self._push(lease.prompt)
        return lease

    def expire_due(self, now: float) -> list[Lease]:
        """Expire every live lease with ``expiry < now``; their prompts return to the pool."""
        due = [
            lid for lids in self.by_actor.values() for lid in lids if self.leases[lid].expiry < now
        ]
        return [self._end(lid, "expire") for lid in sorted(due, key=self._lease_number)]

    def release_actor(self, actor: str) -> list[Lease]:
        """Release every live lease of ``actor`` (graceful leave); prompts return to the pool."""
        lids = sorted(self.by_actor.get(actor, ()), key=self._lease_number)
        return [self._end(lid, "release") for lid in lids]

    def live(self, actor: str) -> list[Lease]:
        return [
            self.leases[lid] for lid in sorted(self.by_actor.get(actor, ()), key=self._lease_number)
        ]

    @staticmethod
    def _lease_number(lease_id: str) -> int:
        return int(lease_id[1:])

    def settle(
        self, lease_id: str, *, actor: str, version: int, weights_hash: str, now: float
    ) -> Verdict:
        """Apply the acceptance predicate to a result and end the lease accordingly."""
        refusal, prompt, returned = self.judge(lease_id, actor, version, weights_hash, now)
        return Verdict(lease=lease_id, refusal=refusal, prompt=prompt, returned_to_pool=returned)

    def judge(
        self, lease_id: str, actor: str, version: int, weights_hash: str, now: float
    ) -> tuple[Refusal | None, str | None, bool]:
        """:meth:`settle` without building a :class:`Verdict` (the Ledger's per-result path):
        ``(refusal, prompt, returned_to_pool)``."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return Refusal.UNKNOWN_LEASE, None, False
        if actor != lease.actor:
            # Not the holder: refuse, and leave the holder's lease alone.
            return Refusal.WRONG_ACTOR, lease.prompt, False
        state = self.states[lease_id]
        if state is LeaseState.SETTLED:
            return Refusal.DUPLICATE, lease.prompt, False
        if state is not LeaseState.CLAIMED:
            return Refusal.LATE, lease.prompt, False
        refusal = admits(lease, t_r=now, v_r=version, h_r=weights_hash)
        if refusal is Refusal.LATE:
            self._end(lease_id, "expire")
            return refusal, lease.prompt, True
        if refusal is not None:
            self._end(lease_id, "release")
            return refusal, lease.prompt, True
        # _end(lease_id, "settle") written out (CLAIMED -> SETTLED, checked above): this line
        # runs once per admitted result.
        prompt = lease.prompt
        self.states[lease_id] = _SETTLED
        del self.leased[prompt]
        self.by_actor[actor].discard(lease_id)
        self.done[prompt] = lease_id
        self._completions.append(now - lease.claimed_at)
        return None, prompt, False

    def forget_settled(self, before_version: int) -> int:
        """Forget every settled prompt of a batch generated on a version below
        ``before_version``, with all its leases; return how many prompts were forgotten.

        Without this the book keeps every lease of the job (~1 KB per prompt: 4 MiB of a
        Trainer's memory over a 200-step soak), and a long job's Ledger grows without bound. A
        forgotten prompt can no longer be settled twice: a result for one of its leases is
        refused as ``UNKNOWN_LEASE`` instead of ``DUPLICATE`` or ``LATE``."""
        done, total = self.done, 0
        for batch in [v for v in self._batch_prompts if v < before_version]:
            prompts = self._batch_prompts[batch]
            gone = {p for p in prompts if p in done}
            if not gone:
                continue
            kept: list[str] = []
            for lid in self._batch_leases.get(batch, ()):
                if self.leases[lid].prompt in gone:
                    del self.leases[lid]
                    del self.states[lid]
                else:
                    kept.append(lid)
            for p in gone:
                del done[p], self.batch_of[p], self._order[p]
            total += len(gone)
            left = [p for p in prompts if p not in gone]
            if left:
                self._batch_prompts[batch] = left
                self._batch_leases[batch] = kept
            else:
                del self._batch_prompts[batch]
                self._batch_leases.pop(batch, None)
        return total

    # -- invariants -----------------------------------------------------------------------
    def check(self) -> None:
        """Assert that every prompt is in exactly one place and every lease is consistent."""
        assert set(self._order) == set(self.batch_of)
        pool, leased, done = {p for _, p in self._pool}, set(self.leased), set(self.done)
        assert len(pool) == len(self._pool), "a prompt is in the pool twice"
        assert not (pool & leased) and not (pool & done) and not (leased & done)
        assert pool | leased | done == set(self._order), "a prompt was lost"
        for prompt, lid in self.leased.items():
            assert self.states[lid] is LeaseState.CLAIMED and self.leases[lid].prompt == prompt
        for prompt, lid in self.done.items():
            assert self.states[lid] is LeaseState.SETTLED and self.leases[lid].prompt == prompt
        settled = [lid for lid, s in self.states.items() if s is LeaseState.SETTLED]
        assert len(settled) == len(self.done), "a prompt was settled twice"
        live = {lid for lids in self.by_actor.values() for lid in lids}
        assert live == set(self.leased.values())
        indexed = [p for ps in self._batch_prompts.values() for p in ps]
        assert len(indexed) == len(self._order) and set(indexed) == set(self._order)
        assert all(self.batch_of[p] == v for v, ps in self._batch_prompts.items() for p in ps)
        indexed = [lid for lids in self._batch_leases.values() for lid in lids]
        assert len(indexed) == len(self.leases) and set(indexed) == set(self.leases)

    def _key(self) -> tuple[object, ...]:
        return (
            self.leases,
            self.states,
            self.batch_of,
            self._order,
            sorted(self._pool),
            self.leased,
            self.done,
            self.by_actor,
            list(self._completions),
            self._next_lease,
            self._arrivals,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LeaseBook):
            return NotImplemented
        return self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]

    def __iter__(self) -> Iterator[Lease]:
        return iter(self.leases.values())
