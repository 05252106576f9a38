"""The project's habits, run by the README's test command (so by CI): ruff's lint rules and its
formatting, and mypy as pyproject.toml configures it (strict on aurora/policy, aurora/delta,
aurora/transport, aurora/store and aurora/jobspec.py; every other module of aurora/, sim/ and
emulation/ with its function bodies checked). Each tool runs as its own process on the whole tree,
as a developer or the pre-commit hooks run it; a failure shows the tool's own report.

mypy reads torch and transformers' annotations, so a cold run (no .mypy_cache) takes about a
minute; later runs reuse the cache and take seconds.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _run(*argv: str, cwd: Path = ROOT, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *argv], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def _report(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


def test_ruff_finds_nothing_to_fix() -> None:
    proc = _run("ruff", "check", ".")
    assert proc.returncode == 0, _report(proc)


def test_every_file_is_formatted_as_ruff_formats_it() -> None:
    proc = _run("ruff", "format", "--check", ".")
    assert proc.returncode == 0, _report(proc)


def test_mypy_finds_no_type_error() -> None:
    proc = _run("mypy")
    assert proc.returncode == 0, _report(proc)
    assert "Success" in proc.stdout, _report(proc)


def test_the_pre_commit_hooks_run_the_same_tools_offline() -> None:
    """.pre-commit-config.yaml: local hooks on the installed tools (no download), each one of
    the checks above, mypy on the configured files rather than the staged ones."""
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    (repo,) = config["repos"]
    assert repo["repo"] == "local"
    hooks = {h["id"]: h for h in repo["hooks"]}
    assert {h["language"] for h in hooks.values()} == {"system"}
    assert hooks["ruff"]["entry"].startswith("python -m ruff check")
    assert hooks["ruff-format"]["entry"].startswith("python -m ruff format")
    assert hooks["mypy"]["entry"] == "python -m mypy"
    assert hooks["mypy"]["pass_filenames"] is False


STRICT = ["policy", "delta", "transport", "store"]


def test_mypy_config_is_strict_on_the_core_and_checks_every_other_body(tmp_path: Path) -> None:
    """The configuration itself, on a tree shaped like aurora/: an unannotated function is an
    error in each strict package and in the job spec, and a type error inside an unannotated
    function is found elsewhere (mypy skips such bodies by default)."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    pkg = tmp_path / "aurora"
    for sub in [*STRICT, "runtime"]:
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    untyped = "def f(x):\n    return x\n"
    for sub in STRICT:
        (pkg / sub / "probe.py").write_text(untyped)
    (pkg / "jobspec.py").write_text(untyped)
    (pkg / "runtime" / "probe.py").write_text('def g():\n    return 1 + ""\n')
    proc = _run("mypy", "--cache-dir", str(tmp_path / "cache"), "aurora", cwd=tmp_path, timeout=120)
    out = proc.stdout
    assert proc.returncode == 1, _report(proc)
    for path in [*(f"aurora/{sub}/probe.py" for sub in STRICT), "aurora/jobspec.py"]:
        assert f"{path}:1: error: Function is missing a type annotation" in out, _report(proc)
    assert (
        'aurora/runtime/probe.py:2: error: Unsupported operand types for + ("int" and "str")'
        in (out)
    ), _report(proc)
