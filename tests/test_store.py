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
