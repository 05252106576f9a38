"""The Checkpoint Store: periodic full snapshots and the chain of delta checkpoints.

Theory of operation
-------------------
The store is the durable half of "the delta checkpoint is both the transfer and the storage":
every published version's delta ``D_v`` and, every snapshot interval, a full snapshot, so that
any Actor can join (snapshot + tail of the chain) or catch up (the deltas it missed), and the
Ledger can plan either from :meth:`CheckpointStore.sizes`.

Layout under the root (a directory, or any fsspec URL such as ``s3://bucket/job``)::

    deltas/v00000042.delta            D_42, the file format of aurora.delta (records.py)
    snapshots/v00000040.safetensors   bf16 weights of v40, safetensors with BF16 dtype

Names are made from version numbers only; :meth:`CheckpointStore.resolve` is the one way a name
from outside (a peer asking a relay for a file) becomes a path, and it refuses anything that is
not one of these two forms, so nothing outside the root can be named.

Publishing is atomic: on a local directory a temporary file is written, fsynced and renamed
(``aurora.store.files.write_atomic``); on an object store a single PUT is atomic. Artifacts are
immutable: publishing a version again with the same bytes is a no-op, with different bytes an
error. A delta is parsed and verified (segment hashes, Merkle root) before it is stored; a
snapshot's weights hash is recorded in its metadata and checked when it is read.

Snapshots are written in the safetensors format with dtype ``BF16`` by a small writer here,
because numpy has no bfloat16 (weights are handled as uint16 bit patterns, as in aurora.delta);
``safetensors.torch.load`` reads the files as ``torch.bfloat16`` tensors (a test checks it).

Retention (:meth:`CheckpointStore.retain`): keep the newest ``keep`` snapshots whose version is
a multiple of the snapshot interval, and every delta after the oldest snapshot kept; delete the
rest. The newest snapshot and the chain after it are never deleted.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from aurora.delta import Delta, read_delta, weights_hash
from aurora.store.files import write_atomic

_DELTA = re.compile(r"^deltas/v(\d{8})\.delta$")
_SNAPSHOT = re.compile(r"^snapshots/v(\d{8})\.safetensors$")


class StoreError(ValueError):
    """A request the store refuses."""


class UnknownVersionError(StoreError, KeyError):
    """No artifact of that version is in the store."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class PathOutsideRootError(StoreError):
    """A name that does not denote an artifact under the store's root."""


def delta_name(version: int) -> str:
    return f"deltas/v{_check_version(version):08d}.delta"


def snapshot_name(version: int) -> str:
    return f"snapshots/v{_check_version(version):08d}.safetensors"


def _check_version(version: int) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 10**8:
        raise StoreError(f"version must be an int in [0, 1e8), got {version!r}")
    return version


@dataclass(frozen=True)
class Listing:
    """Versions held, ascending."""

    deltas: tuple[int, ...]
    snapshots: tuple[int, ...]


