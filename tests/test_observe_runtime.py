"""Observability on real processes: every role's /metrics, ``aurora status`` live and afterwards,
an observer that cannot act, and TensorBoard/W&B series equal between ``aurora sim`` and
``aurora real`` of one topology (read back with TensorBoard's own reader).

One module-scoped ``aurora real --metrics --log tensorboard`` run on the labelled stand-in
compute (real Ledger, leases, data plane, deltas; steps of ~0.5 s) is scraped and asked for its
status while it runs; the tests then check what was gathered against the run's own files.
"""

from __future__ import annotations

import asyncio
import csv
import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from aurora.observe import table
from aurora.observe.steplog import EXTRA_TAGS
from aurora.policy.leases import Refusal
from aurora.policy.membership import ActorLife
from aurora.policy.verification import Trust

STEPS = 8
TOPOLOGY = f"""
name: obs
trainer: {{region: us, model: qwen3-8b, gpu: H100, gpus: 1, egress_gbps: 10}}
regions: [{{name: us}}, {{name: ca}}]
links: [{{a: us, b: ca, gbps: 1.0, rtt_ms: 40, loss: 0}}]
actors:
  - {{region: ca, gpu: A100, count: 2}}
real: {{steps: {STEPS}, prompts_per_step: 12, group_size: 4}}
"""
AURORA = [sys.executable, "-m", "aurora.cli"]


