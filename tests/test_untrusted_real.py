"""One dishonest Actor beside an honest one, on real processes (``aurora real``, the tiny Qwen3,
transformers engines): each attack on the Trainer's step and on the Ledger's admission
(:mod:`aurora.runtime.cheats`) leaves the model finite, the step not steered by one result, no
prompt lost and the Trainer alive; refused results count against the cheater up to its
exclusion, and a throughput lie does not take the batch.

Before the bounds each of these broke the run: a forged behaviour log-prob of -60 or -inf made
every weight NaN (signed and published; the honest Actor then crashed sampling from it), -20
made the step the forged result's own (pre-clip gradient norm x10^7), a token id of the
vocabulary size was admitted and then dropped by the Trainer (the prompt lost, the Actor never
penalised), and 2^40 tokens in 1e-9 s gave the liar the whole batch."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from aurora.faults import Fault
from aurora.runtime.launcher import Launcher, RealRun
from aurora.topology import topology_from_dict

pytest.importorskip("torch")
pytest.importorskip("transformers")

STEPS = 4
PROMPTS = 12
TOPOLOGY = {
    "name": "untrusted",
    "trainer": {"region": "us", "model": "qwen3-8b", "gpu": "H100", "gpus": 1, "egress_gbps": 10},
    "regions": [{"name": "us"}],
    "actors": [
        {"region": "us", "gpu": "A100", "count": 1, "name": "honest"},
        {"region": "us", "gpu": "A100", "count": 1, "name": "cheat"},
    ],
    "real": {
        "model": "tiny",
        "steps": STEPS,
        "prompts_per_step": PROMPTS,
        "group_size": 4,
        "eval_prompts": 20,
        "lease_initial_s": 120.0,
        "actors": None,
    },
}
CHEATER = "cheat-0"


def run(
    tmp: Path,
    cheat: str,
    *,
    extra: dict | None = None,
    topology: dict | None = None,
    faults: tuple[Fault, ...] = (),
) -> Path:
    launcher = Launcher(
        RealRun(
            topology=topology_from_dict(topology or TOPOLOGY, source="untrusted"),
            topology_path="untrusted",
            out=str(tmp),
            backend="rl",
            extra={"start_actors": 2, **(extra or {})},
            hooks={CHEATER: {"cheat": cheat}},
            faults=faults,
            progress=False,
            stall_s=240.0,
        )
    )
    assert launcher.main() == 0
    return launcher.dir


def outcome(run_dir: Path) -> dict:
    with open(run_dir / "events.csv") as f:
        rows = [r | {"rec": json.loads(r["record"])} for r in csv.DictReader(f)]
    steps = [
        json.loads(line)["stats"]
        for line in (run_dir / "trainer" / "steps.jsonl").read_text().splitlines()
    ]
    return {
        "evicted": {r["rec"]["actor"]: r["rec"]["reason"] for r in rows if r["type"] == "Evicted"},
        "refused": [r["rec"] for r in rows if r["type"] == "Refused"],
        "throughput": [r["rec"] for r in rows if r["type"] == "ThroughputObserved"],
        "steps": steps,
        "summary": json.loads((run_dir / "summary.json").read_text()),
    }


def model_is_finite(run_dir: Path) -> bool:
    """Every weight of the run's exported model (its last published version) is finite."""
    import torch
    from safetensors.torch import load_file

    weights = load_file(str(run_dir / "model" / "model.safetensors"))
    return all(bool(torch.isfinite(t.float()).all()) for t in weights.values())


def trained_from(step: dict) -> dict[str, int]:
    shares = str(step.get("trained_from") or "")
    return {a: int(n) for a, _, n in (x.rpartition(":") for x in shares.split(",") if x)}


def assert_whole_and_finite(out: dict, run_dir: Path) -> None:
    s = out["summary"]
    assert s["steps_completed"] == STEPS
    assert s["prompts_lost"] == 0 and s["lease_book_ok"]
    assert s["replay_action_mismatches"] == 0
    assert "honest-0" not in out["evicted"]
    assert model_is_finite(run_dir)
    assert all(math.isfinite(st.get("grad_norm") or 0.0) for st in out["steps"])


