"""Names, the registry and the cleanup of emulated networks (a killed run leaves nothing behind).

Theory of operation
-------------------
Every emulated network has a *tag*: six characters ``[a-z0-9]``. Everything it creates carries
the tag (namespaces ``aurem-<tag>-<name>``, interfaces ``au<tag>h<i>`` / ``au<tag>r<i>``,
iptables comments ``aurem-<tag> ...``; qdiscs, ip rules and delay lines live inside the tagged
namespaces). Nothing is created in the host's own namespace except the registry file
``/run/aurora-emulation/<tag>.json``, written *before* anything else. Three layers remove a
network (:func:`remove_network`): ``Network.close()`` (and the ``with`` block); a *reaper*
process per network that removes it when the builder dies, even by SIGKILL (:func:`_reap`); and
:func:`cleanup_leftovers` for when the reaper was killed too. Standard library only, so the
reaper runs by path under any Python."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

REGISTRY = Path(os.environ.get("AURORA_EMULATION_REGISTRY", "/run/aurora-emulation"))
"""Directory of the registry files (one ``<tag>.json`` per live network)."""
NS_PREFIX = "aurem-"
TAG_RE = re.compile(r"^[a-z0-9]{6}$")
_NS_RE = re.compile(r"^aurem-([a-z0-9]{6})-")
_IF_RE = re.compile(r"^au([a-z0-9]{6})[hr][0-9]+$")


def namespace_name(tag: str, name: str) -> str:
    """Name of the namespace ``name`` (a region or ``rt``) of the network ``tag``."""
    return f"{NS_PREFIX}{tag}-{name}"


def interface_name(tag: str, side: str, index: int) -> str:
    """Region-side (``h``) or router-side (``r``) interface of region ``index``."""
    assert side in ("h", "r") and 0 <= index < 1000
    return f"au{tag}{side}{index}"


def start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (None when no such process, or when it
    has exited and only its zombie is left for its parent to reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def alive(pid: int, started: int | None) -> bool:
    """Whether the process ``pid`` that started at ``started`` still runs."""
    now = start_time(pid)
    return now is not None and (started is None or now == started)


def registry_path(tag: str) -> Path:
    return REGISTRY / f"{tag}.json"


def register(tag: str, **info: object) -> None:
    """Write the registry file of ``tag`` (the calling process is its owner).

    The registry file holds the builder's pid and start time and the helper processes it
    started.
    """
    REGISTRY.mkdir(parents=True, exist_ok=True)
    data = {"tag": tag, "owner_pid": os.getpid(), "owner_start": start_time(os.getpid())}
    data.update(info)
    tmp = registry_path(tag).with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(registry_path(tag))


def add_helper(tag: str, pid: int) -> None:
    """Record a helper process (killed with the network)."""
    path = registry_path(tag)
    data = json.loads(path.read_text())
    data.setdefault("helpers", []).append({"pid": pid, "start": start_time(pid)})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def _read_registry(tag: str) -> dict | None:
    try:
        return json.loads(registry_path(tag).read_text())
    except (OSError, ValueError):
        return None


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


def namespaces(tag: str | None = None) -> list[str]:
    """Namespaces of the network ``tag`` (of every network when None)."""
    out = _ip("netns", "list").stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if (m := _NS_RE.match(n)) and (tag is None or m.group(1) == tag)]


def host_interfaces(tag: str | None = None) -> list[str]:
    """Interfaces of the network ``tag`` left in the host's own namespace."""
    out = _ip("-o", "link", "show").stdout
    found = []
    for line in out.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        m = _IF_RE.match(name)
        if m and (tag is None or m.group(1) == tag):
            found.append(name)
    return found


def tags_present() -> set[str]:
    """Tags that have a registry file, a namespace or a host interface."""
    tags = {p.stem for p in REGISTRY.glob("*.json") if TAG_RE.match(p.stem)}
    tags |= {m.group(1) for n in namespaces() if (m := _NS_RE.match(n))}
    tags |= {m.group(1) for n in host_interfaces() if (m := _IF_RE.match(n))}
    return tags


def processes(tag: str) -> list[int]:
    """Pids of every process inside a namespace of ``tag``."""
    pids: list[int] = []
    for ns in namespaces(tag):
        pids += [int(p) for p in _ip("netns", "pids", ns).stdout.split()]
    return pids


