"""WebRTC ingest (WHIP): a browser, OBS or GStreamer pushes video to vidpipe.

::

    http:
      listen: 127.0.0.1:8080
    sources:
      - url: whip://door          # publishers POST their SDP offer to /whip/door
        stall_timeout: 5          # no frame for this long: the publisher is gone
        open_timeout: 10          # after the offer, the first frame must come within this

The source waits for a publisher (state ``connecting``, reason ``waiting for a
publisher``). ``POST /whip/door`` with ``Content-Type: application/sdp`` gets the
answer (201, ``Location: /whip/door/<session>``); the first frame puts the source
``up``. ``DELETE`` on the Location ends the session (``connecting``, ``publisher
left``); a peer whose connection fails or that sends nothing for ``stall_timeout``
is dropped (``backoff``, ``publisher lost: ...``). Either way the next publisher
can POST again. One publisher at a time; a second one gets 409.

Threading: aiortc decodes on its own thread and delivers frames on the event loop;
this source has no thread of its own. For each frame it takes a pooled buffer on
the loop (never waiting: a dry pool drops the frame as ``pool_empty``), converts
YUV to RGB into it on a worker thread (:func:`asyncio.to_thread`), and puts it in
the queue back on the loop, where a live queue drops the oldest frame instead of
blocking. State changes (first frame, publisher left, stall) stay on the loop, so a
frame converted while its session was being torn down is discarded instead of
flipping the state back to ``up``. Frames are converted one at a time, in order;
when conversion falls behind, the newest received frame replaces the waiting one
and the replaced one counts as ``queue_full``.

A publisher may change its video size mid-stream (a phone turned on its side, a
browser lowering its send resolution): each change is logged (at most one line a
second per source, counting the rest), the source's frame pool is made anew for
the new size, and messages carry the new width and height from that frame on. The
tracks end at the change, as at a reconnect: the picture is another one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from inference.errors import VidpipeError
from inference.memory import BufferHandle
from inference.ratelimit import RateLimitedLog
from pipeline.config import SourceConfig
from pipeline.frames import Frame
from pipeline.queues import FrameQueue
from pipeline.sources.base import ReconnectReason, Source, SourceContext, SourceError, SourceState
from pipeline.sources.decode import copy_rgb
from pipeline.urls import whip_name
from pipeline.webrtc_guard import PENDING_TIMEOUT, PendingSession, candidate_count, unconnected_reason

log = logging.getLogger("vidpipe.whip")

WAITING = "waiting for a publisher"
PUBLISHER_LEFT = "publisher left"
MAX_SDP_BYTES = 64 * 1024
DECODABLE_CODECS = frozenset({"VP8", "H264"})  # what aiortc receives and decodes


class WhipError(VidpipeError):
    """A WHIP request that cannot be served; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(eq=False)
class WhipSession:
    """One publisher's peer connection."""

    id: str
    pc: Any  # aiortc.RTCPeerConnection
    started: float = field(default_factory=time.time)
    receiver: asyncio.Task[None] | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    # The newest received frame not yet converted, with its arrival time.
    pending: tuple[Any, float] | None = None
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    first_pts: float | None = None
    skipped: int = 0
    # Width and height of the last frame converted: a change is logged.
    size: tuple[int, int] | None = None
    # ICE candidates in the offer (after the guard): none says why a session never connected.
    candidates: int = 0
    # Counted against the publisher's address until the connection is up or ends.
    unconnected: PendingSession | None = None
    expiry: asyncio.TimerHandle | None = None


