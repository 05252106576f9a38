"""Typed, bounded control messages (issue 26): one decode for every message, refusing with a
named reason, and the result payloads the Trainer trains on, checked so that a bad one is a
refused result and never a dead Trainer."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aurora.delta.announce import public_key_of
from aurora.runtime import messages as m
from aurora.runtime.trainer import TrainerProcess, TrainerRun
from tests.test_ledger_service import job_spec

# ---- decode: every message, every bound --------------------------------------------------

P, T, OB = m.Direction.PEER_TO_LEDGER, m.Direction.TRAINER_TO_LEDGER, m.Direction.OBSERVER_TO_LEDGER
LP, LT, LO = (
    m.Direction.LEDGER_TO_PEER,
    m.Direction.LEDGER_TO_TRAINER,
    m.Direction.LEDGER_TO_OBSERVER,
)
RESULT = {"lease": "L1", "version": 1, "weights_hash": "h1", "payload": b"x", "tokens": 4}
VALID: dict[tuple[m.Direction, str], dict[str, Any]] = {
    (P, "staged"): {"version": 3},
    (P, "activated"): {"version": 3, "weights_hash": "ab", "digest": "cd", "pause_ms": 1.5},
    (P, "caught_up"): {"version": 3},
    (P, "result"): RESULT,
    (P, "throughput"): {"tokens": 100, "seconds": 2.0},
    (P, "notice"): {"seconds": 30.0},
    (P, "leave"): {},
    (P, "heartbeat"): {},
    (P, "span"): {"activity": "generate", "version": 1, "start": 1.0, "end": 2.0, "tokens": 3},
    (P, "data"): {"addr": "127.0.0.1:4000"},
    (OB, "heartbeat"): {},
    (T, "job"): {"job": {"steps": 2, "prompts_per_batch": 8, "spec": {"job_id": "j"}}},
    (T, "published"): {"version": 1, "weights_hash": "h1", "announcement": b"a" * 300},
    (T, "get_batch"): {"batch": 1},
    (T, "verified"): {
        "actor": "a",
        "lease": "L1",
        "version": 1,
        "max_delta": 0.01,
        "mean_delta": 0.001,
        "min_logprob": -7.5,
        "tokens": 12,
    },
    (T, "refused"): {"actor": "a", "lease": "L1", "why": "gradient norm is nan"},
    (T, "stats"): {"version": 1, "loss": 0.5, "backend": "standin", "batch_versions": [0, 1]},
    (T, "finished"): {},
    (T, "heartbeat"): {},
    (T, "revocations"): {"data": b'{"job": "j", "ids": ["a"], "issued": 1, "sig": "00"}'},
    (LP, "welcome"): {"job": {"job_id": "j"}, "sources": {"trainer": "h:1"}},
    (LP, "announce"): {"data": b"a" * 300},
    (LP, "assign"): {"version": 1, "leases": [["L1", "b1-0"]], "expiry_in": 5.0},
    (LP, "commit"): {"version": 2},
    (LP, "exclude"): {"version": 2},
    (LP, "catch_up"): {"target": 4, "deltas": [3, 4], "snapshot": 2, "snapshot_hash": "h2"},
    (LP, "route"): {"source": "relay-ca", "addr": "h:2"},
    (LP, "stop"): {},
    (LT, "resume"): {"latest": 3, "done": [1, 2]},
    (LT, "batch"): {"batch": 2, "complete": True, "results": [{"actor": "a", "payload": b""}]},
    (LT, "batch_done"): {"batch": 2},
    (LO, "progress"): {"batch": 0, "done": [], "actors": ["a"], "refused": {}, "expired": 0},
    (LO, "batch_requested"): {"batch": 1, "version": 0},
    (LO, "batch_done"): {"batch": 1},
    (LO, "stats"): {"version": 1, "loss": 0.5},
    (LO, "published"): {"version": 1},
    (LO, "finished"): {},
    (OB, "status"): {},
    (LO, "status"): {"snapshot": {"latest": 3, "actors": [{"id": "a", "lag": 1}]}},
}


def test_every_message_has_a_valid_example_that_decodes_and_round_trips():
    assert set(VALID) == {(d, op) for d, table in m.MESSAGES.items() for op in table}
    for (direction, op), fields in VALID.items():
        msg = m.decode({"op": op, **fields}, direction)
        assert type(msg) is m.MESSAGES[direction][op]
        assert m.decode(msg.to_wire(), direction) == msg


def test_an_op_means_one_thing_per_direction():
    """``published`` from the Trainer carries h(v); the observers' note does not."""
    with pytest.raises(m.MessageError, match="published.weights_hash"):
        m.decode({"op": "published", "version": 1}, T)
    assert m.decode({"op": "published", "version": 1}, LO) == m.PublishedNote(version=1)
    with pytest.raises(m.MessageError, match="unknown op"):
        m.decode({"op": "finished"}, P)  # an Actor cannot finish the job


