"""The policy core reads as the specification: its shape, checked from its source.

* no code is generated at run time (``exec``, ``eval``, ``compile``);
* each module's public names, and each class's public methods, are the listed ones: one entry
  point per operation, so a second, faster way to do the same thing shows up here as a name
  nobody listed (fast paths live in ``sim/fastpaths.py``, held to the core by
  ``tests/test_sim_fastpaths.py``);
* events, actions and the other records the core hands out are frozen: assigning raises;
* comments and docstrings give no microsecond costs and name no issue (those belong in the
  commit that measured them).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pathlib
import re

import pytest

POLICY = pathlib.Path(__file__).resolve().parents[1] / "aurora" / "policy"
MODULES = sorted(p.stem for p in POLICY.glob("*.py"))

PUBLIC: dict[str, set[str]] = {
    "__init__": set(),
    "_fsm": {"S", "IllegalTransition", "step"},
    "actor": {
        "Work",
        "ApplyPlan",
        "Generate",
        "Activate",
        "Drop",
        "Wait",
        "Decision",
        "plan_ready",
        "next_action",
        "not_worth_starting",
        "least_seconds",
        "assigned",
        "to_fetch",
        "after_catch_up",
        "takes_catch_up",
    },
    "allocation": {
        "DEFAULT_PRIOR_TOKENS_PER_S",
        "DEFAULT_EMA_BETA",
        "THROUGHPUT_SLACK",
        "DEFAULT_EXCLUSION_ALPHA",
        "prior",
        "split",
        "ema_update",
        "bounded_throughput",
        "exclusion_decay",
    },
    "core": {"LedgerCore"},
    "events": {
        "ActorJoined",
        "ActorLeft",
        "ActorLost",
        "PreemptionNotice",
        "RelayJoined",
        "RelayLost",
        "DeltaPublished",
        "DeltaStaged",
        "VersionActivated",
        "CaughtUp",
        "BatchRequested",
        "ResultArrived",
        "ResultMalformed",
        "ResultsArrived",
        "ResultVerified",
        "ResultRefused",
        "ThroughputObserved",
        "Tick",
        "Event",
        "Commit",
        "Assign",
        "Exclude",
        "CatchUp",
        "Route",
        "FallBack",
        "RelayAssigned",
        "Fanout",
        "Accepted",
        "Refused",
        "Expired",
        "Released",
        "Evicted",
        "BatchCompleted",
        "Action",
        "to_record",
        "event_from_record",
    },
    "leases": {
        "LeaseState",
        "TRANSITIONS",
        "MACHINE",
        "Refusal",
        "Lease",
        "Claim",
        "Verdict",
        "admits",
        "LeaseConfig",
        "LeaseBook",
    },
    "ledger": {
        "LedgerConfig",
        "LIVE",
        "SCHEDULABLE",
        "ActorRecord",
        "VersionInfo",
        "LedgerState",
        "RETAIN_BATCHES",
        "initial_state",
        "decide",
        "changes_nothing",
    },
    "membership": {
        "ActorLife",
        "TRANSITIONS",
        "MACHINE",
        "TRAINER",
        "advance",
        "elect_relay",
        "source_for",
        "fetch_order",
    },
    "pacer": {
        "lowest_allowed",
        "batch_version",
        "waiting_on",
        "request_at",
        "PacerConfig",
        "WakeAt",
        "Pacer",
    },
    "refusals": {
        "FALSE_REFUSAL",
        "ENGINE_GAP_NATS",
        "logprob_floor",
        "completion_fault",
        "Standing",
        "TRANSITIONS",
        "MACHINE",
        "DEFAULT_MAX_REFUSALS",
        "StrikeBook",
    },
    "reports": {"early_horizon", "StagedReports", "Hello", "classify_hello"},
    "sampling": {
        "DISPERSION_VARIANCE",
        "LOCATION_VARIANCE",
        "RankStats",
        "SamplingRule",
        "Skew",
        "best_of_shift",
        "boundary",
        "detection_tokens",
        "expected_max_normal",
        "judge_ranks",
        "max_shift",
        "noise",
        "reward_gain_bound",
    },
    "staging": {
        "DeltaState",
        "TRANSITIONS",
        "MACHINE",
        "ActorVersions",
        "Verdict",
        "judge_staging",
    },
    "timers": {"TickTimers"},
    "verification": {
        "Trust",
        "TRANSITIONS",
        "MACHINE",
        "CheckFailure",
        "Plan",
        "VerificationConfig",
        "Measures",
        "LOGPROB_FLOOR",
        "COIN_PERSON",
        "KEY_BYTES",
        "measure",
        "judge",
        "payload_digest",
        "coin",
        "plan",
        "pick_completions",
        "TrustRecord",
        "TrustBook",
    },
    "versions": {"Eligibility", "eligibility", "CatchUpPlan", "plan_catch_up"},
}
"""Each module's public names (defined there, not imported)."""

