"""Writing a delta checkpoint: tensor by tensor, cut into segments while extraction runs.

The header (model id, v, base v-1, h(v-1), segment size) is known before extraction starts, so
:class:`DeltaEncoder` produces the payload tensor by tensor and cuts it into fixed-size segments
as it goes (cut-through, paper Figure 7); the trailer, with every leaf hash, ``id(D_v)`` and
``h(v)``, comes last. Writing the bytes to a file is the Checkpoint Store's job
(:mod:`aurora.store.files`); this module only produces them.

Each tensor is encoded with every encoding of the requested codec's family
(:data:`aurora.delta.codecs.FAMILIES`) that could be the smallest, and the smallest is kept and
named in its record: ``aurora`` against ``leb128`` always (the LEB128 size is counted exactly
without encoding; zstd frames cost ~10 bytes, which dominates tiny tensors, and LEB128 can win on
huge sparse ones), the dense encodings when the tensor is small or its changes are dense enough to
possibly win (:data:`DENSE_TRY_DENSITY`, from the sweep in ``docs/journal/delta-measurements.md``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Required, TypedDict, Unpack

import numpy as np

from aurora.delta import codecs, leb128
from aurora.delta.extract import FusedTensor, changed_fused, fused_layout, gather_fused
from aurora.delta.hashing import H, leaf_hash, merkle_root
from aurora.delta.records import (
    DEFAULT_SEGMENT_SIZE,
    FORMAT_VERSION,
    HASH_BYTES,
    MAGIC,
    TRAILER_MAGIC,
    Segment,
    TensorDelta,
)


def _frame(tag: bytes, obj: object) -> bytes:
    body = json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()
    return tag + struct.pack("<I", len(body)) + body


def header_bytes(
    *, model: str, version: int, base: int, base_hash: str, segment_size: int
) -> bytes:
    if version != base + 1:
        raise ValueError(f"a delta goes from v-1 to v: version {version} with base {base}")
    if len(bytes.fromhex(base_hash)) != HASH_BYTES:
        raise ValueError(f"base_hash must be {HASH_BYTES} bytes of hex, got {base_hash!r}")
    if segment_size < 1024:
        raise ValueError(f"segment_size must be >= 1024 bytes, got {segment_size}")
    head = {
        "model": model,
        "version": version,
        "base": base,
        "base_hash": base_hash,
        "segment_size": segment_size,
    }
    body = json.dumps(head, separators=(",", ":"), sort_keys=True).encode()
    return MAGIC + struct.pack("<HI", FORMAT_VERSION, len(body)) + body


DENSE_CODECS = frozenset({"dense", "dense-base", "xor-zstd"})
DENSE_TRY_DENSITY = 0.1
"""Try the dense encodings (which read and compress the whole tensor) only from this share of
changed elements up: below it every dense encoding was 1.2-3x the best sparse one in the sweep of
``docs/journal/delta-measurements.md`` (they win from ~60% with the base, ~99% without), so encoding
them would only cost the Trainer time."""
DENSE_TRY_NUMEL = 1 << 16
"""...or when the tensor is this small (norms, biases): trying is then cheaper than deciding."""


def part_label(name: str) -> str:
    """A part's name in its fused record: its module (``q_proj``), since the fused name already
    holds the prefix and the kind (``model.layers.0.self_attn.`` + ``.weight``)."""
    return name.rsplit(".", 2)[-2]


def _candidates(codec: str, nnz: int, numel: int, have_full: bool) -> list[str]:
    family = codecs.FAMILIES.get(codec, (codec,))
    dense_ok = nnz >= DENSE_TRY_DENSITY * numel or numel <= DENSE_TRY_NUMEL
    return [
        c
        for c in family
        if c == codec or ((c not in DENSE_CODECS or dense_ok) and (have_full or c != "dense"))
    ]


def encode_tensor(
    tensor: FusedTensor,
    idx: np.ndarray,
    new: np.ndarray,
    old: np.ndarray,
    codec: str,
    full_old: Callable[[], np.ndarray] | None = None,
) -> TensorDelta:
    """Encode one tensor's change (``old``: the base bits at ``idx``; ``full_old()``: the whole
    flat base tensor, for the ``dense`` encoding, which is not tried without it) with the
    smallest encoding of ``codec``'s family."""
    best: tuple[int, str, list[bytes]] | None = None
    for name in _candidates(codec, int(idx.size), tensor.numel, full_old is not None):
        if name == "leb128" and best is not None:
            # exact LEB128 size first: encoding it is the slowest step of the writer
            size = leb128.encoded_size(codecs.gaps_of(idx)) + 2 * int(idx.size)
            if size >= best[0]:
                continue
        streams = codecs.get(name).encode(idx, new, old, tensor.numel, full_old)
        size = sum(map(len, streams))
        if best is None or size < best[0]:
            best = (size, name, streams)
    assert best is not None
    parts = (
        tuple((part_label(p.name), p.shape[0]) for p in tensor.parts)
        if len(tensor.parts) > 1
        else ()
    )
    return TensorDelta(
        tensor.name, tensor.shape, tensor.numel, int(idx.size), best[1], tuple(best[2]), parts
    )


