"""Where a result came from: the git SHA of the code that produced it."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git_sha() -> str:
    """SHA of the checkout this code runs from, with ``-dirty`` for uncommitted changes;
    ``unknown`` outside a git checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")
