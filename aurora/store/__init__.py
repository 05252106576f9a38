"""The Checkpoint Store: full snapshots plus the delta chain (see aurora.store.checkpoint)."""

from aurora.store.checkpoint import (
    CheckpointStore,
    PathOutsideRootError,
    StoreError,
    UnknownVersionError,
)

__all__ = ["CheckpointStore", "PathOutsideRootError", "StoreError", "UnknownVersionError"]
