"""The trust root without sockets: signed announcements, the job's key files, and a reassembler
that expects exactly what was announced."""

from __future__ import annotations

import json
import os
import stat
import struct
import subprocess
import sys

import numpy as np
import pytest

from aurora.delta import DeltaEncoder, Reassembler, Segment, leaf_hash, weights_hash
from aurora.delta.announce import (
    BadSignatureError,
    MalformedAnnouncementError,
    SnapshotAnnouncement,
    VersionAnnouncement,
    WrongJobError,
    describe_delta,
    describe_parts,
    public_key_of,
    sign,
    verify,
)
from aurora.delta.errors import CorruptError, DeltaError, ForeignSegmentError
from aurora.delta.reader import read_delta, segments_of
from aurora.delta.reassembly import BudgetError

KEY = bytes(range(32))
PUB = public_key_of(KEY)
JOB = "unit-job"


def _delta(seed: int = 0, segment_size: int = 1024) -> bytes:
    rng = np.random.default_rng(seed)
    old = {"w": rng.integers(0, 2**16, 20_000, dtype=np.uint16)}
    new = {"w": old["w"] ^ (rng.random(20_000) < 0.3).astype(np.uint16)}
    enc = DeltaEncoder(
        old, new, model="m", version=1, base_hash=weights_hash(old), segment_size=segment_size
    )
    return b"".join(s.data for s in enc.segments())


DATA = _delta()
ANN = describe_delta(JOB, DATA)


# ---- announcements ---------------------------------------------------------------------------


def test_an_announcement_round_trips_and_describes_the_delta_exactly():
    d = read_delta(DATA)
    segs = segments_of(DATA)
    assert describe_parts(JOB, segs[0].data, segs[-1].data) == ANN
    assert (ANN.delta_id, ANN.weights_hash, ANN.size) == (d.id, d.weights_hash, len(DATA))
    assert ANN.key == segs[0].key and ANN.segments == len(segs) - 1
    assert [ANN.segment_range(s.seq) for s in segs] == [(s.offset, len(s.data)) for s in segs]
    signed = sign(ANN, KEY)
    assert verify(signed, PUB, job=JOB) == ANN
    assert sign(ANN, KEY) == signed  # Ed25519 is deterministic: one announcement, one byte string
    snap = SnapshotAnnouncement(
        job=JOB,
        version=4,
        weights_hash="ab" * 32,
        chain_hash="cd" * 32,
        size=10,
        model_hash="ef" * 32,
    )
    assert verify(sign(snap, KEY), PUB, job=JOB) == snap


def test_a_wrong_key_job_or_field_is_refused_with_a_typed_one_line_reason():
    signed = sign(ANN, KEY)
    cases = [
        (sign(ANN, bytes(32)), BadSignatureError, "not signed by this job's Trainer key"),
        (
            sign(VersionAnnouncement(**{**ANN.__dict__, "job": "other"}), KEY),
            WrongJobError,
            "for job 'other'",
        ),
        (signed[:70] + bytes([signed[70] ^ 1]) + signed[71:], BadSignatureError, "not signed"),
        (signed[:-1], MalformedAnnouncementError, "not signed|announcement"),
        (b"XXXXXXXX" + signed[8:], MalformedAnnouncementError, "bad magic"),
        (signed + b"\0", MalformedAnnouncementError, "announcement"),
        (b"", MalformedAnnouncementError, "of 0 bytes"),
        (b"\0" * 4096, MalformedAnnouncementError, "of 4096 bytes"),
    ]
    for data, error, text in cases:
        with pytest.raises(error, match=text) as info:
            verify(data, PUB, job=JOB)
        assert str(info.value) and "\n" not in str(info.value)
        assert isinstance(info.value, DeltaError)


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("base", 5, "from v-1 to v"),
        ("weights_hash", "00" * 32, "weights_hash is not H"),
        ("size", 10, "do not describe a delta file"),
        ("segments", 3, "do not describe a delta file"),
        ("segment_size", 100, "do not describe a delta file"),
        ("delta_id", "zz" * 32, "not hex"),
        ("key", "ab", "32 hex"),
        ("job", "has space", "printable ASCII"),
        ("version", -1, "integer in"),
    ],
)
def test_an_announcement_that_does_not_describe_a_delta_cannot_even_be_made(field, value, why):
    with pytest.raises(MalformedAnnouncementError, match=why):
        VersionAnnouncement(**{**ANN.__dict__, field: value})


# ---- key files -------------------------------------------------------------------------------


