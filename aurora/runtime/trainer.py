"""The Trainer process: train on each admitted batch, publish ``D_v``, checkpoint, repeat.

Theory of operation
-------------------
One-step asynchronous RL as the paper runs it: the Ledger starts batch ``k`` (on an older policy,
within the lag bound) while the Trainer is still training on batch ``k-1``. The Trainer waits
until the Ledger says a batch is complete, takes one optimizer step on its admitted results
(:meth:`~aurora.runtime.compute.TrainerSide.train`), publishes ``D_k`` cut-through on its
data-plane node, stores it and checkpoints, and only then tells the Ledger ``published(k)``
(:class:`TrainerProcess` says why that order makes a kill at any point safe). By default the Ledger
runs in this process, on the same event loop, behind the same TCP interface as a standalone
``aurora ledger``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgpack

from aurora.delta import Segment
from aurora.delta.announce import verify
from aurora.jobspec import JobSpec
from aurora.keys import (
    DEFAULT_LIFETIME_S,
    LEDGER_ID,
    RevocationFile,
    SelfIssued,
    trainer_identity,
    verification_key,
)
from aurora.observe.exporter import serve as observe_serve
from aurora.observe.node import NodeCollector
from aurora.policy.sampling import RankStats
from aurora.policy.verification import (
    Plan,
    judge,
    measure,
    payload_digest,
    pick_completions,
    plan,
)
from aurora.runtime import hopreport
from aurora.runtime.channel import Channel, IdentityRefused, connect
from aurora.runtime.compute import TrainerSide, make_trainer
from aurora.runtime.job import (
    digest_due,
    transport_config,
    unverified_warning,
    verification_config,
)
from aurora.runtime.ledger.config import LedgerServiceConfig, channel_limits
from aurora.runtime.ledger.service import LedgerService
from aurora.runtime.memprobe import MemoryProbe
from aurora.runtime.messages import (
    MAX_ID,
    MAX_PAYLOAD,
    Blob,
    Direction,
    Int,
    MessageError,
    ResultPayload,
    Str,
    Why,
    decode_result_payload,
    task_index,
)
from aurora.runtime.publisher import TrainerNode
from aurora.store import CheckpointStore
from aurora.store.files import write_atomic
from aurora.store.manifest import check as check_model

log = logging.getLogger("aurora.runtime.trainer")

HISTORY_KEPT = 16
"""Newest versions whose h(v), signed announcement and step statistics the Trainer keeps in
memory and in ``published.json``. Older ones are only ever asked for again by a Ledger that lost
them (a restarted in-memory Ledger re-announces from v0); they are read back from the Checkpoint
Store (h(v) from the signed announcement) and ``trainer/steps.jsonl`` (the statistics). Keeping
every version grew the process ~1.3 KB a step and made each checkpoint's metadata rewrite
(``published.json``, fsynced every step) grow with the job."""


@dataclass(frozen=True, kw_only=True)
class TrainerRun:
    """Where and how one Trainer process runs."""

    spec: JobSpec
    """The job spec (:func:`aurora.runtime.job.make_spec`)."""
    run_dir: str
    """Folder of this run: the Trainer's checkpoint, the Ledger's log, exports."""
    secret: bytes
    """The job secret (admission control on every connection)."""
    signing_key: bytes
    """The Trainer's Ed25519 private key: it signs every version and snapshot it publishes."""
    public_key: bytes
    """The job's public key (the signing key's; every node verifies against it)."""
    host: str = "127.0.0.1"
    """Address the data plane (and an in-process Ledger) listen on."""
    advertise: str | None = None
    """Address other hosts reach this one at (None: ``host``; set it when listening on
    0.0.0.0, e.g. inside an emulated region)."""
    data_port: int = 0
    """Data-plane port (0: any free port)."""
    ledger: tuple[str, int] | None = None
    """A standalone Ledger to use; None runs one in this process."""
    ledger_port: int = 0
    """Port of the in-process Ledger (0: any free port)."""
    ports_file: str | None = None
    """Where to write the ports actually bound (JSON), for a launcher to read."""
    revocations: str | None = None
    """The job's revocation list (``aurora keys revoke``): read whenever it changes, its ids'
    results never trained on, and sent to the Ledger, which enforces it. None:
    ``RUN_DIR/revoked.json``."""
    metrics_port: int | None = None
    """Serve ``/metrics`` (its node's, and its in-process Ledger's) on this port; None: off."""
    metrics_host: str = "127.0.0.1"
    """Address ``/metrics`` listens on (this host only by default)."""


