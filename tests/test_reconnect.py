"""Connections that drop and come back lose nothing, on real processes.

A TCP proxy between one Actor and the Ledger resets the Actor's connection at seeded random
moments while the run goes on (``aurora real``, stand-in compute: real processes, Ledger, leases,
data plane, signed deltas; random tokens instead of a model, slow enough that the Actor spends
most of its time generating). Each reset is one of two kinds, drawn from the seed:

* ``actor``: the Actor's side is reset and the Ledger's side lingers (a middlebox reset, or a
  path that died without telling the Ledger) until the Actor is back: the Ledger sees the same
  Actor connect again while it still counts it live, and re-sends its live leases as ``assign``,
  some of them the ones it is generating right then;
* ``both``: both sides are reset; the Ledger loses the Actor, its leases go back to the pool,
  and it rejoins.

The Actor must stay up (it used to queue the re-sent lease it was generating and die of a
``KeyError`` after finishing it), and the run must lose nothing and admit nothing twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import json
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

from aurora.runtime.launcher import Launcher, RealRun
from aurora.topology import topology_from_dict

STEPS = 10
RATE = 60.0
"""Tokens/s of each stand-in Actor: 6 leases of 4 x 5 tokens take 2 s, so a reset at a random
moment mostly finds the Actor generating."""
PROXIED = "us-a100-0"

TOPOLOGY = {
    "name": "blink",
    "trainer": {"region": "us", "model": "qwen3-8b", "gpu": "H100", "gpus": 1, "egress_gbps": 10},
    "regions": [{"name": "us"}],
    "links": [],
    "actors": [{"region": "us", "gpu": "A100", "count": 2}],
    "real": {"steps": STEPS, "prompts_per_step": 12, "group_size": 4},
}


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close ``writer``'s connection with a TCP reset (SO_LINGER 0), not a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class BlinkingProxy:
    """Forwards one Actor's control connection to the Ledger and resets it ``resets`` times,
    the first ``first_s`` after the Actor first connects, then every ``gap_s`` (a uniform draw)
    (module docstring). Runs its own event loop in a thread."""

    def __init__(
        self,
        target: Callable[[], tuple[str, int]],
        *,
        seed: int,
        resets: int,
        first_s: float,
        gap_s: tuple[float, float],
    ) -> None:
        self.target, self.rng = target, random.Random(seed)
        self.resets, self.first_s, self.gap_s = resets, first_s, gap_s
        self.done: list[tuple[float, str]] = []
        """(wall time, kind) of every reset made."""
        self.connections = 0
        self.port = 0
        self._pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter] | None = None
        self._lingering: list[asyncio.StreamWriter] = []
        self._connected = threading.Event()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self) -> BlinkingProxy:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        blinker = asyncio.create_task(self._blink())
        await self._stop.wait()
        blinker.cancel()
        server.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target())
        except OSError:
            _reset(writer)
            return
        self.connections += 1
        self._pair = (writer, up_writer)
        self._connected.set()
        # The previous connection's Ledger side, left open by an ``actor`` reset, closes once
        # the Actor is back (the Ledger has its new hello by then).
        lingering, self._lingering = self._lingering, []
        if lingering:
            asyncio.get_running_loop().call_later(1.0, lambda: [_reset(w) for w in lingering])
        await asyncio.gather(
            self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
        )

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                if writer.is_closing():
                    return
                writer.write(data)
                await writer.drain()
        if not writer.is_closing() and writer not in self._lingering:
            writer.close()

    async def _blink(self) -> None:
        await asyncio.to_thread(self._connected.wait)
        await asyncio.sleep(self.first_s)
        for i in range(self.resets):
            if i:
                await asyncio.sleep(self.rng.uniform(*self.gap_s))
            kind = self.rng.choice(("actor", "both"))
            if self._pair is None:
                continue
            actor_side, ledger_side = self._pair
            self._pair = None
            self.done.append((time.time(), kind))
            _reset(actor_side)
            if kind == "both":
                _reset(ledger_side)
            else:
                self._lingering.append(ledger_side)


class ProxiedLauncher(Launcher):
    """``aurora real`` with :data:`PROXIED`'s Ledger address pointing at a proxy."""

    proxy_port = 0

    def _actor_args(self, aid: str, region: str, engine: str | None) -> list[str]:
        args = super()._actor_args(aid, region, engine)
        if aid == PROXIED:
            args[args.index("--join") + 1] = f"127.0.0.1:{self.proxy_port}"
        return args


def _spans(run_dir: Path, actor: str) -> list[tuple[float, float]]:
    """(start, end) wall times of ``actor``'s generations, as it reported them."""
    rows = [
        json.loads(line)
        for line in (run_dir / "ledger.spans.jsonl").read_text().splitlines()
        if line
    ]
    return [
        (float(r["start"]), float(r["end"]))
        for r in rows
        if r.get("who") == actor and r.get("activity") == "generate"
    ]


