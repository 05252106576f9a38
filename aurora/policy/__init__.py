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
"""
