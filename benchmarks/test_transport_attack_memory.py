"""Memory under attack: peak resident memory of a process hosting a Trainer and a relay, honest
against attacked, in one run (target: at most 1.5x).

Each side runs in a fresh process (``_attack_peer.py``). The attack: the relay's first source
floods it with self-consistent segments of deltas nobody announced (``GARBAGE_MB``), four
subscribers on the Trainer and four on the relay stop reading, and a connection floods the
Trainer with 1 MB of ``subscribe`` frames every second - while the Trainer publishes
``VERSIONS`` deltas of ``MB`` MB that an honest Actor behind the relay stages and activates.

    python -m pytest benchmarks/test_transport_attack_memory.py --benchmark-enable -s
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _attack_peer  # noqa: E402

pytestmark = pytest.mark.benchmark(group="transport")
MB, VERSIONS, GARBAGE_MB = 32.0, 6, 384.0


def _peak(attacked: bool) -> int:
    ctx = mp.get_context("spawn")
    to_outside, to_victim, result = ctx.Queue(), ctx.Queue(), ctx.Queue()
    out = ctx.Process(
        target=_attack_peer.outside,
        args=(attacked, MB, GARBAGE_MB, to_victim, to_outside),
        daemon=True,
    )
    vic = ctx.Process(
        target=_attack_peer.victim,
        args=(attacked, MB, VERSIONS, to_outside, to_victim, result),
    )
    out.start()
    vic.start()
    try:
        return int(result.get(timeout=300))
    finally:
        vic.join(10)
        out.terminate()
        out.join(5)


def test_peak_memory_of_a_trainer_and_relay_under_attack(benchmark):
    result = {}

    def both() -> None:
        result["honest"] = _peak(False)
        result["attacked"] = _peak(True)

    benchmark.pedantic(both, rounds=1, iterations=1)
    ratio = result["attacked"] / result["honest"]
    print(
        f"\npeak RSS of the Trainer+relay process, {VERSIONS} versions of {MB:.0f} MB: honest "
        f"{result['honest'] / 1e6:.0f} MB, attacked {result['attacked'] / 1e6:.0f} MB "
        f"({GARBAGE_MB:.0f} MB of garbage, {2 * _attack_peer.SLOW_READERS} readers that stop, "
        f"a subscribe flood) = {ratio:.2f}x (target <= 1.5x)"
    )
    assert ratio <= 1.5
