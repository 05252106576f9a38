"""The lease book's pool order and its one claim operation.

The pool is kept in two parts (never-leased prompts in arrival order, and a heap of returned
ones), so random operation sequences check every claim against a reference pool ordered by
arrival number; a claim for several Actors must lease exactly as claiming for each on its own,
one after another.
"""

from __future__ import annotations

import copy
import random

import pytest

from aurora.policy.leases import Claim, LeaseBook, LeaseConfig


def _random_ops(seed: int, steps: int = 400) -> list[tuple[object, ...]]:
    rng = random.Random(seed)
    ops: list[tuple[object, ...]] = []
    batch = 0
    for _ in range(steps):
        r = rng.random()
        if r < 0.15:
            batch += 1
            ops.append(("add", batch, rng.randint(1, 12)))
        elif r < 0.45:
            ops.append(("claim", rng.choice("abc"), rng.randint(0, 9)))
        elif r < 0.85:
            ops.append(("results", rng.choice("abc"), rng.randint(1, 6), rng.random()))
        elif r < 0.92:
            ops.append(("expire",))
        elif r < 0.96:
            ops.append(("release", rng.choice("abc")))
        else:
            ops.append(("forget", rng.randint(0, batch)))
    return ops


def _apply(book: LeaseBook, op: tuple[object, ...], now: float) -> list[object]:
    """Apply one op other than a claim; what it answered."""
    kind = op[0]
    if kind == "add":
        book.add([f"s{op[1]}-{i}" for i in range(op[2])], op[1])  # type: ignore[arg-type]
        return []
    if kind == "results":
        _, actor, n, spoil = op
        live = sorted(book.by_actor.get(actor, ()), key=lambda lid: int(lid[1:]))  # type: ignore[arg-type]
        # A result for a settled lease, another Actor's, or a spoiled version, now and then.
        leases = list(live[:n]) + (["L1"] if spoil < 0.2 else [])  # type: ignore[index,operator]
        version = 2 if spoil > 0.9 else 1
        return [
            book.settle(lid, actor=actor, version=version, weights_hash="h", now=now)  # type: ignore[arg-type]
            for lid in leases
        ]
    if kind == "expire":
        return [le.id for le in book.expire_due(now)]
    if kind == "release":
        return [le.id for le in book.release_actor(op[1])]  # type: ignore[arg-type]
    return [book.forget_settled(op[1])]  # type: ignore[arg-type]


def test_claims_take_the_pool_in_arrival_order_returned_prompts_first():
    claimed = 0
    for seed in range(12):
        book = LeaseBook(LeaseConfig(initial_s=5.0, min_samples=4, min_s=1.0))
        now = 0.0
        for op in _random_ops(seed):
            now += 0.5
            if op[0] == "claim":
                _, actor, n = op
                # The reference pool: every prompt neither leased nor settled, by arrival number.
                waiting = set(book._order) - set(book.leased) - set(book.done)
                expected = sorted(waiting, key=book._order.__getitem__)[:n]  # type: ignore[misc]
                (leases,) = book.claim([Claim(actor, n, 1, "h")], now=now)  # type: ignore[arg-type]
                assert [lease.prompt for lease in leases] == expected, seed
                claimed += len(leases)
            else:
                _apply(book, op, now)
            book.check()
    assert claimed > 100


def test_a_claim_for_several_actors_leases_as_claiming_for_each_in_turn():
    # At every claim of the random sequences (returned prompts in the pool, Actors whose
    # expiries armed their floor, prompts from several batches), one claim for several Actors
    # and the same claims one at a time give the same leases and leave equal books.
    compared = 0
    for seed in range(12):
        rng = random.Random(1000 + seed)
        book = LeaseBook(LeaseConfig(initial_s=5.0, min_samples=4, min_s=1.0))
        now = 0.0
        for op in _random_ops(seed):
            now += 0.5
            if op[0] != "claim":
                _apply(book, op, now)
                continue
            claims = [
                Claim(rng.choice("abcd"), rng.randint(0, 4), rng.randint(1, 2), rng.choice("hg"))
                for _ in range(rng.randint(1, 6))
            ]
            one = copy.deepcopy(book)
            expected = [one.claim([claim], now=now)[0] for claim in claims]
            assert book.claim(claims, now=now) == expected, seed
            assert book == one, seed
            book.check()
            compared += sum(1 for leases in expected if leases)
    assert compared > 100


def test_a_returned_prompt_is_leased_before_newer_ones_and_after_older_fresh_ones():
    book = LeaseBook()
    book.add(["a0", "a1", "a2"], 1)

    def claim(actor: str, n: int) -> list[tuple[str, str]]:
        (leases,) = book.claim([Claim(actor, n, 1, "h")], now=0.0)
        return [(lease.id, lease.prompt) for lease in leases]

    assert claim("x", 1) == [("L1", "a0")]
    book.add(["b0"], 2)
    book.release_actor("x")  # a0 returns, ahead of a1 (it arrived first)
    assert book.pool() == ["a0", "a1", "a2", "b0"]
    assert claim("y", 2) == [("L2", "a0"), ("L3", "a1")]
    assert claim("z", 1) == [("L4", "a2")]
    book.release_actor("y")  # a0 and a1 return behind nothing fresh older than them
    assert book.pool() == ["a0", "a1", "b0"]
    assert [p for _, p in claim("w", 9)] == ["a0", "a1", "b0"] and book.pool_size == 0
    book.check()


def test_a_claim_refuses_a_negative_count_before_any_change():
    book = LeaseBook()
    book.add(["p0", "p1"], 1)
    before = copy.deepcopy(book)
    with pytest.raises(ValueError, match="lease count must be >= 0"):
        book.claim([Claim("a", 1, 1, "h"), Claim("b", -1, 1, "h")], now=0.0)
    assert book == before
