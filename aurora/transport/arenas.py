"""Receive memory that is reused: a pool of arenas (:mod:`aurora.delta.arena`).

Theory of operation
-------------------
Committing fresh pages costs this machine 0.56 ms per MB, as long as the loopback socket
takes to deliver the same bytes, so a receiver that reassembled every delta in new memory would
spend half its time in page faults. The pool hands out arenas whose pages are already committed,
and :meth:`ArenaPool.prefault` commits one at start-up, before the first delta arrives (as
inference engines reserve their KV cache).

An arena goes back to the pool when the last view of it is gone: every view handed out derives
from one owner array, and a finalizer on that array returns the mapping. A staged ``Delta`` whose
streams are views into its arena therefore keeps the arena, and its bytes, alive; a pooled arena
can never be written under a live view, and nobody has to remember to give it back.
"""

from __future__ import annotations

import mmap
import threading
import weakref

import numpy as np

from aurora.delta.arena import DEFAULT_CAPACITY, reserve


class ArenaPool:
    """Arenas of one capacity, reused once every view of them is gone (see the module doc)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, *, keep: int = 2) -> None:
        if keep < 0:
            raise ValueError(f"ArenaPool keep must be >= 0, got {keep}")
        self.capacity = capacity
        self.keep = keep
        """Free arenas kept (with their committed pages); more are unmapped when returned."""
        self._free: list[mmap.mmap] = []
        # Finalizers run on whichever thread drops the last view, and may run inside take() when
        # a collection happens there: reentrant, so that one never waits for itself.
        self._lock = threading.RLock()
        self.reused = 0
        """Arenas handed out again (a counter for tests and logs)."""

    def take(self) -> memoryview:
        """A writable byte view of ``capacity`` bytes; it returns to the pool when unreferenced."""
        with self._lock:
            mapping = self._free.pop() if self._free else None
        if mapping is None:
            mapping = reserve(self.capacity)
        else:
            self.reused += 1
        owner = np.frombuffer(mapping, dtype=np.uint8)
        weakref.finalize(owner, self._give_back, mapping)
        return owner.data

    def _give_back(self, mapping: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(mapping)

    def prefault(self, nbytes: int) -> None:
        """Commit the first ``nbytes`` of a pooled arena now, so that the first delta received
        into it does not pay for fresh pages (0.56 ms per MB on this machine)."""
        if not 0 <= nbytes <= self.capacity:
            raise ValueError(f"prefault of {nbytes} bytes outside the capacity {self.capacity}")
        view = self.take()
        np.frombuffer(view, dtype=np.uint8, count=nbytes).fill(0)
        del view  # back to the pool, pages committed

    @property
    def free(self) -> int:
        """Arenas in the pool now."""
        return len(self._free)
