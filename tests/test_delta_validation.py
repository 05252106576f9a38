"""Every decoder refuses a hostile index stream with a DeltaError, as it decodes, and apply
refuses a whole delta before writing anything: files built here have *valid hashes* around bad
streams (a buggy or hostile Trainer), so only the decoders stand between them and the weights."""

import contextlib

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from aurora.delta import apply as apply_module
from aurora.delta import (
    apply_chain,
    apply_delta,
    codecs,
    encode_delta,
    leb128,
    read_delta,
    weights_hash,
)
from aurora.delta.changes import ulp_diff
from aurora.delta.errors import CorruptError, DeltaError, LayoutError
from aurora.delta.extract import FusedTensor, Part
from aurora.delta.records import TensorDelta
from aurora.delta.writer import DeltaEncoder, encode_records, encode_tensor

N = 64  # elements of the hostile tensor "b"
OLD = {
    "a": np.arange(100, 100 + 3 * N, dtype=np.uint16),
    "b": np.arange(1000, 1000 + N, dtype=np.uint16),
    "c": np.arange(5000, 5000 + N, dtype=np.uint16),
}
H0 = weights_hash(OLD)


@contextlib.contextmanager
def path(fast):
    """Force the compiled loops (``fast``) or numpy for every delta, whatever its size."""
    before = apply_module.COMPILED_MIN_CHANGES
    apply_module.COMPILED_MIN_CHANGES = 0 if fast else 2**62
    try:
        yield
    finally:
        apply_module.COMPILED_MIN_CHANGES = before


def copy(state):
    return {k: v.copy() for k, v in state.items()}


def honest(name, codec="aurora"):
    """A valid record changing every third element of tensor ``name``."""
    old = OLD[name]
    idx = np.arange(0, old.size, 3, dtype=np.int64)
    t = FusedTensor(name, old.shape, (Part(name, 0, old.size, old.shape),))
    return encode_tensor(t, idx, old[idx] + 7, old[idx], codec)


def hostile_streams(codec, gaps, vals, old_at):
    """The streams a writer would produce for these raw gaps (uint64, unchecked) and values."""
    g = np.array(gaps, dtype=np.uint64)
    if codec == "leb128":
        return [leb128.encode(g), vals.astype("<u2").tobytes()]
    if codec == "downcast-zstd":
        return [bytes([8]), codecs.zc(g.astype("<u8")), codecs.zc(vals.astype("<u2"))]
    if codec == "naive":  # absolute indices: the gaps' running sum, wrapped to int32
        idx = (np.cumsum(g.astype(object)) % 2**32).astype(np.int64)
        return [np.where(idx >= 2**31, idx - 2**32, idx).astype("<i4").tobytes(), vals.tobytes()]
    small = (g >= 1) & (g <= 255)
    index = [bytes([8, 8]), codecs.zc(np.where(small, g, 0).astype(np.uint8)), g[~small].tobytes()]
    if codec == "aurora":
        return index + codecs.encode_split_values(vals)
    return index + codecs.encode_ulp_values(vals, old_at)


def valid(gaps, numel):
    total = 0
    for i, g in enumerate(gaps):
        if i and g == 0:
            return False
        total += g
        if total >= numel:
            return False
    return True


def hostile_file(codec, gaps, first="a"):
    vals = (np.arange(len(gaps)) + 9).astype(np.uint16)
    ok = valid(gaps, N)
    old_at = OLD["b"][np.cumsum(np.array(gaps, dtype=object)).astype(np.int64)] if ok else vals
    streams = hostile_streams(codec, gaps, vals, old_at)
    bad = TensorDelta("b", (N,), N, len(gaps), codec, tuple(streams))
    data = encode_records(
        [honest(first), bad, honest("c", "leb128")],
        model="m",
        version=1,
        base_hash=H0,
        segment_size=1024,
    )
    return data, vals, ok


