"""Running many independent simulations: every local core by default, a Dask cluster on request.

Theory of operation
-------------------
A sweep is a list of :class:`experiments.common.Point` (identifying columns and a
:class:`sim.config.SimConfig`) and a *measure* (a module-level function ``SimConfig -> dict``).
:func:`run` hands each point to an executor (this process, a local process pool, or a Dask
cluster) and yields ``(point, metrics)`` as each finishes, in completion order; the caller writes
rows as they come, so a sweep stopped halfway keeps what it computed and the next run computes
only the rest. Each simulation is a deterministic function of its config, so where it runs
changes nothing: the rows are the same as the serial run's (a test checks it on a local
cluster)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    from experiments.common import Point
    from sim.config import SimConfig

Measure = Callable[["SimConfig"], dict[str, Any]]


def default_workers() -> int:
    """Every core this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _one(measure: Measure, index: int, config: SimConfig) -> tuple[int, dict[str, Any]]:
    return index, measure(config)


def run(
    points: Sequence[Point],
    measure: Measure,
    *,
    workers: int | None = None,
    cluster: str | None = None,
) -> Iterator[tuple[Point, dict[str, Any]]]:
    """Measure every point; yield ``(point, metrics)`` as each finishes.

    Executors:

    * ``workers == 1``: in this process (tests, debugging, profiles);
    * default: a ``concurrent.futures.ProcessPoolExecutor`` over every local core;
    * ``cluster="tcp://HOST:PORT"``: the Dask ``distributed`` scheduler at that address (start one
      with ``dask scheduler`` and ``dask worker tcp://HOST:PORT`` on each host, with this package
      installed); ``cluster="local"`` starts a ``LocalCluster`` on this machine. Dask is the
      optional extra ``pip install -e .[cluster]``: a well-kept engine (scheduling, retries of lost
      workers, a dashboard) instead of a hand-written one, and light enough to install in
      seconds.
    """
    if not points:
        return
    if cluster is not None:
        yield from _on_dask(points, measure, cluster)
        return
    n = min(workers or default_workers(), len(points))
    if n <= 1:
        for point in points:
            yield point, measure(point.config)
        return
    with ProcessPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(_one, measure, i, p.config) for i, p in enumerate(points)]
        for future in as_completed(futures):
            i, metrics = future.result()
            yield points[i], metrics


def _on_dask(
    points: Sequence[Point], measure: Measure, cluster: str
) -> Iterator[tuple[Point, dict[str, Any]]]:
    try:
        from distributed import Client, LocalCluster, as_completed
    except ImportError:
        raise ValueError(
            "--cluster needs Dask: pip install -e '.[cluster]' (dask[distributed])"
        ) from None
    local = LocalCluster(processes=True, dashboard_address=None) if cluster == "local" else None
    try:
        with Client(local if local is not None else cluster, timeout="30s") as client:
            futures = [
                client.submit(_one, measure, i, p.config, pure=False) for i, p in enumerate(points)
            ]
            for future in as_completed(futures):
                i, metrics = future.result()
                yield points[i], metrics
    except OSError as exc:
        raise ValueError(f"--cluster {cluster}: cannot reach the Dask scheduler: {exc}") from None
    finally:
        if local is not None:
            local.close()
