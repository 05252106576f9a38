"""Verified rollouts on real processes (``aurora real``, the tiny Qwen3, transformers engines):
each dishonest Actor (:mod:`aurora.runtime.cheats`) is excluded within a stated number of
steps, the honest Actor never is, nothing an excluded Actor returned after its exclusion is
trained on, and without verification the same cheat is trained on to the end (so these tests
cannot pass without the mechanism)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from aurora.runtime.launcher import Launcher, RealRun
from aurora.topology import topology_from_dict

pytest.importorskip("torch")
pytest.importorskip("transformers")

STEPS = 8
CASES = [
    # (cheat, probation, steps within which it is excluded)
    ("random", None, 2),
    ("othermodel", None, 2),
    ("forged-lp", None, 2),
    ("stale", 48, 6),
    ("partial:0.1", 48, STEPS),
]
"""Each cheater and the step by which it must be excluded (counted as batches requested when
the Ledger excluded it). A new Actor has every result checked until 8 pass on 3 versions
(``VerificationConfig.probation``, ``probation_versions``), and each Actor returns ~6 results a step
here, one-step async: a cheat on every result fails at its first checked result, in batch 1 or 2. A
``stale`` Actor (frozen on v0) is honest on v0 (batches 1 and 2) and differs little on v1 (1 in 16
results beyond the bounds on this model; 10 in 16 from v2:
docs/journal/verification-measurements.md), so it is caught from batch 4 if it is still checked on
every result then. Under the default rule it may not be: its v0 and v1 results pass, and if the
first checks of its v2 results pass too (6 in 16 do) it completes probation (8 checks on 3 versions)
and is trusted at 10%; one run of the full suite caught it only at batch 8 that way (a rule's
property, stated in docs/VERIFICATION.md). With ``probation`` 48 every result of the run is checked,
and the bound tests the check itself: caught from batch 4, by 6 unless all its v2+ results pass
(6/16 each). ``partial:0.1`` lies on 10% of its prompts: with ``probation`` 48 here, every one of
its results of the run is checked, and it returns ~48 of them, so it is caught unless it lied on
none (0.9^48 = 0.6%; deterministic per run, the prompts it lies on are fixed by their ids)."""

TOPOLOGY = {
    "name": "verify",
    "trainer": {"region": "us", "model": "qwen3-8b", "gpu": "H100", "gpus": 1, "egress_gbps": 10},
    "regions": [{"name": "us"}],
    "actors": [
        {"region": "us", "gpu": "A100", "count": 1, "name": "honest"},
        {"region": "us", "gpu": "A100", "count": 1, "name": "cheat"},
    ],
    "real": {
        "model": "tiny",
        "steps": STEPS,
        "prompts_per_step": 12,
        "group_size": 4,
        "eval_prompts": 20,
        "lease_initial_s": 120.0,
        "actors": None,
    },
}


def run(
    tmp: Path,
    cheat: str | None,
    *,
    verify: bool = True,
    probation: int | None = None,
    engine: str = "transformers",
    group_size: int = 4,
) -> Path:
    extra: dict = {"verify": verify, "start_actors": 2}
    if probation is not None:
        extra["verify_probation"] = probation
    topo = {**TOPOLOGY, "real": {**TOPOLOGY["real"], "engine": engine, "group_size": group_size}}
    launcher = Launcher(
        RealRun(
            topology=topology_from_dict(topo, source="verify"),
            topology_path="verify",
            out=str(tmp),
            backend="rl",
            extra=extra,
            hooks={"cheat-0": {"cheat": cheat}} if cheat else {},
            progress=False,
            stall_s=240.0,
        )
    )
    assert launcher.main() == 0
    return launcher.dir


def actions(run_dir: Path) -> list[dict]:
    with open(run_dir / "events.csv") as f:
        return [r | {"rec": json.loads(r["record"])} for r in csv.DictReader(f)]


def outcome(run_dir: Path) -> dict:
    """Who was excluded, at which batch request count, and what the Trainer trained on."""
    rows = actions(run_dir)
    evicted = [r["rec"] for r in rows if r["type"] == "Evicted"]
    batches = 0
    excluded_at: dict[str, int] = {}
    for r in rows:
        if r["type"] == "BatchRequested":
            batches += 1
        elif r["type"] == "Evicted":
            excluded_at.setdefault(r["rec"]["actor"], batches)
    steps = [
        json.loads(line)["stats"]
        for line in (run_dir / "trainer" / "steps.jsonl").read_text().splitlines()
    ]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "evicted": {e["actor"]: e["reason"] for e in evicted},
        "excluded_at": excluded_at,
        "steps": steps,
        "summary": summary,
        "refused": [r["rec"] for r in rows if r["type"] == "Refused"],
    }


@pytest.mark.parametrize(("cheat", "probation", "within"), CASES)
def test_a_dishonest_actor_is_excluded_within_the_stated_steps_and_the_honest_one_never(
    tmp_path, cheat, probation, within
):
    out = outcome(run(tmp_path, cheat, probation=probation))
    assert set(out["evicted"]) == {"cheat-0"}, out["evicted"]  # never the honest Actor
    assert out["excluded_at"]["cheat-0"] <= within, out["excluded_at"]
    assert any(r["reason"] == "UNVERIFIED" for r in out["refused"])
    summary = out["summary"]
    assert summary["steps_completed"] == STEPS
    # The exclusion released its leases to the honest Actor: nothing lost, and the Ledger's log
    # replays through the policy to the same actions (the exclusion included).
    assert summary["prompts_lost"] == 0 and summary["lease_book_ok"]
    assert summary["replay_action_mismatches"] == 0
    assert sum(s.get("verify_failed", 0) for s in out["steps"]) == 1
    # Nothing of the cheater's was trained on after it was caught.
    caught = next(i for i, s in enumerate(out["steps"]) if s.get("verify_failed"))
    assert all("cheat-0" not in str(s.get("trained_from", "")) for s in out["steps"][caught:])
    assert sum(s.get("verified", 0) for s in out["steps"]) >= 1


def test_a_coin_aware_liar_that_knows_the_seed_is_excluded_at_its_first_checked_batch(tmp_path):
    """The ``coin-aware`` cheat lies wherever the former coin (BLAKE2b of the job's seed, sent
    to every Actor) says no check looks: as a NEW Actor, on the 4 of 8 completions of each
    result it predicts are not recomputed. Against that coin it was never caught; against the
    keyed one each of its results is caught with probability 69/70 (tests/
    test_verification_coin.py), so it is excluded in batch 1 unless all of its ~6 results
    there escape ((1/70)^6), and by batch 2 all but never."""
    out = outcome(run(tmp_path, "coin-aware", group_size=8))
    assert set(out["evicted"]) == {"cheat-0"}, out["evicted"]  # never the honest Actor
    assert out["evicted"]["cheat-0"] != "REFUSED"  # a recompute caught it, not a payload check
    assert out["excluded_at"]["cheat-0"] <= 2, out["excluded_at"]
    assert out["summary"]["steps_completed"] == STEPS
    assert out["summary"]["replay_action_mismatches"] == 0
    caught = next(i for i, s in enumerate(out["steps"]) if s.get("verify_failed"))
    assert all("cheat-0" not in str(s.get("trained_from", "")) for s in out["steps"][caught:])


def test_with_vllm_actors_a_forged_logprob_actor_is_excluded_and_the_honest_one_never(tmp_path):
    # The honest vLLM Actor's log-probs come from bf16 arithmetic (max |delta| 0.18 measured):
    # within the bounds, not even suspected; the forger's halved log-probs are not.
    from tests.test_vllm_runtime import require_vllm

    require_vllm()
    out = outcome(run(tmp_path, "forged-lp", engine="vllm"))
    assert set(out["evicted"]) == {"cheat-0"}, out["evicted"]
    assert out["excluded_at"]["cheat-0"] <= 2, out["excluded_at"]
    assert out["summary"]["steps_completed"] == STEPS
    assert out["summary"]["replay_action_mismatches"] == 0
    honest_checks = sum(s.get("verified", 0) for s in out["steps"]) - 1
    assert honest_checks >= 8  # the honest vLLM Actor's probation, all passed


def test_without_verification_the_same_cheater_is_trained_on_to_the_end(tmp_path):
    out = outcome(run(tmp_path, "random", verify=False))
    assert out["evicted"] == {}
    assert not any(r["reason"] == "UNVERIFIED" for r in out["refused"])
    assert sum(s.get("verified", 0) for s in out["steps"]) == 0
    assert out["summary"]["steps_completed"] == STEPS
