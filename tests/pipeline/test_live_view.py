"""Live views: MJPEG and WHEP from a running pipeline, read by real clients over loopback."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import aioice.ice
import cv2
import numpy as np
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection, RTCRtpSender, RTCSessionDescription

from pipeline.annotate import LINE_COLOUR, ZONE_COLOUR
from pipeline.nats_server import EmbeddedNats
from tests.pipeline.stack import Stack, until

TOKEN = "live-view-token-0123456789"
FPS = 20
CONFIG = """\
pipeline: live
models: {models}
sources: [{{url: "test://?width={width}&height={height}&fps={fps}", id: cam}}]
stages: [{{name: objects, type: infer, model: squares}}]
nats: {{url: "{nats}"}}
http: {{listen: "127.0.0.1:0", token: {token}}}
"""


@pytest.fixture(autouse=True)
def loopback_ice(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # Keep both WebRTC peers on 127.0.0.1 (ICE skips loopback by default).
    monkeypatch.setattr(aioice.ice, "get_host_addresses", lambda use_ipv4, use_ipv6: ["127.0.0.1"])
    yield


async def start(
    tmp_path: Path, nats: EmbeddedNats, models: Path, size: tuple[int, int] = (320, 240)
) -> Stack:
    text = CONFIG.format(models=models, fps=FPS, nats=nats.url, token=TOKEN, width=size[0], height=size[1])
    return await Stack.start(tmp_path, text, nats.url, token=TOKEN)


async def whep_connect(stack: Stack, pc: RTCPeerConnection, codec: str | None = None) -> tuple[str, Any]:
    """Ask ``/whep/cam`` for the video, receive-only: the session's Location and its track
    (``codec``: offer only that one, ``video/H264`` as Safari prefers)."""
    transceiver = pc.addTransceiver("video", direction="recvonly")
    if codec is not None:
        codecs = RTCRtpSender.getCapabilities("video").codecs
        transceiver.setCodecPreferences([c for c in codecs if c.mimeType in (codec, "video/rtx")])
    got: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    pc.on("track", got.set_result)
    await pc.setLocalDescription(await pc.createOffer())
    async with stack.http.post(
        "/whep/cam", data=pc.localDescription.sdp, headers={"Content-Type": "application/sdp"}
    ) as resp:
        assert resp.status == 201, await resp.text()
        location = resp.headers["Location"]
        answer = await resp.text()
    await pc.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
    return location, await asyncio.wait_for(got, 10)


async def published_rate(stack: Stack, seconds: float) -> float:
    run = stack.runtime.sources["cam"]
    before = run.published
    await asyncio.sleep(seconds)
    return (run.published - before) / seconds


async def mjpeg_parts(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The JPEGs of a multipart MJPEG response, by their Content-Length."""
    buf = b""
    while chunk := await resp.content.readany():
        buf += chunk
        while (head_end := buf.find(b"\r\n\r\n")) >= 0:
            lines = buf[:head_end].decode().split("\r\n")
            headers = dict(line.split(": ", 1) for line in lines if ": " in line)
            start = head_end + 4
            end = start + int(headers["Content-Length"])
            if len(buf) < end + 2:
                break
            yield buf[start:end]
            buf = buf[end + 2 :]


async def read_mjpeg_frames(stack: Stack, count: int) -> list[np.ndarray]:
    images: list[np.ndarray] = []
    async with stack.http.get("/v1/sources/cam/stream.mjpeg?fps=15") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "multipart/x-mixed-replace; boundary=vidpipe-frame"
        async for jpeg in mjpeg_parts(resp):
            image = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
            assert image is not None and image.shape == (240, 320, 3)
            images.append(image)
            if len(images) >= count:
                break
    return images


