"""Event clips: the camera's own packets around an event, written without re-encoding.

::

    outputs:
      - type: clips
        dir: clips/                  # relative to the config file
        pre_s: 3                     # kept before the event (from the keyframe at or before it)
        post_s: 5                    # recorded after it
        on: [track_start]            # track_start | detection | zone_enter | zone_exit | line_cross
        labels: [person, car]        # only these objects start a clip; all when empty
        max_size_mb: 1024            # the oldest clips go beyond this total
        max_age_h: 24                # and clips older than this

A :class:`ClipRecorder` listens to the source's demuxed packets (the decode loop's
packet listener) and keeps a ring of them covering ``pre_s`` and the frames the
graph has not published yet, starting at a keyframe. An event in a published
frame (:func:`clip_event`: the frame's ``events``, whatever stage made them, a
new track id or any object) opens a clip: the ring from the last keyframe at or
before ``event - pre_s``, then every packet until ``event + post_s``. So a clip
lasts ``pre_s + post_s`` plus at most one GOP. A frame shown at ``event + post_s``
or later is left out unless one before the end needs it to decode: with B-frames,
the frames just before the end come after the later frame they are predicted from in
decode order, so the packets from the first one shown at or past the end on are kept
to the end of their group (up to the next packet shown later than all before it, or
a keyframe) when a frame before the end is among them, and dropped when none is. A
clip so ends with at most one run of B-frames and its reference frame past the end,
with no frame missing in between; its ``end`` is its last frame's pts (the largest),
not the last packet's. An event shown before a clip's end (its event plus ``post_s``)
is part of it; one at the end or later opens its own clip, also while the one before
still waits for its last packets (clips of one recorder may so record at once). The clip is
muxed on a worker thread as it came from the camera (no decode, no encode), its
first frame at 0, and announced on ``vidpipe.<pipeline>.<source>.clips``
(docs/outputs.md).

The ring is bounded whatever the stream's keyframe interval: it never holds more
than ``RING_MAX_BYTES`` nor spans more than ``pre_s + HEADROOM_S + MAX_GOP_S``
seconds. A stream that sends no keyframe within those bounds loses its pre-roll
(the ring is emptied and starts again at the next keyframe; the packets are
counted and logged). A recording clip stops at ``CLIP_MAX_BYTES``. The ring is
released when the stream ends (reconnect, end of file) or the source stops.

A clip never crosses from one stream to the next: a new stream (a reconnect, the
next pass of a ``loop: true`` file, where the picture jumps back to the clip's
start) ends the clip recording at the seam. A file decodes ahead of publishing, so
the next pass's packets come while events of the pass before are still to be
published: that pass's ring is kept (:class:`_Ended`) until a frame of the next
one is published, and a clip of an event in it is cut from those packets alone,
ending at the seam.

Sources that have no packets (``test://``, WHIP) cannot record clips.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import io
import itertools
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inference.ratelimit import RateLimitedLog
from pipeline.config import ClipsOutputConfig
from pipeline.events import Event
from pipeline.frames import DetectedObject, Frame
from pipeline.outputs.video_file import recording_path

log = logging.getLogger("vidpipe.clips")

__all__ = [
    "CLIP_MAX_BYTES",
    "MAX_GOP_S",
    "PRUNE_GRACE_S",
    "RING_MAX_BYTES",
    "ClipInfo",
    "ClipRecorder",
    "clip_event",
    "prune_clips",
]

# Frames decoded but not yet published (queue + in flight) lag the newest packet by
# about a second; the ring keeps this much beyond pre_s so the pre-roll is still there.
HEADROOM_S = 5.0
# A keyframe interval up to this long still gives a full pre-roll; past it the ring is
# emptied (a camera's "smart" codec may send one keyframe a minute, or one per stream).
MAX_GOP_S = 20.0
# The most one recorder keeps in its ring, and the most one clip may hold: at 16 Mb/s
# the ring of pre_s 3 plus headroom holds 16 MB; a 10-minute post_s would hold 1.2 GB.
RING_MAX_BYTES = 64 * 1024 * 1024
CLIP_MAX_BYTES = 256 * 1024 * 1024
# The most packets kept past a clip's end while waiting for the frames shown before it
# (B-frames come after the frame they are predicted from): a run of 16 B-frames, twice.
MAX_REORDER = 32
# Timestamps closer than this are the same time (pts and event times are floats).
SAME_TIME_S = 1e-6
# Failures of the clips folder, not of the clip: said as the OS says them, with what to do.
FOLDER_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS})
# Retention keeps every clip changed this recently: one being muxed, or written and not yet
# announced, by any recorder of the folder. Muxing writes the file all along, and a clip is
# announced right after it is closed, so a minute covers a slow disk many times over.
PRUNE_GRACE_S = 60.0
# Track ids remembered per source to tell a new track from a known one.
KNOWN_TRACKS = 4096
CLIP_NAME = re.compile(r"^[A-Za-z0-9_.-]+-\d{8}T\d{6}-\d+-[a-z_]+(\.\d+)?\.mp4$")  # .N: a name taken twice


def clip_event(
    objects: Iterable[DetectedObject],
    known_tracks: collections.OrderedDict[int, None],
    on: Collection[str],
    labels: Collection[str] = (),
    events: Iterable[Event] = (),
) -> tuple[str, DetectedObject | Event] | None:
    """The event a frame raises for a clip, if any: ``(type, what raised it)``.

    ``events`` are the frame's events (``zone_enter``, ``line_cross``, ... from a
    zones stage or any other): one whose type is in ``on`` counts first. Then,
    from the objects, ``track_start``: a track id not seen before, and
    ``detection``: any object. ``labels`` limits which events and objects
    count. Every new track id is remembered, whether it raised the event or not.
    """
    found: tuple[str, DetectedObject | Event] | None = None
    for event in events:
        if event.type in on and (not labels or event.label in labels):
            found = (event.type, event)
            break
    for obj in objects:
        if labels and obj.label not in labels:
            continue
        if obj.track_id is not None and obj.track_id not in known_tracks:
            known_tracks[obj.track_id] = None
            if len(known_tracks) > KNOWN_TRACKS:
                known_tracks.popitem(last=False)
            if found is None and "track_start" in on:
                found = ("track_start", obj)
        if found is None and "detection" in on:
            found = ("detection", obj)
    return found


@dataclass(slots=True)
class ClipInfo:
    """A written clip (what the clips message says)."""

    source: str
    path: Path
    event: str
    event_pts: float
    event_frame: int
    label: str
    track_id: int | None
    start: float  # pts of the clip's first packet (a keyframe), on the source's timeline
    end: float  # pts of its last frame (the largest pts in it, not the last packet's)
    packets: int
    bytes: int
    zone: str | None = None
    line: str | None = None
    direction: str | None = None


@dataclass(slots=True)
class _Ended:
    """A stream that ended (a looping file's pass) while frames of it may not be published yet."""

    first_pts: float  # the pts of its first frame: events from there on (to the next one's) are its
    delta: float  # source pts minus stream seconds
    template: Any
    ring: collections.deque[tuple[float, Any]]
    last_end_s: float  # where its last clip ends, in its stream seconds


@dataclass(slots=True)
class _Clip:
    event: str
    event_s: float  # stream seconds
    end_s: float
    event_frame: int
    label: str
    track_id: int | None
    event_pts: float
    stream: Any
    delta: float
    zone: str | None = None
    line: str | None = None
    direction: str | None = None
    packets: list[Any] = field(default_factory=list)
    bytes: int = 0
    # Where the packets at or past ``end_s`` start (decode order), while they may still be needed.
    past: int | None = None
    # A frame before the end came after them: they are references it needs, and stay.
    needed: bool = False
    # The largest pts so far: a packet above it starts the next group of B-frames.
    top: float = -math.inf


def _take(clip: _Clip, seconds: float, packet: Any) -> bool:
    """Add the next packet (decode order) to a recording clip; True when the clip is complete.

    The clip is complete at the first packet that cannot hold a frame shown before the
    end, nor be one such a frame needs: once a packet at or past the end has come, the
    next keyframe or the next packet shown later than every one so far (the next group's
    reference frame). That packet is not part of the clip.
    """
    if clip.past is not None and (
        packet.is_keyframe or seconds > clip.top or len(clip.packets) - clip.past >= MAX_REORDER
    ):
        _settle(clip)
        return True
    if seconds >= clip.end_s - SAME_TIME_S:
        if clip.past is None:
            clip.past = len(clip.packets)
    elif clip.past is not None:
        clip.needed = True
    clip.packets.append((seconds, packet))
    clip.bytes += packet.size
    clip.top = max(clip.top, seconds)
    return False


def _settle(clip: _Clip) -> None:
    """Drop the packets at or past the clip's end that no frame before the end needs."""
    if clip.past is not None and not clip.needed:
        clip.bytes -= sum(packet.size for _, packet in clip.packets[clip.past :])
        del clip.packets[clip.past :]
    clip.past = None


def _seconds(packet: Any) -> float | None:
    ts = packet.pts if packet.pts is not None else packet.dts
    if ts is None or not packet.time_base:
        return None
    return float(ts * packet.time_base)


def _stamped(first: Any, after: Any, stream: Any) -> Any:
    """A copy of ``first`` (no pts, no dts) stamped one frame before ``after``."""
    import av

    rate = stream.average_rate or stream.guessed_rate
    step = after.duration or (int(1 / (rate * after.time_base)) if rate and after.time_base else 1)
    at = (after.dts if after.dts is not None else after.pts) - max(step, 1)
    copy = av.Packet(bytes(first))
    copy.pts = copy.dts = at
    copy.duration = step
    copy.is_keyframe = True
    copy.time_base = after.time_base
    return copy


def _template(stream: Any) -> Any:
    """A copy of ``stream``'s codec parameters that outlives the stream's container.

    The source closes its input container when its stream ends (end of file, a
    reconnect, stop), which frees the stream's parameters; a clip written after
    that from the input stream itself would read freed memory. The copy lives in
    an output container of our own that is never started (it writes nothing).
    """
    import av

    holder = av.open(io.BytesIO(), "w", format="mp4")
    return holder.add_stream_from_template(stream)


class ClipRecorder:
    """One ``type: clips`` output on one source. Packets arrive on the source's thread."""

    def __init__(
        self,
        config: ClipsOutputConfig,
        source: str,
        folder: Path,
        writer: Executor,
        on_clip: Callable[[ClipInfo], None],
    ) -> None:
        self.config = config
        self.source = source
        self.folder = folder
        self._writer = writer
        self._on_clip = on_clip
        self._lock = threading.Lock()
        self._ring: collections.deque[tuple[float, Any]] = collections.deque()
        self._ring_bytes = 0
        # True from an overflow of the ring to the next keyframe.
        self._starved = False
        # The input stream the ring's packets came from (compared by identity, never read
        # after its first packet) and its codec parameters copied out of its container.
        self._stream: Any = None
        self._template: Any = None
        # Source pts minus stream seconds, from the latest decoded frame (constant per connection).
        self._delta: float | None = None
        # The source pts of the stream's first decoded frame: where its events start.
        self._first_pts: float | None = None
        # Streams that ended before all their frames were published (a file decodes ahead),
        # oldest first. Each is let go once a frame of the stream after it is published, so
        # there are never more than the frames decoded ahead (the source's frame pool).
        self._ended: collections.deque[_Ended] = collections.deque()
        # Clips recording (more than one only while the one before waits for its last packets).
        self._active: list[_Clip] = []
        # Stream seconds where the last clip of this stream ends: an event before it is part
        # of that clip, even once the clip is written (a file decodes ahead of publishing).
        self._last_end_s = -math.inf
        # The last stream ended (its ring let go) and no packet of a new one has come: an
        # event of its frames still being published has no clip, for that reason.
        self._stream_gone = False
        # A keyframe that came without timestamps, and its stream: stamped by the next packet.
        self._unstamped: tuple[Any, Any] | None = None
        self._known: collections.OrderedDict[int, None] = collections.OrderedDict()
        # Clips that fail, and those that cannot be cut, are logged once a minute per reason,
        # with a count of the rest.
        self._failures = RateLimitedLog(interval=60.0, logger=log)
        self._warnings = RateLimitedLog(interval=60.0, logger=log, level=logging.WARNING)
        self._closed = False  # the source ended: packets still on their way are not kept
        self.clips = 0
        self.failed = 0
        # Packets the ring let go before their time because of its bounds (no keyframe).
        self.dropped_packets = 0
        self.dropped_bytes = 0

    @property
    def ring_bytes(self) -> int:
        """Bytes of packets in the ring now."""
        return self._ring_bytes

    @property
    def ring_seconds(self) -> float:
        """Stream time the ring spans now."""
        with self._lock:
            return self._ring[-1][0] - self._ring[0][0] if self._ring else 0.0

    # -- source thread ---------------------------------------------------------------------

    def on_packet(self, packet: Any, stream: Any) -> None:
        if packet.size == 0 or self._closed:
            return
        seconds = _seconds(packet)
        if seconds is None:
            # RTSP's first keyframe comes before the sender's clock is known: no pts, no
            # dts. It is kept and stamped from the packet after it, or every clip of the
            # stream's first GOP (an event in its first frames) would have nothing to start at.
            if packet.is_keyframe:
                self._unstamped = (packet, stream)
            return
        if self._unstamped is not None:
            first, first_stream = self._unstamped
            self._unstamped = None
            if first_stream is stream:
                self.on_packet(_stamped(first, packet, stream), stream)
        done: list[_Clip] = []
        with self._lock:
            if stream is not self._stream:
                # A new connection (or a file's next pass): its timestamps start afresh, and
                # the clip recording ends at the seam. The ring stays for the events of the
                # stream's frames that are still on their way to publishing.
                done.extend(self._end_stream(keep=True))
                self._stream = stream
                self._template = _template(stream)
                self._stream_gone = False
            for clip in list(self._active):
                if _take(clip, seconds, packet):
                    done.append(clip)
                    self._active.remove(clip)
                elif clip.bytes >= CLIP_MAX_BYTES:
                    log.warning(
                        "source %s: clip of %s stopped at %d MB (the most a clip holds)",
                        self.source, clip.event, CLIP_MAX_BYTES // 2**20,
                    )  # fmt: skip
                    done.append(clip)
                    self._active.remove(clip)
            if self._ring or packet.is_keyframe:  # a ring starts at a keyframe, or nothing decodes
                self._starved = False
                self._ring.append((seconds, packet))
                self._ring_bytes += packet.size
                self._trim(seconds)
            elif self._starved:  # the ring overflowed and waits for a keyframe: counted too
                self.dropped_packets += 1
                self.dropped_bytes += packet.size
        for finished in done:
            self._writer.submit(self._write, finished)

    def on_frame_time(self, stream_seconds: float, pts: float) -> None:
        self._delta = pts - stream_seconds
        if self._first_pts is None:
            with self._lock:
                self._first_pts = pts

    def _trim(self, newest: float) -> None:
        keep_from = newest - self.config.pre_s - HEADROOM_S
        ring = self._ring
        # Drop whole GOPs while the next keyframe is still old enough to start a clip, or
        # while the ring is over its size and a later keyframe can start it.
        while True:
            nxt = next((i for i in range(1, len(ring)) if ring[i][1].is_keyframe), None)
            if nxt is None:
                break
            over = self._ring_bytes > RING_MAX_BYTES
            if ring[nxt][0] > keep_from and not over:
                break
            for _ in range(nxt):
                _, packet = ring.popleft()
                self._ring_bytes -= packet.size
                if over:
                    self.dropped_packets += 1
                    self.dropped_bytes += packet.size
        span = newest - ring[0][0]
        if self._ring_bytes > RING_MAX_BYTES or span > self.config.pre_s + HEADROOM_S + MAX_GOP_S:
            # No keyframe to cut at within the bounds: let the whole ring go; it starts
            # again at the next keyframe.
            ring_mb = self._ring_bytes / 1e6
            self.dropped_packets += len(ring)
            self.dropped_bytes += self._ring_bytes
            ring.clear()
            self._ring_bytes = 0
            self._starved = True
            self._warnings(
                "no-keyframe",
                f"source {self.source}: no keyframe in {span:.0f} s ({ring_mb:.0f} MB) of stream: the clip "
                f"pre-roll was dropped ({self.dropped_packets} packets, {self.dropped_bytes / 1e6:.0f} MB so "
                "far); clips start at the next keyframe. Set the camera's keyframe interval (GOP) to a "
                "few seconds",
            )

    def _end_stream(self, keep: bool = False) -> list[_Clip]:
        """Under the lock: the stream ended; its ring goes, its clip is finished.

        ``keep``: another stream follows at once (a file's next pass) while this one's
        frames may still be published; the ring is kept for their events. Otherwise
        every ring goes.
        """
        clips, self._active = self._active, []
        if not keep:
            self._ended.clear()
            # Frames of this stream may still be on their way to publishing (a live
            # source's queue): their events find no ring, and the log says why.
            self._stream_gone = self._stream_gone or self._stream is not None
        elif self._ring and self._first_pts is not None and self._delta is not None:
            self._ended.append(
                _Ended(self._first_pts, self._delta, self._template, self._ring, self._last_end_s)
            )
        self._last_end_s = -math.inf  # a new stream's times start afresh
        self._first_pts = None
        self._ring = collections.deque()
        self._ring_bytes = 0
        self._starved = False
        self._stream = None
        self._template = None
        self._delta = None
        self._unstamped = None
        return [clip for clip in clips if clip.packets]

    def stream_ended(self) -> None:
        """The source's stream ended (it reconnects, or stopped): release the ring, write the clip."""
        with self._lock:
            done = self._end_stream()
        for clip in done:
            self._writer.submit(self._write, clip)

    # -- event loop ------------------------------------------------------------------------

    def on_frame(self, frame: Frame) -> None:
        """Look for an event in a published frame; open a clip when one starts."""
        if self._ended:
            # Every published frame lets go of the passes before its own, events or not: a
            # looping file with no events would otherwise keep one ring per pass.
            with self._lock:
                self._forget_published(frame.pts)
        found = clip_event(frame.objects, self._known, self.config.on, self.config.labels, frame.events)
        if found is None:
            return
        event, what = found
        if isinstance(what, Event):
            at_pts, at_frame = what.pts, what.frame
            zone, line, direction = what.zone, what.line, what.direction
        else:
            at_pts, at_frame = frame.pts, frame.index
            zone = line = direction = None
        with self._lock:
            # An event of a stream that has ended (a looping file's pass before) is cut from
            # that stream's packets: its clip ends at the seam at the latest.
            ended = self._ended_at(at_pts)
            if ended is not None:
                ring, delta, template, last_end_s = ended.ring, ended.delta, ended.template, ended.last_end_s
            else:
                ring, template, last_end_s = self._ring, self._template, self._last_end_s
                delta = self._delta if self._delta is not None else 0.0
            event_s = at_pts - delta
            if event_s < last_end_s - SAME_TIME_S:
                # Shown before the last clip's end (recording, or already written when a file
                # decodes ahead): part of that clip. At its end or later, the frame is not in
                # it (a clip holds the frames before its end), so it gets a clip of its own.
                return
            if not ring:
                gone = ended is None and self._stream_gone
                why = (
                    "the stream ended (a reconnect, the source's end) before the frame was published, "
                    "and its clip ring went with it"
                    if gone
                    else "no keyframe with timestamps has come from the stream yet (clips start at a "
                    "keyframe)"
                )
                self._warnings(
                    "stream-gone" if gone else "no-ring",
                    f"source {self.source}: no clip for {event} at frame {at_frame}: {why}",
                )
                return
            start_target = event_s - self.config.pre_s
            start = 0
            for i, (seconds, packet) in enumerate(ring):
                if seconds > start_target:
                    break
                if packet.is_keyframe:
                    start = i
            clip = _Clip(
                event=event, event_s=event_s, end_s=event_s + self.config.post_s, event_frame=at_frame,
                label=what.label, track_id=what.track_id, event_pts=at_pts, stream=template,
                delta=delta, zone=zone, line=line, direction=direction,
            )  # fmt: skip
            if ended is not None:
                ended.last_end_s = clip.end_s
            else:
                self._last_end_s = clip.end_s
            # Packets already past the end (a file decoded far ahead) complete it at once; so
            # does the end of an ended stream's packets.
            complete = ended is not None
            for seconds, packet in itertools.islice(ring, start, None):
                if _take(clip, seconds, packet):
                    complete = True
                    break
            if not complete:
                self._active.append(clip)
            elif clip.packets:
                self._writer.submit(self._write, clip)

    def _ended_at(self, pts: float) -> _Ended | None:
        """Under the lock: the ended stream an event at ``pts`` belongs to; None: the current one."""
        if self._first_pts is not None and pts >= self._first_pts - SAME_TIME_S:
            return None
        return next((e for e in reversed(self._ended) if e.first_pts <= pts + SAME_TIME_S), None)

    def _forget_published(self, pts: float) -> None:
        """Under the lock: a frame at ``pts`` is published; the streams before its own go."""
        while self._ended:
            after = self._ended[1].first_pts if len(self._ended) > 1 else self._first_pts
            if after is None or pts < after - SAME_TIME_S:
                return
            self._ended.popleft()

    def close(self) -> None:
        """The source ended: write the clip that is recording, as far as it got; keep nothing more."""
        self._closed = True
        self.stream_ended()

    # -- writer thread ---------------------------------------------------------------------

    def _failed(self, exc: Exception, clip: _Clip, path: Path) -> None:
        """Log a clip that could not be written: at most once a minute per source and reason.

        A full disk fails every clip of every camera (about one a second each): the line
        says it once, with the count of the rest. A folder that refuses writes says so; any
        other failure is FFmpeg's, in its own words.
        """
        code = exc.errno if isinstance(exc, OSError) else None
        if code in FOLDER_ERRNOS:
            assert code is not None
            if code in (errno.ENOSPC, errno.EDQUOT):
                what = "free space there, or lower max_size_mb"
            else:
                what = "make the folder writable for vidpipe, or choose another dir"
            message = (
                f"source {self.source}: clips not written to {self.folder}: {os.strerror(code)} "
                f"(clip {path.name}); {what}. Clips resume once a write succeeds"
            )
        else:
            message = (
                f"source {self.source}: clip {path} not written: {type(exc).__name__}: {exc} "
                f"(FFmpeg: {_mux_error(clip)})"
            )
        self._failures(f"{self.source}:{code or type(exc).__name__}", message, extra={"source": self.source})

    def _write(self, clip: _Clip) -> None:
        _settle(clip)
        if not clip.packets:
            return
        first_s = clip.packets[0][0]
        # The last frame shown, not the last packet: with B-frames that one is shown earlier.
        last_s = max(seconds for seconds, _ in clip.packets)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.localtime())
        name = f"{self.source}-{stamp}-{int(clip.event_pts * 1000)}-{clip.event}.mp4"
        path = self.folder / name
        try:
            # Claimed exclusively, as recordings are: two clips outputs sharing a folder, or
            # two pipelines with a source of the same id, get .1, .2, ... and never overwrite
            # a clip already announced.
            path = recording_path(path)
            joins = _mux(clip, str(path))
        except Exception as exc:
            self.failed += 1
            path.unlink(missing_ok=True)
            self._failed(exc, clip, path)
            return
        if joins:
            log.warning(
                "source %s: clip %s: the stream's timestamps went back %d time(s) (a restarted "
                "encoder, or lost UDP packets); the parts were joined",
                self.source, path, joins,
            )  # fmt: skip
        self.clips += 1
        info = ClipInfo(
            source=self.source, path=path, event=clip.event, event_pts=clip.event_pts,
            event_frame=clip.event_frame, label=clip.label, track_id=clip.track_id,
            start=first_s + clip.delta, end=last_s + clip.delta, packets=len(clip.packets),
            bytes=path.stat().st_size, zone=clip.zone, line=clip.line, direction=clip.direction,
        )  # fmt: skip
        pruned = prune_clips(
            self.folder, self.config.max_size_mb * 1e6, self.config.max_age_h * 3600, keep=path
        )
        if pruned:
            log.info(
                "source %s: deleted %d older clip(s) for max_size_mb %g / max_age_h %g",
                self.source, len(pruned), self.config.max_size_mb, self.config.max_age_h,
            )  # fmt: skip
        self._on_clip(info)


