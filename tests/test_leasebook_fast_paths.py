"""The lease book's bulk paths decide exactly as its one-at-a-time ones.

``claim_ids`` takes prompts from a two-part pool (never-leased prompts in arrival order, and a
heap of returned ones) and ``settle_run`` settles a run of admitted results in one call; both
exist for speed only. Random operation sequences check them against a reference pool ordered by
arrival number and against :meth:`LeaseBook.judge` result by result.
"""

from __future__ import annotations

import copy
import random

import pytest

from aurora.policy.leases import LeaseBook, LeaseConfig


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


def _run(ops: list[tuple[object, ...]], *, bulk: bool) -> tuple[LeaseBook, list[object]]:
    """Apply ``ops``; results are judged one by one, or settled by ``settle_run`` first."""
    book = LeaseBook(LeaseConfig(initial_s=5.0, min_samples=4, min_s=1.0))
    seen: list[object] = []
    now = 0.0
    for op in ops:
        now += 0.5
        kind = op[0]
        if kind == "add":
            _, batch, n = op
            book.add([f"s{batch}-{i}" for i in range(n)], batch)  # type: ignore[arg-type]
        elif kind == "claim":
            _, actor, n = op
            # The reference pool: every prompt neither leased nor settled, by arrival number.
            waiting = set(book._order) - set(book.leased) - set(book.done)
            expected = sorted(waiting, key=book._order.__getitem__)[:n]  # type: ignore[misc]
            lids, prompts, _ = book.claim_ids(
                actor,  # type: ignore[arg-type]
                n,  # type: ignore[arg-type]
                version=1,
                weights_hash="h",
                now=now,
            )
            assert prompts == expected
            seen.append(("claim", lids, prompts))
        elif kind == "results":
            _, actor, n, spoil = op
            live = sorted(book.by_actor.get(actor, ()), key=lambda lid: int(lid[1:]))  # type: ignore[arg-type]
            # A result for a settled lease, another Actor's, or a spoiled version, now and then.
            leases = tuple(live[:n]) + (("L1",) if spoil < 0.2 else ())  # type: ignore[operator]
            version = 2 if spoil > 0.9 else 1
            i = 0
            while i < len(leases):
                if bulk:
                    got = book.settle_run(leases, i, actor, version, "h", now)  # type: ignore[arg-type]
                    seen.extend(("ok", p) for p in got)
                    i += len(got)
                    if i == len(leases):
                        break
                refusal, prompt, returned = book.judge(leases[i], actor, version, "h", now)  # type: ignore[arg-type]
                seen.append(("ok", prompt) if refusal is None else (refusal, prompt, returned))
                i += 1
        elif kind == "expire":
            seen.append(("expired", [le.id for le in book.expire_due(now)]))
        elif kind == "release":
            seen.append(("released", [le.id for le in book.release_actor(op[1])]))  # type: ignore[arg-type]
        else:
            seen.append(("forgot", book.forget_settled(op[1])))  # type: ignore[arg-type]
        book.check()
    return book, seen


def test_settle_run_settles_exactly_as_judging_each_result():
    for seed in range(12):
        ops = _random_ops(seed)
        one, seen_one = _run(ops, bulk=False)
        bulk, seen_bulk = _run(ops, bulk=True)
        assert seen_bulk == seen_one, seed
        assert bulk == one, seed


def test_claims_take_the_pool_in_arrival_order_returned_prompts_first():
    claims = 0
    for seed in range(12):
        _, seen = _run(_random_ops(seed), bulk=True)  # _run checks each claim's prompts
        claims += sum(1 for e in seen if isinstance(e, tuple) and e[0] == "claim" and e[2])
    assert claims > 100


def test_a_returned_prompt_is_leased_before_newer_ones_and_after_older_fresh_ones():
    book = LeaseBook()
    book.add(["a0", "a1", "a2"], 1)
    (lid,), _, _ = book.claim_ids("x", 1, version=1, weights_hash="h", now=0.0)  # a0
    book.add(["b0"], 2)
    book.release_actor("x")  # a0 returns, ahead of a1 (it arrived first)
    assert book.pool() == ["a0", "a1", "a2", "b0"]
    _, prompts, _ = book.claim_ids("y", 2, version=1, weights_hash="h", now=0.0)
    assert prompts == ["a0", "a1"]
    (lid2,), _, _ = book.claim_ids("z", 1, version=1, weights_hash="h", now=0.0)  # a2
    book.release_actor("y")  # a0 and a1 return behind nothing fresh older than them
    assert book.pool() == ["a0", "a1", "b0"]
    _, prompts, _ = book.claim_ids("w", 9, version=1, weights_hash="h", now=0.0)
    assert prompts == ["a0", "a1", "b0"] and book.pool_size == 0
    book.check()
    assert lid == "L1" and lid2 == "L4"


