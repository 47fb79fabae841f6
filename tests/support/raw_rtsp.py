"""A raw TCP server on loopback standing in for a camera: it records every byte it receives.

:class:`RawListener` accepts connections on a free loopback port, keeps what each
connection sent, splits it into RTSP requests (request line, headers, body by
``Content-Length``) and answers each with what ``answer`` returns for it (nothing:
stay silent). Tests use it to see exactly what vidpipe sends to a camera, and to
play a hostile camera (a 302 to another host).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["RawListener", "RtspRequest", "parse_requests", "reply"]


@dataclass
class RtspRequest:
    """One request as it arrived: the request line, its headers in order, the body."""

    line: str
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""

    @property
    def method(self) -> str:
        return self.line.split(" ", 1)[0]

    @property
    def target(self) -> str:
        parts = self.line.split(" ")
        return parts[1] if len(parts) > 1 else ""

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)


def parse_requests(data: bytes) -> tuple[list[RtspRequest], bytes]:
    """The complete requests in ``data`` and the incomplete rest."""
    out: list[RtspRequest] = []
    while b"\r\n\r\n" in data:
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        request = RtspRequest(lines[0])
        for raw in lines[1:]:
            name, sep, value = raw.partition(":")
            # A line that is not "Name: value" is kept as it is, for the test to fail on.
            request.headers.append((name, value.strip()) if sep else (raw, "\x00malformed"))
        length = int(request.header("Content-Length") or 0)
        if len(rest) < length:
            break
        request.body, data = rest[:length], rest[length:]
        out.append(request)
    return out, data


Answer = Callable[[RtspRequest], bytes | None]


class RawListener:
    """A loopback TCP listener that records what arrives and answers RTSP requests."""

    def __init__(self, answer: Answer | None = None) -> None:
        self.answer = answer
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self._sock.settimeout(0.1)
        self.port: int = self._sock.getsockname()[1]
        self.connections = 0
        self.received = bytearray()
        self.requests: list[RtspRequest] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accepter = threading.Thread(target=self._accept, name=f"raw-listener-{self.port}", daemon=True)

    def __enter__(self) -> RawListener:
        self._accepter.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        self._accepter.join(2.0)
        for t in self._threads:
            t.join(2.0)
        self._sock.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.connections += 1
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        pending = b""
        conn.settimeout(0.1)
        with conn:
            while not self._stop.is_set():
                try:
                    chunk = conn.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not chunk:
                    return
                with self._lock:
                    self.received.extend(chunk)
                requests, pending = parse_requests(pending + chunk)
                for request in requests:
                    with self._lock:
                        self.requests.append(request)
                    reply = self.answer(request) if self.answer is not None else None
                    if reply:
                        try:
                            conn.sendall(reply)
                        except OSError:
                            return


def reply(request: RtspRequest, status: str, *headers: str) -> bytes:
    """An RTSP response to ``request`` (its CSeq echoed) with ``headers``."""
    lines = [f"RTSP/1.0 {status}", f"CSeq: {request.header('CSeq') or '0'}", *headers, "Content-Length: 0"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()
