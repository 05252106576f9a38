"""Opt-in memory probe: tracemalloc snapshots of a role process at chosen steps.

Theory of operation
-------------------
A process that grows a few KB a step shows it only over hundreds of steps, and RSS alone cannot
say whether the growth is a retained Python object (a leak to fix) or the allocator's arenas and
torch's caches (memory the process reuses). ``AURORA_TRACEMALLOC=<folder>`` makes the Trainer
dump a :mod:`tracemalloc` snapshot and its native allocators' counts at chosen steps
(:class:`MemoryProbe`); ``python -m aurora.runtime.memprobe <folder> 50 150`` compares two
(:func:`compare`). Off by default and free when off. On, tracemalloc slows every allocation and
its own tables take memory (counted apart, ``tracemalloc_self``), so it is for a diagnosis run,
never for a measured one.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tracemalloc
from pathlib import Path

ENV = "AURORA_TRACEMALLOC"
STEPS_ENV = "AURORA_TRACEMALLOC_STEPS"
FRAMES = 16
"""Traceback depth kept per allocation (deep enough to reach the runtime's own frames)."""


def _native() -> dict[str, int]:
    """Memory outside Python's object allocator, best effort (Linux, glibc): SQLite's allocator
    (``sqlite3_memory_used``: its page cache and statements), and glibc's ``mallinfo2``
    (in-use bytes, heap and mmapped; free bytes held in its arenas: fragmentation)."""
    import ctypes

    out: dict[str, int] = {}
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
        libs = sorted({m.split()[-1] for m in maps if "libsqlite3.so" in m})
        if libs:
            lib = ctypes.CDLL(libs[0])
            lib.sqlite3_memory_used.restype = ctypes.c_int64
            out["sqlite"] = int(lib.sqlite3_memory_used())

        class MallInfo2(ctypes.Structure):
            _fields_ = [
                (n, ctypes.c_size_t)
                for n in (
                    *("arena", "ordblks", "smblks", "hblks", "hblkhd"),
                    *("usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"),
                )
            ]

        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        mi = libc.mallinfo2()
        out["malloc_used"] = int(mi.uordblks + mi.hblkhd)
        out["malloc_free"] = int(mi.fordblks)
    except (OSError, AttributeError):
        pass
    return out


def _malloc_trim() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def _rss_kib() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


class MemoryProbe:
    """Snapshots at the steps named by the environment (inactive when ``AURORA_TRACEMALLOC`` is
    not set).

    Setting ``AURORA_TRACEMALLOC=<folder>`` (and optionally ``AURORA_TRACEMALLOC_STEPS=50,150``,
    the default) makes the Trainer start :mod:`tracemalloc` when it starts and, right after
    publishing each listed step (:meth:`at_step`), collect garbage and dump a snapshot to
    ``<folder>/trainer-<step>.tracemalloc`` and one JSON line to ``<folder>/trainer.jsonl``
    (step, traced bytes, RSS, and what tracemalloc cannot see: SQLite's own allocator, glibc
    malloc's in-use and free bytes, tracemalloc's own tables), then hands glibc's free memory
    back (``malloc_trim``) and records RSS again."""

    def __init__(self, role: str, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.role = role
        folder = env.get(ENV)
        self.folder = Path(folder) if folder else None
        raw = env.get(STEPS_ENV, "50,150")
        try:
            self.steps = {int(s) for s in raw.split(",") if s.strip()}
        except ValueError:
            raise ValueError(f"{STEPS_ENV}={raw!r}: expected step numbers like 50,150") from None
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            if not tracemalloc.is_tracing():
                tracemalloc.start(FRAMES)

    @property
    def active(self) -> bool:
        return self.folder is not None

    def at_step(self, step: int) -> None:
        if self.folder is None or step not in self.steps:
            return
        gc.collect()
        snap = tracemalloc.take_snapshot()
        snap.dump(str(self.folder / f"{self.role}-{step}.tracemalloc"))
        traced, peak = tracemalloc.get_traced_memory()
        line = {
            "step": step,
            "traced": traced,
            "traced_peak": peak,
            "tracemalloc_self": tracemalloc.get_tracemalloc_memory(),
            "rss_kib": _rss_kib(),
            **_native(),
        }
        # Then give glibc's free memory back to the system: RSS after the trim is what the
        # process holds in use; what the trim returns is allocator free space, not objects.
        if _malloc_trim():
            line["rss_trimmed_kib"] = _rss_kib()
        with open(self.folder / f"{self.role}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")


def compare(folder: str, a: int, b: int, *, role: str = "trainer", top: int = 25) -> str:
    """A report of what grew between the snapshots at steps ``a`` and ``b``: the allocation
    sites whose size grew, with their tracebacks, and traced memory against RSS and the native
    allocators (``python -m aurora.runtime.memprobe <folder> 50 150``)."""
    base = Path(folder)
    old = tracemalloc.Snapshot.load(str(base / f"{role}-{a}.tracemalloc"))
    new = tracemalloc.Snapshot.load(str(base / f"{role}-{b}.tracemalloc"))
    lines = []
    rows = {}
    jsonl = base / f"{role}.jsonl"
    if jsonl.exists():
        for line in jsonl.read_text().splitlines():
            rec = json.loads(line)
            rows[rec["step"]] = rec
    if a in rows and b in rows:
        n = b - a
        dt = rows[b]["traced"] - rows[a]["traced"]
        drss = (rows[b]["rss_kib"] - rows[a]["rss_kib"]) * 1024
        lines.append(
            f"steps {a} -> {b}: traced {rows[a]['traced'] / 2**20:.2f} -> "
            f"{rows[b]['traced'] / 2**20:.2f} MiB ({dt / n:+.0f} B/step), RSS "
            f"{rows[a]['rss_kib'] / 1024:.1f} -> {rows[b]['rss_kib'] / 1024:.1f} MiB "
            f"({drss / n:+.0f} B/step)"
        )
        for key in ("rss_trimmed_kib", "sqlite", "malloc_used", "malloc_free", "tracemalloc_self"):
            if key in rows[a] and key in rows[b]:
                scale = 1024 if key.endswith("_kib") else 1
                x, y = rows[a][key] * scale, rows[b][key] * scale
                lines[-1] += (
                    f"; {key.removesuffix('_kib')} {x / 2**20:.2f} -> {y / 2**20:.2f} MiB "
                    f"({(y - x) / n:+.0f} B/step)"
                )
    diffs = new.compare_to(old, "traceback")
    diffs.sort(key=lambda d: d.size_diff, reverse=True)
    for d in diffs[:top]:
        if d.size_diff <= 0:
            break
        lines.append(f"{d.size_diff:+9d} B {d.count_diff:+6d} blocks (now {d.size} B)")
        for frame in d.traceback.format()[-12:]:
            lines.append("    " + frame)
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        print("usage: python -m aurora.runtime.memprobe FOLDER STEP_A STEP_B", file=sys.stderr)
        raise SystemExit(2)
    print(compare(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
