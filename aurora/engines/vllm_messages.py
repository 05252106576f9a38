"""What crosses between vLLM's driver and its workers for the ``aurora_delta`` backend.

Theory of operation
-------------------
An update carries a whole delta file (:func:`delta_bytes`: the file framed again from its parsed
records, byte for byte) or a snapshot as safetensors bytes (:func:`snapshot_bytes`); over
``vllm serve``'s JSON routes bytes travel as base64, and :func:`bytes_of` takes either. For the
content digest every worker returns its rank's weights (:func:`rank_state_message`) and the
driver puts them in rank order (:func:`ranks_from_messages`), refusing a missing or extra rank.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from aurora.delta import Delta
from aurora.delta.writer import encode_records
from aurora.engines.base import EngineError

if TYPE_CHECKING:  # pragma: no cover
    from aurora.engines.vllm_receiver import DeltaReceiver


def bytes_of(value: bytes | bytearray | memoryview | str, what: str) -> bytes:
    """``value`` as bytes: as it is, or decoded from base64 (JSON carries bytes as text)."""
    if isinstance(value, str):  # JSON (HTTP) carries bytes as base64
        try:
            return base64.b64decode(value, validate=True)
        except ValueError:
            raise EngineError(f"update_info.{what}: not valid base64") from None
    return bytes(value)


def snapshot_bytes(state: Mapping[str, np.ndarray]) -> bytes:
    """Split bf16 bit patterns as safetensors bytes (BF16), what a snapshot update carries."""
    import torch
    from safetensors.torch import save

    return bytes(
        save(
            {
                k: torch.from_numpy(np.ascontiguousarray(v).view(np.int16)).view(torch.bfloat16)
                for k, v in state.items()
            }
        )
    )


def delta_bytes(delta: Delta) -> bytes:
    """The file of a parsed delta, framed again from its records (byte for byte the original:
    the writer is deterministic; the receiver checks it against h(v) anyway)."""
    return encode_records(
        delta.tensors,
        model=delta.model,
        version=delta.version,
        base_hash=delta.base_hash,
        segment_size=delta.segment_size,
    )


def rank_state_message(receiver: DeltaReceiver, *, text: bool = False) -> dict[str, Any]:
    """What a worker returns for :meth:`aurora.engines.vllm.VLLMEngine.weights_digest` (plain
    types for vLLM's RPC; ``text``: the tensors' bytes as base64, for ``vllm serve``'s JSON
    ``/collective_rpc``)."""
    st = receiver.local_state()
    return {
        "rank": receiver.rank,
        "size": receiver.size,
        "version": receiver.version,
        "weights_hash": receiver.weights_hash,
        "tensors": {
            k: (list(v.shape), base64.b64encode(v.tobytes()).decode() if text else v.tobytes())
            for k, v in st.items()
        },
    }


def ranks_from_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, np.ndarray]]:
    """Worker messages (any order, one per rank) -> per-rank states in rank order."""
    by_rank: dict[int, dict[str, np.ndarray]] = {}
    for m in messages:
        st = {
            k: np.frombuffer(bytes_of(b, "tensors"), dtype=np.uint16).reshape(shape)
            for k, (shape, b) in m["tensors"].items()
        }
        by_rank[int(m["rank"])] = st
    size = int(messages[0]["size"]) if messages else 0
    if sorted(by_rank) != list(range(size)):
        raise EngineError(f"weights came back from ranks {sorted(by_rank)} of {size}")
    return [by_rank[r] for r in range(size)]
