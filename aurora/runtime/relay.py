"""A standalone relay process: one per remote region, receives each delta once, fans it out.

Theory of operation
-------------------
A relay is a data-plane node (:class:`aurora.transport.Node`) that subscribes to the Trainer
(its sources: the Trainer, then any peer relay the Ledger names) and serves the Actors of its
region, forwarding every verified segment the moment it has it (cut-through). It registers with
the Ledger (``RelayJoined``), which routes the region's Actors to it; if it dies, the Ledger
notices the dropped connection and re-routes them (``RelayLost`` → ``FallBack``), and the
Actors' nodes fall back to their next source on their own meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from aurora.jobspec import JobSpec
from aurora.keys import Identity
from aurora.observe.exporter import serve as observe_serve
from aurora.observe.node import NodeCollector
from aurora.runtime import hooks, hopreport
from aurora.runtime.channel import Channel, IdentityRefused, connect
from aurora.runtime.job import transport_config
from aurora.runtime.messages import Direction
from aurora.transport import Node

log = logging.getLogger("aurora.runtime.relay")


@dataclass(frozen=True, kw_only=True)
class RelayRun:
    """Where and how one relay process runs."""

    id: str
    """Relay id."""
    region: str
    """Region it serves."""
    ledger: tuple[str, int]
    """The Ledger's control address."""
    secret: bytes
    """The job secret."""
    public_key: bytes
    """The job's public key (announcements are verified before anything is forwarded)."""
    identity: Identity | Callable[[], Identity] | None = None
    """Its identity (``aurora keys issue --role relay``): the Ledger accepts its id only with
    it, and it accepts only a Ledger the job key certified for its job. A callable
    (:class:`aurora.keys.IdentityFile`) is asked at every connection (a renewed file is used
    without a restart). None only against a control server that checks nothing."""
    host: str = "127.0.0.1"
    """Address its data-plane node listens on."""
    port: int = 0
    """Data-plane port (0: any free port)."""
    advertise: str | None = None
    """Address the region's Actors reach it at (None: ``host``)."""
    connect_timeout_s: float = 30.0
    """How long to keep trying to reach the Ledger (s)."""
    metrics_port: int | None = None
    """Serve ``/metrics`` (its node's counters) on this port; None: off."""
    metrics_host: str = "127.0.0.1"
    """Address ``/metrics`` listens on (this host only by default)."""


class RelayProcess:
    def __init__(self, run: RelayRun) -> None:
        self.run = run
        self.node: Node | None = None
        self.job: JobSpec | None = None
        self.sources: dict[str, str] = {}
        self._channel: Channel | None = None
        self._hops: asyncio.Task[None] | None = None

    async def _connect(self) -> Channel:
        deadline = time.monotonic() + self.run.connect_timeout_s
        hello = {"id": self.run.id, "role": "relay", "region": self.run.region}
        while True:
            ident = self.run.identity
            try:
                return await connect(
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

    async def main(self) -> int:
        if self.run.metrics_port is not None:  # docs/OBSERVABILITY.md
            self.metrics_server, _ = await observe_serve(
                [NodeCollector(lambda: self.node)], self.run.metrics_host, self.run.metrics_port
            )
        channel = self._channel = await self._connect()
        while True:
            try:
                msg = await channel.recv_checked(Direction.LEDGER_TO_PEER)
            except ConnectionError:
                log.warning("%s: lost the Ledger; reconnecting", self.run.id)
                channel = self._channel = await self._connect()
                if self.node is not None:
                    channel.send_nowait({"op": "data", "addr": self._addr})
                continue
            op = msg.get("op")
            if op == "welcome":
                self.sources.update({k: v for k, v in (msg.get("sources") or {}).items() if v})
                if msg.get("job") is not None and self.node is None:
                    self.job = JobSpec.decode(msg["job"])
                    await self._start(channel)
            elif op == "announce" and self.node is not None:
                try:
                    self.node.announce(bytes(msg["data"]))
                except Exception as exc:  # refused, never fatal
                    log.warning("%s: refused an announcement: %s", self.run.id, exc)
            elif op == "stop":
                break
        if self._hops is not None:
            self._hops.cancel()
            await asyncio.sleep(0)  # its last report goes out on the channel before it closes
        if self.node is not None:
            await self.node.close()
        channel.close()
        return 0

    async def _start(self, channel: Channel) -> None:
        assert self.job is not None
        config = transport_config(
            self.job,
            secret=self.run.secret,
            public_key=self.run.public_key,
            overrides=hooks.node_config_overrides(),
        )
        trainer = self.sources.get("trainer") or self.job.trainer_data
        if trainer is None:
            raise ValueError("the job names no Trainer data-plane address")
        host, port = trainer.rsplit(":", 1)
        self.node = hooks.node_class()(self.run.id, config, sources=[(host, int(port))])
        self._hops = asyncio.create_task(
            hopreport.report(
                lambda: self.node.metrics if self.node else None,
                lambda msg: self._channel.send_nowait(msg) if self._channel else None,
            )
        )
        port_bound = await self.node.serve(self.run.host, self.run.port)
        self._addr = f"{self.run.advertise or self.run.host}:{port_bound}"
        channel.send_nowait({"op": "data", "addr": self._addr})
        try:
            await self.node.subscribe()
        except ConnectionError as exc:  # it keeps reconnecting in the background
            log.warning("%s: %s", self.run.id, exc)
        log.info("%s: relaying %s from %s on %s", self.run.id, self.run.region, trainer, self._addr)
