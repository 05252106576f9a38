"""A sweep reuses a stored row only when it was produced from the same resolved configuration by
the same code: a changed setting or changed code reruns the point and replaces the stale row,
``--force`` reruns everything, and a dirty tree is recorded as such."""

from __future__ import annotations

import subprocess
from dataclasses import replace

import pandas as pd
import pytest

from aurora import provenance
from experiments import bandwidth_sweep
from experiments.common import parser, run_points, sweep_options


def _points(n: int = 2):
    return bandwidth_sweep.points()[:n]


def _counting(seen: list):
    def measure(cfg):
        seen.append(cfg)
        return bandwidth_sweep.measure(cfg)

    return measure


def test_a_rerun_with_the_same_configuration_and_code_computes_nothing(tmp_path):
    run_points("s", _points(), bandwidth_sweep.measure, root=tmp_path, workers=1)
    again = run_points("s", _points(), lambda cfg: pytest.fail("recomputed"), root=tmp_path)
    assert len(again) == 2
    assert again["run_key"].tolist() == [provenance.run_key(p.config) for p in _points()]


def test_a_changed_strategy_setting_reruns_its_point_and_replaces_the_stale_row(tmp_path):
    first = run_points("s", _points(), bandwidth_sweep.measure, root=tmp_path, workers=1)
    changed = _points()
    p0 = changed[0]
    strategy = replace(p0.config.strategy, streams=p0.config.strategy.streams + 7)
    changed[0] = replace(p0, config=replace(p0.config, strategy=strategy))  # same key columns
    seen: list = []
    rows = run_points("s", changed, _counting(seen), root=tmp_path, workers=1)
    assert [c.strategy.streams for c in seen] == [strategy.streams]  # only the changed point
    on_file = pd.read_csv(tmp_path / "s" / "rows.csv")
    assert len(on_file) == 2  # the stale row was replaced, not kept beside the new one
    assert rows["run_key"].iloc[0] != first["run_key"].iloc[0]
    assert rows["run_key"].iloc[1] == first["run_key"].iloc[1]
    assert f'"streams": {strategy.streams}' in rows["strategy_config"].iloc[0]


def test_changed_code_reruns_every_point(tmp_path, monkeypatch):
    run_points("s", _points(), bandwidth_sweep.measure, root=tmp_path, workers=1)
    monkeypatch.setattr(provenance, "code_version", lambda: "another-commit")
    seen: list = []
    rows = run_points("s", _points(), _counting(seen), root=tmp_path, workers=1)
    assert len(seen) == 2 and len(pd.read_csv(tmp_path / "s" / "rows.csv")) == 2
    assert all(k.endswith("@another-commit") for k in rows["run_key"])


def test_rows_written_before_run_keys_existed_are_stale(tmp_path):
    run_points("s", _points(), bandwidth_sweep.measure, root=tmp_path, workers=1)
    path = tmp_path / "s" / "rows.csv"
    pd.read_csv(path).drop(columns="run_key").to_csv(path, index=False)
    seen: list = []
    run_points("s", _points(), _counting(seen), root=tmp_path, workers=1)
    assert len(seen) == 2 and len(pd.read_csv(path)) == 2


def test_force_reruns_every_point_and_other_points_rows_stay(tmp_path):
    run_points("s", _points(3), bandwidth_sweep.measure, root=tmp_path, workers=1)
    args = parser("a sweep").parse_args(["--force", "--workers", "1"])
    seen: list = []
    rows = run_points("s", _points(2), _counting(seen), root=tmp_path, **sweep_options(args))
    assert len(seen) == 2 and len(rows) == 2
    assert len(pd.read_csv(tmp_path / "s" / "rows.csv")) == 3  # the third point's row is kept


def _git(repo, *args):
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def test_a_dirty_tree_is_recorded_as_such_and_two_edits_are_two_versions(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "rule.py").write_text("x = 1\n")
    _git(repo, "add", "rule.py")
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "one")
    monkeypatch.setattr(provenance, "ROOT", repo)
    provenance.code_version.cache_clear()
    try:
        clean = provenance.code_version()
        assert not provenance.git_sha().endswith("-dirty") and clean == provenance.git_sha()
        (repo / "rule.py").write_text("x = 2\n")
        provenance.code_version.cache_clear()
        first = provenance.code_version()
        assert provenance.git_sha() == clean + "-dirty"
        assert first.startswith(clean + "-dirty-")
        (repo / "rule.py").write_text("x = 3\n")
        provenance.code_version.cache_clear()
        assert provenance.code_version() not in (clean, first)
    finally:
        provenance.code_version.cache_clear()
