"""The commands an emulated network is built and read with: iproute2 and iptables, in batches.

Theory of operation
-------------------
Every step of a build is one batch of the commands a person would type to inspect or reproduce
it (``ip -batch``/``tc -batch`` per namespace, ``iptables-restore``), so a build is a few dozen
processes and ``docs/EMULATION.md`` can list them. A command that fails raises
:class:`~emulation.plan.EmulationError` quoting it and the last lines it printed.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

from emulation.plan import EmulationError


def run(argv: Sequence[str], *, stdin: str | None = None, check: bool = True) -> str:
    """Run ``argv`` (``stdin`` fed to it) and return its output; raise if it fails."""
    proc = subprocess.run(list(argv), input=stdin, capture_output=True, text=True)
    if check and proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise EmulationError(f"`{' '.join(argv)}` failed: {' / '.join(msg[-3:])}")
    return proc.stdout


def batch(tool: str, namespace: str | None, lines: list[str]) -> None:
    """``lines`` through ``tool -batch`` (``ip`` or ``tc``), in ``namespace`` if given."""
    if not lines:
        return
    argv = [tool] + (["-n", namespace] if namespace else []) + ["-batch", "-"]
    run(argv, stdin="\n".join(lines) + "\n")


def in_ns(namespace: str, argv: Sequence[str]) -> list[str]:
    """``argv`` run inside ``namespace``."""
    return ["ip", "netns", "exec", namespace, *argv]
