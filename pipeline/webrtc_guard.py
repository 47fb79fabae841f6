"""What a WHIP or WHEP offer may ask of the server: ICE candidates in allowed ranges, few pending sessions.

::

    http:
      listen: 192.168.1.10:8080
      ice_networks: [192.168.1.0/24]   # default: the networks of http.listen (below)
      max_pending_webrtc_per_client: 4 # offers per client address not connected yet

An offer's ICE candidates are addresses the server will send STUN checks to, so
an offer naming ``10.0.0.1:22`` or a host on another network would make the
server probe it. :meth:`OfferGuard.filter_offer` keeps only the candidates whose
address lies in ``http.ice_networks`` (hostnames, such as mDNS ``.local``
names, are dropped: resolving them is a request of its own) and refuses an offer
that named addresses and is left with none (400). An offer left with no candidate
at all (it named none, as a client that trickles them sends it, or only mDNS
names) also loses its ``a=end-of-candidates``: the session then connects from the
checks the peer sends to the answer's candidates, instead of giving up at once.
Candidates sent later (trickle ICE, ``PATCH``) are not taken. By default the
ranges are those of the address the server listens on: loopback and this host's
own interface addresses for a loopback address (a browser on this host offers
those), the /24 (IPv4) or /64 (IPv6) around a specific address, and the private,
link-local and loopback ranges for ``0.0.0.0`` or ``::``.

A session counts as pending from its answer until its peer connection connects;
one that has not connected within :data:`PENDING_TIMEOUT` seconds is ended by
its owner (WHIP source or WHEP server), with :func:`unconnected_reason`, and a
client address may have at most ``max_pending_webrtc_per_client`` pending at once
(429 beyond).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field

from inference.errors import VidpipeError

__all__ = [
    "PENDING_TIMEOUT",
    "IceNetwork",
    "OfferGuard",
    "OfferRefused",
    "PendingSession",
    "candidate_count",
    "default_ice_networks",
    "parse_network",
    "unconnected_reason",
]

# Seconds a WHIP or WHEP session may take to connect (ICE and DTLS on a LAN take
# well under a second; a peer behind a slow link, a few).
PENDING_TIMEOUT = 10.0

IceNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Where a server listening on every address expects its peers.
_PRIVATE = (
    "127.0.0.0/8",
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",
    "169.254.0.0/16",
    "::1/128",
    "fc00::/7",
    "fe80::/10",
)


def candidate_count(sdp: str) -> int:
    """How many ICE candidates (``a=candidate:`` lines) ``sdp`` names."""
    return sum(1 for line in sdp.splitlines() if line.startswith("a=candidate:"))


def unconnected_reason(candidates: int) -> str:
    """Why a session whose offer named ``candidates`` usable candidates ended unconnected."""
    reason = f"not connected within {PENDING_TIMEOUT:g}s"
    if candidates == 0:
        # The likely cause, said where the operator looks: the client trickles its
        # candidates (PATCH, not taken) and its own checks did not reach this server.
        reason += (
            "; its offer named no ICE candidate this server could use, so only the peer's own "
            "checks could connect it (candidates sent later by PATCH are not taken: send the "
            "offer once ICE gathering is complete)"
        )
    return reason


class OfferRefused(VidpipeError):
    """An offer the guard refuses: ``status`` (400, 429) and a message for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def parse_network(text: str) -> IceNetwork | None:
    """A CIDR range (``10.0.0.0/8``, an address alone is a /32 or /128); None if not one."""
    try:
        return ipaddress.ip_network(text.strip(), strict=False)
    except ValueError:
        return None


def own_addresses() -> list[IceNetwork]:
    """This host's interface addresses, each as a single-address network."""
    import ifaddr  # aioice's own dependency: the interfaces aiortc gathers candidates on

    out: list[IceNetwork] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            address = ip.ip[0] if isinstance(ip.ip, tuple) else ip.ip
            if not address.startswith("fe80"):
                out.append(ipaddress.ip_network(address))
    return out


