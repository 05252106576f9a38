"""Files of the Checkpoint Store: atomic and exclusive writes, temp-file hygiene, delta files.

:mod:`aurora.delta` is pure (bytes in, bytes out); putting those bytes on a disk so that readers
see all or nothing lives here.

* :func:`write_atomic` - temp file, fsync, rename: readers see the old file or the new one.
* :func:`write_csv` - a table of dict rows, written atomically.
* :func:`write_exclusive` - temp file, fsync, then a hard link to the final name, which the
  kernel creates only if the name is free: of two publishers of one name exactly one wins.
* Temp files are named ``.NAME.tmp.HOST.PID.RANDOM`` so that :func:`clean_temp_files` can
  remove those a crashed (killed) writer on this host left, without touching one a live
  writer is still filling.
"""

from __future__ import annotations

import csv
import io
import os
import re
import socket
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Unpack

import numpy as np

from aurora.delta.reader import read_delta
from aurora.delta.records import Delta
from aurora.delta.writer import DeltaEncoder, EncoderOptions

_TEMP = re.compile(r"^\.(?P<name>[^/]+)\.tmp\.(?P<host>[^.]*)\.(?P<pid>\d+)\.[^.]+$", re.ASCII)
STALE_TEMP_S = 3600.0
"""A temp file of another host (or an unknown writer) older than this (s) is a crash's."""


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64] or "host"


def _temp(path: Path) -> tuple[int, str]:
    return tempfile.mkstemp(prefix=f".{path.name}.tmp.{_host()}.{os.getpid()}.", dir=path.parent)


def _fsync_dir(directory: Path) -> None:
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _write_temp(path: Path, chunks: Iterable[bytes | bytearray | memoryview]) -> str:
    fd, tmp = _temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return tmp


def write_atomic(
    path: str | os.PathLike[str], chunks: Iterable[bytes | bytearray | memoryview]
) -> None:
    """Write to a temporary file beside ``path``, fsync, rename: readers see all or nothing.

    The rename replaces what is there (for files that are rewritten, like a Trainer's
    checkpoint).
    """
    path = Path(path)
    tmp = _write_temp(path, chunks)
    try:
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_csv(path: str | os.PathLike[str], rows: Sequence[Mapping[str, Any]]) -> None:
    """``rows`` as CSV (columns in the first row's order, a header, then one line per row;
    nothing at all for no rows), written with :func:`write_atomic`.

    Used for the result files of a simulated or real run.
    """
    text = io.StringIO(newline="")
    if rows:
        writer = csv.DictWriter(text, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    write_atomic(path, [text.getvalue().encode()])


def write_exclusive(path: str | os.PathLike[str], data: bytes) -> bool:
    """Publish ``data`` under ``path`` unless the name is taken: True when written, False when
    the same bytes are there already; FileExistsError when different bytes are.

    Of two publishers of one name exactly one wins, at once and whole; the loser compares
    bytes (the same bytes again is a no-op) instead of silently overwriting.
    """
    path = Path(path)
    tmp = _write_temp(path, [data])
    try:
        os.link(tmp, path)  # atomic: fails if the name exists, whoever made it a moment ago
    except FileExistsError:
        with open(path, "rb") as f:
            same = f.read() == data
        if same:
            return False
        raise FileExistsError(f"{path} exists with different content") from None
    finally:
        os.unlink(tmp)
    _fsync_dir(path.parent)
    return True


def clean_temp_files(directory: str | os.PathLike[str], now: float | None = None) -> list[str]:
    """Remove temp files a crashed writer left in ``directory``: this host's whose process is
    gone, and any older than ``STALE_TEMP_S``. Returns the names removed."""
    now = time.time() if now is None else now
    removed = []
    host = _host()
    for entry in os.scandir(directory):
        m = _TEMP.match(entry.name)
        if m is None or not entry.is_file(follow_symlinks=False):
            continue
        pid = int(m.group("pid"))
        dead = m.group("host") == host and not _alive(pid)
        if dead or now - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMP_S:
            try:
                os.unlink(entry.path)
                removed.append(entry.name)
            except FileNotFoundError:
                pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_delta(
    path: str | os.PathLike[str],
    old: Mapping[str, np.ndarray],
    new: Mapping[str, np.ndarray],
    **kw: Unpack[EncoderOptions],
) -> DeltaEncoder:
    """Encode and write ``D_v`` atomically; returns the encoder (ids, hashes, tensors)."""
    enc = DeltaEncoder(old, new, **kw)
    write_atomic(path, (s.data for s in enc.segments()))
    return enc


def read_delta_file(path: str | os.PathLike[str], **kw: str) -> Delta:
    return read_delta(Path(path).read_bytes(), **kw)
