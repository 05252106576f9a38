"""Per-prompt leases and the acceptance predicate (paper, "Per-prompt leases, not collective
micro-batches").

Theory of operation
-------------------
Work is a pool of prompts. Dispatch claims prompts from the pool as leases, one per prompt, for a
given Actor and policy version ``v_j`` with expiry ``now + L``. ``L = k * median completion time``
of recently settled leases (``k`` = 2.5, within the paper's 2-3x); before :attr:`LeaseConfig.
min_samples` completions exist, ``L`` is :attr:`LeaseConfig.initial_s`.

**Leases that cannot livelock.** The median is over every Actor's completions, so a fast Actor
can shrink ``L`` below what a slower one needs: when the fast one then leaves (or is preempted),
every lease of the slow one expires before its result arrives, nothing is ever admitted, and
the median never moves again (an attack made 76 expiries and no admission this way). So the
length also adapts from expiries, per Actor (:meth:`LeaseBook.lease_length` with ``actor``):

* an expired lease of length ``l`` makes its holder's next leases at least
  ``expiry_growth * l`` long (a late result's measured time too), up to ``max_s`` (by default
  the initial length): an Actor that needs ``T`` seconds gets an admitted result after at most
  ``floor(log2(T / L)) + 1`` rounds of expiry. An Actor generates one assignment at a time, so
  this holds only because it drops work whose lease has expired, or would before it could
  finish it (:func:`aurora.policy.actor.next_action`): otherwise each new lease waits behind a
  generation that can only be refused late. With that, the stall is at most the expired
  leases' lengths (each at most ``T``, together less than ``2T``), the ticks that found them,
  and one generation (``tests/test_lease_livelock.py``);
* once an Actor has had a lease expire, its leases are never shorter than the longest completion
  it was admitted with among its last ``own_window`` (what it has needed), so after the first
  admission it is not starved again by the others' median.

An Actor none of whose leases ever expired gets exactly ``L`` (the floor is not armed), so
where no lease expires every decision is the one the plain median rule makes. The floor is per
Actor, kept only for the Actor it describes, so a departed Actor's times never lengthen another
Actor's leases (a prompt on a crashed fast Actor is not held for a slow one's time).

A lease ends exactly once:

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
from collections.abc import Iterable, Iterator, Sequence
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


class Refusal(Enum):
    """Why a result was not admitted."""

    UNKNOWN_LEASE = "unknown lease"
    WRONG_ACTOR = "result from an Actor that does not hold the lease"
    DUPLICATE = "lease already settled"
    LATE = "result after the lease expired"
    WRONG_VERSION = "result generated on another policy version"
    WRONG_HASH = "result generated on weights whose hash differs from h(v)"
    BAD_PAYLOAD = "result whose payload is not what its lease asked for"
    UNVERIFIED = "result whose completions failed the Trainer's recompute under pi_v"
    TRAINER_REFUSED = "admitted result the Trainer refused (its payload, or a step it spoils)"


class Lease(NamedTuple):
    """One prompt leased to one Actor for one policy version (immutable)."""

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


class Claim(NamedTuple):
    """A request to lease prompts to one Actor (:meth:`LeaseBook.claim`)."""

    actor: str
    """Who gets the leases."""
    wanted: int
    """How many prompts it takes at most (fewer when the pool runs out)."""
    version: int
    """Policy version v_j its rollouts must be generated on."""
    weights_hash: str
    """h(v_j)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
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
    expiry_growth: float = 2.0
    """An expired lease of length l makes its holder's next leases at least this x l long."""
    own_window: int = 16
    """Per Actor: how many of its most recent admitted completion times its floor is taken
    over (the floor is their maximum, armed once one of its leases has expired)."""
    max_s: float | None = None
    """Upper bound (seconds) on the length an Actor's expiries grow its leases to; None:
    ``initial_s``, the length trusted before anything is known (so a dead Actor's expiries never
    make its leases, should it rejoin and die again, hold prompts longer than that). The plain
    median rule is never cut by it."""

    def __post_init__(self) -> None:
        if not (2.0 <= self.k <= 3.0):
            raise ValueError(f"LeaseConfig.k must be within the paper's 2-3, got {self.k!r}")
        if not (math.isfinite(self.expiry_growth) and self.expiry_growth > 1.0):
            raise ValueError(
                f"LeaseConfig.expiry_growth must be a finite factor > 1, got {self.expiry_growth!r}"
            )
        if self.own_window < 1:
            raise ValueError(f"LeaseConfig.own_window must be >= 1, got {self.own_window!r}")
        if self.max_s is not None and not (math.isfinite(self.max_s) and self.max_s > 0):
            raise ValueError(
                f"LeaseConfig.max_s must be None or positive seconds, got {self.max_s!r}"
            )
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
        # The pool in two parts: prompts never leased, in arrival order (their numbers are
        # consecutive, ending at _arrivals), from index _fresh_head on; and returned prompts, a
        # heap of arrival numbers with their prompts in _returned_prompt. Claiming takes the
        # lower number of the two heads, so the pool is leased in arrival order.
        self._fresh: list[str] = []
        self._fresh_head = 0
        self._returned: list[int] = []
        self._returned_prompt: dict[int, str] = {}
        self.pool_size = 0
        """Prompts in the pool (fresh from ``_fresh_head`` on, and returned): kept by
        :meth:`add`, :meth:`_push` and :meth:`_take`, the only places the pool changes."""
        self.leased: dict[str, str] = {}  # prompt -> live lease id
        self.done: dict[str, str] = {}  # prompt -> settled lease id
        self.by_actor: dict[str, set[str]] = {}  # actor -> live lease ids
        self._completions: deque[float] = deque(maxlen=self.config.window)
        self._length: float | None = None
        """lease_length() until _completions next changes (a batch's dispatch claims for every
        Actor in a row, and the median sorts up to ``window`` times)."""
        # Per Actor (the livelock rule, module docstring): its recent admitted completion times,
        # the length its expiries grew its leases to (0: none since its last admission), and
        # whether one of its leases ever expired (which arms the floor).
        self._max_s = self.config.initial_s if self.config.max_s is None else self.config.max_s
        self._own: dict[str, list[float]] = {}
        """Per Actor, its last ``own_window`` admitted completion times (s), oldest first: a
        list trimmed from the front (a ``deque(maxlen=...)`` per Actor takes four times the
        memory)."""
        self._grown: dict[str, float] = {}
        self._armed: set[str] = set()
        self._next_lease = 0
        # Batch version -> its prompts, and the ids of their leases, still in the book: an index
        # so that forget_settled visits only the batches it forgets, not every lease of the book.
        self._batch_prompts: dict[int, list[str]] = {}
        self._batch_leases: dict[int, list[str]] = {}

    # -- pool -----------------------------------------------------------------------------
    def add(self, prompts: Iterable[str], batch_version: int) -> None:
        """Put new prompts into the pool. Raises ValueError for a prompt id seen before."""
        prompts = list(prompts)
        if len(set(prompts)) < len(prompts) or not self._order.keys().isdisjoint(prompts):
            seen: set[str] = set()
            for p in prompts:  # the first id seen before, for the message
                if p in self._order or p in seen:
                    raise ValueError(f"prompt id {p!r} was already submitted")
                seen.add(p)
        # Arrival numbers are never reused: forget_settled drops old prompts, and a number
        # taken from the book's size could then sort a new batch before returned older prompts.
        first = self._arrivals
        self._arrivals += len(prompts)
        self._order.update(zip(prompts, range(first, self._arrivals), strict=True))
        self.batch_of.update(dict.fromkeys(prompts, batch_version))
        self._fresh.extend(prompts)
        self.pool_size += len(prompts)
        self._batch_prompts.setdefault(batch_version, []).extend(prompts)

    def _push(self, prompt: str) -> None:
        number = self._order[prompt]
        self._returned_prompt[number] = prompt
        heapq.heappush(self._returned, number)
        self.pool_size += 1

    def pool(self) -> list[str]:
        """Prompts waiting for a lease, in the order they will be claimed."""
        returned = self._returned_prompt
        fresh = self._fresh[self._fresh_head :]
        if not returned:
            return fresh
        return [
            p
            for _, p in sorted(
                [*zip(self._numbers_of_fresh(), fresh, strict=True), *returned.items()]
            )
        ]

    def _numbers_of_fresh(self) -> range:
        return range(self._arrivals - (len(self._fresh) - self._fresh_head), self._arrivals)

    def _take(self, count: int) -> list[str]:
        """Remove the ``count`` first prompts of the pool (``count <= pool_size``)."""
        fresh, head, returned = self._fresh, self._fresh_head, self._returned
        if not returned:
            out = fresh[head : head + count]
            head += count
        else:
            first_fresh = self._arrivals - (len(fresh) - head)  # number of fresh[head]
            pop, prompt_of = heapq.heappop, self._returned_prompt.pop
            out = []
            for _ in range(count):
                if returned and (head == len(fresh) or returned[0] < first_fresh):
                    out.append(prompt_of(pop(returned)))
                else:
                    out.append(fresh[head])
                    head += 1
                    first_fresh += 1
        if head == len(fresh):
            fresh.clear()
            head = 0
        elif head > 4096 and head * 2 > len(fresh):
            del fresh[:head]  # claimed prompts leave the list a block at a time
            head = 0
        self._fresh_head = head
        self.pool_size -= count
        return out

    # -- lease length ---------------------------------------------------------------------
    def lease_length(self, actor: str | None = None) -> float:
        """L in seconds: k x median of recent completion times, or the initial length; for
        ``actor``, at least its own floor once one of its leases has expired (module
        docstring)."""
        if self._length is None:
            if len(self._completions) < self.config.min_samples:
                self._length = self.config.initial_s
            else:
                self._length = max(self.config.min_s, self.config.k * median(self._completions))
        if actor is None or actor not in self._armed:
            return self._length
        own = self._own.get(actor)
        floor = max(self._grown.get(actor, 0.0), max(own) if own else 0.0)
        return max(self._length, min(floor, self._max_s))

    def _expired(self, lease: Lease, measured: float | None = None) -> None:
        """``lease`` expired (``measured``: the late result's time since the claim, s): its
        holder's next leases grow (the livelock rule)."""
        length = lease.expiry - lease.claimed_at
        grown = self.config.expiry_growth * length
        if measured is not None:
            grown = max(grown, measured)
        actor = lease.actor
        self._armed.add(actor)
        self._grown[actor] = max(self._grown.get(actor, 0.0), min(grown, self._max_s))

    def _admitted(self, actor: str, times: Sequence[float]) -> None:
        """``actor`` was admitted with results that took these times (s, oldest first): they
        join its floor, and what its expiries grew is spent (it has shown what it needs)."""
        own = self._own.setdefault(actor, [])
        own.extend(times)
        window = self.config.own_window
        if len(own) > window:
            del own[:-window]
        self._grown.pop(actor, None)

    # -- transitions ----------------------------------------------------------------------
    def claim(self, claims: Sequence[Claim], *, now: float) -> list[list[Lease]]:
        """Lease the head of the pool at ``now``: to each of ``claims`` in turn, up to its
        ``wanted`` prompts for its ``version`` (whose weights hash is ``weights_hash``), each
        expiring one :meth:`lease_length` of its Actor later. Returns each claim's leases (the
        same as claiming for each on its own, one after another; a dispatch claims for every
        Actor it leases to at once)."""
        for claim in claims:
            if claim.wanted < 0:
                raise ValueError(f"lease count must be >= 0, got {claim.wanted}")
        prompts = self._take(min(sum(claim.wanted for claim in claims), self.pool_size))
        first = self._next_lease + 1
        self._next_lease += len(prompts)
        ids = [f"L{n}" for n in range(first, self._next_lease + 1)]
        out: list[list[Lease]] = []
        start = 0
        for actor, wanted, version, weights_hash in claims:
            expiry = now + self.lease_length(actor)
            end = min(start + wanted, len(prompts))
            made: list[Lease] = []
            for i in range(start, end):
                lease = Lease(ids[i], prompts[i], actor, version, weights_hash, now, expiry)
                self.leases[lease.id] = lease
                self.by_actor.setdefault(actor, set()).add(lease.id)
                made.append(lease)
            out.append(made)
            start = end
        self.states.update(dict.fromkeys(ids, LeaseState.CLAIMED))
        self.leased.update(zip(prompts, ids, strict=True))
        for prompt, lease_id in zip(prompts, ids, strict=True):
            self._batch_leases.setdefault(self.batch_of[prompt], []).append(lease_id)
        return out

    def _end(self, lease_id: str, trigger: str) -> Lease:
        new = step(MACHINE, TRANSITIONS, self.states[lease_id], trigger)  # or IllegalTransition
        lease = self.leases[lease_id]
        self.states[lease_id] = new
        del self.leased[lease.prompt]
        self.by_actor[lease.actor].discard(lease_id)
        if new is LeaseState.SETTLED:
            self.done[lease.prompt] = lease_id
        else:
            self._push(lease.prompt)
            if new is LeaseState.EXPIRED:
                self._expired(lease)
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
        """``actor``'s result for ``lease_id``, generated on ``version`` with ``weights_hash``,
        arrived at ``now``: the acceptance predicate (:func:`admits`) ends the lease. Admitted,
        it is settled; late, it expires; on another version or weights, it is released (the
        prompt goes back to the pool either way). A result for a lease ``actor`` does not hold
        claimed is refused with the book untouched (:meth:`changes_nothing`)."""
        untouched = self._untouched(lease_id, actor)
        if untouched is not None:
            return Verdict(lease=lease_id, refusal=untouched[0], prompt=untouched[1])
        lease = self.leases[lease_id]
        refusal = admits(lease, t_r=now, v_r=version, h_r=weights_hash)
        if refusal is None:
            self._end(lease_id, "settle")
            took = now - lease.claimed_at
            self._completions.append(took)
            self._length = None
            self._admitted(actor, (took,))
            return Verdict(lease=lease_id, refusal=None, prompt=lease.prompt)
        if refusal is Refusal.LATE:
            self._end(lease_id, "expire")
            # The late result measured what this Actor needed: its next leases are at least that.
            self._expired(lease, measured=now - lease.claimed_at)
        else:
            self._end(lease_id, "release")
        return Verdict(lease=lease_id, refusal=refusal, prompt=lease.prompt, returned_to_pool=True)

    def refuse_malformed(self, lease_id: str, actor: str) -> Verdict:
        """A result of ``actor`` for ``lease_id`` whose payload does not decode. The holder's
        claimed lease is released with ``BAD_PAYLOAD`` (its prompt goes back to the pool: the
        payload will not get better by waiting); anyone else's result, or one for a lease no
        longer claimed, is refused as :meth:`settle` refuses it, lease untouched."""
        untouched = self._untouched(lease_id, actor)
        if untouched is not None:
            return Verdict(lease=lease_id, refusal=untouched[0], prompt=untouched[1])
        lease = self._end(lease_id, "release")
        return Verdict(
            lease=lease_id, refusal=Refusal.BAD_PAYLOAD, prompt=lease.prompt, returned_to_pool=True
        )

    def changes_nothing(self, lease_id: str, actor: str) -> bool:
        """Would a result of ``actor`` for ``lease_id`` be refused with the book untouched,
        whatever its version, hash, time or payload? So when the lease is unknown, another
        Actor's, or no longer claimed (settled, expired or released): :meth:`settle` and
        :meth:`refuse_malformed` return before any change for these (``UNKNOWN_LEASE``,
        ``WRONG_ACTOR``, ``DUPLICATE``, ``LATE`` on an ended lease). The only results a sender
        can repeat without end are of this kind: the Ledger bounds how many of them it logs
        (``aurora.runtime.ledger.driver``)."""
        return self._untouched(lease_id, actor) is not None

    def _untouched(self, lease_id: str, actor: str) -> tuple[Refusal, str | None] | None:
        """The refusal and prompt of a result for a lease ``actor`` does not hold claimed (the
        book left as it is), or None for the holder's claimed lease."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return Refusal.UNKNOWN_LEASE, None
        if actor != lease.actor:
            # Not the holder: refuse, and leave the holder's lease alone.
            return Refusal.WRONG_ACTOR, lease.prompt
        state = self.states[lease_id]
        if state is LeaseState.SETTLED:
            return Refusal.DUPLICATE, lease.prompt
        if state is not LeaseState.CLAIMED:
            return Refusal.LATE, lease.prompt
        return None

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
            if all(map(done.__contains__, prompts)):
                # The usual case, every prompt of the batch settled: all of it goes.
                leases, states, batch_of, order = (
                    self.leases,
                    self.states,
                    self.batch_of,
                    self._order,
                )
                for lid in self._batch_leases.pop(batch, ()):
                    del leases[lid], states[lid]
                for p in prompts:
                    del done[p], batch_of[p], order[p]
                del self._batch_prompts[batch]
                total += len(prompts)
                continue
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
        listed = self.pool()
        pool, leased, done = set(listed), set(self.leased), set(self.done)
        assert len(pool) == len(listed) == self.pool_size, "a prompt is in the pool twice"
        assert self.pool_size == len(self._fresh) - self._fresh_head + len(self._returned)
        assert sorted(self._returned) == sorted(self._returned_prompt), "returned heap != index"
        assert all(self._order[p] == n for n, p in self._returned_prompt.items())
        fresh = self._fresh[self._fresh_head :]
        assert all(
            self._order[p] == n for n, p in zip(self._numbers_of_fresh(), fresh, strict=True)
        )
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
            self.pool(),
            self.leased,
            self.done,
            self.by_actor,
            list(self._completions),
            {a: list(times) for a, times in self._own.items()},
            self._grown,
            self._armed,
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
