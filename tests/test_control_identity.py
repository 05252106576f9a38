"""The control plane's second half (issue 26): every role proves its own identity, the Ledger
believes h(v) only from a signed announcement, decodes before it logs, keeps only admitted
payloads, bounds what a peer can make it hold, and refuses an altered log.

Each test is one attack of the issue's table, run against a real Ledger server over the real
channel (or, where the channel adds nothing, against the service's handlers)."""

import asyncio
import hashlib
import json
import sqlite3

import msgpack
import pytest

from aurora.delta.announce import (
    SnapshotAnnouncement,
    VersionAnnouncement,
    public_key_of,
    sign,
    trailer_bytes,
)
from aurora.delta.hashing import chain_hash
from aurora.keys import Identity, issue_identity, trainer_identity
from aurora.policy.events import ResultArrived
from aurora.policy.leases import LeaseConfig
from aurora.policy.ledger import LedgerConfig
from aurora.runtime.channel import Channel, connect
from aurora.runtime.job import make_spec
from aurora.runtime.ledger import driver as ledger_driver
from aurora.runtime.ledger import service as ledger_service
from aurora.runtime.ledger.config import LedgerServiceConfig
from aurora.runtime.ledger.service import LedgerService
from aurora.store.ledgerlog import LedgerLog, LogCorrupt
from aurora.topology import topology_from_dict

JOB_KEY = hashlib.sha256(b"the job's signing key").digest()
JOB_PUB = public_key_of(JOB_KEY)
SECRET = b"s" * 32
JOB_ID = "job-trust2-0123"
SPEC = (
    make_spec(
        topology_from_dict(
            {
                "name": "t",
                "trainer": {"region": "us", "model": "qwen3-8b", "gpus": 1},
                "regions": [{"name": "us"}],
                "actors": [{"region": "us", "gpu": "A100", "count": 1}],
            }
        ),
        strategy="aurora",
        seed=0,
        steps=3,
        store="unused-store",
        backend="standin",
    )
    .with_settings(
        job_id=JOB_ID, start_actors=1, prompts_per_step=2, group_size=2, max_new_tokens=8
    )
    .encode()
)
"""The encoded job spec the Trainer registers (small batches, short completions)."""
H0 = "ab" * 32
LEDGER = issue_identity("ledger", "ledger", JOB_KEY, job=JOB_ID)
"""The Ledger's own identity, certified by the job key for this job."""


def snapshot_signed(h: str = H0) -> bytes:
    ann = SnapshotAnnouncement(
        job=JOB_ID, version=0, weights_hash=h, chain_hash=h, size=4096, model_hash="ef" * 32
    )
    return sign(ann, JOB_KEY)


def delta_signed(v: int, base_hash: str, *, key: bytes = JOB_KEY) -> tuple[bytes, str]:
    """A signed announcement of a (made-up) D_v on ``base_hash``, and its h(v)."""
    delta_id = hashlib.sha256(f"delta {v}".encode()).hexdigest()
    ann = VersionAnnouncement(
        job=JOB_ID,
        version=v,
        base=v - 1,
        base_hash=base_hash,
        key="00" * 16,
        delta_id=delta_id,
        weights_hash=chain_hash(base_hash, delta_id),
        size=trailer_bytes(1) + 2048,
        segments=1,
        segment_size=4096,
    )
    return sign(ann, key), ann.weights_hash


def payload(prompt: str, index: int, ids: tuple[int, ...] = (1, 2)) -> bytes:
    comp = {"ids": list(ids), "lp": [-0.5] * len(ids)}
    return msgpack.packb({"prompt": prompt, "index": index, "completions": [comp, comp]})


def service(tmp_path, **kw) -> LedgerService:
    config = LedgerServiceConfig(
        policy=LedgerConfig(trainer_region="us", lease=LeaseConfig(initial_s=30.0)),
        log_path=str(tmp_path / "ledger.db"),
    )
    return LedgerService(config, public_key=JOB_PUB, **kw)


async def join(port: int, role: str, pid: str, ident: Identity | None, **hello) -> Channel:
    return await connect(
        "127.0.0.1",
        port,
        secret=SECRET,
        hello={"id": pid, "role": role, "region": "us", **hello},
        identity=ident,
        job_key=JOB_PUB,
        job=JOB_ID,
    )