@pytest.mark.parametrize(
    ("msg", "why", "where"),
    [
        ([1, 2], m.Why.NOT_A_MAP, "message"),
        ({"version": 1}, m.Why.UNKNOWN_OP, "message"),
        ({"op": "launch_missiles"}, m.Why.UNKNOWN_OP, "message"),
        ({"op": "staged"}, m.Why.MISSING, "staged.version"),
        ({"op": "staged", "version": "1"}, m.Why.WRONG_TYPE, "staged.version"),
        ({"op": "staged", "version": True}, m.Why.WRONG_TYPE, "staged.version"),
        ({"op": "staged", "version": -1}, m.Why.OUT_OF_RANGE, "staged.version"),
        ({"op": "staged", "version": 2**53}, m.Why.OUT_OF_RANGE, "staged.version"),
        # the attack's 400-digit token count (sent as a string, which int() accepted)
        ({"op": "throughput", "tokens": "9" * 400, "seconds": 1.0}, m.Why.WRONG_TYPE, None),
        ({"op": "throughput", "tokens": 2**41, "seconds": 1.0}, m.Why.OUT_OF_RANGE, None),
        ({"op": "throughput", "tokens": 1, "seconds": math.inf}, m.Why.NOT_FINITE, None),
        ({"op": "throughput", "tokens": 1, "seconds": math.nan}, m.Why.NOT_FINITE, None),
        ({"op": "throughput", "tokens": 1, "seconds": 0.0}, m.Why.OUT_OF_RANGE, None),
        ({"op": "activated", "version": -(10**18)}, m.Why.OUT_OF_RANGE, "activated.version"),
        ({"op": "result", **RESULT, "lease": "L" * 200}, m.Why.TOO_LONG, None),
        ({"op": "result", **RESULT, "lease": "L\n1"}, m.Why.NOT_PRINTABLE, None),
        ({"op": "result", **RESULT, "payload": "text"}, m.Why.WRONG_TYPE, None),
        ({"op": "span", **VALID[P, "span"], "activity": "x" * 65}, m.Why.TOO_LONG, None),
        ({"op": "assign", **VALID[LP, "assign"], "leases": [["L1"]]}, m.Why.WRONG_TYPE, None),
        ({"op": "catch_up", **VALID[LP, "catch_up"], "deltas": [1] * 70_000}, m.Why.TOO_LONG, None),
        ({"op": "published", **VALID[T, "published"], "announcement": bytes(5000)}, None, None),
        ({"op": "job", "job": {"steps": 0, "prompts_per_batch": 8}}, m.Why.OUT_OF_RANGE, None),
        ({"op": "job", "job": {1: 2}}, m.Why.WRONG_TYPE, "job.job"),
        ({"op": "stats", "version": 1, "loss": {"a": 1}}, m.Why.WRONG_TYPE, "stats.loss"),
        ({"op": "stats", "version": 1, "batch_versions": [0] * 65}, m.Why.TOO_LONG, None),
    ],
)
def test_a_bad_message_is_refused_with_a_named_reason_and_field(msg, why, where):
    op = msg.get("op") if isinstance(msg, dict) else None
    direction = next((d for d, table in m.MESSAGES.items() if op in table), P)
    with pytest.raises(m.MessageError) as info:
        m.decode(msg, direction)
    err = info.value
    if why is not None:
        assert err.why is why, str(err)
    if where is not None:
        assert err.where == where
    line = str(err)
    assert "\n" not in line and len(line) <= 300


def test_a_receiver_refuses_an_op_it_does_not_take_from_that_sender():
    actor_ops = frozenset({"staged", "result", "leave"})  # e.g. what a relay may send
    with pytest.raises(m.MessageError, match="unknown op"):
        m.decode({"op": "throughput", "tokens": 1, "seconds": 1.0}, P, allowed=actor_ops)
    assert isinstance(m.decode({"op": "leave"}, P, allowed=actor_ops), m.Leave)


def test_fields_a_message_does_not_define_are_dropped():
    msg = m.decode({"op": "staged", "version": 1, "extra": "x" * 10_000}, P)
    assert msg == m.Staged(version=1) and "extra" not in msg.to_wire()


