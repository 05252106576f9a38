"""Model manifests: every file of a model other than its weights, pinned by content hash.

A model is more than its weights: the config (architecture, special token ids), the tokenizer
files (which id is which text: a tokenizer that swaps "1" and "7" changes every answer), the chat
template and the generation config change what the weights compute and what their output means.
The weights are pinned by the Trainer's signed snapshot announcements; the rest by a manifest:
the BLAKE3 hash of every file of the model directory but its weights (:func:`is_weights`, which
a snapshot replaces), keyed by its path in the directory. The Trainer signs the hash of the
manifest's canonical bytes into every snapshot announcement (``model_hash``,
:mod:`aurora.delta.announce`) and the Checkpoint Store keeps the manifest beside the snapshot;
every role that loads the job's model, and ``aurora export``, hashes what it loads and refuses
a difference in one line naming the first file that differs (:func:`difference`). What is hashed
is what is loaded (:func:`pinned_copy`).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from aurora.delta.hashing import HASH_BYTES, H

FORMAT = "aurora-model-manifest/1"
"""The ``format`` field of a manifest's canonical bytes."""
MAX_BYTES = 1 << 20
"""Longest manifest read (bytes): a parser refuses longer input before reading it."""
MAX_FILES = 10_000
"""Most files one manifest may name."""
WEIGHT_SUFFIXES = (
    ".safetensors",
    ".safetensors.index.json",
    ".bin",
    ".bin.index.json",
    ".pt",
    ".pth",
    ".ckpt",
    ".gguf",
    ".h5",
    ".msgpack",
    ".onnx",
)
"""Files holding weights (or the index of weight shards): replaced by the signed snapshot, so
not in the manifest."""
RECORD_FILES = ("aurora.announce", "aurora.manifest")
"""The signed record a model directory written by the Trainer carries (its snapshot
announcement and manifest, :func:`aurora.models.sign_model_dir`): about the model, not of it,
so never in a manifest."""
_HEX = re.compile(r"^[0-9a-f]{64}$")


class ModelMismatchError(ValueError):
    """Model files that are not the ones the Trainer signed; the message names the file."""


def is_weights(path: str) -> bool:
    """Whether ``path`` (in a model directory) holds weights or the index of weight shards."""
    return path.endswith(WEIGHT_SUFFIXES)


