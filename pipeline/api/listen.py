"""Where the HTTP server may listen, and how many connections it may hold.

::

    http:
      listen: 127.0.0.1:8080     # host:port; port 0 picks a free one
      token: null                # bearer token; required (16+ characters) off loopback
      max_connections: 256       # lowered to half the open-file limit when that is lower

Checked before anything starts (``vidpipe run`` exits 2 on a problem), so an
exposed API without a token never serves a request.
"""

from __future__ import annotations

import ipaddress
import resource
import socket

from inference.errors import VidpipeError
from pipeline.config import HttpConfig

# Off loopback the token is all that stands between the network and the API.
MIN_TOKEN_CHARS = 16


class ApiConfigError(VidpipeError):
    """The HTTP server cannot start as configured; ``key`` is the setting to change."""

    def __init__(self, message: str, key: str = "http.listen") -> None:
        self.key = key
        super().__init__(message)


def parse_listen(listen: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6) into its parts."""
    host, sep, port_text = listen.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ApiConfigError(f"http.listen: expected HOST:PORT, got {listen!r}")
    if int(port_text) > 65535:
        raise ApiConfigError(f"http.listen: port {port_text} in {listen!r} is out of range; use 1-65535")
    host = host.strip("[]")
    if not host:
        raise ApiConfigError(f"http.listen: {listen!r} has no host; use 127.0.0.1:PORT or 0.0.0.0:PORT")
    return host, int(port_text)


def is_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback address."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ApiConfigError(f"http.listen: cannot resolve host {host!r}: {exc}") from None
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def check_http_config(config: HttpConfig) -> tuple[str, int]:
    """Host and port to bind; refuses a non-loopback address without a token."""
    host, port = parse_listen(config.listen)
    if config.token is not None and not config.token.strip():
        raise ApiConfigError("http.token is empty; set a real token or remove the key", key="http.token")
    if not is_loopback(host):
        if not config.token:
            raise ApiConfigError(
                f"http.listen {config.listen} is reachable from other machines, so the API needs a "
                "token: set http.token (or VIDPIPE_HTTP_TOKEN), or listen on 127.0.0.1"
            )
        if len(config.token) < MIN_TOKEN_CHARS:
            raise ApiConfigError(
                f"http.token is {len(config.token)} characters; off loopback it must have at least "
                f"{MIN_TOKEN_CHARS} (e.g. python3 -c 'import secrets; print(secrets.token_urlsafe(24))')",
                key="http.token",
            )
    return host, port


def connection_cap(configured: int) -> int:
    """``http.max_connections``, lowered to half of this process's open-file limit.

    The other half is for sources, NATS, models and the accept itself: an HTTP
    client must never be able to take the process's last descriptor.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    return max(1, min(configured, soft // 2))


def bind(host: str, port: int, listen: str) -> socket.socket:
    """A socket bound to ``host:port`` (not yet listening); ``listen`` is the setting, for the error."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ApiConfigError(f"http.listen {listen}: cannot bind: {exc.strerror}") from None
    return sock
