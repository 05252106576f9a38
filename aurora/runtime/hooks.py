"""Fault-injection points for the reliability matrix, inert unless asked for.

Theory of operation
-------------------
Most faults of the matrix (``docs/RELIABILITY.md``) are injected from outside: a signal to a
process, a link cut. A few must strike *inside* a step of a process, at a moment no outside
timer can hit reliably on a fast machine: an Actor killed halfway through applying ``D_v``, or
while the segments of ``D_v`` are arriving; an Actor that submits stale or duplicate results.
Those are named here, and a process carries them out only when its environment holds
``AURORA_FAULT_HOOKS`` (a JSON object; the launcher sets it for the process a test names). A
process without it is unaffected: :func:`get` returns None for every hook.

=======================  =========================================================================
hook                     effect (in the Actor)
=======================  =========================================================================
``kill_mid_apply``       SIGKILL itself after writing part of ``D_v`` (value: v) into its weights
``kill_mid_transfer``    SIGKILL itself once part, not all, of ``D_v`` has arrived (value: v)
``late_results``         hold the results of version v back ``seconds`` (value: [v, seconds])
``stale_version``        report results of version v as generated on v-2 (value: v)
``duplicate_results``    send every result of version v twice (value: v)
=======================  =========================================================================
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

ENV = "AURORA_FAULT_HOOKS"

_HOOKS: dict[str, Any] = json.loads(os.environ.get(ENV, "") or "{}")


def get(name: str) -> Any:
    """The value of hook ``name`` for this process, or None."""
    return _HOOKS.get(name)


def die() -> None:
    """SIGKILL this process now (no cleanup, as a preemption would)."""
    os.kill(os.getpid(), signal.SIGKILL)
