"""Delta checkpoints: the one artifact that is both AuroraRL's storage and its transfer unit.

Pure data transformation: numpy arrays and bytes in, numpy arrays and bytes out (``hf`` and
``torch_apply`` add torch tensors, importing torch lazily); no files, sockets or subprocesses (a
test walks the imports). Modules, by idea:

* :mod:`~aurora.delta.extract` - exact changes by 16-bit pattern; fused engine names.
* :mod:`~aurora.delta.leb128` - vectorised LEB128 varints (the paper's index encoding).
* :mod:`~aurora.delta.codecs` - ``leb128``, ``aurora`` (default), ``aurora-base`` and the peers';
  the families the writer picks the smallest encoding from.
* :mod:`~aurora.delta.dense` - whole-tensor encodings for dense changes (``dense``,
  ``dense-base``, ``xor-zstd``).
* :mod:`~aurora.delta.changes` - a record parsed and checked, ready to store (numpy) or to
  materialise as indices and values (torch, tensor parallelism).
* :mod:`~aurora.delta.kernels` - the compiled check and fused decode-and-store loops (numba).
* :mod:`~aurora.delta.hashing` - leaf hashes, the Merkle id, the weights hash chain.
* :mod:`~aurora.delta.records` - the file layout's constants and records (segments, deltas).
* :mod:`~aurora.delta.writer` - header, records, table and trailer, cut into segments.
* :mod:`~aurora.delta.reader` - parse and verify a whole file; cut it back into segments.
* :mod:`~aurora.delta.reassembly` - segments from untrusted sources into one verified delta.
* :mod:`~aurora.delta.apply` - transactional apply (every record checked before the first
  write), chains with an undo log.
* :mod:`~aurora.delta.torch_apply` - the same apply into torch tensors by index, any device.
* :mod:`~aurora.delta.tp` - the slice of a fused delta one vLLM tensor-parallel rank holds.
* :mod:`~aurora.delta.arena` - reserved address space that a received delta is assembled in.
* :mod:`~aurora.delta.synthetic` - a synthetic Adam-like step for measurements.
* :mod:`~aurora.delta.errors` - every refusal is a :class:`~aurora.delta.errors.DeltaError`.

The names below are the package's public surface; import them from ``aurora.delta``.
"""

from aurora.delta.apply import apply_chain, apply_delta, decode_delta, prepare_delta, warm_up
from aurora.delta.errors import DeltaError
from aurora.delta.hashing import H, chain_hash, leaf_hash, merkle_root, weights_hash
from aurora.delta.reader import parse_header, read_delta, segments_of
from aurora.delta.reassembly import Reassembler
from aurora.delta.records import DEFAULT_SEGMENT_SIZE, Delta, Segment, TensorDelta
from aurora.delta.torch_apply import apply_delta_torch
from aurora.delta.tp import Sharding, TPRank, vllm_shardings
from aurora.delta.writer import DeltaEncoder, encode_delta, encode_records, header_bytes

__all__ = [
    "DEFAULT_SEGMENT_SIZE",
    "Delta",
    "DeltaEncoder",
    "DeltaError",
    "H",
    "Reassembler",
    "Segment",
    "Sharding",
    "TPRank",
    "TensorDelta",
    "apply_chain",
    "apply_delta",
    "apply_delta_torch",
    "chain_hash",
    "decode_delta",
    "prepare_delta",
    "encode_delta",
    "encode_records",
    "header_bytes",
    "leaf_hash",
    "merkle_root",
    "parse_header",
    "read_delta",
    "segments_of",
    "vllm_shardings",
    "warm_up",
    "weights_hash",
]
