"""The policy core alone, per Actor per step: what the simulator's cohort mode asks of it.

``N`` Actors in one region on one version; each step the Trainer publishes the next version,
every Actor stages and activates it (one ``feed`` each, as a cohort reports), the pacer is polled,
the batch (one prompt per Actor) is requested and dispatched, and every Actor returns its
result (``ResultsArrived``) and its throughput (``ThroughputObserved``). Prints one JSON line:
microseconds per Actor per step by entry point (process time), and a digest of every action
the core returned, so two trees can be compared for speed and for identical decisions.

    python benchmarks/core_step.py 20000 10
"""

from __future__ import annotations

import gc
import hashlib
import json
import sys
import time

from aurora.policy.core import LedgerCore
from aurora.policy.events import (
    ActorJoined,
    BatchRequested,
    DeltaPublished,
    DeltaStaged,
    ResultsArrived,
    ThroughputObserved,
    VersionActivated,
)
from aurora.policy.ledger import LedgerConfig
from aurora.policy.pacer import PacerConfig


def run(actors: int, steps: int) -> dict[str, object]:
    core = LedgerCore(
        LedgerConfig(trainer_region="us"),
        PacerConfig(steps=steps, prompts_per_batch=actors, staging_grace_s=30.0, prompt_prefix="s"),
    )
    ids = [f"a{i:06d}" for i in range(actors)]
    digest = hashlib.sha256()
    spent: dict[str, float] = {}
    clock = time.process_time

    def note(name: str, t: float, actions: object) -> None:
        spent[name] = spent.get(name, 0.0) + clock() - t
        digest.update(repr(actions).encode())

    now = 0.0
    t = clock()
    acts = [
        core.feed(
            DeltaPublished(version=0, weights_hash="h0", delta_bytes=None, snapshot_bytes=100),
            now=now,
        )
    ]
    acts += [core.feed(ActorJoined(actor=a, region="us", active=0), now=now) for a in ids]
    note("join", t, acts)
    for step in range(1, steps + 1):
        now += 1.0
        t = clock()
        request = core.poll(now)
        note("poll", t, request)
        assert isinstance(request, BatchRequested), request
        t = clock()
        assigns = core.feed(request, now=now)
        note("BatchRequested", t, assigns)
        now += 1.0
        t = clock()
        acts = [
            core.feed(
                ResultsArrived(
                    actor=a.actor, leases=a.leases, version=a.version, weights_hash=f"h{a.version}"
                ),
                now=now,
            )
            for a in assigns
            if type(a).__name__ == "Assign"
        ]
        note("ResultsArrived", t, acts)
        t = clock()
        acts = [
            core.feed(ThroughputObserved(actor=a, tokens=1000 + i % 7, seconds=1.0), now=now)
            for i, a in enumerate(ids)
        ]
        note("ThroughputObserved", t, acts)
        if step == steps:
            break
        t = clock()
        acts = core.feed(
            DeltaPublished(version=step, weights_hash=f"h{step}", delta_bytes=10), now=now
        )
        note("DeltaPublished", t, acts)
        t = clock()
        staged = [core.staged(a, step) for a in ids]
        note("staged", t, staged)
        t = clock()
        acts = [core.feed(e, now=now) for e in staged if isinstance(e, DeltaStaged)]
        acts += [core.feed(VersionActivated(actor=a, version=step), now=now) for a in ids]
        note("staged+activated", t, acts)
    per = {k: round(v / actors / steps * 1e6, 3) for k, v in spent.items()}
    return {
        "actors": actors,
        "steps": steps,
        "core_s": round(sum(spent.values()), 3),
        "us_per_actor_step": per,
        "digest": digest.hexdigest()[:16],
    }


if __name__ == "__main__":
    # As the simulator runs the core (sim.model.Simulation.run): without the cyclic collector,
    # which would rescan the growing lease history and Actor records again and again (with it
    # on, its collections were ~23% of this benchmark's time at 10^5 Actors, `perf`), so that
    # the two sizes compare the core's own work.
    gc.disable()
    print(json.dumps(run(int(sys.argv[1]), int(sys.argv[2]))))
