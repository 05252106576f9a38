"""Delta checkpoints: the one artifact that is both AuroraRL's storage and its transfer unit.

Pure data transformation: numpy arrays and bytes in, numpy arrays and bytes out (``hf`` and
``torch_apply`` add torch tensors, importing torch lazily); no files, sockets or subprocesses (a
test walks the imports). Modules, by idea: :mod:`~aurora.delta.extract` (exact changes by 16-bit
pattern), ``leb128``, ``codecs`` and ``dense`` (the encodings the writer picks the smallest of),
``changes`` and ``kernels`` (parsed, checked records and the compiled loops that store them),
``hashing`` (leaf hashes, Merkle id, weights hash chain), ``records``, ``writer``, ``reader`` and
``reassembly`` (the file layout, cut into segments and put back together from untrusted
sources), ``apply`` and ``torch_apply`` (transactional apply with an undo log, numpy or torch),
``tp`` (a tensor-parallel rank's slice), ``arena`` (address space a received delta is assembled
in), ``synthetic`` (an Adam-like step for measurements) and ``errors`` (every refusal is a
:class:`~aurora.delta.errors.DeltaError`).

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
