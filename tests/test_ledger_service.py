"""The Ledger process's durable log: a restarted Ledger replays it to exactly the same state."""

import asyncio
import pathlib

import pytest

from aurora.policy.events import ActorJoined, DeltaPublished, ResultArrived, Tick
from aurora.policy.leases import LeaseConfig
from aurora.policy.ledger import LedgerConfig
from aurora.runtime.ledger.config import LedgerServiceConfig
from aurora.runtime.ledger.service import LedgerService
from aurora.store.ledgerlog import LedgerLog
from tests.test_control_identity import H0, JOB_ID, JOB_PUB, delta_signed


def job_spec(tmp_path, **settings):
    """A whole job spec (stand-in compute) as the Trainer registers it."""
    from aurora.runtime.job import make_spec
    from aurora.topology import topology_from_dict

    topo = topology_from_dict(
        {
            "name": "t",
            "trainer": {"region": "us", "model": "qwen3-8b", "gpus": 1},
            "regions": [{"name": "us"}],
            "actors": [{"region": "us", "gpu": "A100", "count": 2}],
        }
    )
    spec = make_spec(
        topo, strategy="aurora", seed=0, steps=None, store=str(tmp_path), backend="standin"
    )
    return spec.with_settings(**settings)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def config(db) -> LedgerServiceConfig:
    return LedgerServiceConfig(
        policy=LedgerConfig(trainer_region="us", lease=LeaseConfig(initial_s=30.0)),
        log_path=str(db),
    )


async def drive(svc: LedgerService, clock: Clock) -> None:
    spec = job_spec(pathlib.Path(svc.config.log_path).parent, start_actors=2).encode()
    svc.note({"type": "Job", "steps": 3, "prompts_per_batch": 6, "spec": spec})
    svc.note({"type": "Published", "version": 0, "weights_hash": "h0"})
    svc.feed(DeltaPublished(version=0, weights_hash="h0", delta_bytes=None, snapshot_bytes=100))
    for a in ("a1", "a2"):
        svc.feed(ActorJoined(actor=a, region="us", active=0))
    assert svc.next_batch == 2  # batch 1 was requested once both were ready
    clock.now += 2.0
    for lease in svc.state.book.live("a1"):
        svc.feed(
            ResultArrived(actor="a1", lease=lease.id, version=0, weights_hash="h0"),
            payload=("a1", lease.id, b"result of " + lease.id.encode()),
        )
    clock.now += 60.0  # a2's leases expire and go back to the pool
    svc.feed(Tick())


def test_a_restarted_ledger_replays_its_log_to_the_same_state(tmp_path):
    db = tmp_path / "ledger.db"
    clock = Clock()

    async def first() -> LedgerService:
        svc = LedgerService(config(db), clock=clock)
        await drive(svc, clock)
        return svc  # "killed": never closed, nothing flushed beyond what each event committed

    before = asyncio.run(first())
    assert before.counters.expired == 3 and before.counters.accepted == 3

    async def second() -> LedgerService:
        svc = LedgerService(config(db), clock=clock)
        assert svc.replay() > 0
        return svc

    after = asyncio.run(second())
    assert after.state == before.state
    assert after.state.book == before.state.book
    a, b = after.pacer, before.pacer
    assert (a.next_batch, a.target, a.results, a.done) == (
        b.next_batch,
        b.target,
        b.results,
        b.done,
    )
    assert after.job is not None and after.job.prompts_per_batch == 6
    # The admitted results themselves survived with the events that carried them.
    first = after.pacer.results[1][0]
    assert after.log.payload(first.actor, first.lease) == b"result of " + first.lease.encode()


def test_an_event_the_policy_refuses_is_logged_and_changes_nothing(tmp_path):
    clock = Clock()

    async def main() -> None:
        svc = LedgerService(config(tmp_path / "l.db"), clock=clock)
        await drive(svc, clock)
        snapshot = (svc.state.book.pool_size, dict(svc.state.actors))
        assert (
            svc.feed(ResultArrived(actor="nobody", lease="L1", version=0, weights_hash="h0")) == []
        )
        assert (svc.state.book.pool_size, dict(svc.state.actors)) == snapshot

    asyncio.run(main())
    rows = list(LedgerLog(tmp_path / "l.db").events())
    assert rows[-1].record["actor"] == "nobody"


def test_an_unreadable_log_is_a_one_line_error(tmp_path):
    (tmp_path / "dir.db").mkdir()
    with pytest.raises(ValueError, match="cannot open the Ledger log"):
        LedgerLog(tmp_path / "dir.db")


def test_an_actor_reconnecting_to_a_restarted_ledger_reports_what_it_staged_meanwhile(tmp_path):
    db = tmp_path / "ledger.db"
    clock = Clock()

    async def first() -> None:
        svc = LedgerService(config(db), clock=clock)
        await drive(svc, clock)
        svc.note({"type": "Published", "version": 1, "weights_hash": "h1"})
        svc.feed(DeltaPublished(version=1, weights_hash="h1", delta_bytes=10, snapshot_bytes=None))
        # The Ledger dies here: a1's "staged v1" message never reaches it.

    asyncio.run(first())

    async def second() -> LedgerService:
        svc = LedgerService(config(db), clock=clock)
        svc.replay()
        assert svc.state.actors["a1"].versions.state(1).value != "staged"
        svc._join_actor("a1", {"role": "actor", "region": "us", "active": 0, "staged": [1]})
        return svc

    svc = asyncio.run(second())
    # Known at once, not after the staging grace: the Actor stays in the next batch.
    assert svc.state.actors["a1"].versions.state(1).value == "staged"
    assert svc.state.actors["a1"].live


def test_a_joiner_that_staged_a_version_before_its_announcement_is_counted_once_published(
    tmp_path,
):
    # Cut-through: a joining Actor can hold D_1 before the Trainer has told the Ledger v1 is
    # published. The join path used to drop it (only reconnections kept such reports), so the
    # Actor waited out the staging grace and was left out of the batch; both paths now go
    # through the core's staged reports.
    clock = Clock()

    async def main() -> LedgerService:
        svc = LedgerService(config(tmp_path / "l.db"), clock=clock, public_key=JOB_PUB)
        spec = job_spec(tmp_path, start_actors=9, job_id=JOB_ID).encode()
        svc.note({"type": "Job", "steps": 3, "prompts_per_batch": 6, "spec": spec})
        svc.note({"type": "Published", "version": 0, "weights_hash": H0})
        svc.feed(DeltaPublished(version=0, weights_hash=H0, delta_bytes=None, snapshot_bytes=9))
        svc._join_actor("a1", {"role": "actor", "region": "us", "active": 0, "staged": [1]})
        assert svc.state.actors["a1"].versions.state(1).value == "none"
        signed, _ = delta_signed(1, H0)
        svc._on_published({"version": 1, "announcement": signed, "delta_bytes": 10})
        return svc

    svc = asyncio.run(main())
    assert svc.state.actors["a1"].versions.state(1).value == "staged"