class CheckpointStore:
    """Snapshots and delta chain of one job under ``url`` (a path or an fsspec URL)."""

    def __init__(self, url: str | Path) -> None:
        self.url = str(url)
        self.fs, root = fsspec.core.url_to_fs(self.url)
        self.root = root.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)
        for sub in ("deltas", "snapshots"):
            self.fs.makedirs(f"{self.root}/{sub}", exist_ok=True)

    # -- names --------------------------------------------------------------------------------

    def resolve(self, name: str) -> str:
        """The path of artifact ``name`` (``deltas/v00000042.delta`` or
        ``snapshots/v00000040.safetensors``); anything else is refused."""
        if not isinstance(name, str) or not (_DELTA.match(name) or _SNAPSHOT.match(name)):
            raise PathOutsideRootError(
                f"{name!r} is not an artifact name (deltas/vNNNNNNNN.delta or "
                "snapshots/vNNNNNNNN.safetensors); nothing outside the store root can be named"
            )
        return f"{self.root}/{name}"

    def _put(self, name: str, data: bytes) -> str:
        path = self.resolve(name)
        if self.fs.exists(path):
            if self.fs.cat_file(path) == data:
                return path  # immutable and already there: publishing again is a no-op
            raise StoreError(
                f"{name} already exists with different content (artifacts are immutable)"
            )
        if self.local:
            write_atomic(path, [data])
        else:
            self.fs.pipe_file(path, data)  # one PUT: atomic on object stores
        return path

    def _get(self, name: str, what: str) -> bytes:
        path = self.resolve(name)
        try:
            return bytes(self.fs.cat_file(path))
        except FileNotFoundError:
            raise UnknownVersionError(f"{what} is not in the store at {self.url}") from None

    # -- deltas -------------------------------------------------------------------------------

    def publish_delta(self, data: bytes) -> Delta:
        """Verify and store one delta checkpoint file; returns it parsed."""
        delta = read_delta(data)  # raises a DeltaError for anything it cannot verify
        self._put(delta_name(delta.version), data)
        return delta

    def delta_bytes(self, version: int) -> bytes:
        return self._get(delta_name(version), f"delta D_{version}")

    def delta(self, version: int) -> Delta:
        """D_version, verified."""
        return read_delta(self.delta_bytes(version))

    def chain(self, first: int, last: int) -> list[Delta]:
        """D_first .. D_last in order, verified; refuses a range with a missing link."""
        _check_version(first)
        _check_version(last)
        if first > last:
            raise StoreError(f"empty or reversed range {first}..{last}")
        held = set(self.list().deltas)
        missing = [v for v in range(first, last + 1) if v not in held]
        if missing:
            raise UnknownVersionError(
                f"deltas {missing} of the range {first}..{last} are not in the store"
            )
        return [self.delta(v) for v in range(first, last + 1)]

    # -- snapshots ----------------------------------------------------------------------------

    def publish_snapshot(self, version: int, state: Mapping[str, np.ndarray]) -> str:
        """Store bf16 weights (uint16 bit patterns) of ``version``; returns their weights hash."""
        h = weights_hash(state)
        self._put(
            snapshot_name(version),
            _safetensors_bf16(state, {"version": str(version), "weights_hash": h}),
        )
        return h

    def snapshot(self, version: int) -> tuple[dict[str, np.ndarray], str]:
        """(weights as uint16 bit patterns, weights hash), checked against the recorded hash."""
        data = self._get(snapshot_name(version), f"snapshot of v{version}")
        state, meta = _read_safetensors_bf16(data, f"snapshot v{version}")
        h = weights_hash(state)
        if meta.get("weights_hash") != h or meta.get("version") != str(version):
            raise StoreError(
                f"snapshot v{version} does not match its metadata (hash {h[:16]}.. vs "
                f"{str(meta.get('weights_hash'))[:16]}.., version {meta.get('version')})"
            )
        return state, h

    # -- listing, sizes, retention -------------------------------------------------------------

    def list(self) -> Listing:
        deltas, snaps = [], []
        for sub, pattern, out in (("deltas", _DELTA, deltas), ("snapshots", _SNAPSHOT, snaps)):
            for path in self.fs.ls(f"{self.root}/{sub}", detail=False):
                m = pattern.match(f"{sub}/{Path(path).name}")
                if m:
                    out.append(int(m.group(1)))
        return Listing(tuple(sorted(deltas)), tuple(sorted(snaps)))

    def sizes(self) -> tuple[dict[int, int], dict[int, int]]:
        """(delta bytes per version, snapshot bytes per version): the inputs of
        ``aurora.policy.versions.plan_catch_up``."""
        listing = self.list()
        deltas = {v: int(self.fs.size(self.resolve(delta_name(v)))) for v in listing.deltas}
        snaps = {v: int(self.fs.size(self.resolve(snapshot_name(v)))) for v in listing.snapshots}
        return deltas, snaps

    def retain(self, *, snapshot_interval: int, keep: int = 2) -> list[str]:
        """Apply the retention policy; returns the names deleted."""
        if snapshot_interval < 1 or keep < 1:
            raise StoreError("snapshot_interval and keep must be >= 1")
        listing = self.list()
        periodic = [v for v in listing.snapshots if v % snapshot_interval == 0]
        kept = set(periodic[-keep:])
        if not kept:
            return []  # no periodic snapshot yet: the chain is the only way to join
        oldest = min(kept)
        doomed = [snapshot_name(v) for v in listing.snapshots if v not in kept]
        doomed += [delta_name(v) for v in listing.deltas if v <= oldest]
        for name in doomed:
            self.fs.rm(self.resolve(name))
        return doomed


# ------------------------------------------------------------------------------------------
# safetensors with BF16 from uint16 bit patterns (numpy has no bfloat16)
# ------------------------------------------------------------------------------------------


def _safetensors_bf16(state: Mapping[str, np.ndarray], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    blobs = []
    for name in sorted(state):
        arr = np.ascontiguousarray(state[name])
        if arr.dtype != np.uint16:
            raise StoreError(f"{name}: expected bf16 bit patterns as uint16, got {arr.dtype}")
        raw = arr.astype("<u2", copy=False).tobytes()
        header[name] = {
            "dtype": "BF16",
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format aligns the data to 8 bytes
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def _read_safetensors_bf16(data: bytes, what: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    try:
        (n,) = struct.unpack_from("<Q", data, 0)
        header = json.loads(data[8 : 8 + n])
        body = memoryview(data)[8 + n :]
        meta = header.pop("__metadata__", {})
        state = {}
        for name, info in header.items():
            if info["dtype"] != "BF16":
                raise StoreError(f"{what}: tensor {name} has dtype {info['dtype']}, expected BF16")
            start, end = info["data_offsets"]
            if not 0 <= start <= end <= len(body):
                raise StoreError(f"{what}: tensor {name} lies outside the file")
            arr = np.frombuffer(body[start:end], dtype="<u2").reshape(info["shape"])
            state[name] = arr.copy()
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, StoreError):
            raise
        raise StoreError(f"{what}: not a readable safetensors file ({exc})") from None
    return state, meta