def test_keys_new_writes_a_private_key_and_secret_only_the_owner_reads(tmp_path, capsys):
    from aurora.keys import load_job_secret, load_public_key, load_signing_key, new_job_keys

    files = new_job_keys(tmp_path / "keys")
    assert stat.S_IMODE(files.signing_key.stat().st_mode) == 0o600
    assert stat.S_IMODE(files.secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(files.public_key.stat().st_mode) == 0o644
    key, pub = load_signing_key(files.signing_key), load_public_key(files.public_key)
    assert public_key_of(key) == pub and len(load_job_secret(files.secret)) == 32
    signed = sign(ANN, key)
    assert verify(signed, pub, job=JOB) == ANN
    from aurora.keys import KeyFileError

    with pytest.raises(KeyFileError, match="exists already"):
        new_job_keys(tmp_path / "keys")


def test_keys_new_force_refuses_a_symbolic_link_planted_where_a_key_goes(tmp_path):
    """``--force`` where someone planted ``trainer.key`` as a link: the private key must not be
    written through it (the target is neither truncated nor replaced)."""
    from aurora.keys import KeyFileError, new_job_keys

    out = tmp_path / "keys"
    out.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"the attacker wants the key here")
    victim.chmod(0o644)
    (out / "trainer.key").symlink_to(victim)
    with pytest.raises(KeyFileError, match="symbolic link"):
        new_job_keys(out, force=True)
    assert victim.read_bytes() == b"the attacker wants the key here"
    assert (out / "trainer.key").is_symlink()


def test_keys_load_from_an_environment_variable_never_the_command_line(tmp_path, monkeypatch):
    from aurora.keys import (
        ENV_PUBLIC_KEY,
        ENV_SECRET,
        ENV_SIGNING_KEY,
        load_job_secret,
        load_public_key,
        load_signing_key,
        new_job_keys,
    )

    files = new_job_keys(tmp_path)
    monkeypatch.setenv(ENV_SIGNING_KEY, files.signing_key.read_text())
    monkeypatch.setenv(ENV_PUBLIC_KEY, PUB.hex())
    monkeypatch.setenv(ENV_SECRET, files.secret.read_text())
    assert load_signing_key() == load_signing_key(files.signing_key)
    assert load_public_key() == PUB
    assert load_job_secret() == load_job_secret(files.secret)


def test_a_missing_unreadable_or_wrong_key_gives_one_line_naming_it(tmp_path, monkeypatch):
    from aurora.keys import (
        ENV_PUBLIC_KEY,
        KeyFileError,
        load_job_secret,
        load_public_key,
        load_signing_key,
    )

    rsa = tmp_path / "rsa.pem"
    subprocess.run(
        [
            "openssl",
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:1024",
            "-out",
            str(rsa),
        ],
        check=True,
        capture_output=True,
    )
    (tmp_path / "junk").write_text("hello\n")
    (tmp_path / "short").write_text("abcd\n")
    monkeypatch.delenv(ENV_PUBLIC_KEY, raising=False)
    cases = [
        (lambda: load_signing_key(tmp_path / "nope.key"), "nope.key: no such file"),
        (lambda: load_signing_key(tmp_path), "is a directory"),
        (lambda: load_signing_key(rsa), "not an Ed25519 private key"),
        (lambda: load_signing_key(tmp_path / "junk"), "junk: not a"),
        (lambda: load_public_key(), f"set the environment variable {ENV_PUBLIC_KEY}"),
        (lambda: load_job_secret(tmp_path / "short"), "at least 16 needed"),
        (lambda: load_job_secret(tmp_path / "junk"), "must be hex"),
    ]
    for call, text in cases:
        with pytest.raises(KeyFileError, match=text) as info:
            call()
        assert "\n" not in str(info.value)


