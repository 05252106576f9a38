"""The Checkpoint Store: atomic immutable publish, verified reads, ranges, retention, names."""

from __future__ import annotations

import numpy as np
import pytest

from aurora.delta import DeltaEncoder, apply_chain, weights_hash
from aurora.delta.errors import DeltaError
from aurora.policy.versions import plan_catch_up
from aurora.store import CheckpointStore, PathOutsideRootError, StoreError, UnknownVersionError

SHAPES = {"model.layers.0.mlp.down_proj.weight": (64, 48), "model.norm.weight": (48,)}


def _weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.integers(0, 2**16, size=s, dtype=np.uint16) for k, s in SHAPES.items()}


def _chain(n: int):
    """v0 weights and D_1..D_n as bytes, each changing a few weights."""
    states = [_weights(0)]
    rng = np.random.default_rng(1)
    for _ in range(n):
        new = {k: v.copy() for k, v in states[-1].items()}
        for v in new.values():
            flat = v.reshape(-1)
            flat[rng.choice(flat.size, 5, replace=False)] ^= 0x0101
        states.append(new)
    deltas, h = [], weights_hash(states[0])
    for v in range(1, n + 1):
        enc = DeltaEncoder(states[v - 1], states[v], model="toy", version=v, base_hash=h)
        deltas.append(b"".join(s.data for s in enc.segments()))
        h = enc.weights_hash
    return states, deltas


@pytest.fixture(params=["dir", "memory"])
def store(request, tmp_path):
    if request.param == "dir":
        return CheckpointStore(tmp_path / "store")
    return CheckpointStore(f"memory://store-{id(request)}")


def test_a_published_chain_is_listed_fetched_and_applies_bit_exactly(store):
    states, deltas = _chain(3)
    h0 = store.publish_snapshot(0, states[0])
    for data in deltas:
        store.publish_delta(data)
    listing = store.list()
    assert listing.deltas == (1, 2, 3) and listing.snapshots == (0,)
    state, h = store.snapshot(0)
    assert h == h0
    h3 = apply_chain(store.chain(1, 3), state, active_version=0, active_hash=h0)
    assert weights_hash(state) == weights_hash(states[3])
    assert h3 == store.delta(3).weights_hash


def test_sizes_feed_the_catch_up_planner(store):
    states, deltas = _chain(2)
    store.publish_snapshot(0, states[0])
    for data in deltas:
        store.publish_delta(data)
    delta_sizes, snaps = store.sizes()
    assert delta_sizes == {1: len(deltas[0]), 2: len(deltas[1])}
    plan = plan_catch_up(None, 2, delta_sizes, snaps)
    assert plan.snapshot == 0 and plan.deltas == (1, 2)
    # One stored piece's size without a listing (what the Trainer asks per announcement).
    assert store.size_of("delta", 2) == len(deltas[1]) and store.size_of("delta", 3) is None
    assert store.size_of("snapshot", 0) == snaps[0] and store.size_of("snapshot", 1) is None
    with pytest.raises(StoreError, match="kind"):
        store.size_of("announce", 1)


def test_artifacts_are_immutable(store):
    states, deltas = _chain(1)
    store.publish_delta(deltas[0])
    store.publish_delta(deltas[0])  # the same bytes again: a no-op
    store.publish_snapshot(0, states[0])
    with pytest.raises(StoreError, match="already exists with different content"):
        store.publish_snapshot(0, states[1])


