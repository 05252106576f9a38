"""Inference engines behind one protocol (:mod:`aurora.engines.base`).

* :mod:`~aurora.engines.base` - :class:`Engine`, :class:`Sampling`, :class:`Completion`, the
  canonical fused digest of weights.
* :mod:`~aurora.engines.transformers` - :class:`TransformersEngine` (CPU, or CUDA if present).
"""

from aurora.engines.base import (
    Completion,
    Engine,
    Sampling,
    canonical_state,
    weights_digest_of,
)
from aurora.engines.transformers import EngineError, TransformersEngine

__all__ = [
    "Completion",
    "Engine",
    "EngineError",
    "Sampling",
    "TransformersEngine",
    "canonical_state",
    "weights_digest_of",
]
