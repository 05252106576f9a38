"""Traces recorded from real runs: a finished ``aurora real`` run folder as the simulator's inputs.

Theory of operation
-------------------
The simulator charges time only from recorded inputs (:mod:`aurora.traces`). This package makes
them from a run of our own runtime, so that the simulator can replay the run and its predictions
be checked against what the run did (``experiments/sim_vs_real.py``). A run folder is read
(:mod:`sim.runtrace.run`), its measurements derived (:mod:`sim.runtrace.measurements`) and
written as ``<run>/sim/``: the simulator's trace format with each number's provenance
(:mod:`sim.runtrace.trace`), the deployment and the replay settings (:mod:`sim.runtrace.record`,
which also turns the folder back into a :class:`sim.config.SimConfig`). A loopback run's links
are the host's loopback as probed (:mod:`sim.runtrace.loopback`). ``python -m sim.runtrace
RUN_DIR`` records a run and replays it. Which input is recorded from what: docs/SIMULATOR.md.
"""
