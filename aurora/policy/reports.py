"""What the Ledger does with an Actor's report before :func:`~aurora.policy.ledger.decide` sees
it: staged versions the Trainer has not announced yet, and a (re)connecting Actor's hello.

Theory of operation
-------------------
With cut-through publication (and the ``sequential`` pipeline) the data plane can run ahead of
the control plane: an Actor may hold D_v, verified against the signed announcement, before the
Trainer has told the Ledger that v is published. ``decide`` only knows published versions, so
:class:`StagedReports` keeps such a report and hands it back, as a ``DeltaStaged``, when
``DeltaPublished(v)`` has been decided (in Actor id order; only for an Actor that is still live
and not already past v). A report the Ledger already knows (the version is staged or active, or
at or below the Actor's active version: a re-subscribed node stages what it had again) or from
an Actor that is not live is dropped here rather than refused by ``decide``. The record is
bounded: a report is kept only for a version at most :func:`early_horizon` ahead of the newest
published one (``latest + max_lag + 1``: the Trainer cannot publish further ahead than the lag
bound lets Actors trail, so an honest early report never names a later version), so a flood of
``staged`` for versions never published holds at most ``max_lag + 1`` sets of Actor ids
(200,000 such reports held 59 MiB for good before).

:func:`classify_hello` turns the hello of an Actor that connects into what happened: the same
machine reconnecting (a network blip or a restarted Ledger: it is re-sent its route, live leases
and pending commit, and ``CaughtUp`` first if it moved to a newer known version meanwhile), or a
join (``ActorJoined``, after ``ActorLost`` when the Ledger still counted an older life of it
live). Either way the versions it says it staged go through :class:`StagedReports`.

Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from aurora.policy.events import ActorJoined, ActorLost, CaughtUp, DeltaStaged, Event
from aurora.policy.ledger import LIVE, LedgerState
from aurora.policy.staging import DeltaState


def early_horizon(state: LedgerState) -> int:
    """The newest version an early staged report may name (module docstring)."""
    return (-1 if state.latest is None else state.latest) + state.config.max_lag + 1


class StagedReports:
    """Staged reports held until their version is published (one set of Actors per version)."""

    def __init__(self) -> None:
        self.early: dict[int, set[str]] = {}
        """version -> Actors that staged it before it was published."""

    def staged(self, state: LedgerState, actor: str, version: int) -> DeltaStaged | None:
        """``actor`` says it holds D_``version`` staged: the event to decide now, or None (kept
        until ``version`` is published, or already known, or from an Actor not live)."""
        if version not in state.versions:
            rec = state.actors.get(actor)
            if version <= early_horizon(state) and rec is not None and rec.live:
                self.early.setdefault(version, set()).add(actor)
            return None
        rec = state.actors.get(actor)
        if rec is None or rec.life not in LIVE:
            return None
        active = rec.versions.active
        if (active is not None and version <= active) or rec.versions.state(version) in (
            DeltaState.STAGED,
            DeltaState.ACTIVE,
        ):
            return None
        return DeltaStaged(actor=actor, version=version)

    def published(self, state: LedgerState, version: int) -> list[DeltaStaged]:
        """``DeltaPublished(version)`` was decided: the reports it held, to decide in order
        (none, and all kept, while ``version`` is not published)."""
        if version not in state.versions:
            return []
        out = []
        for actor in sorted(self.early.pop(version, ())):
            rec = state.actors.get(actor)
            if rec is not None and rec.live and (rec.versions.active or 0) < version:
                out.append(DeltaStaged(actor=actor, version=version))
        return out


@dataclass(frozen=True, slots=True)
class Hello:
    """What an Actor's hello means (:func:`classify_hello`)."""

    reconnected: bool
    """The Ledger's live record of it is this machine: re-send its route, live leases and
    pending commit instead of joining it again."""
    events: tuple[Event, ...]
    """To decide first, in order."""


def classify_hello(state: LedgerState, actor: str, *, region: str, active: int | None) -> Hello:
    """Actor ``actor`` in ``region`` connected, holding ``active`` (None: no weights)."""
    rec = state.actors.get(actor)
    if rec is not None and rec.live:
        known = rec.versions.active
        if active is not None and known is not None and active > known and active in state.versions:
            # It switched versions while the Ledger could not hear it (a restart, a blip).
            return Hello(reconnected=True, events=(CaughtUp(actor=actor, version=active),))
        if known == active:
            return Hello(reconnected=True, events=())
        lost: tuple[Event, ...] = (ActorLost(actor=actor),)
    else:
        lost = ()
    return Hello(
        reconnected=False, events=(*lost, ActorJoined(actor=actor, region=region, active=active))
    )
