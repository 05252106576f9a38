"""Each state machine: legal moves work; an illegal move raises and leaves state unchanged."""

import copy

import pytest

from aurora.policy import IllegalTransition
from aurora.policy.leases import TRANSITIONS as LEASE_TABLE
from aurora.policy.leases import Claim, LeaseBook, LeaseState
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
    (lease,) = book.claim([Claim("a", 1, 1, "h")], now=0.0)[0]
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


def test_stage_and_activate_move_exactly_as_the_table_says():
    # ActorVersions.stage and .activate take legal moves without step() (a per-Actor hot path):
    # from every state a version can be in, on every active version around it, they end or
    # raise exactly as the table-driven _move does, and a raise changes nothing.
    def by_table(av: ActorVersions, trigger: str, v: int) -> None:
        if trigger == "stage":
            av._deltas[v] = av._move(v, "stage")
            return
        av._move(v, "activate")
        if av.active != v - 1:
            raise IllegalTransition("delta staging", DeltaState.STAGED, "activate onto base")
        av._set_active(v)

    compared = 0
    for active in (None, 2, 3, 4):
        for state in (None, "receive", "stage"):
            for v in (2, 3, 4, 5, 6):
                for trigger in ("stage", "activate"):
                    av = ActorVersions(active)
                    if state is not None and active is not None and v > active:
                        av.receive(v)
                        if state == "stage":
                            av.stage(v)
                    ref = copy.deepcopy(av)
                    before = copy.deepcopy(av)
                    try:
                        getattr(av, trigger)(v)
                        got = None
                    except IllegalTransition:
                        got = "raised"
                        assert av == before
                    try:
                        by_table(ref, trigger, v)
                        want = None
                    except IllegalTransition:
                        want = "raised"
                    assert (got, av) == (want, ref), (active, state, v, trigger)
                    compared += 1
    assert compared == 4 * 3 * 5 * 2