def _publish_in_thread(
    compute: TrainerSide, loop: asyncio.AbstractEventLoop
) -> tuple[asyncio.Queue, asyncio.Future]:
    """Run ``compute.publish`` (extraction: CPU work) in a worker thread and hand each segment
    to the event loop as it is cut, so publishing on the data plane overlaps extraction. The
    queue ends with None (or the exception); the future holds the :class:`Published`."""
    queue: asyncio.Queue[Segment | BaseException | None] = asyncio.Queue()

    def on_segment(seg: Segment) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, seg)

    def work():
        try:
            return compute.publish(on_segment)
        except BaseException as exc:
            loop.call_soon_threadsafe(queue.put_nowait, exc)
            raise
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, None)

    return queue, loop.run_in_executor(None, work)


class TrainerProcess:
    """The Trainer role. Its loop:

    1. wait until the Ledger says batch ``k`` is complete, and fetch its admitted results (every
       result passed the acceptance predicate: its lease was live, its version and weights hash were
       the lease's);
    2. one optimizer step on them (:meth:`~aurora.runtime.compute.TrainerSide.train`; the Trainer
       computes the rewards itself from the prompts and the completions' text);
    3. extract ``D_k`` against the last published bf16 weights and publish it segment by segment as
       extraction produces them (cut-through) on its data-plane node; relays and Actors stage it
       while they generate;
    4. store ``D_k`` (and every ``snapshot_interval`` a snapshot) in the Checkpoint Store, save its
       own checkpoint (master weights, optimizer, RNG, version), and only then tell the Ledger
       ``published(k)`` with h(k), the content digest of its bf16 weights and the step's statistics.

    The order of 4 makes a kill at any point safe: a Trainer restarted from its checkpoint redoes at
    most the step whose checkpoint it had not written, producing the same bytes (a deterministic
    step on the same sorted inputs), which the store accepts as a no-op and Actors that staged the
    first copy find identical."""

    def __init__(self, run: TrainerRun) -> None:
        self.run = run
        self.spec = run.spec
        self.dir = Path(run.run_dir)
        self.state_dir = self.dir / "trainer"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.store = CheckpointStore(
            self.spec.store, job=self.spec.job_id, public_key=run.public_key
        )
        self.compute: TrainerSide | None = None
        self.hashes: dict[int, str] = {}
        """h(v) of v0 and the newest :data:`HISTORY_KEPT` versions (persisted beside the
        checkpoint); :meth:`_hash_of` takes an older one from its stored announcement."""
        self.announcements: dict[int, bytes] = {}
        """Signed announcements of the newest versions published by this process (or
        re-served); an older one is read from the store."""
        self.ledger_service: LedgerService | None = None
        self.node: TrainerNode | None = None
        self.channel: Channel | None = None
        self._hops: asyncio.Task[None] | None = None
        self.done_batches: set[int] = set()
        self._batch_event = asyncio.Event()
        self._inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._batch_tokens = 0
        self._batch_refused = 0
        """Results of the batch the Trainer refused (a payload that fails its checks)."""
        self._refusals: list[tuple[str, str, str]] = []
        """(Actor, lease, why) of each result of the batch the Trainer refused: each is one
        strike against its Actor, told to the Ledger with the step (``refused``)."""
        self._batch_owners: list[tuple[str, str]] = []
        """(Actor, lease) of each result the step trains on, in the order handed to it."""
        """Messages from the Ledger other than ``batch_done`` (one queue per connection)."""
        self._batch_verify: dict[str, float | str] = {}
        """The batch's verification counts and time (``verify_s``, ``verified``, ...)."""
        self.verification = verification_config(run.spec)
        """The job's verification rule (None: results are trained unchecked)."""
        warning = unverified_warning(run.spec)
        if warning is not None:
            log.warning("trainer: %s", warning)
        self._verify_key = verification_key(run.signing_key)
        """The key of the coin that picks which results and completions are recomputed: from
        the signing key, so no other role can compute it (never sent, logged or printed)."""
        self._ranks: dict[str, RankStats] = {}
        """Each checked Actor's rank sums (:mod:`aurora.policy.sampling`) since this start."""
        self.probe = MemoryProbe("trainer")
        """Opt-in tracemalloc snapshots (``AURORA_TRACEMALLOC``; off by default)."""
        self.revocations = RevocationFile(
            run.revocations or self.dir / "revoked.json", run.public_key, job=self.spec.job_id
        )
        """The job's revoked ids (the union of every list read; the file is watched)."""

    # -- state on disk -----------------------------------------------------------------------

    @property
    def _ckpt(self) -> str:
        return str(self.state_dir / "state")

    def _save(self, meta: dict[str, Any]) -> None:
        """Checkpoint, then the version it is at: both renamed into place, checkpoint first, so
        a kill at any point leaves a matching pair (or the previous one)."""
        assert self.compute is not None
        tmp = f"{self._ckpt}.tmp"
        self.compute.save(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self._ckpt)
        write_atomic(self.state_dir / "published.json", [json.dumps(meta).encode()])

    @property
    def _steps_log(self) -> Path:
        return self.state_dir / "steps.jsonl"

    def _log_step(self, version: int, stats: dict[str, Any]) -> None:
        """Append one step's statistics to ``steps.jsonl`` (a redone step appends again; the
        last line of a version wins, a torn last line is skipped when read)."""
        line = json.dumps({"version": version, "stats": stats}).encode() + b"\n"
        with open(self._steps_log, "a+b") as f:
            if f.seek(0, os.SEEK_END) > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    line = b"\n" + line  # end the line a kill tore, so this one parses
            f.write(line)

    def _logged_steps(self, versions: set[int]) -> dict[int, dict[str, Any]]:
        out: dict[int, dict[str, Any]] = {}
        if not versions or not self._steps_log.exists():
            return out
        with open(self._steps_log) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # the line a kill tore
                if int(rec["version"]) in versions:
                    out[int(rec["version"])] = rec["stats"]
        return out

    def _hash_of(self, v: int, signed: bytes | None) -> str:
        """h(v): kept for the newest versions, else from ``signed``, v's signed announcement
        (read back from the store by the caller), checked against the Trainer's key."""
        h = self.hashes.get(v)
        if h is None:
            if signed is None:
                raise RuntimeError(f"no h(v) kept and no announcement stored for v{v}")
            h = str(verify(signed, self.run.public_key, job=self.spec.job_id).weights_hash)
        return h

    def _forget_before(self, v: int, meta: dict[str, Any]) -> None:
        """At version ``v``: drop the history at or below ``v - HISTORY_KEPT`` from memory and
        ``meta`` (h(0) stays: the chain's root), and the batches already trained."""
        floor = v - HISTORY_KEPT
        self.hashes = {u: h for u, h in self.hashes.items() if u == 0 or u > floor}
        self.announcements = {u: a for u, a in self.announcements.items() if u > floor}
        self.done_batches = {k for k in self.done_batches if k > v}
        steps = meta.get("steps", {})
        for u in [u for u in steps if int(u) <= floor]:
            del steps[u]
        meta["hashes"] = {str(u): h for u, h in self.hashes.items()}

    def _resume(self) -> dict[str, Any] | None:
        path = self.state_dir / "published.json"
        if not path.exists():
            return None
        meta = json.loads(path.read_text())
        assert self.compute is not None
        self.compute.load(self._ckpt)
        if self.compute.version != meta["version"]:
            raise RuntimeError(
                f"{self.state_dir}: checkpoint is at v{self.compute.version} but "
                f"published.json at v{meta['version']}"
            )
        return meta

    # -- main --------------------------------------------------------------------------------

    async def main(self) -> int:
        self.revocations.poll(strict=True)  # a list that does not verify: one line, no start
        self.compute = await asyncio.to_thread(make_trainer, self.spec, workdir=str(self.dir))
        if self.verification is not None and not hasattr(self.compute, "recompute"):
            raise ValueError(
                f"real.verify: the {self.spec.backend} backend cannot recompute log-probs "
                "(verified rollouts need backend rl)"
            )
        if self.spec.max_new_tokens is None:
            self.spec = replace(self.spec, max_new_tokens=self.compute.max_new_tokens)
        # What the Ledger checks every payload against before admission, from the model: the
        # same check the Trainer applies (aurora.runtime.messages.decode_result_payload).
        vocab, eos = (
            getattr(self.compute, "vocab_size", None),
            getattr(self.compute, "eos_id", None),
        )
        if self.spec.vocab_size is None and vocab is not None:
            self.spec = replace(self.spec, vocab_size=int(vocab))
        if self.spec.eos_id is None and eos is not None:
            self.spec = replace(self.spec, eos_id=int(eos))
        ends = getattr(self.compute, "eos_ids", None)
        if self.spec.eos_ids is None and ends:
            self.spec = replace(self.spec, eos_ids=tuple(int(e) for e in ends))
        spec = self.spec
        meta = self._resume()
        if meta is None:
            compute = self.compute  # as narrowed here: a lambda does not keep the narrowing
            h0 = await asyncio.to_thread(
                lambda: self.store.publish_snapshot(
                    0,
                    compute.published(),
                    signing_key=self.run.signing_key,
                    model=compute.model_files,
                )
            )
            self.hashes = {0: h0}
            reward_first = await asyncio.to_thread(self.compute.evaluate)
            meta = {"version": 0, "hashes": {"0": h0}, "reward_first": reward_first}
            self._save(meta)
        else:
            log.info("trainer: resumed from its checkpoint at v%d", meta["version"])
            # The model files it restarted with must be the ones it signed before.
            signed = await asyncio.to_thread(self.store.model_manifest)
            check_model(self.compute.model_files, signed, where=spec.model)
        self.hashes = {int(k): v for k, v in meta["hashes"].items()}
        v = int(meta["version"])
        config = transport_config(spec, secret=self.run.secret, public_key=self.run.public_key)
        self.node = TrainerNode(
            "trainer", config, active=(v, self.hashes[v]), signing_key=self.run.signing_key
        )
        await self._refill_cache(v)
        # The delta path's first hops (out of this node) and this loop's lag, which is also the
        # in-process Ledger's: trainer/hops.jsonl (its Ledger session carries no spans).
        self._hops = asyncio.create_task(
            hopreport.report(lambda: self.node.metrics if self.node else None, self._hop_line)
        )
        data_port = await self.node.serve(self.run.host, self.run.data_port)
        spec = replace(spec, trainer_data=f"{self.run.advertise or self.run.host}:{data_port}")
        ledger_addr = self.run.ledger
        if ledger_addr is None:
            memory = spec.ledger_in_memory
            self.ledger_service = LedgerService(
                ledger_config(
                    spec,
                    ":memory:" if memory else str(self.dir / "ledger.db"),
                    stats_path=str(self.dir / "ledger.stats.json"),
                ),
                public_key=self.run.public_key,
            )
            self.ledger_service.replay()
            port = await self.ledger_service.start(
                self.run.host,
                self.run.ledger_port,
                secret=self.run.secret,
                # The job key holder certifies its own Ledger, anew before each lapses.
                identity=SelfIssued(
                    "ledger",
                    LEDGER_ID,
                    self.run.signing_key,
                    job=spec.job_id,
                    lifetime_s=DEFAULT_LIFETIME_S,
                ),
                unix_path=str(self.dir / "ledger.sock"),
                limits=channel_limits(spec),
            )
            ledger_addr = (self.run.host, port)
        if self.run.metrics_port is not None:  # docs/OBSERVABILITY.md
            self.metrics_server, _ = await observe_serve(
                [NodeCollector(lambda: self.node)]
                + ([self.ledger_service.metrics] if self.ledger_service else []),
                self.run.metrics_host,
                self.run.metrics_port,
            )
        if self.run.ports_file:
            write_atomic(
                self.run.ports_file,
                [json.dumps({"data": data_port, "ledger": ledger_addr[1]}).encode()],
            )
        try:
            await self._serve_job(spec, ledger_addr, v, meta)
        finally:
            await self.close()
        return 0

    def _hop_line(self, span: dict[str, Any]) -> None:
        with open(self.state_dir / "hops.jsonl", "a") as f:
            f.write(json.dumps({**span, "who": "trainer"}) + "\n")

    async def close(self) -> None:
        if self._hops is not None:
            self._hops.cancel()
            await asyncio.sleep(0)  # its last report is written before the node goes
        if self.channel is not None:
            self.channel.close()
        if self.node is not None:
            await self.node.close()
        if self.ledger_service is not None:
            await self.ledger_service.close()

    async def _refill_cache(self, v: int) -> None:
        """After a restart: serve the newest published deltas again from the store, so relays
        and Actors that missed them can still fetch them from the Trainer."""
        from aurora.delta import segments_of

        assert self.node is not None
        first = max(1, v - self.node.config.cache_versions + 1)
        for u in range(first, v + 1):
            data = await asyncio.to_thread(self.store.delta_bytes, u)
            signed = await asyncio.to_thread(self.store.announcement, u)
            self.announcements[u] = signed
            await self.node.publish(u, segments_of(data), announcement=signed)

    async def _connect(self, addr: tuple[str, int]) -> Channel:
        deadline = time.monotonic() + 30.0
        while True:
            try:
                return await connect(
                    addr[0],
                    addr[1],
                    secret=self.run.secret,
                    hello={"id": "trainer", "role": "trainer"},
                    identity=trainer_identity(self.run.signing_key),
                    # Only a Ledger the job key certified for this job decides what is trained.
                    job_key=self.run.public_key,
                    job=self.spec.job_id,
                    revoked=self.revocations.ids,
                )
            except IdentityRefused:
                raise  # not this job's Ledger (or a revoked one): never trained with
            except ConnectionError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)

    async def _send_revocations(self, ch: Channel) -> None:
        """Send the Ledger the revocation list on connect and whenever the file adds ids (it
        is read once a second: a stat while nothing changes)."""
        sent = None
        while not ch.closed:
            self.revocations.poll()
            latest = self.revocations.latest
            if latest is not None and latest is not sent:
                try:
                    await ch.send({"op": "revocations", "data": latest.encode()})
                except ConnectionError:
                    return  # the next connection sends it
                sent = latest
            await asyncio.sleep(1.0)

    async def _serve_job(
        self, spec: JobSpec, addr: tuple[str, int], v: int, meta: dict[str, Any]
    ) -> None:
        assert self.compute is not None
        steps = spec.steps
        while True:
            # After a lost Ledger connection, go on from what is published (and saved): a step
            # whose announcement did not get through is announced again, not trained again.
            v = int(meta["version"])
            self.channel = await self._connect(addr)
            self._inbox = asyncio.Queue()
            reader = asyncio.create_task(self._read(self.channel))
            revoker = asyncio.create_task(self._send_revocations(self.channel))
            try:
                resume = await self._resume_with_ledger(spec, v, meta)
                self.done_batches |= set(resume)
                while v < steps:
                    k = v + 1
                    results = await self._fetch_batch(k)
                    v = await self._step(k, results, meta)
                await self._finish(meta)
                return
            except ConnectionError as exc:
                log.warning("trainer: lost the Ledger (%s); reconnecting", exc)
                await asyncio.sleep(0.5)
            finally:
                reader.cancel()
                revoker.cancel()

    async def _resume_with_ledger(self, spec: JobSpec, v: int, meta: dict[str, Any]) -> list[int]:
        assert self.channel is not None
        first = await self._inbox.get()
        if first.get("op") != "resume":
            raise ConnectionError(f"expected resume from the Ledger, got {first.get('op')}")
        await self.channel.send(
            {
                "op": "job",
                "job": {
                    "steps": spec.steps,
                    "prompts_per_batch": spec.prompts_per_step,
                    "spec": spec.encode(),
                },
            }
        )
        latest = first.get("latest")
        start = 0 if latest is None else int(latest) + 1
        kept = meta.get("steps", {})
        older = {u for u in range(max(start, 1), v + 1) if str(u) not in kept}
        logged = await asyncio.to_thread(self._logged_steps, older)
        for u in range(start, v + 1):
            await self._announce(u, kept.get(str(u)) or logged.get(u, {}))
        return [int(k) for k in first.get("done", ())]

    async def _read(self, ch: Channel) -> None:
        try:
            while True:
                msg = await ch.recv_checked(Direction.LEDGER_TO_TRAINER)
                if msg.get("op") == "batch_done":
                    self.done_batches.add(int(msg["batch"]))
                    self._batch_event.set()
                else:
                    await self._inbox.put(msg)
        except ConnectionError as exc:
            await self._inbox.put({"op": "closed", "why": str(exc)})
            self._batch_event.set()

    async def _fetch_batch(self, k: int) -> list[tuple[int, bytes, int]]:
        assert self.channel is not None
        while k not in self.done_batches:
            self._batch_event.clear()
            if self.channel.closed:
                raise ConnectionError("the Ledger closed the connection")
            await self._batch_event.wait()
        await self.channel.send({"op": "get_batch", "batch": k})
        while True:
            msg = await self._inbox.get()
            if msg.get("op") == "closed":
                raise ConnectionError(msg.get("why", "closed"))
            if msg.get("op") == "batch" and int(msg["batch"]) == k:
                break
        self._batch_tokens = 0
        self._batch_refused = 0
        self._refusals = []
        kept: list[tuple[str, str, bool, tuple[int, bytes, int], int]] = []
        dropped = 0
        for r in msg.get("results") or ():
            if isinstance(r, dict) and str(r.get("actor")) in self.revocations.ids:
                self._batch_refused += 1  # revoked: never trained on, whatever the Ledger says
                continue
            checked = self._check_result(r)
            if isinstance(checked, str):
                self._batch_refused += 1
                self._refuse(r, checked)
                continue
            payload, version = checked
            actor, lease, body = str(r["actor"]), str(r["lease"]), bytes(r["payload"])
            decided = self._plan(actor, lease, body, r.get("check", 1.0))
            if decided is Plan.DROP:
                dropped += 1  # its Actor failed verification: never trained on
                continue
            entry = (payload.index, body, version)
            kept.append((actor, lease, decided is Plan.CHECK, entry, payload.tokens))
        failed = await self._verify(kept) if self.verification is not None else set()
        out = []
        trained: dict[str, int] = {}
        for actor, lease, _, entry, tokens in kept:
            if actor in failed:
                dropped += 1  # every result of an Actor that failed in this batch goes
                continue
            self._batch_tokens += tokens
            trained[actor] = trained.get(actor, 0) + 1
            out.append((entry, actor, lease))
        self._batch_verify["dropped_results"] = dropped
        # Whose results the step trains on ("actor:count,..."; a short string, as the
        # observers' stats carry it), for the experiment's count of what a cheater got in.
        shares = ",".join(f"{a}:{n}" for a, n in sorted(trained.items()))
        if len(shares) <= 1000:
            self._batch_verify["trained_from"] = shares
        # A deterministic order: the same batch trains to the same bytes after any restart.
        out.sort(key=lambda t: t[0][0])
        self._batch_owners = [(actor, lease) for _, actor, lease in out]
        return [entry for entry, _, _ in out]

    def _plan(self, actor: str, lease: str, payload: bytes, fraction: object) -> Plan:
        """What to do with an admitted result: the Ledger says the share of its Actor's results
        to check (None: drop them), the verification key's coin which ones
        (:func:`aurora.policy.verification.plan`). A share that is missing or not a number in
        [0, 1] (a Ledger bug) checks the result: never trained unchecked by mistake."""
        if fraction is None:
            return Plan.DROP
        if self.verification is None:
            return Plan.TRAIN
        share = 1.0
        if isinstance(fraction, int | float) and not isinstance(fraction, bool):
            share = float(fraction) if 0.0 <= fraction <= 1.0 else 1.0  # NaN fails: checked
        return plan(self._verify_key, share, actor, lease, payload_digest(payload))

    def _refuse(self, r: object, why: str) -> None:
        """Note a refused result of the batch (one strike for its Actor, told with the step),
        when it names an Actor and a lease (a result that does not is junk no Actor sent)."""
        if not isinstance(r, dict):
            return
        actor, lease = r.get("actor"), r.get("lease")
        if isinstance(actor, str) and isinstance(lease, str) and actor and lease:
            self._refusals.append((actor[:MAX_ID], lease[:MAX_ID], _printable(why)))

    async def _verify(
        self, kept: list[tuple[str, str, bool, tuple[int, bytes, int], int]]
    ) -> set[str]:
        """Recompute the results :meth:`_plan` marked ``check`` under their claimed
        version's weights (:meth:`~aurora.runtime.rlbackend.RLTrainer.recompute`), judge each
        with the job's rule (:func:`aurora.policy.verification.judge`) and tell the Ledger
        every measure (it decides, durably: ``ResultVerified``); return the Actors whose
        result failed (the Ledger excludes them; none of their results of this batch is
        trained). An Actor's further results are not checked once one failed."""
        assert self.compute is not None and self.channel is not None
        cfg = self.verification
        assert cfg is not None
        todo = [k for k in kept if k[2]]
        t0 = time.perf_counter()
        # Which completions of each checked result (the payload decoded against the job's
        # group size already; counted again here so that a job without one works too).
        picks = [
            pick_completions(
                cfg,
                self._verify_key,
                actor,
                lease,
                payload_digest(entry[1]),
                len(msgpack.unpackb(entry[1])["completions"]),
            )
            for actor, lease, _, entry, _ in todo
        ]
        # Each checked token's rank under pi_v too (aurora.policy.sampling), its V keyed by
        # the result: the same after a restart.
        recomputed = await asyncio.to_thread(
            self.compute.recompute,  # type: ignore[attr-defined]
            [k[3] for k in todo],
            picks,
            keys=[f"{actor}|{lease}" for actor, lease, _, _, _ in todo],
            secret=self._verify_key,
        )
        failed: set[str] = set()
        checked = unverifiable = 0
        for (actor, lease, _, entry, _), pair in zip(todo, recomputed, strict=True):
            if pair is None:
                unverifiable += 1  # its version's weights are not kept (after a restart)
                continue
            if actor in failed:
                continue
            m = measure(*pair)
            checked += 1
            # The Actor's rank sums over its checks (the Ledger keeps the durable ones; these
            # start over after a restart, and the Ledger's exclusion drops its next results).
            before = self._ranks.get(actor, RankStats())
            self._ranks[actor] = before.merge(m.ranks)
            if judge(m, cfg, before) is not None:
                failed.add(actor)
                log.warning(
                    "trainer: %s's result for %s fails verification on v%d (max %.3g, mean "
                    "%.3g, min log-prob %.3g nats; rank z %.2f over %d tokens)",
                    actor,
                    lease,
                    entry[2],
                    m.max_delta,
                    m.mean_delta,
                    m.min_logprob,
                    self._ranks[actor].z,
                    self._ranks[actor].tokens,
                )
            await self.channel.send(
                {
                    "op": "verified",
                    "actor": actor,
                    "lease": lease,
                    "version": entry[2],
                    "max_delta": m.max_delta,
                    "mean_delta": m.mean_delta,
                    "min_logprob": m.min_logprob,
                    "tokens": m.tokens,
                    "rank_tokens": m.ranks.tokens,
                    "rank_shift": m.ranks.shift,
                    "rank_spread": m.ranks.spread,
                }
            )
        self._batch_verify = {
            "verify_s": time.perf_counter() - t0,
            "verified": checked,
            "verify_failed": len(failed),
            "unverifiable": unverifiable,
            # What the check keeps beyond the Trainer's own weights (bytes).
            "verify_kept_bytes": self.compute.verification_bytes(),  # type: ignore[attr-defined]
        }
        return failed

    def _check_result(self, r: object) -> tuple[ResultPayload, int] | str:
        """One admitted result of a batch, decoded and checked against its lease (prompt and
        task index), the job (group size, tokens, vocabulary, end of sequence, plausible
        log-probs: the Ledger's check before admission) and the lag bound; why, with one log
        line, when it is refused. Before, the Trainer unpacked payloads unchecked: one admitted
        result with the payload ``{"index": 0}`` raised KeyError and killed the Trainer (and
        the Ledger inside it), and again after every restart, since it fetched the same
        batch. A refused result is left out of the step: the rest of the batch trains."""
        assert self.compute is not None
        spec = self.spec
        try:
            if not isinstance(r, dict):
                raise MessageError(Why.NOT_A_MAP, "batch.results[]", type(r).__name__)
            prompt = Str(MAX_ID).check(r.get("prompt"), "batch.results[].prompt")
            now = getattr(self.compute, "version", None)
            lag = spec.strategy.max_lag
            version = (
                Int().check(r.get("version"), "batch.results[].version")
                if not isinstance(now, int)
                else Int(max(0, now - lag), now).check(r.get("version"), "batch.results[].version")
            )
            body = Blob(MAX_PAYLOAD).check(r.get("payload"), "batch.results[].payload")
            try:
                index = task_index(prompt, spec.prompts_per_step)
            except ValueError:
                raise MessageError(Why.WRONG_TYPE, "batch.results[].prompt", prompt) from None
            payload = decode_result_payload(
                body,
                prompt=prompt,
                index=index,
                group_size=spec.group_size or None,
                max_new_tokens=spec.max_new_tokens or None,
                vocab_size=getattr(self.compute, "vocab_size", None),
                eos_ids=getattr(self.compute, "eos_ids", None),
            )
        except MessageError as exc:
            who = r.get("actor") if isinstance(r, dict) else None
            log.warning(
                "trainer: refused a result from %s (lease %s): %s",
                str(who)[:MAX_ID],
                str(r.get("lease") if isinstance(r, dict) else None)[:MAX_ID],
                exc,
            )
            return str(exc)
        return payload, version

    async def _step(self, k: int, results: list[tuple[int, bytes, int]], meta: dict) -> int:
        assert self.compute is not None and self.node is not None and self.channel is not None
        spec = self.spec
        t0 = time.time()
        stats = await asyncio.to_thread(self.compute.train, results)
        t1 = time.time()
        # The step guard's dropped results and the payloads refused at fetch: each one strike
        # for its Actor at the Ledger (the policy counts them up to exclusion).
        why = str(stats.get("refused") or "the step guard")
        for i in stats.get("dropped") or ():
            if 0 <= int(i) < len(self._batch_owners):
                actor, lease = self._batch_owners[int(i)]
                self._refusals.append((actor, lease, _printable(why)))
                log.warning(
                    "trainer: left %s's result for %s out of step %d: %s", actor, lease, k, why
                )
        for actor, lease, reason in self._refusals:
            await self.channel.send(
                {"op": "refused", "actor": actor, "lease": lease, "why": reason}
            )
        refused_step = len(self._refusals)
        self._refusals = []
        if self.compute.version != k - 1:
            raise RuntimeError(f"the Trainer's compute is at v{self.compute.version}, not v{k - 1}")
        queue, done = _publish_in_thread(self.compute, asyncio.get_running_loop())
        signed: bytes | None = None
        while True:
            seg = await queue.get()
            if seg is None:
                break
            if isinstance(seg, BaseException):
                raise seg
            signed = await self.node.publish(k, [seg]) or signed
        pub = await done
        t2 = time.time()
        assert signed is not None and pub.version == k
        self.announcements[k] = signed
        data = pub.data
        await asyncio.to_thread(lambda: self.store.publish_delta(data, announcement=signed))
        self.hashes[k] = pub.weights_hash
        snapshot_bytes = None
        if k % spec.snapshot_interval == 0:
            compute = self.compute  # as narrowed here: a lambda does not keep the narrowing
            await asyncio.to_thread(
                lambda: self.store.publish_snapshot(
                    k,
                    compute.published(),
                    chain_hash=self.hashes[k],
                    signing_key=self.run.signing_key,
                    model=compute.model_files,
                )
            )
            snapshot_bytes = self.store.size_of("snapshot", k)
        digest = None
        if digest_due(self.spec, k):
            digest = await asyncio.to_thread(self.compute.digest)
        dense = sum(a.nbytes for a in self.compute.published().values())
        nnz, numel = pub.changed, pub.total
        step = {
            **{k2: v2 for k2, v2 in stats.items() if isinstance(v2, int | float | str)},
            "train_s": t1 - t0,
            "extract_s": t2 - t1,
            "delta_bytes": len(data),
            "dense_bytes": dense,
            "density": nnz / numel if numel else 0.0,
            "batch_versions": sorted({r[2] for r in results}),
            "results": len(results),
            "tokens": self._batch_tokens,
            "refused_results": self._batch_refused,
            "refusals_reported": refused_step,
            **self._batch_verify,
            "time": t2,
        }
        meta["version"] = k
        meta.setdefault("steps", {})[str(k)] = step
        self._forget_before(k, meta)
        t3 = time.time()
        await asyncio.to_thread(self._log_step, k, step)
        await asyncio.to_thread(self._save, meta)
        # The runtime's own time on the Trainer's critical path after extraction (s): the store
        # write (and snapshot, digest), then the checkpoint that must precede the announcement.
        step = {**step, "store_s": t3 - t2, "checkpoint_s": time.time() - t3}
        await self._announce(k, step, digest=digest, delta_bytes=len(data), snap=snapshot_bytes)
        self.probe.at_step(k)
        return k

    async def _announce(
        self,
        v: int,
        stats: dict[str, Any],
        *,
        digest: str | None = None,
        delta_bytes: int | None = None,
        snap: int | None = None,
    ) -> None:
        assert self.channel is not None and self.compute is not None
        if v == 0:
            snap = self.store.size_of("snapshot", 0)
        elif delta_bytes is None:  # a re-announcement: the sizes come from the store
            delta_bytes = self.store.size_of("delta", v)
            if snap is None:
                snap = self.store.size_of("snapshot", v)  # a restarted Ledger plans from it
        if digest is None and v == self.compute.version and digest_due(self.spec, v):
            digest = await asyncio.to_thread(self.compute.digest)
        signed = self.announcements.get(v)
        if signed is None and v > 0:
            signed = await asyncio.to_thread(self.store.announcement, v)
        # v0 has no delta: the Ledger believes h(0) from the signed snapshot announcement.
        snapshot_signed = (
            await asyncio.to_thread(self.store.announcement, 0, "snapshots") if v == 0 else None
        )
        weights_hash = self._hash_of(v, signed)
        await self.channel.send(
            {
                "op": "published",
                "version": v,
                "announcement": signed,
                "snapshot_announcement": snapshot_signed,
                "weights_hash": weights_hash,
                "digest": digest,
                "delta_bytes": delta_bytes,
                "snapshot_bytes": snap,
                "stats": stats,
            }
        )
        if v > 0:
            await self.channel.send({"op": "stats", "version": v, **stats})

    async def _finish(self, meta: dict[str, Any]) -> None:
        assert self.compute is not None and self.channel is not None
        if "reward_last" not in meta:
            meta["reward_last"] = await asyncio.to_thread(self.compute.evaluate)
            export = self.dir / "model"
            await asyncio.to_thread(self.compute.export, str(export))
            if (export / "config.json").exists():  # a Hugging Face model: signed, every file
                from aurora.models import sign_model_dir

                await asyncio.to_thread(
                    sign_model_dir,
                    export,
                    job=self.spec.job_id,
                    version=self.compute.version,
                    chain_hash=self.hashes[self.compute.version],
                    signing_key=self.run.signing_key,
                )
            meta["exported"] = str(export)
            await asyncio.to_thread(self._save, meta)
        await self.channel.send(
            {
                "op": "finished",
                "reward_first": meta.get("reward_first"),
                "reward_last": meta.get("reward_last"),
            }
        )
        # Give the Ledger a moment to tell everyone to stop before this process goes away.
        await asyncio.sleep(0.2)


def _printable(why: str) -> str:
    """A reason as the ``refused`` message carries it (printable, at most 200 characters)."""
    return "".join(c if c.isprintable() else "?" for c in why[:200])


def ledger_config(
    spec: JobSpec, log_path: str, *, stats_path: str | None = None
) -> LedgerServiceConfig:
    """The Ledger's configuration for a job spec."""
    from aurora.policy.leases import LeaseConfig
    from aurora.policy.ledger import LedgerConfig

    strat = spec.strategy
    return LedgerServiceConfig(
        policy=LedgerConfig(
            trainer_region=spec.trainer_region,
            lease=LeaseConfig(initial_s=spec.lease_initial_s),
            max_lag=strat.max_lag,
            relays=strat.relays,
            verification=verification_config(spec),
        ),
        log_path=log_path,
        staging_grace_s=strat.staging_grace_s,
        stats_path=stats_path,
    )