def _mux(clip: _Clip, target: Any, format: str | None = None) -> int:
    """Write ``clip``'s packets, unchanged, to ``target``. Returns how often its timestamps went back."""
    import av

    base = None
    last_dts: int | None = None
    joins = 0
    with av.open(target, "w", format=format) as out:
        # The template, never the input stream: that one's container may be closed.
        ostream = out.add_stream_from_template(clip.stream)
        for (_, packet), dts in zip(clip.packets, _decode_times(clip.packets), strict=True):
            if base is None:
                # The first frame (a keyframe) is shown at 0. With B-frames it is decoded
                # before it is shown, so the first timestamps to decode are below 0 (the
                # muxer's edit list); from its dts instead, the clip would start late.
                base = packet.pts if packet.pts is not None else dts
            elif dts is not None and last_dts is not None and dts - base <= last_dts:
                # Timestamps went back (an encoder that restarted, lost or reordered UDP
                # packets): the MP4 muxer refuses that, so what follows is joined on after
                # the last packet, as FFmpeg does at a stream discontinuity.
                base = dts - last_dts - (packet.duration or 1)
                joins += 1
            # A copy: muxing consumes a packet's data, and the ring still holds this one.
            copy = av.Packet(bytes(packet))
            copy.pts = None if packet.pts is None or base is None else packet.pts - base
            copy.dts = None if dts is None or base is None else dts - base
            if dts is not None and base is not None:
                last_dts = dts - base
            copy.duration = packet.duration
            copy.is_keyframe = packet.is_keyframe
            copy.time_base = packet.time_base
            copy.stream = ostream
            out.mux(copy)
    return joins


