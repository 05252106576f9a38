"""What one admitted result costs in memory access, by lease-book layout: the evidence for the
next step of the simulator's 10^5-Actor target (docs/journal/simulator-speed.md, "Third pass").

A result settles its lease: the lease is looked up and checked, marked settled, its prompt
moves from leased to done, the holder's live set and recent completion times are updated
(what ``LeaseBook.settle`` touches for an admitted result, written out here without the rest
of the Ledger). Two layouts are timed on ``N`` Actors holding one lease each, results arriving in
random order (as they do in the simulator: each Actor finishes at its own time):

* ``dicts``: the book's layout today (maps keyed by lease id and prompt strings, a set and a
  list per Actor);
* ``arrays``: per-lease fields in unboxed arrays (``array``, ``bytearray``) indexed by lease
  number and per-Actor ones by Actor number (a count instead of a set), the layout of option
  (a) in docs/journal/simulator-speed.md.

Each lease has claim and expiry times of its own (float objects in the tuple, unboxed doubles in
the arrays), as the book's claims make them.

Both do the same checks and updates; printed: microseconds per result for each, at ``N`` and
at 2,000 Actors (where everything fits in the fast caches), so the share that is memory access
at ``N`` shows.

    python benchmarks/settle_layout.py 100000
"""

from __future__ import annotations

import json
import random
import sys
import time
from array import array
from collections import deque

ROUNDS = 4
OWN_WINDOW = 16  # LeaseConfig.own_window


def dicts(n: int, seed: int = 1) -> float:
    """Microseconds per result with the book's maps."""
    rnd = random.Random(seed)
    actors = [f"a{i:06d}" for i in range(n)]
    leases: dict[str, tuple[str, str, str, int, str, float, float]] = {}
    states: dict[str, int] = {}
    leased: dict[str, str] = {}
    done: dict[str, str] = {}
    by_actor: dict[str, set[str]] = {a: set() for a in actors}
    own: dict[str, list[float]] = {a: [] for a in actors}
    completions: deque[float] = deque(maxlen=256)
    spent = 0.0
    for r in range(ROUNDS):
        lids = [f"L{r * n + i + 1}" for i in range(n)]
        prompts = [f"s{r}-{i}" for i in range(n)]
        for i, (lid, prompt, actor) in enumerate(zip(lids, prompts, actors, strict=True)):
            claimed = r + i * 1e-9  # a float of its own per lease, as a claim makes them
            leases[lid] = (lid, prompt, actor, r, "h", claimed, claimed + 100.0)
            states[lid] = 1
            leased[prompt] = lid
            by_actor[actor].add(lid)
        order = list(range(n))
        rnd.shuffle(order)
        t = time.perf_counter()
        for i in order:
            lid, actor = lids[i], actors[i]
            _, prompt, holder, v, h, claimed, expiry = leases[lid]
            if holder != actor or states[lid] != 1 or expiry < r or v != r or h != "h":
                raise AssertionError("refused")
            states[lid] = 2
            del leased[prompt]
            done[prompt] = lid
            by_actor[actor].discard(lid)
            took = r + 1.0 - claimed
            completions.append(took)
            mine = own[actor]
            mine.append(took)
            if len(mine) > OWN_WINDOW:
                del mine[:-OWN_WINDOW]
        spent += time.perf_counter() - t
    return spent / ROUNDS / n * 1e6


def arrays(n: int, seed: int = 1) -> float:
    """Microseconds per result with lists indexed by lease and Actor number."""
    rnd = random.Random(seed)
    prompt_of: list[str | None] = [None]
    holder_of = array("q", [-1])  # unboxed: lease i's fields are 8 bytes each, in a row
    version_of = array("q", [-1])
    hash_of: list[str] = [""]
    claimed_at = array("d", [0.0])
    expiry_of = array("d", [0.0])
    state_of = bytearray(1)
    held = [0] * n
    own: list[list[float]] = [[] for _ in range(n)]
    completions: deque[float] = deque(maxlen=256)
    spent = 0.0
    for r in range(ROUNDS):
        base = len(prompt_of)
        prompt_of += [f"s{r}-{i}" for i in range(n)]
        holder_of.extend(range(n))
        version_of.extend([r] * n)
        hash_of += ["h"] * n
        claimed_at.extend([r + i * 1e-9 for i in range(n)])
        expiry_of.extend([r + i * 1e-9 + 100.0 for i in range(n)])
        state_of += bytes([1]) * n
        for i in range(n):
            held[i] += 1
        order = list(range(n))
        rnd.shuffle(order)
        t = time.perf_counter()
        for actor in order:
            lease = base + actor
            if (
                holder_of[lease] != actor
                or state_of[lease] != 1
                or expiry_of[lease] < r
                or version_of[lease] != r
                or hash_of[lease] != "h"
            ):
                raise AssertionError("refused")
            state_of[lease] = 2
            held[actor] -= 1
            took = r + 1.0 - claimed_at[lease]
            completions.append(took)
            mine = own[actor]
            mine.append(took)
            if len(mine) > OWN_WINDOW:
                del mine[:-OWN_WINDOW]
        spent += time.perf_counter() - t
    return spent / ROUNDS / n * 1e6


def main(n: int) -> dict[str, object]:
    return {
        "actors": n,
        "dicts_us": round(dicts(n), 3),
        "arrays_us": round(arrays(n), 3),
        "dicts_us_at_2000": round(dicts(2000), 3),
        "arrays_us_at_2000": round(arrays(2000), 3),
    }


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 100000)))
