"""Every notebook runs on a fresh clone: only the repository's tracked files (the committed
evidence/ rows for the real-mode notebooks, quick simulated runs made on the spot for the
others), no results/ folder, no AURORA_RESULTS (issue 27)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """The tracked files of this checkout, copied as a clone would have them."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    out = tmp_path_factory.mktemp("clone")
    for name in filter(None, files):
        src = ROOT / os.fsdecode(name)
        if src.is_file():
            dst = out / os.fsdecode(name)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    return out


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_each_notebook_runs_on_a_fresh_clone_without_a_results_folder(clone, notebook, monkeypatch):
    monkeypatch.delenv("AURORA_RESULTS", raising=False)
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    # The clone's own code, as a user of that clone would import it.
    monkeypatch.setenv("PYTHONPATH", str(clone))
    nb = nbformat.read(clone / "notebooks" / notebook, as_version=4)
    NotebookClient(
        nb, timeout=300, resources={"metadata": {"path": str(clone / "notebooks")}}
    ).execute()
    for cell in nb.cells:
        if cell.cell_type == "code" and "plt." in cell.source:
            images = [o for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
            assert images, f"{notebook}: a plotting cell rendered no image:\n{cell.source[:200]}"