GAP = st.one_of(
    st.integers(0, 3),
    st.integers(1, 300),
    st.integers(N - 2, N + 2),
    st.integers(2**62 - 3, 2**62 + 3),
    st.integers(2**63 - 2, 2**64 - 1),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    codec=st.sampled_from(["leb128", "aurora", "aurora-base", "downcast-zstd", "naive"]),
    gaps=st.lists(GAP, min_size=1, max_size=12),
    fast=st.booleans(),
)
@example(codec="naive", gaps=[2**62], fast=True)  # wraps to index 0 in int32: a valid stream
@example(codec="leb128", gaps=[0, 2**62, 2**62, 2**62, 2**62 + 1], fast=True)  # the repro
@example(codec="leb128", gaps=[0, 2**62, 2**62, 2**62, 2**62 + 1], fast=False)
@example(codec="aurora", gaps=[2**64 - 1, 1], fast=True)
@example(codec="aurora", gaps=[2**64 - 1, 1], fast=False)
@example(codec="downcast-zstd", gaps=[5, 0], fast=False)
def test_hostile_index_streams_in_files_with_valid_hashes_raise_and_leave_weights_untouched(
    codec, gaps, fast
):
    with path(fast):
        check_hostile(codec, gaps)


def check_hostile(codec, gaps):
    data, vals, ok = hostile_file(codec, gaps)
    d = read_delta(data)  # the hashes are valid: only the decoder can refuse it
    state = copy(OLD)
    idx = [int(i) for i in np.cumsum(np.array(gaps, dtype=object))]
    if codec == "naive":  # absolute int32 indices: the running sum as written, wrapped
        idx = [(i + 2**31) % 2**32 - 2**31 for i in idx]
        ok = all(0 <= i < N for i in idx) and all(b > a for a, b in zip(idx, idx[1:], strict=False))
    if not ok:
        with pytest.raises(DeltaError):
            apply_delta(d, state, active_version=0, active_hash=H0)
        assert weights_hash(state) == H0
        return
    apply_delta(d, state, active_version=0, active_hash=H0)
    assert state["b"][idx].tolist() == vals.tolist()
    assert np.array_equal(np.delete(state["b"], idx), np.delete(OLD["b"], idx))


@pytest.mark.parametrize("fast", [True, False], ids=["compiled", "numpy"])
def test_leb128_gap_sums_past_int64_are_refused_not_wrapped_negative(fast):
    gaps = [0, 2**62, 2**62, 2**62, 2**62 + 1]  # the sum wraps to -2^63 in int64
    streams = [leb128.encode(np.array(gaps, dtype=np.uint64)), bytes(10)]
    with pytest.raises(CorruptError, match="past the end|not strictly increasing"):
        codecs.get("leb128").decode(streams, 5, 32, None, "x", fast)


def test_downcast_gap_sums_past_int64_are_refused():
    gaps = np.array([0, 2**62, 2**62, 2**62, 2**62 + 1], dtype="<u8")
    streams = [bytes([8]), codecs.zc(gaps), codecs.zc(np.zeros(5, "<u2"))]
    with pytest.raises(CorruptError):
        codecs.get("downcast-zstd").decode(streams, 5, 32, None, "x")


def test_leb128_values_of_2_to_the_64_or_more_are_refused_not_wrapped():
    with pytest.raises(CorruptError, match="64 bits"):
        leb128.decode(b"\x80" * 9 + b"\x02", 1)  # 2^64: wrapped to 0 before
    assert leb128.decode(b"\xff" * 9 + b"\x01", 1).tolist() == [2**64 - 1]
    with pytest.raises(CorruptError, match="10 bytes"):
        codecs.get("leb128").decode([b"\x80" * 9 + b"\x02", bytes(2)], 1, 32, None, "x")


@pytest.mark.parametrize("fast", [True, False], ids=["compiled", "numpy"])
@pytest.mark.parametrize("codec", ["leb128", "aurora", "downcast-zstd"])
def test_an_overflowing_record_after_good_ones_refuses_the_delta_before_writing_any(codec, fast):
    data, _, ok = hostile_file(codec, [0, 2**62, 2**62, 2**62, 2**62 + 1])
    assert not ok
    state = copy(OLD)
    with path(fast), pytest.raises(DeltaError):  # was: 3 of 4 tensors written, then IndexError
        apply_delta(read_delta(data), state, active_version=0, active_hash=H0)
    assert weights_hash(state) == H0


