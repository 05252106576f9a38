"""Each version's own delta size (issue 27): a trace recorded from a real run carries the bytes
of every delta it published, and the simulator charges version v its own bytes; a trace with
one number per model (the paper's) charges every version that number."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from aurora.topology import load_topology
from aurora.traces import PAPER, Series, load_traces
from experiments.sim_vs_real import sim_transfers
from sim.config import SimConfig, strategy
from sim.model import Simulation, simulate
from sim.runtrace.trace import _by_version

GEO = Path(__file__).resolve().parent.parent / "examples" / "geo.yaml"


def _cfg(series: Series | None, *, steps: int = 6, name: str = "aurora") -> SimConfig:
    topo = load_topology(GEO)
    traces = load_traces()
    model = topo.trainer.model
    m = dataclasses.replace(traces.models[model], delta_bytes_by_version=series)
    traces = dataclasses.replace(traces, models={**traces.models, model: m})
    return SimConfig(
        topology=topo, traces=traces, strategy=strategy(name), steps=steps, record_trace=True
    )


def _published(result) -> dict[int, int]:
    return {
        ev.version: ev.delta_bytes
        for _t, ev in result.fed
        if type(ev).__name__ == "DeltaPublished" and ev.delta_bytes is not None
    }


def test_each_version_is_published_with_its_own_recorded_size_and_later_ones_with_the_mean():
    base = _cfg(None)
    mean = Simulation(base).version_bytes
    ratio = mean / base.traces.models[base.topology.trainer.model].delta_bytes_leb128.value
    series = Series(values=(3e8, 2e8, 1e8), source="a test's sizes")
    result = simulate(_cfg(series))
    published = _published(result)
    assert [published[v] for v in (1, 2, 3)] == [int(b * ratio) for b in series.values]
    assert all(published[v] == int(mean) for v in published if v > 3)


def test_a_larger_version_takes_longer_to_reach_the_actors_than_a_smaller_one():
    # v2 four times v3's bytes: it is the size, not the version number, that costs time.
    lean = _cfg(None).traces.models[load_topology(GEO).trainer.model].delta_bytes_leb128.value
    series = Series(values=(lean, 4 * lean, lean, lean), source="a test's sizes")
    with_series = sim_transfers(simulate(_cfg(series)))
    without = sim_transfers(simulate(_cfg(None)))
    # The same run's v2 is late by its extra bytes; v1, the same size, is not.
    assert with_series[2] > 1.5 * without[2]
    assert with_series[2] > 1.5 * with_series[1]
    assert with_series[1] == pytest.approx(without[1])


def test_a_trace_without_sizes_per_version_charges_every_version_the_same_bytes():
    published = _published(simulate(_cfg(None)))
    assert len(set(published.values())) == 1


def test_a_dense_strategy_ignores_the_delta_sizes():
    series = Series(values=(1.0, 2.0), source="a test's sizes")
    sim = Simulation(_cfg(series, name="prime-full"))
    assert sim.bytes_of(1) == sim.bytes_of(2) == sim.version_bytes


@pytest.mark.parametrize(
    ("values", "match"),
    [((), "at least one"), ((1.0, -2.0), "finite numbers >= 0"), ((float("nan"),), "finite")],
)
def test_a_bad_series_is_refused(values, match):
    with pytest.raises(ValueError, match=match):
        Series(values=values, source="s")


def test_a_trace_file_with_a_bad_series_names_the_file_and_the_field(tmp_path):
    data = yaml.safe_load(PAPER.read_text())
    model = next(iter(data["models"]))
    data["models"][model]["delta_bytes_by_version"] = {"values": "big", "source": "s"}
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=rf"{path}.*delta_bytes_by_version"):
        load_traces(path)


def test_a_run_missing_a_versions_size_records_no_series():
    full = {v: {"delta_bytes": 100 * v} for v in (1, 2, 3)}
    recorded = _by_version(full, "run r")
    assert recorded["delta_bytes_by_version"]["values"] == [100.0, 200.0, 300.0]
    assert _by_version({1: {"delta_bytes": 5}, 3: {"delta_bytes": 7}}, "run r") == {}
    assert _by_version({1: {"delta_bytes": None}}, "run r") == {}
    assert _by_version({}, "run r") == {}
