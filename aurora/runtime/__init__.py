"""The runtime: Trainer, Ledger, relays and Actors as processes (``aurora real``).

Theory of operation
-------------------
Every role is its own OS process and subcommand, so a deployment starts them on different hosts
and ``aurora real`` starts them all on one (``docs/RUNTIME.md``). The **Ledger**
(:mod:`~aurora.runtime.ledger`) drives the policy core with real events and the wall
clock, logging each event before acting on it, so a restarted Ledger replays to the same state;
the **Trainer** (:mod:`~aurora.runtime.trainer`) trains on each admitted batch and publishes
``D_v``; a **relay** (:mod:`~aurora.runtime.relay`) serves its region; an **Actor**
(:mod:`~aurora.runtime.actor`) generates, stages deltas meanwhile and takes every choice from
:func:`aurora.policy.actor.next_action`. Roles talk over the sealed control plane
(:mod:`~aurora.runtime.channel`; typed messages in :mod:`~aurora.runtime.messages`) and move
weights over the data plane (:mod:`aurora.transport`). No role decides scheduling, leases or
versions on its own.
"""
