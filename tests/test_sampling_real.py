"""Sampling, not only log-probs, on real processes (``aurora real``, the tiny Qwen3, transformers
engines): an Actor returning greedy decodes with their true log-probs passes every recompute
and is excluded for the ranks of its tokens (SAMPLING_DISTRIBUTION) within the stated steps; the
honest Actor never is."""

from __future__ import annotations

from pathlib import Path

import pytest

from aurora.runtime.launcher import Launcher, RealRun
from aurora.topology import topology_from_dict
from tests.test_verification_real import TOPOLOGY, outcome

pytest.importorskip("torch")
pytest.importorskip("transformers")

STEPS = 8


def run(tmp: Path, cheat: str) -> Path:
    # 24 prompts a step (the verification tests' 12, doubled): the cheater returns ~10 results
    # a batch, ~150 checked tokens with every result checked (probation 48).
    topo = {**TOPOLOGY, "real": {**TOPOLOGY["real"], "prompts_per_step": 24, "steps": STEPS}}
    launcher = Launcher(
        RealRun(
            topology=topology_from_dict(topo, source="sampling"),
            topology_path="sampling",
            out=str(tmp),
            backend="rl",
            extra={"verify": True, "start_actors": 2, "verify_probation": 48},
            hooks={"cheat-0": {"cheat": cheat}},
            progress=False,
            stall_s=240.0,
        )
    )
    assert launcher.main() == 0
    return launcher.dir


def test_a_greedy_actor_is_excluded_for_its_ranks_and_the_honest_one_never(tmp_path):
    # Greedy moves u by 0.09-0.11 a token on this model (docs/journal/verification-sampling.md):
    # the test crosses after ~330 tokens, ~22 checks, so by batch ~4 here; 6 allows for the
    # noise of one run (a check's sum has sd 1.1 over its ~15 tokens).
    out = outcome(run(tmp_path, "greedy"))
    assert out["evicted"] == {"cheat-0": "SAMPLING_DISTRIBUTION"}, out["evicted"]
    assert out["excluded_at"]["cheat-0"] <= 6, out["excluded_at"]
    summary = out["summary"]
    assert summary["steps_completed"] == STEPS
    assert summary["prompts_lost"] == 0 and summary["lease_book_ok"]
    assert summary["replay_action_mismatches"] == 0
    # Every recompute passed (its log-probs are true): the ranks alone excluded it, and
    # nothing of its was trained on from the batch that caught it.
    assert sum(s.get("verify_failed", 0) for s in out["steps"]) == 1
    caught = next(i for i, s in enumerate(out["steps"]) if s.get("verify_failed"))
    assert all("cheat-0" not in str(s.get("trained_from", "")) for s in out["steps"][caught:])