async def test_mjpeg_viewer_gets_frames_and_one_that_never_reads_does_not_slow_the_pipeline(
    tmp_path: Path, nats_server: EmbeddedNats, sample_models: Path
) -> None:
    stack = await start(tmp_path, nats_server, sample_models)
    try:
        await until(lambda: stack.runtime.sources["cam"].published > FPS, what="the pipeline to run")
        baseline = await published_rate(stack, 3.0)

        # A viewer that connects, asks for the fastest stream and never reads a byte.
        port = stack.api.port
        assert port is not None
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(
            b"GET /v1/sources/cam/stream.mjpeg?fps=30 HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + f"Authorization: Bearer {TOKEN}\r\n\r\n".encode()
        )
        try:
            await until(lambda: stack.runtime.outputs.relay.viewers("cam") == 1, what="the stuck viewer")
            await asyncio.sleep(2.0)  # long enough for its socket buffers to fill
            reading = asyncio.ensure_future(read_mjpeg_frames(stack, 10))
            watched = await published_rate(stack, 3.0)
            images = await asyncio.wait_for(reading, 20)
        finally:
            sock.close()
        assert len(images) >= 10
        # The frames are annotated: the detector's box is drawn in a saturated colour.
        hsv = cv2.cvtColor(images[-1], cv2.COLOR_BGR2HSV)
        assert int(((hsv[:, :, 1] > 90) & (hsv[:, :, 2] > 90)).sum()) > 50
        assert watched == pytest.approx(baseline, rel=0.10), (baseline, watched)
        assert baseline == pytest.approx(FPS, rel=0.10)
    finally:
        await stack.close()


async def test_mjpeg_and_whep_need_the_token(
    tmp_path: Path, nats_server: EmbeddedNats, sample_models: Path
) -> None:
    stack = await start(tmp_path, nats_server, sample_models)
    try:
        async with stack.http.get("/v1/sources/cam/stream.mjpeg", headers={"Authorization": ""}) as resp:
            assert resp.status == 401
        status, body = await stack.json(
            "POST", "/whep/cam", data=b"v=0", headers={"Authorization": "", "Content-Type": "application/sdp"}
        )
        assert status == 401
        status, body = await stack.json("GET", "/v1/sources/nope/stream.mjpeg")
        assert (status, body) == (404, {"error": "no source 'nope'"})
        status, body = await stack.json("GET", "/v1/sources/cam/stream.mjpeg?fps=0")
        assert (status, body) == (400, {"error": "fps: expected a number from 0.1 to 30"})
    finally:
        await stack.close()


async def test_whep_client_receives_annotated_video(
    tmp_path: Path, nats_server: EmbeddedNats, sample_models: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="vidpipe")
    stack = await start(tmp_path, nats_server, sample_models)
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    try:
        location, track = await whep_connect(stack, pc)
        assert location.startswith("/whep/cam/")
        sizes = set()
        for _ in range(30):
            frame = await asyncio.wait_for(track.recv(), 10)
            sizes.add((frame.width, frame.height))
        assert sizes == {(320, 240)}
        async with stack.http.delete(location) as resp:
            assert resp.status == 200
        assert stack.api.whep.sessions == {}
        session = location.rsplit("/", 1)[1]
        assert f"source cam: WHEP session {session} ended: the viewer ended it (DELETE)" in caplog.messages
    finally:
        await pc.close()
        await stack.close()


async def test_an_h264_viewer_gets_video_from_a_camera_of_odd_size(
    tmp_path: Path, nats_server: EmbeddedNats, sample_models: Path
) -> None:
    # x264 refuses odd sizes in 4:2:0; the viewer gets the frame less its odd column and row.
    stack = await start(tmp_path, nats_server, sample_models, size=(321, 241))
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    try:
        _, track = await whep_connect(stack, pc, codec="video/H264")
        sizes = set()
        for _ in range(10):
            frame = await asyncio.wait_for(track.recv(), 10)
            sizes.add((frame.width, frame.height))
        assert sizes == {(320, 240)}
    finally:
        await pc.close()
        await stack.close()


