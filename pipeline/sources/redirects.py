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

The ``Location`` is read exactly as FFmpeg reads it (:func:`ffmpeg_endpoint`):
FFmpeg never resolves it against the request, needs no ``//`` after the scheme
(``rtsp:10.0.0.9:8554/x`` is host 10.0.0.9), and ends header lines at a bare LF.

What this cannot see: a camera that answers these requests normally and redirects
FFmpeg's own requests afterwards, or only after authenticating (the check sends no
credentials, so a camera that answers it with 401 says nothing about its redirects).
See docs/security.md.
"""

from __future__ import annotations

import re
import socket
import ssl
import time
from urllib.parse import urlsplit

from pipeline.redact import redact_url
from pipeline.sources.base import SourceError

__all__ = ["check_redirect", "ffmpeg_endpoint", "has_credentials", "same_endpoint"]

_DEFAULT_PORTS = {"rtsp": 554, "rtsps": 322}
# An answer larger than this is not a camera's reply to OPTIONS or DESCRIBE headers.
_MAX_HEAD = 16 * 1024
_BLANK_LINE = re.compile(rb"\n\r?\n")


def has_credentials(url: str) -> bool:
    parts = urlsplit(url)
    return parts.username is not None or parts.password is not None


def _endpoint(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return (parts.hostname or "").lower(), parts.port or _DEFAULT_PORTS.get(parts.scheme.lower(), 554)


def ffmpeg_endpoint(location: str) -> tuple[str, str, int | None] | None:
    """``(scheme, host, port)`` of ``location`` as FFmpeg's ``av_url_split`` reads it (host lowercased).

    None for a location without a ``:`` (FFmpeg takes it as a plain path and
    connects to no host). FFmpeg needs no ``//``: ``rtsp:10.0.0.9:8554/x`` names
    host 10.0.0.9 port 8554, and the scheme is everything before the first ``:``,
    wherever it is (``/a:1/b`` names host ``1``). ``port`` is None when absent,
    0 when FFmpeg's ``strtol`` finds no digits.
    """
    scheme, colon, rest = location.partition(":")
    if not colon:
        return None
    for _ in range(2):
        rest = rest.removeprefix("/")
    hostport = rest[: min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))]
    hostport = hostport.rpartition("@")[2]  # user info up to the last '@'
    port_text: str | None = None
    if hostport.startswith("[") and "]" in hostport:
        host, _, after = hostport[1:].partition("]")
        if after.startswith(":"):
            port_text = after[1:]
    else:
        host, sep, port_text_found = hostport.partition(":")
        port_text = port_text_found if sep else None
    port: int | None = None
    if port_text is not None:
        digits = port_text.lstrip(" \t")
        sign = -1 if digits.startswith("-") else 1
        digits = digits.lstrip("+-")
        number = digits[: len(digits) - len(digits.lstrip("0123456789"))]
        port = sign * int(number) if number else 0
    return scheme, host.lower(), port


def same_endpoint(url: str, location: str) -> bool:
    """Whether FFmpeg, following ``location``, stays on ``url``'s host and port.

    ``location`` is read as FFmpeg reads it (:func:`ffmpeg_endpoint`), not as a
    browser would: FFmpeg never resolves a redirect relative to the request.
    """
    endpoint = ffmpeg_endpoint(location)
    if endpoint is None:
        return True  # a plain path: FFmpeg connects to no other host with it
    scheme, host, port = endpoint
    if port is None or port < 0:
        # FFmpeg compares the scheme case-sensitively and takes anything else for rtsp.
        port = _DEFAULT_PORTS["rtsps" if scheme == "rtsps" else "rtsp"]
    try:
        return _endpoint(url) == (host, port)
    except ValueError:  # an unparsable port in the source's own URL: not the same place
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


def _head_end(data: bytes) -> int:
    """Where the head ends (FFmpeg ends lines at LF and drops a CR before it); -1 if not yet."""
    match = _BLANK_LINE.search(data)
    return -1 if match is None else match.start()


def _read_head(sock: socket.socket, deadline: float) -> bytes:
    data = b""
    while _head_end(data) < 0:
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
    end = _head_end(head)
    text = (head if end < 0 else head[:end]).decode("latin-1")
    lines = [line.removesuffix("\r") for line in text.split("\n")]
    # FFmpeg reads the status as atoi() of the line's second word, whatever the first is.
    words = lines[0].split()
    digits = words[1][: len(words[1]) - len(words[1].lstrip("0123456789"))] if len(words) > 1 else ""
    if not digits:
        return 0, None
    location = None
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "location":
            location = value.strip()
    return int(digits), location


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