@pytest.mark.parametrize("cheat", ["forge-lp:-60", "forge-lp:-inf", "forge-lp:-25"])
def test_a_forged_behaviour_log_prob_is_refused_at_admission_and_its_actor_excluded(
    tmp_path, cheat
):
    """Below the plausible floor of the tiny model's 17 tokens (-24.6 nats): refused by the
    Ledger before the lease settles, the prompt leased again, the cheater excluded at its
    third refusal, nothing of it trained on."""
    d = run(tmp_path, cheat)
    out = outcome(d)
    assert_whole_and_finite(out, d)
    assert out["evicted"] == {CHEATER: "REFUSED"}
    mine = [r for r in out["refused"] if r["actor"] == CHEATER]
    assert [r["reason"] for r in mine].count("BAD_PAYLOAD") == 3
    assert all(CHEATER not in trained_from(st) for st in out["steps"])


def test_a_forged_log_prob_above_the_floor_is_trained_on_but_cannot_steer_the_step(tmp_path):
    """-20 nats passes admission (above the floor): its tokens' ratios are ~e^19, which the
    dual clip caps (``capped_frac``), so every step's pre-clip gradient norm stays on the honest
    scale; before, such a step's norm was ~10^7 and its direction the forged result's."""
    d = run(tmp_path, "forge-lp:-20")
    out = outcome(d)
    assert_whole_and_finite(out, d)
    assert out["evicted"] == {}
    steps = out["steps"]
    assert any(CHEATER in trained_from(st) for st in steps)
    norms = [st["grad_norm"] for st in steps if not st.get("skipped")]
    assert norms and max(norms) < 20.0, norms  # honest tiny-model norms: ~0.5-2.5
    assert any(st.get("capped_frac", 0) > 0 for st in steps)
    assert all(not st.get("refused") for st in steps)


@pytest.mark.parametrize("cheat", ["vocab-id", "after-eos"])
def test_a_payload_the_trainer_would_refuse_is_refused_before_admission_and_counts(tmp_path, cheat):
    """A token id equal to the vocabulary size, or tokens after <eos>: the Ledger applies the
    Trainer's check (vocabulary and end of sequence included), so the prompt is leased again
    (before, the Trainer dropped it after admission: a prompt lost, no one penalised)."""
    d = run(tmp_path, cheat)
    out = outcome(d)
    assert_whole_and_finite(out, d)
    assert out["evicted"] == {CHEATER: "REFUSED"}
    assert all(st.get("refused_results", 0) == 0 for st in out["steps"])  # none reached it


def test_a_throughput_lie_does_not_take_the_batch(tmp_path):
    """2^40 tokens in 1e-9 s: counted as at most twice the rate its admitted results show,
    so the honest Actor keeps a share of every batch (before: the liar took all of it)."""
    d = run(tmp_path, "throughput-lie")
    out = outcome(d)
    assert_whole_and_finite(out, d)
    liar = [r for r in out["throughput"] if r["actor"] == CHEATER]
    assert liar and all(r["tokens"] < 2**20 and r["seconds"] > 1e-6 for r in liar)
    honest = [trained_from(st).get("honest-0", 0) for st in out["steps"][2:]]
    assert all(n >= PROMPTS // 6 for n in honest), honest


def test_the_trainer_survives_a_batch_with_nothing_trainable_and_a_restart_on_it(tmp_path):
    """Batch 1 is the cheater's alone (the honest Actor joins after it is handed out), every
    result of it fails verification: nothing to train. The Trainer publishes v1 unchanged
    instead of exiting (before: ``train([])`` raised and killed it, and again on the same
    batch after every restart), also when it is killed before that step and restarts."""
    topo = {**TOPOLOGY, "actors": [TOPOLOGY["actors"][1]]}
    d = run(
        tmp_path,
        "random",
        topology=topo,
        extra={"start_actors": 1, "verify": True, "verify_probation": 48},
        faults=(
            Fault(kind="join", target="honest-0", region="us", gpu="A100", at_step=1),
            Fault(kind="trainer_crash", at_step=1),
        ),
    )
    out = outcome(d)
    assert out["summary"]["steps_completed"] == STEPS
    assert set(out["evicted"]) == {CHEATER}
    # Back after the restart, the cheater is refused as excluded: recorded, never the run's end.
    dismissed = out["summary"]["dismissed"]
    assert set(dismissed) <= {CHEATER} and all("excluded" in w for w in dismissed.values())
    assert "resumed from its checkpoint at v0" in (d / "logs" / "trainer.log").read_text()
    first = out["steps"][0]
    assert first.get("results") == 0 and first.get("skipped") == 1
    assert first.get("density") == 0.0  # v1 is v0's weights: an empty delta
    assert model_is_finite(d)
