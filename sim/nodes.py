"""What the simulator knows about each receiver of policy versions: relays and Actors.

Plain records, no behaviour: the roles that change them are :mod:`sim.transfers` (what a node
holds and receives), :mod:`sim.actors` (what an Actor runs) and :mod:`sim.faults` (when a node
goes away).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from aurora.policy.actor import Work
from aurora.policy.membership import TRAINER
from aurora.policy.versions import CatchUpPlan
from sim.network import Flow, Resource

if TYPE_CHECKING:  # pragma: no cover - typing only
    import simpy

    from sim.cohorts import Cohort


@dataclass(eq=False, slots=True)
class Transfer:
    """One version moving from ``src`` to ``members`` (a cohort of identical receivers)."""

    version: int
    src: str
    members: list[str]
    flow: Flow | None = None
    start: float = 0.0
    """When the send began (s): the start of its span in the timeline."""
    cap: float = 0.0
    """Rate (bytes/s) one segment crosses the last hop at when nothing else shares it."""
    pair_cap: float = 0.0
    """Rate cap of the sender-receiver pair (bytes/s): TCP bundle, or LAN rate."""
    upstream: Flow | None = None
    """The relay's own inbound flow this forward is coupled to (cut-through), if any."""


@dataclass(eq=False, slots=True)
class Node:
    """A receiver of deltas: an Actor or a standalone relay."""

    id: str
    region: str
    nic: Resource
    """Its interface's sending side, shared by everything it forwards."""
    nic_in: Resource
    """Its interface's receiving side, shared by everything it receives."""
    held: set[int] = field(default_factory=set)
    """Versions held whole (verified)."""
    inbound: dict[int, Transfer] = field(default_factory=dict)
    """Versions being received."""
    live: bool = True
    waiters: dict[int, list[Callable[[], None]]] = field(default_factory=dict)
    """Callbacks for when a version is held whole (store-and-forward relays, catch-up)."""
    starters: dict[int, list[Callable[[], None]]] = field(default_factory=dict)
    """Callbacks for when a version starts arriving (cut-through forwards)."""


@dataclass(eq=False, slots=True)
class ActorNode(Node):
    """An Actor machine. A machine that is lost and returns is the same record, fresh."""

    gpu: str = ""
    rate: float = 0.0
    """Nominal generation throughput (tokens/s)."""
    spot: bool = False
    index: int = 0
    rng: np.random.Generator | None = None
    active: int | None = None
    """Active version (None before any weights are loaded)."""
    queue: deque[Work] = field(default_factory=deque)
    """Work leased to it, in arrival order."""
    pending_commit: int | None = None
    plan: CatchUpPlan | None = None
    pulling: set[int] = field(default_factory=set)
    """Versions (deltas, or a snapshot) being pulled from the Checkpoint Store; a revised
    catch-up plan (the target moved on) does not pull them again."""
    source: str = TRAINER
    draining: bool = False
    """Under a preemption notice: leaving at its deadline."""
    life: object | None = None
    """A token for this machine's current life (see :mod:`sim.actors`): a process that finds
    another token here when it wakes belongs to a life that has ended."""
    idle: simpy.Event | None = None
    """While the Actor waits for something to do: the event that wakes it."""
    cohort: Cohort | None = None
    """The cohort whose process drives it (:mod:`sim.cohorts`), or None: its own process."""
    recent: tuple[tuple[int, float], ...] = ()
    """Its last generation as ``((leases, seconds),)`` (empty: none yet): what it expects work
    to take at least when it asks whether work is still worth starting (:func:`aurora.policy.
    actor.next_action`). The runtime's Actor keeps its last few; one here, since a tuple per
    Actor is what 10^5 Actors can afford."""
    noise: list[float] = field(default_factory=list)
    """Throughput noises drawn ahead from ``rng``, next last (:meth:`sim.actors.Actors.
    draw_noise`); kept across lives, so the draws stay in order whatever the Actor becomes."""
