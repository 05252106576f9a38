"""Soak: ``aurora real`` for hundreds of steps under a spot hazard, relay loss and joins.

Theory of operation
-------------------
One deployment (Trainer in ``us`` with 2 on-demand Actors; 4 spot Actors in ``ca`` behind a
standalone relay) runs ``SOAK_STEPS`` steps twice on loopback on the labelled stand-in compute
(:mod:`aurora.runtime.standin`, about a second a step): **fault-free**, the reference for
throughput, and **soak**, under ``--spot-hazard``, a relay loss and two joins (:func:`run`).
While each run goes, every role process is sampled for memory and open descriptors
(:func:`sample`). The test asserts the invariants (no prompt lost or settled twice, nothing
admitted on a wrong version or hash, every activation on h(v)) and that the long-lived roles
do not grow between the middle and the end (a leak of one object per step is a slope).

    python -m pytest benchmarks/test_soak.py --benchmark-enable -s
    AURORA_SOAK_STEPS=400 python -m pytest benchmarks/test_soak.py --benchmark-enable -s
"""

from __future__ import annotations

import csv
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

STEPS = int(os.environ.get("AURORA_SOAK_STEPS", "200"))
HAZARD_PER_HOUR = 30.0
"""Preemptions per hour per spot Actor: about two per Actor in a 200-step soak (~4 min)."""
NOTICE_S = 3.0
RETURN_S = 15.0
TOKENS_PER_S = 80.0
"""Stand-in generation rate per Actor: 4 prompts x 4 completions x 5 tokens = 80 tokens, ~1 s."""

TOPOLOGY = f"""
name: soak
trainer: {{region: us, model: qwen3-8b, gpu: H100, gpus: 1, egress_gbps: 10}}
regions: [{{name: us}}, {{name: ca}}]
links: [{{a: us, b: ca, gbps: 1.0, rtt_ms: 40, loss: 0}}]
relays: [{{region: ca}}]
actors:
  - {{region: us, gpu: A100, count: 2}}
  - {{region: ca, gpu: A100, count: 4, spot: true}}
real: {{steps: {STEPS}, prompts_per_step: 24, group_size: 4, actors: 6}}
"""


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def role_of(pid: int) -> str | None:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return None
    if "aurora.cli" not in argv:
        return None
    i = argv.index("aurora.cli")
    if i + 1 >= len(argv) or argv[i + 1] == "real":
        return None
    role = argv[i + 1]
    return argv[argv.index("--id") + 1] if "--id" in argv else role


def sample(pid: int) -> tuple[int, int, int] | None:
    """(VmRSS KiB, VmHWM KiB, open FDs) of a process, or None if it is gone.

    Every role process the run started (the launcher's descendants, by ``/proc``) every 0.5 s:
    resident memory (``VmRSS``), its peak (``VmHWM``) and open file descriptors. After the run,
    samples are matched to the wall time each version was published (the Ledger's ``Published``
    events) and reported at 1/4, 1/2 and 10 steps before the end of the run (steps 50/100/190 of
    a 200-step soak; at the last step the roles are closing).
    """
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0]), fds


