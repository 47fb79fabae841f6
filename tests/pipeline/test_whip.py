"""WHIP ingest: a real aiortc publisher pushes video to a whip:// source over loopback."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import aiohttp
import aioice.ice
import numpy as np
import pytest
from aiortc import (
    AudioStreamTrack,
    RTCConfiguration,
    RTCPeerConnection,
    RTCSessionDescription,
    VideoStreamTrack,
)
from av import VideoFrame

from pipeline.nats_server import EmbeddedNats
from pipeline.runtime import SourceRun
from pipeline.sources.whip import WhipSource
from tests.conftest import Collector
from tests.pipeline.stack import Stack, until

CONFIG = """\
pipeline: whiptest
sources:
  - url: whip://cam
    stall_timeout: 1.0     # notice a vanished publisher quickly
    open_timeout: 10
nats: {{url: "{nats}"}}
http: {{listen: "127.0.0.1:0"}}
"""

WIDTH, HEIGHT = 320, 240


@pytest.fixture(autouse=True)
def loopback_ice(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # ICE gathers candidates on every interface except loopback; keep both peers of
    # this test on 127.0.0.1 so nothing listens on a reachable address.
    monkeypatch.setattr(aioice.ice, "get_host_addresses", lambda use_ipv4, use_ipv6: ["127.0.0.1"])
    yield


def whip(run: SourceRun) -> WhipSource:
    assert isinstance(run.source, WhipSource)
    return run.source


class SolidColour(VideoStreamTrack):
    """Frames of one RGB colour at the default 30 fps."""

    def __init__(self, rgb: tuple[int, int, int]) -> None:
        super().__init__()
        self.image = np.empty((HEIGHT, WIDTH, 3), np.uint8)
        self.image[:] = rgb

    async def recv(self) -> VideoFrame:
        pts, time_base = await self.next_timestamp()
        frame = VideoFrame.from_ndarray(self.image, format="rgb24")
        frame.pts = pts
        frame.time_base = Fraction(time_base)
        return frame


class Freezing(SolidColour):
    """Sends ``frames`` frames, then nothing, while the connection stays up."""

    def __init__(self, rgb: tuple[int, int, int], frames: int) -> None:
        super().__init__(rgb)
        self.left = frames

    async def recv(self) -> VideoFrame:
        if self.left == 0:
            await asyncio.Event().wait()
        self.left -= 1
        return await super().recv()


class Publisher:
    """A WHIP client: offer, POST, apply the answer; DELETE the Location to leave."""

    def __init__(self, http: aiohttp.ClientSession, track: VideoStreamTrack) -> None:
        self.http = http
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.pc.addTrack(track)
        self.location: str | None = None

    async def publish(self, path: str = "/whip/cam") -> tuple[int, str]:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        offer = self.pc.localDescription.sdp
        async with self.http.post(path, data=offer, headers={"Content-Type": "application/sdp"}) as resp:
            body = await resp.text()
            if resp.status == 201:
                assert resp.content_type == "application/sdp"
                self.location = resp.headers["Location"]
                await self.pc.setRemoteDescription(RTCSessionDescription(sdp=body, type="answer"))
            return resp.status, body

    async def leave(self) -> int:
        assert self.location is not None
        async with self.http.delete(self.location) as resp:
            status = resp.status
        await self.pc.close()
        return status


async def test_publisher_frames_become_detections_messages(
    tmp_path: Path, nats_server: EmbeddedNats, collector: Collector
) -> None:
    await collector.start(nats_server.url, "vidpipe.whiptest.>")
    stack = await Stack.start(tmp_path, CONFIG.format(nats=nats_server.url), nats_server.url)
    first = second = None
    try:
        run = stack.runtime.sources["cam"]
        assert (run.source.state.value, run.source.reason) == ("connecting", "waiting for a publisher")

        first = Publisher(stack.http, SolidColour((200, 40, 40)))
        status, body = await first.publish()
        assert status == 201, body
        assert first.location is not None and first.location.startswith("/whip/cam/")
        await until(lambda: len(collector.by_source("cam")) >= 10, timeout=20, what="messages from cam")
        assert {(m["width"], m["height"]) for m in collector.by_source("cam")} == {(WIDTH, HEIGHT)}
        assert run.source.state.value == "up"
        assert run.last_frame is not None
        # The colour survives VP8 within a few levels: these frames are the publisher's.
        mean = run.last_frame.image.reshape(-1, 3).mean(axis=0)
        assert np.abs(mean - (200, 40, 40)).max() < 12, mean

        # A second publisher while the first is live is refused.
        intruder = Publisher(stack.http, SolidColour((0, 0, 255)))
        status, body = await intruder.publish()
        await intruder.pc.close()
        assert status == 409 and "already has a publisher" in body

        assert await first.leave() == 200
        assert (run.source.state.value, run.source.reason) == ("connecting", "publisher left")
        published = run.published
        await asyncio.sleep(0.3)  # frames already decoded must not trickle in after DELETE
        assert run.published == published
        async with stack.http.delete(first.location) as resp:
            assert resp.status == 404  # the session is gone

        # A new publisher brings the source up again, with its own frames.
        second = Publisher(stack.http, SolidColour((30, 30, 220)))
        status, _ = await second.publish()
        assert status == 201
        await until(lambda: run.source.state.value == "up", timeout=20, what="cam up again")
        await until(
            lambda: run.last_frame is not None and run.last_frame.image[..., 2].mean() > 180,
            timeout=10,
            what="frames of the second publisher",
        )
        assert run.source.stats.reconnects == 1
        frames = [m["frame"] for m in collector.by_source("cam")]
        assert frames == sorted(frames) and len(set(frames)) == len(frames)

        # The publisher vanishes without DELETE (its track ends): noticed, source goes down.
        await second.pc.close()
        await until(lambda: run.source.state.value == "backoff", timeout=5, what="the loss to be noticed")
        # Closing ends the track and closes the connection; whichever the source sees first
        # names the loss. Either way it is the peer going away, not the stall timeout.
        assert run.source.reason in ("publisher lost: track ended", "publisher lost: connection closed")
        lost = "track_ended" if run.source.reason.endswith("track ended") else "connection_closed"

        # Up again with the next publisher; this one freezes with the connection still
        # open, which only the stall timeout (1 s) can tell.
        third = Publisher(stack.http, Freezing((40, 200, 40), frames=15))
        status, _ = await third.publish()
        assert status == 201
        await until(lambda: run.source.state.value == "up", timeout=20, what="cam up after a loss")
        await until(lambda: run.source.state.value == "backoff", timeout=10, what="the stall to be noticed")
        assert run.source.reason == "publisher lost: no frame for 1s"
        assert whip(run).session is None
        await third.pc.close()
        assert run.source.stats.reconnects == 2
        reconnects = {
            reason: stack.runtime.metrics.registry.get_sample_value(
                "vidpipe_source_reconnects_total", {"pipeline": "whiptest", "source": "cam", "reason": reason}
            )
            for reason in ("publisher_left", lost)
        }
        # Labelled by how the session before ended: whichever of the two the source saw first.
        assert reconnects == {"publisher_left": 1.0, lost: 1.0}
    finally:
        await stack.close()
    # Stopping the runtime closed the server side of the peer connection too.
    assert whip(run).session is None


async def test_an_offer_whose_connection_never_comes_up_is_no_reconnect(
    tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    stack = await Stack.start(tmp_path, CONFIG.format(nats=nats_server.url), nats_server.url)
    first = silent = None
    try:
        run = stack.runtime.sources["cam"]
        first = Publisher(stack.http, SolidColour((200, 40, 40)))
        assert (await first.publish())[0] == 201
        await until(lambda: run.source.state.value == "up", timeout=20, what="cam up")
        assert await first.leave() == 200
        # This one offers and is answered, but never applies the answer: no ICE, no DTLS.
        silent = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        silent.addTrack(SolidColour((0, 0, 255)))
        await silent.setLocalDescription(await silent.createOffer())
        headers = {"Content-Type": "application/sdp"}
        async with stack.http.post("/whip/cam", data=silent.localDescription.sdp, headers=headers) as resp:
            assert resp.status == 201
            location = resp.headers["Location"]
        # Counted when a publisher's connection comes up, not when its offer is answered.
        assert run.source.stats.reconnects == 0
        async with stack.http.delete(location) as resp:
            assert resp.status == 200
        assert run.source.stats.reconnects == 0
    finally:
        if silent is not None:
            await silent.close()
        await stack.close()


async def test_bad_offers_and_unknown_ids(tmp_path: Path, nats_server: EmbeddedNats) -> None:
    stack = await Stack.start(tmp_path, CONFIG.format(nats=nats_server.url), nats_server.url)
    try:
        sdp = {"Content-Type": "application/sdp"}
        assert await stack.json("POST", "/whip/cam", data="hello", headers=sdp) == (
            400,
            {"error": "bad SDP offer: it does not start with 'v=0'"},
        )
        audio_only = "v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\ns=-\r\nt=0 0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 0\r\n"
        assert await stack.json("POST", "/whip/cam", data=audio_only, headers=sdp) == (
            400,
            {"error": "bad SDP offer: it has no video media section (m=video)"},
        )
        no_codec = (
            "v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\ns=-\r\nt=0 0\r\nm=video 9 UDP/TLS/RTP/SAVPF 96\r\n"
            "c=IN IP4 0.0.0.0\r\na=mid:0\r\na=sendonly\r\na=rtcp-mux\r\na=rtpmap:96 NOPE/90000\r\n"
            "a=ice-ufrag:abcd\r\na=ice-pwd:abcdefghijklmnopqrstuvwx\r\n"
            "a=fingerprint:sha-256 " + ":".join(["AB"] * 32) + "\r\na=setup:actpass\r\n"
        )
        assert await stack.json("POST", "/whip/cam", data=no_codec, headers=sdp) == (
            400,
            {"error": "bad SDP offer: no supported video codec (offer VP8 or H.264)"},
        )
        status, body = await stack.json(
            "POST", "/whip/cam", data="v=0", headers={"Content-Type": "text/plain"}
        )
        assert (status, body) == (415, {"error": "Content-Type must be application/sdp, got 'text/plain'"})
        status, body = await stack.json("POST", "/whip/nope", data="v=0", headers=sdp)
        assert (status, body) == (404, {"error": "no whip:// source named 'nope'"})
        status, body = await stack.json("DELETE", "/whip/cam/not-a-session")
        assert status == 404
        # A rejected offer leaves the source free for a real publisher.
        run = stack.runtime.sources["cam"]
        # Waiting for a publisher costs no thread: frames come from the event loop.
        assert not [t.name for t in threading.enumerate() if t.name.startswith("source-")]
        assert whip(run).session is None
        assert (run.source.state.value, run.source.reason) == ("connecting", "waiting for a publisher")
    finally:
        await stack.close()


async def test_slow_conversion_skips_frames_instead_of_lagging(
    tmp_path: Path, nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pipeline.sources.whip as whip_module

    real = whip_module.copy_rgb
    converters: set[str] = set()

    def slow_copy_rgb(frame: VideoFrame, out: np.ndarray) -> None:
        converters.add(threading.current_thread().name)
        time.sleep(0.1)  # a converter at 10 fps behind a 30 fps publisher
        real(frame, out)

    monkeypatch.setattr(whip_module, "copy_rgb", slow_copy_rgb)
    stack = await Stack.start(tmp_path, CONFIG.format(nats=nats_server.url), nats_server.url)
    try:
        run = stack.runtime.sources["cam"]
        publisher = Publisher(stack.http, SolidColour((200, 200, 40)))
        publisher.pc.addTrack(AudioStreamTrack())  # audio is read and discarded
        status, _ = await publisher.publish()
        assert status == 201
        await until(lambda: run.published >= 15, timeout=20, what="15 published frames")
        skipped = stack.runtime.metrics.registry.get_sample_value(
            "vidpipe_frames_dropped_total", {"pipeline": "whiptest", "source": "cam", "reason": "queue_full"}
        )
        assert skipped is not None and skipped >= 15  # about two of every three frames
        assert run.last_frame is not None
        # Every published frame is at most one conversion (plus one waiting frame) old.
        assert max(run.latencies[-10:]) < 0.5, run.latencies[-10:]
        assert await publisher.leave() == 200
    finally:
        await stack.close()
    # The conversion ran on worker threads, never on the event loop's thread.
    assert converters and threading.main_thread().name not in converters
