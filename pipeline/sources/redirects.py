"""RTSP redirects: a camera may not send FFmpeg, with the source's credentials, to another host.

::

    sources:
      - id: gate
        url: rtsp://user:secret@10.0.0.7/stream1
        allow_redirects: false   # the default: a 3xx to another host or port fails the attempt

FFmpeg follows an RTSP 3xx answer by itself and keeps the credentials for the new
host, and has no option to stop it. So before FFmpeg opens a URL that carries
credentials, :func:`check_redirect` asks the camera itself: an ``OPTIONS`` and a
``DESCRIBE`` for the URL without its user info, well-formed, within the source's
``open_timeout``. A 3xx whose ``Location`` names another host or port fails the
attempt with ``redirected to <location>; set allow_redirects: true to follow it``
(reconnect reason ``redirect``). A redirect to the same host and port is harmless
(the credentials go where they were meant to) and is left to FFmpeg.

What this cannot see: a camera that answers these requests normally and redirects
FFmpeg's own requests afterwards, or only after authenticating (the check sends no
credentials, so a camera that answers it with 401 says nothing about its redirects).
See docs/security.md.
"""

from __future__ import annotations

import socket
import ssl
import time
from urllib.parse import urlsplit

from pipeline.redact import redact_url
from pipeline.sources.base import SourceError

__all__ = ["check_redirect", "has_credentials", "same_endpoint"]

_DEFAULT_PORTS = {"rtsp": 554, "rtsps": 322}
# An answer larger than this is not a camera's reply to OPTIONS or DESCRIBE headers.
_MAX_HEAD = 16 * 1024


def has_credentials(url: str) -> bool:
    parts = urlsplit(url)
    return parts.username is not None or parts.password is not None


def _endpoint(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return (parts.hostname or "").lower(), parts.port or _DEFAULT_PORTS.get(parts.scheme.lower(), 554)


def same_endpoint(url: str, location: str) -> bool:
    """Whether ``location`` (absolute, or relative to ``url``) is the same host and port."""
    if "://" not in location:
        return True
    try:
        return _endpoint(url) == _endpoint(location)
    except ValueError:  # an unparsable port: not the same place
        return False


def _printable(text: str, limit: int = 200) -> str:
    shown = "".join(c if c.isprintable() else "?" for c in text)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def _request_url(url: str) -> str:
    """``url`` without its user info, as it goes in a request line."""
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    query = f"?{parts.query}" if parts.query else ""
    return f"{parts.scheme}://{netloc}{parts.path or '/'}{query}"


def _read_head(sock: socket.socket, deadline: float) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        sock.settimeout(remaining)
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
        if len(data) > _MAX_HEAD:
            break
    return data


def _status_and_location(head: bytes) -> tuple[int, str | None]:
    lines = head.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    status_line = lines[0].split(" ", 2)
    if len(status_line) < 2 or not status_line[0].startswith("RTSP/") or not status_line[1].isdigit():
        return 0, None
    location = None
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "location":
            location = value.strip()
    return int(status_line[1]), location


def check_redirect(source_id: str, url: str, timeout: float) -> None:
    """Raise :class:`SourceError` (kind ``redirect``) if the camera redirects to another host.

    Connection errors raise :class:`SourceError` of kind ``refused``, ``unreachable``
    or ``timeout`` (FFmpeg would fail the same way); an answer that is not RTSP is
    left for FFmpeg to report.
    """
    display = redact_url(url)
    host, port = _endpoint(url)
    target = _request_url(url)
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        # Worded as AvSource.open words FFmpeg's failures, so callers see one form.
        kind = {ConnectionRefusedError: "refused", TimeoutError: "timeout"}.get(type(exc), "unreachable")
        reason = exc.strerror or ("Connection timed out" if kind == "timeout" else type(exc).__name__)
        raise SourceError(source_id, f"cannot open {display}: {reason}", kind, reason) from None
    try:
        if urlsplit(url).scheme.lower() == "rtsps":
            # As FFmpeg's own TLS: encrypted, the camera's certificate not verified.
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            sock = context.wrap_socket(sock, server_hostname=host)
        for cseq, (method, extra) in enumerate(
            (("OPTIONS", ""), ("DESCRIBE", "Accept: application/sdp\r\n")), start=1
        ):
            request = f"{method} {target} RTSP/1.0\r\nCSeq: {cseq}\r\nUser-Agent: vidpipe\r\n{extra}\r\n"
            sock.sendall(request.encode("ascii", "strict"))
            status, location = _status_and_location(_read_head(sock, deadline))
            if 300 <= status < 400 and location and not same_endpoint(url, location):
                shown = _printable(redact_url(location))
                raise SourceError(
                    source_id,
                    f"redirected to {shown}; set allow_redirects: true to follow it",
                    "redirect",
                )
            if status != 200:
                return  # 401, 404, not RTSP...: FFmpeg's own attempt will say what it is
    except TimeoutError:
        reason = "Connection timed out"
        raise SourceError(source_id, f"cannot open {display}: {reason}", "timeout", reason) from None
    except (OSError, UnicodeEncodeError):
        return  # a reset or a TLS failure: FFmpeg's attempt reports it in its own words
    finally:
        sock.close()