def test_claim_many_leases_exactly_as_one_claim_per_actor_in_order():
    # At every claim of the random sequences (returned prompts in the pool, Actors whose
    # expiries armed their floor, prompts from several batches), a batch of claims through
    # claim_many and the same claims one by one through claim_ids give the same answers and
    # leave equal books.
    compared = 0
    for seed in range(12):
        rng = random.Random(1000 + seed)
        book = LeaseBook(LeaseConfig(initial_s=5.0, min_samples=4, min_s=1.0))
        now = 0.0
        for op in _random_ops(seed):
            now += 0.5
            if op[0] == "claim":
                claims = [
                    (rng.choice("abcd"), rng.randint(0, 4), rng.randint(1, 2), rng.choice("hg"))
                    for _ in range(rng.randint(1, 6))
                ]
                one = copy.deepcopy(book)
                expected = [
                    one.claim_ids(a, n, version=v, weights_hash=h, now=now) for a, n, v, h in claims
                ]
                got = book.claim_many(claims, now)
                assert [(list(a), list(b), e) for a, b, e in got] == expected, seed
                assert book == one, seed
                book.check()
                compared += sum(1 for lids, _, _ in expected if lids)
            elif op[0] == "add":
                book.add([f"s{op[1]}-{i}" for i in range(op[2])], op[1])  # type: ignore[arg-type]
            elif op[0] == "results":
                _, actor, n, _ = op
                live = sorted(book.by_actor.get(actor, ()), key=lambda lid: int(lid[1:]))  # type: ignore[arg-type]
                for lid in live[:n]:  # type: ignore[index]
                    version = book.leases[lid].version
                    book.judge(lid, actor, version, book.leases[lid].weights_hash, now)  # type: ignore[arg-type]
            elif op[0] == "expire":
                book.expire_due(now)
            elif op[0] == "release":
                book.release_actor(op[1])  # type: ignore[arg-type]
            else:
                book.forget_settled(op[1])  # type: ignore[arg-type]
    assert compared > 100


def test_claim_many_refuses_a_negative_count_before_any_change():
    book = LeaseBook()
    book.add(["p0", "p1"], 1)
    before = copy.deepcopy(book)
    with pytest.raises(ValueError, match="lease count must be >= 0"):
        book.claim_many([("a", 1, 1, "h"), ("b", -1, 1, "h")], 0.0)
    assert book == before


def test_settle_run_of_one_lease_judges_as_judge_does():
    # settle_run's one-lease path (one prompt per Actor per step at 10^5 Actors) against judge,
    # for each way a result can be refused and for the admitted one: the same prompt or none,
    # and equal books after.
    cases = [
        ("L1", "a", 1, "h", 1.0),  # admitted
        ("L1", "b", 1, "h", 1.0),  # another Actor's lease
        ("L1", "a", 2, "h", 1.0),  # wrong version
        ("L1", "a", 1, "g", 1.0),  # wrong hash
        ("L1", "a", 1, "h", 99.0),  # late
        ("L9", "a", 1, "h", 1.0),  # unknown lease
    ]
    for lid, actor, version, h, now in cases:
        books = []
        for _ in range(2):
            book = LeaseBook(LeaseConfig(initial_s=5.0, min_samples=4, min_s=1.0))
            book.add(["p0", "p1"], 1)
            book.claim_many([("a", 1, 1, "h"), ("b", 1, 1, "h")], 0.0)
            books.append(book)
        run, one = books
        got = run.settle_run((lid,), 0, actor, version, h, now)
        if got:
            assert one.judge(lid, actor, version, h, now) == (None, got[0], False)
        assert run.settle_run((lid,), 0, actor, version, h, now) == []  # settled, or untouched
        assert run == one
        run.check()
    done = LeaseBook()
    done.add(["p0"], 1)
    (((lid,), _, _),) = done.claim_many([("a", 1, 1, "h")], 0.0)
    assert done.settle_run((lid,), 0, "a", 1, "h", 1.0) == ["p0"]
    assert done.settle_run((lid,), 0, "a", 1, "h", 1.0) == []  # a duplicate: left to judge
    assert done.pool_size == 0 and done.done == {"p0": lid}