def status(*args: str, timeout: float = 60) -> dict:
    out = subprocess.run(
        [*AURORA, "status", *args, "--json"], capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("observe")
    topo = tmp / "obs.yaml"
    topo.write_text(TOPOLOGY)
    folder = tmp / "out" / "obs-aurora-s0"
    proc = subprocess.Popen(
        [
            *AURORA,
            "real",
            "--topology",
            str(topo),
            "--backend",
            "standin",
            "--out",
            str(tmp / "out"),
            "--quiet",
            "--extra",
            json.dumps({"standin_tokens_per_s": 200.0}),
            "--metrics",
            "--log",
            "tensorboard",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    bodies: dict[str, str] = {}
    live: dict | None = None
    elsewhere: list[str] | None = None
    watch: subprocess.Popen | None = None
    here = this_hosts_address()
    try:
        targets_file = folder / "prometheus" / "targets.json"
        deadline = time.monotonic() + 120
        while not targets_file.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        targets = json.loads(targets_file.read_text())
        while proc.poll() is None and time.monotonic() < deadline:
            for t in targets:
                url = f"http://{t['targets'][0]}/metrics"
                try:
                    with urllib.request.urlopen(url, timeout=2) as resp:
                        bodies[t["labels"]["id"]] = resp.read().decode()
                except OSError:
                    pass
            if elsewhere is None and len(bodies) == len(targets):
                elsewhere = [t["labels"]["id"] for t in targets if answers(here, t)]
            version = re.search(r"^aurora_version (\S+)", bodies.get("trainer", ""), re.M)
            if watch is None and version and float(version.group(1)) >= 1:
                watch = subprocess.Popen(
                    [*AURORA, "status", str(folder), "--watch", "0.3", "--json"],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            if live is None and version and float(version.group(1)) >= 2:
                live = status(str(folder))
            time.sleep(0.2)
        out, err = proc.communicate(timeout=60)
        watched = watch.communicate(timeout=60) if watch is not None else ("", "no watch")
    finally:
        for p in (proc, watch):
            if p is not None and p.poll() is None:
                p.kill()
    assert proc.returncode == 0, err
    return {
        "folder": folder,
        "topology": topo,
        "targets": targets,
        "bodies": bodies,
        "live": live,
        "tmp": tmp,
        "elsewhere": elsewhere,
        "watched": (watch.returncode if watch else None, *watched),
    }


def this_hosts_address() -> str | None:
    """An address of this host other than loopback (None: it has none)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: only a route is chosen
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


def answers(host: str | None, target: dict) -> bool:
    import socket

    if host is None:
        return False
    port = int(target["targets"][0].rsplit(":", 1)[1])
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return False
    return True


def test_every_role_serves_its_metrics_on_localhost_and_never_a_key_or_a_prompt(run):
    folder, bodies = run["folder"], run["bodies"]
    assert set(bodies) == {"trainer", "relay-ca", "ca-a100-0", "ca-a100-1"}
    assert all(t["targets"][0].startswith("127.0.0.1:") for t in run["targets"])
    assert run["elsewhere"] == [], "a /metrics answered on an address other than 127.0.0.1"
    ids = {"trainer", "relay-ca", "ca-a100-0", "ca-a100-1"}
    allowed = {
        "actor": ids,
        "relay": ids,
        "source": ids,
        "region": {"us", "ca"},
        "life": {x.value for x in ActorLife},
        "state": {x.value for x in Trust},
        "reason": {x.name for x in Refusal} | {"UNKNOWN_ACTOR"},
        "at": {"first", "last"},
        "kind": {
            "segment",
            "trailer",
            "announcement",
            "version",
            "control",
            "connection",
            "subscriber",
        },
    }
    keys = [(folder / "keys" / "job.secret").read_text().strip()]
    for ident in (folder / "keys").glob("*.identity"):
        keys += [json.loads(ident.read_text())[k] for k in ("key", "cert")]
    pem = (folder / "keys" / "trainer.key").read_text().splitlines()
    keys += [line for line in pem if line and not line.startswith("-----")]
    assert len(keys) >= 10 and all(len(k) >= 32 for k in keys)
    names = {m.name.removesuffix("_total") for m in table.METRICS}
    for who, body in bodies.items():
        for key in keys:
            assert key not in body, who
        assert not re.search(r"\bb\d+-\d+\b", body), who  # no prompt (or lease) id
        for fam in text_string_to_metric_families(body):
            assert fam.name in names or fam.name.startswith(("process_", "python_")), fam.name
            for s in fam.samples:
                for label, value in s.labels.items():
                    if label == "le":
                        continue
                    assert value in allowed[label], (who, s.name, label, value)
    assert (
        "aurora_version" in bodies["trainer"] and "aurora_actor_lag_versions" in bodies["trainer"]
    )
    assert re.search(r"^aurora_node_bytes_verified_total [1-9]", bodies["relay-ca"], re.M)
    assert re.search(r"^aurora_engine_tokens_total [1-9]", bodies["ca-a100-0"], re.M)


def steps_csv(folder: Path) -> dict[int, dict]:
    with open(folder / "steps.csv") as f:
        return {int(r["step"]): r for r in csv.DictReader(f)}


def test_aurora_status_reads_a_running_job_and_then_its_finished_folder(run):
    live, folder = run["live"], run["folder"]
    assert live is not None, "the run ended before a status could be asked"
    assert not live["finished"] and 2 <= live["latest"] < STEPS
    done = status(str(folder))
    assert done["finished"] and done["latest"] == STEPS and done["steps_total"] == STEPS
    for snap in (live, done):
        assert snap["actors_total"] == 2 and snap["regions"]["ca"]["live"] == 2
        assert {a["id"] for a in snap["actors"]} == {"ca-a100-0", "ca-a100-1"}
        assert [link["source"] for link in snap["links"]] == ["relay-ca"]
    # The live view's steps are the finished run's, as the run's own files have them.
    rows = steps_csv(folder)
    assert [s["step"] for s in done["steps"]] == list(range(1, STEPS + 1))
    for s in done["steps"]:
        assert s["delta_bytes"] == float(rows[s["step"]]["delta_bytes"])
    finished = {s["step"]: s for s in done["steps"]}
    for s in live["steps"]:
        assert s == finished[s["step"]]
    text = subprocess.run(
        [*AURORA, "status", str(folder)], capture_output=True, text=True, timeout=60
    )
    assert text.returncode == 0 and "relay-ca -> ca" in text.stdout


def test_aurora_status_watch_follows_the_job_until_it_finishes(run):
    code, out, err = run["watched"]
    assert code == 0, err
    snaps = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert len(snaps) >= 3
    versions = [s["latest"] for s in snaps]
    assert versions == sorted(versions) and versions[0] < STEPS
    assert snaps[-1]["finished"] and snaps[-1]["latest"] == STEPS


def tb_scalars(folder: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def sim_run(run) -> Path:
    """``aurora sim --log tensorboard`` of the run's own topology; its run folder."""
    sim_out = run["tmp"] / "sim"
    done = subprocess.run(
        [*AURORA, "sim", "--topology", str(run["topology"]), "--strategy", "aurora"]
        + ["--steps", str(STEPS), "--out", str(sim_out), "--log", "tensorboard"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return sim_out / "obs-aurora-s0"


def test_tensorboard_tags_are_equal_between_aurora_sim_and_aurora_real_for_one_topology(
    run, sim_run
):
    pytest.importorskip("tensorboard", reason="the test reads with TensorBoard's reader (dev)")
    sim_folder = sim_run
    sim, real = tb_scalars(sim_folder / "tb"), tb_scalars(run["folder"] / "tb")
    assert set(sim) == table.tags("sim")
    learning = (table.tags("real") - table.tags("sim")) | set(EXTRA_TAGS.values())
    assert {t for t in real if t not in learning} == set(sim)  # equal, but for what needs a model
    assert set(real) & learning  # the stand-in trains on something: reward, density
    for tags in (sim, real):
        assert all(sorted(tags[t]) == list(range(1, STEPS + 1)) for t in table.tags("sim"))
    # Each series is what the run's own rows say.
    for folder, scalars in ((sim_folder, sim), (run["folder"], real)):
        rows = steps_csv(folder)
        for v in range(1, STEPS + 1):
            assert scalars["delta/delta_bytes"][v] == pytest.approx(float(rows[v]["delta_bytes"]))
            assert scalars["scheduling/staleness"][v] == float(rows[v]["staleness"])
            if v > 1:  # the real run's first step is timed from its log's start
                want = float(rows[v]["step_time_s"])
                assert scalars["training/step_time_s"][v] == pytest.approx(want, rel=1e-5)


def test_w_and_b_offline_gets_the_same_tags(tmp_path, run):
    pytest.importorskip("wandb", reason="wandb is optional ('.[wandb]')")
    done = subprocess.run(
        [
            *AURORA,
            "sim",
            "--topology",
            str(run["topology"]),
            "--strategy",
            "aurora",
            "--steps",
            "3",
            "--out",
            str(tmp_path),
            "--log",
            "wandb",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "WANDB_MODE": "offline"},
    )
    assert done.returncode == 0, done.stderr
    (log,) = (tmp_path / "obs-aurora-s0" / "wandb").glob("offline-run-*/run-*.wandb")
    # The history records name their keys in the clear in W&B's offline transaction log.
    written = {
        m.decode() for m in re.findall(rb"(?:training|delta|scheduling)/[a-z_]+", log.read_bytes())
    }
    assert written == table.tags("sim")


def test_an_observer_can_read_but_never_act(tmp_path, monkeypatch):
    """Whatever an observer sends but a heartbeat or a status request is dropped: nothing it
    sends is logged or changes the state; an observer identity that says it is an Actor or the
    Trainer in its hello is refused."""
    from aurora.keys import issue_identity
    from aurora.observe import status as observe_status
    from aurora.observe.status import snapshot
    from aurora.policy.events import ActorJoined
    from tests.test_control_identity import JOB_ID, JOB_KEY, join, rows, running

    forbidden = [
        {"op": "staged", "version": 1},
        {"op": "activated", "version": 0, "weights_hash": "h", "digest": None, "pause_ms": 1.0},
        {"op": "result", "lease": "x", "version": 0, "weights_hash": "h", "payload": b"p"},
        {"op": "throughput", "tokens": 10, "seconds": 1.0},
        {"op": "notice", "seconds": 5.0},
        {"op": "leave"},
        {"op": "data", "addr": "127.0.0.1:1"},
        {"op": "published", "version": 1, "weights_hash": "h"},
        {"op": "finished"},
        {"op": "job", "job": {"steps": 1, "prompts_per_batch": 1, "spec": {}}},
        {"op": "get_batch", "batch": 1},
        {
            "op": "verified",
            "actor": "a1",
            "lease": "x",
            "version": 0,
            "max_delta": 99.0,
            "mean_delta": 99.0,
            "min_logprob": -99.0,
            "tokens": 1,
        },
        {"op": "fault", "spec": "preempt:a1@step=1"},
    ]

    async def main() -> None:
        svc, port, _trainer = await running(tmp_path)
        svc.feed(ActorJoined(actor="a1", region="us", active=0))
        ident = issue_identity("observer", "o", JOB_KEY, job=JOB_ID)
        before_rows, before_state = len(rows(tmp_path)), repr(svc.state)
        for claimed in ("actor", "trainer"):  # its certificate says observer
            with pytest.raises(ConnectionError, match="refused us"):
                await join(port, claimed, "o", ident)
        for claimed in ("observer",):
            obs = await join(port, claimed, "o", ident)
            assert (await obs.recv())["op"] == "progress"
            await obs.send({"op": "status"})
            while (reply := await asyncio.wait_for(obs.recv(), 5))["op"] != "status":
                pass
            assert reply["snapshot"]["actors_total"] == 1
            for msg in forbidden:
                await obs.send(msg)  # dropped, with a log line; the session goes on reading
            await obs.send({"op": "status"})
            while (reply := await asyncio.wait_for(obs.recv(), 5))["op"] != "status":
                pass
            obs.close()
        await asyncio.sleep(0.2)
        assert len(rows(tmp_path)) == before_rows and repr(svc.state) == before_state
        assert not svc.finished and "a1" in svc.state.actors and svc.state.latest == 0
        # A flood of status requests costs the Ledger one snapshot per MIN_INTERVAL_S.
        made = []

        def counted(service):
            made.append(1)
            return snapshot(service)

        monkeypatch.setattr(observe_status, "snapshot", counted)
        await asyncio.sleep(observe_status.MIN_INTERVAL_S + 0.1)  # the cached one is old now
        obs = await join(port, "observer", "o", ident)
        t0 = time.monotonic()
        for _ in range(200):
            await obs.send({"op": "status"})
        got = 0
        while got < 200:
            got += (await asyncio.wait_for(obs.recv(), 5))["op"] == "status"
        assert 1 <= len(made) <= 2 + (time.monotonic() - t0) / observe_status.MIN_INTERVAL_S
        await svc.close()

    asyncio.run(main())


def test_the_overlay_figure_is_drawn_from_a_real_and_a_simulated_runs_event_files(
    tmp_path, run, sim_run
):
    pytest.importorskip("tensorboard", reason="it reads with TensorBoard's reader (dev)")
    import shutil

    from experiments import observe_overlay

    folder = tmp_path / "obs-aurora-s0"  # a run folder as sim_vs_real --log leaves it
    shutil.copytree(run["folder"] / "tb", folder / "tb")
    shutil.copytree(sim_run / "tb", folder / "sim" / "tb")
    png = observe_overlay.main(
        [str(folder), "--out", str(tmp_path / "o.png"), "--evidence", str(tmp_path / "ev")]
    )
    assert png.stat().st_size > 10_000
    with open(tmp_path / "ev" / "obs-aurora-s0.csv") as f:
        rows = list(csv.DictReader(f))
    for tag, _ in observe_overlay.TAGS:
        mine = [r for r in rows if r["tag"] == tag]
        assert len(mine) == STEPS and all(r["real"] and r["sim"] for r in mine), tag


def test_aurora_status_watch_goes_on_past_its_certificates_end_with_the_renewed_one(
    tmp_path, monkeypatch
):
    """The Ledger ends a session when its certificate expires; ``aurora status --watch`` reads
    its identity file again and connects with the renewed one (``aurora real`` renews the
    observer identity it issues with the others)."""
    import argparse

    from aurora.keys import (
        CLOCK_SKEW_S,
        issue_identity,
        renew_identity,
        replace_identity,
        write_identity,
    )
    from aurora.runtime import channel
    from aurora.runtime import status as status_command
    from tests.test_control_identity import JOB_ID, JOB_KEY, JOB_PUB, SECRET, running

    connects: list[str] = []
    connect = channel.connect

    async def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        connects.append(kwargs["identity"].cert.issued)
        return await connect(*args, **kwargs)

    monkeypatch.setattr(channel, "connect", counted)

    (tmp_path / "job.secret").write_text(SECRET.hex())
    (tmp_path / "job.secret").chmod(0o600)
    (tmp_path / "job.pub").write_text(JOB_PUB.hex())
    path = tmp_path / "o.identity"
    # A certificate whose last second (clock skew allowed) is 2 s from now.
    short = issue_identity(
        "observer", "o", JOB_KEY, job=JOB_ID, lifetime_s=60, now=time.time() - 60 - CLOCK_SKEW_S + 2
    )
    write_identity(path, short)
    end = short.expires + CLOCK_SKEW_S

    async def main() -> list[float]:
        svc, port, _trainer = await running(tmp_path)
        shown: list[float] = []
        args = argparse.Namespace(
            join=f"127.0.0.1:{port}",
            secret_file=str(tmp_path / "job.secret"),
            public_key=str(tmp_path / "job.pub"),
            identity=str(path),
            job_id=None,
            unix_path=None,
            watch=0.2,
        )
        watch = asyncio.create_task(
            status_command._live(args, lambda snap: shown.append(time.time()))
        )
        await asyncio.sleep(0.5)
        replace_identity(path, renew_identity(short, JOB_KEY, lifetime_s=3600))
        await asyncio.sleep(end - time.time() + 2.0)
        assert not watch.done(), watch.exception()
        watch.cancel()
        await svc.close()
        return shown

    shown = asyncio.run(main())
    # One session with the old certificate, closed at its end; one with the renewed.
    assert len(connects) == 2 and connects[0] == short.cert.issued < connects[1]
    assert any(t < end for t in shown)
    assert sum(t > end + 0.5 for t in shown) >= 3, (end, shown)
