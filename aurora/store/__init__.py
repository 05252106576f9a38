"""The Checkpoint Store: full snapshots plus the chain of delta checkpoints (aurora.store.checkpoint)."""

from aurora.store.checkpoint import (
    CheckpointStore,
    PathOutsideRootError,
    StoreError,
    UnknownVersionError,
)

__all__ = ["CheckpointStore", "PathOutsideRootError", "StoreError", "UnknownVersionError"]
