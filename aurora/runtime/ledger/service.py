"""The Ledger process's server: one authenticated session per peer, by the role it proved.

Theory of operation
-------------------
The Ledger is the control plane's hub: every Actor, relay and the Trainer keeps one connection
to it (:mod:`aurora.runtime.channel`). Who may connect is settled before any session: the Ledger
shows every peer its own certificate (role ``ledger``, the job it serves) and refuses a peer
revoked by the job's signed list or excluded by the policy. What a session receives becomes an
event fed to the core (:mod:`~aurora.runtime.ledger.driver`) or a driver record
(:mod:`~aurora.runtime.ledger.durable`); the Trainer's ``published`` is believed only with an
announcement the job key signed. Connections are not state: a peer whose connection drops and
does not come back within ``reconnect_grace_s`` is lost (its leases return to the pool), and a
reconnecting Actor the Ledger still counts as live is re-sent its leases and pending commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aurora.delta.announce import (
    AnnouncementError,
    SnapshotAnnouncement,
    VersionAnnouncement,
    verify,
)
from aurora.keys import Identity, KeyFileError, Revocations
from aurora.observe.ledger import LedgerMetrics
from aurora.observe.status import SnapshotCache
from aurora.policy import allocation
from aurora.policy.core import LedgerCore
from aurora.policy.events import (
    Accepted,
    ActorLeft,
    ActorLost,
    CaughtUp,
    DeltaPublished,
    PreemptionNotice,
    RelayJoined,
    RelayLost,
    ResultArrived,
    ResultMalformed,
    ResultRefused,
    ResultVerified,
    ThroughputObserved,
    VersionActivated,
)
from aurora.policy.membership import TRAINER
from aurora.policy.reports import classify_hello
from aurora.policy.timers import TickTimers
from aurora.runtime import messages
from aurora.runtime.channel import Channel, ChannelClosed, ChannelLimits, ControlServer, serve
from aurora.runtime.ledger.config import Job, LedgerServiceConfig
from aurora.runtime.ledger.counts import Counters, LatencyHistogram
from aurora.runtime.ledger.driver import TICK_SLACK_S
from aurora.runtime.ledger.durable import ANNOUNCEMENTS_KEPT, DurableLedger
from aurora.runtime.messages import Direction, MessageError, decode_result_payload, task_index
from aurora.store.ledgerlog import LedgerLog

log = logging.getLogger("aurora.runtime.ledger")

RELAY_OPS = frozenset({"data", "heartbeat", "span"})
"""What a relay may tell the Ledger (it holds no leases and stages nothing the Ledger counts)."""

SPANS_MAX_BYTES = 64 << 20
"""Most bytes of spans the Ledger appends to its ``.spans.jsonl`` in one life (each span is a
bounded :class:`~aurora.runtime.messages.Span`, ~150 bytes: 400,000 of them); past this they
are counted and dropped, so a flood of spans cannot fill the disk."""

RENEWAL_GRACE_S = 30.0
"""A peer whose session the Ledger closed because its certificate expired is lost only if it
does not come back within this (s): a role whose identity was renewed meanwhile reconnects
with it at once (it reads its file again), so a renewal costs a reconnect, never its leases."""

SPANS_PER_VERSION = 16
"""Spans one peer may have written per version the job has published, plus one version's worth
(the v0 catch-up): an honest peer sends at most 10 per version (one per activity and hop:
catch-up, receive, stage, apply, generate...; 10 measured over the fault matrix), so a peer
that floods spans adds about its own honest share of disk (~200 bytes x 16 a version) and no
peer's flood takes another's share of :data:`SPANS_MAX_BYTES`."""


def hello_fields(hello: dict[str, Any]) -> dict[str, Any]:
    """What the Ledger reads of a peer's HELLO (its region, the version it holds, the versions
    it staged), each within the message bounds; :class:`MessageError` otherwise. The rest of
    the HELLO is not kept (a version of 2^64 in it overflowed a SQLite look-up before)."""
    out: dict[str, Any] = {
        "role": messages.Str(16).check(hello.get("role"), "hello.role"),
        "region": messages.Str(messages.MAX_ID, empty=True).check(
            hello.get("region", ""), "hello.region"
        ),
        "staged": messages.Seq(messages.VERSION, 1 << 12).check(
            hello.get("staged", ()), "hello.staged"
        ),
    }
    if hello.get("active") is not None:
        out["active"] = messages.VERSION.check(hello["active"], "hello.active")
    return out


class LedgerService(DurableLedger):
    """One job's Ledger (see the module docstring)."""

    def __init__(
        self,
        config: LedgerServiceConfig,
        *,
        clock: Callable[[], float] = time.time,
        public_key: bytes | None = None,
    ) -> None:
        self.config = config
        self.public_key = public_key
        """The job's Ed25519 public key: every peer proves its role with it (the Trainer's key
        is it), and ``published`` is believed only with an announcement it signed."""
        self.clock = clock
        """The wall clock (s): the one place the Ledger reads time."""
        self.core = LedgerCore(config.policy)
        self.state = self.core.state
        self.log = LedgerLog(config.log_path)
        self.job: Job | None = None
        self.published: dict[int, dict[str, Any]] = {}
        """version -> what the Trainer announced (h(v), content digest, sizes)."""
        self.counters = Counters()
        self.channels: dict[str, Channel] = {}
        self.roles: dict[str, dict[str, Any]] = {}
        """peer id -> its hello (role, region, data-plane address)."""
        self.trainer: Channel | None = None
        self.observers: set[Channel] = set()
        self.job_id: str | None = None
        """The job this Ledger serves: the one its certificate names (set by :meth:`start`);
        every peer's certificate and the Trainer's registration must name it too."""
        self.revoked: set[str] = set()
        """Ids the job key revoked (the union of every verified list; in the log)."""
        self.finished = False
        self.done = asyncio.Event()
        self._pacer_timers: list[asyncio.TimerHandle] = []
        self._tick_timers = TickTimers(TICK_SLACK_S)
        self._ticks: dict[float, asyncio.TimerHandle] = {}
        self._lost_timers: dict[str, asyncio.TimerHandle] = {}
        self._server: ControlServer | None = None
        self._unix: ControlServer | None = None
        self._span_bytes = 0
        self._span_counts: dict[str, int] = {}
        self.spans_dropped = 0
        self._quiet: dict[str, int] = {}
        self._admitted: dict[str, int] = {}
        self._shown: dict[str, list[float]] = {}
        """Actor -> [tokens, first, last]: its results admitted since its last throughput
        report, and the span (s) in which they were delivered (:meth:`_count_shown`)."""
        self._last_admit: dict[str, float] = {}
        """Actor -> when its latest result was admitted (it was busy until then)."""
        self.unlogged = 0
        """Results decided but not logged (:data:`QUIET_ROWS`), in this life."""
        self._spans = Path(
            config.log_path if config.log_path != ":memory:" else (config.stats_path or "x")
        ).with_suffix(".spans.jsonl")
        self.replayed = 0
        self.timings: dict[str, LatencyHistogram] = {
            "decide": LatencyHistogram(),
            "log": LatencyHistogram(),
        }
        """Seconds per event spent in ``decide`` and in appending to the log (the load
        benchmark's latency figures)."""
        self.metrics = LedgerMetrics(self)
        """What ``/metrics`` and ``aurora status`` read (:mod:`aurora.observe`)."""
        self.status = SnapshotCache(self)

    # -- connections -------------------------------------------------------------------------

    async def start(
        self,
        host: str,
        port: int,
        *,
        secret: bytes,
        identity: Identity | Callable[[], Identity],
        unix_path: str | None = None,
        limits: ChannelLimits | None = None,
    ) -> int:
        """Serve the control plane; returns the port. ``identity``: the Ledger's own (role
        ``ledger``, certified by the job key for the job it serves; a callable is asked at
        every connection, so a renewed certificate is used at once), which every peer checks.
        With ``unix_path`` it also listens on that Unix socket (for observers on this host
        outside the Ledger's network namespace). ``limits``: what peers may hold
        (:func:`channel_limits` of the job)."""
        if self.public_key is None:
            raise ValueError("the Ledger needs the job's public key to tell the roles apart")
        current = identity if callable(identity) else (lambda: identity)
        mine = current()
        if mine.role != "ledger" or mine.job is None:
            raise ValueError(
                f"the Ledger's identity is {mine.role} {mine.id!r}: it needs a ledger identity "
                "(aurora keys issue --role ledger --id ledger)"
            )
        if self.job is not None and self.job.spec.job_id != mine.job:
            raise ValueError(
                f"the Ledger's identity is for job {mine.job!r}, its log for "
                f"{self.job.spec.job_id!r}"
            )
        self.job_id = mine.job
        key = self.public_key
        serving: dict[str, Any] = {
            "secret": secret,
            "handler": self._session,
            "limits": limits,
            "public_key": key,
            "identity": current,
            "admit": self._admission,
        }
        self._server = await serve(host, port, **serving)
        if unix_path is not None and len(unix_path.encode()) < 100:  # sun_path holds 108 bytes
            import os

            with contextlib.suppress(FileNotFoundError):
                os.unlink(unix_path)
            self._unix = await serve("", 0, unix_path=unix_path, **serving)
        sock = self._server.sockets[0]
        return int(sock.getsockname()[1])

    def stats(self) -> dict[str, Any]:
        """Counts and latencies of this process's life (written as ``ledger.stats.json``)."""

        out: dict[str, Any] = {
            "events": len(self.timings["decide"]),
            "accepted": self.counters.accepted,
            "verified": self.counters.verified,
            "evicted": dict(self.counters.evicted),
            "log_bytes": self.log.bytes_written,
            "log_path": self.config.log_path,
        }
        for name, values in self.timings.items():
            out[f"{name}_p50_s"] = values.quantile(0.5)
            out[f"{name}_p99_s"] = values.quantile(0.99)
            out[f"{name}_total_s"] = values.total
        if self.config.log_path != ":memory:":
            files = [Path(self.config.log_path), Path(self.config.log_path + "-wal")]
            out["db_file_bytes"] = sum(f.stat().st_size for f in files if f.exists())
        return out

    async def close(self) -> None:
        if self.config.log_path != ":memory:" or self.timings["decide"]:
            with contextlib.suppress(OSError):
                path = self.config.stats_path or str(
                    Path(self.config.log_path).with_suffix(".stats.json")
                )
                Path(path).write_text(json.dumps(self.stats(), indent=2))
        for timer in [*self._ticks.values(), *self._lost_timers.values(), *self._pacer_timers]:
            timer.cancel()
        for ch in [*self.channels.values(), *self.observers]:
            ch.close()
        if self.trainer is not None:
            self.trainer.close()
        for server in (self._server, self._unix):
            if server is not None:
                server.close()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(server.wait_closed(), 1.0)
        self.log.close()

    async def _session(self, ch: Channel) -> None:
        """One connection, by the role it proved (never by what its HELLO says)."""
        if not ch.verified:
            log.warning("ledger: %s did not prove a role; closed", ch.peer)
            return
        role = ch.role
        if role == "trainer":
            await self._trainer_session(ch)
        elif role in ("actor", "relay"):
            await self._peer_session(ch, role)
        elif role == "observer":
            # Read-only: it is sent the live line and nothing it says is noted or decided.
            self.observers.add(ch)
            try:
                ch.send_nowait(self.progress())
                while True:
                    msg = await ch.recv_checked(Direction.OBSERVER_TO_LEDGER)
                    if msg["op"] == "status":  # a snapshot to read (aurora status)
                        ch.send_nowait({"op": "status", "snapshot": self.status.get()})
            finally:
                self.observers.discard(ch)
        else:
            log.warning("ledger: %s connected with unknown role %r", ch.peer, role)

    def progress(self) -> dict[str, Any]:
        """The numbers of the live line (sent to observers on connect)."""
        return {
            "op": "progress",
            "latest": self.state.latest,
            "batch": self.next_batch - 1,
            "done": sorted(self.batch_done),
            "actors": sorted(a.id for a in self.state.actors.values() if a.live),
            "refused": dict(self.counters.refused),
            "expired": self.counters.expired,
        }

    async def _trainer_session(self, ch: Channel) -> None:
        if self.trainer is not None:
            self.trainer.close()
        self.trainer = ch
        self.metrics.trainer_connected()
        ch.send_nowait(
            {"op": "resume", "latest": self.state.latest, "done": sorted(self.batch_done)}
        )
        try:
            while True:
                msg = await ch.recv_checked(Direction.TRAINER_TO_LEDGER)
                op = msg["op"]
                if op == "job":
                    if self.job is None:
                        # Decoded before it is logged: a spec that does not decode (ValueError,
                        # the session ends) never reaches the log, where every replay would
                        # trip on it; what is logged is the spec as JobSpec encodes it.
                        job = Job.from_record(msg["job"])
                        if self.job_id is not None and job.spec.job_id != self.job_id:
                            log.error(
                                "ledger: the Trainer registered job %r; this Ledger serves %r "
                                "(its certificate's); closed",
                                job.spec.job_id[:80],
                                self.job_id,
                            )
                            return
                        self.note(
                            {
                                "type": "Job",
                                "steps": job.steps,
                                "prompts_per_batch": job.prompts_per_batch,
                                "spec": job.spec.encode(),
                            }
                        )
                        for peer_ch in list(self.channels.values()):
                            self._welcome(peer_ch, str(peer_ch.hello.get("role")))
                    self._try_request()
                elif op == "published":
                    self._on_published(msg)
                elif op == "get_batch":
                    await ch.send(self._batch_message(int(msg["batch"])))
                elif op == "verified":
                    # Trainer-only: a recompute's measures, judged by the policy.
                    self.feed(
                        ResultVerified(
                            actor=str(msg["actor"]),
                            lease=str(msg["lease"]),
                            version=int(msg["version"]),
                            max_delta=float(msg["max_delta"]),
                            mean_delta=float(msg["mean_delta"]),
                            min_logprob=float(msg["min_logprob"]),
                            tokens=int(msg["tokens"]),
                            rank_tokens=int(msg.get("rank_tokens") or 0),
                            rank_shift=float(msg.get("rank_shift") or 0.0),
                            rank_spread=float(msg.get("rank_spread") or 0.0),
                        )
                    )
                elif op == "refused":
                    # Trainer-only: an admitted result it refused, one strike for its Actor.
                    self.feed(
                        ResultRefused(
                            actor=str(msg["actor"]), lease=str(msg["lease"]), why=str(msg["why"])
                        )
                    )
                elif op == "revocations":
                    self._on_revocations(bytes(msg["data"]))
                elif op == "stats":
                    step = self.metrics.step(int(msg["version"]))  # the step's record (observe)
                    self._tell_observers({**msg, **step, "op": "stats"})
                elif op == "finished":
                    self.metrics.finished(msg)
                    self.note({"type": "Finished"})
                    for peer in list(self.channels.values()):
                        peer.send_nowait({"op": "stop"})
                    self._tell_observers({"op": "finished"})
                    self.done.set()
        finally:
            if self.trainer is ch:
                self.trainer = None

    # -- who may connect ---------------------------------------------------------------------

    def _admission(self, role: str, peer: str) -> str | None:
        """Why a peer that proved ``role`` and ``peer`` may not connect (checked by the
        channel before anything else: no welcome, no log row), or None."""
        if peer in self.revoked:
            return f"{peer[:40]!r} is revoked in this job (aurora keys revoke)"
        if role == "actor" and self._excluded(peer):
            return f"{peer[:40]!r} is excluded from this job (it failed verification)"
        return None

    def _excluded(self, actor: str) -> bool:
        """Whether the policy excluded ``actor`` for good (a failed check)."""
        trust = self.state.trust
        return (trust is not None and trust.excluded(actor)) or actor in self.counters.evicted

    def _on_revocations(self, data: bytes) -> None:
        """The Trainer sent the job's revocation list: verified (the job key, this job), its
        new ids logged, their connections closed and each of them lost at once."""
        if self.public_key is None or self.job_id is None:
            return
        try:
            rev = Revocations.decode(data, self.public_key, job=self.job_id)
        except KeyFileError as exc:
            log.error("ledger: a revocation list refused: %s", exc)
            return
        new = sorted(set(rev.ids) - self.revoked)
        if not new:
            return  # sent again (every Trainer connection sends it): no row
        self.note({"type": "Revoked", "ids": new})
        log.warning("ledger: revoked %s", ", ".join(new))
        for peer in new:
            channel = self.channels.pop(peer, None)
            if channel is not None:
                # Closed, not told to stop: it reconnects, is refused with the reason, and
                # stops with that line (its operator learns why).
                channel.close()
            timer = self._lost_timers.pop(peer, None)
            if timer is not None:
                timer.cancel()
            role = "relay" if peer in self.state.relays else "actor"
            self._lose(peer, role)
        for obs in [o for o in self.observers if o.peer in new]:
            obs.close()

    def _signed_hash(self, msg: dict[str, Any]) -> str:
        """h(v) of a ``published`` message, from the announcement the job key signed (a delta's
        for v >= 1, the v0 snapshot's for v0), never from the message; ValueError (one line)
        when there is none or it does not verify for this job and version."""
        v = int(msg["version"])
        job = self.job.spec.job_id if self.job is not None else None
        if self.public_key is None or not isinstance(job, str):
            raise ValueError("no job key or job id to verify it against")
        data = msg.get("announcement") if v > 0 else msg.get("snapshot_announcement")
        if not isinstance(data, bytes):
            raise ValueError("no signed announcement")
        try:
            ann = verify(data, self.public_key, job=job)
        except AnnouncementError as exc:
            raise ValueError(str(exc)) from None
        if v > 0 and isinstance(ann, VersionAnnouncement) and ann.version == v:
            return ann.weights_hash
        if v == 0 and isinstance(ann, SnapshotAnnouncement) and ann.version == 0:
            return ann.chain_hash
        raise ValueError(f"the signed announcement is for another version or kind ({ann!r})"[:200])

    def _on_published(self, msg: dict[str, Any]) -> None:
        v = int(msg["version"])
        try:
            weights_hash = self._signed_hash(msg)
        except ValueError as exc:
            log.error("ledger: published v%d refused: %s", v, exc)
            return
        if v in self.state.versions:
            # A restarted Trainer announcing a version again: it must be the same version.
            if self.state.versions[v].weights_hash != weights_hash:
                log.error("ledger: the Trainer re-published v%d with another hash; ignored", v)
            return
        rec = {
            "type": "Published",
            "version": v,
            "weights_hash": weights_hash,
            "digest": msg.get("digest"),
            "delta_bytes": msg.get("delta_bytes"),
            "snapshot_bytes": msg.get("snapshot_bytes"),
            "stats": msg.get("stats") or {},
            "at": self.clock(),
            "announcement": bytes(msg["announcement"]).hex() if msg.get("announcement") else None,
        }
        self.note(rec)
        if rec["announcement"]:
            # Anyone may carry a signed announcement: every peer gets it from here too, so a
            # node whose source withholds it still learns the version exists (and its deadline
            # starts).
            for peer_ch in list(self.channels.values()):
                peer_ch.send_nowait({"op": "announce", "data": bytes(msg["announcement"])})
        self.feed(
            DeltaPublished(
                version=v,
                weights_hash=weights_hash,
                delta_bytes=msg.get("delta_bytes"),
                snapshot_bytes=msg.get("snapshot_bytes"),
            )
        )
        for staged in self.core.early(v):
            self.feed(staged)
        self._tell_observers({"op": "published", "version": v})

    def _batch_message(self, k: int) -> dict[str, Any]:
        results = []
        pacer = self.core.pacer
        for a in pacer.results.get(k, []) if pacer is not None else []:
            results.append(
                {
                    "actor": a.actor,
                    "lease": a.lease,
                    "prompt": a.prompt,
                    "version": a.version,
                    "payload": self.log.payload(a.actor, a.lease),
                    # The share of this Actor's results to check (None: drop them); which
                    # ones is the Trainer's keyed coin, a key the Ledger never holds.
                    "check": None if a.actor in self.revoked else self.core.check_fraction(a.actor),
                }
            )
        return {"op": "batch", "batch": k, "complete": k in self.batch_done, "results": results}

    async def _peer_session(self, ch: Channel, role: str) -> None:
        peer = ch.peer
        if peer == TRAINER or not peer:
            raise ChannelClosed(f"peer id {peer!r} is reserved")
        try:
            hello = hello_fields(ch.hello)
        except MessageError as exc:
            log.warning("ledger: %s sent a bad hello; closed: %s", peer, exc)
            return
        if self._admission(role, peer) is not None:
            return  # revoked or excluded since its identity step: closed, nothing else
        old = self.channels.get(peer)
        if old is not None and not old.closed:
            log.warning("ledger: %s connected again; closing its previous connection", peer)
            old.close()
        self.channels[peer] = ch
        self.roles[peer] = hello
        timer = self._lost_timers.pop(peer, None)
        if timer is not None:
            timer.cancel()
        self._welcome(ch, role)
        try:
            if role == "relay":
                self._join_relay(peer, hello)
            else:
                self._join_actor(peer, hello)
            allowed = RELAY_OPS if role == "relay" else None
            while True:
                msg = await ch.recv_checked(Direction.PEER_TO_LEDGER, allowed=allowed)
                self._on_peer_message(peer, msg)
        finally:
            if self.channels.get(peer) is ch:
                del self.channels[peer]
                if not self.finished:
                    grace = self.config.reconnect_grace_s
                    if ch.ended is not None:  # its certificate ended: it may bring a renewed one
                        grace = max(grace, RENEWAL_GRACE_S)
                    if grace > 0:
                        self._lost_timers[peer] = asyncio.get_running_loop().call_later(
                            grace, self._lose, peer, role
                        )
                    else:
                        self._lose(peer, role)

    def _welcome(self, ch: Channel, role: str) -> None:
        spec = self.job.spec.encode() if self.job is not None else None
        recent = sorted(v for v, r in self.published.items() if r.get("announcement"))
        recent = recent[-ANNOUNCEMENTS_KEPT:]
        for v in recent:
            ch.send_nowait(
                {"op": "announce", "data": bytes.fromhex(self.published[v]["announcement"])}
            )
        ch.send_nowait(
            {
                "op": "welcome",
                "job": spec,
                "sources": {
                    rid: self._address(rid)
                    for rid in [TRAINER, *self.state.relays]
                    if self._address(rid) is not None
                },
            }
        )

    def _join_relay(self, peer: str, hello: dict[str, Any]) -> None:
        if peer in self.state.relays:
            return
        self.feed(RelayJoined(relay=peer, region=str(hello.get("region", ""))))
        # Actors routed to this relay before it (re)connected learn its address now.
        for rec in self.state.actors.values():
            if rec.live and rec.source == peer:
                self._send_route(rec.id, peer)

    def _join_actor(self, peer: str, hello: dict[str, Any]) -> None:
        active = hello.get("active")
        said = classify_hello(
            self.state,
            peer,
            region=str(hello.get("region", "")),
            active=None if active is None else int(active),
        )
        for event in said.events:
            self.feed(event)
        if said.reconnected:
            # A network blip or a restarted Ledger: resend what it may have missed.
            rec = self.state.actors[peer]
            self._send_route(peer, rec.source)
            for lease in self.state.book.live(peer):
                self._send(
                    peer,
                    {
                        "op": "assign",
                        "version": lease.version,
                        "leases": [[lease.id, lease.prompt]],
                        "expiry_in": max(0.0, lease.expiry - self.clock()),
                    },
                )
            if rec.commit_sent is not None:
                self._send(peer, {"op": "commit", "version": rec.commit_sent})
        # What it staged while the Ledger could not hear it: without this a restarted Ledger
        # waited the whole staging grace (10 s) and then left these Actors out of the batch.
        for v in sorted(int(x) for x in hello.get("staged", ())):
            self._staged(peer, v)

    def _staged(self, peer: str, v: int) -> None:
        """Actor ``peer`` says it holds D_v verified and staged."""
        event = self.core.staged(peer, v)
        if event is not None:
            self.feed(event)

    def _bad_payload(self, peer: str, lease_id: str, payload: bytes) -> tuple[str | None, int]:
        """Why ``payload`` is not what lease ``lease_id`` asked for (its prompt and task index,
        the job's group size, token limit, vocabulary, end of sequence and plausible log-probs:
        :func:`~aurora.runtime.messages.decode_result_payload`, the check the Trainer applies
        again), or None; and the tokens it holds. A result for a lease that is not this
        Actor's is left to the policy (refused there, payload never kept)."""
        lease = self.state.book.leases.get(lease_id)
        if lease is None or lease.actor != peer or self.job is None:
            return None, 0
        spec = self.job.spec
        try:
            per_step = spec.prompts_per_step or self.job.prompts_per_batch
            index = task_index(lease.prompt, per_step)
            decoded = decode_result_payload(
                payload,
                prompt=lease.prompt,
                index=index,
                group_size=spec.group_size or None,
                max_new_tokens=spec.max_new_tokens or None,
                vocab_size=spec.vocab_size,
                eos_ids=spec.end_ids(),
            )
        except (MessageError, ValueError, TypeError) as exc:
            return str(exc)[:200], 0
        return None, sum(len(c.ids) for c in decoded.completions)

    def _count_shown(self, peer: str, claimed_at: float, tokens: int, now: float) -> None:
        """An admitted result of ``peer`` (its lease claimed at ``claimed_at``, ``tokens``
        tokens) is evidence of its throughput: delivered in the span from the claim, or from
        its previous admitted result if later (it was busy until then), to ``now``."""
        start = max(claimed_at, self._last_admit.get(peer, -math.inf))
        shown = self._shown.get(peer)
        if shown is None:
            self._shown[peer] = [float(tokens), start, now]
        else:
            shown[0] += tokens
            shown[1] = min(shown[1], start)
            shown[2] = now
        self._last_admit[peer] = now

    def _lose(self, peer: str, role: str) -> None:
        self._lost_timers.pop(peer, None)
        if peer in self.channels or self.finished:
            return
        if role == "relay":
            if peer in self.state.relays:
                self.feed(RelayLost(relay=peer))
        else:
            rec = self.state.actors.get(peer)
            if rec is not None and rec.live:
                self.feed(ActorLost(actor=peer))

    def _on_peer_message(self, peer: str, msg: dict[str, Any]) -> None:
        op = msg["op"]
        rec = self.state.actors.get(peer)
        if op == "span":
            # The decoded span, never the raw map (which may carry any other field), and no
            # more than SPANS_MAX_BYTES in all.
            line = json.dumps(
                {**messages.decode(msg, Direction.PEER_TO_LEDGER).to_wire(), "who": peer}
            )
            allowed = SPANS_PER_VERSION * ((self.state.latest or 0) + 2)
            mine = self._span_counts.get(peer, 0)
            if mine >= allowed or self._span_bytes + len(line) + 1 > SPANS_MAX_BYTES:
                self.spans_dropped += 1
                return
            self._span_counts[peer] = mine + 1  # one entry per identity the job certified
            self._span_bytes += len(line) + 1
            with open(self._spans, "a") as f:
                f.write(line + "\n")
            return
        if op == "data":
            self.roles.setdefault(peer, {})["data"] = str(msg["addr"])
            for other in self.state.actors.values():
                if other.live and other.source == peer and other.id != peer:
                    self._send_route(other.id, peer)
            return
        if rec is None or not rec.live:
            if op == "result":
                # A result from a machine the Ledger no longer counts: refused, never admitted.
                self.counters.refused["UNKNOWN_ACTOR"] = (
                    self.counters.refused.get("UNKNOWN_ACTOR", 0) + 1
                )
            return
        if op == "staged":
            self._staged(peer, int(msg["version"]))
        elif op in ("activated", "caught_up"):
            version = int(msg["version"])
            self.note(
                {
                    "type": "Activation",
                    "actor": peer,
                    "version": version,
                    "weights_hash": msg.get("weights_hash"),
                    "digest": msg.get("digest"),
                    "pause_ms": msg.get("pause_ms"),
                    "how": "activate" if op == "activated" else "catch_up",
                }
            )
            if op == "activated":
                self.feed(VersionActivated(actor=peer, version=version))
            else:
                self.feed(CaughtUp(actor=peer, version=version))
        elif op == "result":
            lease, payload = str(msg["lease"]), bytes(msg["payload"])
            why, tokens = self._bad_payload(peer, lease, payload)
            if why is not None:
                if self._quiet.get(peer, 0) < self._quiet_allowed(peer):  # a flood: no line each
                    log.warning("ledger: refused a result of %s for %s: %s", peer, lease, why)
                self.feed(ResultMalformed(actor=peer, lease=lease))
                return
            held = self.state.book.leases.get(lease)
            now = self.clock()
            actions = self.feed(
                ResultArrived(
                    actor=peer,
                    lease=lease,
                    version=int(msg["version"]),
                    weights_hash=str(msg["weights_hash"]),
                ),
                payload=(peer, lease, payload),
                now=now,
            )
            if held is not None and any(type(a) is Accepted for a in actions):
                self._count_shown(peer, held.claimed_at, tokens, now)
        elif op == "throughput":
            # Counted only as far as its admitted results show it (policy's rule); the event
            # logged is the bounded one, so a replay decides the same.
            shown = self._shown.pop(peer, None)
            got = allocation.bounded_throughput(
                int(msg["tokens"]),
                float(msg["seconds"]),
                shown_tokens=int(shown[0]) if shown else 0,
                shown_seconds=shown[2] - shown[1] if shown else 0.0,
                estimate=rec.estimate,
            )
            if got is not None:
                self.feed(ThroughputObserved(actor=peer, tokens=got[0], seconds=got[1]))
        elif op == "notice":
            self.feed(PreemptionNotice(actor=peer, deadline=self.clock() + float(msg["seconds"])))
        elif op == "leave":
            self.feed(ActorLeft(actor=peer))
        else:
            log.warning("ledger: unknown message %r from %s", op, peer)