METHODS: dict[str, set[str]] = {
    "core.LedgerCore": {"start_pacing", "feed", "poll", "check_fraction", "staged", "early"},
    "leases.Verdict": {"admitted"},
    "leases.LeaseBook": {
        "add",
        "pool",
        "lease_length",
        "claim",
        "settle",
        "refuse_malformed",
        "changes_nothing",
        "expire_due",
        "release_actor",
        "live",
        "forget_settled",
        "check",
    },
    "ledger.ActorRecord": {"live", "schedulable"},
    "ledger.LedgerState": {"check_fraction", "excluded"},
    "pacer.Pacer": {
        "requesting",
        "prompts",
        "batch_of",
        "poll",
        "observe",
        "woke",
        "unblocked",
        "left",
        "check_request",
        "requested",
        "settle",
        "published",
    },
    "refusals.StrikeBook": {"excluded", "strike"},
    "reports.StagedReports": {"staged", "published"},
    "sampling.RankStats": {"add", "merge", "z", "z_spread"},
    "staging.ActorVersions": {
        "state",
        "staged",
        "is_staged",
        "reachable",
        "staged_versions",
        "receive",
        "stage",
        "fail",
        "activate",
        "catch_up",
        "copy",
    },
    "timers.TickTimers": {"arm", "fired"},
    "verification.TrustBook": {"record", "excluded", "fraction", "observe"},
}
"""Each class's public methods and properties, for every class of the core that has any."""

ISSUE_REFERENCES_LEFT = {"sampling", "verification"}
"""Modules whose docstrings still name an issue (each in its first lines: left to whoever next
changes that module)."""


def _tree(module: str) -> ast.Module:
    return ast.parse((POLICY / f"{module}.py").read_text())


def _defined(tree: ast.Module) -> tuple[set[str], dict[str, set[str]]]:
    """Public names a module defines at its top level, and its classes' public methods."""
    names: set[str] = set()
    methods: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                public = {
                    n.name
                    for n in node.body
                    if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")
                }
                if public:
                    methods[node.name] = public
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        names.add(name.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if not n.startswith("_")}, methods


def test_every_module_of_the_core_is_listed():
    assert set(MODULES) == set(PUBLIC)


@pytest.mark.parametrize("module", MODULES)
def test_no_code_is_generated_at_run_time(module):
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            assert name not in {"exec", "eval", "compile", "__import__"}, (module, node.lineno)


@pytest.mark.parametrize("module", MODULES)
def test_a_module_defines_exactly_its_listed_public_names(module):
    names, _ = _defined(_tree(module))
    assert names == PUBLIC[module]


@pytest.mark.parametrize("module", MODULES)
def test_a_class_has_exactly_its_listed_public_methods(module):
    _, methods = _defined(_tree(module))
    assert {f"{module}.{cls}": m for cls, m in methods.items()} == {
        key: m for key, m in METHODS.items() if key.split(".")[0] == module
    }


def _sample(field: dataclasses.Field[object]) -> object:
    """A value of the field's type, to build an instance with."""
    from aurora.policy.leases import Refusal
    from aurora.policy.versions import CatchUpPlan

    if field.default is not dataclasses.MISSING:
        return field.default
    kind = str(field.type)
    if kind.startswith("tuple"):
        return ()
    if kind.startswith("CatchUpPlan"):
        return CatchUpPlan(target=1, snapshot=None, deltas=(1,), bytes=1)
    if kind.startswith("Refusal"):
        return Refusal.LATE
    if kind.startswith("Work"):
        from aurora.policy.actor import Work

        return Work(1, ("L1",))
    return {"str": "x", "int": 1, "float": 1.0, "bool": True}[kind.split(" ")[0]]


def _records(module: str) -> list[tuple[str, str]]:
    """Every dataclass ``aurora.policy.<module>`` defines."""
    mod = importlib.import_module(f"aurora.policy.{module}")
    return [
        (module, name)
        for name in sorted(PUBLIC[module])
        if dataclasses.is_dataclass(getattr(mod, name))
        and getattr(mod, name).__module__ == mod.__name__
    ]


FROZEN = [*_records("events"), ("leases", "Verdict"), *_records("actor")]


@pytest.mark.parametrize(("module", "name"), FROZEN)
def test_a_record_the_core_hands_out_is_frozen_and_slotted(module, name):
    cls = getattr(importlib.import_module(f"aurora.policy.{module}"), name)
    assert "__slots__" in cls.__dict__, name
    obj = cls(**{f.name: _sample(f) for f in dataclasses.fields(cls)})
    for f in dataclasses.fields(cls):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, f.name, _sample(f))
    # No field to assign (Tick, Wait): a new attribute is refused too (slots, frozen).
    assert cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
    with pytest.raises((dataclasses.FrozenInstanceError, TypeError, AttributeError)):
        obj.anything = 1


@pytest.mark.parametrize("module", MODULES)
def test_comments_and_docstrings_give_no_microsecond_costs_nor_issue_numbers(module):
    text = (POLICY / f"{module}.py").read_text()
    costs = re.findall(r"\d\s*(?:us|µs|μs)\b|microsecond", text)
    assert not costs, (module, costs)
    if module not in ISSUE_REFERENCES_LEFT:
        issues = re.findall(r"\b[Ii]ssues? \d+|#\d{2,}", text)
        assert not issues, (module, issues)