async def running(tmp_path) -> tuple[LedgerService, int, Channel]:
    """A Ledger with the job registered and v0 published by the real Trainer."""
    svc = service(tmp_path)
    port = await svc.start("127.0.0.1", 0, secret=SECRET, identity=LEDGER)
    trainer = await join(port, "trainer", "trainer", trainer_identity(JOB_KEY))
    await trainer.send({"op": "job", "job": {"steps": 3, "prompts_per_batch": 2, "spec": SPEC}})
    await trainer.send(
        {
            "op": "published",
            "version": 0,
            "weights_hash": H0,
            "snapshot_announcement": snapshot_signed(),
            "snapshot_bytes": 4096,
        }
    )
    await until(lambda: svc.state.latest == 0)
    return svc, port, trainer


async def until(cond, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def rows(tmp_path, kind: str | None = None) -> list[dict]:
    log = LedgerLog(tmp_path / "ledger.db")
    try:
        return [r.record for r in log.events() if kind is None or r.kind == kind]
    finally:
        log.close()


# ---- identity per role -----------------------------------------------------------------


def test_a_secret_holder_claiming_the_trainer_role_cannot_send_finished(tmp_path):
    async def main() -> LedgerService:
        svc, port, _ = await running(tmp_path)
        mallory = issue_identity(
            "actor", "mallory", JOB_KEY, job=JOB_ID
        )  # a real Actor's credentials
        claims = [
            None,  # the secret alone, as before
            Identity(role="trainer", id="trainer", private_key=mallory.private_key, cert=None),
            Identity(
                role="trainer", id="trainer", private_key=mallory.private_key, cert=mallory.cert
            ),
        ]
        for ident in claims:
            try:
                ch = await join(port, "trainer", "trainer", ident)
            except ConnectionError as exc:
                assert "refused us" in str(exc) or "closed the connection" in str(exc)
                continue
            ch.send_nowait({"op": "finished"})  # the attack, wherever the connection got
            await asyncio.sleep(0.3)
        await svc.close()
        return svc

    svc = asyncio.run(main())
    assert not svc.finished
    assert not [r for r in rows(tmp_path, "driver") if r["type"] == "Finished"]


def test_another_secret_holder_cannot_take_over_an_actors_id(tmp_path):
    async def main() -> tuple[bool, bool]:
        svc, port, _ = await running(tmp_path)
        a1 = await join(
            port, "actor", "a1", issue_identity("actor", "a1", JOB_KEY, job=JOB_ID), active=0
        )
        await until(lambda: svc.state.book.live("a1"))
        mine, leases = svc.channels["a1"], svc.state.book.live("a1")
        evil = issue_identity("actor", "evil", JOB_KEY, job=JOB_ID)  # a certified Actor of its own
        for ident in (None, evil, Identity("actor", "a1", evil.private_key, evil.cert)):
            try:
                impostor = await join(port, "actor", "a1", ident, active=0)
            except ConnectionError:
                continue
            impostor.send_nowait({"op": "leave"})  # wherever its connection got
        await asyncio.sleep(0.3)
        kept = svc.channels.get("a1") is mine and not mine.closed and not a1.closed
        still = svc.state.actors["a1"].live and svc.state.book.live("a1") == leases
        await svc.close()
        return kept, still

    kept, still = asyncio.run(main())
    assert kept  # the victim keeps its connection
    assert still  # and its leases


def test_an_actor_reconnecting_with_its_own_identity_replaces_its_old_connection(tmp_path):
    async def main() -> LedgerService:
        svc, port, _ = await running(tmp_path)
        ident = issue_identity("actor", "a1", JOB_KEY, job=JOB_ID)
        first = await join(port, "actor", "a1", ident, active=0)
        await until(lambda: svc.state.book.live("a1"))
        old, leases = svc.channels["a1"], svc.state.book.live("a1")
        second = await join(port, "actor", "a1", ident, active=0)
        await until(lambda: svc.channels.get("a1") not in (None, old))
        assert old.closed and not second.closed
        assert svc.state.book.live("a1") == leases  # a blip, not a loss: its leases stay
        first.close()
        await svc.close()
        return svc

    asyncio.run(main())


def test_an_observer_is_read_only_and_cannot_write_a_fault(tmp_path):
    async def main() -> None:
        svc, port, _ = await running(tmp_path)
        obs = await join(
            port, "observer", "o", issue_identity("observer", "o", JOB_KEY, job=JOB_ID)
        )
        msg = await obs.recv()
        assert msg["op"] == "progress"
        await obs.send({"op": "fault", "spec": "made up"})
        await obs.send({"op": "finished"})
        await asyncio.sleep(0.3)
        assert not svc.finished
        await svc.close()

    asyncio.run(main())
    assert not [r for r in rows(tmp_path, "driver") if r["type"] == "Fault"]


def test_an_on_path_secret_holder_cannot_derive_the_session_keys():
    # The keys after the identity step depend on an X25519 secret nobody on the path holds:
    # two connections with the same secret, HELLO and nonces would still get different keys.
    import os

    from aurora.runtime.channel import identity_keys
    from aurora.transport.wire import Transcript, session_keys

    t = Transcript(hello=b"h", nonce_s=os.urandom(32), binding=b"")
    base = session_keys(SECRET, t)
    a = identity_keys(base, os.urandom(32), t, b"c" * 32, b"s" * 32)
    b = identity_keys(base, os.urandom(32), t, b"c" * 32, b"s" * 32)
    assert a != b and base not in (a, b)


@pytest.mark.parametrize(
    "hello", [{"active": 2**64 - 1}, {"staged": [-(2**63)]}, {"region": "x" * 200}]
)
def test_a_hello_out_of_bounds_is_refused_before_anything_is_logged(tmp_path, hello):
    async def main() -> None:
        svc, port, _ = await running(tmp_path)
        ch = await join(
            port, "actor", "a1", issue_identity("actor", "a1", JOB_KEY, job=JOB_ID), **hello
        )
        with pytest.raises(ConnectionError):
            while True:  # the welcome may come first; then the Ledger closes the connection
                await asyncio.wait_for(ch.recv(), 2.0)
        assert "a1" not in svc.state.actors
        await svc.close()

    asyncio.run(main())
    assert service(tmp_path).replay() == len(rows(tmp_path))


# ---- published: h(v) only from the signed announcement ---------------------------------


def test_a_published_with_a_made_up_hash_is_believed_only_as_signed(tmp_path):
    async def main() -> LedgerService:
        svc, port, trainer = await running(tmp_path)
        other_key = hashlib.sha256(b"not the job key").digest()
        forged, _ = delta_signed(1, H0, key=other_key)
        await trainer.send({"op": "published", "version": 1, "weights_hash": "ff" * 32})
        await trainer.send(
            {"op": "published", "version": 1, "weights_hash": "ff" * 32, "announcement": forged}
        )
        await asyncio.sleep(0.2)
        assert 1 not in svc.state.versions  # neither without a signature nor with a forged one
        signed, h1 = delta_signed(1, H0)
        await trainer.send(
            {
                "op": "published",
                "version": 1,
                "weights_hash": "ff" * 32,
                "announcement": signed,
                "delta_bytes": 2176,
            }
        )
        await until(lambda: 1 in svc.state.versions)
        await svc.close()
        return svc

    svc = asyncio.run(main())
    assert svc.state.versions[1].weights_hash == delta_signed(1, H0)[1]
    assert svc.published[1]["weights_hash"] != "ff" * 32


# ---- decode first, then log --------------------------------------------------------------


def test_out_of_range_messages_never_reach_the_log_and_it_replays(tmp_path):
    async def main() -> None:
        svc, port, _ = await running(tmp_path)
        a1 = await join(
            port, "actor", "a1", issue_identity("actor", "a1", JOB_KEY, job=JOB_ID), active=0
        )
        await until(lambda: svc.state.book.live("a1"))
        await a1.send({"op": "throughput", "tokens": "9" * 400, "seconds": 1.0})
        await a1.send({"op": "activated", "version": -1e30})
        await a1.send({"op": "caught_up", "version": "-" + "1" * 31})
        # Honest, after: a result (2 x 2 tokens) and its throughput report, which counts for
        # no more tokens than the admitted result holds.
        lease = svc.state.book.live("a1")[0]
        body = payload(lease.prompt, int(lease.prompt.split("-")[1]))
        await a1.send(
            {"op": "result", "lease": lease.id, "version": 0, "weights_hash": H0, "payload": body}
        )
        await a1.send({"op": "throughput", "tokens": 100, "seconds": 1.0})
        await until(
            lambda: (
                svc.state.actors["a1"].estimate is not None
                and any(r.get("type") == "ThroughputObserved" for r in rows(tmp_path, "policy"))
            )
        )
        await svc.close()

    asyncio.run(main())
    logged = rows(tmp_path)
    assert all(r.get("tokens") in (None, 4) for r in logged)
    assert not [r for r in logged if r.get("type") in ("Activation", "VersionActivated")]
    again = service(tmp_path)
    assert again.replay() == len(logged)  # starts again on its own log


# ---- payloads -----------------------------------------------------------------------------


async def with_leases(tmp_path) -> tuple[LedgerService, list]:
    svc = service(tmp_path)
    svc.note({"type": "Job", "steps": 3, "prompts_per_batch": 2, "spec": SPEC})
    svc._on_published(
        {
            "version": 0,
            "weights_hash": H0,
            "snapshot_announcement": snapshot_signed(),
            "snapshot_bytes": 9,
        }
    )
    svc._join_actor("a1", {"role": "actor", "region": "us", "active": 0})
    leases = svc.state.book.live("a1")
    assert len(leases) == 2
    return svc, leases


def result(lease, body: bytes, h: str = H0) -> dict:
    return {"op": "result", "lease": lease.id, "version": 0, "weights_hash": h, "payload": body}


def test_a_second_result_for_a_settled_lease_never_overwrites_the_admitted_payload(tmp_path):
    async def main() -> LedgerService:
        svc, (lease, _) = await with_leases(tmp_path)
        good = payload(lease.prompt, int(lease.prompt.split("-")[1]))
        svc._on_peer_message("a1", result(lease, good))
        other = payload(lease.prompt, int(lease.prompt.split("-")[1]), ids=(7, 7, 7))
        svc._on_peer_message("a1", result(lease, other))  # DUPLICATE
        assert svc.log.payload("a1", lease.id) == good
        return svc

    svc = asyncio.run(main())
    assert svc.counters.refused == {"DUPLICATE": 1} and svc.counters.accepted == 1


def test_refused_payloads_are_not_kept(tmp_path):
    async def main() -> None:
        svc, (lease, _) = await with_leases(tmp_path)
        body = payload(lease.prompt, int(lease.prompt.split("-")[1]))
        fake = lease._replace(id="L999")
        svc._on_peer_message("a1", result(fake, body))  # a made-up lease
        svc._on_peer_message("a1", result(lease, body, h="cd" * 32))  # wrong hash
        assert svc.log.payload("a1", "L999") is None
        assert svc.log.payload("a1", lease.id) is None
        n = svc.log.db.execute("SELECT COUNT(*) FROM payloads").fetchone()[0]
        assert n == 0

    asyncio.run(main())


@pytest.mark.parametrize(
    "bad",
    [
        msgpack.packb({"index": 0}),
        b"\xc1 not msgpack",
        "wrong prompt",
        "too many tokens",
        "a token id of 400 digits",
    ],
)
def test_a_result_whose_payload_is_not_what_its_lease_asked_is_refused_and_released(tmp_path, bad):
    async def main() -> LedgerService:
        svc, (lease, _) = await with_leases(tmp_path)
        index = int(lease.prompt.split("-")[1])
        body = {
            "wrong prompt": payload("b9-0", index),
            "too many tokens": payload(lease.prompt, index, ids=tuple(range(9))),
            "a token id of 400 digits": payload(lease.prompt, index).replace(
                b"\x01", b"\xcf" + b"\xff" * 8, 1
            ),
        }.get(bad, bad)
        svc._on_peer_message("a1", result(lease, body))
        assert svc.log.payload("a1", lease.id) is None
        assert lease.id not in {x.id for x in svc.state.book.live("a1")}
        return svc

    svc = asyncio.run(main())
    assert svc.counters.refused == {"BAD_PAYLOAD": 1}
    assert svc.counters.accepted == 0


# ---- bounded records -------------------------------------------------------------------


def test_200k_early_staged_reports_hold_at_most_the_lag_horizon(tmp_path):
    async def main() -> LedgerService:
        svc, _ = await with_leases(tmp_path)
        for i in range(200_000):
            svc._on_peer_message("a1", {"op": "staged", "version": 2 + i})
        return svc

    svc = asyncio.run(main())
    early = svc.core.reports.early
    assert set(early) <= {1, 2} and sum(map(len, early.values())) <= 2


def test_spans_are_written_decoded_and_within_their_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger_service, "SPANS_MAX_BYTES", 10_000)

    async def main() -> LedgerService:
        svc, _ = await with_leases(tmp_path)
        span = {"op": "span", "activity": "generate", "start": 1.0, "end": 2.0}
        for _ in range(1000):
            svc._on_peer_message("a1", {**span, "junk": "x" * 100_000})
        return svc

    svc = asyncio.run(main())
    written = svc._spans.read_text()
    assert len(written) <= 10_000 and "junk" not in written and svc.spans_dropped > 0


