"""A source's annotated pictures over plain HTTP: the snapshot JPEG and the live MJPEG view.

``GET /v1/sources/{id}/snapshot.jpg`` is the latest published frame, annotated;
``GET /v1/sources/{id}/stream.mjpeg?fps=10`` is the live view as
``multipart/x-mixed-replace`` JPEGs. Both may be embedded by the pages in
``http.allowed_origins`` (``<img src=...>``); the WebRTC view is in
:mod:`pipeline.api.webrtc`.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from pipeline.api.answers import error
from pipeline.frames import Frame
from pipeline.outputs.relay import LiveFrame, Subscription, ended_source
from pipeline.runtime import Runtime
from pipeline.snapshot import render_snapshot

SNAPSHOT_PATH = "/v1/sources/{id}/snapshot.jpg"
MJPEG_PATH = "/v1/sources/{id}/stream.mjpeg"
# The routes a page in http.allowed_origins may embed: images, never the API's data.
EMBEDDABLE = frozenset({SNAPSHOT_PATH, MJPEG_PATH})
# Live MJPEG views: frames per second a viewer gets unless it asks (?fps=), and the most.
MJPEG_FPS = 10.0
MJPEG_MAX_FPS = 30.0
MJPEG_BOUNDARY = "vidpipe-frame"
# How often a viewer waiting for a frame is checked for having left (a silent source).
VIEWER_CHECK_S = 1.0


class ViewRoutes:
    """The snapshot (encoded once per published frame, whoever asks) and the MJPEG live view."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        # Per source, the frame last encoded and its JPEG.
        self._snapshots: dict[str, tuple[Frame, bytes]] = {}

    def add_to(self, router: web.UrlDispatcher) -> None:
        router.add_get(SNAPSHOT_PATH, self.snapshot)
        router.add_get(MJPEG_PATH, self.stream_mjpeg)

    def forget(self, sid: str) -> None:
        """Drop what is kept for a removed source."""
        self._snapshots.pop(sid, None)

    async def snapshot(self, request: web.Request) -> web.Response:
        sid = request.match_info["id"]
        run = self._runtime.sources.get(sid)
        if run is None:
            return error(404, f"no source {sid!r}")
        frame = run.last_frame
        if frame is None:
            return error(404, f"source {sid!r} has not published a frame yet")
        cached = self._snapshots.get(sid)
        if cached is not None and cached[0] is frame:
            jpeg = cached[1]
        else:
            # JPEG encoding takes milliseconds per frame: keep it off the event loop, and
            # keep the frame's pooled buffer from being reused while the thread reads it.
            buffer = frame.buffer.retain() if frame.buffer is not None else None
            try:
                jpeg = await asyncio.to_thread(render_snapshot, frame)
            finally:
                if buffer is not None:
                    buffer.release()
            self._snapshots[sid] = (frame, jpeg)
        return web.Response(body=jpeg, content_type="image/jpeg", headers={"X-Frame-Index": str(frame.index)})

    async def stream_mjpeg(self, request: web.Request) -> web.StreamResponse:
        """The source's annotated frames as ``multipart/x-mixed-replace`` JPEGs, rate-capped.

        The viewer reads the newest frame each time: one that reads slowly skips frames,
        and the graph never waits for it.
        """
        sid = request.match_info["id"]
        if sid not in self._runtime.sources:
            return error(404, f"no source {sid!r}")
        try:
            fps = float(request.query.get("fps", MJPEG_FPS))
        except ValueError:
            fps = -1.0
        if not 0.1 <= fps <= MJPEG_MAX_FPS:
            return error(400, f"fps: expected a number from 0.1 to {MJPEG_MAX_FPS:g}")
        if self._runtime.outputs.relay.ended(sid):
            return error(409, ended_source(sid))
        sub = self._runtime.outputs.relay.subscribe(sid, fps)
        try:
            response = web.StreamResponse(
                headers={"Content-Type": f"multipart/x-mixed-replace; boundary={MJPEG_BOUNDARY}"}
            )
            await response.prepare(request)
            loop = asyncio.get_running_loop()
            due = loop.time()
            while (item := await _next_while_connected(request, sub)) is not None:
                jpeg = await asyncio.to_thread(item.jpeg)
                head = (
                    f"--{MJPEG_BOUNDARY}\r\nContent-Type: image/jpeg\r\n"
                    f"Content-Length: {len(jpeg)}\r\nX-Frame-Index: {item.index}\r\n\r\n"
                )
                await response.write(head.encode() + jpeg + b"\r\n")
                due = max(due + 1.0 / fps, loop.time())
                await asyncio.sleep(due - loop.time())
        except (ConnectionResetError, ConnectionError):
            pass  # the viewer went away
        finally:
            sub.close()
        return response


async def _next_while_connected(request: web.Request, sub: Subscription) -> LiveFrame | None:
    """The subscription's next frame, or None once the viewer has gone.

    A write is what finds a closed connection, and a source that sends no frames (a
    camera that is down) gives nothing to write: without this check each viewer that left
    kept its handler, its subscription and its connection for as long as the source
    stayed silent.
    """
    pending = asyncio.ensure_future(sub.next())
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=VIEWER_CHECK_S)
            if done:
                return pending.result()
            transport = request.transport
            if transport is None or transport.is_closing():
                return None
    finally:
        pending.cancel()
