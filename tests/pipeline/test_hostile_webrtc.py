"""Hostile WebRTC peers: session paths, ICE candidates and offers that never connect.

A live HTTP server (runtime + API on a real socket) meets real aiortc peers and raw
HTTP requests over loopback.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import aioice.ice
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

from pipeline.nats_server import EmbeddedNats
from pipeline.sources.base import SourceState
from pipeline.sources.whip import WhipSource
from pipeline.webrtc_guard import PENDING_TIMEOUT, default_ice_networks, own_addresses
from tests.pipeline.stack import Stack, until
from tests.pipeline.test_whip import Publisher, SolidColour

CONFIG = """\
pipeline: webrtc
sources:
  - url: whip://cam
    open_timeout: 60       # only the pending-session expiry may end a silent publisher
  - {{url: "test://?width=64&height=48&fps=10", id: pattern}}
nats: {{url: "{nats}"}}
http: {{listen: "127.0.0.1:0"{http}}}
"""


@pytest.fixture(autouse=True)
def loopback_ice(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # ICE gathers candidates on every interface except loopback; keep both peers on 127.0.0.1.
    monkeypatch.setattr(aioice.ice, "get_host_addresses", lambda use_ipv4, use_ipv6: ["127.0.0.1"])
    yield


async def start(tmp_path: Path, nats: EmbeddedNats, http: str = "") -> Stack:
    return await Stack.start(
        tmp_path, CONFIG.format(nats=nats.url, http=f", {http}" if http else ""), nats.url
    )


def whip(stack: Stack) -> WhipSource:
    source = stack.runtime.sources["cam"].source
    assert isinstance(source, WhipSource)
    return source


async def raw_request(port: int, head: bytes) -> bytes:
    """Send a request head as raw bytes (a path no client library would send) and read the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        return await asyncio.wait_for(reader.read(), 5.0)
    finally:
        writer.close()


async def offer_sdp(direction: str = "recvonly") -> tuple[RTCPeerConnection, str]:
    """A real aiortc offer (host candidates on 127.0.0.1) from a peer that will never connect."""
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    if direction == "sendonly":
        pc.addTrack(SolidColour((0, 0, 0)))
    else:
        pc.addTransceiver("video", direction="recvonly")
    await pc.setLocalDescription(await pc.createOffer())
    return pc, pc.localDescription.sdp


# -- session paths -------------------------------------------------------------------------------


