"""The Job Ledger process: the policy core's ``decide`` with real events and the wall clock,
durable in SQLite.

Every decision is the policy core's (:class:`aurora.policy.core.LedgerCore`, the same object the
simulator drives); this package keeps the log, the connections and the timers around it, one
idea per module, each a layer of :class:`~aurora.runtime.ledger.service.LedgerService`:

* :mod:`~aurora.runtime.ledger.driver`: every event logged, decided at one ``now``, its actions
  carried out, the pacer polled and its timers set;
* :mod:`~aurora.runtime.ledger.durable`: the log's driver records and the replay that rebuilds
  the state after a restart;
* :mod:`~aurora.runtime.ledger.service`: the server and one session per peer, by proven role;
* :mod:`~aurora.runtime.ledger.config` (the config and the registered job) and
  :mod:`~aurora.runtime.ledger.counts` (totals and latencies in fixed memory).
"""