@pytest.mark.parametrize("fast", [True, False], ids=["compiled", "numpy"])
def test_duplicate_decreasing_and_out_of_range_indices_are_refused_as_they_decode(fast):
    for gaps in ([3, 0], [5, 2**64 - 1], [N], [N - 1, 1], [1, 1, 2**63]):
        for codec in ("leb128", "aurora", "aurora-base", "downcast-zstd"):
            data, _, ok = hostile_file(codec, gaps)
            assert not ok
            with path(fast), pytest.raises(CorruptError):
                apply_delta(read_delta(data), copy(OLD), active_version=0, active_hash=H0)


def test_a_chain_whose_second_link_is_hostile_writes_nothing():
    data, _, _ = hostile_file("leb128", [2, 2, 0])
    d1 = read_delta(encode_delta(OLD, {**OLD, "a": OLD["a"] + 1}, model="m", version=1,
                                 base_hash=H0))  # fmt: skip
    bad = read_delta(
        encode_records(read_delta(data).tensors, model="m", version=2, base_hash=d1.weights_hash)
    )
    state = copy(OLD)
    with pytest.raises(DeltaError):
        apply_chain([d1, bad], state, active_version=0, active_hash=H0)
    assert weights_hash(state) == H0


# ---- fused part boundaries -----------------------------------------------------------------

Q, K, V = "l.self_attn.q_proj.weight", "l.self_attn.k_proj.weight", "l.self_attn.v_proj.weight"


def qkv_state(q_rows, kv_rows, seed=0):
    r = np.random.default_rng(seed)
    shapes = {Q: (q_rows, 8), K: (kv_rows, 8), V: (kv_rows, 8)}
    return {k: r.integers(0, 2**16, s, dtype=np.uint16) for k, s in shapes.items()}


def fused_delta(old, new):
    """The delta as a reader passes it on: every record with its parts."""
    enc = DeltaEncoder(old, new, model="m", version=1, base_hash=weights_hash(old))
    d = read_delta(b"".join(s.data for s in enc.segments()))
    return d.__class__(**{**d.__dict__, "tensors": tuple(enc.tensors)})


def test_a_fused_qkv_delta_is_refused_by_a_target_split_differently_with_the_same_shape():
    old = qkv_state(64, 16)
    new = {k: v ^ np.uint16(1) for k, v in old.items()}
    d = fused_delta(old, new)
    (td,) = d.tensors
    assert td.name == "l.self_attn.qkv_proj.weight"
    assert td.parts == (("q_proj", 64), ("k_proj", 16), ("v_proj", 16))
    other = qkv_state(48, 24)  # same fused shape (96, 8)
    h = weights_hash(other)
    with pytest.raises(LayoutError, match="parts"):
        apply_delta(d, other, active_version=0, active_hash=d.base_hash)
    assert weights_hash(other) == h
    same = copy(old)
    apply_delta(d, same, active_version=0, active_hash=d.base_hash)
    assert weights_hash(same) == weights_hash(new)


def test_the_parts_a_writer_records_reach_apply_through_the_reader():
    old = qkv_state(64, 16)
    new = {k: v ^ np.uint16(1) for k, v in old.items()}
    d = read_delta(encode_delta(old, new, model="m", version=1, base_hash=weights_hash(old)))
    with pytest.raises(LayoutError, match="parts"):
        apply_delta(d, qkv_state(48, 24), active_version=0, active_hash=d.base_hash)


# ---- the writer keeps the smaller encoding ---------------------------------------------------


def test_the_writer_keeps_leb128_where_it_is_smaller_than_aurora_on_a_huge_sparse_tensor():
    numel = 2**33  # no array of this size is needed: the writer only reads the changes
    r = np.random.default_rng(0)
    idx = np.unique(r.integers(0, numel, 6000, dtype=np.int64))
    new = r.integers(0, 2**16, idx.size, dtype=np.uint16)
    old = new ^ np.uint16(1)
    t = FusedTensor("w", (numel,), (Part("w", 0, numel, (numel,)),))
    aurora = sum(map(len, codecs.get("aurora").encode(idx, new, old, numel)))
    leb = sum(map(len, codecs.get("leb128").encode(idx, new, old, numel)))
    assert idx.size >= 4096 and leb < aurora  # u16 gaps escape to u32: 6 B vs ~4.3 B per index
    td = encode_tensor(t, idx, new, old, "aurora")
    assert td.codec == "leb128" and td.nbytes == leb