async def test_a_source_that_has_ended_has_no_live_view_and_takes_no_place(
    tmp_path: Path, nats_server: EmbeddedNats, sample_models: Path
) -> None:
    from samples.make_clip import write_clip

    clip = write_clip(tmp_path / "short.mp4", frames=5, fps=10, width=160, height=120)
    text = CONFIG.format(
        models=sample_models, fps=FPS, nats=nats_server.url, token=TOKEN, width=320, height=240
    )
    text = text.replace("id: cam}]", f'id: cam}}, {{url: "{clip}", id: short}}]')
    stack = await Stack.start(tmp_path, text, nats_server.url, token=TOKEN)
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    try:
        run = stack.runtime.sources["short"]
        await until(lambda: run.source.state.value == "stopped", what="the file ended")
        await until(lambda: stack.runtime.outputs.relay.ended("short"), what="its viewers ended")
        said = {
            "error": "source 'short' has ended: there is no live view; its last frame is "
            "/v1/sources/short/snapshot.jpg"
        }
        # Answered at once (it used to be a 200 that never sent a frame).
        assert await stack.json("GET", "/v1/sources/short/stream.mjpeg") == (409, said)
        pc.addTransceiver("video", direction="recvonly")
        await pc.setLocalDescription(await pc.createOffer())
        status, body = await stack.json(
            "POST", "/whep/short", data=pc.localDescription.sdp, headers={"Content-Type": "application/sdp"}
        )
        assert (status, body) == (409, said)
        assert stack.api.whep.sessions == {}
        status, _ = await stack.json("GET", "/v1/sources/short/snapshot.jpg")
        assert status == 200
    finally:
        await pc.close()
        await stack.close()


async def test_a_whep_session_ends_with_its_source(
    tmp_path: Path, nats_server: EmbeddedNats, sample_models: Path
) -> None:
    stack = await start(tmp_path, nats_server, sample_models)
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    try:
        location, track = await whep_connect(stack, pc)
        await asyncio.wait_for(track.recv(), 10)
        assert len(stack.api.whep.sessions) == 1
        # The source goes: its viewers' sessions end with it and give their places back.
        async with stack.http.delete("/v1/sources/cam") as resp:
            assert resp.status == 204
        await until(lambda: stack.api.whep.sessions == {}, what="the WHEP session ended")
        async with stack.http.delete(location) as resp:
            assert resp.status == 404
    finally:
        await pc.close()
        await stack.close()


async def test_an_mjpeg_viewer_that_leaves_a_silent_source_is_let_go(
    tmp_path: Path, nats_server: EmbeddedNats, sample_models: Path
) -> None:
    # Only a write found a closed connection: a camera that is down sends nothing to write,
    # and each viewer that left kept its handler and subscription while it stayed down.
    stack = await start(tmp_path, nats_server, sample_models)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens here once it is closed
    try:
        status, _ = await stack.json(
            "POST", "/v1/sources", json={"id": "dead", "url": f"rtsp://127.0.0.1:{port}/x"}
        )
        assert status == 201
        relay = stack.runtime.outputs.relay
        for _ in range(3):
            async with stack.http.get("/v1/sources/dead/stream.mjpeg") as resp:
                assert resp.status == 200
                await until(lambda: relay.viewers("dead") == 1, what="the viewer subscribed")
            await until(lambda: relay.viewers("dead") == 0, what="the viewer let go", timeout=5)
    finally:
        await stack.close()