def _record_bytes(t: TensorDelta) -> bytes:
    rec = {
        "name": t.name,
        "shape": list(t.shape),
        "dtype": "bf16",
        "numel": t.numel,
        "nnz": t.nnz,
        "codec": t.codec,
        "streams": [len(s) for s in t.streams],
    }
    if t.parts:
        rec["parts"] = [list(p) for p in t.parts]
    return _frame(b"T", rec) + b"".join(t.streams)


class RecordFramer:
    """Frames tensor records into ``D_v``: header, records, table, cut into segments, trailer.

    Iterate :meth:`segments` to stream; the last segment is the trailer. Afterwards
    :attr:`delta_id` and :attr:`weights_hash` hold id(D_v) and h(v). :class:`DeltaEncoder`
    supplies the records from weights as it extracts them; :func:`encode_records` from a list.
    """

    def __init__(
        self, *, model: str, version: int, base_hash: str, segment_size: int = DEFAULT_SEGMENT_SIZE
    ) -> None:
        self.header = header_bytes(
            model=model,
            version=version,
            base=version - 1,
            base_hash=base_hash,
            segment_size=segment_size,
        )
        self.key = H(self.header).hex()[:32]
        self.segment_size = segment_size
        self.base_hash = base_hash
        self.delta_id: str | None = None
        self.weights_hash: str | None = None
        self.tensors: list[TensorDelta] = []

    def _records(self) -> Iterator[TensorDelta]:
        yield from self.tensors

    def _payload_pieces(self) -> Iterator[bytes]:
        yield self.header
        offset = len(self.header)
        table = []
        for td in self._records():
            rec = _record_bytes(td)
            table.append(
                {
                    "name": td.name,
                    "offset": offset,
                    "length": len(rec),
                    "nnz": td.nnz,
                    "codec": td.codec,
                }
            )
            offset += len(rec)
            yield rec
        yield _frame(b"E", {"tensors": table})

    def segments(self) -> Iterator[Segment]:
        buf = bytearray()
        seq = offset = 0
        leaves: list[bytes] = []

        def cut(data: bytes) -> Segment:
            nonlocal seq, offset
            leaf = leaf_hash(data)
            leaves.append(leaf)
            seg = Segment(self.key, seq, offset, data, leaf.hex())
            seq += 1
            offset += len(data)
            return seg

        for piece in self._payload_pieces():
            buf += piece
            while len(buf) >= self.segment_size:
                yield cut(bytes(buf[: self.segment_size]))
                del buf[: self.segment_size]
        if buf:
            yield cut(bytes(buf))
        delta_id = merkle_root(leaves)
        h_v = H(bytes.fromhex(self.base_hash), delta_id)
        trailer = (
            TRAILER_MAGIC
            + struct.pack("<QII", offset, self.segment_size, len(leaves))
            + b"".join(leaves)
            + delta_id
            + h_v
            + MAGIC
        )
        self.delta_id, self.weights_hash = delta_id.hex(), h_v.hex()
        yield Segment(self.key, seq, offset, trailer, H(trailer).hex(), trailer=True)


