"""Recordings under a burst of frames, and recordings that cannot be written."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import av
import numpy as np
import pytest

from pipeline.config import load_config
from pipeline.frames import Frame
from pipeline.outputs.video_file import VideoFileWriter
from pipeline.runtime import PipelineStartError, Runtime
from pipeline.stages.base import Stage, StageContext, StageOptions
from tests.pipeline.stack import stage_kinds, until

DROPPED = "vidpipe_recording_frames_dropped_total"


class FirstFrameGate(Stage):
    """Holds each source's first frame until ``open`` is set (a seam, not a model): the
    frames queued behind it are then published in a burst, as after a slow first inference."""

    kind = "first_frame_gate"

    def __init__(self, options: StageOptions, context: StageContext) -> None:
        super().__init__(options, context)
        self.open = asyncio.Event()
        self.waiting = 0

    async def process(self, frame: Frame) -> None:
        if frame.index == 0:
            self.waiting += 1
            await self.open.wait()


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def frames_in(path: Path) -> int:
    with av.open(str(path)) as container:
        return sum(1 for _ in container.decode(video=0))


async def test_a_burst_after_a_slow_start_is_recorded_whole_on_a_live_source(tmp_path: Path) -> None:
    # A live camera whose first frame is held while 20 more queue up behind it (its queue
    # holds all 40, so none is dropped there): the burst that follows is more than the
    # worker holds in pooled buffers, and before the backlog of copies the recording left
    # all but two of those frames out.
    path = tmp_path / "p.yaml"
    path.write_text(
        "pipeline: rec\n"
        "sources: [{id: cam, url: 'test://?fps=30&width=320&height=240&frames=40', queue_size: 64}]\n"
        "stages: [{name: gate, type: first_frame_gate}]\n"
        "outputs: [{type: file, path: 'out/{source}.mp4', annotate: false}]\n"
    )
    published: list[int] = []
    with stage_kinds(FirstFrameGate):
        rt = Runtime(load_config(path), nats_url=None, on_published=lambda f: published.append(f.index))
        await rt.start()
    gate = next(s for s in rt.stages if isinstance(s, FirstFrameGate))
    try:
        await until(lambda: gate.waiting == 1 and len(rt.sources["cam"].queue) >= 20, 60, "a queue behind")
        gate.open.set()
        await rt.wait(60)
    finally:
        await rt.stop()
    assert published == list(range(40))
    assert rt.metrics.registry.get_sample_value(DROPPED, {"pipeline": "rec", "source": "cam"}) in (None, 0)
    assert frames_in(tmp_path / "out" / "cam.mp4") == 40


async def test_a_recording_that_cannot_be_written_is_said_once_and_the_sources_go_on(tmp_path: Path) -> None:
    # A file stands where source a's folder would be made; b records as usual.
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "a").write_bytes(b"")
    path = tmp_path / "p.yaml"
    path.write_text(
        "pipeline: rec\n"
        "sources:\n"
        "  - {id: a, url: 'test://?fps=30&width=160&height=120&frames=20'}\n"
        "  - {id: b, url: 'test://?fps=30&width=160&height=120&frames=20'}\n"
        "outputs: [{type: file, path: 'out/{source}/rec.mp4'}]\n"
    )
    handler = Records()
    logger = logging.getLogger("vidpipe.outputs")
    logger.addHandler(handler)
    published = {"a": 0, "b": 0}

    def count(frame: Frame) -> None:
        published[frame.source] += 1

    rt = Runtime(load_config(path), nats_url=None, on_published=count)
    try:
        await rt.start()
        await rt.wait(60)
        await rt.stop()
    finally:
        logger.removeHandler(handler)
    assert published == {"a": 20, "b": 20}
    errors = [r.getMessage() for r in handler.records if r.levelno >= logging.ERROR]
    assert errors == [
        f"source a: cannot record to {tmp_path / 'out' / 'a' / 'rec.mp4'}: File exists ({tmp_path / 'out' / 'a'}); "
        "this recording is stopped, the source goes on"
    ]
    assert frames_in(tmp_path / "out" / "b" / "rec.mp4") == 20


async def test_an_output_folder_that_cannot_be_made_stops_the_start_at_its_line(tmp_path: Path) -> None:
    (tmp_path / "taken").write_bytes(b"")
    path = tmp_path / "p.yaml"
    path.write_text(
        "pipeline: rec\nsources: [{url: 'test://?frames=1'}]\noutputs:\n  - {type: clips, dir: taken/clips}\n"
    )
    rt = Runtime(load_config(path), nats_url=None)
    try:
        with pytest.raises(PipelineStartError) as info:
            await rt.start()
    finally:
        await rt.stop()
    assert str(info.value) == (
        f"{path}:4: outputs[0].dir: cannot write to {tmp_path / 'taken' / 'clips'}: Not a directory"
    )


@pytest.mark.parametrize(("codec", "suffix"), [("mpeg4", ".avi"), ("mpeg4", ".mov"), ("libvpx-vp9", ".webm")])
def test_each_suggested_encoder_records_a_file_that_plays_at_the_frames_timing(
    tmp_path: Path, codec: str, suffix: str
) -> None:
    # The encoders validate's hint names (libx264 has its own tests): mpeg4 refused the
    # 90 kHz clock and left an empty file.
    writer = VideoFileWriter(tmp_path / f"out{suffix}", codec=codec)
    image = np.zeros((120, 160, 3), np.uint8)
    for i in range(15):
        image[:, :, 1] = 10 * i
        writer.write(image, i / 15)
    writer.close()
    assert writer.path is not None and writer.frames == 15
    with av.open(str(writer.path)) as f:
        rate = f.streams.video[0].average_rate
        frames = list(f.decode(video=0))
    if suffix != ".avi":  # AVI states its tick rate, not the frames'
        assert rate == 15  # the frames' own rate, not a fixed 25
    assert len(frames) == 15
    assert [round(float(fr.time), 3) for fr in frames] == [round(i / 15, 3) for i in range(15)]


def test_libx265_records_without_writing_to_stderr(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # x265 prints its banner and statistics on the process's stderr, which broke JSON logs.
    writer = VideoFileWriter(tmp_path / "hevc.mp4", codec="libx265")
    for i in range(5):
        writer.write(np.full((64, 96, 3), 20 * i, np.uint8), i / 10)
    writer.close()
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")
    assert writer.path is not None
    with av.open(str(writer.path)) as f:
        assert f.streams.video[0].codec_context.name == "hevc"
        assert len(list(f.decode(video=0))) == 5


def test_codec_h264_is_libx264_with_its_crf(tmp_path: Path) -> None:
    # FFmpeg's h264 encoder is libx264: the crf (and zerolatency) must reach it as well.
    sizes = {}
    rng = np.random.default_rng(7)
    images = [rng.integers(0, 256, (120, 160, 3), dtype=np.uint8) for _ in range(8)]
    for codec, crf in (("h264", 10), ("h264", 45), ("libx264", 45)):
        writer = VideoFileWriter(tmp_path / f"{codec}-{crf}.mp4", codec=codec, crf=crf)
        for i, image in enumerate(images):
            writer.write(image, i / 10)
        writer.close()
        assert writer.path is not None
        sizes[codec, crf] = writer.path.stat().st_size
    assert sizes["h264", 10] > 2 * sizes["h264", 45]
    assert sizes["h264", 45] == sizes["libx264", 45]


def test_a_picture_that_changes_size_goes_on_in_a_new_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A WHIP publisher that turns its phone: the encoder's size is fixed, so the frames of
    # the new size were cut and stretched into the old one.
    caplog.set_level(logging.INFO, logger="vidpipe.outputs")
    writer = VideoFileWriter(tmp_path / "cam.mp4")
    parts = [((240, 320), (200, 40, 40), 10), ((320, 240), (40, 40, 200), 8), ((240, 320), (40, 200, 40), 6)]
    paths, t = [], 0
    for shape, colour, count in parts:
        for _ in range(count):
            writer.write(np.full((*shape, 3), colour, np.uint8), t / 10)
            t += 1
        paths.append(writer.path)
    writer.close()
    assert paths == [tmp_path / "cam.mp4", tmp_path / "cam.1.mp4", tmp_path / "cam.2.mp4"]
    for path, (shape, colour, count) in zip(paths, parts, strict=True):
        assert path is not None
        with av.open(str(path)) as f:
            images = [frame.to_ndarray(format="bgr24") for frame in f.decode(video=0)]
        assert len(images) == count, path
        assert {image.shape[:2] for image in images} == {shape}, path
        assert np.abs(images[-1].astype(int) - colour).max() < 12, path
    said = [r.getMessage() for r in caplog.records if "picture changed" in r.getMessage()]
    assert said == [
        f"recording {paths[0]}: the picture changed to 240x320; recording goes on in a new file",
        f"recording {paths[1]}: the picture changed to 320x240; recording goes on in a new file",
    ]
