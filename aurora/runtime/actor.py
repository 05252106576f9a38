"""The Actor process: generate on v, stage v+1 meanwhile, switch at a safe point.

Theory of operation
-------------------
An Actor holds an inference engine (:mod:`aurora.runtime.compute`), a data-plane node that
receives deltas while the engine generates (:class:`aurora.transport.Node`) and one control
connection to the Ledger (:mod:`aurora.runtime.channel`). A *pump* reads the Ledger's messages
into the Actor's state; a *worker* runs, at every safe point, the decision of
:func:`aurora.policy.actor.next_action` (the function the simulator calls) and carries it out,
so the Actor decides nothing of its own. After every switch of version it reports h(v) and a
content digest of its weights, which the Ledger compares with what the Trainer published: a torn
or wrong apply is counted, never silent. Before it takes any work it checks that its engine's
model files are the ones the Trainer signed (:mod:`aurora.store.manifest`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aurora.delta import Delta
from aurora.jobspec import JobSpec
from aurora.keys import Identity
from aurora.observe.exporter import serve as observe_serve
from aurora.observe.node import ActorCollector, NodeCollector
from aurora.policy.actor import (
    Activate,
    ApplyPlan,
    Drop,
    Generate,
    Wait,
    Work,
    after_catch_up,
    assigned,
    next_action,
    takes_catch_up,
    to_fetch,
)
from aurora.policy.membership import fetch_order
from aurora.policy.staging import ActorVersions
from aurora.policy.versions import CatchUpPlan
from aurora.runtime import hooks, hopreport
from aurora.runtime.channel import Channel, Dismissed, IdentityRefused, connect
from aurora.runtime.compute import EngineSide, Sampling, make_engine
from aurora.runtime.job import digest_due, transport_config
from aurora.runtime.messages import Direction, task_index
from aurora.store import CheckpointStore
from aurora.store.manifest import check as check_model
from aurora.transport import Node

log = logging.getLogger("aurora.runtime.actor")


@dataclass(frozen=True, kw_only=True)
class ActorRun:
    """Where and how one Actor process runs."""

    id: str
    """Actor id (unique in the job; a returning Actor reuses its id)."""
    region: str
    """Region it runs in (decides its relay)."""
    ledger: tuple[str, int]
    """The Ledger's control address."""
    secret: bytes
    """The job secret."""
    public_key: bytes
    """The job's public key: every announcement, delta and snapshot is checked against it."""
    identity: Identity | Callable[[], Identity] | None = None
    """Its identity (``aurora keys issue --role actor``): the Ledger accepts its id only with
    it, and it accepts only a Ledger the job key certified for the job its certificate names.
    A callable (:class:`aurora.keys.IdentityFile`) is asked at every connection, so a renewed
    file is used without a restart. None only against a control server that checks nothing."""
    host: str = "127.0.0.1"
    """Address its data-plane node listens on (other Actors fetch from it when it relays)."""
    engine: str | None = None
    """Engine override (None: the job's engine)."""
    engine_url: str | None = None
    """A running ``vllm serve`` to drive as the engine (:mod:`aurora.engines.vllm_server`)."""
    advertise: str | None = None
    """Address peers reach its data-plane node at (None: ``host``)."""
    notice_s: float = 30.0
    """Preemption notice on SIGTERM: time to drain before leaving (s)."""
    connect_timeout_s: float = 30.0
    """How long to keep trying to reach the Ledger at start (s)."""
    metrics_port: int | None = None
    """Serve ``/metrics`` (its engine's and node's counters) on this port; None: off."""
    metrics_host: str = "127.0.0.1"
    """Address ``/metrics`` listens on (this host only by default)."""


def activate(node: Node, version: int) -> None:
    """The Actor's weights now run staged ``D_version`` (applied by the caller): checked by the
    rule of :mod:`aurora.policy.staging` (only a staged delta, only onto its base ``v-1``), then
    the node is told (:meth:`~aurora.transport.Node.set_active`: later deltas are checked against
    it, it and everything older are released and its arena goes back to the pool). Raises
    ValueError (IllegalTransition) with nothing changed when the rule refuses."""
    if version not in node.staged:
        staged = sorted(node.staged)
        raise ValueError(f"node {node.id}: v{version} is not staged (staged: {staged})")
    rule = ActorVersions(node.active[0] if node.active is not None else None)
    rule.stage(version)
    rule.activate(version)
    node.set_active(version, node.staged[version].weights_hash)


