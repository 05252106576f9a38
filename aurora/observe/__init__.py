"""Observability: one table of metrics, served by every role and written by every run.

* :mod:`aurora.observe.table` names every metric once (Prometheus name, TensorBoard tag, who
  serves it), :mod:`aurora.observe.steps` defines each per-step series once;
* :mod:`aurora.observe.ledger` counts the job as the Ledger sees it, :mod:`aurora.observe.node`
  a process's own node and engine; :mod:`aurora.observe.exporter` serves them at ``/metrics``;
* :mod:`aurora.observe.steplog` writes the step series to TensorBoard or W&B (``--log``);
* :mod:`aurora.observe.status` is ``aurora status``'s snapshot of a job.

The roles and the simulator call into this package through a line or two each; it imports
neither (``docs/OBSERVABILITY.md``).
"""
