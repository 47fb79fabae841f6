"""Connection limits for the HTTP server: a cap on open connections and a header-read deadline.

::

    http:
      listen: 127.0.0.1:8080
      max_connections: 256      # open connections at once
      max_connections_per_client: 64   # open connections from one client address
      header_timeout: 10.0      # seconds a client has to send a request's headers
      keepalive_timeout: 15.0   # seconds an idle keep-alive connection stays open

aiohttp on its own keeps an idle connection for an hour and has no deadline for
the request line and headers, so a few thousand silent sockets (or one client
trickling a header byte a second) hold descriptors until the process can accept
nothing, ``/healthz`` included. :class:`GuardedSite` serves the same aiohttp
runner from its own accept loop (:class:`GuardedListener`) through
:class:`ConnectionGuard`, which wraps each connection's protocol:

* at ``max_connections`` (or at ``max_connections_per_client`` from one client
  address) a new connection takes the place of the oldest connection (of that
  address) that has not completed a request head yet: idle sockets are shed
  before useful ones, and a health probe always gets in, however many silent
  sockets a flood holds. When every connection has sent a request, the new one
  is closed as soon as it is accepted, before any transport is made, so its
  descriptor is free again at once and the process never runs out of
  descriptors because of HTTP clients;
* a connection that has not sent a complete request head (``\\r\\n\\r\\n``) within
  ``header_timeout`` of connecting, or of its previous request head, is closed;
* if ``accept()`` fails for want of descriptors anyway (other parts of the process
  hold them), accepting pauses for a second; asyncio's own accept loop instead logs
  and reschedules itself once per pending connection, a flood of log lines;
* refusals are counted and logged at most once per ``log_interval`` seconds.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
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
    # Connections without a complete request head closed to make room for a new one.
    evicted: int = 0
    timed_out: int = 0
    # accept() failed for want of descriptors or memory (accepting paused each time).
    exhausted: int = 0
    _last_log: float = field(default=0.0, repr=False)
    _unlogged: int = field(default=0, repr=False)
    _unlogged_evicted: int = field(default=0, repr=False)


class ConnectionGuard(asyncio.Protocol):
    """One connection: admitted under the cap, then passed through to aiohttp's protocol."""

    def __init__(self, site: GuardedSite, inner: asyncio.Protocol, client: str) -> None:
        self._site = site
        self._inner = inner
        self.client = client
        self._transport: asyncio.Transport | None = None
        self._admitted = False
        # Evicted: already uncounted, and its connection_lost must not count again.
        self._evicted = False
        self._timer: asyncio.TimerHandle | None = None
        # The tail of the bytes seen since the last request head, to find "\r\n\r\n"
        # split across two reads.
        self._tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # The listener counted this connection in ``open`` when it accepted it.
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._admitted = True
        self._site.awaiting_head[self] = None
        self._inner.connection_made(transport)
        self._arm()

    def evict(self) -> None:
        """Close this connection (no request head yet) to admit a new one; uncount it now."""
        self._evicted = True
        self._site.release(self)
        if self._transport is not None:
            self._transport.abort()

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
            self._site.awaiting_head.pop(self, None)
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
        if not self._evicted:
            self._site.release(self)
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._admitted:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._admitted:
            self._inner.resume_writing()


# accept() errors that mean "out of descriptors or memory": wait for some to be freed.
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# Connections taken per readiness event, so one burst cannot starve the loop.
_ACCEPT_BATCH = 64
_ACCEPT_RETRY_DELAY = 1.0