def test_a_peer_flooding_spans_writes_its_own_share_per_version_and_no_other_peers(tmp_path):
    """An honest peer sends at most ~10 spans a version; one that sends 5,000 writes
    SPANS_PER_VERSION per version published (+1), and another peer's spans still land."""

    async def main() -> LedgerService:
        svc, _ = await with_leases(tmp_path)
        span = {"op": "span", "activity": "generate", "start": 1.0, "end": 2.0}
        for _ in range(5000):
            svc._on_peer_message("a1", span)
        svc._on_peer_message("relay-x", {**span, "activity": "forward"})
        return svc

    svc = asyncio.run(main())
    rows = [json.loads(line) for line in svc._spans.read_text().splitlines()]
    allowed = ledger_service.SPANS_PER_VERSION * ((svc.state.latest or 0) + 2)
    assert sum(r["who"] == "a1" for r in rows) == allowed
    assert [r["who"] for r in rows].count("relay-x") == 1
    assert svc.spans_dropped == 5000 - allowed


# ---- the log -------------------------------------------------------------------------------


def test_an_altered_row_in_the_log_is_refused_at_start_with_one_line(tmp_path):
    async def main() -> None:
        svc, (lease, _) = await with_leases(tmp_path)
        svc._on_peer_message("a1", result(lease, payload(lease.prompt, 0)))
        svc.log.close()

    asyncio.run(main())
    db = sqlite3.connect(tmp_path / "ledger.db")
    seq = db.execute("SELECT seq FROM events WHERE body LIKE '%ActorJoined%'").fetchone()[0]
    db.execute("UPDATE events SET body = replace(body, '\"us\"', '\"eu\"') WHERE seq = ?", (seq,))
    db.commit()
    db.close()
    with pytest.raises(LogCorrupt, match=f"row {seq} .*checksum chain"):
        service(tmp_path).replay()


