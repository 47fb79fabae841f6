"""The source registry and the frame copy shared by every PyAV source."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest

from pipeline.config import SourceConfig
from pipeline.frames import Frame
from pipeline.queues import EndOfStream, FrameQueue
from pipeline.sources.base import SourceContext, SourceState
from pipeline.sources.budget import MIB, FrameMemoryBudget
from pipeline.sources.decode import copy_rgb
from pipeline.sources.file import FileSource
from pipeline.sources.pattern import TestPatternSource
from pipeline.sources.registry import create_source, register_source, source_class
from pipeline.sources.rtsp import RtspSource
from pipeline.sources.schemes import SCHEMES, check_url, is_live
from pipeline.sources.whip import WhipSource
from pipeline.urls import derive_id, resolve_url
from samples.make_clip import write_clip


@pytest.mark.parametrize(
    ("url", "cls", "live", "sid"),
    [
        ("/data/clips/lobby.mp4", FileSource, False, "lobby"),
        ("file:///data/clips/gate%201.mp4", FileSource, False, "gate_201"),
        ("test://?width=64&height=48&id=left", TestPatternSource, True, "left"),
        ("rtsp://user:pw@10.0.0.7:554/cam/1", RtspSource, True, "cam_1"),
        ("rtsps://10.0.0.7", RtspSource, True, "10_0_0_7"),
        ("whip://door", WhipSource, True, "door"),
    ],
)
def test_each_scheme_makes_its_source(url: str, cls: type, live: bool, sid: str) -> None:
    assert check_url(url) is None
    assert is_live(url) is live
    assert derive_id(url) == sid
    source = create_source(SourceConfig(url=url, id=sid))
    assert type(source) is cls
    assert source.live is live and source.id == sid


def test_scheme_names_and_unknown_schemes() -> None:
    assert sorted(SCHEMES) == [
        "file",
        "http",
        "https",
        "rtp",
        "rtsp",
        "rtsps",
        "srt",
        "test",
        "udp",
        "v4l2",
        "whip",
    ]
    assert is_live("rtsp") and not is_live("file")
    assert check_url("gopher://u:secret@x/y") == (
        "unsupported source scheme 'gopher' in 'gopher://***@x/y'; "
        "known schemes: file, test, rtsp, rtsps, whip, http, https, udp, rtp, srt, v4l2"
    )
    # A misspelt scheme is named with the one meant.
    assert (
        check_url("rstp://cam/1")
        == "unsupported source scheme 'rstp' in 'rstp://cam/1'; did you mean rtsp://?"
    )
    assert (
        check_url("htps://cdn/a.m3u8")
        == "unsupported source scheme 'htps' in 'htps://cdn/a.m3u8'; did you mean https://?"
    )
    assert check_url(r"C:\clips\a.mp4") is None  # a drive letter is not a scheme


def test_relative_files_resolve_and_other_urls_pass_through(tmp_path: Path) -> None:
    assert resolve_url("clips/a.mp4", tmp_path) == str(tmp_path / "clips" / "a.mp4")
    assert resolve_url("file://clips/a.mp4", tmp_path) == str(tmp_path / "clips" / "a.mp4")
    assert resolve_url("/abs/a.mp4", tmp_path) == "/abs/a.mp4"
    assert resolve_url("rtsp://cam/x", tmp_path) == "rtsp://cam/x"


@pytest.mark.parametrize("width", [100, 101, 1280])
def test_copy_rgb_skips_the_row_padding(width: int) -> None:
    height = 6
    image = np.arange(height * width * 3, dtype=np.uint32).astype(np.uint8).reshape(height, width, 3)
    frame = av.VideoFrame.from_ndarray(image, format="rgb24").reformat(format="yuv444p")
    rgb = frame.reformat(format="rgb24")
    if width == 100:
        assert rgb.planes[0].line_size > width * 3  # FFmpeg pads rows: the case that matters
    out = np.zeros((height, width, 3), np.uint8)
    copy_rgb(frame, out)
    assert np.array_equal(out, frame.to_ndarray(format="rgb24"))
    # An RGB frame is copied as it is, without a conversion.
    copy_rgb(av.VideoFrame.from_ndarray(image, format="rgb24"), out)
    assert np.array_equal(out, image)


def test_a_whip_name_takes_no_user_info_and_names_the_route_and_id_alike() -> None:
    # Before, whip://u:p@door became source id "door" but listened at /whip/u:p@door.
    assert check_url("whip://u:p@door") == "a whip:// URL is whip://<name>: it takes no user or password"
    source = create_source(SourceConfig(url="whip://door", id=derive_id("whip://door")))
    assert isinstance(source, WhipSource)
    assert (source.id, source.name) == ("door", "door")


def test_file_urls_keep_their_host_part_everywhere(tmp_path: Path) -> None:
    # One parser for file:// URLs: the id, the resolved path and the opened path agree.
    url = "file://clips/lobby.mp4"
    assert derive_id(url) == "lobby"
    assert resolve_url(url, tmp_path) == str(tmp_path / "clips" / "lobby.mp4")
    source = create_source(SourceConfig(url=resolve_url(url, tmp_path), id="lobby"))
    assert isinstance(source, FileSource)
    assert source.path == tmp_path / "clips" / "lobby.mp4"


def test_source_classes_register_per_scheme_like_stage_kinds() -> None:
    class Marked(TestPatternSource):
        schemes = ("test",)

    assert source_class("test", live=True) is TestPatternSource
    try:
        assert register_source(Marked) is Marked
        assert type(create_source(SourceConfig(url="test://", id="t"))) is Marked
    finally:
        register_source(TestPatternSource)
    assert type(create_source(SourceConfig(url="test://", id="t"))) is TestPatternSource

    class Finite(FileSource):
        schemes = ("rtsp",)

    with pytest.raises(ValueError, match="Finite: rtsp:// sources are never finite"):
        register_source(Finite)

    class Unknown(FileSource):
        schemes = ("ftp",)

    with pytest.raises(ValueError, match="Unknown: unknown source scheme 'ftp'"):
        register_source(Unknown)
    # Every scheme is served both ways it can be.
    for name, scheme in SCHEMES.items():
        for live in (True, False):
            if scheme.can_be_live if live else scheme.can_be_finite:
                assert source_class(name, live) is not None


class KeptPackets:
    """A packet listener that keeps the kind of each packet's stream."""

    def __init__(self) -> None:
        self.packets: list[str] = []
        self.frame_times = 0

    def on_packet(self, packet: Any, stream: Any) -> None:
        self.packets.append(stream.type)

    def on_frame_time(self, stream_seconds: float, pts: float) -> None:
        self.frame_times += 1