class GuardedListener(asyncio.AbstractServer):
    """The accept loop on the bound socket: admits under the cap, closes the rest at once."""

    def __init__(
        self, site: GuardedSite, sock: socket.socket, factory: Callable[[], asyncio.Protocol]
    ) -> None:
        self._site = site
        self._sock = sock
        self._factory = factory
        self._loop = asyncio.get_running_loop()
        self._serving = False
        self._retry: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self._sock.setblocking(False)
        self._serving = True
        self._loop.add_reader(self._sock.fileno(), self._accept)

    def _accept(self) -> None:
        stats = self._site.stats
        for _ in range(_ACCEPT_BATCH):
            try:
                conn, address = self._sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                if exc.errno not in _EXHAUSTED:
                    raise
                stats.exhausted += 1
                self._site.report_refusal(f"accept failed: {exc.strerror}")
                # The listening socket stays readable; stop watching it for a while
                # instead of spinning on the same error.
                self._loop.remove_reader(self._sock.fileno())
                self._retry = self._loop.call_later(_ACCEPT_RETRY_DELAY, self._resume)
                return
            client = str(address[0]) if isinstance(address, tuple) else ""
            if not self._site.make_room(client):
                # Closed before any transport exists: the descriptor is free now.
                conn.close()
                stats.refused += 1
                self._site.report_refusal()
                continue
            self._site.admit(client)
            task = self._loop.create_task(self._serve(conn, client))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: socket.socket, client: str) -> None:
        protocol = ConnectionGuard(self._site, self._factory(), client)
        try:
            await self._loop.connect_accepted_socket(lambda: protocol, sock=conn)
        except (OSError, RuntimeError):
            # Never connected (peer gone, loop closing): connection_lost will not come.
            if not protocol._admitted:
                self._site.release(protocol)
            conn.close()

    def _resume(self) -> None:
        self._retry = None
        if self._serving:
            self._loop.add_reader(self._sock.fileno(), self._accept)

    # -- asyncio.AbstractServer, as aiohttp's site uses it ---------------------------------

    def close(self) -> None:
        if not self._serving:
            return
        self._serving = False
        if self._retry is not None:
            self._retry.cancel()
        else:
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def is_serving(self) -> bool:
        return self._serving

    async def start_serving(self) -> None:
        if not self._serving:
            self.start()

    async def serve_forever(self) -> None:
        while self._serving:
            await asyncio.sleep(3600)

    async def wait_closed(self) -> None:
        return None

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return (self._sock,) if self._serving else ()


class GuardedSite(web.SockSite):
    """An aiohttp site on a bound socket whose connections go through :class:`ConnectionGuard`."""

    def __init__(
        self,
        runner: web.BaseRunner,
        sock: Any,
        *,
        max_connections: int,
        header_timeout: float,
        max_connections_per_client: int | None = None,
        log_interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(runner, sock, backlog=max(128, min(max_connections, 1024)))
        self.max_connections = max_connections
        self.max_per_client = min(max_connections_per_client or max_connections, max_connections)
        self.header_timeout = header_timeout
        self.log_interval = log_interval
        self.stats = ConnectionStats()
        self._clock = clock
        # Connections yet to complete their first request head, oldest first.
        self.awaiting_head: dict[ConnectionGuard, None] = {}
        self.per_client: dict[str, int] = {}

    def make_room(self, client: str) -> bool:
        """Whether a new connection from ``client`` fits, evicting an idle one if it must.

        At the per-client cap the oldest of that client's connections without a
        request head goes; at the global cap the oldest of anyone's. False when
        there is none to evict.
        """
        if self.per_client.get(client, 0) >= self.max_per_client and not self._evict(client):
            return False
        return self.stats.open < self.max_connections or self._evict(None)

    def _evict(self, client: str | None) -> bool:
        victim = next((c for c in self.awaiting_head if client is None or c.client == client), None)
        if victim is None:
            return False
        victim.evict()
        self.stats.evicted += 1
        self.report_refusal(evicted=True)
        return True

    def admit(self, client: str) -> None:
        self.stats.open += 1
        self.stats.accepted += 1
        self.per_client[client] = self.per_client.get(client, 0) + 1

    def release(self, connection: ConnectionGuard) -> None:
        """Uncount a connection that closed, was evicted or never connected."""
        self.stats.open -= 1
        self.awaiting_head.pop(connection, None)
        left = self.per_client.get(connection.client, 0) - 1
        if left > 0:
            self.per_client[connection.client] = left
        else:
            self.per_client.pop(connection.client, None)

    async def start(self) -> None:
        # What SockSite.start does, with this module's accept loop instead of asyncio's.
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        self._sock.listen(self._backlog)
        listener = GuardedListener(self, self._sock, server)
        listener.start()
        self._server = listener

    def report_refusal(self, why: str = "", evicted: bool = False) -> None:
        """One log line per ``log_interval`` at most, however many connections are refused or evicted."""
        stats = self.stats
        now = self._clock()
        if evicted:
            stats._unlogged_evicted += 1
        else:
            stats._unlogged += 1
        if now - stats._last_log >= self.log_interval:
            log.warning(
                "HTTP: refused %d connection(s)%s and evicted %d without a request head: %d open,"
                " the limits are http.max_connections=%d, http.max_connections_per_client=%d",
                stats._unlogged,
                f" ({why})" if why else "",
                stats._unlogged_evicted,
                stats.open,
                self.max_connections,
                self.max_per_client,
            )
            stats._last_log = now
            stats._unlogged = 0
            stats._unlogged_evicted = 0


__all__ = ["ConnectionGuard", "ConnectionStats", "GuardedListener", "GuardedSite"]
