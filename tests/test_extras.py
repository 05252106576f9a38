"""A missing or broken optional part is one line naming the fix, never a traceback.

Each command runs in a subprocess whose imports are blocked the way a core-only install lacks
them: a ``sitecustomize`` on ``PYTHONPATH`` puts a finder first on ``sys.meta_path`` that
refuses the named packages, exactly as Python refuses a package that is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from aurora.extras import INSTALL, TORCHVISION_FIX, explain

ROOT = Path(__file__).resolve().parent.parent
GEO = str(ROOT / "examples" / "geo.yaml")

BLOCKER = """
import sys

HIDDEN = {hidden!r}


class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled())
"""


def run(tmp_path: Path, hidden: tuple[str, ...], *argv: str, extra_path: str = "") -> tuple:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER.format(hidden=set(hidden)))
    paths = [str(site), *([extra_path] if extra_path else []), str(ROOT)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    done = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )
    return done.returncode, done.stdout, done.stderr


def test_aurora_real_without_torch_is_one_line_naming_the_install_command(tmp_path):
    code, out, err = run(
        tmp_path,
        ("torch", "transformers", "safetensors"),
        "-m",
        "aurora.cli",
        "real",
        "--topology",
        GEO,
        "--out",
        str(tmp_path / "out"),
    )
    assert code == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines == [f"aurora real: needs torch, which is not installed: {INSTALL['torch']}"]
    assert not (tmp_path / "out").exists()  # refused before anything was made


def test_the_warm_start_without_torch_is_one_line_too(tmp_path):
    code, _out, err = run(
        tmp_path, ("torch", "transformers"), "-m", "aurora.cli", "warmstart", "--cache", "c"
    )
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [
        f"aurora warmstart: needs torch, which is not installed: {INSTALL['torch']}"
    ]


def test_the_simulator_needs_no_extra(tmp_path):
    code, out, err = run(
        tmp_path,
        ("torch", "transformers", "safetensors", "vllm", "dask", "distributed"),
        "-m",
        "aurora.cli",
        "sim",
        "--topology",
        GEO,
        "--steps",
        "3",
        "--strategy",
        "aurora",
        "--out",
        str(tmp_path / "sim"),
    )
    assert code == 0, err
    assert "aurora" in out


def test_a_cluster_sweep_without_dask_is_one_line_naming_the_install_command(tmp_path):
    code, _out, err = run(
        tmp_path,
        ("dask", "distributed"),
        "-m",
        "experiments.bandwidth_sweep",
        "--cluster",
        "local",
        "--out",
        str(tmp_path / "res"),
    )
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("python -m experiments.bandwidth_sweep: ")
    assert INSTALL["cluster"] in err


def test_a_broken_torchvision_beside_vllm_is_one_line_saying_what_to_remove(tmp_path):
    """The CUDA torchvision vLLM's CPU build pulls in imports and then fails on its C
    operators; transformers then cannot import any model. Here a torchvision that fails the
    same way stands in for it (the real one needs a CUDA wheel this machine does not have)."""
    fake = tmp_path / "fake"
    (fake / "torchvision").mkdir(parents=True)
    (fake / "torchvision" / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n'
    )
    code, _out, err = run(
        tmp_path,
        (),
        "-m",
        "aurora.cli",
        "warmstart",
        "--cache",
        str(tmp_path / "cache"),
        extra_path=str(fake),
    )
    assert code == 2 and "Traceback" not in err, err
    (line,) = err.strip().splitlines()
    assert line.startswith("aurora warmstart: the torchvision installed beside vLLM's CPU build")
    assert "operator torchvision::nms does not exist" in line and TORCHVISION_FIX in line


def test_explain_leaves_other_errors_alone():
    assert explain(ValueError("steps must be >= 1")) is None
    assert explain(ModuleNotFoundError("No module named 'torchvision'", name="torchvision")) is None
    assert explain(ModuleNotFoundError("No module named 'numpyy'", name="numpyy")) is None
    assert "pip install -e '.[torch]'" in explain(
        ModuleNotFoundError("No module named 'torch.cuda'", name="torch.cuda")
    )
    try:
        try:
            raise RuntimeError("operator torchvision::nms does not exist")
        except RuntimeError as inner:
            raise ModuleNotFoundError("Could not import module 'Qwen3ForCausalLM'") from inner
    except ModuleNotFoundError as outer:
        assert TORCHVISION_FIX in explain(outer)