async def test_a_non_ascii_session_path_is_a_404_and_forges_no_log_line(
    tmp_path: Path, nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    stack = await start(tmp_path, nats_server)
    port = stack.api.port
    assert port is not None
    publisher = Publisher(stack.http, SolidColour((0, 200, 0)))
    try:
        assert (await publisher.publish())[0] == 201
        await until(lambda: stack.runtime.sources["cam"].source.state is SourceState.UP, what="publisher up")
        caplog.set_level(logging.INFO)
        forged = "%C3%A9%0A2026-01-01%2000:00:00%20INFO%20vidpipe.api%20admin%20logged%20in"
        for prefix in ("/whip/cam/", "/whep/pattern/"):
            answer = await raw_request(
                port,
                f"DELETE {prefix}{forged} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode(),
            )
            assert answer.startswith(b"HTTP/1.1 404 Not Found"), answer
        assert not [r for r in caplog.records if "\n" in r.getMessage()], [
            r.getMessage() for r in caplog.records
        ]
        # The publisher's own session is untouched.
        assert whip(stack).session is not None
        assert await publisher.leave() == 200
    finally:
        await publisher.pc.close()
        await stack.close()


# -- ICE candidates ------------------------------------------------------------------------------


def _add_candidate(sdp: str, address: str, port: int) -> str:
    """``sdp`` with one more host candidate per media section, preferred over every other one."""
    line = f"a=candidate:9999 1 udp 2130706431 {address} {port} typ host"
    return re.sub(r"(a=candidate:[^\r\n]*\r\n)", lambda m: line + "\r\n" + m.group(1), sdp, count=1)


async def test_ice_candidates_outside_the_allowed_ranges_are_never_contacted(
    tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    stack = await start(tmp_path, nats_server, 'ice_networks: ["127.0.0.1/32"]')
    target = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    target.bind(("127.0.0.7", 0))
    target.setblocking(False)
    publisher = Publisher(stack.http, SolidColour((0, 200, 0)))
    try:
        # A publisher whose offer also names a host on another range, as its best candidate.
        await publisher.pc.setLocalDescription(await publisher.pc.createOffer())
        offer = _add_candidate(publisher.pc.localDescription.sdp, "127.0.0.7", target.getsockname()[1])
        async with stack.http.post(
            "/whip/cam", data=offer, headers={"Content-Type": "application/sdp"}
        ) as resp:
            assert resp.status == 201, await resp.text()
            publisher.location = resp.headers["Location"]
            answer = await resp.text()
        await publisher.pc.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
        await until(lambda: whip(stack).state is SourceState.UP, what="publisher up")
        with pytest.raises(BlockingIOError):
            target.recv(2048)  # not one STUN check reached the other range

        # An offer with no candidate in range at all is refused, naming the ranges.
        pc, sdp = await offer_sdp()
        only_outside = re.sub(r"(a=candidate:\S+ \d+ udp \d+ )127\.0\.0\.1 ", r"\g<1>10.9.9.9 ", sdp)
        status, body = await stack.json(
            "POST", "/whep/pattern", data=only_outside, headers={"Content-Type": "application/sdp"}
        )
        await pc.close()
        assert (status, body) == (
            400,
            {
                "error": "bad SDP offer: no ICE candidate in the allowed ranges "
                "(offered 10.9.9.9; http.ice_networks allows 127.0.0.1/32)"
            },
        )
        assert stack.api.whep.sessions == {}
        await publisher.leave()
    finally:
        target.close()
        await publisher.pc.close()
        await stack.close()


def test_ice_networks_default_to_the_listen_address_ranges() -> None:
    # Loopback, and this host's own addresses (what a browser on this host offers), each alone.
    own = [str(n) for n in own_addresses()]
    assert [str(n) for n in default_ice_networks("127.0.0.1")] == list(
        dict.fromkeys(["127.0.0.0/8", "::1/128", *own])
    )
    assert all(n.endswith(("/32", "/128")) for n in own)
    assert [str(n) for n in default_ice_networks("192.168.4.20")] == ["192.168.4.0/24"]
    assert "10.0.0.0/8" in [str(n) for n in default_ice_networks("0.0.0.0")]


# -- sessions that never connect -----------------------------------------------------------------


async def test_pending_sessions_expire_and_count_against_their_address(
    tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    stack = await start(tmp_path, nats_server, "max_pending_webrtc_per_client: 3")
    peers: list[RTCPeerConnection] = []
    try:
        sdp_headers = {"Content-Type": "application/sdp"}
        t0 = time.monotonic()
        # A WHIP publisher and two WHEP viewers that take their answers and never connect.
        pc, sdp = await offer_sdp("sendonly")
        peers.append(pc)
        status, _ = await stack.json("POST", "/whip/cam", data=sdp, headers=sdp_headers)
        assert status == 201
        for _ in range(2):
            pc, sdp = await offer_sdp()
            peers.append(pc)
            status, _ = await stack.json("POST", "/whep/pattern", data=sdp, headers=sdp_headers)
            assert status == 201
        # A fourth pending session from the same address is refused.
        pc, sdp = await offer_sdp()
        peers.append(pc)
        status, body = await stack.json("POST", "/whep/pattern", data=sdp, headers=sdp_headers)
        assert (status, body) == (
            429,
            {
                "error": "3 WebRTC session(s) from this address have not connected yet "
                "(http.max_pending_webrtc_per_client=3); each expires after 10s"
            },
        )
        assert stack.api.webrtc.pending == {"127.0.0.1": 3}
        # All three expire within 15 s of their offers, and free their address's count.
        await until(
            lambda: (
                not stack.api.whep.sessions and whip(stack).session is None and not stack.api.webrtc.pending
            ),
            timeout=15.0,
            what="pending sessions to expire",
        )
        assert time.monotonic() - t0 < 15.0
        assert whip(stack).state is SourceState.BACKOFF
        assert whip(stack).reason == f"publisher lost: not connected within {PENDING_TIMEOUT:g}s"
        pc, sdp = await offer_sdp()
        peers.append(pc)
        status, _ = await stack.json("POST", "/whep/pattern", data=sdp, headers=sdp_headers)
        assert status == 201
    finally:
        for pc in peers:
            await pc.close()
        await stack.close()


async def test_a_connected_session_stops_counting_as_pending(
    tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    stack = await start(tmp_path, nats_server, "max_pending_webrtc_per_client: 1")
    publisher = Publisher(stack.http, SolidColour((0, 200, 0)))
    try:
        assert (await publisher.publish())[0] == 201
        await until(lambda: whip(stack).state is SourceState.UP, what="publisher up")
        await until(lambda: not stack.api.webrtc.pending, what="the session to stop counting")
        pc, sdp = await offer_sdp()
        status, _ = await stack.json(
            "POST", "/whep/pattern", data=sdp, headers={"Content-Type": "application/sdp"}
        )
        await pc.close()
        assert status == 201
        assert await publisher.leave() == 200
    finally:
        await publisher.pc.close()
        await stack.close()
