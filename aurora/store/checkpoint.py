"""The Checkpoint Store: periodic full snapshots and the chain of delta checkpoints.

The store is the durable half of "the delta checkpoint is both the transfer and the storage":
every published version's delta ``D_v`` and, every snapshot interval, a full snapshot, each with
the Trainer's signed announcement beside it, so that any Actor can join (snapshot + tail of the
chain) or catch up (the deltas it missed), and the Ledger can plan either from
:meth:`CheckpointStore.sizes`. The layout under the root (a directory or an fsspec URL) is at
:class:`CheckpointStore`; names are made from version numbers only and
:meth:`CheckpointStore.resolve` refuses any other name, so nothing outside the root can be
named. The store is untrusted (docs/ARCHITECTURE.md, "Trust"): a joiner reads through the
``verified_*`` methods, which check every artifact against the Trainer's signed announcement, so
a snapshot and chain fetched from any mirror are the Trainer's or are refused. Publishing is
atomic and exclusive (of two publishers of one version exactly one wins); retention
(:meth:`CheckpointStore.retain`) never deletes the newest snapshot or the chain after it.
"""

from __future__ import annotations

import builtins
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
from aurora.delta.announce import (
    AnnouncementError,
    SnapshotAnnouncement,
    VersionAnnouncement,
    describe_delta,
    sign,
    verify,
)
from aurora.delta.errors import DeltaError
from aurora.delta.hashing import H
from aurora.store import manifest
from aurora.store.files import clean_temp_files, write_exclusive

_DELTA = re.compile(r"deltas/v([0-9]{8})\.delta", re.ASCII)
_SNAPSHOT = re.compile(r"snapshots/v([0-9]{8})\.safetensors", re.ASCII)
_ANNOUNCE = re.compile(r"(deltas|snapshots)/v([0-9]{8})\.announce", re.ASCII)
_MANIFEST = re.compile(r"snapshots/v([0-9]{8})\.manifest", re.ASCII)


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


def manifest_name(version: int) -> str:
    """``snapshots/vNNNNNNNN.manifest``: the model manifest signed with that snapshot."""
    return f"snapshots/v{_check_version(version):08d}.manifest"


