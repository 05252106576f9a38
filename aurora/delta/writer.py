"""Writing a delta checkpoint: tensor by tensor, cut into segments while extraction runs.

The header (model id, v, base v-1, h(v-1), segment size) is known before extraction starts, so
:class:`DeltaEncoder` produces the payload tensor by tensor and cuts it into fixed-size segments
as it goes (cut-through, paper Figure 7); the trailer, with every leaf hash, ``id(D_v)`` and
``h(v)``, comes last. Writing the bytes to a file is the Checkpoint Store's job
(:mod:`aurora.store.files`); this module only produces them.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping

import numpy as np

from aurora.delta import codecs
from aurora.delta.extract import FusedTensor, changed_fused, fused_layout, gather_fused
from aurora.delta.hashing import H, leaf_hash, merkle_root
from aurora.delta.records import (
    DEFAULT_SEGMENT_SIZE,
    FORMAT_VERSION,
    HASH_BYTES,
    MAGIC,
    SMALL_TENSOR_NNZ,
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


def encode_tensor(
    tensor: FusedTensor,
    idx: np.ndarray,
    new: np.ndarray,
    old: np.ndarray,
    codec: str,
) -> TensorDelta:
    """Encode one tensor's change (``old``: the base bits at ``idx``); tiny ones fall back to
    ``leb128`` when that is smaller."""
    chosen = codecs.get(codec)
    streams = chosen.encode(idx, new, old, tensor.numel)
    if idx.size < SMALL_TENSOR_NNZ and chosen.name in ("aurora", "aurora-base"):
        alt = codecs.CODECS["leb128"].encode(idx, new, old, tensor.numel)
        if sum(map(len, alt)) < sum(map(len, streams)):
            chosen, streams = codecs.CODECS["leb128"], alt
    return TensorDelta(
        tensor.name, tensor.shape, tensor.numel, int(idx.size), chosen.name, tuple(streams)
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
    return _frame(b"T", rec) + b"".join(t.streams)


class DeltaEncoder:
    """Produces ``D_v`` as segments while it extracts, tensor by tensor (cut-through).

    ``old`` and ``new`` map split (transformers) names to bf16 tensors as uint16 arrays. Iterate
    :meth:`segments` to stream; the last segment is the trailer. Afterwards :attr:`delta_id`
    and :attr:`weights_hash` hold id(D_v) and h(v).
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
    ) -> None:
        codecs.get(codec)  # unknown codec: fail before any work
        if set(old) != set(new):
            raise ValueError(f"old and new weights differ in names: {sorted(set(old) ^ set(new))}")
        self.old, self.new, self.codec = old, new, codec
        self.layout = fused_layout({k: tuple(v.shape) for k, v in new.items()}, fuse=fuse)
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

    def _payload_pieces(self) -> Iterator[bytes]:
        yield self.header
        offset = len(self.header)
        table = []
        for t in self.layout:
            idx, new = changed_fused(t, self.old, self.new)
            if idx.size == 0:
                continue
            td = encode_tensor(t, idx, new, gather_fused(t, self.old, idx), self.codec)
            self.tensors.append(td)
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


def encode_delta(
    old: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray], **kw: object
) -> bytes:
    """The whole delta file as bytes (see :class:`DeltaEncoder` for the arguments)."""
    enc = DeltaEncoder(old, new, **kw)  # type: ignore[arg-type]
    return b"".join(s.data for s in enc.segments())
