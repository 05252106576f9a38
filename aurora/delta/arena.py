"""Arenas: the contiguous memory a delta is reassembled in.

A receiver places every segment of ``D_v`` at its byte offset in one contiguous buffer, the
*arena*, so the verified file is parsed where it lies: records and codec streams are views into
the arena, nothing is joined or copied, and the kernel's copy out of the socket is the only copy
a received byte ever makes (:class:`aurora.delta.reassembly.Reassembler` hands out the slots). The
size of ``D_v`` is not known until its trailer arrives (the Trainer streams segments while it is
still extracting), so an arena *reserves* address space for the largest delta a node accepts
(``capacity``) with an anonymous private mapping; the kernel commits a page only when it is first
written, so reserving 64 GiB costs nothing but address space. What costs is that first write to a
page, so a receiver reuses arenas whose pages are committed
(:class:`aurora.transport.arenas.ArenaPool`).
"""

from __future__ import annotations

import mmap
import sys

import numpy as np

DEFAULT_CAPACITY = 64 << 30
"""Address space reserved per arena (bytes): the largest delta a receiver accepts. Dense bf16
weights of a 32B model are 64 GB, so any delta of such a model fits."""


_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)
"""Linux: do not count the reservation against the commit limit (the module only names it from
Python 3.13); other systems commit anonymous pages lazily anyway."""


def reserve(capacity: int = DEFAULT_CAPACITY) -> mmap.mmap:
    """An anonymous private mapping of ``capacity`` bytes, committed page by page on first write."""
    if capacity < 1:
        raise ValueError(f"arena capacity must be >= 1 byte, got {capacity}")
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
    try:
        return mmap.mmap(-1, capacity, flags=flags)
    except OSError as exc:
        raise ValueError(
            f"cannot reserve {capacity / 2**30:.1f} GiB of address space for a receive arena "
            f"({exc}); with vm.overcommit_memory=2 reservations count against the commit limit: "
            "lower the arena capacity (TransportConfig.max_delta_bytes) to the largest delta"
        ) from None


def arena(capacity: int = DEFAULT_CAPACITY) -> memoryview:
    """A writable byte view of a fresh, unpooled arena (unmapped when the last view is gone)."""
    return np.frombuffer(reserve(capacity), dtype=np.uint8).data