def test_the_keys_command_writes_the_three_files(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "aurora.keys", "keys", "new", "--out", str(tmp_path / "k")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert out.returncode == 0, out.stderr
    assert "fingerprint ed25519:" in out.stdout
    assert sorted(p.name for p in (tmp_path / "k").iterdir()) == [
        "job.pub",
        "job.secret",
        "trainer.key",
    ]
    again = subprocess.run(
        [sys.executable, "-m", "aurora.keys", "keys", "new", "--out", str(tmp_path / "k")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert again.returncode != 0 and "exists already" in again.stderr
    assert "Traceback" not in again.stderr


# ---- a reassembler that expects the announced delta -------------------------------------------


def test_an_expecting_reassembler_refuses_everything_off_the_announced_grid():
    segs = segments_of(DATA)
    ra = Reassembler(expected=ANN)
    other = segments_of(_delta(seed=1))
    assert ra.refutes(other[0].key, 0, 0, 1024, False) is not None  # another delta
    assert ra.slot(ANN.key, 1, 1000, 1024, False) is None  # off the grid
    assert ra.slot(ANN.key, 999, 999 * 1024, 1024, False) is None  # no such segment
    assert "is not where" in ra.refutes(ANN.key, ANN.segments, 0, 1 << 40, True)
    with pytest.raises(CorruptError, match="is not where"):
        ra.add(Segment(ANN.key, 1, 1000, bytes(1024), leaf_hash(bytes(1024)).hex()))
    trailer_slot = ra.slot(ANN.key, ANN.segments, *ANN.segment_range(ANN.segments), True)
    assert trailer_slot is not None and len(trailer_slot) == len(segs[-1].data)
    assert ra.slot(ANN.key, ANN.segments, *ANN.segment_range(ANN.segments), True) is None
    trailer_slot[:] = segs[-1].data
    ra.add(Segment(ANN.key, ANN.segments, segs[-1].offset, trailer_slot, segs[-1].checksum, True))
    for s in segs[:-1]:
        ra.add(s)
    assert ra.result().id == ANN.delta_id
    assert ra.held_bytes == ANN.payload_bytes


def test_a_forged_trailer_of_the_announced_length_is_refused_and_leaves_no_trace():
    forged = segments_of(_delta(seed=2))[-1]
    ra = Reassembler(expected=ANN)
    fake = Segment(ANN.key, ANN.segments, ANN.payload_bytes, forged.data, forged.checksum, True)
    with pytest.raises(CorruptError, match="not the announced one|do not add up|is not where"):
        ra.add(fake)
    assert ra.missing() == list(range(ANN.segments)) or ra.missing() == [-1]
    for s in segments_of(DATA):
        ra.add(s)
    assert ra.result().id == ANN.delta_id


def test_before_the_announcement_a_reassembler_takes_only_its_budget_in_pages():
    ra = Reassembler(budget=3 * 4096)
    junk = bytes(10)
    # Ten bytes in each of three pages use the budget up: memory is charged in pages.
    for i in range(3):
        assert ra.slot("k" * 32, i, i * 4096, 10, False) is not None
    assert ra.slot("k" * 32, 3, 3 * 4096, 10, False) is None
    with pytest.raises(BudgetError):
        ra.add(Segment("k" * 32, 4, 5 * 4096, junk, leaf_hash(junk).hex()))
    assert ra.charged == 3 * 4096


def test_the_announcement_drops_what_it_does_not_describe():
    segs = segments_of(DATA)
    ra = Reassembler(key=ANN.key, budget=1 << 20)
    junk = bytes(700)
    ra.add(segs[2])
    ra.add(Segment(ANN.key, 7, 50_000, junk, leaf_hash(junk).hex()))  # off the grid
    assert ra.expect(ANN) == [7]
    assert ra.holds(2) and not ra.holds(7)
    foreign = Reassembler(budget=1 << 20)
    foreign.add(segments_of(_delta(seed=3))[0])
    with pytest.raises(ForeignSegmentError):
        foreign.expect(ANN)


def test_a_deeply_nested_header_is_a_corrupt_delta_not_a_recursion_error():
    nested = b"[" * 30_000 + b"]" * 30_000
    data = b"AURDELTA" + struct.pack("<HI", 2, len(nested)) + nested
    with pytest.raises(CorruptError, match="nested too deeply"):
        read_delta(data)
    big = json.dumps({"x": "y" * (70 << 10)}).encode()
    with pytest.raises(CorruptError, match="exceeds"):
        read_delta(b"AURDELTA" + struct.pack("<HI", 2, len(big)) + big)


# ---- which source next ------------------------------------------------------------------------


def _choice(n=3, attempts=2):
    from aurora.transport.sources import SourceChoice

    return SourceChoice(
        [f"s{i}:1" for i in range(n)], attempts=attempts, backoff_s=0.5, max_backoff_s=2.0
    )


def test_a_refuted_source_is_never_used_again_for_that_version_and_the_refusal_names_all():
    c = _choice()
    c.connected(0)
    assert c.refute(7, 0, "a forged trailer") and not c.refute(7, 0, "again")
    assert c.next([7]) == 1 and c.usable(8, 0)  # other versions may still use it
    c.connected(1)
    c.left(1, [7], "no progress")
    c.left(1, [7], "no progress")
    assert c.next([7]) == 2
    c.unreachable(2, [7], "connection refused", now=0.0)
    assert c.refusal(7) is None  # s2 has one try left
    c.unreachable(2, [7], "connection refused", now=0.0)
    assert c.next([7]) is None
    assert c.refusal(7) == (
        "no source can complete it: s0:1 sent a forged trailer; s1:1 failed 2 tries (last: no "
        "progress); s2:1 failed 2 tries (last: connection refused)"
    )
    c.forget(7)
    assert c.refusal(7) is None and c.next([7]) is not None


def test_a_source_that_keeps_failing_is_tried_last_until_it_completes_a_version():
    c = _choice()
    c.connected(0)
    c.left(0, [1], "no progress")
    assert c.next([1]) == 1
    c.connected(1)
    c.done(1, source=1)
    c.left(1, [2], "lost")  # s1 had a good run, then one strike; s0 still has its strike
    assert c.strikes == [1, 1, 0] and c.next([2]) == 2
    c.done(2, source=0)
    assert c.strikes[0] == 0


def test_rounds_that_reach_no_source_back_off_exponentially_and_progress_resets_it():
    c = _choice(n=2, attempts=9)
    delays = []
    for r in range(4):
        c.unreachable(0, [], "refused", now=10.0 * r)
        c.unreachable(1, [], "refused", now=10.0 * r)
        delays.append(c.delay())
    assert delays == [0.5, 1.0, 2.0, 2.0]
    assert not c.ready(30.0 + 1.9) and c.ready(32.0)
    c.progressed()
    assert c.delay() == 0 and c.ready(0.0)


def test_an_unknown_source_is_refused_and_changes_nothing():
    c = _choice()
    before = (list(c.strikes), c.current, dict(c._versions))
    for call in (
        lambda: c.refute(1, 5, "x"),
        lambda: c.left(-1, [1], "x"),
        lambda: c.connected(3),
        lambda: c.done(1, source=True),
    ):
        with pytest.raises(ValueError, match="source"):
            call()
    assert (list(c.strikes), c.current, dict(c._versions)) == before


def test_a_transport_config_needs_the_job_and_its_public_key_and_names_a_bad_field():
    from aurora.runtime.publisher import TrainerNode
    from aurora.transport import TransportConfig

    with pytest.raises(TypeError, match="job"):
        TransportConfig(secret=b"s" * 16, public_key=PUB)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="TransportConfig.public_key must be 32 raw bytes"):
        TransportConfig(secret=b"s" * 16, job=JOB, public_key=b"short")
    with pytest.raises(ValueError, match="TransportConfig.progress_s must be > 0"):
        TransportConfig(secret=b"s" * 16, job=JOB, public_key=PUB, progress_s=0)
    with pytest.raises(ValueError, match="signing key does not match"):
        TrainerNode(
            "t", TransportConfig(secret=b"s" * 16, job=JOB, public_key=PUB), signing_key=bytes(32)
        )


# ---- job ids ---------------------------------------------------------------------------------


def test_two_jobs_of_the_same_topology_strategy_and_seed_get_different_ids():
    """Deterministic ids let one run's signed announcements verify in the next run that reuses
    the keys; the nonce makes every job its own scope."""
    from aurora.runtime.job import make_spec
    from aurora.topology import load_topology

    topo = load_topology("examples/geo.yaml")
    ids = {
        make_spec(topo, strategy="aurora", seed=0, steps=2, store="s", backend="standin").job_id
        for _ in range(2)
    }
    assert len(ids) == 2
    signed = sign(VersionAnnouncement(**{**ANN.__dict__, "job": min(ids)}), KEY)
    with pytest.raises(WrongJobError):
        verify(signed, PUB, job=max(ids))


def test_a_trainer_restarted_from_the_topology_keeps_its_job_id(tmp_path):
    import argparse

    from aurora.runtime.cli import _load_job

    args = argparse.Namespace(
        job=None,
        topology="examples/geo.yaml",
        strategy="aurora",
        seed=0,
        steps=2,
        store=None,
        backend="standin",
        run_dir=str(tmp_path / "trainer"),
    )
    first = _load_job(argparse.Namespace(**vars(args)), keep=True)
    again = _load_job(argparse.Namespace(**vars(args)), keep=True)
    assert first.job_id == again.job_id
    assert (tmp_path / "trainer" / "job.json").exists()
