"""The held-out validation's predictions come from other runs' committed inputs, change only
what each held-out case changes, and were committed before any held-out run (issue 27)."""

from __future__ import annotations

import pandas as pd
import pytest

from experiments import heldout
from sim.runtrace.record import replay_config

_CASES = [(name, case) for name, hset in heldout.SETS.items() for case in hset.cases]


@pytest.mark.parametrize(("name", "case"), _CASES)
def test_a_prediction_changes_only_what_its_held_out_case_changes(name, case):
    hset = heldout.SETS[name]
    spec = hset.cases[case]
    for strategy in spec["strategies"]:
        base = replay_config(hset.traces / heldout._base(strategy))
        cfg = heldout.predicted_config(case, strategy, hset)
        assert cfg.strategy.name == strategy
        assert cfg.traces == base.traces  # every recorded input is the base run's
        (lk,) = cfg.topology.links
        (b,) = base.topology.links
        assert lk.rtt_ms == spec["rtt_ms"]
        assert lk.gbps / b.gbps == pytest.approx(spec["rate_factor"] * heldout.wire_overhead.load())
        assert [g.count for g in cfg.topology.actors] == [spec["actors"]]
        assert cfg.batch_rollouts == spec["prompts_per_step"] * heldout.GROUP


@pytest.mark.parametrize("name", [n for n, h in heldout.SETS.items() if not h.superseded])
def test_the_committed_predictions_are_what_the_committed_inputs_predict(name):
    hset = heldout.SETS[name]
    committed = pd.read_csv(hset.predictions)
    again = heldout.predict(hset)
    assert list(committed.case) == list(again.case)
    for col in ("pred_step_time_s", "pred_tokens_per_s", "pred_transfer_s"):
        assert committed[col].to_numpy() == pytest.approx(again[col].to_numpy(), rel=1e-9)
    assert not committed["git_sha"].astype(str).str.endswith("-dirty").any()


def test_the_held_out_table_reports_prediction_replay_and_real_with_their_errors():
    rows = pd.DataFrame(
        [
            {
                "part": "heldout-link",
                "strategy": "aurora",
                "real_step_time_s": 1.0,
                "sim_step_time_s": 0.9,
                "real_tokens_per_s": 100.0,
                "sim_tokens_per_s": 110.0,
                "real_transfer_s": 0.2,
                "sim_transfer_s": 0.25,
            }
        ]
    )
    preds = pd.DataFrame(
        [
            {
                "case": "link",
                "strategy": "aurora",
                "pred_step_time_s": 1.2,
                "pred_tokens_per_s": 80.0,
                "pred_transfer_s": 0.2,
            }
        ]
    )
    rows = heldout.set_rows(rows.assign(backend="standin"), heldout.SETS["standin"])
    t = heldout.table(rows, preds).set_index("metric")
    assert t.loc["step_time_s", "pred_error"] == pytest.approx(0.2)
    assert t.loc["step_time_s", "replay_error"] == pytest.approx(-0.1)
    assert t.loc["transfer_s", "pred_error"] == pytest.approx(0.0)


def test_each_sets_rows_are_told_apart_by_part_and_backend():
    rows = pd.DataFrame(
        [
            {"part": "heldout-link", "backend": "standin"},
            {"part": "heldout-rl-link", "backend": "rl"},
            {"part": "compare", "backend": "rl"},
        ]
    )
    standin = heldout.set_rows(rows, heldout.SETS["standin"])
    rl = heldout.set_rows(rows, heldout.SETS["rl"])
    assert list(standin.case) == ["link"] and list(rl.case) == ["link"]
    assert list(rl.part) == ["heldout-rl-link"]


def test_the_rl_base_traces_carry_each_versions_delta_size():
    from aurora.traces import load_traces

    traces = load_traces(heldout.SETS["rl"].traces / "aurora" / "trace.yaml")
    (model,) = traces.models.values()
    assert model.delta_bytes_by_version is not None
    assert len(model.delta_bytes_by_version.values) == heldout.SETS["rl"].steps


@pytest.mark.parametrize("name", [n for n, h in heldout.SETS.items() if h.superseded])
def test_a_superseded_sets_predictions_stand_as_committed_from_a_clean_tree(name):
    committed = pd.read_csv(heldout.SETS[name].predictions)
    assert len(committed) and committed["git_sha"].nunique() == 1
    assert not committed["git_sha"].astype(str).str.endswith("-dirty").any()
