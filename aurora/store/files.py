"""Files of the Checkpoint Store: atomic writes (temp file, fsync, rename) and delta files.

:mod:`aurora.delta` is pure (bytes in, bytes out); putting those bytes on a disk so that readers
see all or nothing lives here.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from aurora.delta.reader import read_delta
from aurora.delta.records import Delta
from aurora.delta.writer import DeltaEncoder


def write_atomic(path: str | os.PathLike[str], chunks: Iterable[bytes]) -> None:
    """Write to a temporary file beside ``path``, fsync, rename: readers see all or nothing."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_delta(
    path: str | os.PathLike[str],
    old: Mapping[str, np.ndarray],
    new: Mapping[str, np.ndarray],
    **kw: object,
) -> DeltaEncoder:
    """Encode and write ``D_v`` atomically; returns the encoder (ids, hashes, tensors)."""
    enc = DeltaEncoder(old, new, **kw)  # type: ignore[arg-type]
    write_atomic(path, (s.data for s in enc.segments()))
    return enc


def read_delta_file(path: str | os.PathLike[str], **kw: str) -> Delta:
    return read_delta(Path(path).read_bytes(), **kw)
