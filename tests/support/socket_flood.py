"""A flood of idle TCP sockets that re-opens each one the server closes (a thread of its own).

:class:`SocketFlood` holds ``count`` connections to ``port`` from the given loopback
source addresses (Linux routes all of 127.0.0.0/8 to the loopback device), sends
nothing on them, and opens a new one as soon as the server closes one, as an
attacker keeping a server's connection slots full would.
"""

from __future__ import annotations

import errno
import selectors
import socket
import threading

__all__ = ["SocketFlood"]


class SocketFlood:
    """``count`` silent connections to 127.0.0.1:``port``, spread over ``sources``, kept open."""

    def __init__(self, port: int, count: int, sources: list[str]) -> None:
        self.port, self.count, self.sources = port, count, sources
        self.reopened = 0
        self._selector = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="socket-flood", daemon=True)

    def _open(self, index: int) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.bind((self.sources[index % len(self.sources)], 0))
        code = sock.connect_ex(("127.0.0.1", self.port))
        if code not in (0, errno.EINPROGRESS):
            sock.close()
            return
        self._selector.register(sock, selectors.EVENT_READ, index)

    @property
    def held(self) -> int:
        """Sockets open (connected or connecting) now."""
        return len(self._selector.get_map())

    def _run(self) -> None:
        for index in range(self.count):
            self._open(index)
        while not self._stop.is_set():
            for key, _ in self._selector.select(0.1):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if data:
                    continue
                # Closed by the server (or refused): open another in its place.
                self._selector.unregister(sock)
                sock.close()
                self.reopened += 1
                self._open(key.data)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()

    def __enter__(self) -> SocketFlood:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10.0)
