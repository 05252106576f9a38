"""Delta checkpoints: exact extraction, every codec bit-exact, the file verifies itself,
segments reassemble in any order, apply is transactional, bad input raises a DeltaError."""

import contextlib
import random
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aurora.delta import (
    DeltaEncoder,
    Reassembler,
    Segment,
    apply_chain,
    apply_delta,
    chain_hash,
    changes,
    codecs,
    encode_delta,
    leb128,
    read_delta,
    segments_of,
    weights_hash,
)
from aurora.delta import apply as apply_module
from aurora.delta.errors import (
    BadMagicError,
    BaseMismatchError,
    CorruptError,
    DeltaError,
    ForeignSegmentError,
    LayoutError,
    TruncatedError,
    UnknownCodecError,
    UnsupportedFormatError,
)
from aurora.delta.extract import changed, fused_layout
from aurora.store.files import read_delta_file, write_delta

SHAPES = {
    "model.embed_tokens.weight": (64, 32),
    "model.layers.0.self_attn.q_proj.weight": (64, 32),
    "model.layers.0.self_attn.k_proj.weight": (16, 32),
    "model.layers.0.self_attn.v_proj.weight": (16, 32),
    "model.layers.0.self_attn.o_proj.weight": (32, 64),
    "model.layers.0.mlp.gate_proj.weight": (96, 32),
    "model.layers.0.mlp.up_proj.weight": (96, 32),
    "model.layers.0.mlp.down_proj.weight": (32, 96),
    "model.norm.weight": (32,),
}


def weights(seed=0):
    r = np.random.default_rng(seed)
    return {
        k: (r.standard_normal(v).astype(np.float32) * 0.02)
        .view(np.uint32)
        .__rshift__(16)
        .astype(np.uint16)
        for k, v in SHAPES.items()
    }


def stepped(old, density=0.05, seed=1):
    r = np.random.default_rng(seed)
    new = {}
    for k, v in old.items():
        n = v.copy().reshape(-1)
        m = r.random(n.size) < density
        n[m] = (n[m].astype(np.int32) + r.choice([-2, -1, 1, 2], int(m.sum()))).astype(np.uint16)
        new[k] = n.reshape(v.shape)
    return new


@pytest.fixture
def step():
    old = weights()
    new = stepped(old)
    return old, new, weights_hash(old)


def copy_state(s):
    return {k: v.copy() for k, v in s.items()}


# ---- LEB128 -----------------------------------------------------------------------------


def test_leb128_encodes_the_papers_worked_example_198_as_c6_01():
    assert leb128.encode(np.array([198])) == bytes([0xC6, 0x01])
    assert leb128.decode(bytes([0xC6, 0x01]), 1).tolist() == [198]


@given(st.lists(st.integers(0, 2**64 - 1), max_size=200))
def test_leb128_round_trips_any_unsigned_64_bit_values(values):
    arr = np.array(values, dtype=np.uint64)
    assert leb128.decode(leb128.encode(arr), len(values)).tolist() == values


def test_leb128_decode_refuses_missing_and_extra_bytes():
    with pytest.raises(TruncatedError):
        leb128.decode(bytes([0xC6]), 1)
    with pytest.raises(CorruptError):
        leb128.decode(bytes([0x01, 0x02]), 1)
    with pytest.raises(CorruptError):
        leb128.decode(bytes([0xFF] * 11 + [0x01]), 1)


# ---- extraction -------------------------------------------------------------------------


def test_extraction_compares_bit_patterns_so_signed_zero_and_nan_changes_are_found():
    pos0, neg0, nan_a, nan_b = 0x0000, 0x8000, 0x7FC0, 0x7FC1
    old = np.array([pos0, nan_a, nan_a, 0x3F80], dtype=np.uint16)
    new = np.array([neg0, nan_a, nan_b, 0x3F80], dtype=np.uint16)
    idx, vals = changed(old, new)
    assert idx.tolist() == [0, 2] and vals.tolist() == [neg0, nan_b]


