"""The pure policy core: every scheduling, lease and version decision of AuroraRL.

No module in this package imports time, asyncio, socket, threading, random or simpy (a test walks
the imports). Time is an argument (``now``, seconds as float); decisions are return values. The
simulator (``sim/``) and the runtime (``aurora/runtime``) both drive
:func:`aurora.policy.ledger.decide`; neither holds a copy of this logic. Modules: ``allocation``
(proportional batch split, EMA estimates, exclusion decay), ``versions`` (the version predicate,
the catch-up planner), ``leases`` (per-prompt leases, the acceptance predicate), ``staging``
(receiving -> staged -> active per Actor), ``membership`` (Actor lifecycle, relay election,
routes), ``ledger`` (``decide(state, event, *, now) -> (state, actions)``), ``pacer`` (when batch
k starts and on which version, the start barrier, when a batch is complete), ``reports`` (staged
reports that precede their version; what a hello means), ``timers`` (one lease-expiry tick per
distinct expiry), ``refusals`` (the payload rule; strikes up to exclusion), ``core``
(``LedgerCore``: the above as the one object both drivers hold). Every state machine refuses an
illegal move with :class:`IllegalTransition`, the public error (its home ``_fsm`` is private).
"""

from aurora.policy._fsm import IllegalTransition

__all__ = ["IllegalTransition"]
