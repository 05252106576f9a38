"""Where a result came from: the git SHA of the code that produced it, and digests that say
whether a stored result was produced by the same code from the same resolved configuration
(so a sweep never reuses a row computed by other code or other settings)."""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def git_sha() -> str:
    """SHA of the checkout this code runs from, with ``-dirty`` for uncommitted changes;
    ``unknown`` outside a git checkout."""
    try:
        sha = _git("rev-parse", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


@functools.cache
def code_version() -> str:
    """The code's version as a result's reuse key needs it: the SHA, and for a dirty tree a
    digest of the uncommitted changes too (``<sha>-dirty-<digest>``), so two different edits of
    one commit are two versions. Looked up once per process: the code a process runs does not
    change under it."""
    sha = git_sha()
    if not sha.endswith("-dirty"):
        return sha
    try:
        diff = _git("diff", "HEAD", "--no-ext-diff", "--binary")
    except (OSError, subprocess.CalledProcessError):
        return sha
    return f"{sha}-{hashlib.blake2b(diff.encode(), digest_size=6).hexdigest()}"


def canonical(value: Any) -> Any:
    """``value`` (a resolved config: dataclasses, enums, mappings, sequences, numbers, paths,
    arrays) as plain JSON data, the same for equal configs whatever their dicts' order."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: canonical(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"__type__": type(value).__qualname__, **fields}
    if isinstance(value, enum.Enum):
        return canonical(value.value)
    if isinstance(value, Mapping):
        return {str(k): canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((canonical(v) for v in value), key=repr)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return repr(value)  # exact: 0.1 and 0.1000000001 differ, nan equals nan
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tobytes") and hasattr(value, "dtype"):  # a numpy array
        body = hashlib.blake2b(value.tobytes(), digest_size=16).hexdigest()
        return {"__array__": str(value.dtype), "shape": list(value.shape), "bytes": body}
    if hasattr(value, "__dict__"):
        return {"__type__": type(value).__qualname__, **canonical(vars(value))}
    raise TypeError(f"cannot digest a {type(value).__qualname__} in a configuration")


def config_digest(config: Any) -> str:
    """A digest of the whole resolved configuration (16 hex digits)."""
    text = json.dumps(canonical(config), sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def run_key(config: Any) -> str:
    """What a stored row must carry to be reused for ``config``: the configuration's digest and
    the code's version."""
    return f"{config_digest(config)}@{code_version()}"
