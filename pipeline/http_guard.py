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
nothing, ``/healthz`` included. :class:`GuardedSite` serves an aiohttp runner's
``server`` (its public protocol factory; nothing private of aiohttp is touched)
from its own accept loop (:class:`GuardedListener`) through
:class:`ConnectionGuard`, which wraps each connection's protocol:

* an accepted socket that has sent nothing is only watched for bytes
  (:class:`WaitingSocket`); aiohttp's protocol is made when it speaks, so silent
  sockets are cheap to hold and to close;
* at ``max_connections`` (or at ``max_connections_per_client`` from one client
  address) a new connection that has sent bytes takes the place of the oldest
  connection (of that address) that has not completed a request head: idle
  sockets are shed before useful ones, and a health probe gets in however many
  silent sockets a flood holds. A newcomer still silent displaces only a
  connection silent for a second or more; otherwise it waits, uncounted, up to
  half a second (64 at most) for its first bytes, so a flood cannot churn the
  slots it holds. When every connection has sent a request, the new one is
  closed as soon as it is accepted, before any transport is made, so its
  descriptor is free again at once and the process never runs out of
  descriptors because of HTTP clients;
* the accept queue is deep (4096, capped by ``net.core.somaxconn``): under a
  flood a probe's connection waits its turn there, drained quickly, instead of
  having its SYN dropped and retried a second later;
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

    def __init__(self, site: GuardedSite, inner: asyncio.Protocol, client: str, waited: float = 0.0) -> None:
        self._site = site
        # Seconds it already waited for its first bytes: they count against its first head.
        self._waited = waited
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
        self._site.awaiting_head[self] = self._site._clock()
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
            delay, self._waited = max(0.0, self._site.header_timeout - self._waited), 0.0
            self._timer = loop.call_later(delay, self._header_timeout)

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


class WaitingSocket:
    """An accepted socket that has sent nothing yet: watched for bytes, no transport made.

    A flood of silent sockets is cheap to hold and to evict this way (one reader
    registration each); aiohttp's protocol, buffers and timers are made only for a
    socket that speaks. On ``probation`` it is not counted yet: it arrived silent
    while every slot was taken, and gets one only if it speaks within
    :data:`PROBATION_SECONDS` (displacing a silent connection); otherwise it is closed.
    """

    __slots__ = ("_listener", "_timer", "client", "conn", "probation", "since")

    def __init__(self, listener: GuardedListener, conn: socket.socket, client: str, probation: bool) -> None:
        self._listener = listener
        self.conn = conn
        self.client = client
        self.probation = probation
        site = listener._site
        self.since = site._clock()
        loop = listener._loop
        if probation:
            site.probation[self] = None
            timeout = PROBATION_SECONDS
        else:
            site.awaiting_head[self] = site._clock()
            timeout = site.header_timeout
        conn.setblocking(False)
        loop.add_reader(conn.fileno(), self._readable)
        self._timer: asyncio.TimerHandle | None = loop.call_later(timeout, self._timeout)

    def _stop_watching(self) -> None:
        self._listener._loop.remove_reader(self.conn.fileno())
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _readable(self) -> None:
        try:
            first = self.conn.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            first = b""
        if not first:  # the client left without a word
            self.drop()
            return
        site = self._listener._site
        if self.probation:
            if not site.make_room(self.client):
                self.refuse()
                return
            site.probation.pop(self, None)
            site.admit(self.client)
        else:
            # Still without a complete head: the ConnectionGuard takes over that place.
            site.awaiting_head.pop(self, None)
        self._stop_watching()
        waited = 0.0 if self.probation else site._clock() - self.since
        self._listener.serve(self.conn, self.client, waited)

    def _timeout(self) -> None:
        self._timer = None
        if self.probation:
            self.refuse()
        else:
            self._listener._site.stats.timed_out += 1
            self.drop()

    def refuse(self) -> None:
        """A newcomer on probation that got no slot: closed and counted as refused."""
        site = self._listener._site
        site.stats.refused += 1
        site.report_refusal()
        self.drop()

    def evict(self) -> None:
        self.drop()

    def drop(self) -> None:
        """Close it and uncount it."""
        self._stop_watching()
        if self.probation:
            self._listener._site.probation.pop(self, None)
        else:
            self._listener._site.release(self)
        self.conn.close()


# accept() errors that mean "out of descriptors or memory": wait for some to be freed.
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# Connections taken per readiness event, so one burst cannot starve the loop.
_ACCEPT_BATCH = 64
_ACCEPT_RETRY_DELAY = 1.0
_BACKLOG = 4096
# Seconds a silent connection is safe from a newcomer that is silent too.
SILENT_DISPLACES_AFTER = 1.0
# A silent newcomer finding every slot taken waits this long, uncounted, to speak;
# at most this many wait at once (the oldest is closed for the next).
PROBATION_SECONDS = 0.5
_PROBATION_SOCKETS = 64