def test_fused_names_stack_q_k_v_and_gate_up_at_vllm_row_offsets():
    layout = {t.name: t for t in fused_layout(SHAPES)}
    qkv = layout["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.shape == (96, 32)
    assert [(p.name.split(".")[-2], p.offset) for p in qkv.parts] == [
        ("q_proj", 0),
        ("k_proj", 64 * 32),
        ("v_proj", 80 * 32),
    ]
    gu = layout["model.layers.0.mlp.gate_up_proj.weight"]
    assert [(p.name.split(".")[-2], p.offset) for p in gu.parts] == [
        ("gate_proj", 0),
        ("up_proj", 96 * 32),
    ]
    assert "model.layers.0.self_attn.o_proj.weight" in layout


# ---- codecs and the file ----------------------------------------------------------------


@pytest.mark.parametrize("codec", sorted(codecs.CODECS))
@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("fast", [True, False], ids=["compiled", "numpy"])
def test_every_codec_applies_bit_exactly_fused_and_unfused(step, codec, fuse, fast, monkeypatch):
    monkeypatch.setattr(apply_module, "COMPILED_MIN_CHANGES", 0 if fast else 2**62)
    old, new, h0 = step
    data = encode_delta(
        old, new, model="m", version=1, base_hash=h0, codec=codec, fuse=fuse, segment_size=2048
    )
    d = read_delta(data)
    assert all(t.codec in (codec, "leb128") for t in d.tensors)
    state = copy_state(old)
    assert apply_delta(d, state, active_version=0, active_hash=h0) == d.weights_hash
    assert weights_hash(state) == weights_hash(new)


def test_codecs_handle_edge_indices_full_density_and_huge_gaps():
    numel = 70_000 + 2**16
    old = np.zeros(numel, dtype=np.uint16)
    for idx in ([0], [numel - 1], [0, numel - 1], list(range(0, 300)), [5, 5 + 2**16 + 3]):
        idx = np.array(idx, dtype=np.int64)
        new = np.full(idx.size, 0x3F80, dtype=np.uint16)
        for c in codecs.CODECS.values():
            streams = c.encode(idx, new, old[idx], numel, lambda: old)
            for fast in (True, False):
                got_idx, got = c.decode(streams, idx.size, numel, old, c.name, fast)
                assert got_idx.tolist() == idx.tolist() and got.tolist() == new.tolist(), c.name


def test_the_aurora_codec_is_smaller_than_leb128_on_a_realistic_step():
    from aurora.delta import synthetic

    old, new = synthetic.make_step({"w": (512, 1024)}, lr=5.4e-7, seed=3)
    h0 = weights_hash(old)
    size = {
        c: len(encode_delta(old, new, model="m", version=1, base_hash=h0, codec=c))
        for c in ("leb128", "aurora", "aurora-base", "naive")
    }
    assert size["aurora"] < 0.8 * size["leb128"]
    assert size["aurora-base"] < 0.5 * size["leb128"]
    assert size["naive"] > 1.8 * size["leb128"]


def test_weights_hash_chains_through_the_delta_id(step):
    old, new, h0 = step
    enc = DeltaEncoder(old, new, model="m", version=1, base_hash=h0)
    list(enc.segments())
    assert enc.weights_hash == chain_hash(h0, enc.delta_id)


def test_write_is_atomic_and_inspectable(tmp_path, step):
    old, new, h0 = step
    path = tmp_path / "v1.delta"
    write_delta(path, old, new, model="m", version=1, base_hash=h0)
    assert [p.name for p in tmp_path.iterdir()] == ["v1.delta"]
    assert read_delta_file(path).version == 1


def test_unchanged_weights_make_an_empty_but_valid_delta(step):
    old, _, h0 = step
    d = read_delta(encode_delta(old, old, model="m", version=1, base_hash=h0))
    assert d.tensors == ()
    state = copy_state(old)
    apply_delta(d, state, active_version=0, active_hash=h0)
    assert weights_hash(state) == h0


def test_an_unknown_codec_is_refused_before_any_work(step):
    old, new, h0 = step
    with pytest.raises(UnknownCodecError, match="'zip'"):
        DeltaEncoder(old, new, model="m", version=1, base_hash=h0, codec="zip")


# ---- segments ---------------------------------------------------------------------------


def test_segments_are_emitted_before_extraction_finishes(step):
    old, new, h0 = step
    seen = []

    class Spy(dict):
        def __getitem__(self, k):
            seen.append(k)
            return dict.__getitem__(self, k)

    enc = DeltaEncoder(Spy(old), new, model="m", version=1, base_hash=h0, segment_size=1024)
    it = enc.segments()
    next(it)
    assert 0 < len(set(seen)) < len(SHAPES), "the first segment came only after all were read"
    rest = list(it)
    assert rest[-1].trailer


def test_reassembly_accepts_any_order_and_duplicates_and_yields_only_when_complete(step):
    old, new, h0 = step
    data = encode_delta(old, new, model="m", version=1, base_hash=h0, segment_size=1024)
    segs = segments_of(data)
    assert len(segs) > 4
    order = segs + segs[::3]
    random.Random(7).shuffle(order)
    ra = Reassembler(expected_id=read_delta(data).id)
    done_at = [i for i, s in enumerate(order) if ra.add(s)]
    assert ra.complete and done_at[0] >= len(segs) - 1
    assert ra.result().id == read_delta(data).id
    partial = Reassembler()
    for s in segs[:-2]:
        partial.add(s)
    with pytest.raises(TruncatedError, match="missing"):
        partial.result()


def test_reassembly_refuses_a_segment_of_another_delta(step):
    old, new, h0 = step
    a = segments_of(encode_delta(old, new, model="m", version=1, base_hash=h0, segment_size=1024))
    b = segments_of(
        encode_delta(old, new, model="other", version=1, base_hash=h0, segment_size=1024)
    )
    ra = Reassembler()
    ra.add(a[0])
    with pytest.raises(ForeignSegmentError):
        ra.add(b[1])
    assert ra.missing() == [-1]


def test_a_forged_segment_with_a_matching_checksum_is_caught_by_the_trailer_and_refetched(step):
    from aurora.delta import Segment, leaf_hash

    old, new, h0 = step
    data = encode_delta(old, new, model="m", version=1, base_hash=h0, segment_size=1024)
    segs = segments_of(data)
    forged_data = bytes(len(segs[1].data))
    forged = Segment(segs[1].key, 1, segs[1].offset, forged_data, leaf_hash(forged_data).hex())
    ra = Reassembler()
    ra.add(segs[0])
    ra.add(forged)
    with pytest.raises(CorruptError, match=r"segments \[1\]"):
        ra.add(segs[-1])
    assert ra.missing() == list(range(1, len(segs) - 1))
    for s in segs[2:-1]:
        ra.add(s)
    assert ra.add(segs[1]) and weights_hash(new)


def test_reassembly_names_the_segments_being_received_until_added_or_abandoned(step):
    """What a node leaves out of a fetch it sends while a push is arriving (so the source does
    not send those segments a second time)."""
    from aurora.delta import Segment

    old, new, h0 = step
    data = encode_delta(old, new, model="m", version=1, base_hash=h0, segment_size=1024)
    segs = segments_of(data)
    ra = Reassembler()
    ra.add(segs[0])
    views = {s.seq: ra.slot(s.key, s.seq, s.offset, len(s.data), False) for s in segs[1:3]}
    assert ra.receiving() == {1, 2}
    views[1][:] = segs[1].data
    ra.add(Segment(segs[1].key, 1, segs[1].offset, views[1], segs[1].checksum))
    ra.abandon(views[2])
    assert ra.receiving() == set() and ra.holds(1) and not ra.holds(2)


# ---- bad input --------------------------------------------------------------------------


def test_bad_files_raise_specific_errors(step):
    old, new, h0 = step
    data = encode_delta(old, new, model="m", version=1, base_hash=h0, segment_size=1024)
    with pytest.raises(BadMagicError):
        read_delta(b"NOTDELTA" + data[8:])
    with pytest.raises(UnsupportedFormatError, match="format version 3"):
        read_delta(data[:8] + b"\x03\x00" + data[10:])
    with pytest.raises(TruncatedError):
        read_delta(data[: len(data) // 2])
    with pytest.raises(TruncatedError):
        read_delta(data[:-1])


def test_one_flipped_byte_anywhere_is_refused_and_the_weights_stay_untouched(step):
    old, new, h0 = step
    data = encode_delta(old, new, model="m", version=1, base_hash=h0, segment_size=1024)
    state = copy_state(old)
    for pos in list(range(0, len(data), max(1, len(data) // 300))) + [len(data) - 1]:
        bad = bytearray(data)
        bad[pos] ^= 0x10
        with pytest.raises(DeltaError):
            apply_delta(read_delta(bytes(bad)), state, active_version=0, active_hash=h0)
    assert weights_hash(state) == h0


def test_a_wrong_base_version_or_hash_is_refused_and_nothing_is_written(step):
    old, new, h0 = step
    d = read_delta(encode_delta(old, new, model="m", version=1, base_hash=h0))
    state = copy_state(old)
    with pytest.raises(BaseMismatchError, match="v0; the target is on v3"):
        apply_delta(d, state, active_version=3, active_hash=h0)
    with pytest.raises(BaseMismatchError, match="h="):
        apply_delta(d, state, active_version=0, active_hash="00" * 32)
    assert weights_hash(state) == h0


def test_a_delta_for_other_shapes_is_refused_before_writing(step):
    old, new, h0 = step
    d = read_delta(encode_delta(old, new, model="m", version=1, base_hash=h0))
    state = copy_state(old)
    state["model.norm.weight"] = np.zeros(16, dtype=np.uint16)
    with pytest.raises(LayoutError, match="model.norm.weight"):
        apply_delta(d, state, active_version=0, active_hash=h0)
    state.pop("model.norm.weight")
    assert {k: weights_hash({k: v}) for k, v in state.items()} == {
        k: weights_hash({k: v}) for k, v in old.items() if k != "model.norm.weight"
    }


def test_a_chain_applies_whole_from_any_version_behind(step):
    v0, v1, h0 = step
    v2 = stepped(v1, seed=2)
    v3 = stepped(v2, seed=3)
    d1 = read_delta(encode_delta(v0, v1, model="m", version=1, base_hash=h0, codec="aurora-base"))
    d2 = read_delta(
        encode_delta(v1, v2, model="m", version=2, base_hash=d1.weights_hash, codec="aurora-base")
    )
    d3 = read_delta(encode_delta(v2, v3, model="m", version=3, base_hash=d2.weights_hash))
    state = copy_state(v0)
    assert apply_chain([d1, d2, d3], state, active_version=0, active_hash=h0) == d3.weights_hash
    assert weights_hash(state) == weights_hash(v3)
    state = copy_state(v0)
    with pytest.raises(BaseMismatchError, match="chain broken at D_3"):
        apply_chain([d1, d3], state, active_version=0, active_hash=h0)
    assert weights_hash(state) == h0


CHANGE_CLASSES = (changes.SmallGapChange, changes.LebChange, changes.Materialized)


def test_a_chain_that_fails_midway_is_rolled_back(step, monkeypatch):
    v0, v1, h0 = step
    v2 = stepped(v1, seed=2)
    d1 = read_delta(encode_delta(v0, v1, model="m", version=1, base_hash=h0))
    d2 = read_delta(encode_delta(v1, v2, model="m", version=2, base_hash=d1.weights_hash))
    calls = []

    def failing(real):
        def store(self, parts):
            calls.append(1)
            if len(calls) == len(d1.tensors) + 2:  # D_1 written, one tensor of D_2 written
                raise CorruptError("injected")
            return real(self, parts)

        return store

    for cls in CHANGE_CLASSES:
        monkeypatch.setattr(cls, "store", failing(cls.store))
    state = copy_state(v0)
    with pytest.raises(CorruptError, match="injected"):
        apply_chain([d1, d2], state, active_version=0, active_hash=h0)
    assert len(calls) > len(d1.tensors) + 2  # the undo log wrote the old bits back
    assert weights_hash(state) == h0


def test_a_keyboard_interrupt_midway_through_a_chain_rolls_it_back(step, monkeypatch):
    """SIGINT arrives as a KeyboardInterrupt (a BaseException, not a DeltaError) between two
    writes: the weights must still be on the version they were on, never on none."""
    v0, v1, h0 = step
    v2 = stepped(v1, seed=2)
    d1 = read_delta(encode_delta(v0, v1, model="m", version=1, base_hash=h0))
    d2 = read_delta(encode_delta(v1, v2, model="m", version=2, base_hash=d1.weights_hash))
    calls = []

    def interrupted(real):
        def store(self, parts):
            calls.append(1)
            if len(calls) == len(d1.tensors) + 2:  # D_1 written, one tensor of D_2 written
                raise KeyboardInterrupt
            return real(self, parts)

        return store

    for cls in CHANGE_CLASSES:
        monkeypatch.setattr(cls, "store", interrupted(cls.store))
    state = copy_state(v0)
    with pytest.raises(KeyboardInterrupt):
        apply_chain([d1, d2], state, active_version=0, active_hash=h0)
    assert weights_hash(state) == h0


class _InterruptedKernels:
    """The compiled loops, with a KeyboardInterrupt raised when the ``at``-th call of a store
    loop has returned (its writes made): SIGINT as Python delivers it, between two calls."""

    STORES = ("store_small_gaps", "apply_leb128")

    def __init__(self, at):
        from aurora.delta import kernels

        self.real, self.at, self.calls = kernels, at, 0

    def __getattr__(self, name):
        fn = getattr(self.real, name)
        if name not in self.STORES:
            return fn

        def call(*args):
            fn(*args)
            self.calls += 1
            if self.calls == self.at:
                raise KeyboardInterrupt

        return call


@pytest.mark.parametrize("codec", ["aurora", "aurora-base", "leb128"])
@pytest.mark.parametrize("at", [1, 2, 5])
def test_a_keyboard_interrupt_inside_a_compiled_apply_leaves_the_weights_on_their_version(
    step, monkeypatch, codec, at
):
    """Interrupted after the ``at``-th store loop returned (call 2 is the k part of the fused
    qkv record: a store cut short between two parts): every element written so far is put
    back. Before the compiled ``aurora`` loops kept an undo log, apply_delta rolled back only
    on a DeltaError and left such weights on no version."""
    v0, v1, h0 = step
    monkeypatch.setattr(apply_module, "COMPILED_MIN_CHANGES", 0)
    d = read_delta(encode_delta(v0, v1, model="m", version=1, base_hash=h0, codec=codec))
    kernels = _InterruptedKernels(at)
    monkeypatch.setattr(changes, "compiled", lambda: kernels)
    state = copy_state(v0)
    with pytest.raises(KeyboardInterrupt):
        apply_delta(d, state, active_version=0, active_hash=h0)
    assert kernels.calls == at
    assert weights_hash(state) == h0
    monkeypatch.undo()
    apply_delta(d, state, active_version=0, active_hash=h0)  # and the same delta then applies
    assert weights_hash(state) == weights_hash(v1)


def test_the_aurora_stores_skip_their_undo_log_only_where_the_caller_says_nothing_interrupts(
    step, monkeypatch
):
    """Python raises a signal's exception in the main thread only, and an ``aurora`` store
    checked at parse raises nothing: with ``interruptible=False`` (an Actor's engine, applying
    in a worker thread) the log, ~30% of that loop, is skipped; the bits are the same."""
    v0, v1, h0 = step
    monkeypatch.setattr(apply_module, "COMPILED_MIN_CHANGES", 0)
    d = read_delta(encode_delta(v0, v1, model="m", version=1, base_hash=h0, codec="aurora"))
    flags = []
    kernels = _InterruptedKernels(at=-1)  # never interrupts
    real = kernels.real.store_small_gaps

    def spy(*args):
        flags.append(args[11])
        real(*args)

    kernels.store_small_gaps = spy
    monkeypatch.setattr(changes, "compiled", lambda: kernels)
    logged, quiet = copy_state(v0), copy_state(v0)
    apply_delta(d, logged, active_version=0, active_hash=h0)
    assert flags and all(flags)
    flags.clear()
    apply_delta(d, quiet, active_version=0, active_hash=h0, interruptible=False)
    assert flags and not any(flags)
    assert weights_hash(logged) == weights_hash(quiet) == weights_hash(v1)


def test_the_engines_apply_off_the_main_thread_without_the_log_and_in_it_with_the_log(step):
    """The stand-in engine (as the transformers engine) tells apply where it runs."""
    import threading

    from aurora.runtime.standin import StandinEngine

    v0, v1, h0 = step
    d = read_delta(encode_delta(v0, v1, model="m", version=1, base_hash=h0, codec="aurora"))
    seen = []
    real = apply_module.store_prepared

    def spy(prepared, state, *, interruptible=True):
        seen.append(interruptible)
        return real(prepared, state, interruptible=interruptible)

    apply_module.store_prepared = spy
    try:
        for where in ("main", "worker"):
            engine = StandinEngine.__new__(StandinEngine)  # apply reads only what load sets
            engine.load(v0, version=0, weights_hash=h0)
            if where == "main":
                engine.apply(d)
            else:
                t = threading.Thread(target=engine.apply, args=(d,))
                t.start()
                t.join()
            assert engine.digest() == weights_hash(v1)
    finally:
        apply_module.store_prepared = real
    assert seen == [True, False]


def test_a_keyboard_interrupt_inside_a_numpy_apply_leaves_the_weights_on_their_version(
    step, monkeypatch
):
    v0, v1, h0 = step
    monkeypatch.setattr(apply_module, "COMPILED_MIN_CHANGES", 2**62)
    d = read_delta(encode_delta(v0, v1, model="m", version=1, base_hash=h0))
    real, calls = changes.Materialized.store, []

    def store(self, parts):
        real(self, parts)
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(changes.Materialized, "store", store)
    state = copy_state(v0)
    with pytest.raises(KeyboardInterrupt):
        apply_delta(d, state, active_version=0, active_hash=h0)
    assert weights_hash(state) == h0


def test_a_chain_with_a_bad_record_in_a_later_link_writes_nothing(step, monkeypatch):
    v0, v1, h0 = step
    v2 = stepped(v1, seed=2)
    d1 = read_delta(encode_delta(v0, v1, model="m", version=1, base_hash=h0))
    d2 = read_delta(encode_delta(v1, v2, model="m", version=2, base_hash=d1.weights_hash))
    bad = d2.tensors[-1]
    d2 = replace(d2, tensors=(*d2.tensors[:-1], replace(bad, nnz=bad.nnz + 1)))
    stores = []
    for cls in CHANGE_CLASSES:
        monkeypatch.setattr(cls, "store", lambda self, parts: stores.append(1))
    state = copy_state(v0)
    with pytest.raises(DeltaError):
        apply_chain([d1, d2], state, active_version=0, active_hash=h0)
    assert stores == [] and weights_hash(state) == h0


# ---- fuzz ---------------------------------------------------------------------------------

_OLD = weights(5)
_NEW = stepped(_OLD, seed=6)
_H0 = weights_hash(_OLD)
_DATA = {
    c: encode_delta(_OLD, _NEW, model="m", version=1, base_hash=_H0, codec=c, segment_size=1024)
    for c in ("aurora", "aurora-base", "leb128")
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    codec=st.sampled_from(sorted(_DATA)),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
    cut=st.one_of(st.none(), st.integers(0, 10**6)),
)
def test_mutated_bytes_only_ever_raise_delta_errors_and_never_partially_apply(codec, edits, cut):
    data = bytearray(_DATA[codec])
    for pos, val in edits:
        data[pos % len(data)] = val
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    state = copy_state(_OLD)
    try:
        d = read_delta(bytes(data))
        apply_delta(d, state, active_version=0, active_hash=_H0)
    except DeltaError:
        assert weights_hash(state) == _H0
        return
    assert bytes(data) == _DATA[codec] or weights_hash(state) == weights_hash(_NEW)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes_only_ever_raise_delta_errors(blob):
    with pytest.raises(DeltaError):
        read_delta(b"AURDELTA" + blob if len(blob) % 2 else blob)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.binary(max_size=64), st.booleans()), max_size=20))
def test_the_reassembler_only_ever_raises_delta_errors_on_garbage_segments(items):
    from aurora.delta import Segment, leaf_hash

    segs = segments_of(_DATA["aurora"])
    ra = Reassembler()
    for seq, blob, honest in items:
        s = (
            segs[seq % len(segs)]
            if honest
            else Segment(
                segs[0].key, seq, seq * 1024, blob, leaf_hash(blob).hex(), trailer=seq % 7 == 0
            )
        )
        with contextlib.suppress(DeltaError):
            ra.add(s)
    if ra.complete:
        assert ra.result().id == read_delta(_DATA["aurora"]).id


def test_a_trailer_magic_right_before_the_end_is_refused_as_truncated(step):
    old, new, h0 = step
    data = encode_delta(old, new, model="m", version=1, base_hash=h0)
    payload = data[: data.rfind(b"AURTRAIL")]
    import struct

    fake = payload + b"AURTRAIL" + struct.pack("<Q", len(payload)) + b"AURDELTA"
    with pytest.raises(TruncatedError):
        read_delta(fake)


# ---- reassembly in place ------------------------------------------------------------------


def _small_segments(step):
    old, new, h0 = step
    data = encode_delta(old, new, model="m", version=1, base_hash=h0, segment_size=1 << 10)
    return data, segments_of(data)


def _receive_into_slot(ra, seg, data=None):
    """What the transport does: ask for the slot, let the socket fill it, add it (the trailer
    has no slot: it is kept apart)."""
    view = ra.slot(seg.key, seg.seq, seg.offset, len(seg.data), seg.trailer)
    if seg.trailer:
        assert view is None
        return ra.add(seg)
    assert view is not None
    view[:] = seg.data if data is None else data
    return ra.add(Segment(seg.key, seg.seq, seg.offset, view, seg.checksum, seg.trailer))


def test_segments_received_into_their_slots_are_parsed_in_place_without_a_copy(step):
    from aurora.delta.arena import arena

    old, new, h0 = step
    data = encode_delta(old, new, model="m", version=1, base_hash=h0, segment_size=1024)
    buf = arena(1 << 20)
    ra = Reassembler(arena=buf)
    segs = segments_of(data)
    for s in segs[::-1]:
        _receive_into_slot(ra, s)
    d = ra.result()
    assert d.id == read_delta(data).id
    every_stream = [s for t in d.tensors for s in t.streams if len(s)]
    assert every_stream and all(
        np.shares_memory(np.frombuffer(s, np.uint8), np.frombuffer(buf, np.uint8))
        for s in every_stream
    )
    assert all(s.readonly for s in every_stream)
    state = {k: v.copy() for k, v in old.items()}
    assert apply_delta(d, state, active_version=0, active_hash=h0) == d.weights_hash
    assert all(np.array_equal(state[k], new[k]) for k in new)


def test_a_slot_is_its_receivers_alone_until_added_or_abandoned(step):
    old, new, h0 = step
    data = encode_delta(old, new, model="m", version=1, base_hash=h0, segment_size=1024)
    segs = segments_of(data)
    ra = Reassembler()
    s1 = segs[1]
    view = ra.slot(s1.key, 1, s1.offset, len(s1.data), False)
    assert view is not None
    assert ra.slot(s1.key, 1, s1.offset, len(s1.data), False) is None  # being filled
    assert ra.slot(s1.key, 2, s1.offset + 10, 1024, False) is None  # overlaps it
    view[:100] = s1.data[:100]  # half-received, and a copy races in: dropped, not an error
    ra.add(s1)
    assert 1 not in ra._held
    ra.abandon(view)  # the receiving stream broke
    _receive_into_slot(ra, s1)
    assert ra.slot(s1.key, 1, s1.offset, len(s1.data), False) is None  # held now
    for s in segs:
        ra.add(s)
    assert ra.result().id == read_delta(data).id


def test_verified_bytes_are_never_overwritten_by_an_overlapping_segment(step):
    from aurora.delta import leaf_hash

    _, segs = _small_segments(step)
    ra = Reassembler()
    ra.add(segs[0])
    forged = bytes(300)
    with pytest.raises(CorruptError, match="overlaps"):
        ra.add(Segment(segs[0].key, 5, 100, forged, leaf_hash(forged).hex()))
    assert ra.slot(segs[0].key, 5, 100, 300, False) is None
    assert bytes(ra._arena[:1024]) == segs[0].data


def test_forged_segments_received_before_the_trailer_cannot_keep_the_delta_from_completing(step):
    from aurora.delta import leaf_hash

    data, segs = _small_segments(step)
    ra = Reassembler()
    junk = bytes(1500)  # self-consistent, straddling segments 2 and 3
    ra.add(Segment(segs[0].key, 2, 2048 + 100, junk, leaf_hash(junk).hex()))
    in_flight = ra.slot(segs[0].key, 9, 4096 + 10, 900, False)  # forged, still arriving
    assert in_flight is not None and ra.slot(segs[0].key, 2, 2048, 1024, False) is None
    with pytest.raises(CorruptError, match=r"segments \[2\]"):
        ra.add(segs[-1])  # the trailer refutes the forged segment 2
    assert ra.slot(segs[0].key, 9, 4096 + 10, 900, False) is None  # not a slot of this delta
    ra.abandon(in_flight)  # the forging stream is closed
    for s in segs[:-1]:
        _receive_into_slot(ra, s)
    assert ra.result().id == read_delta(data).id


def test_a_corrupt_segment_received_in_place_frees_its_slot_for_the_refetch(step):
    _, segs = _small_segments(step)
    ra = Reassembler()
    damaged = bytearray(segs[2].data)
    damaged[7] ^= 0xFF
    with pytest.raises(CorruptError, match="checksum"):
        _receive_into_slot(ra, segs[2], damaged)
    _receive_into_slot(ra, segs[2])  # the re-fetched copy lands in the same place
    for s in segs:
        ra.add(s)
    assert ra.complete
