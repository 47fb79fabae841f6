"""``Outputs``: the runtime's one entry point for live views, recordings and clips.

::

    outputs:
      - {type: file, path: "out/{source}-{start}.mp4", annotate: true}
      - {type: clips, dir: clips/, pre_s: 3, post_s: 5, on: [track_start, line_cross]}

After a frame is published the runtime hands it to :meth:`Outputs.frame_published`.
A source nobody watches and nothing records costs a dictionary look-up there.
Otherwise the frame's buffer is kept and a per-source worker thread draws on a
copy (:mod:`pipeline.annotate`), feeds the source's recordings and offers the
result to live viewers through the :class:`FrameRelay`:

- a recording needs every frame: a file source waits for the worker (nothing is
  lost, as decoding waits for the graph); a live source's frames past the
  ``MAX_PENDING`` the worker holds are copied out of the frame pool, up to
  ``BACKLOG_FRAMES`` (and ``BACKLOG_BYTES``) of them (a burst after a slow first
  inference, the encoder opening), and only beyond that dropped from the
  recording (``recording_dropped``);
- a recording that cannot be written (a folder that cannot be created, an
  encoder this FFmpeg lacks) is said once, with its path, and stopped for that
  source; the others go on;
- viewers need only the newest frame, at most as often as the fastest viewer
  asks: frames above that rate, or while the worker is busy, are not drawn.

Clip recorders get every published frame on the event loop (a cheap look at
its objects and at the events any stage attached to it: the one way events
reach outputs) and every packet on the source's thread. When a live source's
stream ends (it goes to backoff) the runtime calls :meth:`Outputs.stream_ended`
so the clip rings let their packets go.

Each written clip is handed to the ``publish`` callback (the runtime's
:meth:`~pipeline.stages.publish.Publisher.publish_clip`), which sends it as
events are sent: queued while NATS is away, acknowledged in JetStream mode,
with ``Nats-Msg-Id: <pipeline>/<source>/<stream id>/<event frame>/clip-<k>``
(``<k>``: the place of its ``clips`` output among the pipeline's).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from pipeline.annotate import annotate, to_bgr
from pipeline.config import ClipsOutputConfig, FileOutputConfig, PipelineConfig, SourceConfig
from pipeline.frames import Frame
from pipeline.outputs.clips import ClipInfo, ClipRecorder
from pipeline.outputs.relay import FrameRelay, LiveFrame
from pipeline.outputs.video_file import RecordingError, VideoFileWriter
from pipeline.sources.base import PacketListener

log = logging.getLogger("vidpipe.outputs")

__all__ = ["CLIPS_SCHEMA", "ClipPublish", "Outputs", "clip_message", "clips_schema", "clips_subject"]

CLIPS_SCHEMA = "vidpipe.clips/v1"
# Frames a source's worker may hold (each keeps a pooled buffer): the frame pool has
# four spare buffers beyond the queue and frames in flight, and the snapshot keeps one.
MAX_PENDING = 2
# Copied frames a live source's recording may have waiting beyond those, at most so many
# bytes (per source): a burst of about two seconds at 15 fps, a second of 720p at 15 fps.
# A longer one drops frames from the recording; a stop waits for at most these.
BACKLOG_FRAMES = 30
BACKLOG_BYTES = 48 * 1024 * 1024

# Sends a clips message: ``publish(subject, source, message, stream id, key)``, ``key`` being
# ``<event frame>/clip-<k>``; it returns at once (the message may wait for NATS).
ClipPublish = Callable[[str, str, dict[str, Any], str, str], None]


def clips_subject(prefix: str, pipeline: str, source: str) -> str:
    """``vidpipe.<pipeline>.<source>.clips``."""
    return f"{prefix}.{pipeline}.{source}.clips"


def _applies(sources: list[str], source: str) -> bool:
    return not sources or source in sources


@dataclass
class _SourceOutputs:
    source: str
    live: bool
    writers: list[tuple[FileOutputConfig, VideoFileWriter]]
    clips: list[ClipRecorder]
    worker: ThreadPoolExecutor | None = None
    pending: int = 0  # frames at the worker holding a pooled buffer
    copied: int = 0  # frames at the worker copied out of the pool (BACKLOG_FRAMES)
    copied_bytes: int = 0  # their bytes (BACKLOG_BYTES)
    room: asyncio.Event = field(default_factory=asyncio.Event)
    last_view: float = 0.0
    recording_dropped: int = 0

    def executor(self) -> ThreadPoolExecutor:
        if self.worker is None:
            self.worker = ThreadPoolExecutor(1, thread_name_prefix=f"annotate-{self.source}")
        return self.worker


class _Fanout:
    """The one packet listener of a source, handing packets to each of its clip recorders."""

    def __init__(self, recorders: list[ClipRecorder]) -> None:
        self.recorders = recorders

    def on_packet(self, packet: Any, stream: Any) -> None:
        for r in self.recorders:
            r.on_packet(packet, stream)

    def on_frame_time(self, stream_seconds: float, pts: float) -> None:
        for r in self.recorders:
            r.on_frame_time(stream_seconds, pts)


class Outputs:
    """Live views, annotated recordings and event clips of every source of a pipeline."""

    def __init__(
        self,
        config: PipelineConfig,
        publish: ClipPublish | None = None,
        on_recording_drop: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        # Told the source of each frame a live recording leaves out (metrics and the log).
        self._on_recording_drop = on_recording_drop
        self.relay = FrameRelay()
        # Sends a clips message (the runtime's publisher: outbox or acks, as events go).
        self._publish = publish
        self._sources: dict[str, _SourceOutputs] = {}
        self._clip_writer = ThreadPoolExecutor(1, thread_name_prefix="clips")
        self._loop: asyncio.AbstractEventLoop | None = None
        # Workers finishing the files of ended sources; close() waits for them.
        self._finishing: list[ThreadPoolExecutor] = []
        self.clips: list[ClipInfo] = []

    def _path(self, template: str, source: str) -> Path:
        return (Path(self.config.base_dir) / template.replace("{source}", source)).resolve()

    def add_source(
        self, source: SourceConfig, *, gives_packets: bool, stream_id: str = ""
    ) -> PacketListener | None:
        """Set up the outputs that apply to ``source``; the packet listener to build it with, if any.

        ``gives_packets``: whether its class demuxes packets (event clips are cut from them).
        ``stream_id``: this run of the source, as in its messages' ``Nats-Msg-Id``.
        """
        self._loop = asyncio.get_running_loop()
        sid = source.source_id
        self.relay.begin(sid)
        writers = [
            (o, VideoFileWriter(self._path(o.path, sid), o.codec, o.crf))
            for o in self.config.outputs
            if isinstance(o, FileOutputConfig) and _applies(o.sources, sid)
        ]
        clips_outputs = [o for o in self.config.outputs if isinstance(o, ClipsOutputConfig)]
        clips = [
            ClipRecorder(o, sid, self._path(o.dir, sid), self._clip_writer, self._announcer(stream_id, k))
            for k, o in enumerate(clips_outputs)
            if _applies(o.sources, sid)
        ]
        if clips and not gives_packets:
            log.warning("source %s: no packets to cut clips from (%s); clips off", sid, source.scheme)
            clips = []
        self._sources[sid] = _SourceOutputs(sid, source.live is True, writers, clips)
        return _Fanout(clips) if clips else None

    async def frame_published(self, frame: Frame) -> None:
        """A frame was published: feed clips, recordings and viewers (see the module doc)."""
        out = self._sources.get(frame.source)
        if out is None:
            return
        for clip in out.clips:
            clip.on_frame(frame)
        fps = self.relay.max_fps(frame.source)
        now = time.monotonic()
        view = fps > 0 and now - out.last_view >= 0.95 / fps
        record = bool(out.writers)
        if not (view or record):
            return
        copied = 0
        if out.pending >= MAX_PENDING:
            if not record:
                return  # viewers get a later frame
            if out.live:
                copied = frame.image.nbytes
                if out.copied >= BACKLOG_FRAMES or out.copied_bytes + copied > BACKLOG_BYTES:
                    out.recording_dropped += 1
                    if self._on_recording_drop is not None:
                        self._on_recording_drop(frame.source)
                    return
                # The pool's buffer goes back now; the worker draws on a copy.
                frame = dataclasses.replace(frame, image=frame.image.copy(), buffer=None)
            while out.pending >= MAX_PENDING and not copied:
                out.room.clear()
                await out.room.wait()
        if view:
            out.last_view = now
        buffer = frame.buffer.retain() if frame.buffer is not None and not copied else None
        if copied:
            out.copied += 1
            out.copied_bytes += copied
        else:
            out.pending += 1
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(out.executor(), self._draw, out, frame, view)

        def done(f: asyncio.Future[LiveFrame | None]) -> None:
            if buffer is not None:
                buffer.release()
            if copied:
                out.copied -= 1
                out.copied_bytes -= copied
            else:
                out.pending -= 1
            out.room.set()
            if f.cancelled():
                return
            if f.exception() is not None:
                log.error("source %s: annotation failed: %r", out.source, f.exception())
                return
            item = f.result()
            if item is not None:
                self.relay.publish(item)

        future.add_done_callback(done)

    @staticmethod
    def _draw(out: _SourceOutputs, frame: Frame, view: bool) -> LiveFrame | None:
        """On the source's worker thread: draw once, write every recording, return the view."""
        plain = to_bgr(frame)
        drawn: Any = None
        if view or any(o.annotate for o, _ in out.writers):
            drawn = annotate(frame, plain.copy() if not all(o.annotate for o, _ in out.writers) else plain)
        for options, writer in out.writers:
            if writer.failed:
                continue
            try:
                writer.write(drawn if options.annotate else plain, frame.pts)
            except RecordingError as exc:
                log.error("source %s: %s; this recording is stopped, the source goes on", out.source, exc)
        return LiveFrame(frame.source, frame.index, frame.pts, drawn) if view else None

    def _close_source(self, out: _SourceOutputs) -> None:
        for clip in out.clips:
            clip.close()

        def finish() -> None:
            for _, writer in out.writers:
                try:
                    writer.close()
                except Exception as exc:
                    log.error("source %s: recording %s not finished: %r", out.source, writer.path, exc)

        if out.worker is not None:
            out.worker.submit(finish)
            out.worker.shutdown(wait=False)
            self._finishing.append(out.worker)
        else:
            finish()

    def stream_ended(self, source: str) -> None:
        """The source's stream ended and it will reconnect: release its clip rings (any thread)."""
        out = self._sources.get(source)
        if out is not None:
            for clip in out.clips:
                clip.stream_ended()

    def forget_source(self, source: str) -> None:
        """The source ended or was removed: finish its files and clips, end its viewers."""
        self.relay.end(source)
        out = self._sources.pop(source, None)
        if out is not None:
            self._close_source(out)

    async def close(self) -> None:
        """Finish every recording and clip and announce the clips (at shutdown)."""
        self.relay.end_all()
        outs = list(self._sources.values())
        self._sources.clear()
        for out in outs:
            self._close_source(out)
        workers, self._finishing = self._finishing, []
        for worker in workers:
            await asyncio.get_running_loop().run_in_executor(None, worker.shutdown, True)
        # The announcements of the last clips run on the loop before this returns; the
        # publisher's close waits for their messages.
        await asyncio.get_running_loop().run_in_executor(None, self._clip_writer.shutdown, True)

    # -- clips -----------------------------------------------------------------------------

    def _announcer(self, stream_id: str, output: int) -> Callable[[ClipInfo], None]:
        """What a clip recorder calls, on the clip writer thread, with each clip it wrote."""

        def written(info: ClipInfo) -> None:
            # The message goes out from the event loop.
            loop = self._loop
            if loop is None or loop.is_closed():
                return
            loop.call_soon_threadsafe(self._announce, info, stream_id, output)

        return written

    def _announce(self, info: ClipInfo, stream_id: str = "", output: int = 0) -> None:
        self.clips.append(info)
        del self.clips[:-100]
        log.info("source %s: clip %s (%s, %.1fs)", info.source, info.path, info.event, info.end - info.start)
        if self._publish is None:
            return
        subject = clips_subject(self.config.nats.subject_prefix, self.config.pipeline, info.source)
        message = clip_message(self.config.pipeline, info)
        self._publish(subject, info.source, message, stream_id, clip_key(info.event_frame, output))


