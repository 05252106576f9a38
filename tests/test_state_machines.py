"""Each state machine: legal moves work; an illegal move raises and leaves state unchanged."""

import copy

import pytest

from aurora.policy import IllegalTransition
from aurora.policy.leases import TRANSITIONS as LEASE_TABLE
from aurora.policy.leases import LeaseBook, LeaseState
from aurora.policy.membership import ActorLife, advance
from aurora.policy.staging import ActorVersions, DeltaState


def test_staging_goes_receiving_staged_active():
    av = ActorVersions(3)
    av.receive(4)
    assert av.state(4) is DeltaState.RECEIVING
    av.stage(4)
    assert av.staged == 4
    av.activate(4)
    assert av.active == 4 and av.staged is None


def test_staging_refuses_to_activate_onto_the_wrong_base_and_changes_nothing():
    av = ActorVersions(3)
    av.stage(5)
    before = av.copy()
    with pytest.raises(IllegalTransition, match="base 3"):
        av.activate(5)
    assert av == before


@pytest.mark.parametrize(
    "move",
    [
        lambda av: av.activate(4),  # not staged
        lambda av: av.stage(3),  # not newer than active
        lambda av: av.receive(2),  # stale
        lambda av: av.fail(4),  # not receiving
        lambda av: av.catch_up(3),  # backwards
    ],
)
def test_staging_illegal_moves_raise_and_leave_state_unchanged(move):
    av = ActorVersions(3)
    av.receive(5)
    before = av.copy()
    with pytest.raises(IllegalTransition):
        move(av)
    assert av == before


def test_staging_without_weights_cannot_stage_but_can_catch_up():
    av = ActorVersions(None)
    with pytest.raises(IllegalTransition):
        av.stage(1)
    assert av == ActorVersions(None)
    av.catch_up(7)
    assert av.active == 7


def test_a_failed_receive_can_be_received_again():
    av = ActorVersions(1)
    av.receive(2)
    av.fail(2)
    av.receive(2)
    av.stage(2)
    assert av.staged == 2


def test_lease_table_ends_each_lease_exactly_once():
    assert set(LEASE_TABLE[LeaseState.CLAIMED].values()) == {
        LeaseState.SETTLED,
        LeaseState.EXPIRED,
        LeaseState.RELEASED,
    }
    for end in (LeaseState.SETTLED, LeaseState.EXPIRED, LeaseState.RELEASED):
        assert LEASE_TABLE[end] == {}


def test_expiring_a_settled_lease_is_illegal_and_changes_nothing():
    book = LeaseBook()
    book.add(["p"], 1)
    (lease,) = book.claim("a", 1, version=1, weights_hash="h", now=0.0)
    book.settle(lease.id, actor="a", version=1, weights_hash="h", now=1.0)
    before = copy.deepcopy(book)
    with pytest.raises(IllegalTransition, match="'expire' from state SETTLED"):
        book._end(lease.id, "expire")
    assert book == before


def test_actor_lifecycle_legal_path():
    life = ActorLife.NEW
    for trigger, expected in [
        ("join", ActorLife.CATCHING_UP),
        ("caught_up", ActorLife.READY),
        ("fall_behind", ActorLife.CATCHING_UP),
        ("caught_up", ActorLife.READY),
        ("notice", ActorLife.DRAINING),
        ("leave", ActorLife.GONE),
        ("join", ActorLife.CATCHING_UP),
    ]:
        life = advance(life, trigger)
        assert life is expected


@pytest.mark.parametrize(
    "life,trigger",
    [
        (ActorLife.READY, "join"),
        (ActorLife.DRAINING, "caught_up"),
        (ActorLife.GONE, "leave"),
        (ActorLife.GONE, "notice"),
        (ActorLife.NEW, "caught_up"),
    ],
)
def test_actor_lifecycle_illegal_moves_raise(life, trigger):
    with pytest.raises(IllegalTransition, match=trigger):
        advance(life, trigger)


def test_staging_judges_a_delta_by_its_base_the_one_rule_the_data_plane_asks():
    from aurora.policy.staging import Verdict, judge_staging

    held = {3: "a" * 64, 4: "b" * 64}  # active v3 and a staged v4, by weights hash
    judge = lambda v, base, h: judge_staging(v, base=base, base_hash=h, active=3, held=held)  # noqa: E731
    assert judge(5, 4, "b" * 64) == (Verdict.STAGE, "")
    assert judge(6, 5, "c" * 64) == (Verdict.WAIT, "")  # its base may still come
    verdict, why = judge(5, 4, "c" * 64)
    assert verdict is Verdict.REFUSE and "which this node does not hold" in why
    assert judge(5, 2, "a" * 64) == (Verdict.REFUSE, "D_5 is based on v2, older than the active v3")
    assert judge(3, 2, "a" * 64)[0] is Verdict.REFUSE  # not newer than the active version
