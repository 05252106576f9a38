"""The runtime: Trainer, Ledger, relays and Actors as processes (``aurora real``).

Theory of operation
-------------------
Every role is its own OS process and its own subcommand, so a deployment starts them on different
hosts and ``aurora real`` starts them all on one (``docs/RUNTIME.md``):

* the **Ledger** (:mod:`~aurora.runtime.ledger_service`) drives the policy core
  (:class:`aurora.policy.core.LedgerCore`: ``decide`` and the pacer that says when each batch
  starts and is complete) with real events and the wall clock; every event is appended to
  SQLite before its actions are carried out (:mod:`~aurora.store.ledgerlog`), so a restarted
  Ledger replays its log through the core and resumes with the same state;
* the **Trainer** (:mod:`~aurora.runtime.trainer`) trains on the admitted results of each batch
  and publishes ``D_v`` through its data-plane node and the Checkpoint Store;
* a **relay** (:mod:`~aurora.runtime.relay`) is a data-plane node that subscribes to the Trainer
  and serves its region;
* an **Actor** (:mod:`~aurora.runtime.actor`) generates on its engine, stages deltas while it
  generates, and takes every choice at a safe point from :func:`aurora.policy.actor.next_action`.

Roles talk over the control plane (:mod:`~aurora.runtime.channel`: the data plane's authenticated
framing, every frame after the handshake sealed with a per-connection MAC, msgpack messages both
ways, each with one typed, bounded decode in :mod:`~aurora.runtime.messages`) and move weights
over the data plane
(:mod:`aurora.transport`). No role makes a scheduling, lease or version decision of its own.
"""