def test_an_altered_payload_in_the_log_is_refused_at_start(tmp_path):
    async def main() -> None:
        svc, (lease, _) = await with_leases(tmp_path)
        svc._on_peer_message("a1", result(lease, payload(lease.prompt, int(lease.prompt[-1]))))
        assert svc.counters.accepted == 1
        svc.log.close()

    asyncio.run(main())
    db = sqlite3.connect(tmp_path / "ledger.db")
    db.execute("UPDATE payloads SET body = ?", (payload("b1-0", 0, ids=(5, 5)),))
    db.commit()
    db.close()
    with pytest.raises(LogCorrupt, match="checksum chain"):
        service(tmp_path).replay()


def test_a_logged_event_that_does_not_decide_stops_replay_naming_it(tmp_path):
    log = LedgerLog(tmp_path / "ledger.db")
    bad = {"type": "ResultArrived", "actor": "nobody", "lease": "L1", "version": 0}
    bad["weights_hash"] = H0
    log.append(1.0, "policy", bad)  # written as if it had decided (a foreign log)
    log.close()
    with pytest.raises(ValueError, match="row 1, event ResultArrived, does not decide"):
        service(tmp_path).replay()


def test_an_invalid_event_is_kept_for_the_record_and_skipped_on_replay(tmp_path):
    async def main() -> None:
        svc, _ = await with_leases(tmp_path)
        assert svc.feed(ResultArrived(actor="x", lease="L1", version=0, weights_hash=H0)) == []
        svc.log.close()

    asyncio.run(main())
    log = LedgerLog(tmp_path / "ledger.db")
    kinds = [r.kind for r in log.events()]
    log.close()
    assert kinds[-1] == "invalid"
    svc = service(tmp_path)
    assert svc.replay() == len(kinds)


