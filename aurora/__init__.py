"""AuroraRL: RL post-training of LLMs over decentralized networks.

Layers (arrows point down only; see docs/ARCHITECTURE.md):

* ``aurora.policy`` and ``aurora.delta`` are the pure core: no sockets, no clocks, no simpy.
* I/O adapters (transport, store, ledger, engines, rl) and drivers (sim, emulation, runtime) call
  the core; they never re-implement a scheduling, lease or version decision.
"""

__version__ = "0.1.0"