def test_the_hop_reports_spans_reach_the_ledger_with_every_field_they_carry():
    # A typed Span once dropped every hop time and loop-lag figure (the Ledger keeps only what
    # the message defines), and the delta-path tables silently came out empty.
    from aurora.runtime import hopreport
    from aurora.transport.node import NodeMetrics

    metrics = NodeMetrics()
    for hop in ("in_first", "in_last", "staged", "out_first", "out_last"):
        metrics.hop(3, hop)
    sent = [hopreport.lag_span([0.001, 0.004, 0.002], 10.0, 11.0)]
    sent += hopreport.changed_hops(metrics, {})
    for span in sent:
        assert m.decode(span, P).to_wire() == span


_ANY = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)


_DIRECTED_OPS = sorted(((d, op) for d, table in m.MESSAGES.items() for op in table), key=str)
_FIELD_NAMES = sorted(
    {f.name for t in m.MESSAGES.values() for c in t.values() for f in dataclasses.fields(c)}
)


@settings(max_examples=400, deadline=None)
@given(
    directed=st.sampled_from(_DIRECTED_OPS),
    fields=st.dictionaries(st.sampled_from(_FIELD_NAMES), _ANY),
)
def test_any_map_decodes_to_a_message_within_every_bound_or_is_refused(directed, fields):
    """Whatever a peer sends, decode returns a message all of whose fields are within their
    bounds, or raises MessageError - never another exception."""
    direction, op = directed
    try:
        msg = m.decode({"op": op, **fields}, direction)
    except m.MessageError:
        return
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        if value is None:
            assert f.metadata["optional"]
            continue
        assert f.metadata["bound"].check(value, "again") == value


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_any_bytes_as_a_payload_are_decoded_or_refused_never_raise(data):
    with pytest.raises(m.MessageError):
        m.decode_result_payload(
            data, prompt="b1-0", index=0, group_size=2, max_new_tokens=4, vocab_size=10
        )


# ---- result payloads ---------------------------------------------------------------------


def _payload(prompt="b1-3", index=3, comps=None, **extra) -> bytes:
    if comps is None:
        comps = [{"ids": [1, 2, 3], "lp": [-0.5, -1.0, -0.1]}, {"ids": [4], "lp": [-2.0]}]
    return msgpack.packb({"prompt": prompt, "index": index, "completions": comps, **extra})


JOB = {"group_size": 2, "max_new_tokens": 4, "vocab_size": 10}


def test_an_honest_payload_decodes_to_its_completions():
    p = m.decode_result_payload(_payload(), prompt="b1-3", index=3, **JOB)
    assert p.index == 3 and p.tokens == 4 and p.completions[1] == m.Completion(ids=(4,), lp=(-2.0,))


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (msgpack.packb({"index": 0}), m.Why.MISSING),  # the attack's payload
        (b"\xc1", m.Why.WRONG_TYPE),
        (msgpack.packb([1]), m.Why.NOT_A_MAP),
        (_payload(prompt="b1-4"), m.Why.MISMATCH),  # another prompt's rollouts
        (_payload(index=7), m.Why.MISMATCH),
        (_payload(comps=[{"ids": [1], "lp": [-1.0]}]), m.Why.MISMATCH),  # one of two
        (_payload(comps=[{"ids": [1, 2, 3, 4, 5], "lp": [-1.0] * 5}] * 2), m.Why.TOO_LONG),
        (_payload(comps=[{"ids": [10], "lp": [-1.0]}] * 2), m.Why.OUT_OF_RANGE),  # vocab
        (_payload(comps=[{"ids": [-1], "lp": [-1.0]}] * 2), m.Why.OUT_OF_RANGE),
        (_payload(comps=[{"ids": [1], "lp": [math.nan]}] * 2), m.Why.NOT_FINITE),
        (_payload(comps=[{"ids": [1], "lp": [5.0]}] * 2), m.Why.OUT_OF_RANGE),
        (_payload(comps=[{"ids": [1, 2], "lp": [-1.0]}] * 2), m.Why.MISMATCH),
        (_payload(comps=[{"ids": [1]}] * 2), m.Why.MISSING),
        (_payload(comps="many"), m.Why.WRONG_TYPE),
    ],
)
def test_a_bad_payload_is_refused_with_a_named_reason(payload, why):
    with pytest.raises(m.MessageError) as info:
        m.decode_result_payload(payload, prompt="b1-3", index=3, **JOB)
    assert info.value.why is why, str(info.value)


EOS = 2
"""End of sequence in the payloads below (the arithmetic tokenizer's)."""


