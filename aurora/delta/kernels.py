"""Compiled loops of the decode and apply path (numba): check index streams and store them.

Applying a sparse delta is bound by memory, not arithmetic: at 2% density a 64-byte line of bf16
weights holds a change with probability 1 - 0.98^32 = 48%, so the store touches about half the
lines of the tensor wherever the indices come from (``benchmarks/test_apply_bound.py``). A chain
of numpy temporaries writes and re-reads 10+ bytes per change on top of that; the loops here read
each stream once and keep the running index in a register. ``check_*`` walk an index stream
without writing and return a status code (``OK`` or the first violation); ``store_small_gaps``
stores a checked ``aurora`` stream and ``apply_leb128`` checks and stores a LEB128 stream in one
pass with an undo log (:func:`restore`); both stop at the end of one part of a fused tensor and
resume from the state in ``st``. ``expand_*`` write the int64 indices of a checked stream. Value
streams: ``SPLIT`` is a high-byte and a low-byte plane (``aurora``); ``ULP`` zigzagged differences
of the order-preserving bf16 key from the old value, uint8 with 0 as escape to a uint16 side array
(``aurora-base``).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

OK, NOT_INCREASING, OUT_OF_RANGE, ESCAPES, TOO_LONG, TRUNCATED, LEFTOVER = range(7)
MESSAGES = {
    NOT_INCREASING: "indices are not strictly increasing (a zero gap after the first)",
    OUT_OF_RANGE: "an index or gap reaches past the end of the tensor",
    ESCAPES: "the escape count does not match the escape side array",
    TOO_LONG: "a LEB128 value is longer than 10 bytes or not below 2^64",
    TRUNCATED: "the LEB128 stream ends inside a value or before the last one",
    LEFTOVER: "bytes are left over after the last LEB128 value",
}
"""Status code of a ``check_*`` kernel -> what is wrong (the caller names the tensor)."""

SPLIT, ULP = 0, 1
"""Value stream kinds of :func:`store_small_gaps` (as :data:`aurora.delta.changes.SPLIT`)."""
LOOKAHEAD = 128
"""Changes between the one stored and the one whose line is prefetched: at 2% density ~190
lines, ~12 KB ahead, enough to cover a DRAM round trip at one change per ~5 ns."""
RING = 256
"""Indices the lookahead keeps for the store (a power of two > LOOKAHEAD; 2 KB, in L1)."""
RING_MASK = RING - 1
STATE = 6
"""Length of the ``st`` state array of the ``apply_*`` loops."""
MAX_NUMEL = 1 << 62
"""Largest tensor the kernels accept: below it, index + gap never overflows int64."""
VERSION = numba.__version__


@intrinsic
def _prefetch(typingctx, arr, i):  # type: ignore[no-untyped-def]
    """Hint the CPU to bring the line of ``arr[i]`` into L1 (``llvm.prefetch``; never faults)."""
    sig = types.void(arr, i)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        # read (0), highest locality (3), data cache (1): measured faster than a write hint here
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


_jit = numba.njit(cache=True, nogil=True)


@_jit
def _small_gap(lo, hi, i, wide):  # type: ignore[no-untyped-def]
    if wide:
        return np.int64(lo[i]) | (np.int64(hi[i]) << 8)
    return np.int64(lo[i])


@_jit
def check_small_gaps(lo, hi, esc, numel):  # type: ignore[no-untyped-def]
    """Status of an ``aurora`` index stream: gaps ``lo`` (| ``hi`` << 8 when ``hi`` is as long),
    0 meaning the next escape (uint64). Vectorisable: sums and counts, no running index.

    A ``check_*`` walk refuses (status code, not an exception): a gap after the first below 1
    (indices strictly increasing, no duplicates), a gap or running sum reaching ``numel`` (so no
    int64 overflow: both stay below ``numel < 2**62``), a LEB128 value of more than 10 bytes or not
    below 2^64, escape counts that do not match. ``aurora`` and ``aurora-base`` streams are checked
    this way when parsed, before the first byte of the weights is written.
    """
    n = lo.size
    wide = hi.size == n and n > 0
    total = np.uint64(0)
    zeros = 0
    if wide:
        for i in range(n):
            g = np.uint64(lo[i]) | (np.uint64(hi[i]) << np.uint64(8))
            total += g
            zeros += g == 0
    else:
        for i in range(n):
            total += np.uint64(lo[i])
            zeros += lo[i] == 0
    if zeros != esc.size:
        return ESCAPES
    first_escaped = n > 0 and _small_gap(lo, hi, 0, wide) == 0
    lim = np.uint64(numel)
    for j in range(esc.size):
        e = esc[j]
        if e == 0 and not (j == 0 and first_escaped):
            return NOT_INCREASING
        if e >= lim:
            return OUT_OF_RANGE
        total += e  # < 2 * 2^62 after the check below held for the previous sum: no overflow
        if total >= lim:
            return OUT_OF_RANGE
    if n > 0 and total >= lim:  # the last index is the sum of all gaps
        return OUT_OF_RANGE
    return OK


@_jit
def _ulp_add(old, z):  # type: ignore[no-untyped-def]
    b = np.int64(old)
    key = (~b & 0xFFFF) if b & 0x8000 else (b | 0x8000)
    zz = np.int64(z)
    key = (key + ((zz >> 1) ^ -(zz & 1))) & 0xFFFF
    return np.uint16((key & 0x7FFF) if key & 0x8000 else (~key & 0xFFFF))


@_jit
def store_small_gaps(out, base, end, st, lo, hi, esc, va, vb, vesc, vmode, log, undo):  # type: ignore[no-untyped-def]
    """Store the changes of an ``aurora`` stream already checked whole (``check_small_gaps``)
    whose fused index is below ``end`` into ``out[index - base]``; with ``log``, keep the old bits
    of change ``i`` in ``undo[i]`` so an interrupted apply can be rolled back (a split value's store
    reads nothing otherwise: the read and the log cost ~35% of this loop, a ULP store ~0%, as it
    reads the old bits anyway: benchmarks/test_apply_bound.py). No checks; the lookahead decodes
    each gap a second time for its prefetch (a ring of indices and in-loop checks made it slower:
    docs/journal/delta-measurements.md). ``st`` = [change, escape, value escape, last index,
    lookahead change, lookahead escape, lookahead index] is read and updated in place.

    It prefetches the line of the change ``LOOKAHEAD`` changes ahead: the hardware prefetchers
    follow sequential streams, not this ascending but irregular one. A ULP value's old value is the
    one being overwritten, read from the line the store brings in anyway.
    """
    n = lo.size
    wide = hi.size == n and n > 0
    i, j, k, cur, ia, ja, ca = st[0], st[1], st[2], st[3], st[4], st[5], st[6]
    while ia < n and ia < i + LOOKAHEAD:
        g = _small_gap(lo, hi, ia, wide)
        if g == 0:
            g = np.int64(esc[ja])
            ja += 1
        ca += g
        ia += 1
    while i < n:
        g = _small_gap(lo, hi, i, wide)
        jj = j
        if g == 0:
            g = np.int64(esc[j])
            jj = j + 1
        nxt = cur + g
        if nxt >= end:
            break
        if ia < n:
            ga = _small_gap(lo, hi, ia, wide)
            if ga == 0:
                ga = np.int64(esc[ja])
                ja += 1
            ca += ga
            ia += 1
            if ca < end:
                _prefetch(out, ca - base)
        if vmode == SPLIT:
            if log:
                undo[i] = out[nxt - base]
            out[nxt - base] = (np.uint16(va[i]) << np.uint16(8)) | np.uint16(vb[i])
        else:
            z = np.uint16(va[i])
            if z == 0:
                z = vesc[k]
                k += 1
            old = out[nxt - base]
            if log:
                undo[i] = old
            out[nxt - base] = _ulp_add(old, z)
        cur = nxt
        j = jj
        i += 1
    st[0], st[1], st[2], st[3], st[4], st[5], st[6] = i, j, k, cur, ia, ja, ca


@_jit
def restore(out, base, idx, undo):  # type: ignore[no-untyped-def]
    """Write ``undo`` back at ``idx - base`` (a rolled-back store)."""
    for i in range(idx.size):
        out[idx[i] - base] = undo[i]


@_jit
def expand_small_gaps(lo, hi, esc, idx):  # type: ignore[no-untyped-def]
    """The indices of the first ``idx.size`` changes of a checked ``aurora`` stream into ``idx``
    (int64).

    The ``expand_*`` loops serve the torch path (``index_copy_`` needs an index tensor), the
    tensor-parallel remap and a rollback.
    """
    n = lo.size
    wide = hi.size == n and n > 0
    cur = np.int64(0)
    j = 0
    for i in range(idx.size):
        g = _small_gap(lo, hi, i, wide)
        if g == 0:
            g = np.int64(esc[j])
            j += 1
        cur += g
        idx[i] = cur


@_jit
def check_leb128(buf, nnz, numel):  # type: ignore[no-untyped-def]
    """Status of ``nnz`` LEB128 gaps in ``buf`` (uint8) as the index stream of a tensor of
    ``numel`` elements; the whole buffer must be used. One pass over the bytes; the checks of a
    value are or-ed into one flag (fewer branches: 25% faster than testing each)."""
    acc = np.uint64(0)
    shift = np.uint64(0)
    count = 0
    cur = np.uint64(0)
    lim = np.uint64(numel)
    for pos in range(buf.size):
        b = np.uint64(buf[pos])
        acc |= (b & np.uint64(0x7F)) << shift
        if b < 0x80:
            if (shift == 63) & (b > 1):  # the 10th byte carries bit 63 only
                return TOO_LONG
            bad = (count > 0) & (acc == 0)
            if bad:
                return NOT_INCREASING
            bad = acc >= lim
            cur += acc  # both below 2^62 unless ``bad``: no wrap before the return
            if bad | (cur >= lim):
                return OUT_OF_RANGE
            count += 1
            if count > nnz:
                return LEFTOVER
            acc = np.uint64(0)
            shift = np.uint64(0)
        else:
            shift += np.uint64(7)
            if shift > 63:
                return TOO_LONG
    if count != nnz or shift != 0:
        return TRUNCATED
    return OK


@_jit
def _leb_next(buf, pos):  # type: ignore[no-untyped-def]
    v = np.int64(0)
    shift = 0
    while True:
        b = buf[pos]
        pos += 1
        v |= np.int64(b & 0x7F) << shift
        if b < 0x80:
            return v, pos
        shift += 7


@_jit
def apply_leb128(out, base, end, st, ring, undo, buf, vals, numel):  # type: ignore[no-untyped-def]
    """Check and store a ``leb128`` change in one pass: every change whose fused index is below
    ``end`` goes to ``out[index - base]``, its old bits to ``undo[change]``. ``st`` = [changes
    stored, unused, lookahead change, lookahead byte position, lookahead index, status] and
    ``ring`` (the lookahead's indices, :data:`RING`) carry the state from one part to the next.

    The lookahead cursor decodes each value ``LOOKAHEAD`` changes before the store reaches it,
    with the checks of ``check_leb128`` (a 1-byte value, most gaps at 1-3% changed, skips the
    continuation loop), puts its index in the ring and prefetches its line; the store only reads
    the ring. A bad stream sets ``st[5]`` to its status and stops before the bad change is
    written: the caller restores ``undo[:st[0]]`` (:func:`restore`). The arithmetic stays in
    int64 (values compared as uint64 against ``numel`` first): numba computes uint64-with-int64
    expressions in float64, which made a first version of these loops 8x slower."""
    n = vals.size
    nb = buf.size
    lim = np.uint64(numel)
    i, ia, pa, ca, status = st[0], st[2], st[3], st[4], st[5]
    while status == OK:
        while ia < n and ia < i + LOOKAHEAD:
            if pa >= nb:
                status = TRUNCATED
                break
            b = np.int64(buf[pa])
            pa += 1
            if b < 0x80:
                g = b
            else:
                v = np.uint64(b & 0x7F)
                shift = 7
                while True:
                    if pa >= nb:
                        status = TRUNCATED
                        break
                    b = np.int64(buf[pa])
                    pa += 1
                    if shift == 63 and b > 1:  # the 10th byte carries bit 63 only
                        status = TOO_LONG
                        break
                    v |= np.uint64(b & 0x7F) << np.uint64(shift)
                    if b < 0x80:
                        break
                    shift += 7
                    if shift > 63:
                        status = TOO_LONG
                        break
                if status != OK:
                    break
                if v >= lim:
                    status = OUT_OF_RANGE
                    break
                g = np.int64(v)
            if g == 0 and ia > 0:
                status = NOT_INCREASING
                break
            ca += g  # both < 2^62: no wrap
            if ca >= numel:
                status = OUT_OF_RANGE
                break
            ring[ia & RING_MASK] = ca
            if ca < end:
                _prefetch(out, ca - base)
            ia += 1
            if ia == n and pa != nb:
                status = LEFTOVER
                break
        if status != OK or i >= n:
            break
        idx = ring[i & RING_MASK]
        if idx >= end:
            break
        p = idx - base
        undo[i] = out[p]
        out[p] = vals[i]
        i += 1
    st[0], st[2], st[3], st[4], st[5] = i, ia, pa, ca, status


@_jit
def expand_leb128(buf, idx):  # type: ignore[no-untyped-def]
    """The indices of the first ``idx.size`` changes of a checked LEB128 stream into ``idx``
    (int64)."""
    pos = 0
    cur = np.int64(0)
    for i in range(idx.size):
        g, pos = _leb_next(buf, pos)
        cur += g
        idx[i] = cur
