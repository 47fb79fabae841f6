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
graph has not published yet, starting at a keyframe. An event found in a
published frame (:func:`clip_event`, a function of the frame's objects) opens a
clip: the ring from the last keyframe at or before ``event - pre_s``, then every
packet until ``event + post_s``. So a clip lasts ``pre_s + post_s`` plus at
most one GOP. Events while a clip records are part of it. The clip is muxed on
a worker thread as it came from the camera (no decode, no encode) and announced
on ``vidpipe.<pipeline>.<source>.clips`` (docs/outputs.md).

Sources that have no packets (``test://``, WHIP) cannot record clips.
"""

from __future__ import annotations

import collections
import logging
import re
import threading
import time
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config import ClipsOutputConfig
from pipeline.frames import DetectedObject, Frame

log = logging.getLogger("vidpipe.clips")

__all__ = ["ClipInfo", "ClipRecorder", "clip_event", "prune_clips"]

# Frames decoded but not yet published (queue + in flight) lag the newest packet by
# about a second; the ring keeps this much beyond pre_s so the pre-roll is still there.
HEADROOM_S = 5.0
# Track ids remembered per source to tell a new track from a known one.
KNOWN_TRACKS = 4096
CLIP_NAME = re.compile(r"^[A-Za-z0-9_.-]+-\d{8}T\d{6}-\d+-[a-z_]+\.mp4$")


def clip_event(
    objects: Iterable[DetectedObject],
    known_tracks: collections.OrderedDict[int, None],
    on: Collection[str],
    labels: Collection[str] = (),
) -> tuple[str, DetectedObject] | None:
    """The event a frame's objects raise for a clip, if any: ``(type, object)``.

    ``track_start``: a track id not seen before; ``detection``: any object.
    Objects may carry ``events`` (names such as ``zone_enter``, from a zones
    stage); those count when listed in ``on``. ``labels`` limits which objects
    count. Every new track id is remembered, whether it raised the event or not.
    """
    found: tuple[str, DetectedObject] | None = None
    for obj in objects:
        if labels and obj.label not in labels:
            continue
        for name in getattr(obj, "events", None) or ():
            if found is None and name in on:
                found = (str(name), obj)
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
    start: float  # pts of the clip's first packet, on the source's timeline
    end: float  # pts of its last packet
    packets: int
    bytes: int


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
    packets: list[Any] = field(default_factory=list)


def _seconds(packet: Any) -> float | None:
    ts = packet.pts if packet.pts is not None else packet.dts
    if ts is None or not packet.time_base:
        return None
    return float(ts * packet.time_base)


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
        self._stream: Any = None
        # Source pts minus stream seconds, from the latest decoded frame (constant per connection).
        self._delta: float | None = None
        self._active: _Clip | None = None
        self._known: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.clips = 0
        self.failed = 0

    # -- source thread ---------------------------------------------------------------------

    def on_packet(self, packet: Any, stream: Any) -> None:
        seconds = _seconds(packet)
        if seconds is None or packet.size == 0:
            return
        done: _Clip | None = None
        with self._lock:
            if stream is not self._stream:
                # A new connection: its timestamps start afresh; the old ring means nothing.
                self._ring.clear()
                self._stream = stream
                self._delta = None
            if not self._ring and not packet.is_keyframe:
                return  # a ring starts at a keyframe, or a clip could not be decoded
            self._ring.append((seconds, packet))
            self._trim(seconds)
            clip = self._active
            if clip is not None and clip.stream is stream:
                if seconds >= clip.end_s:
                    done, self._active = clip, None
                else:
                    clip.packets.append((seconds, packet))
        if done is not None:
            self._writer.submit(self._write, done)

    def on_frame_time(self, stream_seconds: float, pts: float) -> None:
        self._delta = pts - stream_seconds

    def _trim(self, newest: float) -> None:
        keep_from = newest - self.config.pre_s - HEADROOM_S
        ring = self._ring
        # Drop whole GOPs while the next keyframe is still old enough to start a clip.
        while True:
            nxt = next((i for i in range(1, len(ring)) if ring[i][1].is_keyframe), None)
            if nxt is None or ring[nxt][0] > keep_from:
                return
            for _ in range(nxt):
                ring.popleft()

    # -- event loop ------------------------------------------------------------------------

    def on_frame(self, frame: Frame) -> None:
        """Look for an event in a published frame; open a clip when one starts."""
        found = clip_event(frame.objects, self._known, self.config.on, self.config.labels)
        if found is None:
            return
        event, obj = found
        with self._lock:
            if self._active is not None or not self._ring:
                return  # one clip at a time: this event is inside the one recording
            delta = self._delta if self._delta is not None else 0.0
            event_s = frame.pts - delta
            start_target = event_s - self.config.pre_s
            start = 0
            for i, (seconds, packet) in enumerate(self._ring):
                if seconds > start_target:
                    break
                if packet.is_keyframe:
                    start = i
            clip = _Clip(
                event=event, event_s=event_s, end_s=event_s + self.config.post_s, event_frame=frame.index,
                label=obj.label, track_id=obj.track_id, event_pts=frame.pts, stream=self._stream,
                delta=delta, packets=list(self._ring)[start:],
            )  # fmt: skip
            # Packets already past the end (a file decoded far ahead) close it at once.
            cut = next((i for i, (s, _) in enumerate(clip.packets) if s >= clip.end_s), None)
            if cut is not None:
                clip.packets = clip.packets[:cut]
                self._writer.submit(self._write, clip)
            else:
                self._active = clip

    def close(self) -> None:
        """The source ended: write the clip that is recording, as far as it got."""
        with self._lock:
            clip, self._active = self._active, None
            self._ring.clear()
        if clip is not None and clip.packets:
            self._writer.submit(self._write, clip)

    # -- writer thread ---------------------------------------------------------------------

    def _write(self, clip: _Clip) -> None:
        import av

        first_s = clip.packets[0][0]
        last_s = clip.packets[-1][0]
        stamp = time.strftime("%Y%m%dT%H%M%S", time.localtime())
        name = f"{self.source}-{stamp}-{int(clip.event_pts * 1000)}-{clip.event}.mp4"
        path = self.folder / name
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            base = None
            with av.open(str(path), "w") as out:
                ostream = out.add_stream_from_template(clip.stream)
                for _, packet in clip.packets:
                    if base is None:
                        base = packet.dts if packet.dts is not None else packet.pts
                    # A copy: muxing consumes a packet's data, and the ring still holds this one.
                    copy = av.Packet(bytes(packet))
                    copy.pts = None if packet.pts is None else packet.pts - base
                    copy.dts = None if packet.dts is None else packet.dts - base
                    copy.duration = packet.duration
                    copy.is_keyframe = packet.is_keyframe
                    copy.time_base = packet.time_base
                    copy.stream = ostream
                    out.mux(copy)
        except Exception as exc:
            self.failed += 1
            log.error("source %s: clip %s not written: %s: %s", self.source, path, type(exc).__name__, exc)
            path.unlink(missing_ok=True)
            return
        self.clips += 1
        info = ClipInfo(
            source=self.source, path=path, event=clip.event, event_pts=clip.event_pts,
            event_frame=clip.event_frame, label=clip.label, track_id=clip.track_id,
            start=first_s + clip.delta, end=last_s + clip.delta, packets=len(clip.packets),
            bytes=path.stat().st_size,
        )  # fmt: skip
        prune_clips(self.folder, self.config.max_size_mb * 1e6, self.config.max_age_h * 3600)
        self._on_clip(info)


def prune_clips(folder: Path, max_bytes: float, max_age_s: float, now: float | None = None) -> list[Path]:
    """Delete clips older than ``max_age_s``, then the oldest until the rest fit ``max_bytes``.

    Only files named like the clips vidpipe writes are touched. Returns what was deleted.
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
        path.unlink(missing_ok=True)
        deleted.append(path)
        total -= size
    return deleted