class WhipSource(Source):
    """A live source fed by one WebRTC publisher at a time."""

    schemes = ("whip",)

    def __init__(self, config: SourceConfig, context: SourceContext | None = None) -> None:
        super().__init__(config, context)
        self.name = whip_name(config.url)
        self.session: WhipSession | None = None
        # How the last publisher's session ended: the label of the next reconnect.
        self._ended_by: ReconnectReason | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing: set[asyncio.Task[None]] = set()
        # A publisher flipping its size every frame must not write a line per frame.
        self._resized = RateLimitedLog(interval=1.0, logger=log, level=logging.INFO)
        # Buffers are taken on the event loop, which must never wait for one: a dry pool drops.
        self.emit_blocks = False
        self.set_state(SourceState.CONNECTING, WAITING)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, queue: FrameQueue[Frame]) -> None:
        # Nothing runs until a publisher POSTs its offer (see the module docstring).
        self._queue = queue

    def stop(self, reason: str = "stop requested") -> None:
        """Stop the source, end its stream and close the publisher's peer connection, if any."""
        super().stop(reason)
        self._finish(SourceState.STOPPED, self.stop_reason)
        if self.session is None or self._loop is None or self._loop.is_closed():
            return
        session = self.session
        with contextlib.suppress(RuntimeError):  # the loop is already shutting down
            self._loop.call_soon_threadsafe(self._schedule_end, session)

    def _schedule_end(self, session: WhipSession) -> None:
        task = asyncio.ensure_future(self._end(session, SourceState.STOPPED, "stopped", None))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def closed(self) -> None:
        """Wait until a peer connection being closed by :meth:`stop` is closed."""
        if self._closing:
            await asyncio.gather(*list(self._closing), return_exceptions=True)

    # -- WHIP --------------------------------------------------------------------------------

    async def accept(self, offer: str, unconnected: PendingSession | None = None) -> tuple[str, str]:
        """Answer a publisher's SDP offer; returns ``(session id, answer SDP)``.

        Raises :class:`WhipError` (400 bad offer, 409 busy, 503 stopping). A session
        whose peer has not connected within ``PENDING_TIMEOUT`` seconds is ended
        (``publisher lost: not connected``); ``unconnected`` is settled when it
        connects or ends.
        """
        from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

        if self.stopping:
            raise WhipError(503, f"source {self.id} is stopping")
        if self.session is not None:
            # The session id stays out of the message: its Location is the publisher's to end.
            raise WhipError(
                409, f"source {self.id} already has a publisher; it must DELETE its session first"
            )
        problem = _check_offer(offer)
        if problem:
            raise WhipError(400, f"bad SDP offer: {problem}")
        self._loop = asyncio.get_running_loop()
        # No ICE servers: the default would be a public STUN server, which a camera
        # network usually cannot reach, and waiting for it delays every answer.
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        # Claimed before the first await so a concurrent second POST gets 409.
        session = WhipSession(
            id=secrets.token_urlsafe(12), pc=pc, unconnected=unconnected, candidates=candidate_count(offer)
        )
        self.session = session

        @pc.on("track")
        def on_track(track: Any) -> None:
            if self.session is not session:
                return
            if track.kind == "video" and session.receiver is None:
                session.receiver = asyncio.ensure_future(self._receive(session, track))
                session.tasks += [session.receiver, asyncio.ensure_future(self._convert(session))]
            else:
                # aiortc queues received frames without bound until someone reads them:
                # read and discard audio (and any extra video) so memory stays flat.
                session.tasks.append(asyncio.ensure_future(_discard_frames(track)))

        @pc.on("connectionstatechange")
        async def on_connection_state() -> None:
            state = pc.connectionState
            if state == "connected":
                _settle(session)
                if self.session is session:
                    self._connected(session)
            if state in ("failed", "closed"):
                label: ReconnectReason = "connection_failed" if state == "failed" else "connection_closed"
                await self._end(session, SourceState.BACKOFF, f"publisher lost: connection {state}", label)

        try:
            await pc.setRemoteDescription(RTCSessionDescription(sdp=offer, type="offer"))
            if not any(
                t.kind == "video" and t.direction in ("recvonly", "sendrecv") for t in pc.getTransceivers()
            ):
                raise WhipError(400, "bad SDP offer: it sends no video")
            await pc.setLocalDescription(await pc.createAnswer())
            answer = pc.localDescription.sdp
            if not _video_accepted(answer):
                raise WhipError(400, "bad SDP offer: no supported video codec (offer VP8 or H.264)")
        except WhipError:
            await self._discard(session)
            raise
        except Exception as exc:  # aiortc raises ValueError and friends on malformed SDP
            await self._discard(session)
            raise WhipError(400, f"bad SDP offer: {exc or type(exc).__name__}") from None
        session.expiry = self._loop.call_later(PENDING_TIMEOUT, self._expire, session)
        log.debug("source %s: publisher offered (session %s)", self.id, session.id)
        return session.id, answer

    def _connected(self, session: WhipSession) -> None:
        """The publisher's connection is up (ICE and DTLS done): only now has it come back.
        An offer whose connection never comes up is no reconnect (it ends as ``timeout``)."""
        if self._ended_by is not None:
            # A publisher coming back counts as a reconnect, labelled by how the last one ended.
            self.count_reconnect(self._ended_by)
        log.info("source %s: publisher connected (session %s)", self.id, session.id)

    async def end_session(self, session_id: str) -> bool:
        """The publisher's DELETE; False if ``session_id`` is not the active session."""
        session = self.session
        # As bytes: compare_digest refuses a str that is not ASCII (a path may hold any).
        given = session_id.encode("utf-8", "surrogateescape")
        if session is None or not secrets.compare_digest(session.id.encode(), given):
            return False
        await self._end(session, SourceState.CONNECTING, PUBLISHER_LEFT, "publisher_left")
        return True

    def _expire(self, session: WhipSession) -> None:
        """A session that has not connected in time: end it, freeing the source for another."""
        session.expiry = None
        if self.session is session and session.pc.connectionState != "connected":
            reason = f"publisher lost: {unconnected_reason(session.candidates)}"
            task = asyncio.ensure_future(self._end(session, SourceState.BACKOFF, reason, "timeout"))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _discard(self, session: WhipSession) -> None:
        _settle(session)
        if self.session is session:
            self.session = None
        await session.pc.close()

    async def _end(
        self, session: WhipSession, state: SourceState, reason: str, label: ReconnectReason | None
    ) -> None:
        """End ``session`` once; later calls for the same session do nothing.

        ``reason`` is what the API shows; ``label`` is the metric label of the reconnect
        the next publisher will count (None: the source is stopping, there is no next).
        """
        if self.session is not session:
            return
        self.session = None
        _settle(session)
        if label is not None:
            self._ended_by = label
        if not self.stopping:
            self.set_state(state, reason)
            log.debug("source %s: session %s ended: %s", self.id, session.id, reason)
        if session.skipped:
            log.info(
                "source %s: %d frame(s) of session %s skipped while converting",
                self.id,
                session.skipped,
                session.id,
            )
        for task in session.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        await session.pc.close()

    async def _receive(self, session: WhipSession, track: Any) -> None:
        """Take frames off the track as they come; :meth:`_convert` works on the newest."""
        from aiortc.mediastreams import MediaStreamError

        # The first frame waits for ICE and DTLS as well, so it gets the open timeout.
        timeout = self.config.open_timeout
        # Keep pts increasing across publishers (each starts its RTP clock anywhere).
        self._pts_offset = (self._last_kept_pts + 1e-3) if self._last_kept_pts is not None else 0.0
        while self.session is session and not self.stopping:
            try:
                frame = await asyncio.wait_for(track.recv(), timeout)
            except TimeoutError:
                await self._end(
                    session, SourceState.BACKOFF, f"publisher lost: no frame for {timeout:g}s", "stalled"
                )
                return
            except MediaStreamError:
                await self._end(session, SourceState.BACKOFF, "publisher lost: track ended", "track_ended")
                return
            timeout = self.config.stall_timeout
            # Live: when conversion falls behind, the newest frame replaces the waiting one,
            # so latency stays bounded instead of aiortc's queue growing.
            if session.pending is not None:
                session.skipped += 1
                # The same overflow a camera's queue counts, one step earlier.
                self._drop("queue_full")
            session.pending = (frame, time.time())
            session.wakeup.set()

    async def _convert(self, session: WhipSession) -> None:
        """Convert the newest received frame into a pooled buffer off the loop, then queue it."""
        while self.session is session and not self.stopping:
            await session.wakeup.wait()
            session.wakeup.clear()
            if session.pending is None:
                continue
            frame, capture_ts = session.pending
            session.pending = None
            if frame.pts is not None and frame.time_base is not None:
                pts = float(frame.pts * frame.time_base)
            else:
                pts = capture_ts
            if session.first_pts is None:
                session.first_pts = pts
            self._note_size(session, frame.width, frame.height)
            try:
                reserved = self._reserve(pts - session.first_pts, (frame.height, frame.width, 3))
            except SourceError as exc:  # over max_pixels: this publisher's stream is refused
                await self._end(session, SourceState.BACKOFF, exc.problem, "error")
                return
            if reserved is None:
                continue  # dropped (max_fps, pool_empty) and counted
            pts, buffer = reserved
            conversion = asyncio.ensure_future(asyncio.to_thread(copy_rgb, frame, buffer.array))
            try:
                await asyncio.shield(conversion)
            except BaseException:
                # Cancelled (the session ended) or failed: the worker may still be writing
                # into the buffer, so it goes back to the pool only once the worker is done.
                conversion.add_done_callback(functools.partial(_release_after, buffer))
                raise
            if self.session is not session or self.stopping:
                buffer.release()  # ended while converting: the frame belongs to a gone publisher
                return
            if not self._publish(buffer, pts, capture_ts):
                return

    def _note_size(self, session: WhipSession, width: int, height: int) -> None:
        """Log a change of the publisher's video size: boxes change scale with it."""
        old, session.size = session.size, (width, height)
        if old is not None and old != session.size:
            # Another picture (turned, rescaled): boxes of the old size match nothing in the
            # new one, so the tracks end here, as at a reconnect, and no line is crossed by
            # the jump.
            self._break_stream()
            self._resized(
                self.id,
                f"source {self.id}: the publisher changed its video from {old[0]}x{old[1]} to "
                f"{width}x{height} (session {session.id}); messages carry the new width and "
                "height from here on",
            )