class GuardedListener:
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
            speaking = True
            if self._site.full(client):
                conn.setblocking(False)
                try:
                    speaking = bool(conn.recv(1, socket.MSG_PEEK))
                    if not speaking:  # gone already
                        conn.close()
                        continue
                except (BlockingIOError, InterruptedError):
                    speaking = False
                except OSError:
                    conn.close()
                    continue
            if not self._site.make_room(client, speaking):
                if not speaking:
                    self._probation(conn, client)
                    continue
                # Closed before any transport exists: the descriptor is free now.
                conn.close()
                stats.refused += 1
                self._site.report_refusal()
                continue
            self._site.admit(client)
            WaitingSocket(self, conn, client, probation=False)

    def _probation(self, conn: socket.socket, client: str) -> None:
        """Hold a silent newcomer uncounted for a moment; the oldest held one makes way when full."""
        probation = self._site.probation
        if len(probation) >= _PROBATION_SOCKETS:
            next(iter(probation)).refuse()
        WaitingSocket(self, conn, client, probation=True)

    def serve(self, conn: socket.socket, client: str, waited: float) -> None:
        """Hand a socket that has sent its first bytes to aiohttp (through a :class:`ConnectionGuard`)."""
        task = self._loop.create_task(self._serve(conn, client, waited))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: socket.socket, client: str, waited: float) -> None:
        protocol = ConnectionGuard(self._site, self._factory(), client, waited)
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

    def close(self) -> None:
        """Stop accepting; close the listening socket and the sockets still silent."""
        if not self._serving:
            return
        self._serving = False
        if self._retry is not None:
            self._retry.cancel()
        else:
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        waiting = [c for c in self._site.awaiting_head if isinstance(c, WaitingSocket)]
        for held in [*waiting, *self._site.probation]:
            held.drop()


class GuardedSite:
    """A runner's server on a bound socket, its connections going through :class:`ConnectionGuard`.

    Not an aiohttp site: it uses only the runner's public ``server`` (the protocol
    factory), so whoever starts it stops it (:meth:`stop`) before ``runner.cleanup()``.
    """

    def __init__(
        self,
        runner: web.BaseRunner,
        sock: socket.socket,
        *,
        max_connections: int,
        header_timeout: float,
        max_connections_per_client: int | None = None,
        log_interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if runner.server is None:
            raise RuntimeError("call runner.setup() before making a GuardedSite")
        self.server: web.Server = runner.server
        self.sock = sock
        self.max_connections = max_connections
        self.max_per_client = min(max_connections_per_client or max_connections, max_connections)
        self.header_timeout = header_timeout
        self.log_interval = log_interval
        self.stats = ConnectionStats()
        self._clock = clock
        self._listener: GuardedListener | None = None
        # Connections yet to complete their first request head, oldest first, with the
        # time each came in.
        self.awaiting_head: dict[ConnectionGuard | WaitingSocket, float] = {}
        # Silent newcomers waiting, uncounted, for a slot they may take once they speak.
        self.probation: dict[WaitingSocket, None] = {}
        self.per_client: dict[str, int] = {}

    def full(self, client: str) -> bool:
        """Whether a new connection from ``client`` needs room made for it."""
        return (
            self.stats.open >= self.max_connections or self.per_client.get(client, 0) >= self.max_per_client
        )

    def make_room(self, client: str, speaking: bool = True) -> bool:
        """Whether a new connection from ``client`` fits, evicting an idle one if it must.

        At the per-client cap the oldest of that client's connections without a
        request head goes; at the global cap the oldest of anyone's. A newcomer
        that has sent nothing yet displaces only a connection silent for
        :data:`SILENT_DISPLACES_AFTER` seconds or more: a flood of silent sockets
        then cannot churn the slots it holds, while a client that speaks always
        gets in. False when there is none to evict.
        """
        min_age = 0.0 if speaking else SILENT_DISPLACES_AFTER
        if self.per_client.get(client, 0) >= self.max_per_client and not self._evict(client, min_age):
            return False
        return self.stats.open < self.max_connections or self._evict(None, min_age)

    def _evict(self, client: str | None, min_age: float) -> bool:
        victim = next((c for c in self.awaiting_head if client is None or c.client == client), None)
        if victim is None or self._clock() - self.awaiting_head[victim] < min_age:
            return False
        victim.evict()
        self.stats.evicted += 1
        self.report_refusal(evicted=True)
        return True

    def admit(self, client: str) -> None:
        self.stats.open += 1
        self.stats.accepted += 1
        self.per_client[client] = self.per_client.get(client, 0) + 1

    def release(self, connection: ConnectionGuard | WaitingSocket) -> None:
        """Uncount a connection that closed, was evicted or never connected."""
        self.stats.open -= 1
        self.awaiting_head.pop(connection, None)
        left = self.per_client.get(connection.client, 0) - 1
        if left > 0:
            self.per_client[connection.client] = left
        else:
            self.per_client.pop(connection.client, None)

    async def start(self) -> None:
        """Listen and accept through this module's accept loop instead of asyncio's."""
        # A deep accept queue: under a flood, a probe's connection waits its turn in the
        # queue (the loop drains it fast, evicting) instead of having its SYN dropped and
        # retried a second later. The kernel caps it at net.core.somaxconn.
        self.sock.listen(_BACKLOG)
        self._listener = GuardedListener(self, self.sock, self.server)
        self._listener.start()

    async def stop(self) -> None:
        """Stop accepting and close the connections still waiting for their first bytes.

        Connections being served are the runner's to close (``runner.cleanup()``).
        """
        if self._listener is not None:
            self._listener.close()
            self._listener = None

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
