"""The held-out validation's predictions come from other runs' committed inputs, change only
what each held-out case changes, and were committed before any held-out run (issue 27)."""

from __future__ import annotations

import pandas as pd
import pytest

from experiments import heldout
from sim.runtrace import replay_config


@pytest.mark.parametrize("case", list(heldout.CASES))
def test_a_prediction_changes_only_what_its_held_out_case_changes(case):
    spec = heldout.CASES[case]
    for strategy in spec["strategies"]:
        base = replay_config(heldout.TRACES / heldout._base(strategy))
        cfg = heldout.predicted_config(case, strategy)
        assert cfg.strategy.name == strategy
        assert cfg.traces == base.traces  # every recorded input is the base run's
        (lk,) = cfg.topology.links
        (b,) = base.topology.links
        assert lk.rtt_ms == spec["rtt_ms"]
        assert lk.gbps / b.gbps == pytest.approx(spec["rate_factor"] * heldout.wire_overhead.load())
        assert [g.count for g in cfg.topology.actors] == [spec["actors"]]
        assert cfg.batch_rollouts == spec["prompts_per_step"] * heldout.GROUP


def test_the_committed_predictions_are_what_the_committed_inputs_predict():
    committed = pd.read_csv(heldout.PREDICTIONS)
    again = heldout.predict()
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
    t = heldout.table(rows, preds).set_index("metric")
    assert t.loc["step_time_s", "pred_error"] == pytest.approx(0.2)
    assert t.loc["step_time_s", "replay_error"] == pytest.approx(-0.1)
    assert t.loc["transfer_s", "pred_error"] == pytest.approx(0.0)
