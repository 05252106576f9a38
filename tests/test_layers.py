"""The layers of docs/ARCHITECTURE.md hold: every import in the tree, lazy ones inside function
bodies included, points down or sideways within a layer, and no package reaches into another
package's private ``_module``.

The walk covers every ``import``/``from ... import`` node anywhere in a file's syntax tree
(module level, functions, methods, ``if TYPE_CHECKING`` blocks) and ``importlib.import_module``
calls with a constant name, relative imports resolved against the importing module.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("aurora", "sim", "emulation", "experiments", "benchmarks", "tests")

RULES = [
    ("sim", "aurora.runtime", "the simulator drives the policy core, never the runtime's code"),
    ("aurora.runtime", "sim", "the runtime drives the policy core, never the simulator's code"),
    ("aurora.engines", "aurora.rl", "engines serve any trainer; model loading is aurora.models"),
    ("aurora.policy", "aurora.", "the pure core imports nothing else of the tree"),
    ("aurora.policy", "sim", "the pure core imports nothing else of the tree"),
    ("aurora.delta", "aurora.", "the artifact imports nothing else of the tree"),
    ("aurora", "experiments", "the library never imports what users run"),
    ("aurora.observe", "aurora.runtime", "roles and the simulator call observe, not the reverse"),
    ("aurora.observe", "sim", "roles and the simulator call observe, not the reverse"),
    # The Ledger's layers (aurora/runtime/ledger/__init__.py): each knows only those below it.
    ("aurora.runtime.ledger.driver", "aurora.runtime.ledger.durable", "the driver is below"),
    ("aurora.runtime.ledger.driver", "aurora.runtime.ledger.service", "the driver is below"),
    ("aurora.runtime.ledger.durable", "aurora.runtime.ledger.service", "the log is below"),
    ("aurora.runtime.ledger.config", "aurora.runtime.ledger.", "the job's shape is a leaf"),
    ("aurora.runtime.ledger.counts", "aurora.runtime.ledger.", "the counts are a leaf"),
]
"""(importer, imported, why): a module under ``importer`` may not import one under
``imported`` (``aurora.policy`` importing ``aurora.policy.*`` is its own package, allowed)."""


def module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[tuple[str, int]]:
    """Every module ``path`` imports, with its line: ``from a.b import c`` gives ``a.b`` and
    ``a.b.c`` (``c`` may be a module)."""
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            out.append((mod, node.lineno))
            out += [(f"{mod}.{alias.name}", node.lineno) for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.append((node.args[0].value, node.lineno))
    return out


def _under(name: str, prefix: str) -> bool:
    if prefix.endswith("."):
        return name.startswith(prefix)
    return name == prefix or name.startswith(prefix + ".")


def violations(root: pathlib.Path = ROOT) -> list[str]:
    found = []
    files = [f for pkg in PACKAGES if (root / pkg).is_dir() for f in (root / pkg).rglob("*.py")]
    for path in sorted(files):
        me = module_name(path, root)
        my_package = me if path.name == "__init__.py" else me.rpartition(".")[0]
        where = f"{path.relative_to(root)}"
        for name, line in imports_of(path, root):
            for importer, imported, why in RULES:
                own = _under(name, importer) if imported.endswith(".") else False
                if _under(me, importer) and _under(name, imported) and not own:
                    found.append(f"{where}:{line} imports {name}: {why}")
            parts = name.split(".")
            for i, part in enumerate(parts):
                if part.startswith("_") and not part.startswith("__"):
                    owner = ".".join(parts[:i])
                    is_module = (root / pathlib.Path(*parts[: i + 1])).with_suffix(".py").exists()
                    if is_module and owner != my_package:
                        found.append(f"{where}:{line} imports {name}, private to {owner}")
                    break
    return sorted(set(found))


def test_every_import_in_the_tree_follows_the_layers():
    assert violations() == []


@pytest.mark.parametrize(
    ("where", "source", "expected"),
    [
        ("sim/x.py", "def f():\n    from aurora.runtime import trainer\n", "sim/x.py:2"),
        ("aurora/runtime/x.py", "import sim.config\n", "aurora/runtime/x.py:1"),
        (
            "aurora/engines/x.py",
            "def f():\n    import aurora.rl.trainer\n",
            "aurora/engines/x.py:2",
        ),
        ("aurora/transport/x.py", "from aurora.policy._fsm import E\n", "private to aurora.policy"),
        ("aurora/policy/x.py", "from aurora.store import files\n", "aurora/policy/x.py:1"),
        ("aurora/delta/x.py", "from ..policy import ledger\n", "aurora/delta/x.py:1"),
        (
            "aurora/runtime/x.py",
            "import importlib\nm = importlib.import_module('sim.model')\n",
            "aurora/runtime/x.py:2",
        ),
        (
            "aurora/runtime/ledger/driver.py",
            "def f():\n    from .service import LedgerService\n",
            "aurora/runtime/ledger/driver.py:2",
        ),
    ],
)
def test_the_layer_check_catches_a_lazy_relative_or_dynamic_import(
    tmp_path, where, source, expected
):
    for d in (
        "aurora/policy",
        "aurora/runtime",
        "aurora/runtime/ledger",
        "aurora/engines",
        "aurora/transport",
        "aurora/delta",
        "sim",
    ):
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
        (tmp_path / d / "__init__.py").write_text("")
    (tmp_path / "aurora/__init__.py").write_text("")
    (tmp_path / "aurora/policy/_fsm.py").write_text("E = 1\n")
    (tmp_path / where).write_text(source)
    found = violations(tmp_path)
    assert len(found) >= 1 and all(expected in f for f in found), found


def test_a_package_may_use_its_own_private_module(tmp_path):
    (tmp_path / "aurora/policy").mkdir(parents=True)
    (tmp_path / "aurora/__init__.py").write_text("")
    (tmp_path / "aurora/policy/__init__.py").write_text("from aurora.policy._fsm import E\n")
    (tmp_path / "aurora/policy/_fsm.py").write_text("E = 1\n")
    (tmp_path / "aurora/policy/ledger.py").write_text("from ._fsm import E\n")
    assert violations(tmp_path) == []