async def test_a_source_is_built_with_its_context_and_only_demuxers_take_packets(tmp_path: Path) -> None:
    clip = write_clip(tmp_path / "clip.mp4", frames=4, fps=30, width=64, height=48)
    listener = KeptPackets()
    budget = FrameMemoryBudget(MIB)
    states: list[SourceState] = []
    context = SourceContext(
        on_state=lambda _s, state, _reason: states.append(state),
        frame_pool_size=5,
        frame_memory=budget,
        packet_listener=listener,
    )
    pattern = create_source(SourceConfig(url="test://?frames=2", id="t"), context)
    assert not TestPatternSource.gives_packets and pattern.packet_listener is None  # it demuxes nothing
    source = create_source(SourceConfig(url=str(clip), id="clip"), context)
    assert FileSource.gives_packets and source.packet_listener is listener
    queue: FrameQueue[Frame] = FrameQueue(8, "block", asyncio.get_running_loop())
    source.start(queue)
    frames: list[Frame] = []
    while not isinstance(item := await asyncio.wait_for(queue.get(), 30), EndOfStream):
        frames.append(item)
    # The pool and the budget are the context's: 5 frames of 64x48 reserved, 4 decoded.
    assert source.frame_pool is not None and source.frame_pool.capacity == 5
    assert budget.used == 5 * 64 * 48 * 3
    assert [f.index for f in frames] == [0, 1, 2, 3] and listener.frame_times == 4
    assert listener.packets.count("video") >= 4
    assert states == [SourceState.UP, SourceState.STOPPED]
    for f in frames:
        f.release()
    source.release_pools()
    assert budget.used == 0


async def test_a_looping_file_runs_on_one_frame_after_each_pass(tmp_path: Path) -> None:
    clip = write_clip(tmp_path / "clip.mp4", frames=5, fps=10, width=64, height=48)
    source = create_source(SourceConfig(url=str(clip), id="clip", loop=True))
    queue: FrameQueue[Frame] = FrameQueue(32, "block", asyncio.get_running_loop())
    source.start(queue)
    pts: list[float] = []
    while len(pts) < 12:
        frame = await asyncio.wait_for(queue.get(), 30)
        assert isinstance(frame, Frame)
        pts.append(frame.pts)
        frame.release()
    source.stop()
    while not isinstance(await asyncio.wait_for(queue.get(), 30), EndOfStream):
        pass
    # Three passes of 0.0-0.4 s at 10 fps: a steady 0.1 s step across the seams too.
    assert [round(p, 6) for p in pts] == [round(0.1 * i, 6) for i in range(12)]