def announcement_name(version: int, kind: str) -> str:
    """``deltas/vNNNNNNNN.announce`` or ``snapshots/vNNNNNNNN.announce``."""
    if kind not in ("deltas", "snapshots"):
        raise StoreError(f"announcement kind must be 'deltas' or 'snapshots', got {kind!r}")
    return f"{kind}/v{_check_version(version):08d}.announce"


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
    """Snapshots and delta chain of one job under ``url`` (a path or an fsspec URL).

    ``job`` and ``public_key`` (the job's Ed25519 key, 32 raw bytes) are needed to store or
    read signed announcements; a joiner reading from an untrusted mirror passes them.

    Layout under the root (a directory, or any fsspec URL such as ``s3://bucket/job``)::

        deltas/v00000042.delta            D_42, the file format of aurora.delta (records.py)
        deltas/v00000042.announce         the Trainer's signed announcement of D_42
        snapshots/v00000040.safetensors   bf16 weights of v40, safetensors with BF16 dtype
        snapshots/v00000040.announce      the Trainer's signed announcement of that snapshot
        snapshots/v00000040.manifest      the model's other files (config, tokenizer, chat
                                          template) by content hash, whose hash that
                                          announcement signs (aurora.store.manifest)

    A joiner opens the store with the job's id and public key and reads through
    :meth:`verified_delta` / :meth:`verified_snapshot`, which check every artifact against the
    Trainer's signed announcement stored beside it; :meth:`verified_manifest` gives the model
    files the Trainer signed with a snapshot, which a role checks the model it loads against.

    Publishing is atomic and exclusive: on a local directory a temporary file is written,
    fsynced and hard-linked to its name, which the kernel does only if the name is free
    (``aurora.store.files.write_exclusive``); of two publishers of one version exactly one wins,
    and the other gets an error naming the artifact unless its bytes are the same (then it is a
    no-op). On an object store a single PUT is atomic, but exclusivity is a check before the PUT
    (fsspec has no portable conditional write). Temp files a crashed publisher left are removed
    when a store is opened. A delta is parsed and verified (segment hashes, Merkle root) before
    it is stored; a snapshot's weights hash is recorded in its metadata and checked when it is
    read.

    Snapshots are written in the safetensors format with dtype ``BF16`` by a small writer here,
    because numpy has no bfloat16 (weights are handled as uint16 bit patterns, as in
    aurora.delta); ``safetensors.torch.load`` reads the files as ``torch.bfloat16`` tensors (a
    test checks it).
    """

    def __init__(
        self, url: str | Path, *, job: str | None = None, public_key: bytes | None = None
    ) -> None:
        self.url = str(url)
        self.job, self.public_key = job, public_key
        self.fs, root = fsspec.core.url_to_fs(self.url)
        self.root = root.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)
        self.cleaned: list[str] = []
        """Temp files of crashed publishers removed when the store was opened."""
        for sub in ("deltas", "snapshots"):
            self.fs.makedirs(f"{self.root}/{sub}", exist_ok=True)
            if self.local:
                self.cleaned += [f"{sub}/{n}" for n in clean_temp_files(f"{self.root}/{sub}")]

    # -- names --------------------------------------------------------------------------------

    def resolve(self, name: str) -> str:
        """The path of artifact ``name`` (``deltas/v00000042.delta``,
        ``snapshots/v00000040.safetensors``, either's ``.announce``, or a snapshot's
        ``.manifest``); anything else is refused, and so is a local path that runs through a
        symbolic link.

        This is the one way a name from outside (a peer asking a relay for a file) becomes a
        path: it refuses anything that is not one of these forms exactly (ASCII digits, nothing
        after the extension, not even a newline), so nothing outside the root can be named; on a
        local directory a name whose path runs through a symbolic link is refused too, so a link
        planted under the root cannot lead out of it.
        """
        if not isinstance(name, str) or not (
            _DELTA.fullmatch(name)
            or _SNAPSHOT.fullmatch(name)
            or _ANNOUNCE.fullmatch(name)
            or _MANIFEST.fullmatch(name)
        ):
            raise PathOutsideRootError(
                f"{name[:80] if isinstance(name, str) else name!r} is not an artifact name "
                "(deltas/vNNNNNNNN.delta, snapshots/vNNNNNNNN.safetensors, .announce or "
                ".manifest); nothing outside the store root can be named"
            )
        path = f"{self.root}/{name}"
        if self.local:
            for p in (Path(self.root) / name.split("/")[0], Path(path)):
                if p.is_symlink():
                    raise PathOutsideRootError(
                        f"{name}: {p} is a symbolic link; nothing outside the store root can be "
                        "named"
                    )
        return path

    def _put(self, name: str, data: bytes) -> str:
        path = self.resolve(name)
        if self.local:
            try:
                write_exclusive(path, data)
            except FileExistsError:
                raise StoreError(
                    f"{name} already exists with different content (artifacts are immutable)"
                ) from None
            return path
        if self.fs.exists(path):
            if self.fs.cat_file(path) == data:
                return path  # immutable and already there: publishing again is a no-op
            raise StoreError(
                f"{name} already exists with different content (artifacts are immutable)"
            )
        self.fs.pipe_file(path, data)  # one PUT: atomic on object stores
        return path

    def _get(self, name: str, what: str) -> bytes:
        path = self.resolve(name)
        try:
            return bytes(self.fs.cat_file(path))
        except FileNotFoundError:
            raise UnknownVersionError(f"{what} is not in the store at {self.url}") from None

    # -- announcements --------------------------------------------------------------------------

    def _trust(self) -> tuple[str, bytes]:
        if self.job is None or self.public_key is None:
            raise StoreError(
                f"the store at {self.url} was opened without the job id and public key: it "
                "cannot check signed announcements"
            )
        return self.job, self.public_key

    def announcement(self, version: int, kind: str = "deltas") -> bytes:
        """The signed announcement of ``D_version`` (``kind="snapshots"``: of the snapshot), as
        stored (unverified bytes: hand them to a Node, or use the ``verified_*`` readers)."""
        return self._get(announcement_name(version, kind), f"the announcement of {kind} v{version}")

    def _verified_announcement(
        self, version: int, kind: str
    ) -> VersionAnnouncement | SnapshotAnnouncement:
        job, key = self._trust()
        signed = self.announcement(version, kind)
        try:
            ann = verify(signed, key, job=job)
        except AnnouncementError as exc:
            raise StoreError(f"{announcement_name(version, kind)}: {exc}") from None
        if ann.version != version:
            raise StoreError(
                f"{announcement_name(version, kind)} announces v{ann.version}, not v{version}"
            )
        return ann

    def verified_delta(self, version: int) -> tuple[Delta, VersionAnnouncement]:
        """D_version and its announcement, the file checked against the Trainer's signature:
        what a joiner reads from a store it does not trust."""
        ann = self._verified_announcement(version, "deltas")
        assert isinstance(ann, VersionAnnouncement)
        data = self.delta_bytes(version)
        if len(data) != ann.size:
            raise StoreError(f"{delta_name(version)} is {len(data)} bytes, announced {ann.size}")
        try:
            delta = read_delta(data, expected_id=ann.delta_id, expected_hash=ann.weights_hash)
        except DeltaError as exc:
            raise StoreError(
                f"{delta_name(version)} does not match its announcement: {exc}"
            ) from None
        return delta, ann

    def verified_snapshot(self, version: int) -> tuple[dict[str, np.ndarray], SnapshotAnnouncement]:
        """The snapshot of ``version`` and its announcement, checked against the Trainer's
        signature (size and weights hash); ``ann.chain_hash`` is the h(v) the next delta names."""
        ann = self._verified_announcement(version, "snapshots")
        assert isinstance(ann, SnapshotAnnouncement)
        data = self._get(snapshot_name(version), f"snapshot of v{version}")
        if len(data) != ann.size:
            raise StoreError(f"{snapshot_name(version)} is {len(data)} bytes, announced {ann.size}")
        state, h = self._snapshot_from(data, version)
        if h != ann.weights_hash:
            raise StoreError(
                f"{snapshot_name(version)} hashes to {h[:16]}.., "
                f"announced {ann.weights_hash[:16]}.."
            )
        return state, ann

    def verified_manifest(self, version: int) -> dict[str, str]:
        """The model files (``{path: BLAKE3 hex}``, :mod:`aurora.store.manifest`) the Trainer
        signed with the snapshot of ``version``: the stored manifest, checked against the hash
        its signed announcement carries."""
        ann = self._verified_announcement(version, "snapshots")
        assert isinstance(ann, SnapshotAnnouncement)
        name = manifest_name(version)
        data = self._get(name, f"the model manifest of snapshot v{version}")
        if H(data).hex() != ann.model_hash:
            raise StoreError(
                f"{name} hashes to {H(data).hex()[:16]}.., its snapshot's announcement signs "
                f"{ann.model_hash[:16]}.."
            )
        try:
            return manifest.decode(data, what=name)
        except ValueError as exc:
            raise StoreError(str(exc)) from None

    def model_manifest(self) -> dict[str, str]:
        """:meth:`verified_manifest` of the newest snapshot that has its announcement (one
        being published may not yet): the model files the Trainer signed. UnknownVersionError
        when no snapshot has."""
        for v in reversed(self.list().snapshots):
            try:
                self.announcement(v, "snapshots")
            except UnknownVersionError:
                continue
            return self.verified_manifest(v)
        raise UnknownVersionError(f"no signed snapshot is in the store at {self.url}")

    # -- deltas -------------------------------------------------------------------------------

    def publish_delta(
        self,
        data: bytes,
        *,
        announcement: bytes | None = None,
        signing_key: bytes | None = None,
    ) -> Delta:
        """Verify and store one delta checkpoint file; returns it parsed. With
        ``announcement`` (signed bytes) or ``signing_key`` (the Trainer's: it signs one), the
        announcement is checked to describe this very file and stored beside it."""
        delta = read_delta(data)  # raises a DeltaError for anything it cannot verify
        signed = announcement
        if signing_key is not None and signed is None:
            job, _ = self._trust()
            signed = sign(describe_delta(job, data), signing_key)
        if signed is not None:
            job, key = self._trust()
            ann = verify(signed, key, job=job)
            if ann != describe_delta(job, data):
                raise StoreError(
                    f"the announcement of v{ann.version} does not describe this delta file"
                )
        self._put(delta_name(delta.version), data)
        if signed is not None:
            self._put(announcement_name(delta.version, "deltas"), bytes(signed))
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

    def publish_snapshot(
        self,
        version: int,
        state: Mapping[str, np.ndarray],
        *,
        chain_hash: str | None = None,
        signing_key: bytes | None = None,
        model: Mapping[str, str] | None = None,
    ) -> str:
        """Store bf16 weights (uint16 bit patterns) of ``version``; returns their weights hash.
        With ``signing_key`` (the Trainer's) and ``chain_hash`` (h(v) of the delta chain at
        ``version``; for v0 the weights hash itself) a signed snapshot announcement is stored
        beside it, signing ``model``, the manifest of the model's other files (None: no file,
        as for a backend without a model), which is stored beside it too."""
        h = weights_hash(state)
        data = _safetensors_bf16(state, {"version": str(version), "weights_hash": h})
        signed = listed = None
        if signing_key is not None:
            job, _ = self._trust()
            listed = manifest.encode(model or {})
            ann = SnapshotAnnouncement(
                job=job,
                version=version,
                weights_hash=h,
                chain_hash=chain_hash if chain_hash is not None else h,
                size=len(data),
                model_hash=H(listed).hex(),
            )
            signed = sign(ann, signing_key)
        self._put(snapshot_name(version), data)
        if signed is not None and listed is not None:
            # The manifest before the announcement: a reader that finds the announcement finds
            # what it signs.
            self._put(manifest_name(version), listed)
            self._put(announcement_name(version, "snapshots"), signed)
        return h

    def snapshot(self, version: int) -> tuple[dict[str, np.ndarray], str]:
        """(weights as uint16 bit patterns, weights hash), checked against the recorded hash."""
        data = self._get(snapshot_name(version), f"snapshot of v{version}")
        return self._snapshot_from(data, version)

    def _snapshot_from(self, data: bytes, version: int) -> tuple[dict[str, np.ndarray], str]:
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
        deltas: list[int] = []
        snaps: list[int] = []
        for sub, pattern, out in (("deltas", _DELTA, deltas), ("snapshots", _SNAPSHOT, snaps)):
            for path in self.fs.ls(f"{self.root}/{sub}", detail=False):
                m = pattern.fullmatch(f"{sub}/{Path(path).name}")
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

    def size_of(self, kind: str, version: int) -> int | None:
        """Bytes of one stored ``delta`` or ``snapshot`` (None if absent): one stat, where
        :meth:`sizes` lists the whole store (the Trainer asks at every snapshot and
        re-announcement, so a listing would cost time growing with the job)."""
        if kind not in ("delta", "snapshot"):
            raise StoreError(f"kind must be delta or snapshot, got {kind!r}")
        path = self.resolve(delta_name(version) if kind == "delta" else snapshot_name(version))
        try:
            return int(self.fs.size(path))
        except FileNotFoundError:
            return None

    # builtins.list: in the class body ``list`` is the method above
    def retain(self, *, snapshot_interval: int, keep: int = 2) -> builtins.list[str]:
        """Apply the retention policy; returns the names deleted.

        Keep the newest ``keep`` snapshots whose version is a multiple of the snapshot interval,
        and every delta after the oldest snapshot kept; delete the rest. The newest snapshot and
        the chain after it are never deleted.
        """
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
            kind, rest = name.split("/")
            beside = [f"{kind}/{rest.split('.')[0]}.announce"]
            if kind == "snapshots":
                beside.append(f"{kind}/{rest.split('.')[0]}.manifest")
            for other in beside:
                if self.fs.exists(self.resolve(other)):
                    self.fs.rm(self.resolve(other))
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