def run(tmp: Path, name: str, args: list[str]) -> tuple[Path, list[tuple[float, str, tuple]]]:
    """The stand-in compute: real processes, leases, deltas, store, relays; random tokens at a
    fixed rate instead of a model, so each step takes about a second and hundreds of steps fit
    in minutes. **soak**: ``--spot-hazard`` preempts each spot Actor as a Poisson process (with
    a short notice, SIGKILL when it is not gone by then) and brings it back as a fresh process
    after ``RETURN_S``; on top, a relay loss and two joins of new Actors at steps drawn from a
    seeded generator (the same draws every run)."""
    topo = tmp / "soak.yaml"
    topo.write_text(TOPOLOGY)
    out = tmp / name
    extra = {"standin_tokens_per_s": TOKENS_PER_S}
    cmd = [sys.executable, "-m", "aurora.cli", "real", "--topology", str(topo)]
    cmd += ["--backend", "standin", "--out", str(out), "--quiet", "--extra", json.dumps(extra)]
    proc = subprocess.Popen(cmd + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    samples: list[tuple[float, str, tuple]] = []
    deadline = time.monotonic() + 40 * STEPS
    while proc.poll() is None:
        assert time.monotonic() < deadline, "soak run did not finish"
        now = time.time()
        for pid in descendants(proc.pid):
            role = role_of(pid)
            s = sample(pid) if role else None
            if role and s:
                samples.append((now, role, s))
        time.sleep(0.5)
    _, err = proc.communicate()
    assert proc.returncode == 0, err.decode()[-3000:]
    run_dir = out / "soak-aurora-s0"
    (run_dir / "proc_samples.json").write_text(json.dumps(samples))
    return run_dir, samples


def published_at(run_dir: Path) -> dict[int, float]:
    at = {}
    with open(run_dir / "events.csv") as f:
        for r in csv.DictReader(f):
            if r["type"] == "Published":
                rec = json.loads(r["record"])
                at[int(rec["version"])] = float(rec["at"])
    return at


def at_step(samples: list, when: float, *, within_s: float = 1.0) -> dict[str, tuple]:
    """Per role alive at ``when``, its sample closest to it (none further than ``within_s``)."""
    best: dict[str, tuple[float, tuple]] = {}
    for t, role, s in samples:
        d = abs(t - when)
        if d <= within_s and (role not in best or d < best[role][0]):
            best[role] = (d, s)
    return {r: s for r, (_, s) in best.items()}


@pytest.mark.benchmark(group="soak")
def test_soak_under_spot_hazard_keeps_invariants_and_flat_memory(benchmark, tmp_path):
    """Flat: between the middle and the end of the run, FDs within a few, RSS within 15%."""
    rng = random.Random(7)
    relay_step = rng.randint(STEPS // 5, STEPS // 2)
    joins = sorted(rng.sample(range(STEPS // 4, 3 * STEPS // 4), 2))
    faults = [f"relay_fail:relay-ca@step={relay_step}"] + [
        f"join:late-{i}:ca:A100@step={s}" for i, s in enumerate(joins)
    ]
    soak_args = ["--spot-hazard", str(HAZARD_PER_HOUR), "--spot-notice", str(NOTICE_S)]
    soak_args += ["--spot-return", str(RETURN_S)]
    for f in faults:
        soak_args += ["--fault", f]
    results: dict[str, tuple[Path, list]] = {}

    def both() -> None:
        results["clean"] = run(tmp_path, "clean", [])
        results["soak"] = run(tmp_path, "soak", soak_args)

    benchmark.pedantic(both, rounds=1, iterations=1)
    clean = json.loads((results["clean"][0] / "summary.json").read_text())
    run_dir, samples = results["soak"]
    s = json.loads((run_dir / "summary.json").read_text())
    fired = [
        json.loads(line)["spec"] for line in (run_dir / "faults.jsonl").read_text().splitlines()
    ]
    print(f"\nsoak: {s['steps_completed']} steps, faults fired: {len(fired)}")
    for spec in fired:
        print(f"  {spec}")
    print(
        f"prompts lost {s['prompts_lost']}, settled twice {s['prompts_settled_twice']}, "
        f"wrong admits {s['wrong_admits']}, hash mismatches {s['actor_hash_mismatches']}, "
        f"refused {s['results_refused']}, leases expired {s['leases_expired']}"
    )
    print(
        f"throughput {s['tokens_per_s']:,.0f} tok/s vs fault-free {clean['tokens_per_s']:,.0f}: "
        f"{s['tokens_per_s'] / clean['tokens_per_s']:.2f}x"
    )
    assert s["steps_completed"] == STEPS
    assert s["prompts_lost"] == 0 and s["prompts_settled_twice"] == 0
    assert s["wrong_admits"] == 0 and s["actor_hash_mismatches"] == 0 and s["lease_book_ok"]

    at = published_at(run_dir)
    # The last mark is 10 steps before the end: at the last step every role is shutting down.
    marks = [STEPS // 4, STEPS // 2, STEPS - 10]
    snaps = {m: at_step(samples, at[m]) for m in marks}
    print("role            " + "".join(f"  step {m}: RSS MiB (peak) FDs" for m in marks))
    for role in sorted({r for snap in snaps.values() for r in snap}):
        cells = []
        for m in marks:
            v = snaps[m].get(role)
            cells.append(f"{v[0] / 1024:>13.1f} ({v[1] / 1024:.1f}) {v[2]:>3}" if v else "-")
        print(f"{role:<16}" + "".join(f"  {c:>28}" for c in cells))
    # Roles alive the whole run (the Trainer, and the on-demand Actors) must not grow.
    for role in ("trainer", *sorted(r for r in snaps[marks[-1]] if r.startswith("us-"))):
        mid, end = snaps[marks[1]].get(role), snaps[marks[-1]].get(role)
        if mid is None or end is None:
            continue
        assert end[2] <= mid[2] + 4, f"{role}: open FDs {mid[2]} at step {marks[1]} -> {end[2]}"
        assert end[0] <= 1.15 * mid[0], f"{role}: RSS {mid[0]} KiB -> {end[0]} KiB"