def files_of(directory: Path) -> list[str]:
    """Paths (posix, relative) of the files of ``directory`` a manifest covers (weights too),
    sorted."""
    out = []
    for root, dirs, names in os.walk(directory, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            rel = (Path(root) / name).relative_to(directory).as_posix()
            if not name.startswith(".") and rel not in RECORD_FILES:
                out.append(rel)
    return sorted(out)


def file_hash(path: Path) -> str:
    """BLAKE3 of a file's bytes, hex."""
    return H(path.read_bytes()).hex()


def manifest_of(directory: str | os.PathLike[str]) -> dict[str, str]:
    """``{path: BLAKE3 hex}`` of every file of ``directory`` but its weights and dot-files."""
    root = Path(directory)
    if not root.is_dir():
        raise ModelMismatchError(f"model path {root} is not a directory")
    return {p: file_hash(root / p) for p in files_of(root) if not is_weights(p)}


def builtin(name: str, definition: Mapping[str, object]) -> dict[str, str]:
    """The manifest of a model built from code: one ``builtin:NAME`` entry, the hash of its
    ``definition`` (JSON-able: whatever the model is built from)."""
    text = json.dumps(definition, sort_keys=True, separators=(",", ":")).encode()
    return {f"builtin:{name}": H(text).hex()}


def encode(files: Mapping[str, str]) -> bytes:
    """The canonical bytes of a manifest (sorted JSON, ASCII, no spaces)."""
    _check(dict(files), "manifest")
    body = {"format": FORMAT, "files": dict(sorted(files.items()))}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("ascii")


def digest(files: Mapping[str, str]) -> str:
    """The hash a snapshot announcement signs: BLAKE3 of :func:`encode`, hex."""
    return H(encode(files)).hex()


def decode(data: bytes, *, what: str = "manifest") -> dict[str, str]:
    """The files of a manifest's canonical bytes; ValueError (one line) for anything else."""
    if len(data) > MAX_BYTES:
        raise ModelMismatchError(f"{what}: {len(data)} bytes, more than a manifest holds")
    try:
        body = json.loads(data.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise ModelMismatchError(f"{what}: not a model manifest (not ASCII JSON)") from None
    if (
        not isinstance(body, dict)
        or body.get("format") != FORMAT
        or set(body)
        != {
            "format",
            "files",
        }
    ):
        raise ModelMismatchError(f"{what}: not a model manifest ({FORMAT})")
    files = body["files"]
    _check(files, what)
    if encode(files) != data:
        raise ModelMismatchError(f"{what}: not in canonical form")
    return dict(files)


def _check(files: object, what: str) -> None:
    if not isinstance(files, dict) or len(files) > MAX_FILES:
        raise ModelMismatchError(f"{what}: files must be a map of at most {MAX_FILES}")
    for name, value in files.items():
        if not isinstance(name, str) or not name or len(name) > 1024 or "\\" in name:
            raise ModelMismatchError(f"{what}: bad file name {str(name)[:80]!r}")
        if name.startswith("/") or ".." in name.split("/"):
            raise ModelMismatchError(f"{what}: file name {name[:80]!r} leaves the directory")
        if not isinstance(value, str) or not _HEX.match(value):
            raise ModelMismatchError(f"{what}: {name[:80]}: not a {HASH_BYTES}-byte hex hash")


def difference(actual: Mapping[str, str], signed: Mapping[str, str]) -> str | None:
    """The first file (sorted) in which ``actual`` differs from ``signed``, said in a few words,
    or None when they are the same."""
    for name in sorted(set(actual) | set(signed)):
        have, want = actual.get(name), signed.get(name)
        if want is None:
            return f"{name} is not in the model the Trainer signed"
        if have is None:
            return f"{name} is missing (the Trainer signed it)"
        if have != want:
            return (
                f"{name} differs from the model the Trainer signed "
                f"(blake3 {have[:12]}.., signed {want[:12]}..)"
            )
    return None


def check(actual: Mapping[str, str], signed: Mapping[str, str], *, where: str) -> None:
    """Raise :class:`ModelMismatchError` (one line naming ``where`` and the file) unless the
    model files ``actual`` are the ``signed`` ones."""
    diff = difference(actual, signed)
    if diff is not None:
        raise ModelMismatchError(f"model {where}: {diff}; refusing to use it")


_PRIVATE: list[str] = []


@atexit.register
def _remove_private() -> None:
    for d in _PRIVATE:
        shutil.rmtree(d, ignore_errors=True)


def pinned_copy(directory: str | os.PathLike[str]) -> tuple[Path, dict[str, str]]:
    """``(private copy, its manifest)`` of model directory ``directory``: every file the
    manifest covers copied into a directory only this process writes (removed at exit), the
    weights linked, dot-files and a signed record (:data:`RECORD_FILES`) left out, and the
    manifest hashed from the copies. Load from the copy:
    what was hashed is what is loaded.

    A file changed between the check and the load is not the file loaded. Every file is pinned
    but those whose path has a part starting with a dot (``.gitattributes``, a download cache:
    nothing a loader reads), so a file added (an injected ``chat_template.jinja``) is refused as
    a changed one is. A model without a directory (the built-in tiny Qwen3) is pinned by one
    ``builtin:NAME`` entry (:func:`builtin`), the hash of the definition it is built from; a
    backend with no model pins no file.
    """
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise ModelMismatchError(f"model path {root} is not a directory")
    private = Path(tempfile.mkdtemp(prefix="aurora-model-"))
    _PRIVATE.append(str(private))
    files: dict[str, str] = {}
    for rel in files_of(root):
        src, dst = root / rel, private / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if is_weights(rel):
            dst.symlink_to(src.resolve())
            continue
        data = src.read_bytes()
        dst.write_bytes(data)
        files[rel] = H(data).hex()
    return private, files
