"""The pure core does no I/O: no module in aurora/policy (or aurora/delta) imports a clock,
an event loop, sockets, threads, unseeded randomness or simpy; aurora/delta also starts no
process and writes no file (bytes and tensors in, bytes and tensors out)."""

import ast
import pathlib
import subprocess
import sys

import aurora

FORBIDDEN_POLICY = {"time", "asyncio", "socket", "threading", "random", "simpy", "datetime"}
FORBIDDEN_DELTA = {
    "time",
    "asyncio",
    "socket",
    "threading",
    "simpy",
    "subprocess",
    "tempfile",
    "shutil",
    "os",
    "pathlib",
}
WRITES = {"open", "write_bytes", "write_text", "mkstemp", "replace", "unlink"}
"""Calls that put bytes on a disk (``str.replace``/``bytes.replace`` never take a path
argument here, and none of aurora/delta calls them)."""
ROOT = pathlib.Path(aurora.__file__).parent


def imported_modules(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_policy_modules_import_no_clock_io_threads_randomness_or_simpy():
    files = sorted((ROOT / "policy").rglob("*.py"))
    assert files, "aurora/policy has no modules"
    bad = {str(f.relative_to(ROOT)): imported_modules(f) & FORBIDDEN_POLICY for f in files}
    assert {k: v for k, v in bad.items() if v} == {}


def called_names(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.id if isinstance(f, ast.Name) else getattr(f, "attr", ""))
    return names


def test_delta_modules_import_no_clock_io_threads_processes_or_files():
    files = sorted((ROOT / "delta").rglob("*.py"))
    assert files, "aurora/delta has no modules"
    bad = {str(f.relative_to(ROOT)): imported_modules(f) & FORBIDDEN_DELTA for f in files}
    assert {k: v for k, v in bad.items() if v} == {}


def test_delta_modules_write_no_file():
    files = sorted((ROOT / "delta").rglob("*.py"))
    bad = {str(f.relative_to(ROOT)): called_names(f) & WRITES for f in files}
    assert {k: v for k, v in bad.items() if v} == {}


def test_importing_the_policy_package_loads_no_event_loop_socket_or_simpy():
    code = (
        "import sys; before = set(sys.modules); import aurora.policy.ledger; "
        "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
        "print(sorted(new & {'asyncio', 'socket', 'simpy', 'selectors', 'threading', 'time'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_purity_check_catches_a_forbidden_import_and_a_file_write(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom time import monotonic\nopen('x', 'wb').write(b'')\n")
    assert imported_modules(bad) & FORBIDDEN_POLICY == {"time"}
    assert imported_modules(bad) & FORBIDDEN_DELTA == {"os", "time"}
    assert called_names(bad) & WRITES == {"open"}


def test_the_transport_machines_read_no_clock_and_do_no_io():
    # The receive machine, its version table, its actions and the source choice take `now` as
    # an argument (issue 30): only the asyncio shell (node.py, server.py, upstream.py) and the
    # metrics (config.py: hop times) read clocks.
    machines = ("receiver.py", "table.py", "actions.py", "sources.py")
    bad = {
        name: imported_modules(ROOT / "transport" / name) & FORBIDDEN_POLICY for name in machines
    }
    assert {k: v for k, v in bad.items() if v} == {}
    for name in machines:
        calls = called_names(ROOT / "transport" / name)
        assert not calls & {"hop", "monotonic", "sleep"}, name
