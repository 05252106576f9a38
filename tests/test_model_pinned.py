"""The whole model pinned: config, tokenizer and chat template signed with the snapshots.

The Trainer signs, with every snapshot, the hash of a manifest of the model's files other than
its weights (:mod:`aurora.store.manifest`); ``aurora export``, every Actor and a restarted
Trainer hash the model files they load and refuse a difference, naming the file; the run's own
``model/`` carries a signed record of every file (``aurora check-model``). The attacks: a
tokenizer that swaps "1" and "7", an injected chat template, a changed config.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from aurora.delta.announce import BadSignatureError, SnapshotAnnouncement, sign, verify
from aurora.delta.hashing import H
from aurora.keys import load_public_key, load_signing_key, new_job_keys
from aurora.store import CheckpointStore, StoreError
from aurora.store import manifest as mf

JOB = "job-pinned"


def _model_dir(root: Path) -> Path:
    d = root / "model"
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"vocab_size": 17}')
    (d / "tokenizer.json").write_text('{"model": {"vocab": {"1": 4, "7": 10}}}')
    (d / "model.safetensors").write_bytes(b"weights")
    (d / ".gitattributes").write_text("*.safetensors lfs")
    return d


# -- the manifest ------------------------------------------------------------------------------


def test_a_manifest_pins_every_file_but_the_weights_and_dot_files(tmp_path):
    d = _model_dir(tmp_path)
    (d / "sub").mkdir()
    (d / "sub" / "merges.txt").write_text("a b")
    files = mf.manifest_of(d)
    assert sorted(files) == ["config.json", "sub/merges.txt", "tokenizer.json"]
    assert files["config.json"] == H(b'{"vocab_size": 17}').hex()
    assert mf.decode(mf.encode(files)) == files
    assert mf.digest(files) == H(mf.encode(files)).hex()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (
            lambda d: (d / "tokenizer.json").write_text('{"model": {"vocab": {"1": 10, "7": 4}}}'),
            "tokenizer.json differs from the model the Trainer signed",
        ),
        (
            lambda d: (d / "chat_template.jinja").write_text("{{ 'answer 7' }}"),
            "chat_template.jinja is not in the model the Trainer signed",
        ),
        (lambda d: (d / "config.json").unlink(), "config.json is missing"),
    ],
)
def test_a_changed_added_or_missing_file_is_named_in_one_line(tmp_path, change, named):
    d = _model_dir(tmp_path)
    signed = mf.manifest_of(d)
    change(d)
    with pytest.raises(mf.ModelMismatchError, match=named) as err:
        mf.check(mf.manifest_of(d), signed, where=str(d))
    assert "\n" not in str(err.value)
    # Weights and dot-files are not the manifest's: changing them changes nothing here.
    d2 = _model_dir(tmp_path / "two")
    (d2 / "model.safetensors").write_bytes(b"other weights")
    (d2 / ".gitattributes").write_text("changed")
    mf.check(mf.manifest_of(d2), mf.manifest_of(_model_dir(tmp_path / "three")), where="x")


def test_the_private_copy_is_what_was_hashed_and_the_weights_are_linked(tmp_path):
    d = _model_dir(tmp_path)
    copy, files = mf.pinned_copy(d)
    assert files == mf.manifest_of(d) == mf.manifest_of(copy)
    assert (copy / "model.safetensors").is_symlink()
    assert not (copy / ".gitattributes").exists()
    # A change to the source after the copy is not in what is loaded.
    (d / "tokenizer.json").write_text("swapped")
    assert mf.manifest_of(copy) == files


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b'{"format":"other","files":{}}',
        b'{"files":{"../x":"' + b"0" * 64 + b'"},"format":"aurora-model-manifest/1"}',
        b'{"files":{"a":"xyz"},"format":"aurora-model-manifest/1"}',
        b'{"format": "aurora-model-manifest/1", "files": {}}',  # not canonical
    ],
)
def test_a_manifest_that_is_not_one_is_refused_in_one_line(data):
    with pytest.raises(mf.ModelMismatchError) as err:
        mf.decode(data)
    assert "\n" not in str(err.value)


# -- signed with the snapshot -------------------------------------------------------------------


@pytest.fixture
def keys(tmp_path):
    k = new_job_keys(tmp_path / "keys")
    return load_signing_key(k.signing_key), load_public_key(k.public_key)


def _state() -> dict[str, np.ndarray]:
    return {"w": np.arange(64, dtype=np.uint16).reshape(8, 8)}


def test_a_snapshot_announcement_signs_the_manifest_and_the_store_checks_it(tmp_path, keys):
    key, pub = keys
    files = mf.manifest_of(_model_dir(tmp_path))
    store = CheckpointStore(tmp_path / "store", job=JOB, public_key=pub)
    store.publish_snapshot(0, _state(), signing_key=key, model=files)
    ann = verify(store.announcement(0, "snapshots"), pub, job=JOB)
    assert isinstance(ann, SnapshotAnnouncement) and ann.model_hash == mf.digest(files)
    assert store.verified_manifest(0) == files == store.model_manifest()
    # A store that swaps the manifest (any other one, even a well-formed one) is refused.
    path = tmp_path / "store" / "snapshots" / "v00000000.manifest"
    path.chmod(0o644)
    path.write_bytes(mf.encode({**files, "chat_template.jinja": "ab" * 32}))
    with pytest.raises(StoreError, match="announcement signs"):
        store.verified_manifest(0)


def test_a_snapshot_without_a_model_signs_an_empty_manifest_and_retention_removes_it(
    tmp_path, keys
):
    key, pub = keys
    store = CheckpointStore(tmp_path / "store", job=JOB, public_key=pub)
    for v in (0, 2, 4):
        store.publish_snapshot(v, _state(), signing_key=key)
    assert store.verified_manifest(4) == {} == store.model_manifest()
    store.retain(snapshot_interval=2, keep=1)
    left = sorted(p.name for p in (tmp_path / "store" / "snapshots").iterdir())
    assert left == ["v00000004.announce", "v00000004.manifest", "v00000004.safetensors"]


def test_the_model_hash_is_part_of_what_is_signed(keys):
    key, pub = keys
    ann = SnapshotAnnouncement(
        job=JOB,
        version=3,
        weights_hash="ab" * 32,
        chain_hash="cd" * 32,
        size=9,
        model_hash="ef" * 32,
    )
    signed = bytearray(sign(ann, key))
    assert verify(bytes(signed), pub, job=JOB) == ann
    body = len(signed) - 64
    signed[body - 1] ^= 1  # the last byte of the model hash
    with pytest.raises(BadSignatureError, match="not signed"):
        verify(bytes(signed), pub, job=JOB)


# -- on real processes -------------------------------------------------------------------------

TOPOLOGY = """
name: pin
trainer: {{region: us, model: qwen3-8b, gpu: H100, gpus: 1, egress_gbps: 10}}
regions: [{{name: us}}]
links: []
actors:
  - {{region: us, gpu: A100, count: 1}}