@pytest.mark.parametrize(
    ("comp", "refused"),
    [
        ({"ids": [5, 7, EOS], "lp": [-0.5, -1.0, -0.1]}, False),  # ends at <eos>
        ({"ids": [5, 7, 9, 3], "lp": [-0.5] * 4}, False),  # the length limit, no <eos>
        ({"ids": [5, EOS, 7], "lp": [-0.5] * 3}, True),  # a token after <eos>
        ({"ids": [EOS, EOS], "lp": [-0.5] * 2}, True),
        ({"ids": [5, 7], "lp": [-0.5] * 2}, True),  # short, and no <eos>
        ({"ids": [], "lp": []}, True),  # nothing sampled
        ({"ids": [5, EOS], "lp": [-0.5, -24.0]}, False),  # above the floor of V = 10
        ({"ids": [5, EOS], "lp": [-0.5, -25.0]}, True),  # below it
        ({"ids": [5, EOS], "lp": [-60.0, -0.1]}, True),  # the attack's forged log-prob
        ({"ids": [5, EOS], "lp": [-math.inf, -0.1]}, True),
    ],
)
def test_tokens_after_eos_and_implausible_log_probs_are_refused(comp, refused):
    """The payload rule of aurora.policy.refusals: a completion ends at its first <eos> (or at
    the length limit), and no reported log-prob is below ln(1e-9 / V) - 1 (-24.03 for V = 10)."""
    good = {"ids": [3, EOS], "lp": [-0.3, -0.2]}
    body = _payload(comps=[good, comp])
    if refused:
        with pytest.raises(m.MessageError) as info:
            m.decode_result_payload(body, prompt="b1-3", index=3, eos_ids=(EOS,), **JOB)
        assert info.value.why in (m.Why.IMPLAUSIBLE, m.Why.NOT_FINITE), str(info.value)
    else:
        m.decode_result_payload(body, prompt="b1-3", index=3, eos_ids=(EOS,), **JOB)


def test_prompt_ids_map_to_task_indices_and_nothing_else_does():
    assert m.task_index("b1-0", 8) == 0 and m.task_index("b3-5", 8) == 21
    for bad in ("b0-1", "b1-8", "b1--1", "b01-1", "x1-1", "b1-1\n", "b١-1", "b" + "9" * 30 + "-1"):
        with pytest.raises(ValueError):
            m.task_index(bad, 8)


# ---- the Trainer: a bad payload is a refused result, never a dead Trainer ----------------


class _Channel:
    closed = False

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def send(self, msg: dict[str, Any]) -> None:
        self.sent.append(msg)


class _Compute:
    vocab_size = 10


def test_the_trainer_refuses_bad_payloads_of_a_batch_and_trains_on_the_rest(tmp_path, caplog):
    """Before, one admitted result with the payload {"index": 0} raised KeyError in the
    Trainer's batch fetch and killed it (and the Ledger inside it), after every restart too."""
    key = bytes(range(32))
    run = TrainerRun(
        spec=job_spec(
            tmp_path / "store", job_id="j", prompts_per_step=8, group_size=2, max_new_tokens=4
        ),
        run_dir=str(tmp_path / "run"),
        secret=b"s" * 32,
        signing_key=key,
        public_key=public_key_of(key),
    )
    trainer = TrainerProcess(run)

    def result(prompt, payload, lease="L1", version=1):
        return {"actor": "a1", "lease": lease, "prompt": prompt, "version": version,
                "payload": payload}  # fmt: skip

    results = [
        result("b2-3", msgpack.packb({"index": 0}), lease="L2"),
        result("b2-3", _payload(prompt="b2-3", index=11)),
        result("b2-4", _payload(prompt="b2-3", index=11), lease="L3"),  # another prompt's
        result("b2-5", _payload(prompt="b2-5", index=13, comps=[{"ids": [99], "lp": [-1.0]}] * 2)),
        result("b2-6", b"\xc1"),
        result("nonsense", _payload()),
        "not a map",
        result("b2-7", _payload(prompt="b2-7", index=15), version=-1),
    ]

    async def fetch():
        trainer.channel = _Channel()  # type: ignore[assignment]
        trainer.compute = _Compute()  # type: ignore[assignment]
        trainer._inbox = asyncio.Queue()
        trainer.done_batches = {2}
        await trainer._inbox.put({"op": "batch", "batch": 2, "complete": True, "results": results})
        return await trainer._fetch_batch(2)

    with caplog.at_level("WARNING", logger="aurora.runtime"):
        out = asyncio.run(fetch())
    assert [(index, version) for index, _, version in out] == [(11, 1)]
    assert trainer._batch_refused == 7 and trainer._batch_tokens == 4
    assert caplog.text.count("refused a result") == 7