def caught_up(node: Node, version: int, weights_hash: str) -> None:
    """The Actor's weights jumped to ``version`` (a verified snapshot and/or chain applied by the
    caller, or it had no weights yet): the node checks later deltas against it, releases
    everything up to it and stages complete versions above it that build on it. Raises
    ValueError, with nothing changed, backwards."""
    if node.active is not None and version < node.active[0]:
        raise ValueError(
            f"node {node.id}: cannot catch up backwards from v{node.active[0]} to v{version}"
        )
    node.set_active(version, weights_hash)


RECENT_GENERATIONS = 8
"""Generations an Actor remembers to judge whether work would finish before its expiry
(:func:`aurora.policy.actor.least_seconds` takes the shortest comparable one)."""
HELD_AFTER_EXPIRY_S = 5.0
"""How long an Actor keeps recognising a lease after its expiry (s): the Ledger re-sends only
live leases, and this covers the assignment's time on the wire."""

KEY_CHECKS = 3
"""Announcements from the Ledger that must fail verification, with none verified, before an
Actor concludes it was given the wrong job key (:meth:`ActorProcess._check_job_key`)."""


class ActorProcess:
    """One Actor (see the module docstring).

    If the Ledger connection drops, the Actor reconnects under the same id and re-sends the
    results the Ledger may not have received; a lease the Ledger re-sends meanwhile is taken
    once (:func:`aurora.policy.actor.assigned`), whether it is queued, being generated or done.
    Before it takes any work the Actor checks that the model files its engine was built from are
    the ones the Trainer signed with its snapshots (:mod:`aurora.store.manifest`), and stops
    with one line naming the file otherwise."""

    def __init__(self, run: ActorRun) -> None:
        self.run = run
        self.id = run.id
        self.job: JobSpec | None = None
        self.sources: dict[str, str] = {}
        self.route: str | None = None
        self.engine: EngineSide | None = None
        self.node: Node | None = None
        self.store: CheckpointStore | None = None
        self.channel: Channel | None = None
        self.queue: collections.deque[Work] = collections.deque()
        self.prompt_of: dict[str, str] = {}
        """Lease -> prompt of every lease queued or being generated."""
        self.held: dict[str, float] = {}
        """Lease -> its expiry (s, ``time.monotonic``) of every lease taken: queued, being
        generated or generated, until it has expired (the Ledger re-sends only live leases), so
        that a lease re-sent after a reconnect is recognised (:func:`aurora.policy.actor.
        assigned`)."""
        self.recent: collections.deque[tuple[int, float]] = collections.deque(
            maxlen=RECENT_GENERATIONS
        )
        """``(leases, seconds)`` of its last generations: what work takes at least."""
        self.plan: CatchUpPlan | None = None
        self.pending_commit: int | None = None
        self.snapshots: dict[int, tuple[dict, str]] = {}
        """Verified snapshots held for a catch-up: version -> (weights, chain hash h(v))."""
        self.snapshot_hashes: dict[int, tuple[str, str | None]] = {}
        """version -> (chain hash h(v), content digest) of snapshots the Ledger planned."""
        self.fetched: dict[int, Delta] = {}
        self.in_flight: set[int] = set()
        self.unsent: list[dict[str, Any]] = []
        """Results not yet known to have reached the Ledger (re-sent after a reconnect)."""
        self.wake = asyncio.Event()
        self.stopping = False
        self.draining_until: float | None = None
        self.sampling: Sampling | None = None
        self.stats = {"generated": 0, "activations": 0, "catch_ups": 0, "generate_s": 0.0}
        self.announcements: list[bytes] = []
        """Signed announcements heard from the Ledger (the newest 32), handed to the node."""
        self._subscribed = False
        self.failed: str | None = None
        self.dismissed: Dismissed | None = None
        """Set when the Ledger refused a reconnect because the job excluded or revoked this
        Actor: the process exits as dismissed (:class:`Dismissed`), not as failed."""
        self.leaving = False
        self.key_ok = False
        """An announcement from the Ledger has verified under this Actor's public key."""
        self.key_failures = 0

    # -- state ---------------------------------------------------------------------------------

    @property
    def active(self) -> int | None:
        return None if self.engine is None else self.engine.version

    async def _digest(self, version: int | None) -> str | None:
        """Content digest of the engine's weights when the job asks for one at ``version``
        (:func:`aurora.runtime.job.digest_due`); None otherwise (h(v) is still reported)."""
        assert self.engine is not None
        if version is None or self.job is None or not digest_due(self.job, version):
            return None
        return await asyncio.to_thread(self.engine.digest)

    def _staged(self) -> dict[int, Delta]:
        staged = dict(self.fetched)
        if self.node is not None:
            staged.update(self.node.staged)
        return staged

    # -- control connection ---------------------------------------------------------------------

    async def _connect(self) -> Channel:
        deadline = time.monotonic() + self.run.connect_timeout_s
        while True:
            # Said afresh on every attempt: the data plane keeps staging while the Ledger is
            # away, and a "staged" sent meanwhile went to the dead connection.
            hello: dict[str, Any] = {
                "id": self.id,
                "role": "actor",
                "region": self.run.region,
                "active": self.active,
                "staged": sorted(self.node.staged) if self.node is not None else [],
            }
            ident = self.run.identity
            try:
                channel = await connect(
                    self.run.ledger[0],
                    self.run.ledger[1],
                    secret=self.run.secret,
                    hello=hello,
                    identity=ident() if callable(ident) else ident,
                    job_key=self.run.public_key,
                )
            except ConnectionError as exc:
                if (
                    time.monotonic() > deadline
                    or isinstance(exc, IdentityRefused)
                    or "refused us" in str(exc)
                ):
                    raise
                await asyncio.sleep(0.5)
                continue
            # Staged during the handshake itself: said now, on the new connection (the Ledger
            # ignores a version it already knows is staged). Without this a restarted Ledger
            # never heard of it, and the next batch waited the whole staging grace (10 s)
            # before leaving every such Actor out.
            if self.node is not None:
                for v in sorted(set(self.node.staged) - set(hello["staged"])):
                    channel.send_nowait({"op": "staged", "version": v})
            return channel

    def send(self, msg: dict[str, Any]) -> None:
        if self.channel is not None:
            self.channel.send_nowait(msg)

    async def _pump(self) -> None:
        """Read the Ledger's messages; reconnect when the connection drops.

        The pump reads the Ledger's messages into the Actor's state: leases (``assign``), the
        version to switch to (``commit``), a catch-up plan (``catch_up``: the pieces are fetched
        from the Checkpoint Store at once, while the Actor keeps serving what it can), routes."""
        while not self.stopping:
            assert self.channel is not None
            try:
                msg = await self.channel.recv_checked(Direction.LEDGER_TO_PEER)
            except ConnectionError:
                if self.stopping:
                    return
                log.warning("%s: lost the Ledger; reconnecting", self.id)
                try:
                    self.channel = await self._connect()
                except ConnectionError as exc:
                    log.error("%s: %s; giving up", self.id, exc)
                    self.failed = str(exc)
                    if isinstance(exc, Dismissed):
                        self.dismissed = exc
                    self.stopping = True
                    self.wake.set()
                    return
                for m in self.unsent:
                    self.send(m)
                continue
            self._on_message(msg)
            self.wake.set()

    def _on_message(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "welcome":
            self.sources.update({k: v for k, v in (msg.get("sources") or {}).items() if v})
            if msg.get("job") is not None and self.job is None:
                self.job = JobSpec.decode(msg["job"])
        elif op == "announce":
            data = bytes(msg["data"])
            self._check_job_key(data)
            self.announcements.append(data)
            del self.announcements[:-32]
            if self.node is not None:
                self._announce(data)
        elif op == "assign":
            now = time.monotonic()
            for lease, expiry in list(self.held.items()):
                if expiry + HELD_AFTER_EXPIRY_S < now:
                    del self.held[lease]
            expiry = now + float(msg["expiry_in"])
            leases = [str(lease) for lease, _ in msg["leases"]]
            work = assigned(int(msg["version"]), leases, expiry, held=self.held)
            if work is None:
                log.info("%s: %d re-sent leases already held", self.id, len(leases))
                return
            prompts = dict((str(lease), str(prompt)) for lease, prompt in msg["leases"])
            for lease in work.leases:
                self.prompt_of[lease] = prompts[lease]
                self.held[lease] = expiry
            self.queue.append(work)
        elif op == "commit":
            self.pending_commit = int(msg["version"])
        elif op == "catch_up":
            plan = CatchUpPlan(
                target=int(msg["target"]),
                snapshot=msg.get("snapshot"),
                deltas=tuple(int(v) for v in msg["deltas"]),
                bytes=0,
            )
            if not takes_catch_up(plan, active=self.active):
                log.warning(
                    "%s: ignored a catch-up to v%d: it is on v%s already (never backwards)",
                    self.id,
                    plan.target,
                    self.active,
                )
                # Say where it is, so a Ledger that lost track stops waiting for the plan.
                assert self.engine is not None
                self.send(
                    {
                        "op": "caught_up",
                        "version": self.engine.version,
                        "weights_hash": self.engine.weights_hash,
                        "digest": None,
                        "pause_ms": 0.0,
                    }
                )
                return
            self.plan = plan
            if msg.get("snapshot") is not None:
                self.snapshot_hashes[int(msg["snapshot"])] = (
                    str(msg["snapshot_hash"]),
                    msg.get("snapshot_digest"),
                )
            asyncio.get_running_loop().create_task(self._fetch_plan(self.plan))
        elif op == "route":
            self.route = str(msg["source"])
            if msg.get("addr"):
                self.sources[self.route] = str(msg["addr"])
            self._set_sources()
        elif op == "stop":
            self.stopping = True
        elif op == "exclude":
            log.info("%s: excluded from step v%s", self.id, msg.get("version"))

    def _check_job_key(self, data: bytes) -> None:
        """Stop with one line when this Actor was given another job's public key.

        The Ledger forwards the Trainer's announcements over the authenticated control channel.
        If none of the first ``KEY_CHECKS`` of them verifies under our key, and none ever did,
        the key is wrong (or the Ledger is not this job's): every delta and snapshot would be
        refused forever. Once one has verified, a bad one is only refused (never fatal)."""
        if self.key_ok or self.job is None or self.failed is not None:
            return
        from aurora.delta.announce import AnnouncementError, verify

        try:
            verify(data, self.run.public_key, job=self.job.job_id)
        except AnnouncementError as exc:
            self.key_failures += 1
            if self.key_failures >= KEY_CHECKS:
                self.failed = (
                    f"the job's announcements are not signed by the Trainer key this Actor "
                    f"was given (wrong --public-key for job {self.job.job_id}?): {exc}"
                )
                self.stopping = True
                self.wake.set()
        else:
            self.key_ok = True

    def _announce(self, data: bytes) -> None:
        assert self.node is not None
        try:
            self.node.announce(data)
        except Exception as exc:  # a bad announcement from anyone is refused, never fatal
            log.warning("%s: refused an announcement: %s", self.id, exc)

    def _set_sources(self) -> None:
        if self.node is None:
            return
        addrs = [self.sources[s] for s in fetch_order(self.route) if s in self.sources]
        parsed = []
        for a in dict.fromkeys(addrs):
            host, port = a.rsplit(":", 1)
            parsed.append((host, int(port)))
        self.node.set_sources(parsed)
        # Subscribe once the Ledger has routed this Actor (it does on every join): before that
        # only the Trainer is known, and a subscription to it would race the route to a relay.
        if parsed and self.route is not None and not self._subscribed:
            self._subscribed = True
            asyncio.get_running_loop().create_task(self._subscribe())

    async def _subscribe(self) -> None:
        assert self.node is not None
        try:
            await self.node.subscribe()
        except ConnectionError as exc:  # it keeps trying in the background
            log.warning("%s: %s", self.id, exc)

    # -- catch-up ------------------------------------------------------------------------------

    async def _fetch_plan(self, plan: CatchUpPlan) -> None:
        assert self.store is not None
        snapshot, deltas = to_fetch(
            plan,
            staged=set(self._staged()),
            snapshots=set(self.snapshots),
            in_flight=self.in_flight,
        )
        wanted = ([snapshot] if snapshot is not None else []) + list(deltas)
        self.in_flight.update(wanted)
        try:
            if snapshot is not None:
                # Checked against the Trainer's signature; its announcement names the chain
                # hash h(v) the deltas after it build on (not the content hash of the file).
                state, ann = await asyncio.to_thread(self.store.verified_snapshot, snapshot)
                self.snapshots[snapshot] = (state, ann.chain_hash)
            for v in deltas:
                delta, _ann = await asyncio.to_thread(self.store.verified_delta, v)
                self.fetched[v] = delta
        except Exception as exc:  # the store is untrusted: a bad piece is refused, not applied
            log.warning("%s: catch-up fetch failed: %s", self.id, exc)
        finally:
            self.in_flight.difference_update(wanted)
            self.wake.set()

    async def _apply_plan(self, plan: CatchUpPlan) -> None:
        assert self.engine is not None
        t0 = time.time()
        if plan.snapshot is not None:
            state, h = self.snapshots.pop(plan.snapshot)
            await asyncio.to_thread(self.engine.load, state, version=plan.snapshot, weights_hash=h)
        staged = self._staged()
        for v in plan.deltas:
            await self._apply(staged[v])
        t1 = time.time()
        keep, _restage = after_catch_up(plan, queue=self.queue, staged=staged)
        for work in self.queue:
            if work not in keep:
                self._forget(work)
        self.queue = collections.deque(keep)
        self.plan = None
        self.pending_commit = None
        self.fetched = {v: d for v, d in self.fetched.items() if v > plan.target}
        self.snapshots.clear()
        assert self.node is not None and self.engine.version is not None
        assert self.engine.weights_hash is not None
        caught_up(self.node, self.engine.version, self.engine.weights_hash)
        self.stats["catch_ups"] += 1
        digest = await self._digest(self.engine.version)
        self.send(
            {
                "op": "caught_up",
                "version": self.engine.version,
                "weights_hash": self.engine.weights_hash,
                "digest": digest,
                "pause_ms": (t1 - t0) * 1e3,
            }
        )
        self.send(
            {"op": "span", "activity": "catch-up", "version": plan.target, "start": t0, "end": t1}
        )

    async def _start_node(self) -> None:
        """The data-plane node: no weights yet (it relays and collects until the first
        catch-up), announcements checked against the job's key, the store as last source."""
        assert self.job is not None and self.store is not None
        config = transport_config(self.job, secret=self.run.secret, public_key=self.run.public_key)

        def staged(delta: Delta, _ann: object) -> None:
            self.send({"op": "staged", "version": delta.version})
            self.wake.set()

        def refused(version: int, reason: str) -> None:
            log.warning("%s: D_%d refused: %s", self.id, version, reason)

        store = self.store
        self.node = hooks.node_class()(
            self.id,
            config,
            on_staged=staged,
            on_refused=refused,
            fallback=lambda v: asyncio.to_thread(store.delta_bytes, v),
        )
        port = await self.node.serve(self.run.host, 0)
        self.send({"op": "data", "addr": f"{self.run.advertise or self.run.host}:{port}"})
        for data in self.announcements:
            self._announce(data)
        self._set_sources()

    # -- the worker ------------------------------------------------------------------------------

    async def _worker(self) -> None:
        """At every safe point, run the decision of :func:`aurora.policy.actor.next_action` and
        carry it out: apply a held catch-up plan (snapshot, then deltas), generate a batch of
        leases on the active version and send every result with its lease, version and weights
        hash, activate a staged delta in place (the only pause generation ever sees), or drop
        work it cannot run."""
        while not self.stopping:
            if self.leaving:
                return
            if self.draining_until is not None and (
                not self.queue or time.time() > self.draining_until
            ):
                return
            decision = next_action(
                active=self.active,
                staged=set(self._staged()),
                queue=self.queue,
                plan=self.plan,
                pending_commit=self.pending_commit,
                snapshots=set(self.snapshots),
                now=time.monotonic(),
                recent=self.recent,
            )
            if isinstance(decision, ApplyPlan):
                await self._apply_plan(decision.plan)
            elif isinstance(decision, Generate):
                self.queue.popleft()
                await self._generate(decision.work)
            elif isinstance(decision, Activate):
                await self._activate(decision.version)
            elif isinstance(decision, Drop):
                self.queue.popleft()
                self._forget(decision.work)
                log.info(
                    "%s: dropped %d leases on v%d (%s)",
                    self.id,
                    len(decision.work.leases),
                    decision.work.version,
                    decision.reason,
                )
            else:
                assert isinstance(decision, Wait)
                self.wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), 0.5)

    def _forget(self, work: Work) -> None:
        """``work`` will not be generated here: its prompts are no longer needed (its leases
        stay recognised until they expire, :attr:`held`)."""
        for lease in work.leases:
            self.prompt_of.pop(lease, None)

    async def _generate(self, work: Work) -> None:
        assert self.engine is not None and self.job is not None and self.sampling is not None
        per_step = self.job.prompts_per_step
        prompts = [
            (self.prompt_of[lease], task_index(self.prompt_of[lease], per_step))
            for lease in work.leases
        ]
        note = getattr(self.engine, "note_leases", None)  # a coin-aware cheat's (cheats)
        if note is not None:
            note(work.leases)
        t0, started = time.time(), time.monotonic()
        out = await asyncio.to_thread(self.engine.generate, prompts, self.sampling)
        t1 = time.time()
        self.recent.append((len(work.leases), time.monotonic() - started))
        h = self.engine.weights_hash
        late = hooks.get("late_results")
        if late is not None and int(late[0]) == work.version:
            await asyncio.sleep(float(late[1]))  # fault injection: results after their expiry
        claimed = work.version
        if hooks.get("stale_version") == work.version:
            claimed = work.version - 2  # fault injection: a result claiming an old version
        copies = 2 if hooks.get("duplicate_results") == work.version else 1
        tokens = 0
        sent = []
        for lease, gen in zip(work.leases, out, strict=True):
            msg = {
                "op": "result",
                "lease": lease,
                "version": claimed,
                "weights_hash": h,
                "payload": gen.payload,
                "tokens": gen.tokens,
            }
            tokens += gen.tokens
            sent.append(msg)
            for _ in range(copies):
                self.send(msg)
            self.prompt_of.pop(lease, None)
        self.unsent = sent  # the latest batch, re-sent if the connection turns out to be gone
        self.stats["generated"] += tokens
        self.stats["generate_s"] += t1 - t0
        said = (max(1, tokens), max(t1 - t0, 1e-6))
        claim = getattr(self.engine, "claim_throughput", None)  # a dishonest Actor's (cheats)
        if claim is not None:
            said = claim(*said)
        self.send({"op": "throughput", "tokens": said[0], "seconds": said[1]})
        self.send(
            {
                "op": "span",
                "activity": "generate",
                "version": work.version,
                "start": t0,
                "end": t1,
                "tokens": tokens,
            }
        )

    async def _apply(self, delta: Delta) -> None:
        assert self.engine is not None
        if hooks.get("kill_mid_apply") == delta.version:
            # Fault injection: write the first half of D_v into the weights, then die.
            half = delta.tensors[: len(delta.tensors) // 2]
            await asyncio.to_thread(self.engine.apply, dataclasses.replace(delta, tensors=half))
            hooks.die()
        await asyncio.to_thread(self.engine.apply, delta)

    async def _activate(self, v: int) -> None:
        assert self.engine is not None
        staged = self._staged()
        t0 = time.time()
        if hooks.get("kill_mid_apply") == v:
            # Fault injection: write the first half of D_v into the weights, then die.
            torn = dataclasses.replace(
                staged[v], tensors=staged[v].tensors[: len(staged[v].tensors) // 2]
            )
            await asyncio.to_thread(self.engine.apply, torn)
            hooks.die()
        await asyncio.to_thread(self.engine.apply, staged[v])
        if self.node is not None and v in self.node.staged:
            activate(self.node, v)
        self.fetched.pop(v, None)
        t1 = time.time()
        if self.pending_commit is not None and self.pending_commit <= v:
            self.pending_commit = None
        self.stats["activations"] += 1
        digest = await self._digest(self.engine.version)
        self.send(
            {
                "op": "activated",
                "version": v,
                "weights_hash": self.engine.weights_hash,
                "digest": digest,
                "pause_ms": (t1 - t0) * 1e3,
            }
        )
        self.send({"op": "span", "activity": "apply", "version": v, "start": t0, "end": t1})

    # -- lifecycle ------------------------------------------------------------------------------

    def _on_sigusr1(self) -> None:
        """Leave now (graceful): finish the current step, hand the leases back, exit.

        SIGUSR1 is a plain graceful leave: its leases go back to the pool at once."""
        self.leaving = True
        self.wake.set()

    def _on_sigterm(self) -> None:
        """A SIGTERM is a preemption notice: tell the Ledger (which drains the Actor: no new
        leases), finish what it holds within the notice, leave gracefully and exit."""
        if self.draining_until is not None:
            return
        self.draining_until = time.time() + self.run.notice_s
        log.info("%s: preemption notice, leaving within %.0f s", self.id, self.run.notice_s)
        self.send({"op": "notice", "seconds": self.run.notice_s})
        self.wake.set()

    async def main(self) -> int:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signal.SIGTERM, self._on_sigterm)
            loop.add_signal_handler(signal.SIGUSR1, self._on_sigusr1)
        if hooks.get("fail_at_start"):
            raise ConnectionError(str(hooks.get("fail_at_start")))  # fault injection
        if self.run.metrics_port is not None:  # docs/OBSERVABILITY.md
            self.metrics_server, _ = await observe_serve(
                [ActorCollector(self), NodeCollector(lambda: self.node)],
                self.run.metrics_host,
                self.run.metrics_port,
            )
        self.channel = await self._connect()
        while self.job is None:
            msg = await self.channel.recv_checked(Direction.LEDGER_TO_PEER)
            self._on_message(msg)
        job = self.job
        if job.max_new_tokens is None:
            raise ValueError("the job names no max_new_tokens (the Trainer sets it on register)")
        self.sampling = Sampling(
            n=job.group_size,
            max_new_tokens=job.max_new_tokens,
            temperature=job.temperature,
            seed=job.seed,
        )
        self.store = CheckpointStore(job.store, job=job.job_id, public_key=self.run.public_key)
        self.engine = await asyncio.to_thread(
            make_engine, job, engine=self.run.engine, engine_url=self.run.engine_url
        )
        # Built from the model files the Trainer signed with its snapshots, or not at all.
        signed = await asyncio.to_thread(self.store.model_manifest)
        check_model(self.engine.model_files, signed, where=job.model)
        log.info(
            "%s: model %s: its %d files as the Trainer signed", self.id, job.model, len(signed)
        )
        if hooks.get("cheat"):  # a dishonest Actor, for the tests of verified rollouts
            from aurora.runtime.cheats import CheatingEngine

            engine = self.engine
            self.engine = await asyncio.to_thread(
                CheatingEngine, engine, str(hooks.get("cheat")), job, self.id
            )
        await self._start_node()
        pump = asyncio.create_task(self._pump())
        # The delta path's hop times and this loop's lag, to the Ledger (docs/REPRODUCTION.md).
        hops = asyncio.create_task(
            hopreport.report(lambda: self.node.metrics if self.node else None, self.send)
        )
        try:
            await self._worker()
        finally:
            hops.cancel()
            if (self.draining_until is not None or self.leaving) and not self.stopping:
                self.send({"op": "leave"})
                with contextlib.suppress(Exception):
                    assert self.channel is not None
                    await self.channel.send({"op": "heartbeat"})
            self.stopping = True
            pump.cancel()
            if self.node is not None:
                await self.node.close()
            if self.channel is not None:
                self.channel.close()
        if self.dismissed is not None:
            raise self.dismissed
        if self.failed is not None:
            raise ConnectionError(self.failed)
        return 0