async def test_a_viewer_over_the_session_limit_is_told_why_and_it_is_logged(
    tmp_path: Path, nats_server: EmbeddedNats, sample_models: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Viewers that closed their tab hold their places for about 30 s: the bare 429 was a riddle.
    stack = await start(tmp_path, nats_server, sample_models)
    stack.api.whep.max_sessions = 1
    first = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    second = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    try:
        await whep_connect(stack, first)
        second.addTransceiver("video", direction="recvonly")
        await second.setLocalDescription(await second.createOffer())
        async with stack.http.post(
            "/whep/cam", data=second.localDescription.sdp, headers={"Content-Type": "application/sdp"}
        ) as resp:
            problem = (
                "1 WHEP sessions already; end one first (a viewer that left without DELETE holds its "
                "place until its connection times out, about 30 s)"
            )
            assert (resp.status, await resp.json()) == (429, {"error": problem})
        assert f"source cam: WHEP viewer refused: {problem}" in caplog.messages
    finally:
        await first.close()
        await second.close()
        await stack.close()


ZONES_CONFIG = """\
pipeline: live
models: {models}
sources: [{{url: "test://?width=320&height=240&fps={fps}", id: cam}}]
stages:
  - {{name: objects, type: infer, model: squares}}
  - name: gate
    type: zones
    zones: [{{name: dock, polygon: [[20, 20], [100, 20], [100, 220], [20, 220]]}}]
    lines: [{{name: door, points: [[160, 20], [160, 220]]}}]
nats: {{url: "{nats}"}}
http: {{listen: "127.0.0.1:0", token: {token}}}
"""


def coloured(image_bgr: np.ndarray, colour: tuple[int, int, int]) -> np.ndarray:
    """Where the image is ``colour`` (within JPEG / VP8 error)."""
    return np.abs(image_bgr.astype(np.int16) - np.array(colour, dtype=np.int16)).max(axis=2) < 60


def square_clear(image: np.ndarray) -> bool:
    """The pattern's white square, its box and caption are right of x = 196: nothing hides the shapes."""
    xs = np.nonzero(image.min(axis=2) > 200)[1]
    return xs.size > 0 and int(xs.min()) >= 200


def assert_line_and_zone_drawn(image: np.ndarray, where: str) -> None:
    line = coloured(image, LINE_COLOUR)
    # Along the segment (x = 160, y 20 to 220), give or take a pixel.
    along = line[20:221, 159:162].any(axis=1)
    assert along.mean() > 0.95, (where, along.mean())
    assert not line[20:221, 120].any() and not line[:20, 159:162].any(), where
    # The arrow from its middle points to the line's right walking down it: the picture's left.
    assert line[116:125, 140:156].sum() >= 15 and not line[116:125, 166:180].any(), where
    zone = coloured(image, ZONE_COLOUR)
    assert zone[30:211, 19:22].any(axis=1).mean() > 0.95, where  # its left edge at x = 20
    assert zone[30:211, 99:102].any(axis=1).mean() > 0.95, where  # and its right one at x = 100
    assert not zone[30:211, 60].any(), where


async def test_lines_and_zones_are_drawn_on_the_snapshot_mjpeg_and_whep(
    tmp_path: Path, nats_server: EmbeddedNats, sample_models: Path
) -> None:
    text = ZONES_CONFIG.format(models=sample_models, fps=FPS, nats=nats_server.url, token=TOKEN)
    stack = await Stack.start(tmp_path, text, nats_server.url, token=TOKEN)
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    try:
        await until(lambda: stack.runtime.sources["cam"].published > 2, what="the pipeline to run")

        # The square goes everywhere: each view is checked on its first frame with the square
        # clear of the shapes (about a third of the frames).
        async def snapshot() -> np.ndarray:
            async with stack.http.get("/v1/sources/cam/snapshot.jpg") as resp:
                assert resp.status == 200
                decoded = cv2.imdecode(np.frombuffer(await resp.read(), np.uint8), cv2.IMREAD_COLOR)
                assert decoded is not None
                return decoded

        for _ in range(400):
            image = await snapshot()
            if square_clear(image):
                break
            await asyncio.sleep(1 / FPS)
        assert_line_and_zone_drawn(image, "snapshot")
        async with stack.http.get("/v1/sources/cam/stream.mjpeg?fps=20") as resp:
            async for jpeg in mjpeg_parts(resp):
                decoded = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
                assert decoded is not None
                image = decoded
                if square_clear(image):
                    break
        assert_line_and_zone_drawn(image, "mjpeg")

        _, track = await whep_connect(stack, pc)
        # The first frames of a WebRTC stream are coarse while its bitrate ramps up.
        for i in range(300):
            frame = await asyncio.wait_for(track.recv(), 10)
            image = frame.to_ndarray(format="bgr24")
            if i >= 20 and square_clear(image):
                break
        assert_line_and_zone_drawn(image, "whep")
    finally:
        await pc.close()
        await stack.close()