class EncoderOptions(TypedDict, total=False):
    """The keyword arguments of :class:`DeltaEncoder`, for the functions that pass them on."""

    model: Required[str]
    version: Required[int]
    base_hash: Required[str]
    codec: str
    fuse: bool
    segment_size: int
    full: bool


class DeltaEncoder(RecordFramer):
    """Produces ``D_v`` as segments while it extracts, tensor by tensor (cut-through).

    ``old`` and ``new`` map split (transformers) names to bf16 tensors as uint16 arrays; each
    changed (fused) tensor is encoded with the smallest encoding of ``codec``'s family. With
    ``full``, every element of every tensor is written with the ``dense`` encoding, changed or
    not: a dense copy of the new weights in the delta format (the PrimeRL baselines' broadcast,
    still checked against its base and chained like any delta).
    """

    def __init__(
        self,
        old: Mapping[str, np.ndarray],
        new: Mapping[str, np.ndarray],
        *,
        model: str,
        version: int,
        base_hash: str,
        codec: str = codecs.DEFAULT_CODEC,
        fuse: bool = True,
        segment_size: int = DEFAULT_SEGMENT_SIZE,
        full: bool = False,
    ) -> None:
        codecs.get(codec)  # unknown codec: fail before any work
        self.full = full
        if set(old) != set(new):
            raise ValueError(f"old and new weights differ in names: {sorted(set(old) ^ set(new))}")
        super().__init__(
            model=model, version=version, base_hash=base_hash, segment_size=segment_size
        )
        self.old, self.new, self.codec = old, new, codec
        self.layout = fused_layout({k: tuple(v.shape) for k, v in new.items()}, fuse=fuse)

    def _records(self) -> Iterator[TensorDelta]:
        for t in self.layout:
            if self.full:
                idx = np.arange(t.numel, dtype=np.int64)
                new = gather_fused(t, self.new, idx)
                td = encode_tensor(
                    t, idx, new, gather_fused(t, self.old, idx), "dense", self._full(t)
                )
                self.tensors.append(td)
                yield td
                continue
            idx, new = changed_fused(t, self.old, self.new)
            if idx.size == 0:
                continue
            td = encode_tensor(
                t, idx, new, gather_fused(t, self.old, idx), self.codec, self._full(t)
            )
            self.tensors.append(td)
            yield td

    def _full(self, t: FusedTensor) -> Callable[[], np.ndarray]:
        def full() -> np.ndarray:
            flat = [np.asarray(self.old[p.name]).reshape(-1) for p in t.parts]
            return flat[0] if len(flat) == 1 else np.concatenate(flat)

        return full


def encode_records(records: Sequence[TensorDelta], **kw: Any) -> bytes:
    """A whole delta file framing the given records as they are (``model``, ``version``,
    ``base_hash``, ``segment_size`` as for :class:`RecordFramer`): the file verifies, whatever
    the records hold. For re-framing records, and for tests of what a receiver must refuse."""
    framer = RecordFramer(**kw)
    framer.tensors = list(records)
    return b"".join(s.data for s in framer.segments())


def encode_delta(
    old: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray], **kw: Unpack[EncoderOptions]
) -> bytes:
    """The whole delta file as bytes (see :class:`DeltaEncoder` for the arguments)."""
    enc = DeltaEncoder(old, new, **kw)
    return b"".join(s.data for s in enc.segments())