def _kill_and_wait(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    """SIGKILL ``pids`` and wait for each to exit (bounded); return those still alive."""
    waits = []
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue  # already gone
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            os.close(fd)
            continue
        waits.append((pid, fd))
    deadline = time.monotonic() + timeout_s
    left = []
    for pid, fd in waits:
        # A pidfd becomes readable when its process has exited (not necessarily reaped).
        ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0.0))
        os.close(fd)
        if not ready:
            left.append(pid)
    return left


def remove_network(tag: str) -> dict:
    """Remove everything of the network ``tag``; return what was removed.

    SIGKILL every process inside its namespaces (delay lines, probes, the roles the runtime
    started there) and its helpers, wait for them to die, delete the namespaces (which takes
    their interfaces, qdiscs, rules and iptables rules with them), delete any interface of the
    tag left in the host namespace (only a crash half-way through a Mininet build can leave
    one), and remove the registry file.
    """
    if not TAG_RE.match(tag):
        raise ValueError(f"not an emulation tag: {tag!r} (six characters a-z, 0-9)")
    reg = _read_registry(tag) or {}
    helpers = [
        h["pid"]
        for h in reg.get("helpers", [])
        if h["pid"] != os.getpid() and alive(h["pid"], h.get("start"))
    ]
    pids = processes(tag)
    stuck = _kill_and_wait(pids + helpers)
    # Helpers may have started processes in the namespaces as they died; once more.
    stuck += _kill_and_wait(processes(tag))
    removed_ns = []
    for ns in namespaces(tag):
        if _ip("netns", "del", ns).returncode == 0:
            removed_ns.append(ns)
    removed_if = []
    for name in host_interfaces(tag):
        if _ip("link", "del", name).returncode == 0:
            removed_if.append(name)
    with contextlib.suppress(FileNotFoundError):
        registry_path(tag).unlink()
    return {
        "tag": tag,
        "killed": sorted(set(pids + helpers) - set(stuck)),
        "stuck": sorted(set(stuck)),
        "namespaces": removed_ns,
        "interfaces": removed_if,
    }


def owner_alive(tag: str) -> bool:
    """Whether the process that built ``tag`` still runs (False without a registry file)."""
    reg = _read_registry(tag)
    return reg is not None and alive(reg["owner_pid"], reg.get("owner_start"))


def cleanup_leftovers(*, include_live: bool = False) -> list[dict]:
    """Remove every emulated network whose builder is gone (all of them with ``include_live``).

    Returns one report per network removed (see :func:`remove_network`).

    ``aurora real --emulate --cleanup``: every network whose builder is no longer alive (pid
    gone, or reused by another process: the start time differs).
    """
    if os.geteuid() != 0:
        raise PermissionError("removing network namespaces needs root")
    reports = []
    for tag in sorted(tags_present()):
        if include_live or not owner_alive(tag):
            reports.append(remove_network(tag))
    return reports


def leftovers(tag: str) -> dict:
    """What of ``tag`` still exists (empty lists and False when nothing)."""
    return {
        "namespaces": namespaces(tag),
        "interfaces": host_interfaces(tag),
        "registry": registry_path(tag).exists(),
    }


def _reap(tag: str) -> int:
    # Ignore the signals a terminal or a process-group kill of the builder would send.
    """The reaper (``python cleanup.py --reap TAG``) runs in its own session so a signal to the
    builder's process group does not reach it, and holds the read end of a pipe whose write end
    only the builder holds. When the builder dies, even by SIGKILL, the pipe reaches end of file
    and the reaper removes the network if its registry file is still there."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    while sys.stdin.buffer.read(65536):
        pass  # the builder never writes; end of file means it closed or died
    if registry_path(tag).exists():
        remove_network(tag)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Remove emulated networks left by killed runs.")
    ap.add_argument("--reap", metavar="TAG", help="wait for end of file on stdin, then remove TAG")
    ap.add_argument("--all", action="store_true", help="also remove networks whose builder runs")
    args = ap.parse_args(argv)
    if args.reap:
        return _reap(args.reap)
    for report in cleanup_leftovers(include_live=args.all):
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