def test_a_corrupt_delta_is_refused_and_nothing_is_stored(store):
    _, deltas = _chain(1)
    bad = bytearray(deltas[0])
    bad[len(bad) // 2] ^= 0xFF
    with pytest.raises(DeltaError):
        store.publish_delta(bytes(bad))
    assert store.list().deltas == ()


def test_unknown_versions_and_broken_ranges_are_refused(store):
    _, deltas = _chain(3)
    store.publish_delta(deltas[0])
    store.publish_delta(deltas[2])
    with pytest.raises(UnknownVersionError, match="delta D_7 is not in the store"):
        store.delta(7)
    with pytest.raises(UnknownVersionError, match=r"deltas \[2\] of the range 1..3"):
        store.chain(1, 3)
    with pytest.raises(UnknownVersionError):
        store.snapshot(0)


@pytest.mark.parametrize(
    "name",
    [
        "../secret",
        "deltas/../../etc/passwd",
        "/etc/passwd",
        "deltas/v1.delta",
        "snapshots/v00000001.safetensors/../../x",
        "deltas/v00000001.delta\x00",
        "",
    ],
)
def test_a_name_outside_the_root_is_refused(store, name):
    with pytest.raises(PathOutsideRootError, match="nothing outside the store root"):
        store.resolve(name)


def test_a_tampered_snapshot_is_refused(tmp_path):
    store = CheckpointStore(tmp_path)
    states, _ = _chain(0)
    store.publish_snapshot(0, states[0])
    path = tmp_path / "snapshots" / "v00000000.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="does not match its metadata"):
        store.snapshot(0)


def test_retention_keeps_periodic_snapshots_and_the_chain_after_the_oldest(tmp_path):
    store = CheckpointStore(tmp_path)
    states, deltas = _chain(6)
    for v in (0, 2, 3, 4, 6):
        store.publish_snapshot(v, states[v])
    for data in deltas:
        store.publish_delta(data)
    deleted = store.retain(snapshot_interval=2, keep=2)
    listing = store.list()
    assert listing.snapshots == (4, 6)
    assert listing.deltas == (5, 6)
    assert "snapshots/v00000003.safetensors" in deleted


def test_snapshots_are_safetensors_that_torch_reads_as_bfloat16(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    store = CheckpointStore(tmp_path)
    states, _ = _chain(0)
    store.publish_snapshot(0, states[0])
    loaded = load_file(tmp_path / "snapshots" / "v00000000.safetensors")
    for name, bits in states[0].items():
        assert loaded[name].dtype == torch.bfloat16
        assert np.array_equal(loaded[name].view(torch.uint16).numpy(), bits)


# ---- trust: exclusive publish, strict names, crashed publishers, signed announcements -------

KEY = bytes(range(32))
JOB = "store-job"


def _signed_store(path):
    from aurora.delta.announce import public_key_of

    return CheckpointStore(path, job=JOB, public_key=public_key_of(KEY))


def test_of_concurrent_publishers_of_one_version_exactly_one_wins(tmp_path):
    import threading

    from aurora.store.files import write_exclusive

    _, deltas = _chain(1)
    variants = [deltas[0]] + [bytes(b) for b in (bytearray(deltas[0]) for _ in range(7))]
    for i, v in enumerate(variants[1:], 1):  # same name, other bytes (a torn copy would do)
        variants[i] = v[:-1] + bytes([v[-1] ^ i])
    path = tmp_path / "v00000001.delta"
    results = [None] * len(variants)
    start = threading.Barrier(len(variants))

    def publish(i):
        start.wait()
        try:
            results[i] = write_exclusive(path, variants[i])
        except FileExistsError:
            results[i] = "refused"

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(len(variants))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    winners = [i for i, r in enumerate(results) if r is True]
    assert len(winners) == 1 and results.count("refused") == len(variants) - 1
    assert path.read_bytes() == variants[winners[0]]
    assert write_exclusive(path, variants[winners[0]]) is False  # the same bytes: a no-op
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left


def test_a_second_publisher_of_other_bytes_gets_a_clear_error_and_the_first_stays(tmp_path):
    states, deltas = _chain(1)
    a, b = CheckpointStore(tmp_path), CheckpointStore(tmp_path)  # two publishers, one store
    a.publish_snapshot(0, states[0])
    with pytest.raises(StoreError, match="snapshots/v00000000.safetensors already exists"):
        b.publish_snapshot(0, states[1])
    assert a.snapshot(0)[1] == weights_hash(states[0])


@pytest.mark.parametrize(
    "name",
    [
        "deltas/v00000001.delta\n",
        "deltas/v0000000\u0661.delta",  # an Arabic-Indic digit matches \d, not [0-9]
        "deltas/v00000001.delta/",
        "deltas/v00000001.announce\n",
        "snapshots/v00000001.delta",
    ],
)
def test_names_with_a_trailing_newline_or_non_ascii_digits_are_refused(store, name):
    with pytest.raises(PathOutsideRootError):
        store.resolve(name)


def test_a_symbolic_link_under_the_root_cannot_lead_out_of_it(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "v00000001.delta").write_bytes(b"secret")
    store = CheckpointStore(tmp_path / "store")
    (tmp_path / "store" / "deltas" / "v00000002.delta").symlink_to(outside / "v00000001.delta")
    with pytest.raises(PathOutsideRootError, match="symbolic link"):
        store.delta_bytes(2)
    (tmp_path / "store" / "snapshots").rmdir()
    (tmp_path / "store" / "snapshots").symlink_to(outside)
    with pytest.raises(PathOutsideRootError, match="symbolic link"):
        store.resolve("snapshots/v00000001.safetensors")


def test_temp_files_of_a_killed_publisher_are_removed_when_the_store_is_opened(tmp_path):
    import os
    import subprocess
    import sys

    from aurora.store.files import _host

    CheckpointStore(tmp_path)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    crashed = tmp_path / "deltas" / f".v00000001.delta.tmp.{_host()}.{dead.stdout.strip()}.x1"
    crashed.write_bytes(b"half a delta")
    live = tmp_path / "deltas" / f".v00000002.delta.tmp.{_host()}.{os.getpid()}.x2"
    live.write_bytes(b"being written")
    store = CheckpointStore(tmp_path)
    assert store.cleaned == [f"deltas/{crashed.name}"]
    assert not crashed.exists() and live.exists()  # a live writer's file is left alone


def test_a_joiner_verifies_snapshot_and_chain_from_an_untrusted_store(tmp_path):
    states, deltas = _chain(3)
    trainer = _signed_store(tmp_path)
    h0 = trainer.publish_snapshot(0, states[0], signing_key=KEY)
    for data in deltas[:2]:
        trainer.publish_delta(data, signing_key=KEY)
    h2 = trainer.delta(2).weights_hash
    trainer.publish_snapshot(2, states[2], chain_hash=h2, signing_key=KEY)
    trainer.publish_delta(deltas[2], signing_key=KEY)
    joiner = _signed_store(tmp_path)  # e.g. a mirror: nothing in it is believed unchecked
    state, snap = joiner.verified_snapshot(2)
    assert snap.chain_hash == h2 and snap.weights_hash == weights_hash(states[2])
    d3, ann3 = joiner.verified_delta(3)
    h3 = apply_chain([d3], state, active_version=2, active_hash=snap.chain_hash)
    assert h3 == ann3.weights_hash and weights_hash(state) == weights_hash(states[3])
    assert joiner.verified_snapshot(0)[1].chain_hash == h0


def test_a_mirror_that_swaps_an_artifact_or_its_announcement_is_caught(tmp_path):
    from aurora.delta.announce import describe_delta, sign

    states, deltas = _chain(2)
    trainer = _signed_store(tmp_path / "honest")
    trainer.publish_snapshot(0, states[0], signing_key=KEY)
    trainer.publish_delta(deltas[0], signing_key=KEY)
    # The mirror holds a valid delta for v1 that the Trainer never announced ...
    other = _chain_from(states[0], seed=9)
    mirror = tmp_path / "mirror"
    (mirror / "deltas").mkdir(parents=True)
    (mirror / "snapshots").mkdir()
    (mirror / "deltas" / "v00000001.delta").write_bytes(other)
    (mirror / "deltas" / "v00000001.announce").write_bytes(trainer.announcement(1))
    with pytest.raises(StoreError, match="bytes, announced|is not the expected"):
        _signed_store(mirror).verified_delta(1)
    # ... or an announcement signed by another key, or for another job.
    forged = sign(describe_delta(JOB, other), bytes(32))
    (mirror / "deltas" / "v00000001.announce").write_bytes(forged)
    with pytest.raises(StoreError, match="not signed by this job's Trainer key"):
        _signed_store(mirror).verified_delta(1)
    (mirror / "deltas" / "v00000001.announce").write_bytes(sign(describe_delta("x", other), KEY))
    with pytest.raises(StoreError, match="signed for job 'x'"):
        _signed_store(mirror).verified_delta(1)
    # A snapshot with a bit flipped fails its announced hash (or its size).
    snap = (tmp_path / "honest" / "snapshots" / "v00000000.safetensors").read_bytes()
    (mirror / "snapshots" / "v00000000.safetensors").write_bytes(snap[:-1] + b"\x00")
    (mirror / "snapshots" / "v00000000.announce").write_bytes(trainer.announcement(0, "snapshots"))
    with pytest.raises(StoreError):
        _signed_store(mirror).verified_snapshot(0)
    with pytest.raises(StoreError, match="opened without the job id"):
        CheckpointStore(mirror).verified_delta(1)


def test_an_announcement_that_does_not_describe_the_file_is_not_stored(tmp_path):
    from aurora.delta.announce import describe_delta, sign

    states, deltas = _chain(1)
    store = _signed_store(tmp_path)
    wrong = sign(describe_delta(JOB, _chain_from(states[0], seed=5)), KEY)
    with pytest.raises(StoreError, match="does not describe this delta file"):
        store.publish_delta(deltas[0], announcement=wrong)
    assert store.list().deltas == ()


def _chain_from(state, seed):
    """Another valid D_1 on the same base (other changes)."""
    rng = np.random.default_rng(seed)
    new = {k: v.copy() for k, v in state.items()}
    for v in new.values():
        flat = v.reshape(-1)
        flat[rng.choice(flat.size, 5, replace=False)] ^= 0x0202
    enc = DeltaEncoder(state, new, model="toy", version=1, base_hash=weights_hash(state))
    return b"".join(s.data for s in enc.segments())
