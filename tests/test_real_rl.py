"""``aurora real`` end to end on the real compute (the ``rl`` backend): GRPO Trainer, transformers
engines, real deltas through a relay, and the trained model as the product.

The run's model is a local Hugging Face directory (``real.model: PATH``, the ``from_pretrained``
path every non-default model takes) holding a tiny Qwen3 given a little competence by a short
supervised warm start (100 steps, ~3% greedy: enough that some groups of 16 prompts x 8 have
mixed rewards, so the policy moves; an untrained model scores 0 everywhere, every advantage is 0
and the weights would never change). The built-in default's full warm start takes ~90 s cold on
this machine, too long for CI; it is the same code path once the snapshot exists.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

STEPS = 3

TOPOLOGY = """
name: rl
trainer: {{region: us, model: qwen3-8b, gpu: H100, gpus: 1, egress_gbps: 10}}
regions: [{{name: us}}, {{name: ca}}]
links: [{{a: us, b: ca, gbps: 1.0, rtt_ms: 40, loss: 0}}]
actors:
  - {{region: ca, gpu: A100, count: 2}}
real: {{model: {model}, steps: {steps}, prompts_per_step: 16, group_size: 8, eval_prompts: 50}}
"""


def stock_digest(path: Path) -> str:
    """Load ``path`` with stock transformers and hash its weights as the Trainer does (bf16 bits
    in the canonical fused layout, :func:`aurora.engines.base.weights_digest_of`); the model
    must also generate."""
    import numpy as np
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aurora.engines.base import weights_digest_of

    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(["12+34="], return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]
    state, seen = {}, set()
    for name, t in model.state_dict().items():
        if t.is_floating_point() and t.data_ptr() not in seen:  # tied lm_head: once
            seen.add(t.data_ptr())
            bits = t.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy()
            state[name] = bits.view(np.uint16)
    return weights_digest_of(state)


def test_a_real_run_on_the_rl_backend_loses_nothing_and_exports_the_published_weights(tmp_path):
    from aurora.cli import main as aurora
    from aurora.models import save_pretrained
    from aurora.rl.warmstart import WarmStartConfig, warm_start

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine's other core runs other tests' processes
    try:
        ws = warm_start(
            WarmStartConfig(
                threshold=0.03, eval_every=25, validation_size=128, batch_size=64, warmup_steps=20
            ),
            cache_dir=tmp_path / "cache",
        )
    finally:
        torch.set_num_threads(threads)
    model_dir = save_pretrained(ws.model, ws.tokenizer, tmp_path / "v0", state=ws.state)
    topo = tmp_path / "rl.yaml"
    topo.write_text(TOPOLOGY.format(model=model_dir, steps=STEPS))
    run = subprocess.run(
        [sys.executable, "-m", "aurora.cli", "real", "--topology", str(topo)]
        + ["--out", str(tmp_path / "out"), "--quiet"],
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard, not a budget: ~45 s at a load average of 4, 200 s at 15
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    out = tmp_path / "out" / "rl-aurora-s0"
    s = json.loads((out / "summary.json").read_text())
    assert s["backend"] == "rl" and s["steps_completed"] == STEPS
    assert s["prompts_lost"] == 0 and s["prompts_settled"] == STEPS * 16
    assert s["actor_hash_mismatches"] == 0 and s["actor_digest_mismatches"] == 0
    assert s["wrong_admits"] == 0
    assert isinstance(s["reward_first"], float) and isinstance(s["reward_last"], float)

    with open(out / "events.csv") as f:
        records = [json.loads(r["record"]) for r in csv.DictReader(f)]
    digest = {r["version"]: r["digest"] for r in records if r["type"] == "Published"}
    assert sorted(digest) == list(range(STEPS + 1))
    # The policy moved (else an export of v0 would pass the checks below).
    assert digest[STEPS] != digest[0]
    # Both Actors held the Trainer's bits after their activations, through the relay.
    acts = [r for r in records if r["type"] == "Activation"]
    assert {a["actor"] for a in acts} == {"ca-a100-0", "ca-a100-1"}
    assert all(a["digest"] == digest[a["version"]] for a in acts)
    assert any(r["type"] == "Route" and r["source"] == "relay-ca" for r in records)

    # The run's model/ is the last version, loadable by stock transformers.
    assert stock_digest(out / "model") == digest[STEPS]
    # aurora export rebuilds any version from the store (snapshot + verified deltas).
    for v in (STEPS - 1, STEPS):
        dest = tmp_path / f"export-v{v}"
        args = ["export", "--job", str(out / "job.json"), "--version", str(v)]
        args += ["--out", str(dest), "--public-key", str(out / "keys" / "job.pub")]
        assert aurora(args) == 0
        assert stock_digest(dest) == digest[v]
