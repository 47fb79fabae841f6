"""WebRTC egress over WHEP: a source's annotated frames to a browser or any WHEP client.

``POST /whep/{source}`` with an SDP offer (``application/sdp``, receive-only
video) answers with the server's SDP and a session ``Location``;
``DELETE /whep/{source}/{session}`` ends it. Each session's video track reads
the source's :class:`~pipeline.outputs.relay.FrameRelay` like any other viewer:
latest frame only, so a slow peer never holds the graph back.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from inference.errors import VidpipeError
from inference.ratelimit import RateLimitedLog
from pipeline.outputs.relay import FrameRelay, Subscription, ended_source
from pipeline.webrtc_guard import PENDING_TIMEOUT, PendingSession, candidate_count, unconnected_reason

log = logging.getLogger("vidpipe.whep")

__all__ = ["MAX_WHEP_SESSIONS", "WhepError", "WhepServer"]

MAX_WHEP_SESSIONS = 16
WHEP_FPS = 30.0
VIDEO_CLOCK = 90000


class WhepError(VidpipeError):
    """A WHEP request that cannot be served: ``status`` and a message for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _relay_track(sub: Subscription, on_end: Callable[[], None]) -> Any:
    """A track of the relay's frames; ``on_end`` is called once the relay ends (the source went)."""
    from aiortc.mediastreams import MediaStreamError, VideoStreamTrack
    from av import VideoFrame

    class RelayTrack(VideoStreamTrack):
        """Frames from a relay subscription, stamped on the 90 kHz video clock as they come."""

        def __init__(self) -> None:
            super().__init__()
            self._t0: float | None = None

        async def recv(self) -> VideoFrame:
            item = await sub.next()
            if item is None:
                self.stop()
                on_end()
                raise MediaStreamError
            loop = asyncio.get_running_loop()
            now = loop.time()
            if self._t0 is None:
                self._t0 = now
            image = item.image
            h, w = image.shape[:2]
            if w % 2 or h % 2:
                # H.264 (x264 in 4:2:0) refuses odd sizes: a viewer that negotiated it got no
                # video at all from a 321x241 camera. Drop the odd column and row, as recordings do.
                image = image[: h - h % 2, : w - w % 2]
            frame = VideoFrame.from_ndarray(image, format="bgr24")
            frame.pts = int((now - self._t0) * VIDEO_CLOCK)
            frame.time_base = Fraction(1, VIDEO_CLOCK)
            return frame

    return RelayTrack()


@dataclass
class _Session:
    id: str
    source: str
    pc: Any
    sub: Subscription
    # Counted against the viewer's address until the connection is up or ends.
    unconnected: PendingSession | None = None
    expiry: asyncio.TimerHandle | None = None
    # ICE candidates in the offer (after the guard): none says why a session never connected.
    candidates: int = 0

    def settle(self) -> None:
        """Connected or ended: no longer pending, no expiry."""
        if self.expiry is not None:
            self.expiry.cancel()
            self.expiry = None
        if self.unconnected is not None:
            self.unconnected.settled()


class WhepServer:
    """The WHEP sessions of one HTTP server."""

    def __init__(self, relay: FrameRelay, max_sessions: int = MAX_WHEP_SESSIONS) -> None:
        self.relay = relay
        self.max_sessions = max_sessions
        self.sessions: dict[str, _Session] = {}
        self._closing: set[asyncio.Task[bool]] = set()
        self._refusals = RateLimitedLog(logger=log, level=logging.WARNING)

    async def offer(
        self, source: str, sdp: str, unconnected: PendingSession | None = None
    ) -> tuple[str, str]:
        """Answer a viewer's offer; returns ``(session id, answer SDP)``.

        A session whose peer has not connected within ``PENDING_TIMEOUT`` seconds
        is ended; ``unconnected`` is settled when it connects or ends.
        """
        from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

        if len(self.sessions) >= self.max_sessions:
            # A viewer that left without DELETE (a closed tab) holds its place until its
            # connection is found dead: say so, here and in the log, or the 429 is a riddle.
            problem = (
                f"{self.max_sessions} WHEP sessions already; end one first (a viewer that left "
                "without DELETE holds its place until its connection times out, about 30 s)"
            )
            self._refusals("whep-full", f"source {source}: WHEP viewer refused: {problem}")
            raise WhepError(429, problem)
        if "m=video" not in sdp:
            raise WhepError(400, "bad SDP offer: it asks for no video")
        if self.relay.ended(source):
            raise WhepError(409, ended_source(source))
        # No ICE servers: the default would be a public STUN server (see WHIP).
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        sub = self.relay.subscribe(source, WHEP_FPS)
        session = _Session(
            secrets.token_urlsafe(12), source, pc, sub, unconnected, candidates=candidate_count(sdp)
        )
        self.sessions[session.id] = session

        @pc.on("connectionstatechange")
        async def on_state() -> None:
            if pc.connectionState == "connected":
                session.settle()
                log.info("source %s: WHEP viewer connected (session %s)", source, session.id)
            if pc.connectionState in ("failed", "closed"):
                if session.id in self.sessions:
                    log.info("source %s: WHEP session %s ended: the viewer's connection %s",
                             source, session.id, pc.connectionState)  # fmt: skip
                await self.end(session.id)

        try:
            await pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
            video = next((t for t in pc.getTransceivers() if t.kind == "video"), None)
            if video is None:
                raise WhepError(400, "bad SDP offer: it asks for no video")
            video.sender.replaceTrack(_relay_track(sub, lambda: self._end_soon(session, "its source ended")))
            video.direction = "sendonly"
            await pc.setLocalDescription(await pc.createAnswer())
        except WhepError:
            await self.end(session.id)
            raise
        except Exception as exc:  # aiortc raises ValueError and friends on malformed SDP
            await self.end(session.id)
            raise WhepError(400, f"bad SDP offer: {exc or type(exc).__name__}") from None
        session.expiry = asyncio.get_running_loop().call_later(PENDING_TIMEOUT, self._expire, session)
        log.info("source %s: WHEP session %s answered; the viewer connects", source, session.id)
        return session.id, pc.localDescription.sdp

    def _expire(self, session: _Session) -> None:
        session.expiry = None
        if session.pc.connectionState != "connected":
            self._end_soon(session, unconnected_reason(session.candidates))

    def _end_soon(self, session: _Session, why: str) -> None:
        """End ``session`` from a callback (a timer, a track), if it is still open."""
        if self.sessions.get(session.id) is not session:
            return
        log.info("source %s: WHEP session %s ended: %s", session.source, session.id, why)
        task = asyncio.ensure_future(self.end(session.id))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def end(self, session_id: str, source: str | None = None) -> bool:
        session = self.sessions.get(session_id)
        if session is None or (source is not None and session.source != source):
            return False
        del self.sessions[session_id]
        session.settle()
        session.sub.close()
        await session.pc.close()
        return True

    async def close(self) -> None:
        for sid in list(self.sessions):
            await self.end(sid)
