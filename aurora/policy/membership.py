"""Actor lifecycle state machine and relay choice (paper, "Version-predicate join and delta
catch-up", "Region elasticity", "Spot instances as a concrete application").

An Actor is CATCHING_UP from the moment it joins until it is on the latest version, READY while
it can be given work, DRAINING after a preemption notice, GONE after a graceful leave or an
involuntary loss (:class:`ActorLife`); a GONE Actor may join again under the same id. Each region
other than the Trainer's has at most one relay that receives each delta once over the WAN and
forwards it to the region's Actors (:func:`elect_relay`, :func:`source_for`); when it disappears
a new one is elected from what is left, and an Actor whose route fails fetches from the Trainer
(:func:`fetch_order`).
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

from aurora.policy._fsm import step


class ActorLife(Enum):
    """Where an Actor is in the job (moves: ``TRANSITIONS``).

    CATCHING_UP from the moment it joins (it loads a snapshot and/or replays deltas until it is
    on the latest version), READY while it can be given work, DRAINING after a preemption notice
    (its leases were released at once; it takes no new work and finishes what it must before
    the deadline), GONE after a graceful leave or an involuntary loss (in which case its leases
    are left to expire: the Ledger cannot tell a dead Actor from a partitioned one). A READY
    Actor that falls more than one version behind goes back to CATCHING_UP. A GONE Actor may
    join again under the same id.
    """

    NEW = "new"
    CATCHING_UP = "catching_up"
    READY = "ready"
    DRAINING = "draining"
    GONE = "gone"


TRANSITIONS: dict[ActorLife, dict[str, ActorLife]] = {
    ActorLife.NEW: {"join": ActorLife.CATCHING_UP},
    ActorLife.CATCHING_UP: {
        "caught_up": ActorLife.READY,
        "notice": ActorLife.DRAINING,
        "leave": ActorLife.GONE,
        "lose": ActorLife.GONE,
    },
    ActorLife.READY: {
        "fall_behind": ActorLife.CATCHING_UP,
        "notice": ActorLife.DRAINING,
        "leave": ActorLife.GONE,
        "lose": ActorLife.GONE,
    },
    ActorLife.DRAINING: {"leave": ActorLife.GONE, "lose": ActorLife.GONE},
    ActorLife.GONE: {"join": ActorLife.CATCHING_UP},
}
"""Legal moves of an Actor's membership."""

MACHINE = "actor lifecycle"

TRAINER = "trainer"
"""Source name of the Trainer (and the Checkpoint Store beside it) in routes and fanout edges."""


def advance(life: ActorLife, trigger: str) -> ActorLife:
    """The lifecycle state after ``trigger``; raises IllegalTransition if not allowed."""
    return step(MACHINE, TRANSITIONS, life, trigger)


def elect_relay(standalone: Iterable[str], actors: Iterable[tuple[str, int | None]]) -> str | None:
    """Relay for one region: the smallest-id standalone relay, else the live Actor with the
    newest active version (smallest id on ties), else None.

    Each region other than the Trainer's has at most one relay that receives each delta once
    over the WAN and forwards it to the region's Actors. A standalone relay process is
    preferred; otherwise the seed is the region's most up-to-date live Actor. When a relay
    disappears a new one is elected from what is left and the region's Actors fall back to it;
    the relay itself fetches directly from the Trainer (or, where configured, from a live relay
    of another region, which spares the Trainer's egress: :func:`source_for`)."""
    relays = sorted(standalone)
    if relays:
        return relays[0]
    ranked = sorted(actors, key=lambda a: (-(a[1] if a[1] is not None else -1), a[0]))
    return ranked[0][0] if ranked else None


def source_for(
    actor: str,
    region: str,
    *,
    trainer_region: str,
    region_relay: str | None,
    peer_relays: Iterable[str] = (),
) -> str:
    """Where ``actor`` fetches deltas from. Actors in the Trainer's region fetch from the
    Trainer; others from their region's relay. The relay itself (or an Actor of a region left
    without one) fetches from a peer relay of another region when any are offered (the smallest
    id), else from the Trainer."""
    if region == trainer_region:
        return TRAINER
    if region_relay is not None and region_relay != actor:
        return region_relay
    peers = sorted(p for p in peer_relays if p != actor)
    return peers[0] if peers else TRAINER


def fetch_order(route: str | None) -> list[str]:
    """Where an Actor fetches deltas from, in order: the source the Ledger routed it to, then
    the Trainer (whose store holds every version) when the route fails."""
    return list(dict.fromkeys([s for s in (route, TRAINER) if s is not None]))