@pytest.mark.parametrize("density", [0.001, 0.02, 0.3, 0.9, 1.0])
def test_the_writer_never_writes_more_than_any_encoding_of_the_family(density):
    r = np.random.default_rng(1)
    old = r.integers(0, 2**16, 40_000, dtype=np.uint16)
    idx = np.flatnonzero(r.random(old.size) < density)
    new = old.copy()
    new[idx] = (old[idx].astype(np.int32) + r.choice([-1, 1, 2], idx.size)).astype(np.uint16)
    t = FusedTensor("w", old.shape, (Part("w", 0, old.size, old.shape),))
    for codec, family in codecs.FAMILIES.items():
        td = encode_tensor(t, idx, new[idx], old[idx], codec, lambda: old)
        sizes = {
            c: sum(map(len, codecs.get(c).encode(idx, new[idx], old[idx], old.size, lambda: old)))
            for c in family
        }
        assert td.nbytes == min(sizes.values()), (codec, td.codec, sizes)
        m = codecs.get(td.codec).decode(list(td.streams), td.nnz, old.size, old, "w")
        assert np.array_equal(m[0], idx) and np.array_equal(m[1], new[idx])
    assert ulp_diff(new, old)[idx].min() > 0


def test_warm_up_loads_every_compiled_loop_an_apply_uses():
    from aurora.delta import kernels, warm_up

    warm_up()
    loops = ("check_small_gaps", "store_small_gaps", "expand_small_gaps", "restore")
    loops += ("check_leb128", "apply_leb128", "expand_leb128")
    assert all(getattr(kernels, k).signatures for k in loops)


def test_small_deltas_take_numpy_and_large_ones_the_compiled_loops():
    from aurora.delta.apply import COMPILED_MIN_CHANGES, use_compiled

    data, _, _ = hostile_file("aurora", [1, 2, 3])
    d = read_delta(data)
    assert not use_compiled([d])
    assert use_compiled([d] * (COMPILED_MIN_CHANGES // sum(t.nnz for t in d.tensors) + 1))


@pytest.mark.parametrize("codec", ["leb128", "aurora", "aurora-base"])
@pytest.mark.parametrize("bad", ["duplicate", "past the end", "escape left over"])
def test_a_stream_refused_after_hundreds_of_stores_restores_every_written_element(codec, bad):
    """The compiled loops check each index just before storing it, so a violation deep in a
    stream is found after earlier changes are written: they must be restored, as must the
    records stored before it."""
    n = 20_000
    r = np.random.default_rng(1)
    old = {
        "a": r.integers(0, 2**16, n, dtype=np.uint16),
        "b": r.integers(0, 2**16, n, dtype=np.uint16),
    }
    h0 = weights_hash(old)
    gaps = [3] * 2000  # stores start LOOKAHEAD changes before the lookahead reaches the end
    if bad == "duplicate":
        gaps[1500] = 0
    elif bad == "past the end":
        gaps[-1] = n
    idx = np.cumsum(np.array(gaps, dtype=np.int64))
    vals = (old["b"][np.minimum(idx, n - 1)] + 5).astype(np.uint16)
    streams = hostile_streams(codec, gaps, vals, old["b"][np.minimum(idx, n - 1)])
    if bad == "escape left over":
        streams[2 if codec != "leb128" else 0] += b"\x00" * (8 if codec != "leb128" else 1)
    t = FusedTensor("a", (n,), (Part("a", 0, n, (n,)),))
    good = encode_tensor(t, np.arange(0, n, 7), old["a"][::7] ^ 1, old["a"][::7], codec)
    rec = TensorDelta("b", (n,), n, len(gaps), codec, tuple(streams))
    d = read_delta(encode_records([good, rec], model="m", version=1, base_hash=h0))
    state = copy(old)
    with path(True), pytest.raises(CorruptError):
        apply_delta(d, state, active_version=0, active_hash=h0)
    assert weights_hash(state) == h0
