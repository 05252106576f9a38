"""The verification coin against an Actor that knows everything an Actor is sent (issue 39, part
2): the job spec and its seed, the job id, ``welcome``, its leases and the rule. The coin once was
``BLAKE2b(seed, actor, lease)``, which such an Actor computes; it is now keyed BLAKE2b under a key
derived from the Trainer's signing key (:func:`aurora.keys.verification_key`), over the admitted
payload's hash. The liar here is the runtime's own (:class:`aurora.runtime.cheats.CoinPredictor`,
the ``coin-aware`` cheat): it lies wherever the old coin says no check looks, and predicts its own
record as the Ledger keeps it.

What the design states, for a liar whose predictions are independent of the keyed coin (group 8,
4 completions recomputed, C(8, 4) = 70 ways to pick them):

* NEW (every result checked): it predicts every result checked and lies on the 4 completions it
  predicts are not recomputed; a check picks at least one of them unless it picks exactly the
  other 4: caught at its first lie with probability 1 - 1/70.
* TRUSTED at fraction f: a result it predicts unchecked (1 - f of them) is random throughout and
  caught iff checked (f); one it predicts checked (f) is caught with f x 69/70. Each lie is caught
  with p = f (1 - f/70), independently: within k lies with probability 1 - (1 - p)^k (f = 0.1:
  p = 0.0999, 65% within 10 lies).
"""

import random
from math import comb, sqrt

import msgpack
import pytest

from aurora.keys import verification_key
from aurora.policy.verification import (
    Measures,
    Plan,
    TrustBook,
    VerificationConfig,
    payload_digest,
    pick_completions,
    plan,
)
from aurora.runtime.cheats import CoinPredictor, old_picks, old_unit

RULE = VerificationConfig()
GROUP = 8
RUNS = 300
"""Seeded runs, each its own job: its own signing key (so its own verification key) and seed."""
HONEST = Measures(max_delta=1e-5, mean_delta=1e-6, min_logprob=-5.0, tokens=40)
PER_VERSION = 6
"""Results of the Actor per version (a step), as on real processes."""


def job(run: int) -> tuple[bytes, int]:
    """(verification key, seed) of seeded run ``run``: a fresh signing key per job."""
    rng = random.Random(run)
    return verification_key(rng.randbytes(32)), rng.randrange(1 << 31)


def within(count: int, n: int, p: float, sds: float = 4.5) -> bool:
    """``count`` is within ``sds`` binomial standard deviations of ``n p``."""
    return abs(count - n * p) <= sds * sqrt(n * p * (1 - p)) + 1


def trusted_pair(seed: int, actor: str) -> tuple[TrustBook, CoinPredictor]:
    """The Ledger's record of an Actor that passed probation honestly (8 checks on 3 versions),
    and the Actor's replica of it (identical: it knows the rule and that it was honest)."""
    book = TrustBook(RULE)
    liar = CoinPredictor(seed, actor, RULE)
    for i in range(RULE.probation):
        book.observe(actor, HONEST, i % RULE.probation_versions)
        liar.book.observe(actor, HONEST, i % RULE.probation_versions)
    return book, liar


def lies_until_caught(
    key: bytes, book: TrustBook, liar: CoinPredictor, *, old_coin: bool = False, most: int = 400
) -> tuple[int | None, list[float]]:
    """Feed the liar's results to the Trainer's plan until a check looks at a lie: the number
    of results it lied on up to and including that one (None: never caught within ``most``
    results), and the fraction of its results checked at each lie. With ``old_coin`` the
    Trainer decides with the former seed coin (what the liar predicts)."""
    actor, lies, fractions = liar.actor, 0, []
    for i in range(most):
        lease, version = f"L{i}", RULE.probation_versions + i // PER_VERSION
        lie = liar.unchecked(lease, version, GROUP)
        payload = msgpack.packb({"lease": lease, "random": sorted(lie)})  # what it returned
        h = payload_digest(payload)
        f = book.fraction(actor)
        if old_coin:
            checked = old_unit(liar.seed, actor, lease) < f
            picks = old_picks(liar.seed, actor, lease, GROUP, RULE.completions)
        else:
            checked = plan(key, f, actor, lease, h) is Plan.CHECK
            picks = set(pick_completions(RULE, key, actor, lease, h, GROUP))
        if lie:
            lies += 1
            fractions.append(f)
        if checked and lie & picks:
            return lies, fractions
        if checked:
            book.observe(actor, HONEST, version)  # the recomputed completions were honest
    return None, fractions


def test_a_new_coin_aware_liar_is_caught_at_its_first_lie_with_probability_69_in_70():
    first = 0
    for run in range(RUNS):
        key, seed = job(run)
        liar = CoinPredictor(seed, "cheat-0", RULE)
        caught_at, fractions = lies_until_caught(key, TrustBook(RULE), liar)
        assert fractions[0] == 1.0  # NEW: every result checked
        assert caught_at is not None and caught_at <= 3  # escaping 3: (1/70)^3 per run
        first += caught_at == 1
    p = 1 - 1 / comb(GROUP, RULE.completions)
    assert within(first, RUNS, p), (first, RUNS * p)


