"""``/metrics`` over HTTP on a role's own event loop (prometheus_client's exposition, h11's HTTP).

Theory of operation
-------------------
Every role can serve its registry (prometheus_client's text format) at ``/metrics``; nothing
listens unless asked (``--metrics-port``), and the default address is 127.0.0.1. The server runs
on the role's asyncio loop rather than in prometheus_client's thread, so the collectors read the
role's state between two of its callbacks, never half changed. h11 parses the request (a
well-kept HTTP/1.1 state machine; requests are bounded at :data:`MAX_REQUEST` bytes). One
request per connection, at most :data:`MAX_CONNECTIONS` at once, each given
:data:`TIMEOUT_S`; a scrape made within :data:`MIN_INTERVAL_S` of the previous one gets the
previous body, so a client that scrapes without pause costs the role one exposition per
interval, not one per request. What is served is counts, times, versions and the ids the job
already names (Actors, regions, relays, reasons): never a key, a secret, a prompt or a
completion (a test scrapes every role of a run and checks each label against the job).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from typing import Any

import h11
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

MAX_REQUEST = 8 << 10
"""Most bytes of a request's head (the request line and headers)."""
MAX_CONNECTIONS = 8
"""Scrapes served at once; more are closed unanswered."""
TIMEOUT_S = 5.0
"""A connection that has not sent its request within this is closed (s)."""
MIN_INTERVAL_S = 0.2
"""Scrapes within this of the last exposition get the same body (s)."""
DEFAULT_HOST = "127.0.0.1"
"""Where ``/metrics`` listens unless told otherwise: this host only."""


def registry(collectors: Iterable[Any], *, process: bool = True) -> CollectorRegistry:
    """A registry of ``collectors`` (and the process's RSS, CPU and open files)."""
    reg = CollectorRegistry(auto_describe=False)
    if process:
        ProcessCollector(registry=reg)
    for c in collectors:
        reg.register(c)
    return reg


class MetricsServer:
    """``GET /metrics`` for one registry (module docstring)."""

    def __init__(self, reg: CollectorRegistry) -> None:
        self.registry = reg
        self._server: asyncio.Server | None = None
        self._open = 0
        self._body = b""
        self._made = -1e300
        self.scrapes = 0
        """Expositions made (cached bodies not counted)."""
        self.collect_s = 0.0
        """Seconds spent making them, on the role's event loop."""

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: any free port); returns the port."""
        self._server = await asyncio.start_server(self._handle, host, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)

    def body(self) -> bytes:
        """The exposition (made afresh at most every :data:`MIN_INTERVAL_S`)."""
        now = time.monotonic()
        if now - self._made >= MIN_INTERVAL_S:
            t0 = time.perf_counter()
            self._body = generate_latest(self.registry)
            self.collect_s += time.perf_counter() - t0
            self.scrapes += 1
            self._made = now
        return self._body

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= MAX_CONNECTIONS:
            writer.close()
            return
        self._open += 1
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST)
        try:
            request = await asyncio.wait_for(self._request(conn, reader), TIMEOUT_S)
            if request is None:
                return
            target = request.target.split(b"?", 1)[0]
            if request.method not in (b"GET", b"HEAD"):
                status, body, kind = 405, b"GET /metrics only\n", b"text/plain"
            elif target != b"/metrics":
                status, body, kind = 404, b"see /metrics\n", b"text/plain"
            else:
                status, body, kind = 200, self.body(), CONTENT_TYPE_LATEST.encode()
            await self._respond(conn, writer, status, body, kind, head=request.method == b"HEAD")
        except h11.RemoteProtocolError:
            with contextlib.suppress(Exception):
                await self._respond(conn, writer, 400, b"bad request\n", b"text/plain")
        except (TimeoutError, ConnectionError):
            pass
        finally:
            self._open -= 1
            writer.close()

    async def _request(
        self, conn: h11.Connection, reader: asyncio.StreamReader
    ) -> h11.Request | None:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(4096)
                conn.receive_data(data)  # b"" says the client closed
                continue
            if isinstance(event, h11.Request):
                return event
            return None  # closed before a request

    async def _respond(
        self,
        conn: h11.Connection,
        writer: asyncio.StreamWriter,
        status: int,
        body: bytes,
        kind: bytes,
        *,
        head: bool = False,
    ) -> None:
        headers = [
            (b"content-type", kind),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        writer.write(conn.send(h11.Response(status_code=status, headers=headers)))
        if not head:
            writer.write(conn.send(h11.Data(data=body)))
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()


async def serve(
    collectors: Iterable[Any], host: str, port: int, *, process: bool = True
) -> tuple[MetricsServer, int]:
    """Serve ``collectors`` at ``http://host:port/metrics``; returns the server and its port."""
    server = MetricsServer(registry(collectors, process=process))
    bound = await server.start(host, port)
    return server, bound
