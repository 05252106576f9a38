"""Every experiment runs with its quick budget into a temporary results folder, writes rows and a
figure; experiments.all prints every claim of the paper's evaluation beside ours; sweeps run in
parallel (processes, or a Dask cluster), resume, and give the serial rows; the notebooks render
a figure for every experiment."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import re
from pathlib import Path

import nbformat
import numpy as np
import pandas as pd
import pytest
from nbclient import NotebookClient

from experiments import all as run_all
from experiments import bandwidth_sweep, heterogeneity, scalability, throughput
from experiments.common import Claim, run_points, summary_measure, warmup_steps

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def everything(tmp_path_factory) -> tuple[Path, str]:
    """``python -m experiments.all`` once, quick: the results folder and what it printed."""
    root = tmp_path_factory.mktemp("results")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run_all.main(["--out", str(root)])
    return root, printed.getvalue()


@pytest.fixture(scope="module")
def results(everything) -> Path:
    return everything[0]


@pytest.mark.parametrize("name", run_all.EXPERIMENTS)
def test_each_experiment_writes_rows_with_config_and_a_figure(results, name):
    rows = pd.read_csv(results / name / "rows.csv")
    assert len(rows) > 0
    assert {"git_sha", "seed", "strategy", "model", "faults"} <= set(rows.columns)
    assert (results / name / f"{name}.png").stat().st_size > 10_000


def test_all_prints_every_claim_beside_ours_and_says_which_cannot_be_simulated(everything):
    results, out = everything
    claims = [c for name in run_all.EXPERIMENTS for c in _claims(results, name)]
    assert len(claims) >= 60
    assert all(isinstance(c.ours, float) for c in claims)
    for c in claims + list(run_all.NOT_SIMULABLE):
        assert c.text in out
    # Each table's footer explains its verdict words, "not simulable" among them: count rows only.
    rows_only = re.sub(r"\nverdicts: .*?(?=\n\S|\Z)", "", out, flags=re.S)
    assert out != rows_only  # the footer is there
    assert rows_only.count("not simulable") == len(run_all.NOT_SIMULABLE)
    text = (results / "REPRODUCTION-tables.md").read_text()
    for name in run_all.EXPERIMENTS:
        assert f"## {name}" in text


def test_all_prints_how_many_claims_of_each_kind_count_as_reproduced(everything):
    results, out = everything
    claims = [c for name in run_all.EXPERIMENTS for c in _claims(results, name)]
    claims += list(run_all.NOT_SIMULABLE)
    for kind in ("mechanism", "arithmetic", "input"):
        mine = [c for c in claims if c.kind == kind]
        assert f"{kind:<10} {len(mine):>3} rows" in out
        counted = sum(c.reproduced for c in mine)
        assert f"{counted} counted as reproduced" in out
    assert "counted as reproduced" in (results / "REPRODUCTION-tables.md").read_text()


def test_rows_that_agree_by_construction_are_marked_and_never_count(results):
    claims = {c.id: c for name in run_all.EXPERIMENTS for c in _claims(results, name)}
    by_construction = {
        "fig11.payload.leb128": "input",  # the paper's 202 MB comes back out
        "fig14.qwen3-8b.ideal.10": "arithmetic",  # 15.6 GB / 400 Gbit/s
        "fig14.qwen3-8b.full.10": "arithmetic",
        "fig14.qwen3-8b.delta.10": "arithmetic",
        "fig14.qwen3-8b.full.0.25": "arithmetic",
        "table8.tokens_per_dollar.qwen3-8b": "arithmetic",  # prices
        "table8.tokens_per_dollar.qwen3-14b": "arithmetic",
        "fig16.actors.1": "input",  # the assumed 6K tokens/s
    }
    for cid, kind in by_construction.items():
        assert claims[cid].kind == kind, cid
        assert claims[cid].within or cid.startswith("fig14"), cid  # they agree ...
        assert not claims[cid].reproduced, cid  # ... and do not count
        assert f"{kind}, not counted" in claims[cid].verdict, cid
    assert claims["fig11.payload.naive"].kind == "mechanism"  # measured codec bytes


def test_a_claim_within_the_paper_counts_only_if_it_is_a_steady_mechanism_row():
    def claim(**kw):
        return Claim(id="x", where="w", text="t", low=10, high=20, ours=15, **kw)

    assert claim(kind="mechanism").reproduced
    assert not claim(kind="arithmetic").reproduced
    assert not claim(kind="input").reproduced
    unsteady = claim(kind="mechanism", steady=False)
    assert unsteady.within and not unsteady.reproduced
    assert "NOT STEADY" in unsteady.verdict


def test_the_regime_map_reports_the_gain_at_the_assumed_inputs_not_the_grid_maximum():
    from experiments import regimes

    cells = [(w, b, loss) for w in (10, 45) for b in (0.1, 1.0) for loss in (1e-6, 1e-4)]
    rows = []
    for w, b, loss in cells:
        assumed = (w, b, loss) == (45, 1.0, 1e-6)
        for system in (regimes.BASE, *regimes.MECHANISMS.values()):
            # Every mechanism gains 1% at the assumed cell and 50% at the others.
            base = 101.0 if assumed else 150.0
            tps = base if system == regimes.BASE else 100.0
            rows.append(
                {"window_s": w, "gbps": b, "loss": loss, "system": system, "tokens_per_s": tps}
            )
    out = {c.id: c for c in regimes.claims(pd.DataFrame(rows))}
    for mechanism in ("multi-stream", "relay"):
        c = out[f"regimes.{mechanism}.assumed"]
        assert c.ours == pytest.approx(1.0)
        assert not c.within
        assert "grid 1..50" in c.text


def test_the_warm_up_is_detected_and_a_run_too_short_for_it_says_so():
    # A start-up step, a five-step transient (the lag hiding broadcasts), then steady state.
    run = [100.0] + [200.0] * 5 + [50.0] * 30
    assert warmup_steps(run) == (6, True)
    assert warmup_steps(run[:9])[1] is False  # the transient is still in the tail
    assert warmup_steps(run[:3])[1] is False  # nothing to tell a transient from
    noisy = list(np.random.default_rng(0).normal(100, 5, 40))
    d, is_steady = warmup_steps(noisy)
    assert is_steady and d < 20


def test_the_async_rows_are_measured_past_their_lag_transient(results):
    rows = pd.read_csv(results / "throughput" / "rows.csv")
    assert set(rows["warmup"]) == {"mser"}
    assert rows["steady"].all()
    for model in throughput.MODELS:
        mine = rows[rows["model"] == model].set_index("system")
        # A lag of 4 hides the first broadcasts: more warm-up than the fixed 2 steps of old.
        assert mine.loc["prime-async4", "warmup_steps"] > 2
        # At steady state every dense version still crosses the one connection: any lag bound
        # gives one step per broadcast, PrimeRL-Full's step (docs/REPRODUCTION.md).
        for a in ("prime-async2", "prime-async4"):
            ratio = mine.loc[a, "step_time_s"] / mine.loc["prime-full", "step_time_s"]
            assert ratio == pytest.approx(1.0, abs=0.01), (model, a)


def _claims(results: Path, name: str) -> list[Claim]:
    module = importlib.import_module(f"experiments.{name}")
    rows = run_points(module.NAME, module.points(False), lambda cfg: pytest.fail(), root=results)
    return module.claims(rows)


def test_rerunning_a_sweep_computes_nothing_new(results):
    before = pd.read_csv(results / "heterogeneity" / "rows.csv")
    again = run_points(
        "heterogeneity",
        heterogeneity.points(),
        lambda cfg: pytest.fail("recomputed"),
        root=results,
    )
    assert len(again) == len(before)


def _small_points():
    return bandwidth_sweep.points()[:6]


def _fail_after_three(cfg, _seen=[]):  # noqa: B006 - a counter across calls
    _seen.append(cfg)
    if len(_seen) > 3:
        raise KeyboardInterrupt
    return bandwidth_sweep.measure(cfg)


def test_an_interrupted_sweep_keeps_the_rows_it_finished_and_resumes(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        run_points("sweep", _small_points(), _fail_after_three, root=tmp_path, workers=1)
    assert len(pd.read_csv(tmp_path / "sweep" / "rows.csv")) == 3
    computed = []

    def counting(cfg):
        computed.append(cfg)
        return bandwidth_sweep.measure(cfg)

    rows = run_points("sweep", _small_points(), counting, root=tmp_path, workers=1)
    assert len(computed) == 3 and len(rows) == 6


def test_a_parallel_sweep_gives_the_serial_rows(tmp_path):
    points = throughput.points(steps=4)[:4]
    serial = run_points("s", points, summary_measure, root=tmp_path / "a", workers=1)
    parallel = run_points("s", points, summary_measure, root=tmp_path / "b", workers=2)
    pd.testing.assert_frame_equal(serial, parallel)


def test_a_sweep_on_a_local_dask_cluster_gives_the_serial_rows(tmp_path):
    pytest.importorskip("distributed", reason="the [cluster] extra (dask[distributed])")
    points = throughput.points(steps=4)[:4]
    serial = run_points("s", points, summary_measure, root=tmp_path / "a", workers=1)
    dask = run_points("s", points, summary_measure, root=tmp_path / "b", cluster="local")
    pd.testing.assert_frame_equal(serial, dask)


def test_bandwidth_sweep_scales_dense_transfer_inversely_with_the_link(results):
    rows = pd.read_csv(results / "bandwidth_sweep" / "rows.csv")
    full = rows[rows.system.str.startswith("Full")].set_index("gbps").transfer_s
    assert full[0.25] / full[10.0] == pytest.approx(40, rel=0.01)
    delta = rows[rows.system.str.contains("LEB128")].set_index("gbps").transfer_s
    assert (full / delta).min() > 50  # 15.6 GB dense vs 202 MB delta


def test_throughput_ranks_the_strategies(results):
    rows = pd.read_csv(results / "throughput" / "rows.csv")
    t = rows[rows.model == "qwen3-8b"].set_index("system").tokens_per_s
    assert t["ideal-singledc"] >= t["aurora-leb128"] > t["prime-multistream"] > t["prime-full"]
    assert set(rows.system) == set(throughput.STRATEGIES)


def test_fig16_labels_each_step_by_the_actors_that_returned_rollouts_for_it(results):
    row = pd.read_csv(results / "scalability" / "rows.csv").iloc[0]
    steps = json.loads(row["steps_json"])
    cfg = scalability.points()[0].config
    from sim.model import simulate

    sim_rows = simulate(cfg).rows
    assert [s["actors"] for s in steps] == [
        sum(1 for n in json.loads(r["shares"]).values() if n > 0) for r in sim_rows
    ]
    # A joiner catches up for several steps after its join: the labels lag the joins.
    first_with = {n: min(s["step"] for s in steps if s["actors"] == n) for n in (2, 3, 4)}
    phase = scalability.points()[0].key["phase"]
    assert all(first_with[n] > phase * (n - 1) + 1 for n in (2, 3, 4))


# Notebooks named real_*.ipynb read the results of real-mode experiments (aurora real), which
# the quick simulated results of this fixture do not have; each is executed by its experiment's
# own test on the rows its quick mode wrote.
SIM_NOTEBOOKS = sorted(
    p.name for p in (ROOT / "notebooks").glob("*.ipynb") if not p.name.startswith("real_")
)


@pytest.mark.parametrize("notebook", SIM_NOTEBOOKS)
def test_each_notebook_runs_on_the_results_and_renders_its_figures_inline(
    results, monkeypatch, notebook
):
    monkeypatch.setenv("AURORA_RESULTS", str(results))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(ROOT / "notebooks" / notebook, as_version=4)
    NotebookClient(nb, timeout=120, resources={"metadata": {"path": str(results)}}).execute()
    for cell in nb.cells:
        if cell.cell_type == "code" and "plt." in cell.source:
            images = [o for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
            assert images, f"{notebook}: a plotting cell rendered no image:\n{cell.source[:200]}"


def test_the_notebooks_cover_every_experiment():
    text = "".join(
        cell.source
        for path in (ROOT / "notebooks").glob("*.ipynb")
        for cell in nbformat.read(path, as_version=4).cells
    )
    for name in run_all.EXPERIMENTS:
        assert f'load("{name}")' in text, name


def test_a_band_moves_one_unstated_input_at_a_time():
    from experiments import bands, relay

    point = relay.points()[0]
    cfg = point.config
    (rtt,) = bands.vary([point], "rtt=x2")
    assert [lk.rtt_ms for lk in rtt.config.topology.links] == [
        2 * lk.rtt_ms for lk in cfg.topology.links
    ]
    assert rtt.config.traces == cfg.traces
    (gen,) = bands.vary([point], "gen_window=x2")
    before = cfg.traces.gpus["A100"].tokens_per_s["qwen3-8b"].value
    assert gen.config.traces.gpus["A100"].tokens_per_s["qwen3-8b"].value == before / 2
    assert gen.config.topology == cfg.topology


def test_bands_report_each_claim_at_the_default_and_at_either_end(tmp_path):
    from experiments import bands

    df = bands.bands(tmp_path, experiments=("heterogeneity",), variants=("gen_window=x2",))
    assert len(df) == len(heterogeneity.PAPER_GAIN_PCT)
    for row in df.itertuples():
        assert row.low <= row.default <= row.high
        assert {row.low_at, row.high_at} <= {"default", "gen_window=x2"}