def _decode_times(packets: list[tuple[float, Any]]) -> list[int | None]:
    """The packets' dts, where FFmpeg gave none (its RTSP demuxer, for a stream's first packets).

    Such a packet is decoded before the next one: its dts is just below the next packet's
    (or its own pts when that is earlier). Its pts would not do: with B-frames it is later
    than the next packets' dts, which would look like timestamps going back. Only where
    that is not after the packet before it (the stream's timestamps do go back) is it its pts.
    """
    times = [packet.dts for _, packet in packets]
    made = [False] * len(times)
    later: int | None = None
    for i in reversed(range(len(packets))):
        pts = packets[i][1].pts
        if times[i] is None and pts is not None:
            times[i] = pts if later is None else min(pts, later - 1)
            made[i] = True
        later = times[i] if times[i] is not None else later
    before: int | None = None
    for i, dts in enumerate(times):
        if made[i] and dts is not None and before is not None and dts <= before:
            times[i] = dts = packets[i][1].pts
        before = dts if dts is not None else before
    return times


def _mux_error(clip: _Clip) -> str:
    """FFmpeg's own words for why ``clip`` cannot be muxed (PyAV's exception has only the errno).

    FFmpeg's log is off in PyAV unless asked for, so the clip is muxed again, into memory,
    with the log on for that moment. Only a failed clip pays for this.
    """
    import av

    level = av.logging.get_level()
    av.logging.set_level(av.logging.ERROR)
    try:
        # The failure itself is already known: only its words are wanted.
        with av.logging.Capture() as messages, contextlib.suppress(Exception):
            _mux(clip, io.BytesIO(), format="mp4")
    finally:
        av.logging.set_level(level)
    said = "; ".join(m.strip() for _, _, m in messages if m.strip())
    return said or "no reason given"


def prune_clips(
    folder: Path, max_bytes: float, max_age_s: float, now: float | None = None, keep: Path | None = None
) -> list[Path]:
    """Delete clips older than ``max_age_s``, then the oldest until the rest fit ``max_bytes``.

    Only files named like the clips vidpipe writes are touched, never ``keep`` (the clip
    just written, about to be announced: one clip over the budget alone stays), and never
    a clip changed in the last ``PRUNE_GRACE_S``: another recorder sharing the folder (a
    source, an output, another pipeline) may be writing it or about to announce it.
    Returns what was deleted.
    """
    now = time.time() if now is None else now
    clips = []
    for path in folder.glob("*.mp4"):
        if CLIP_NAME.match(path.name):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            clips.append((st.st_mtime, st.st_size, path))
    clips.sort()
    deleted = []
    total = sum(size for _, size, _ in clips)
    for mtime, size, path in clips:
        if now - mtime <= max_age_s and total <= max_bytes:
            break
        if path == keep or now - mtime < PRUNE_GRACE_S:
            continue
        path.unlink(missing_ok=True)
        deleted.append(path)
        total -= size
    return deleted