# ---- identities ----------------------------------------------------------------------------


def test_an_issued_identity_is_a_0600_file_whose_certificate_holds_for_its_role_id_job_and_time(
    tmp_path,
):
    import stat

    from aurora.keys import CLOCK_SKEW_S, check_identity, load_identity, write_identity

    ident = issue_identity("actor", "ca-0", JOB_KEY, job=JOB_ID, lifetime_s=3600, now=1e9)
    write_identity(tmp_path / "ca-0.identity", ident)
    assert stat.S_IMODE((tmp_path / "ca-0.identity").stat().st_mode) == 0o600
    back = load_identity(tmp_path / "ca-0.identity")
    assert back == ident
    key, cert = back.public_key, back.cert
    assert cert.job == JOB_ID and cert.expires - cert.issued == 3600

    def check(role="actor", pid="ca-0", job_key=JOB_PUB, job=JOB_ID, now=1e9 + 60, **kw):
        return check_identity(role, pid, key, cert, job_key, job=job, now=now, **kw)

    assert check() is None
    assert check(now=1e9 - CLOCK_SKEW_S + 1) is None  # the issuer's clock a little ahead
    assert check(now=1e9 + 3600 + CLOCK_SKEW_S - 1) is None  # ours a little ahead
    other_key = public_key_of(hashlib.sha256(b"another job").digest())
    for why, kw in (
        ("another id", {"pid": "ca-1"}),
        ("another role", {"role": "relay"}),
        ("the trainer's role", {"role": "trainer", "pid": "trainer"}),
        ("another job key", {"job_key": other_key}),
        ("another job", {"job": "another-job"}),
        ("not yet valid", {"now": 1e9 - CLOCK_SKEW_S - 1}),
        ("expired", {"now": 1e9 + 3600 + CLOCK_SKEW_S + 1}),
        ("revoked", {"revoked": {"ca-0"}}),
    ):
        assert check(**kw) is not None, why
    assert "expired" in check(now=1e9 + 7200)
    assert "another-job" in check(job="another-job")
    # A certificate whose expiry (or job) was edited no longer verifies.
    import dataclasses

    longer = dataclasses.replace(cert, expires=cert.expires + 10**6)
    assert check_identity("actor", "ca-0", key, longer, JOB_PUB, job=JOB_ID, now=1e9 + 7200)
    with pytest.raises(ValueError, match="trainer"):
        issue_identity("actor", "trainer", JOB_KEY, job=JOB_ID)