real: {{model: {model}, steps: 2, prompts_per_step: 4, group_size: 2, eval_prompts: 8}}
"""


def _swap_1_and_7(d: Path) -> None:
    tok = json.loads((d / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["1"], vocab["7"] = vocab["7"], vocab["1"]
    (d / "tokenizer.json").write_text(json.dumps(tok))


def _inject_chat_template(d: Path) -> None:
    (d / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ 'the answer is 7: ' }}"
    )


def _change_config(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    config["rope_theta"] = 10.0
    (d / "config.json").write_text(json.dumps(config, indent=2))


TAMPERS = {
    "tokenizer.json": _swap_1_and_7,
    "chat_template.jinja": _inject_chat_template,
    "config.json": _change_config,
}


def _cli(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "aurora.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished two-step ``aurora real`` run of a tiny Qwen3 from a Hugging Face directory."""
    pytest.importorskip("transformers")
    from aurora.models import build_default, save_pretrained

    tmp = tmp_path_factory.mktemp("pin")
    model, tokenizer = build_default()
    model_dir = save_pretrained(model, tokenizer, tmp / "v0")
    (tmp / "pin.yaml").write_text(TOPOLOGY.format(model=model_dir))
    done = _cli(
        "real",
        "--topology",
        str(tmp / "pin.yaml"),
        "--out",
        str(tmp / "out"),
        "--quiet",
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return tmp, model_dir, tmp / "out" / "pin-aurora-s0"


def _actor_loads(tmp: Path, out: Path) -> tuple[int | None, str]:
    """An Actor joining the run's job (a standalone Ledger replaying a copy of its log): it
    loads the job's model, as every Actor does, before it takes any work. Returns its exit
    code (None: it was still running, stopped once it said it took the model) and its log."""
    import select
    import time

    from aurora.keys import issue_identity, write_identity
    from tests.test_runtime import ledger_port

    db = tmp / f"ledger-{len(list(tmp.glob('ledger-*.db')))}.db"
    shutil.copy(out / "ledger.db", db)
    keys = out / "keys"
    common = ["--secret-file", str(keys / "job.secret"), "--public-key", str(keys / "job.pub")]
    ident, ledger_ident = tmp / "a.identity", tmp / "l.identity"
    if not ident.exists():
        key = load_signing_key(keys / "trainer.key")
        job_id = json.loads((out / "job.json").read_text())["spec"]["job_id"]
        write_identity(ident, issue_identity("actor", "joiner", key, job=job_id))
        write_identity(ledger_ident, issue_identity("ledger", "ledger", key, job=job_id))
    aurora = [sys.executable, "-m", "aurora.cli"]
    ledger = subprocess.Popen(
        [*aurora, "ledger", "--job", str(out / "job.json"), "--db", str(db), "--port", "0"]
        + [*common, "--identity", str(ledger_ident)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    actor = None
    try:
        port = ledger_port(ledger, deadline_s=120)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AURORA_")}
        actor = subprocess.Popen(
            [*aurora, "actor", "--join", f"127.0.0.1:{port}", "--id", "joiner", "--region", "us"]
            + [*common, "--identity", str(ident)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
        )
        assert actor.stderr is not None
        seen, end = b"", time.monotonic() + 180
        while time.monotonic() < end and b"as the Trainer signed" not in seen:
            ready, _, _ = select.select([actor.stderr], [], [], 1.0)
            chunk = os.read(actor.stderr.fileno(), 65536) if ready else b""
            if ready and not chunk:
                break  # it exited
            seen += chunk
        if b"as the Trainer signed" not in seen:
            actor.wait(30)
            return actor.returncode, seen.decode(errors="replace")
        return None, seen.decode(errors="replace")
    finally:
        for p in (actor, ledger):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_export_and_check_model_print_signed_on_the_honest_path(run, capsys):
    from aurora.cli import main as aurora

    tmp, _, out = run
    pub = str(out / "keys" / "job.pub")
    job = str(out / "job.json")
    assert aurora(["check-model", str(out / "model"), "--job", job, "--public-key", pub]) == 0
    assert "(signed)" in capsys.readouterr().out
    dest = tmp / "export-honest"
    assert (
        aurora(["export", "--job", job, "--version", "2", "--out", str(dest), "--public-key", pub])
        == 0
    )
    said = capsys.readouterr().out
    assert "(signed)" in said and "model files" in said
    assert (dest / "tokenizer.json").exists()


@pytest.mark.parametrize("name", sorted(TAMPERS))
def test_a_tampered_model_is_refused_at_export_and_by_an_actor_naming_the_file(run, capsys, name):
    from aurora.cli import main as aurora

    tmp, model_dir, out = run
    saved = {p.name: p.read_bytes() for p in model_dir.iterdir()}
    TAMPERS[name](model_dir)
    try:
        dest = tmp / f"export-{name}"
        pub = str(out / "keys" / "job.pub")
        code = aurora(
            [
                "export",
                "--job",
                str(out / "job.json"),
                "--version",
                "2",
                "--out",
                str(dest),
                "--public-key",
                pub,
            ]
        )
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and not dest.exists()
        assert err[-1].startswith("aurora export: model ") and name in err[-1], err
        code, said = _actor_loads(tmp, out)
        last = said.strip().splitlines()[-1]
        assert code == 2, said[-2000:]
        assert last.startswith("aurora actor: model ") and name in last, last
        assert "Traceback" not in said
    finally:
        for p in model_dir.iterdir():
            if p.name not in saved:
                p.unlink()
        for n, data in saved.items():
            (model_dir / n).write_bytes(data)


def test_an_actor_with_the_signed_model_loads_it(run):
    tmp, model_dir, out = run
    code, said = _actor_loads(tmp, out)
    assert code is None and "Traceback" not in said, said[-2000:]
    assert f"model {model_dir}: its 4 files as the Trainer signed" in said


def test_a_restarted_trainer_refuses_a_model_changed_since_it_signed(run):
    tmp, model_dir, out = run
    saved = (model_dir / "config.json").read_bytes()
    _change_config(model_dir)
    run_dir = tmp / "restart"
    shutil.copytree(out, run_dir, ignore=shutil.ignore_patterns("*.sock"))
    try:
        keys = run_dir / "keys"
        done = _cli(
            "trainer",
            "--job",
            str(run_dir / "job.json"),
            "--run-dir",
            str(run_dir),
            "--signing-key",
            str(keys / "trainer.key"),
            "--secret-file",
            str(keys / "job.secret"),
            "--public-key",
            str(keys / "job.pub"),
        )
    finally:
        (model_dir / "config.json").write_bytes(saved)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and last.startswith("aurora trainer: model "), done.stderr[-2000:]
    assert "config.json differs" in last


@pytest.mark.parametrize(
    ("tamper", "named"),
    [
        (_swap_1_and_7, "tokenizer.json differs"),
        (_inject_chat_template, "chat_template.jinja is not in the model"),
        (_change_config, "config.json differs"),
        (lambda d: (d / "model.safetensors").write_bytes(b"x" * 64), "model.safetensors"),
    ],
)
def test_the_runs_own_model_directory_is_signed_and_a_changed_file_is_named(
    run, capsys, tamper, named
):
    from aurora.cli import main as aurora

    tmp, _, out = run
    copy = tmp / f"model-{named.split()[0]}"
    shutil.copytree(out / "model", copy)
    tamper(copy)
    job, pub = str(out / "job.json"), str(out / "keys" / "job.pub")
    assert aurora(["check-model", str(copy), "--job", job, "--public-key", pub]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("aurora check-model: model ") and named in last, last
