"""Connection limits for the HTTP server: a cap on open connections and a header-read deadline.

::

    http:
      listen: 127.0.0.1:8080
      max_connections: 256      # open connections at once; the next one is closed at once
      header_timeout: 10.0      # seconds a client has to send a request's headers
      keepalive_timeout: 15.0   # seconds an idle keep-alive connection stays open

aiohttp on its own keeps an idle connection for an hour and has no deadline for
the request line and headers, so a few thousand silent sockets (or one client
trickling a header byte a second) hold descriptors until the process can accept
nothing, ``/healthz`` included. :class:`GuardedSite` serves the same aiohttp
runner through :class:`ConnectionGuard`, which wraps each connection's protocol:

* over ``max_connections`` a new connection is closed as soon as it is accepted,
  so the process never runs out of descriptors because of HTTP clients;
* a connection that has not sent a complete request head (``\\r\\n\\r\\n``) within
  ``header_timeout`` of connecting, or of its previous request head, is closed;
* refusals are counted and logged at most once per ``log_interval`` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

log = logging.getLogger("vidpipe.api")

_HEAD_END = b"\r\n\r\n"


@dataclass(slots=True)
class ConnectionStats:
    """Counters of the guard; ``open`` is the number of connections now being served."""

    open: int = 0
    accepted: int = 0
    refused: int = 0
    timed_out: int = 0
    _last_log: float = field(default=0.0, repr=False)
    _unlogged: int = field(default=0, repr=False)


class ConnectionGuard(asyncio.Protocol):
    """One connection: admitted under the cap, then passed through to aiohttp's protocol."""

    def __init__(self, site: GuardedSite, inner: asyncio.Protocol) -> None:
        self._site = site
        self._inner = inner
        self._transport: asyncio.Transport | None = None
        self._admitted = False
        self._timer: asyncio.TimerHandle | None = None
        # The tail of the bytes seen since the last request head, to find "\r\n\r\n"
        # split across two reads.
        self._tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        stats = self._site.stats
        if stats.open >= self._site.max_connections:
            stats.refused += 1
            self._site.report_refusal()
            # abort(): no lingering close, the descriptor is free at once.
            transport.abort()
            return
        stats.open += 1
        stats.accepted += 1
        self._admitted = True
        self._inner.connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        if self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self._site.header_timeout, self._header_timeout)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _header_timeout(self) -> None:
        self._timer = None
        self._site.stats.timed_out += 1
        if self._transport is not None:
            self._transport.abort()

    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            return
        seen = self._tail + data
        end = seen.rfind(_HEAD_END)
        if end >= 0:
            # A request head is complete; what follows may be a body or the next request.
            self._disarm()
            rest = seen[end + len(_HEAD_END) :]
            self._tail = rest[-3:]
            if rest:
                self._arm()
        else:
            self._tail = seen[-3:]
            self._arm()
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._admitted else None

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._admitted:
            return
        self._admitted = False
        self._disarm()
        self._site.stats.open -= 1
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._admitted:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._admitted:
            self._inner.resume_writing()


class GuardedSite(web.SockSite):
    """An aiohttp site on a bound socket whose connections go through :class:`ConnectionGuard`."""

    def __init__(
        self,
        runner: web.BaseRunner,
        sock: Any,
        *,
        max_connections: int,
        header_timeout: float,
        log_interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(runner, sock, backlog=max(128, min(max_connections, 1024)))
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.log_interval = log_interval
        self.stats = ConnectionStats()
        self._clock = clock

    async def start(self) -> None:
        # What SockSite.start does, with each connection's protocol wrapped.
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: ConnectionGuard(self, server()), sock=self._sock, backlog=self._backlog
        )

    def report_refusal(self) -> None:
        """One log line per ``log_interval`` at most, however many connections are refused."""
        stats = self.stats
        now = self._clock()
        stats._unlogged += 1
        if now - stats._last_log >= self.log_interval:
            log.warning(
                "HTTP: refused %d connection(s): %d open, the limit is http.max_connections=%d",
                stats._unlogged,
                stats.open,
                self.max_connections,
            )
            stats._last_log = now
            stats._unlogged = 0


__all__ = ["ConnectionGuard", "ConnectionStats", "GuardedSite"]
