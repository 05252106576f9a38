"""The one mechanism every AuroraRL state machine uses: a transition table as data.

Each state machine lives in its own file (h11's ``_state.py`` rule) and declares its legal moves
as ``{state: {trigger: next_state}}``. :func:`step` looks the move up and either returns the next
state or raises :class:`IllegalTransition`; it never mutates anything, so a caller that assigns
the result only after :func:`step` returns leaves its state unchanged on an illegal move.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import TypeVar

S = TypeVar("S", bound=Enum)


class IllegalTransition(ValueError):
    """An event arrived that the state machine does not allow in its current state.

    A ``ValueError`` because it is caused by input (an event from a peer or the driver), never by
    a bug inside the machine; the machine's state is left exactly as it was.
    """

    def __init__(self, machine: str, state: Enum, trigger: str) -> None:
        super().__init__(f"{machine}: illegal transition {trigger!r} from state {state.name}")
        self.machine = machine
        self.state = state
        self.trigger = trigger


def step(machine: str, table: Mapping[S, Mapping[str, S]], state: S, trigger: str) -> S:
    """Return the state after ``trigger`` from ``state``; raise :class:`IllegalTransition` if
    the table has no such move."""
    try:
        return table[state][trigger]
    except KeyError:
        raise IllegalTransition(machine, state, trigger) from None