def default_ice_networks(host: str) -> list[IceNetwork]:
    """The ranges peers of a server listening on ``host`` are expected in (see the module doc)."""
    try:
        addresses = [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError:
            infos = []
        addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    networks: list[IceNetwork] = []
    for address in addresses:
        if address.is_unspecified:
            networks += [ipaddress.ip_network(n) for n in _PRIVATE]
        elif address.is_loopback:
            # A peer of a loopback server runs on this host, and a browser offers this host's
            # own interface addresses, not loopback: those addresses (and nothing past them)
            # are allowed too; the server can only reach itself through them.
            networks += [ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128")]
            networks += own_addresses()
        else:
            prefix = 24 if address.version == 4 else 64
            networks.append(ipaddress.ip_network(f"{address}/{prefix}", strict=False))
    return list(dict.fromkeys(networks))


@dataclass
class PendingSession:
    """A session counted against its client until it connects or ends (whichever comes first)."""

    guard: OfferGuard
    client: str
    counted: bool = field(default=True)

    def settled(self) -> None:
        """The session connected or ended: it no longer counts as pending."""
        if self.counted:
            self.counted = False
            self.guard._release(self.client)


class OfferGuard:
    """The allowed candidate ranges and the pending sessions per client of one HTTP server."""

    def __init__(self, networks: Iterable[IceNetwork], max_pending_per_client: int) -> None:
        self.networks = list(networks)
        self.max_pending_per_client = max_pending_per_client
        self.pending: dict[str, int] = {}

    def _allowed(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False  # a hostname (mDNS .local): never resolved on an offer's word
        return any(ip in network for network in self.networks)

    def filter_offer(self, sdp: str) -> str:
        """``sdp`` with only the candidates in the allowed ranges (see the module doc).

        Raises :class:`OfferRefused` (400) when the offer named addresses and none is allowed.
        """
        kept: list[str] = []
        dropped: list[str] = []
        for line in sdp.splitlines():
            if line.startswith("a=candidate:"):
                fields = line.split()
                address = fields[4] if len(fields) > 5 else ""
                if not self._allowed(address):
                    dropped.append(address)
                    continue
            kept.append(line)
        # A browser hides its host addresses behind mDNS names (``<uuid>.local``) unless the
        # page may use the camera: such an offer has no address at all, and the session still
        # connects, from the checks the browser sends to the answer's candidates (the server
        # only ever answers the address that reached it). Only an offer that named addresses,
        # all outside the ranges, is refused.
        named = [a for a in dropped if not a.endswith(".local")]
        left = sum(1 for line in kept if line.startswith("a=candidate:"))
        if named and not left:
            shown = ", ".join(sorted(set(named))[:3])
            ranges = ", ".join(str(n) for n in self.networks[:6]) or "none"
            raise OfferRefused(
                400,
                f"bad SDP offer: no ICE candidate in the allowed ranges (offered {shown}; "
                f"http.ice_networks allows {ranges})",
            )
        if not left:
            # "No candidates, and no more to come" makes aiortc fail the connection at once,
            # before the peer's checks arrive: an offer that ends its gathered mDNS names with
            # this line, or a client's that names none, never connected. Without it, aiortc
            # waits for those checks (and the session for PENDING_TIMEOUT at most).
            kept = [line for line in kept if not line.startswith("a=end-of-candidates")]
        return "\r\n".join(kept) + "\r\n"

    def admit(self, client: str) -> PendingSession:
        """Count a new pending session of ``client``; :class:`OfferRefused` (429) over the cap."""
        count = self.pending.get(client, 0)
        if count >= self.max_pending_per_client:
            raise OfferRefused(
                429,
                f"{count} WebRTC session(s) from this address have not connected yet "
                f"(http.max_pending_webrtc_per_client={self.max_pending_per_client}); "
                f"each expires after {PENDING_TIMEOUT:g}s",
            )
        self.pending[client] = count + 1
        return PendingSession(self, client)

    def _release(self, client: str) -> None:
        left = self.pending.get(client, 0) - 1
        if left > 0:
            self.pending[client] = left
        else:
            self.pending.pop(client, None)