def _release_after(buffer: BufferHandle, conversion: asyncio.Future[None]) -> None:
    buffer.release()
    if not conversion.cancelled() and conversion.exception() is not None:
        log.debug("frame conversion failed: %r", conversion.exception())


def _settle(session: WhipSession) -> None:
    """The session connected or ended: no longer pending, no expiry."""
    if session.expiry is not None:
        session.expiry.cancel()
        session.expiry = None
    if session.unconnected is not None:
        session.unconnected.settled()


async def _discard_frames(track: Any) -> None:
    from aiortc.mediastreams import MediaStreamError

    with contextlib.suppress(MediaStreamError):
        while True:
            await track.recv()


def _check_offer(offer: str) -> str | None:
    """A short reason the offer is not a usable SDP offer, or None."""
    if not offer.strip():
        return "the body is empty"
    if not offer.lstrip().startswith("v=0"):
        return "it does not start with 'v=0'"
    lines = offer.splitlines()
    if not any(line.startswith("m=video ") for line in lines):
        return "it has no video media section (m=video)"
    if not any(line.startswith("a=ice-ufrag:") for line in lines):
        return "it has no ICE credentials (a=ice-ufrag)"
    if not any(line.startswith("a=fingerprint:") for line in lines):
        return "it has no DTLS fingerprint (a=fingerprint)"
    if not _video_codecs(lines) & DECODABLE_CODECS:
        return "no supported video codec (offer VP8 or H.264)"
    return None


def _video_codecs(lines: list[str]) -> set[str]:
    """Upper-case codec names of the offer's video sections (``a=rtpmap:96 VP8/90000``)."""
    codecs: set[str] = set()
    in_video = False
    for line in lines:
        if line.startswith("m="):
            in_video = line.startswith("m=video ")
        elif in_video and line.startswith("a=rtpmap:"):
            _, _, encoding = line.partition(" ")
            codecs.add(encoding.split("/")[0].strip().upper())
    return codecs


def _video_accepted(answer: str) -> bool:
    """Whether the answer accepts a video section (a rejected one has port 0 or no codec)."""
    for line in answer.splitlines():
        if line.startswith("m=video "):
            fields = line.split()
            if len(fields) >= 4 and fields[1] != "0":
                return True
    return False


__all__ = ["WhipError", "WhipSession", "WhipSource"]