def clip_key(event_frame: int, output: int) -> str:
    """The tail of a clip's ``Nats-Msg-Id`` after the stream id: ``<event frame>/clip-<output>``.

    Two clips of one output never open at the same event frame (a later event at that frame
    is inside the first clip), so the frame and the output's place make the clip unique
    within a run of its source, and the same on every retry.
    """
    return f"{event_frame}/clip-{output}"


def _seconds(value: float) -> float:
    """Seconds to the microsecond, never ``-0.0`` (a first frame at the very start)."""
    return round(value, 6) + 0.0


def clip_message(pipeline: str, info: ClipInfo) -> dict[str, Any]:
    """The ``vidpipe.clips/v1`` payload (docs/outputs.md)."""
    event: dict[str, Any] = {"type": info.event, "pts": _seconds(info.event_pts), "frame": info.event_frame,
                             "label": info.label}  # fmt: skip
    if info.track_id is not None:
        event["track_id"] = info.track_id
    if info.zone is not None:
        event["zone"] = info.zone
    if info.line is not None:
        event["line"] = info.line
        event["direction"] = info.direction
    return {
        "schema": CLIPS_SCHEMA,
        "pipeline": pipeline,
        "source": info.source,
        "path": str(info.path),
        "start": _seconds(info.start),
        "end": _seconds(info.end),
        "duration": _seconds(info.end - info.start),
        "event": event,
        "bytes": info.bytes,
        "created_ts": round(time.time(), 6),
    }


def clips_schema() -> dict[str, Any]:
    """The JSON Schema of the ``vidpipe.clips/v1`` message (``pipeline/schemas/clips.v1.json``)."""
    text = resources.files("pipeline").joinpath("schemas/clips.v1.json").read_text()
    schema: dict[str, Any] = json.loads(text)
    return schema
