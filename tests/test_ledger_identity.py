"""The Ledger proves who it is, and certificates end: each attack on real processes.

A genuine Trainer (or Actor) pointed at a Ledger that cannot show the job key's Ledger
certificate for this job stops with one line and trains nothing (the issue's fake Ledger held an
Actor's certificate and the job secret). A real ``aurora ledger`` process refuses certificates
that expired, are not valid yet, name another job or were revoked, telling their holder why
with no welcome and no log row, however often it comes back; a revocation survives the Ledger's
restart; a session ends with its certificate and a renewed identity resumes it, leases kept."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from aurora.delta.announce import public_key_of
from aurora.jobspec import JobSpec
from aurora.keys import (
    CLOCK_SKEW_S,
    Identity,
    Revocations,
    issue_identity,
    renew_identity,
    revoke,
    trainer_identity,
    write_identity,
)
from aurora.runtime.channel import Channel, Dismissed, IdentityRefused, connect, serve
from tests.test_control_identity import (
    JOB_ID,
    JOB_KEY,
    JOB_PUB,
    LEDGER,
    SECRET,
    SPEC,
    snapshot_signed,
)

FAIL = {"max_delta": 5.0, "mean_delta": 1.0, "min_logprob": -3.0, "tokens": 8}
"""A recompute's measures that fail verification (the Trainer's report that excludes)."""


def actor(pid: str, **kw) -> Identity:
    return issue_identity("actor", pid, JOB_KEY, job=JOB_ID, **kw)


def files(tmp_path: Path) -> dict[str, Path]:
    """The job's keys, spec (verified rollouts on, a store in ``tmp_path``) and the Ledger's
    identity as the files the role commands read."""
    out = {
        "key": tmp_path / "trainer.key",
        "pub": tmp_path / "job.pub",
        "secret": tmp_path / "job.secret",
        "job": tmp_path / "job.json",
        "ledger": tmp_path / "ledger.identity",
    }
    if out["job"].exists():
        return out
    out["key"].write_text(JOB_KEY.hex())
    out["key"].chmod(0o600)
    out["pub"].write_text(JOB_PUB.hex())
    out["secret"].write_text(SECRET.hex())
    out["secret"].chmod(0o600)
    spec = JobSpec.decode(SPEC).with_settings(verify=True, store=str(tmp_path / "store"))
    out["job"].write_text(json.dumps({"spec": spec.encode()}))
    write_identity(out["ledger"], LEDGER)
    return out


def aurora(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "aurora.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class LedgerProcess:
    """``aurora ledger`` on this job's files, its output in a file (never a pipe that fills)."""

    def __init__(self, tmp_path: Path) -> None:
        self.f = files(tmp_path)
        self.db = tmp_path / "ledger.db"
        self.out = tmp_path / "ledger.out"
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def start(self) -> int:
        f = self.f
        with open(self.out, "ab") as out:
            self.proc = subprocess.Popen(
                [
                    *(sys.executable, "-m", "aurora.cli", "ledger", "--job", str(f["job"])),
                    *("--db", str(self.db), "--port", str(self.port)),
                    *("--secret-file", str(f["secret"]), "--public-key", str(f["pub"])),
                    *("--identity", str(f["ledger"])),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        seen = self.out.stat().st_size if self.port else 0
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            text = self.out.read_bytes()[seen:].decode(errors="replace")
            if match := re.search(r"ledger: serving on [^\s:]+:(\d+)", text):
                self.port = int(match.group(1))
                return self.port
            assert self.proc.poll() is None, text[-2000:]
            time.sleep(0.1)
        raise AssertionError("the Ledger did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()

    def rows(self) -> int:
        db = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True)
        try:
            return int(db.execute("SELECT COUNT(*) FROM events").fetchone()[0])
        finally:
            db.close()

    def records(self) -> list[dict]:
        db = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True)
        try:
            return [json.loads(b) for (b,) in db.execute("SELECT body FROM events ORDER BY seq")]
        finally:
            db.close()


@pytest.fixture
def ledger(tmp_path):
    proc = LedgerProcess(tmp_path)
    proc.start()
    yield proc
    proc.stop()


async def dial(port: int, ident: Identity, *, job: str | None = JOB_ID, **hello) -> Channel:
    """Connect as ``ident``, checking the Ledger against ``job`` (None: the one its certificate
    names, as the roles do)."""
    return await connect(
        "127.0.0.1",
        port,
        secret=SECRET,
        hello={"id": ident.id, "role": ident.role, "region": "us", **hello},
        identity=ident,
        job_key=JOB_PUB,
        job=job,
    )


async def trainer_of(ledger: LedgerProcess) -> Channel:
    """The Trainer's session: the job registered and v0 published (batch 1 is then requested
    as soon as an Actor joins)."""
    ch = await dial(ledger.port, trainer_identity(JOB_KEY))
    spec = JobSpec.decode(json.loads(ledger.f["job"].read_text())["spec"])
    job = {"steps": 3, "prompts_per_batch": 2, "spec": spec.encode()}
    await ch.send({"op": "job", "job": job})
    await ch.send(
        {
            "op": "published",
            "version": 0,
            "weights_hash": "ab" * 32,
            "snapshot_announcement": snapshot_signed(),
            "snapshot_bytes": 4096,
        }
    )
    return ch


async def leases_of(ch: Channel, timeout: float = 10.0) -> list[str]:
    """The lease ids of the ``assign`` messages on ``ch``: from the first (within ``timeout``)
    to the first 0.5 s without one (a returning Actor is re-sent one per live lease)."""
    got: list[str] = []
    end = time.monotonic() + timeout
    while True:
        wait = max(0.1, end - time.monotonic()) if not got else 0.5
        try:
            msg = await asyncio.wait_for(ch.recv(), wait)
        except TimeoutError:
            if got:
                return sorted(got)
            raise
        if msg.get("op") == "assign":
            got += [lease for lease, _ in msg["leases"]]


async def closed_within(ch: Channel, timeout: float) -> bool:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            while True:
                try:
                    await ch.recv()
                except ConnectionError:
                    return True
    return False


# ---- a Ledger that cannot prove it is the job's ----------------------------------------------


class FakeLedger:
    """An attacker's control server on its own thread: the real channel code, with whatever
    identity the attacker holds (None: no identity step at all, as every Ledger was before).
    It counts the sessions that got past the handshake and what they sent."""

    def __init__(self, identity: Identity | None) -> None:
        self.sessions: list[str] = []
        self.messages: list[str] = []
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def handler(ch: Channel) -> None:
            self.sessions.append(ch.role)
            ch.send_nowait({"op": "resume", "latest": None, "done": []})
            ch.send_nowait({"op": "welcome", "job": None, "sources": {}})
            while True:
                self.messages.append(str((await ch.recv()).get("op")))

        async def start() -> None:
            kw = {} if identity is None else {"public_key": JOB_PUB, "identity": identity}
            self.server = await serve("127.0.0.1", 0, secret=SECRET, handler=handler, **kw)
            self.port = self.server.sockets[0].getsockname()[1]
            ready.set()

        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(start(), self.loop)
        assert ready.wait(10)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def fake_identity(kind: str) -> Identity | None:
    mallory = actor("mallory")  # a real Actor's identity: what the attacker of the issue held
    if kind == "no identity step":
        return None
    if kind == "an actor's certificate":
        return mallory
    if kind == "the genuine ledger certificate, copied":
        # The certificate is public (the Ledger shows it to every peer): without its key the
        # attacker signs with its own.
        return Identity("ledger", "ledger", mallory.private_key, LEDGER.cert)
    if kind == "a ledger certificate of another job":
        return issue_identity("ledger", "ledger", JOB_KEY, job="another-job")
    if kind == "an expired ledger certificate":
        lifetime = 600
        return issue_identity(
            "ledger",
            "ledger",
            JOB_KEY,
            job=JOB_ID,
            lifetime_s=lifetime,
            now=time.time() - lifetime - CLOCK_SKEW_S - 60,
        )
    raise AssertionError(kind)


FAKES = [
    "no identity step",
    "an actor's certificate",
    "the genuine ledger certificate, copied",
    "a ledger certificate of another job",
    "an expired ledger certificate",
]


@pytest.mark.parametrize("kind", FAKES)
def test_a_genuine_trainer_refuses_a_fake_ledger_and_trains_nothing(tmp_path, kind):
    f = files(tmp_path)
    job = tmp_path / "standin-job.json"  # the stand-in Trainer cannot recompute: no verify
    spec = JobSpec.decode(json.loads(f["job"].read_text())["spec"]).with_settings(verify=False)
    job.write_text(json.dumps({"spec": spec.encode()}))
    fake = FakeLedger(fake_identity(kind))
    try:
        run = aurora(
            *("trainer", "--job", str(job), "--run-dir", str(tmp_path / "run")),
            *("--ledger", f"127.0.0.1:{fake.port}"),
            *("--secret-file", str(f["secret"]), "--public-key", str(f["pub"])),
            *("--signing-key", str(f["key"])),
        )
    finally:
        fake.close()
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 1, run.stderr[-2000:]
    assert last.startswith("aurora trainer: ") and "is not this job's Ledger" in last, last
    assert "Traceback" not in run.stderr
    # It never got as far as a session: nothing registered, no batch asked for, nothing
    # trained or published beyond the v0 snapshot the Trainer makes before it connects.
    assert fake.messages == [] and (kind == "no identity step" or fake.sessions == [])
    meta = json.loads((tmp_path / "run" / "trainer" / "published.json").read_text())
    assert meta["version"] == 0


@pytest.mark.parametrize("kind", ["no identity step", "an actor's certificate"])
def test_an_actor_refuses_a_fake_ledger_with_one_line_before_it_says_who_it_is(tmp_path, kind):
    f = files(tmp_path)
    write_identity(tmp_path / "a1.identity", actor("a1"))
    fake = FakeLedger(fake_identity(kind))
    try:
        run = aurora(
            *("actor", "--join", f"127.0.0.1:{fake.port}", "--id", "a1", "--region", "us"),
            *("--secret-file", str(f["secret"]), "--public-key", str(f["pub"])),
            *("--identity", str(tmp_path / "a1.identity")),
            timeout=60,
        )
    finally:
        fake.close()
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 1 and "is not this job's Ledger" in last, run.stderr[-2000:]
    assert fake.messages == [] and (kind == "no identity step" or fake.sessions == [])


@pytest.mark.parametrize("kind", ["no identity step", "a ledger certificate of another job"])
def test_aurora_status_refuses_a_fake_ledger_and_never_asks_it(tmp_path, kind):
    """``aurora status --join``, an observer, checks the Ledger's certificate like every role."""
    f = files(tmp_path)
    ident = tmp_path / "o.identity"
    write_identity(ident, issue_identity("observer", "o", JOB_KEY, job=JOB_ID))
    fake = FakeLedger(fake_identity(kind))
    try:
        run = aurora(
            *("status", "--join", f"127.0.0.1:{fake.port}", "--identity", str(ident)),
            *("--secret-file", str(f["secret"]), "--public-key", str(f["pub"])),
            timeout=60,
        )
    finally:
        fake.close()
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 1 and "is not this job's Ledger" in last, run.stderr[-2000:]
    assert run.stdout == "" and "Traceback" not in run.stderr
    assert fake.messages == [] and (kind == "no identity step" or fake.sessions == [])


def test_a_peer_checks_the_ledger_before_it_proves_itself_and_the_trainer_its_revocations():
    """At the channel: a server proving an Actor's certificate never sees our identify; the
    Trainer refuses a Ledger whose id it revoked; a connect that proves an identity must be
    given the job key to check the Ledger with."""

    async def main() -> list[str]:
        seen: list[str] = []
        server = await serve(
            "127.0.0.1",
            0,
            secret=SECRET,
            handler=lambda ch: asyncio.sleep(0),
            public_key=JOB_PUB,
            identity=LEDGER,
            admit=lambda role, peer: seen.append(peer),  # type: ignore[func-returns-value]
        )
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(IdentityRefused, match="revoked"):
            await connect(
                "127.0.0.1",
                port,
                secret=SECRET,
                hello={"id": "trainer", "role": "trainer"},
                identity=trainer_identity(JOB_KEY),
                job_key=JOB_PUB,
                job=JOB_ID,
                revoked={"ledger"},
            )
        with pytest.raises(ValueError, match="job_key"):
            await connect(
                "127.0.0.1",
                port,
                secret=SECRET,
                hello={"id": "a1", "role": "actor"},
                identity=actor("a1"),
            )
        ch = await dial(port, actor("a1"))  # the genuine Ledger: accepted both ways
        assert ch.cert is not None and ch.cert.role == "ledger"
        ch.close()
        server.close()
        return seen

    assert asyncio.run(main()) == ["a1"]  # the refused Trainer never identified itself


# ---- the Ledger refuses certificates that ended or are not this job's ------------------------


def test_the_ledger_refuses_expired_early_and_other_jobs_certificates_saying_why(ledger):
    lifetime = 600

    async def main() -> dict[str, str]:
        trainer = await trainer_of(ledger)
        old = time.time() - lifetime - CLOCK_SKEW_S - 60
        cases = {
            "expired": actor("a1", lifetime_s=lifetime, now=old),
            "valid only from": actor("a1", now=time.time() + CLOCK_SKEW_S + 600),
            "another-job": issue_identity("actor", "a1", JOB_KEY, job="another-job"),
        }
        whys = {}
        for word, ident in cases.items():
            with pytest.raises(IdentityRefused) as got:
                await connect(
                    "127.0.0.1",
                    ledger.port,
                    secret=SECRET,
                    hello={"id": "a1", "role": "actor", "region": "us"},
                    identity=ident,
                    job_key=JOB_PUB,
                    job=JOB_ID,  # an attacker checks the Ledger against the job it attacks
                )
            whys[word] = str(got.value)
            assert not isinstance(got.value, Dismissed)  # its certificate, not the job's decision
        # An honest Actor of the other job checks the Ledger against its own, and goes.
        with pytest.raises(IdentityRefused, match="not this job's Ledger"):
            await dial(ledger.port, cases["another-job"], job=None)
        rows = ledger.rows()
        await asyncio.sleep(0.3)
        assert ledger.rows() == rows  # none of them left a row
        ok = await dial(ledger.port, actor("a1"), active=0)  # a good one still joins
        assert await leases_of(ok)
        ok.close()
        trainer.close()
        return whys

    whys = asyncio.run(main())
    for word, why in whys.items():
        assert "refused us" in why and word in why, why


def test_a_revoked_actor_is_cut_off_refused_and_still_refused_after_the_ledger_restarts(
    ledger, tmp_path
):
    listing = tmp_path / "revoked.json"

    async def cut_off() -> tuple[bool, str, str]:
        trainer = await trainer_of(ledger)
        a1 = await dial(ledger.port, actor("a1"), active=0)
        a2 = await dial(ledger.port, actor("a2"), active=0)
        assert await leases_of(a1)
        # Lists that do not hold change nothing: another key's, another job's.
        other = bytes(32 * [7])
        bad = [
            revoke(tmp_path / "x.json", ["a2"], other, job=JOB_ID).encode(),
            revoke(tmp_path / "y.json", ["a2"], JOB_KEY, job="another-job").encode(),
        ]
        for data in bad:
            await trainer.send({"op": "revocations", "data": data})
        rev = revoke(listing, ["a1"], JOB_KEY, job=JOB_ID)
        await trainer.send({"op": "revocations", "data": rev.encode()})
        await trainer.send({"op": "revocations", "data": rev.encode()})  # sent again: no row
        closed = await closed_within(a1, 5.0)
        with pytest.raises(Dismissed) as again:  # the job's decision: a role exits for good
            await dial(ledger.port, actor("a1"), active=0)
        with pytest.raises(Dismissed) as fresh:  # a new certificate for the id as well
            await dial(ledger.port, actor("a1", lifetime_s=60), active=0)
        a2.send_nowait({"op": "heartbeat"})
        assert not a2.closed
        trainer.close()
        a2.close()
        return closed, str(again.value), str(fresh.value)

    closed, again, fresh = asyncio.run(cut_off())
    assert closed
    assert "revoked" in again and "revoked" in fresh
    records = ledger.records()
    revoked = [r for r in records if r.get("type") == "Revoked"]
    assert revoked == [{"type": "Revoked", "ids": ["a1"]}]  # once, a1 only
    assert any(r == {"type": "ActorLost", "actor": "a1"} for r in records)

    ledger.stop()
    ledger.start()  # the same log: the revocation is replayed

    async def after_restart() -> str:
        with pytest.raises(Dismissed) as got:
            await dial(ledger.port, actor("a1"), active=0)
        ok = await dial(ledger.port, actor("a2"), active=0)
        ok.close()
        return str(got.value)

    assert "revoked" in asyncio.run(after_restart())


class CountingProxy:
    """A TCP proxy in front of the Ledger that counts the bytes it sends each connection."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.sent: list[int] = []

    async def start(self) -> int:
        async def pipe(reader, writer, count: list[int] | None) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await reader.read(1 << 16):
                    if count is not None:
                        count[0] += len(data)
                    writer.write(data)
                    await writer.drain()
            with contextlib.suppress(Exception):
                writer.close()

        async def accept(cr, cw) -> None:
            sr, sw = await asyncio.open_connection("127.0.0.1", self.target)
            count = [0]
            await asyncio.gather(pipe(cr, sw, None), pipe(sr, cw, count))
            self.sent.append(count[0])

        self.server = await asyncio.start_server(accept, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]


FLOOD = 1000


def test_reconnect_floods_of_an_excluded_and_a_revoked_actor_cost_no_rows_and_bounded_bytes(
    ledger, tmp_path
):
    """1,000 reconnects each got a ``welcome`` with the whole job spec and a log row, and the
    session stayed open: now each is refused at the identity step, told why in one small
    frame, and closed; the log does not grow, and the Ledger writes one line per 5 s."""

    async def main() -> dict[str, object]:
        trainer = await trainer_of(ledger)
        proxy = CountingProxy(ledger.port)
        port = await proxy.start()
        a1, a2 = actor("a1"), actor("a2")
        ch1 = await dial(port, a1, active=0)
        leases = await leases_of(ch1)
        ch2 = await dial(port, a2, active=0)
        while (await ch2.recv()).get("op") != "welcome":  # an honest join, for comparison
            pass
        ch2.close()
        await asyncio.sleep(0.2)
        welcome_bytes = proxy.sent[-1]
        # a1 fails a check: excluded for good, its session closed.
        await trainer.send(
            {"op": "verified", "actor": "a1", "lease": leases[0], "version": 0, **FAIL}
        )
        assert await closed_within(ch1, 5.0)
        await trainer.send(
            {
                "op": "revocations",
                "data": revoke(tmp_path / "r.json", ["a2"], JOB_KEY, job=JOB_ID).encode(),
            }
        )
        await asyncio.sleep(0.5)
        rows = ledger.rows()
        out_size = ledger.out.stat().st_size
        proxy.sent.clear()
        whys: dict[str, set[str]] = {"a1": set(), "a2": set()}
        t0 = time.monotonic()
        for i in range(FLOOD):
            ident = a1 if i % 2 == 0 else a2
            try:
                ch = await dial(port, ident, active=0)
            except Dismissed as exc:  # excluded or revoked: the job's decision, either way
                whys[ident.id].add(str(exc).split(": ", 2)[-1][:60])
            else:
                ch.close()
                raise AssertionError(f"{ident.id} was let in")
        elapsed = time.monotonic() - t0
        await asyncio.sleep(0.5)
        result = {
            "welcome_bytes": welcome_bytes,
            "flood_bytes": proxy.sent[:],
            "rows_added": ledger.rows() - rows,
            "log_lines": ledger.out.read_bytes()[out_size:].decode().count("\n"),
            "elapsed": elapsed,
            "whys": whys,
        }
        trainer.close()
        proxy.server.close()
        return result

    got = asyncio.run(main())
    flood = got["flood_bytes"]
    print(
        f"{FLOOD} refused reconnects in {got['elapsed']:.1f} s: {max(flood)} bytes from the "
        f"Ledger each at most (a welcomed join: {got['welcome_bytes']}), "
        f"{got['rows_added']} log rows, {got['log_lines']} lines of its output"
    )
    assert len(flood) == FLOOD
    assert got["rows_added"] == 0
    assert max(flood) <= 1024 < got["welcome_bytes"]
    assert got["log_lines"] <= 2 * (2 + got["elapsed"] / 5)  # one line per reason per 5 s
    assert any("excluded" in w for w in got["whys"]["a1"])
    assert any("revoked" in w for w in got["whys"]["a2"])


def test_a_session_ends_with_its_certificate_and_a_renewed_identity_resumes_it_with_its_leases(
    ledger, tmp_path
):

    async def main() -> tuple[list[str], list[str], str]:
        trainer = await trainer_of(ledger)
        # A certificate whose last second (clock skew allowed) is 3 s from now.
        short = actor("a1", lifetime_s=60, now=time.time() - 60 - CLOCK_SKEW_S + 3)
        ch = await dial(ledger.port, short, active=0)
        leases = await leases_of(ch)
        assert await closed_within(ch, 10.0)  # the Ledger ends the session at its expiry
        with pytest.raises(IdentityRefused) as old:
            await dial(ledger.port, short, active=0)
        assert not isinstance(old.value, Dismissed)  # renewing it lets it back
        renewed = renew_identity(short, JOB_KEY, lifetime_s=3600)
        assert renewed.public_key == short.public_key
        back = await dial(ledger.port, renewed, active=0)
        again = await leases_of(back)  # a returning Actor is re-sent its live leases
        back.close()
        trainer.close()
        return leases, again, str(old.value)

    leases, again, why = asyncio.run(main())
    assert "expired" in why
    assert again == leases
    assert not any(r == {"type": "ActorLost", "actor": "a1"} for r in ledger.records())


# ---- the Trainer's own enforcement; the launcher's renewal; the commands ---------------------


def test_the_trainer_never_trains_on_a_revoked_actors_results_whatever_the_ledger_says(tmp_path):
    import msgpack

    from aurora.runtime.compute import make_trainer
    from aurora.runtime.trainer import TrainerProcess, TrainerRun

    f = files(tmp_path)
    spec = JobSpec.decode(json.loads(f["job"].read_text())["spec"]).with_settings(verify=False)
    (tmp_path / "run").mkdir()
    revoke(tmp_path / "run" / "revoked.json", ["a1"], JOB_KEY, job=JOB_ID)  # the default place
    run = TrainerRun(
        spec=spec,
        run_dir=str(tmp_path / "run"),
        secret=SECRET,
        signing_key=JOB_KEY,
        public_key=JOB_PUB,
    )
    trainer = TrainerProcess(run)
    trainer.revocations.poll(strict=True)
    trainer.compute = make_trainer(spec, workdir=str(tmp_path / "run"))

    def result(pid: str, i: int) -> dict:
        comp = {"ids": [1, 2], "lp": [-0.5, -0.5]}
        body = {"prompt": f"b1-{i}", "index": i, "completions": [comp, comp]}
        return {
            "actor": pid,
            "lease": f"L{i}",
            "prompt": f"b1-{i}",
            "version": 0,
            "payload": msgpack.packb(body),
            "check": 0.0,
        }

    class Line:
        closed = False

        async def send(self, msg: dict) -> None:
            pass

    async def main() -> list:
        trainer.channel = Line()  # type: ignore[assignment]
        trainer.done_batches = {1}
        batch = [result("a1", 0), result("a2", 1)]
        await trainer._inbox.put({"op": "batch", "batch": 1, "complete": True, "results": batch})
        return await trainer._fetch_batch(1)

    out = asyncio.run(main())
    assert [index for index, _, _ in out] == [1]  # a2's only: the Ledger said train a1's
    assert trainer._batch_refused == 1


def test_the_launcher_renews_the_identities_it_issued_at_half_their_lifetime(tmp_path):
    from aurora.keys import load_identity
    from aurora.runtime.launcher import Launcher, RealRun
    from aurora.topology import topology_from_dict

    topo = topology_from_dict(
        {
            "name": "t",
            "trainer": {"region": "us", "model": "qwen3-8b", "gpus": 1},
            "regions": [{"name": "us"}],
            "actors": [{"region": "us", "gpu": "A100", "count": 1}],
        }
    )
    run = RealRun(
        topology=topo,
        topology_path="t.yaml",
        strategy="aurora",
        steps=2,
        seed=0,
        out=str(tmp_path / "out"),
        backend="standin",
        identity_lifetime_s=1000,
    )
    launcher = Launcher(run)
    launcher.prepare()
    args = launcher._identity("actor", "a")
    path = Path(args[1])
    first = load_identity(path)
    assert first.job == launcher.job.job_id and first.expires - first.cert.issued == 1000
    # aurora status RUN's observer identity, issued when the run is prepared (before the
    # Actor's): renewed like every other, or a long run's status would be refused.
    status = launcher.dir / "keys" / "observer-status.identity"
    watcher = load_identity(status)
    assert watcher.role == "observer" and watcher.job == launcher.job.job_id
    assert watcher.expires - watcher.cert.issued == 1000
    assert watcher.cert.issued <= first.cert.issued
    assert launcher.renew_identities(now=first.cert.issued + 400) == []  # more than half left
    assert launcher.renew_identities(now=first.cert.issued + 600) == [str(path), str(status)]
    second = load_identity(path)
    assert second.private_key == first.private_key and second.expires == first.cert.issued + 1600
    assert load_identity(status).private_key == watcher.private_key
    assert load_identity(status).expires == first.cert.issued + 1600
    ledger_args = launcher._identity("ledger", "ledger")
    assert load_identity(ledger_args[1]).role == "ledger"


def test_keys_issue_names_the_job_and_expiry_and_keys_revoke_keeps_a_signed_union(tmp_path):
    f = files(tmp_path)
    out = tmp_path / "a.identity"
    run = aurora(
        *("keys", "issue", "--role", "actor", "--id", "a", "--job", str(f["job"])),
        *("--valid-for", "12h", "--signing-key", str(f["key"]), "--out", str(out)),
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert JOB_ID in run.stdout and "valid until" in run.stdout
    from aurora.keys import load_identity

    ident = load_identity(out)
    assert ident.job == JOB_ID and ident.expires - ident.cert.issued == 12 * 3600
    bad = aurora(
        *("keys", "issue", "--role", "actor", "--id", "b", "--job-id", JOB_ID),
        *("--valid-for", "soon", "--signing-key", str(f["key"]), "--out", str(tmp_path / "b")),
        timeout=60,
    )
    assert bad.returncode != 0 and "duration" in bad.stderr and "Traceback" not in bad.stderr
    listing = tmp_path / "revoked.json"
    no_job = aurora("keys", "revoke", "a", "--list", str(listing), "--signing-key", str(f["key"]))
    assert no_job.returncode != 0 and "--job" in no_job.stderr
    for ids in (["a"], ["b", "c"]):
        run = aurora(
            *("keys", "revoke", *ids, "--list", str(listing), "--job-id", JOB_ID),
            *("--signing-key", str(f["key"])),
        )
        assert run.returncode == 0, run.stderr
    rev = Revocations.decode(listing.read_bytes(), JOB_PUB, job=JOB_ID)
    assert rev.ids == ("a", "b", "c")
    forged = json.loads(listing.read_text())
    forged["ids"] = ["a"]  # an edited list no longer verifies
    with pytest.raises(ValueError, match="not signed"):
        Revocations.decode(json.dumps(forged).encode(), JOB_PUB, job=JOB_ID)
    other = public_key_of(bytes(32 * [7]))
    with pytest.raises(ValueError, match="not signed"):
        Revocations.decode(listing.read_bytes(), other, job=JOB_ID)


def test_aurora_keys_revoke_during_a_run_cuts_the_actor_off_and_the_run_finishes(tmp_path):
    """The operator's path end to end: ``aurora keys revoke`` writes the list while ``aurora
    real`` runs; the Trainer reads it and sends it on; the Ledger logs it, cuts the Actor off
    and refuses its reconnect; nothing of it is admitted after, the run finishes on the other."""
    from tests.test_runtime import TOPOLOGY

    topo = tmp_path / "t.yaml"
    topo.write_text(TOPOLOGY.format(name="t", actors=2, steps=10))
    run_dir = tmp_path / "out" / "t-aurora-s0"
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "aurora.cli", "real", "--topology", str(topo)),
            *("--backend", "standin", "--out", str(tmp_path / "out"), "--quiet"),
            *("--extra", json.dumps({"standin_tokens_per_s": 400.0})),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        db = run_dir / "ledger.db"
        deadline = time.monotonic() + 180
        published = 0
        while published < 2:  # two steps done: both Actors at work
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.3)
            with contextlib.suppress(sqlite3.Error):
                con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
                published = con.execute(
                    "SELECT COUNT(*) FROM events WHERE json_extract(body, '$.type') = 'Published'"
                ).fetchone()[0]
                con.close()
        victim = json.loads((run_dir / "job.json").read_text())["actors"][1]["id"]
        revoked = aurora(
            *("keys", "revoke", victim, "--list", str(run_dir / "revoked.json")),
            *("--job", str(run_dir / "job.json")),
            *("--signing-key", str(run_dir / "keys" / "trainer.key")),
        )
        assert revoked.returncode == 0, revoked.stderr
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    rows = [json.loads(b) for (b,) in con.execute("SELECT body FROM events ORDER BY seq")]
    actions = [
        (seq, json.loads(b)) for seq, b in con.execute("SELECT event_seq, body FROM actions")
    ]
    seqs = [s for (s,) in con.execute("SELECT seq FROM events ORDER BY seq")]
    con.close()
    at = next(i for i, r in enumerate(rows) if r.get("type") == "Revoked")
    assert rows[at]["ids"] == [victim]
    assert any(a.get("type") == "Accepted" and a.get("actor") == victim for _, a in actions)
    accepted_after = [
        a
        for seq, a in actions
        if seq > seqs[at] and a.get("type") == "Accepted" and a.get("actor") == victim
    ]
    assert accepted_after == []
    assert any(r.get("type") == "ActorLost" and r.get("actor") == victim for r in rows[at:])
    log = (run_dir / "logs" / f"{victim}.log").read_text()
    assert "revoked" in log
    # Refused at its reconnect, it exits as dismissed: the launcher notes it and goes on.
    assert f"{victim} dismissed by the job" in err and "exited (" not in err
    dismissed = json.loads((run_dir / "summary.json").read_text())["dismissed"]
    assert list(dismissed) == [victim] and "is revoked in this job" in dismissed[victim]
    steps = [json.loads(x) for x in (run_dir / "trainer" / "steps.jsonl").read_text().splitlines()]
    assert steps[-1]["version"] == 10
    assert victim in steps[0]["stats"]["trained_from"]  # it was trained on before
    assert victim not in steps[-1]["stats"]["trained_from"]  # and is not at the end


def test_a_role_reads_its_renewed_identity_file_at_its_next_connection_and_keeps_a_good_one(
    tmp_path,
):
    from aurora.keys import IdentityFile, replace_identity

    path = tmp_path / "a1.identity"
    first = actor("a1", lifetime_s=60)
    write_identity(path, first)
    source = IdentityFile(path)
    assert source() == first
    renewed = renew_identity(first, JOB_KEY, lifetime_s=7 * 86400)
    replace_identity(path, renewed)
    assert source() == renewed  # picked up without a restart
    replace_identity(path, actor("a2"))  # another id's file put in its place: not taken
    assert source() == renewed
    path.write_text("not an identity")  # a half-written or broken file: not taken either
    assert source() == renewed


def test_a_self_issued_identity_is_certified_again_once_half_its_lifetime_is_left():
    from aurora.keys import SelfIssued

    now = [1e9]
    source = SelfIssued(
        "ledger", "ledger", JOB_KEY, job=JOB_ID, lifetime_s=1000, clock=lambda: now[0]
    )
    first = source()
    now[0] += 400
    assert source() is first
    now[0] += 200  # 400 s left of 1,000
    second = source()
    assert second.cert.issued == now[0] and second.expires == now[0] + 1000
    assert second.private_key == first.private_key and second.job == JOB_ID
