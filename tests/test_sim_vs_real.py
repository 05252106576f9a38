"""Recorded traces of real runs replay in the simulator, and the sim-vs-real experiment's quick
mode runs end to end (issue 19).

One module-scoped run of the experiment's quick mode at a tiny size (loopback, the labelled
stand-in compute: three real runs of a few seconds) feeds every test here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from nbclient import NotebookClient

from aurora.topology import load_topology, topology_from_dict
from aurora.traces import load_traces
from sim.config import SimConfig, strategy
from sim.model import simulate
from sim.runtrace.record import record_run, replay_config
from sim.runtrace.run import RunFolderError, read_run

ROOT = Path(__file__).resolve().parent.parent
STEPS, TIMELINE_STEPS = 5, 20
PREEMPT_STEP, JOIN_STEP = 6, 14
"""The timeline's faults, at 30% and 70% of its steps (the experiment's own quick default): the
replacement's process joins a few seconds after it is started on a busy machine, and the 6 steps
after ~0.5 s each leave it time to join, catch up and take work before the run ends."""


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    from experiments import sim_vs_real

    out = tmp_path_factory.mktemp("svr")
    rows = sim_vs_real.main(
        [
            "--out",
            str(out),
            "--network",
            "loopback",
            "--steps",
            str(STEPS),
            "--timeline-steps",
            str(TIMELINE_STEPS),
        ]
    )
    return out, rows


def test_a_trace_recorded_from_a_real_run_loads_and_replays_to_completion(quick):
    out, rows = quick
    run = Path(rows[rows["strategy"] == "aurora"]["run"].iloc[0])
    traces = load_traces(run / "sim" / "trace.yaml")
    model = next(iter(traces.models.values()))
    assert model.extract_s.source.startswith("recorded from run")
    assert model.publish_s is not None and model.publish_s.value >= 0
    (gpu,) = traces.gpus.values()
    assert next(iter(gpu.tokens_per_s.values())).value > 0
    cfg = replay_config(run / "sim")
    assert cfg.publish_pipeline == "sequential" and cfg.control_latency
    result = simulate(cfg)
    assert [r["step"] for r in result.rows] == list(range(1, STEPS + 1))
    # The replay carries the run's own deployment: the Actors it started, the loopback probed.
    topo = load_topology(run / "sim" / "topology.yaml")
    assert sum(g.count for g in topo.actors) == 2
    probed = json.loads((run / "loopback.json").read_text())["gbps"]
    assert all(lk.gbps == pytest.approx(probed) for lk in topo.links)


def test_the_timeline_replay_strikes_the_runs_preemption_and_joins_the_replacement(quick):
    _, rows = quick
    run = Path(rows[rows["part"] == "timeline"]["run"].iloc[0])
    cfg = replay_config(run / "sim")
    kinds = {f.kind: f for f in cfg.faults}
    assert kinds["preempt"].at_step == PREEMPT_STEP and kinds["preempt"].target == "ca-a100-1"
    # The replacement joins when the run's Ledger saw it join (after its process started), or,
    # where its process never got in before the run ended, at the step it was started.
    joins = json.loads((run / "sim" / "replay.json").read_text())["recorded"]["joins"]
    if joins[0]["joined_s"] is None:
        assert kinds["join"].at_step == JOIN_STEP and kinds["join"].at_s is None
    else:
        assert kinds["join"].at_s == pytest.approx(joins[0]["joined_s"])
    result = simulate(cfg)
    shares = [json.loads(r["shares"]) for r in result.rows]
    assert all("ca-a100-1" not in s for s in shares[PREEMPT_STEP:])
    # What the simulator made of the join, from its own record (when the replacement takes work
    # depends on the real process's start time and on the simulated steps, so the real run is
    # no oracle for it): it joined at its time unless the simulated run had ended by then; it
    # had no work before; and once caught up, it had a share of the last batch if that batch
    # was requested after, on the version it caught up to or a later one (an Actor on a batch's
    # version, or one behind with the delta staged, as pacing waits for, is dispatched to).
    fed = [(t, type(ev).__name__, ev) for t, ev in result.fed]
    batches = [(t, ev.version) for t, kind, ev in fed if kind == "BatchRequested"]
    joined = [t for t, kind, ev in fed if kind == "ActorJoined" and ev.actor == "ca-new-0"]
    caught = [
        (t, ev.version) for t, kind, ev in fed if kind == "CaughtUp" and ev.actor == "ca-new-0"
    ]
    if kinds["join"].at_s is None or kinds["join"].at_s < result.rows[-1]["time_s"]:
        assert joined, "the simulator never joined the replacement"
    if kinds["join"].at_s is not None and joined:
        assert joined[0] == pytest.approx(kinds["join"].at_s)
    before = [k for k, (t, _) in enumerate(batches) if not joined or t < joined[0]]
    assert all("ca-new-0" not in shares[k] for k in before)
    if caught and batches[-1][0] > caught[0][0] and batches[-1][1] >= caught[0][1]:
        assert shares[-1].get("ca-new-0", 0) > 0


def test_the_quick_experiment_writes_rows_steps_figure_and_its_table(quick, capsys):
    from experiments import sim_vs_real

    out, rows = quick
    assert sorted(zip(rows["part"], rows["strategy"], strict=True)) == [
        ("compare", "aurora"),
        ("compare", "prime-full"),
        ("timeline", "aurora"),
    ]
    for m in ("step_time_s", "tokens_per_s", "transfer_s"):
        assert all(math.isfinite(x) and x > 0 for x in rows[f"real_{m}"]), m
        assert all(math.isfinite(x) and x > 0 for x in rows[f"sim_{m}"]), m
    assert rows["git_sha"].notna().all() and rows["config"].str.contains("standin").all()
    # Transfer means leave out the warm-up's versions, as the step means and the replay's
    # inputs do (issue 27): at most versions 3..STEPS of each compared run (the last one may
    # still be on its way when the run stops).
    compare = rows[rows["part"] == "compare"]
    assert compare["transfers"].between(1, STEPS - sim_vs_real.WARMUP).all()
    steps = pd.read_csv(out / "sim_vs_real" / "steps.csv")
    assert set(steps["source"]) == {"real", "sim"}
    assert (out / "sim_vs_real" / "sim_vs_real.png").stat().st_size > 0
    # Resumable: a second call measures nothing and prints the same table.
    again = sim_vs_real.main(
        ["--out", str(out), "--network", "loopback", "--steps", str(STEPS)]
        + ["--timeline-steps", str(TIMELINE_STEPS)]
    )
    assert len(again) == 3
    printed = capsys.readouterr().out
    assert "aurora/prime-full" in printed and "sim_vs_real:" not in printed


def test_the_notebook_reads_the_quick_rows_and_renders_its_figures(quick, monkeypatch):
    out, _ = quick
    monkeypatch.setenv("AURORA_RESULTS", str(out))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(ROOT / "notebooks" / "real_sim_vs_real.ipynb", as_version=4)
    NotebookClient(nb, timeout=120, resources={"metadata": {"path": str(out)}}).execute()
    for cell in nb.cells:
        if cell.cell_type == "code" and "plt." in cell.source:
            images = [o for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
            assert images, cell.source[:200]


def test_a_folder_that_is_not_a_finished_run_is_refused_naming_what_is_missing(tmp_path):
    with pytest.raises(RunFolderError, match=r"no job\.json"):
        read_run(tmp_path)
    with pytest.raises(RunFolderError):
        record_run(tmp_path)


def _two_region(control_latency: bool) -> SimConfig:
    topo = topology_from_dict(
        {
            "name": "lat",
            "trainer": {"region": "us", "model": "qwen3-8b", "gpu": "H100", "gpus": 8},
            "regions": [{"name": "us"}, {"name": "ca"}],
            "links": [{"a": "us", "b": "ca", "gbps": 10.0, "rtt_ms": 80, "loss": 0}],
            "actors": [{"region": "ca", "gpu": "A100", "count": 2}],
        }
    )
    return SimConfig(
        topology=topo,
        traces=load_traces(),
        strategy=strategy("aurora"),
        steps=3,
        control_latency=control_latency,
    )


def test_with_control_latency_leases_and_results_cross_the_link_one_way_each():
    off, on = simulate(_two_region(False)), simulate(_two_region(True))
    first_assign = {
        flag: min(t for t, who, what in r.trace if what.startswith("assign"))
        for flag, r in (("off", off), ("on", on))
    }
    assert first_assign == {"off": 0, "on": pytest.approx(0.040)}
    # Batch 1 completes 40 ms (leases out) + 40 ms (results back) later.
    assert on.rows[0]["time_s"] == pytest.approx(off.rows[0]["time_s"] + 0.080, abs=1e-6)


def test_with_control_latency_a_staged_report_crosses_the_link_once():
    # It was charged the one-way delay twice (once when sent, again when the core released
    # it): every DeltaStaged reached the Ledger 40 ms late on a 40 ms link in the replays.
    r = simulate(_two_region(True))
    received = {
        (who, int(what.split()[1][1:])): t
        for t, who, what in r.trace
        if what.startswith("received v") and who.startswith("ca-")
    }
    published = {ev.version: t for t, ev in r.fed if type(ev).__name__ == "DeltaPublished"}
    staged = [(t, ev) for t, ev in r.fed if type(ev).__name__ == "DeltaStaged"]
    assert staged
    for t, ev in staged:
        # One crossing after the later of holding it and its announcement (an early report
        # waits at the Ledger for the announcement, it does not cross again).
        held = received[(ev.actor, ev.version)] + 0.040
        assert t == pytest.approx(max(held, published[ev.version]), abs=1e-5)  # trace: 1 us
