"""The SimPy discrete-event simulator: a driver of the policy core over recorded traces
(docs/SIMULATOR.md)."""