def test_a_trusted_coin_aware_liar_is_caught_within_k_lies_with_the_stated_probability():
    f = RULE.fraction
    p = f * (1 - f / comb(GROUP, RULE.completions))
    caught_at = []
    for run in range(RUNS):
        key, seed = job(run)
        book, liar = trusted_pair(seed, "cheat-0")
        n, fractions = lies_until_caught(key, book, liar)
        assert n is not None
        assert set(fractions) == {f}  # trusted at 10% throughout (a pass is rare: no halving)
        caught_at.append(n)
    for k in (1, 5, 10, 20):
        hit = sum(n <= k for n in caught_at)
        assert within(hit, RUNS, 1 - (1 - p) ** k), (k, hit, RUNS * (1 - (1 - p) ** k))
    # The mean number of lies trained on before the catch: 1/p - 1 = 9.0 (geometric).
    mean = sum(caught_at) / RUNS - 1
    assert abs(mean - (1 / p - 1)) < 4.5 * sqrt((1 - p) / p**2 / RUNS), mean


def test_the_same_liar_is_never_caught_when_the_coin_is_the_one_it_is_sent():
    # The liar is real: against the seed coin (the one every Actor can compute) it escapes
    # every check, NEW or TRUSTED, in every run, lying on 4 to 8 completions of every result.
    for run in range(25):
        key, seed = job(run)
        liar = CoinPredictor(seed, "cheat-0", RULE)
        n, fractions = lies_until_caught(key, TrustBook(RULE), liar, old_coin=True, most=120)
        assert n is None and len(fractions) >= 100
        assert fractions[0] == 1.0 and fractions[-1] == RULE.fraction  # it got trusted


def test_what_an_actor_can_compute_tells_it_nothing_of_which_results_are_checked():
    # 20,000 leases of a trusted Actor at f = 0.25: the Trainer's choice is as frequent among
    # the results the seed coin says "checked" as among the others (independent of it), so the
    # issue's prediction of 20,000 of 20,000 plans falls to chance.
    f, n = 0.25, 20000
    key, seed = job(0)
    h = payload_digest(b"an admitted payload")
    said = [old_unit(seed, "a", f"L{i}") < f for i in range(n)]
    real = [plan(key, f, "a", f"L{i}", h) is Plan.CHECK for i in range(n)]
    both = sum(s and r for s, r in zip(said, real, strict=True))
    predicted = sum(said)
    assert within(sum(real), n, f)
    assert within(both, predicted, f)  # checked given "checked": f, not 1
    assert within(sum(real) - both, n - predicted, f)  # checked given "unchecked": f, not 0
    assert within(sum(s == r for s, r in zip(said, real, strict=True)), n, f * f + (1 - f) ** 2)


def test_the_plan_is_fixed_by_the_signing_key_and_not_by_anything_in_the_job_spec():
    # Two jobs with the same spec, seed and ids but different signing keys check different
    # results (so no function of what Actors are sent gives the plan); the same signing key
    # gives the same plan (a restarted Trainer decides as before: the key is derived, not
    # stored or drawn).
    signing = random.Random(7).randbytes(32)
    other = random.Random(8).randbytes(32)
    assert verification_key(signing) == verification_key(bytes(signing))
    assert len(verification_key(signing)) == 32 and verification_key(signing) != signing
    h = payload_digest(b"p")

    def plans(k: bytes) -> list[Plan]:
        return [plan(verification_key(k), 0.5, "a", f"L{i}", h) for i in range(400)]

    assert plans(signing) == plans(signing)
    assert plans(signing) != plans(other)
    with pytest.raises(ValueError):
        verification_key(b"short")


def test_the_coin_aware_cheat_randomises_exactly_what_the_old_coin_leaves_unchecked(tmp_path):
    pytest.importorskip("transformers")
    from aurora.runtime.cheats import CheatingEngine
    from aurora.runtime.compute import Generated, Sampling
    from aurora.runtime.job import make_spec
    from aurora.topology import topology_from_dict

    topo = topology_from_dict(
        {
            "name": "t",
            "trainer": {"region": "us", "model": "qwen3-8b", "gpus": 1},
            "regions": [{"name": "us"}],
            "actors": [{"region": "us", "gpu": "A100", "count": 1}],
            "real": {"group_size": GROUP, "prompts_per_step": 6},
        }
    )
    spec = make_spec(
        topo, strategy="aurora", seed=5, steps=None, store=str(tmp_path), extra={"verify": True}
    )
    honest = {"ids": [3, 4, 5], "lp": [-0.5, -0.5, -0.5]}

    class Inner:
        version, weights_hash = 0, "h0"

        def generate(self, prompts, sampling):
            body = {"completions": [honest] * GROUP}
            return [
                Generated(prompt=p, payload=msgpack.packb({**body, "prompt": p}), tokens=9)
                for p, _ in prompts
            ]

    cheat = CheatingEngine(Inner(), "coin-aware", spec, "cheat-0")  # type: ignore[arg-type]
    leases = [f"L{i}" for i in range(6)]
    cheat.note_leases(leases)
    out = cheat.generate([(f"b1-{i}", i) for i in range(6)], Sampling(n=GROUP, max_new_tokens=3))
    for lease, g in zip(leases, out, strict=True):
        comps = msgpack.unpackb(g.payload)["completions"]
        lied = {i for i, c in enumerate(comps) if c != honest}
        # NEW: it predicts every result checked, and lies on the 4 the old coin left out.
        assert lied == set(range(GROUP)) - old_picks(5, "cheat-0", lease, GROUP, 4), lease
    assert cheat.lied_completions == 6 * 4
    with pytest.raises(ValueError, match="lease"):
        cheat.generate([("b1-0", 0)], Sampling(n=GROUP, max_new_tokens=3))  # leases not said
