"""The pure policy core: every scheduling, lease and version decision of AuroraRL.

No module in this package imports time, asyncio, socket, threading, random or simpy (a test walks
the imports). Time is an argument (``now``, seconds as float); decisions are return values. The
simulator (``sim/``) and the runtime (``aurora/runtime``) both drive
:func:`aurora.policy.ledger.decide`; neither holds a copy of this logic.

Modules:

* :mod:`~aurora.policy.allocation` - proportional batch split, EMA estimates, exclusion decay.
* :mod:`~aurora.policy.versions` - the version predicate and the catch-up planner.
* :mod:`~aurora.policy.leases` - per-prompt leases and the acceptance predicate (lease machine).
* :mod:`~aurora.policy.staging` - receiving -> staged -> active per Actor (staging machine).
* :mod:`~aurora.policy.membership` - Actor lifecycle machine, relay election and routes.
* :mod:`~aurora.policy.ledger` - ``decide(state, event, *, now) -> (state, actions)``.
* :mod:`~aurora.policy.pacer` - when batch k starts and on which version, the start barrier,
  when a batch is complete (pacer machine).
* :mod:`~aurora.policy.reports` - staged reports that precede their version; what a hello means.
* :mod:`~aurora.policy.timers` - one lease-expiry tick per distinct expiry.
* :mod:`~aurora.policy.refusals` - what a result's completions may look like; refused results
  count against their Actor up to exclusion (strike machine).
* :mod:`~aurora.policy.core` - ``LedgerCore``: the above as the one object both drivers hold.

:class:`IllegalTransition` (every machine's refusal) is this package's public error; its home,
``_fsm``, is private to the package.
"""

from aurora.policy._fsm import IllegalTransition

__all__ = ["IllegalTransition"]