def test_an_identity_file_of_an_older_aurora_without_job_or_expiry_is_refused_in_one_line(
    tmp_path,
):
    import json

    from aurora.keys import KeyFileError, load_identity

    ident = issue_identity("actor", "a", JOB_KEY, job=JOB_ID)
    old = {"role": "actor", "id": "a", "key": ident.private_key.hex(), "cert": "00" * 64}
    (tmp_path / "old.identity").write_text(json.dumps(old))
    with pytest.raises(KeyFileError, match="no job and no expiry"):
        load_identity(tmp_path / "old.identity")


def test_a_registered_job_spec_that_does_not_decode_is_refused_before_it_is_logged(tmp_path):
    """A spec with an unknown key or a wrong type used to be logged first and decoded after:
    the Ledger raised on it, and again on every replay of its log."""

    async def main() -> LedgerService:
        svc = service(tmp_path)
        port = await svc.start("127.0.0.1", 0, secret=SECRET, identity=LEDGER)
        for bad in ({**SPEC, "stanin_hidden": 8}, {**SPEC, "group_size": "2"}):
            trainer = await join(port, "trainer", "trainer", trainer_identity(JOB_KEY))
            await trainer.send(
                {"op": "job", "job": {"steps": 3, "prompts_per_batch": 2, "spec": bad}}
            )
            await asyncio.sleep(0.3)
        await svc.close()
        return svc

    svc = asyncio.run(main())
    assert svc.job is None
    assert not [r for r in rows(tmp_path, "driver") if r["type"] == "Job"]
    again = service(tmp_path)  # the log replays: nothing in it trips the decoder
    again.replay()
    assert again.job is None


