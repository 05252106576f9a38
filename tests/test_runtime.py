"""The runtime on real processes (``aurora real``), on the labelled stand-in compute.

The stand-in keeps everything but the model (real Ledger, leases, data plane, deltas, applies,
hashes), so these runs check the runtime itself in seconds; the real-model run is in
``tests/test_real_rl.py``.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.test_ledger_service import job_spec

TOPOLOGY = """
name: {name}
trainer: {{region: us, model: qwen3-8b, gpu: H100, gpus: 1, egress_gbps: 10}}
regions: [{{name: us}}, {{name: ca}}]
links: [{{a: us, b: ca, gbps: 1.0, rtt_ms: 40, loss: 0}}]
actors:
  - {{region: ca, gpu: A100, count: {actors}}}
real: {{steps: {steps}, prompts_per_step: 12, group_size: 4}}
"""


def real(
    tmp_path: Path,
    *args: str,
    actors: int = 2,
    steps: int = 6,
    name: str = "t",
    rate: float = 0.0,
    timeout: float = 90,
    real_extra: str = "",
) -> tuple[subprocess.CompletedProcess, Path]:
    topo = tmp_path / f"{name}.yaml"
    text = TOPOLOGY.format(name=name, actors=actors, steps=steps)
    topo.write_text(text.replace("group_size: 4}", f"group_size: 4{real_extra}}}"))
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "aurora.cli",
            "real",
            "--topology",
            str(topo),
            "--backend",
            "standin",
            "--out",
            str(tmp_path / "out"),
            "--quiet",
            "--extra",
            json.dumps({"standin_tokens_per_s": rate}),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return run, tmp_path / "out" / f"{name}-aurora-s0"


def events(run_dir: Path) -> list[dict]:
    with open(run_dir / "events.csv") as f:
        return [r | {"rec": json.loads(r["record"])} for r in csv.DictReader(f)]


def lease_expiries(rows: list[dict]) -> list[dict]:
    """The leases whose expiry sent their prompt back to the pool, asserting each was real.

    A lease ends once (:mod:`aurora.policy.leases`); it ended by expiring when its first ending
    is ``Expired`` (a tick found it due) or a LATE ``Refused`` (its result came after it). Each
    such lease must have run out (ended at or after its expiry), no lease may be shorter than
    the Ledger's floor (``LeaseConfig.min_s``), every LATE refusal must come after its lease's
    expiry and name an expired lease, and each expired prompt must be admitted under a later
    lease (once: :func:`assert_invariants`). Load decides only whether a lease runs out."""
    from aurora.policy.leases import LeaseConfig

    assigned: dict[str, dict] = {}
    ended: set[str] = set()
    expired: dict[str, dict] = {}
    late: set[str] = set()
    for r in rows:
        rec, at = r["rec"], float(r["time"])
        if r["type"] == "Assign":
            assert rec["expiry"] - at >= LeaseConfig().min_s - 1e-6, rec
            for lease, prompt in zip(rec["leases"], rec["prompts"], strict=True):
                assigned[lease] = {"lease": lease, "actor": rec["actor"], "prompt": prompt}
                assigned[lease] |= {"claimed": at, "expiry": rec["expiry"]}
            continue
        if r["type"] not in ("Accepted", "Expired", "Released", "Refused"):
            continue
        lease = assigned.get(rec["lease"])
        if lease is None:  # a result naming a lease never handed out: refused, not expired
            assert r["type"] == "Refused", rec
            continue
        if r["type"] == "Refused" and rec["reason"] == "LATE":
            assert at >= lease["expiry"], rec  # whether or not a tick had ended it already
            late.add(lease["lease"])
        if lease["lease"] in ended:
            continue
        ended.add(lease["lease"])
        if r["type"] == "Expired" or lease["lease"] in late:
            assert at >= lease["expiry"], (r["type"], lease)
            expired[lease["lease"]] = lease | {"at": at, "how": r["type"]}
    assert late <= set(expired), late - set(expired)
    admitted = {r["rec"]["prompt"]: r["rec"]["lease"] for r in rows if r["type"] == "Accepted"}
    for lease in expired.values():
        assert admitted[lease["prompt"]] != lease["lease"], lease
    return list(expired.values())


def assert_invariants(run_dir: Path, steps: int) -> dict:
    """What every run must satisfy, read from its own outputs."""
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["steps_completed"] == steps
    assert s["prompts_lost"] == 0 and s["prompts_settled_twice"] == 0
    assert s["prompts_settled"] == s["prompts_requested"] == steps * 12
    assert s["lease_book_ok"], s["lease_book_error"]
    assert s["replay_action_mismatches"] == 0
    assert s["wrong_admits"] == 0
    assert s["actor_hash_mismatches"] == 0 and s["actor_digest_mismatches"] == 0
    rows = events(run_dir)
    # Every admitted result carried its lease's version and the h(v) the Trainer published.
    published = {
        r["rec"]["version"]: r["rec"]["weights_hash"] for r in rows if r["type"] == "Published"
    }
    arrived = {r["rec"]["lease"]: r["rec"] for r in rows if r["type"] == "ResultArrived"}
    accepted = [r["rec"] for r in rows if r["type"] == "Accepted"]
    assert accepted
    for a in accepted:
        res = arrived[a["lease"]]
        assert res["version"] == a["version"] and res["weights_hash"] == published[a["version"]]
    assert Counter(a["prompt"] for a in accepted).most_common(1)[0][1] == 1
    # Each Actor's weights hash equals h(v) at each activation and catch-up.
    activations = [r["rec"] for r in rows if r["type"] == "Activation"]
    assert activations
    for act in activations:
        assert act["weights_hash"] == published[act["version"]]
    return s


def test_a_run_with_two_actors_and_a_relay_completes_with_every_invariant(tmp_path):
    run, out = real(tmp_path, actors=2, steps=6)
    assert run.returncode == 0, run.stderr[-2000:]
    s = assert_invariants(out, 6)
    # Nothing is refused but a late result, and a lease expires only once it has run out: at
    # rate 0 a lease lasts its 1 s floor (LeaseConfig.min_s, above k x a median completion of
    # ms), which a 1 s stall of five processes on a busy 2-core machine outlasts although
    # nothing is wrong. Each such prompt is then admitted once, under a later lease (above).
    assert set(s["results_refused"]) <= {"LATE"}
    expired = lease_expiries(events(out))
    assert s["leases_expired"] == sum(e["how"] == "Expired" for e in expired)
    assert s["activation_pause_ms"]["n"] > 0
    for f in ("steps.csv", "events.csv", "timeline.csv", "summary.json", "t.png"):
        assert (out / f).exists(), f
    with open(out / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, 7))
    assert all(r["backend"] == "standin" for r in rows)
    # The relay took part: the Actors were routed to it and subscribed to it.
    routes = [r["rec"]["source"] for r in events(out) if r["type"] == "Route"]
    assert "relay-ca" in routes
    relay_addr = (out / "logs" / "relay-ca.log").read_text().split(" on ")[-1].split()[0]
    for actor in ("ca-a100-0", "ca-a100-1"):
        assert f"subscribed to {relay_addr}" in (out / "logs" / f"{actor}.log").read_text()
    assert run.stdout.splitlines()[0].startswith("t: 2 Actors (2 in ca")
    # On CPU every version's content digest is computed and compared on both sides.
    assert s["actor_digests_checked"] == s["activations"]


def test_content_digests_are_computed_only_every_digest_interval_versions(tmp_path):
    run, out = real(tmp_path, actors=2, steps=6, real_extra=", digest_interval: 3")
    assert run.returncode == 0, run.stderr[-2000:]
    s = assert_invariants(out, 6)
    rows = events(out)
    digests = {
        r["rec"]["version"]: r["rec"].get("digest") for r in rows if r["type"] == "Published"
    }
    assert [v for v, d in sorted(digests.items()) if d] == [0, 3, 6]
    acts = [r["rec"] for r in rows if r["type"] == "Activation"]
    assert all(bool(a.get("digest")) == (a["version"] % 3 == 0) for a in acts)
    # ... and every digested activation was compared; h(v) was checked at all of them.
    assert s["actor_digests_checked"] == sum(a["version"] % 3 == 0 for a in acts) > 0


def test_a_killed_actors_leases_are_re_leased_and_a_joiner_catches_up_and_contributes(tmp_path):
    # The joiner's process must start, catch up and be handed a batch before the last one is
    # requested: ~0.7 s on an idle machine, several seconds on a busy 2-core one. At 100 tokens/s
    # a step takes 0.8-1.2 s (4-6 prompts x 4 completions x 5 tokens per Actor: 3 Actors or the
    # 2 survivors), so the 10 steps after the join leave it ~9 s; at 300 they left ~3 s, the
    # margin a loaded machine ate in reliability row 15 (the same scenario).
    run, out = real(
        tmp_path,
        "--fault",
        "preempt:ca-a100-1@step=3",
        "--fault",
        "join:ca-new-0:ca:A100@step=4",
        actors=3,
        steps=14,
        rate=100.0,
        timeout=300,  # a hang guard: ~20 s idle
    )
    assert run.returncode == 0, run.stderr[-2000:]
    s = assert_invariants(out, 14)
    assert s["faults"] == ["preempt:ca-a100-1@step=3", "join:ca-new-0:ca:A100@step=4"]
    rows = events(out)
    # Every lease the killed Actor held when it died expired (none came back), and its prompts
    # were admitted from others. A survivor's lease may expire too (a stall on a busy machine
    # outlasting its ~2.5 x median completion): lease_expiries holds those to the same rules,
    # and the invariants above to nothing lost and nothing settled twice.
    expired = lease_expiries(rows)
    admitted = {r["rec"]["lease"] for r in rows if r["type"] == "Accepted"}
    held = {
        lease
        for r in rows
        if r["type"] == "Assign" and r["rec"]["actor"] == "ca-a100-1"
        for lease in r["rec"]["leases"]
        if lease not in admitted
    }
    killed = [e for e in expired if e["actor"] == "ca-a100-1"]
    assert held and {e["lease"] for e in killed} == held
    accepted = {r["rec"]["prompt"]: r["rec"]["actor"] for r in rows if r["type"] == "Accepted"}
    assert all(accepted[e["prompt"]] != "ca-a100-1" for e in killed)
    # The joiner caught up (snapshot + chain) and then produced admitted results.
    caught = [
        r["rec"]
        for r in rows
        if r["type"] == "Activation"
        and r["rec"]["actor"] == "ca-new-0"
        and r["rec"]["how"] == "catch_up"
    ]
    assert caught
    assert "ca-new-0" in accepted.values()


def test_bad_input_gives_one_line_and_no_run(tmp_path):
    topo = tmp_path / "t.yaml"
    topo.write_text(TOPOLOGY.format(name="t", actors=1, steps=2))
    cases = [
        (["--strategy", "aurora-leb128"], "does not run on real processes"),
        (["--fault", "preempt:nobody@step=1"], "unknown Actor 'nobody'"),
        (["--fault", "preempt:ca-a100-0@step=9"], "after the last step"),
        (["--spot-hazard", "1"], "no spot Actors"),
    ]
    for args, why in cases:
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "aurora.cli",
                "real",
                "--topology",
                str(topo),
                "--backend",
                "standin",
                "--out",
                str(tmp_path / "out"),
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 2, (args, run.stderr)
        assert why in run.stderr and "Traceback" not in run.stderr
        assert len(run.stderr.strip().splitlines()) == 1
    # The rl backend's own refusals, before any process or folder exists.
    real_section = "real: {{steps: {steps}, prompts_per_step: 12, group_size: 4}}"
    refusals = [
        ("real: {{model: /no/such/model, steps: 2}}", "real.model: no such model directory"),
        ("real: {{device: cuda, steps: 2}}", "real.device: cuda: no CUDA GPU is visible"),
        ("real: {{engine: tensorrt, steps: 2}}", "engine must be one of"),
    ]
    if importlib.util.find_spec("vllm") is None:
        # Where vLLM's CPU build is installed (CI), engine: vllm runs: tests/test_vllm_runtime.py.
        refusals.append(("real: {{engine: vllm, steps: 2}}", "real.engine: vllm: vLLM is not"))
    for real_line, why in refusals:
        bad = tmp_path / "bad.yaml"
        bad.write_text(TOPOLOGY.replace(real_section, real_line).format(name="b", actors=1))
        out = tmp_path / "bad-out"
        run = subprocess.run(
            [sys.executable, "-m", "aurora.cli", "real", "--topology", str(bad)]
            + ["--out", str(out)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 2, (real_line, run.stderr)
        assert why in run.stderr and "Traceback" not in run.stderr, run.stderr
        assert len(run.stderr.strip().splitlines()) == 1 and not out.exists()
    missing = subprocess.run(
        [sys.executable, "-m", "aurora.cli", "real", "--topology", str(tmp_path / "no.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "cannot read topology file" in missing.stderr


def ledger_port(ledger: subprocess.Popen, *, deadline_s: float) -> int:
    """Wait (at most ``deadline_s``) for ``aurora ledger``'s "serving on HOST:PORT" line."""
    import os
    import re
    import select
    import time

    assert ledger.stdout is not None
    fd, seen, end = ledger.stdout.fileno(), b"", time.monotonic() + deadline_s
    while (left := end - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        chunk = os.read(fd, 4096) if ready else b""
        if ready and not chunk:
            break  # the Ledger exited
        seen += chunk
        if match := re.search(rb"ledger: serving on [^\s:]+:(\d+)", seen):
            return int(match.group(1))
    raise AssertionError(f"no ready line from the Ledger in {deadline_s} s: {seen[-2000:]!r}")


@pytest.mark.parametrize("secret", ["00" * 32, None])
def test_an_actor_with_a_wrong_or_missing_secret_is_refused_with_one_line(tmp_path, secret):
    import os

    from aurora.keys import issue_identity, load_signing_key, new_job_keys, write_identity

    keys = new_job_keys(tmp_path / "keys")
    topo = tmp_path / "t.yaml"
    topo.write_text(TOPOLOGY.format(name="t", actors=1, steps=2))
    signing = load_signing_key(keys.signing_key)
    write_identity(tmp_path / "l.identity", issue_identity("ledger", "ledger", signing, job="j"))
    ledger = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aurora.cli",
            "ledger",
            "--topology",
            str(topo),
            "--backend",
            "standin",
            "--db",
            str(tmp_path / "l.db"),
            "--port",
            "0",
            "--secret-file",
            str(keys.secret),
            "--public-key",
            str(keys.public_key),
            "--identity",
            str(tmp_path / "l.identity"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        # The port the Ledger bound (0: the kernel's choice, so no other process can take it
        # between a probe and the bind), from the line it logs once it accepts connections.
        port = ledger_port(ledger, deadline_s=120)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AURORA_")}
        ident = tmp_path / "a.identity"
        write_identity(ident, issue_identity("actor", "a", signing, job="j"))
        args = ["--public-key", str(keys.public_key), "--identity", str(ident)]
        if secret is not None:
            bad = tmp_path / "bad"
            bad.write_text(secret)
            args += ["--secret-file", str(bad)]
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "aurora.cli",
                "actor",
                "--join",
                f"127.0.0.1:{port}",
                "--id",
                "a",
                "--region",
                "ca",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert run.returncode in (1, 2)
        last = run.stderr.strip().splitlines()[-1]
        assert last.startswith("aurora actor: ") and "Traceback" not in run.stderr
        if secret is None:
            assert "AURORA_JOB_SECRET" in last
        else:
            assert "refused us" in last or "authentication" in last
    finally:
        ledger.kill()
        ledger.wait()


def test_an_actor_given_another_jobs_public_key_stops_with_one_line_and_a_right_one_never_does(
    tmp_path,
):
    import numpy as np

    from aurora.delta import DeltaEncoder, weights_hash
    from aurora.delta.announce import describe_parts, sign
    from aurora.keys import load_public_key, load_signing_key, new_job_keys
    from aurora.runtime.actor import KEY_CHECKS, ActorProcess, ActorRun

    ours, theirs = new_job_keys(tmp_path / "ours"), new_job_keys(tmp_path / "theirs")
    trainer_key = load_signing_key(ours.signing_key)

    def announcement(v: int) -> bytes:
        rng = np.random.default_rng(v)
        old = {"w": rng.integers(0, 2**16, (64, 64), dtype=np.uint16)}
        new = {"w": old["w"] ^ 1}
        segs = list(
            DeltaEncoder(
                old, new, model="toy", version=v, base_hash=weights_hash(old), codec="naive"
            ).segments()
        )
        return sign(describe_parts("job-1", segs[0].data, segs[-1].data), trainer_key)

    def actor(public_key_file: Path) -> ActorProcess:
        a = ActorProcess(
            ActorRun(
                id="a",
                region="us",
                ledger=("127.0.0.1", 1),
                secret=b"s" * 32,
                public_key=load_public_key(public_key_file),
            )
        )
        a.job = job_spec(tmp_path, job_id="job-1")
        return a

    wrong = actor(theirs.public_key)
    for v in range(1, KEY_CHECKS + 1):
        assert wrong.failed is None
        wrong._on_message({"op": "announce", "data": announcement(v)})
    assert wrong.stopping and wrong.failed is not None
    assert "wrong --public-key for job job-1" in wrong.failed and "\n" not in wrong.failed

    right = actor(ours.public_key)
    right._on_message({"op": "announce", "data": announcement(1)})
    bad = bytearray(announcement(2))
    bad[-1] ^= 1  # a forged announcement later is refused, never fatal
    for _ in range(KEY_CHECKS + 1):
        right._on_message({"op": "announce", "data": bytes(bad)})
    assert right.failed is None and not right.stopping


def test_a_role_that_fails_before_the_first_step_stops_the_run_with_its_error(tmp_path, capsys):
    from aurora.runtime.launcher import EXIT_ROLE_FAILED, Launcher, RealRun
    from aurora.topology import load_topology

    topo = tmp_path / "t.yaml"
    topo.write_text(TOPOLOGY.format(name="t", actors=2, steps=4))
    launcher = Launcher(
        RealRun(
            topology=load_topology(topo),
            topology_path=str(topo),
            out=str(tmp_path / "out"),
            backend="standin",
            hooks={"ca-a100-1": {"fail_at_start": "cannot load the engine"}},
            progress=False,
            stall_s=120.0,
        )
    )
    assert launcher.main() == EXIT_ROLE_FAILED
    err = capsys.readouterr().err
    assert "ca-a100-1 failed at start" in err and "cannot load the engine" in err


def test_an_actor_the_job_revoked_before_the_first_step_is_recorded_and_the_run_goes_on(
    tmp_path, capsys, monkeypatch
):
    """Refused by the job itself (revoked here; excluded alike) is the job working: the
    launcher says so once, keeps it in events.csv and summary.json, and finishes the run with
    the other Actor, where a role that cannot start stops it (the test above). Revoked while
    it works: tests/test_ledger_identity.py, ``aurora keys revoke`` during a run."""
    from aurora.keys import load_signing_key, revoke
    from aurora.runtime.launcher import EXIT_OK, Launcher, RealRun
    from aurora.topology import load_topology

    prepare = Launcher.prepare

    def revoked(self: Launcher) -> None:
        prepare(self)  # the run's folder and keys are made here: revoke with them
        key = load_signing_key(self.keys.signing_key)
        revoke(self.dir / "revoked.json", ["ca-a100-1"], key, job=self.job.job_id)

    monkeypatch.setattr(Launcher, "prepare", revoked)
    topo = tmp_path / "t.yaml"
    topo.write_text(TOPOLOGY.format(name="t", actors=2, steps=3))
    launcher = Launcher(
        RealRun(
            topology=load_topology(topo),
            topology_path=str(topo),
            out=str(tmp_path / "out"),
            backend="standin",
            extra={
                # The start barrier counts Actors, not ids: it would wait start_wait_s for the
                # revoked one.
                "start_actors": 1,
                # Steps of ~2 s: the revoked Actor, started beside the other, is refused while
                # the job runs, not after it finished (then nothing is left to go on with).
                "standin_tokens_per_s": 100.0,
            },
            progress=False,
            stall_s=120.0,
        )
    )
    assert launcher.main() == EXIT_OK
    err = capsys.readouterr().err
    assert "ca-a100-1 dismissed by the job" in err and "failed at start" not in err
    summary = json.loads((launcher.dir / "summary.json").read_text())
    assert summary["steps_completed"] == 3 and summary["exit_code"] == EXIT_OK
    assert list(summary["dismissed"]) == ["ca-a100-1"]
    assert "is revoked in this job" in summary["dismissed"]["ca-a100-1"]
    rows = events(launcher.dir)
    dismissed = [r for r in rows if r["type"] == "Dismissed"]
    assert [(r["kind"], r["who"]) for r in dismissed] == [("launcher", "ca-a100-1")]
    assert {r["rec"]["actor"] for r in rows if r["type"] == "Accepted"} == {"ca-a100-0"}
