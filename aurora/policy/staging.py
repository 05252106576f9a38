"""Delta staging state machine of one Actor: receiving -> staged -> active (paper, "Relay-based
fanout": staging is separate from activation).

Theory of operation
-------------------
Each version ``v`` an Actor hears of moves through ``NONE -> RECEIVING -> STAGED -> ACTIVE``:
segments of ``D_v`` are arriving (RECEIVING), the whole delta verified against its hash and held
in memory or on disk (STAGED), applied to the live weights (ACTIVE). Two rules of the data plane
(docs/ARCHITECTURE.md, "Correctness rules") are enforced here and nowhere else:

* stage ``D_v`` only once verified (``stage`` is the verified event) and only for a version newer
  than the active one;
* activate ``D_v`` only if the active version is its base ``v-1``.

Which complete, verified deltas a receiver stages is :func:`judge_staging`: its base must be
the active version or a staged one, with the same weights hash; a base that is newer than the
active version may still come (wait); any other base can never be here (refuse, with the reason).
The data plane's receive machine (:mod:`aurora.transport.receiver`) asks it and keeps no rule of
its own.

A join or catch-up moves the active version forward in one jump (:meth:`ActorVersions.catch_up`)
after the data plane has verified a snapshot and/or a chain of deltas. Entries at or below the
active version are dropped: they can never be activated again. Every method either completes or
raises :class:`~aurora.policy._fsm.IllegalTransition` with the object unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

from aurora.policy._fsm import IllegalTransition, step


class DeltaState(Enum):
    NONE = "none"
    RECEIVING = "receiving"
    STAGED = "staged"
    ACTIVE = "active"


TRANSITIONS: dict[DeltaState, dict[str, DeltaState]] = {
    DeltaState.NONE: {"receive": DeltaState.RECEIVING, "stage": DeltaState.STAGED},
    DeltaState.RECEIVING: {"stage": DeltaState.STAGED, "fail": DeltaState.NONE},
    DeltaState.STAGED: {"activate": DeltaState.ACTIVE},
    DeltaState.ACTIVE: {},
}
"""Legal moves of one version's delta on one Actor."""

MACHINE = "delta staging"


class ActorVersions:
    """Active version and in-flight deltas of one Actor."""

    __slots__ = ("active", "_deltas")

    def __init__(self, active: int | None = None) -> None:
        self.active: int | None = active
        self._deltas: dict[int, DeltaState] = {}

    def state(self, version: int) -> DeltaState:
        if self.active is not None and version <= self.active:
            return DeltaState.ACTIVE if version == self.active else DeltaState.NONE
        return self._deltas.get(version, DeltaState.NONE)

    @property
    def staged(self) -> int | None:
        """The lowest staged version above the active one (the next one it could activate)."""
        if not self._deltas:
            return None
        staged = [v for v, s in self._deltas.items() if s is DeltaState.STAGED]
        return min(staged, default=None)

    def is_staged(self, version: int) -> bool:
        return self._deltas.get(version) is DeltaState.STAGED

    def reachable(self) -> int | None:
        """The newest version reachable by activating staged deltas in order from the active
        one (the active version itself when the next is not staged). Entries are only ever
        above the active version, so this walks ``active + 1, active + 2, ...`` and stops at
        the first gap."""
        held = self.active
        if held is None:
            return None
        deltas, staged = self._deltas, DeltaState.STAGED
        while deltas.get(held + 1) is staged:
            held += 1
        return held

    def staged_versions(self) -> list[int]:
        """Every staged version above the active one, ascending."""
        return sorted(v for v, s in self._deltas.items() if s is DeltaState.STAGED)

    def _move(self, version: int, trigger: str) -> DeltaState:
        if self.active is None or version <= self.active:
            # Nothing to stage onto (no weights yet), or a version that is not newer: stale.
            raise IllegalTransition(MACHINE, self.state(version), trigger)
        return step(MACHINE, TRANSITIONS, self._deltas.get(version, DeltaState.NONE), trigger)

    def receive(self, version: int) -> None:
        self._deltas[version] = self._move(version, "receive")

    def stage(self, version: int) -> None:
        """``D_version`` was fully received and verified."""
        self._deltas[version] = self._move(version, "stage")

    def fail(self, version: int) -> None:
        """Receiving ``D_version`` failed; it may be received again."""
        self._move(version, "fail")
        del self._deltas[version]

    def activate(self, version: int) -> None:
        """Apply staged ``D_version`` at a safe point: only onto its base ``version-1``."""
        new = self._move(version, "activate")
        if self.active != version - 1:
            raise IllegalTransition(MACHINE, DeltaState.STAGED, f"activate onto base {self.active}")
        assert new is DeltaState.ACTIVE
        self._set_active(version)

    def catch_up(self, version: int) -> None:
        """Jump to ``version`` after a verified snapshot and/or delta chain was applied."""
        if self.active is not None and version <= self.active:
            raise IllegalTransition(MACHINE, self.state(version), "catch_up backwards")
        self._set_active(version)

    def _set_active(self, version: int) -> None:
        self.active = version
        self._deltas = {v: s for v, s in self._deltas.items() if v > version}

    def copy(self) -> ActorVersions:
        out = ActorVersions(self.active)
        out._deltas = dict(self._deltas)
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ActorVersions):
            return NotImplemented
        return self.active == other.active and self._deltas == other._deltas

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ActorVersions(active={self.active}, deltas={self._deltas})"


class Verdict(Enum):
    STAGE = "stage"
    WAIT = "wait"
    REFUSE = "refuse"


def judge_staging(
    version: int, *, base: int, base_hash: str, active: int, held: Mapping[int, str]
) -> tuple[Verdict, str]:
    """Whether a complete, verified ``D_version`` on ``base`` (whose weights hash it names as
    ``base_hash``) is staged now, with the one-line reason when it is refused. ``held`` maps the
    active version and every staged one to its weights hash."""
    if version <= active:
        return Verdict.REFUSE, f"D_{version} is not newer than the active v{active}; not staged"
    if base not in held:
        if base > active:
            return Verdict.WAIT, ""  # its base is on its way: staged when that one is
        return Verdict.REFUSE, f"D_{version} is based on v{base}, older than the active v{active}"
    if held[base] != base_hash:
        return Verdict.REFUSE, (
            f"D_{version} is based on v{base} (h={base_hash[:12]}..), which this node does not "
            f"hold (it has h={held[base][:12]}..); not staged"
        )
    return Verdict.STAGE, ""