def test_a_flood_of_results_that_change_nothing_logs_a_bounded_number_and_replays_the_same(
    tmp_path,
):
    """Results for made-up leases (or another Actor's, or ended ones) change nothing and can be
    sent without end: each wrote ~1.1 KB of log. Past QUIET_ROWS (+ a quarter of the Actor's
    admitted results) they are decided (refused, counted) but not logged, and the log replays
    to the same state."""
    n = 500

    async def main() -> tuple[int, list[str]]:
        svc, (lease, _) = await with_leases(tmp_path)
        body = payload(lease.prompt, int(lease.prompt.split("-")[1]))
        svc._on_peer_message("a1", result(lease, body))  # admitted: logged
        rows0 = svc.log.db.execute("SELECT COUNT(*) FROM events").fetchone()[0]
        for i in range(n):
            svc._on_peer_message("a1", result(lease._replace(id=f"L{10**6 + i}"), body))
            svc._on_peer_message("a1", result(lease, body))  # DUPLICATE
        rows = svc.log.db.execute("SELECT COUNT(*) FROM events").fetchone()[0]
        assert svc.counters.refused == {"UNKNOWN_LEASE": n, "DUPLICATE": n}
        allowed = ledger_driver.QUIET_ROWS + 1 // ledger_driver.QUIET_ROWS_PER_ADMITTED
        assert rows - rows0 == allowed
        assert svc.unlogged == 2 * n - allowed
        pool = sorted(svc.core.state.book.leased)
        svc.log.close()
        return svc.counters.accepted, pool

    accepted, pool = asyncio.run(main())
    again = service(tmp_path)
    again.replay()
    assert again.counters.accepted == accepted == 1
    assert sorted(again.core.state.book.leased) == pool


def test_a_result_that_changes_nothing_is_one_the_lease_book_refuses_untouched():
    """LeaseBook.changes_nothing against settle and refuse_malformed: for every lease state and
    sender, where it says nothing changes, neither call changes the book."""
    import copy

    from aurora.policy.leases import Claim, LeaseBook, LeaseConfig

    book = LeaseBook(LeaseConfig())
    book.add([f"p{i}" for i in range(6)], 1)
    held = book.claim([Claim("a", 4, 1, "h")], now=0.0)[0]
    book.settle(held[0].id, actor="a", version=1, weights_hash="h", now=1.0)  # settled
    book.settle(held[1].id, actor="a", version=2, weights_hash="h", now=1.0)  # released
    book.expire_due(10**6)  # held[2], held[3] expired
    (fresh,) = book.claim([Claim("b", 1, 1, "h")], now=10**6)[0]  # claimed by b
    for lid in [*(lease.id for lease in held), fresh.id, "made-up"]:
        for actor in ("a", "b"):
            if not book.changes_nothing(lid, actor):
                assert (lid, actor) == (fresh.id, "b")
                continue
            for call in (
                lambda lid=lid, actor=actor: book.settle(
                    lid, actor=actor, version=1, weights_hash="h", now=10**6 + 1.0
                ),
                lambda lid=lid, actor=actor: book.refuse_malformed(lid, actor),
            ):
                before = copy.deepcopy(book.__dict__)
                verdict = call()
                assert verdict.refusal is not None and not verdict.returned_to_pool
                assert book.__dict__ == before
