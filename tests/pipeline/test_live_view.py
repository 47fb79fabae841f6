"""Live views: MJPEG and WHEP from a running pipeline, read by real clients over loopback."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import aioice.ice
import cv2
import numpy as np
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

from pipeline.nats_server import EmbeddedNats
from tests.pipeline.stack import Stack, until

TOKEN = "live-view-token-0123456789"
FPS = 20
CONFIG = """\
pipeline: live
models: {models}
sources: [{{url: "test://?width=320&height=240&fps={fps}", id: cam}}]
stages: [{{name: objects, type: infer, model: squares}}]
nats: {{url: "{nats}"}}
http: {{listen: "127.0.0.1:0", token: {token}}}
"""


@pytest.fixture(autouse=True)
def loopback_ice(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # Keep both WebRTC peers on 127.0.0.1 (ICE skips loopback by default).
    monkeypatch.setattr(aioice.ice, "get_host_addresses", lambda use_ipv4, use_ipv6: ["127.0.0.1"])
    yield


async def start(tmp_path: Path, nats: EmbeddedNats, models: Path) -> Stack:
    text = CONFIG.format(models=models, fps=FPS, nats=nats.url, token=TOKEN)
    return await Stack.start(tmp_path, text, nats.url, token=TOKEN)


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
    tmp_path: Path, nats_server: EmbeddedNats, sample_models: Path
) -> None:
    stack = await start(tmp_path, nats_server, sample_models)
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    try:
        pc.addTransceiver("video", direction="recvonly")
        got: asyncio.Future[object] = asyncio.get_running_loop().create_future()

        @pc.on("track")
        def on_track(track: object) -> None:
            got.set_result(track)

        await pc.setLocalDescription(await pc.createOffer())
        async with stack.http.post(
            "/whep/cam", data=pc.localDescription.sdp, headers={"Content-Type": "application/sdp"}
        ) as resp:
            assert resp.status == 201, await resp.text()
            location = resp.headers["Location"]
            answer = await resp.text()
        assert location.startswith("/whep/cam/")
        await pc.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
        track = await asyncio.wait_for(got, 10)
        sizes = set()
        for _ in range(30):
            frame = await asyncio.wait_for(track.recv(), 10)  # type: ignore[attr-defined]
            sizes.add((frame.width, frame.height))
        assert sizes == {(320, 240)}
        async with stack.http.delete(location) as resp:
            assert resp.status == 200
        assert stack.api.whep.sessions == {}
    finally:
        await pc.close()
        await stack.close()