def test_an_actor_whose_ledger_connection_is_reset_mid_generation_stays_up_and_loses_nothing(
    tmp_path,
):
    launcher = ProxiedLauncher(
        RealRun(
            topology=topology_from_dict(TOPOLOGY, source="blink"),
            topology_path="blink",
            out=str(tmp_path / "out"),
            faults=(),
            backend="standin",
            extra={"standin_tokens_per_s": RATE},
            hooks={},
            progress=False,
            stall_s=90.0,
        )
    )
    with BlinkingProxy(
        lambda: ("127.0.0.1", launcher.ports["ledger"]),
        seed=39,
        resets=6,
        first_s=6.0,
        gap_s=(1.0, 3.0),
    ) as proxy:
        launcher.proxy_port = proxy.port
        assert launcher.main() == 0
    run_dir = launcher.dir
    # The Actor stayed up: it exited as the run ended, with no error, and recognised the
    # leases the Ledger re-sent while it held them.
    actor = launcher.procs.procs[PROXIED]
    log = actor.log_path.read_text()
    assert "Traceback" not in log, log[log.index("Traceback") :][:2000]
    assert actor.starts == 1 and actor.returncode == 0, actor.last_error()
    assert "re-sent leases already held" in log
    assert len(proxy.done) == 6 and {k for _, k in proxy.done} == {"actor", "both"}
    assert proxy.connections == 7  # it came back after every reset

    # Resets struck while it generated (the generate spans it reported, wall time).
    spans = _spans(run_dir, PROXIED)
    mid = [t for t, _ in proxy.done if any(a <= t <= b for a, b in spans)]
    assert len(mid) >= 2, (proxy.done, spans)

    # Nothing lost, nothing admitted twice, nothing wrong admitted.
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["steps_completed"] == STEPS
    assert s["prompts_lost"] == 0 and s["prompts_settled_twice"] == 0
    assert s["prompts_settled"] == s["prompts_requested"] == STEPS * 12
    assert s["lease_book_ok"], s["lease_book_error"]
    assert s["replay_action_mismatches"] == 0 and s["wrong_admits"] == 0
    assert s["actor_hash_mismatches"] == 0 and s["actor_digest_mismatches"] == 0
    with open(run_dir / "events.csv") as f:
        accepted = [json.loads(r["record"]) for r in csv.DictReader(f) if r["type"] == "Accepted"]
    prompts = [rec["prompt"] for rec in accepted]
    assert len(prompts) == len(set(prompts)) == STEPS * 12
    assert sum(rec["actor"] == PROXIED for rec in accepted) >= STEPS
    # And it kept generating after the last reset.
    assert any(start > proxy.done[-1][0] for start, _ in spans)


def test_a_re_sent_lease_the_actor_is_generating_or_holds_is_not_taken_again():
    """The Ledger re-sends every live lease to an Actor that reconnects; the Actor takes each
    lease once, whether it is queued, being generated or already generated."""
    from aurora.runtime.actor import ActorProcess, ActorRun

    actor = ActorProcess(
        ActorRun(
            id="a", region="us", ledger=("127.0.0.1", 1), secret=b"s" * 32, public_key=b"k" * 32
        )
    )
    actor._on_message(
        {"op": "assign", "version": 2, "leases": [["L1", "p1"], ["L2", "p2"]], "expiry_in": 30.0}
    )
    generating = actor.queue.popleft()  # the worker took it
    assert generating.leases == ("L1", "L2") and generating.expiry is not None
    # The reconnect: both leases again, one at a time, and a new one.
    for lease, prompt in (("L1", "p1"), ("L2", "p2"), ("L3", "p3")):
        msg = {"op": "assign", "version": 2, "leases": [[lease, prompt]], "expiry_in": 29.0}
        actor._on_message(msg)
    assert [w.leases for w in actor.queue] == [("L3",)]
    assert actor.prompt_of == {"L1": "p1", "L2": "p2", "L3": "p3"}


def test_an_actor_skips_work_whose_lease_expired_while_it_was_busy(tmp_path):
    """Queued behind a long generation, work whose lease has expired meanwhile is dropped
    without a generation; live work behind it still runs."""
    from aurora.runtime.actor import ActorProcess, ActorRun
    from aurora.runtime.compute import Generated, Sampling
    from tests.test_ledger_service import job_spec

    class Engine:
        version, weights_hash = 2, "h2"
        asked: list[list[str]] = []

        def generate(self, prompts, sampling):
            self.asked.append([p for p, _ in prompts])
            return [Generated(prompt=p, payload=b"x", tokens=1) for p, _ in prompts]

    actor = ActorProcess(
        ActorRun(
            id="a", region="us", ledger=("127.0.0.1", 1), secret=b"s" * 32, public_key=b"k" * 32
        )
    )
    actor.job = job_spec(tmp_path)
    actor.engine = Engine()  # type: ignore[assignment]
    actor.sampling = Sampling(n=1, max_new_tokens=1, temperature=1.0, seed=0)
    sent: list[dict] = []
    actor.send = sent.append  # type: ignore[method-assign]
    actor._on_message({"op": "assign", "version": 2, "leases": [["L1", "b1-0"]], "expiry_in": 0.0})
    actor._on_message({"op": "assign", "version": 2, "leases": [["L2", "b1-1"]], "expiry_in": 60.0})

    async def work() -> None:
        task = asyncio.create_task(actor._worker())
        while actor.queue:
            await asyncio.sleep(0.01)
        actor.stopping = True
        actor.wake.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(work())
    assert Engine.asked == [["b1-1"]]
    assert [m["lease"] for m in sent if m["op"] == "result"] == ["L2"]
    assert actor.prompt_of == {}
