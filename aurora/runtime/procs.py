"""Role processes started by a launcher: one command line each, no orphans, logs kept.

Theory of operation
-------------------
``aurora real`` (and the tests) start every role as ``python -m aurora.cli <role> ...`` in its
own process, with its output in ``<run dir>/logs/<id>.log``. Each child asks the kernel to kill
it when its parent dies (``PR_SET_PDEATHSIG``), so even a launcher killed with SIGKILL leaves no
orphan; :meth:`Procs.stop_all` asks politely first (SIGTERM), then kills what is left. A
:class:`Proc` can be killed (SIGKILL, a preemption without notice), terminated (SIGTERM, a
preemption notice) or sent SIGUSR1 (leave now) by the fault injector, and restarted under the
same id; SIGINT means "shut down now" to every role.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.setpgid(0, 0)  # its own group: a Ctrl-C in the launcher's terminal is the launcher's


@dataclass
class Proc:
    """One role process."""

    id: str
    role: str
    argv: list[str]
    log_path: Path
    env: dict[str, str]
    popen: subprocess.Popen[bytes] | None = None
    starts: int = 0
    expected_exit: bool = False
    """Set when the launcher or the injector ended it on purpose."""

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.popen = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                preexec_fn=_die_with_parent,
            )
        self.starts += 1
        self.expected_exit = False

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def signal(self, sig: int) -> None:
        if self.alive:
            assert self.popen is not None
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(sig)

    def kill(self) -> None:
        self.expected_exit = True
        self.signal(signal.SIGKILL)
        if self.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(5)

    def last_error(self) -> str:
        """The last non-empty line of its log (a role prints a one-line reason when it fails)."""
        with contextlib.suppress(OSError):
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln]
            if lines:
                return lines[-1]
        return "(no output)"


@dataclass
class Procs:
    """Every process of one run."""

    run_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    procs: dict[str, Proc] = field(default_factory=dict)

    def add(self, pid: str, role: str, args: list[str]) -> Proc:
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        proc = Proc(
            id=pid,
            role=role,
            argv=[sys.executable, "-m", "aurora.cli", role, *args],
            log_path=self.run_dir / "logs" / f"{pid}.log",
            env=env,
        )
        self.procs[pid] = proc
        return proc

    def stop_all(self, *, grace_s: float = 5.0) -> None:
        """SIGINT every live process (shut down now; SIGTERM means a preemption notice to an
        Actor), wait up to ``grace_s``, then SIGKILL the rest."""
        for p in self.procs.values():
            if p.alive:
                p.expected_exit = True
                p.signal(signal.SIGINT)
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            if p.popen is None:
                continue
            left = deadline - time.monotonic()
            try:
                p.popen.wait(max(0.0, left))
            except subprocess.TimeoutExpired:
                p.kill()
