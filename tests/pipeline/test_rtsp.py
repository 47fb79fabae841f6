"""RTSP sources against a real GStreamer RTSP server and a real nats-server.

The server runs as a child process of the system Python (tests/support/rtsp_server.py);
the pipeline runs in-process so its metrics and logs can be read directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.backoff import backoff_delay
from pipeline.config import PipelineConfig, ReconnectConfig, SourceConfig, load_config
from pipeline.frames import DetectedObject, Frame
from pipeline.nats_server import EmbeddedNats
from pipeline.queues import EndOfStream, FrameQueue
from pipeline.redact import redact_text
from pipeline.runtime import Runtime
from pipeline.sources.base import SourceState
from pipeline.sources.rtsp import RtspSource
from pipeline.stages.base import Stage, StageContext, StageOptions
from tests.conftest import Collector
from tests.pipeline.stack import stage_kinds
from tests.support.raw_rtsp import RawListener
from tests.support.rtsp_server import RtspTestServer, free_port, gstreamer_available

needs_gstreamer = pytest.mark.skipif(
    not gstreamer_available(), reason="needs /usr/bin/python3 with PyGObject and gst-rtsp-server"
)

SECRET = "s3cr3t-pw"
# Short timeouts keep every failure path to a second or two.
FAST = {
    "open_timeout": 2.0,
    "read_timeout": 3.0,
    "stall_timeout": 1.0,
    "reconnect": {"min_delay": 0.1, "max_delay": 0.5, "jitter": 0.0},
}


@pytest.fixture
def rtsp_server() -> Iterator[RtspTestServer]:
    if not gstreamer_available():
        pytest.skip("needs /usr/bin/python3 with PyGObject and gst-rtsp-server")
    server = RtspTestServer({"/live": "live"}).start()
    try:
        yield server
    finally:
        server.stop()


def make_config(tmp_path: Path, sources: list[dict[str, Any]], **extra: Any) -> PipelineConfig:
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump({"pipeline": "cams", "sources": sources, **extra}))
    return load_config(path)


@contextlib.asynccontextmanager
async def running(cfg: PipelineConfig, nats_url: str) -> AsyncIterator[Runtime]:
    runtime = Runtime(cfg, nats_url=nats_url)
    await runtime.start()
    try:
        yield runtime
    finally:
        await runtime.stop()


async def until(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll until ``condition`` holds; returns the time.monotonic() it did."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)
    return time.monotonic()


def metric(runtime: Runtime, name: str, **labels: str) -> float:
    value = runtime.metrics.registry.get_sample_value(name, {"pipeline": "cams", **labels})
    return 0.0 if value is None else value


def source_lines(caplog: pytest.LogCaptureFixture, source: str) -> list[logging.LogRecord]:
    prefix = f"source {source}: "
    return [r for r in caplog.records if r.name == "vidpipe.runtime" and r.getMessage().startswith(prefix)]


# -- pure functions ---------------------------------------------------------------------------


def test_backoff_doubles_from_min_delay_caps_at_max_and_jitters() -> None:
    cfg = ReconnectConfig(min_delay=0.1, max_delay=0.8, jitter=0.25)
    middle = [round(backoff_delay(n, cfg, 0.5), 6) for n in range(6)]
    assert middle == [0.1, 0.2, 0.4, 0.8, 0.8, 0.8]
    assert backoff_delay(2, cfg, 0.0) == pytest.approx(0.4 * 0.75)
    assert backoff_delay(2, cfg, 0.999999) == pytest.approx(0.4 * 1.25, rel=1e-5)
    assert backoff_delay(10_000, cfg, 0.5) == 0.8  # no overflow after a very long outage


def test_credentials_are_scrubbed_from_ffmpeg_text() -> None:
    url = f"rtsp://admin:{SECRET}@127.0.0.1:554/cam"
    text = f"Connection refused: '{url}' (auth admin:{SECRET}) rtsp://other:pw@host/x"
    scrubbed = redact_text(text, url)
    assert SECRET not in scrubbed
    assert "other:pw" not in scrubbed
    assert scrubbed == "Connection refused: 'rtsp://***@127.0.0.1:554/cam' (auth ***) rtsp://***@host/x"


def test_ffmpeg_options_follow_transport_and_timeouts() -> None:
    tcp = RtspSource(SourceConfig(url="rtsp://127.0.0.1/x", id="a", read_timeout=2.5))
    assert tcp.open_options() == {
        "rtsp_transport": "tcp",
        "timeout": "2500000",
        "allowed_media_types": "video",
        "analyzeduration": "500000",
        "flags": "low_delay",
    }
    assert tcp.open_timeout() == (10.0, 2.5)
    udp = RtspSource(SourceConfig(url="rtsp://127.0.0.1/x", id="b", transport="udp"))
    options = udp.open_options()
    assert options["rtsp_transport"] == "udp"
    assert options["max_delay"] == "100000"


# -- against the GStreamer server ---------------------------------------------------------------


@needs_gstreamer
async def test_camera_publishes_frames_in_order(
    rtsp_server: RtspTestServer, nats_server: EmbeddedNats, collector: Collector, tmp_path: Path
) -> None:
    cfg = make_config(tmp_path, [{"id": "cam", "url": rtsp_server.url(), **FAST}])
    await collector.start(nats_server.url)
    async with running(cfg, nats_server.url) as runtime:
        await until(lambda: len(collector.by_source("cam")) >= 10, 10, "10 messages from cam")
        assert metric(runtime, "vidpipe_source_up", source="cam") == 1.0
        assert runtime.sources["cam"].source.state == SourceState.UP
    messages = collector.by_source("cam")
    indices = [m["frame"] for m in messages]
    assert indices == sorted(set(indices))
    assert {(m["width"], m["height"]) for m in messages} == {(320, 240)}
    pts = [m["pts"] for m in messages]
    assert pts == sorted(pts)
    assert all(m["capture_ts"] <= m["publish_ts"] for m in messages)


async def test_decode_cuda_without_a_gpu_fails_the_camera_once_and_others_go_on(
    rtsp_server: RtspTestServer, nats_server: EmbeddedNats, collector: Collector, tmp_path: Path
) -> None:
    from inference.device import gpu_available

    if gpu_available()[0]:
        pytest.skip("this machine has a GPU")
    cfg = make_config(
        tmp_path,
        [
            {"id": "nv", "url": rtsp_server.url(), "decode": "cuda", **FAST},
            {"id": "cam", "url": rtsp_server.url(), **FAST},
        ],
    )
    await collector.start(nats_server.url)
    async with running(cfg, nats_server.url) as runtime:
        nv = runtime.sources["nv"].source
        await until(lambda: nv.state == SourceState.FAILED, 20, "nv failed")
        await until(lambda: len(collector.by_source("cam")) >= 5, 20, "5 messages from cam")
        # Failed at its first attempt: no later one would find a GPU.
        assert metric(runtime, "vidpipe_source_reconnects_total", source="nv", reason="error") == 0
        assert nv.reason.startswith("source nv: decode: cuda is not possible here (")
        assert nv.reason.endswith(
            "); it needs an NVIDIA GPU, its driver and an FFmpeg with CUDA: set decode: auto to fall "
            "back to the CPU, or decode: cpu"
        )


@needs_gstreamer
async def test_udp_transport(
    rtsp_server: RtspTestServer, nats_server: EmbeddedNats, collector: Collector, tmp_path: Path
) -> None:
    cfg = make_config(tmp_path, [{"id": "cam", "url": rtsp_server.url(), "transport": "udp", **FAST}])
    await collector.start(nats_server.url)
    async with running(cfg, nats_server.url):
        await until(lambda: len(collector.by_source("cam")) >= 5, 10, "5 messages over UDP")


@needs_gstreamer
async def test_server_outage_reconnects_and_other_sources_keep_flowing(
    rtsp_server: RtspTestServer,
    nats_server: EmbeddedNats,
    collector: Collector,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    cfg = make_config(
        tmp_path,
        [
            {"id": "cam", "url": rtsp_server.url(), **FAST},
            {"id": "pattern", "url": "test://?width=64&height=48&fps=15"},
        ],
    )
    await collector.start(nats_server.url)
    async with running(cfg, nats_server.url) as runtime:
        await until(lambda: len(collector.by_source("cam")) >= 5, 10, "cam up")
        rtsp_server.kill()
        await until(lambda: runtime.sources["cam"].source.state == SourceState.BACKOFF, 3, "backoff")
        await until(lambda: metric(runtime, "vidpipe_source_up", source="cam") == 0.0, 1, "up=0")
        await asyncio.sleep(1.5)  # the camera stays away a while; the source keeps retrying
        rtsp_server.start()
        back, back_wall = time.monotonic(), time.time()
        # Frames decoded before the kill may still be on their way: wait for one decoded after.
        seen = await until(
            lambda: any(m["capture_ts"] > back_wall for m in collector.by_source("cam")), 5, "cam back"
        )
        assert seen - back < 5.0
        await until(lambda: metric(runtime, "vidpipe_source_up", source="cam") == 1.0, 5, "up=1")
        assert metric(runtime, "vidpipe_source_reconnects_total", source="cam", reason="end_of_stream") == 1
        assert metric(runtime, "vidpipe_source_reconnects_total", source="cam", reason="refused") >= 1
        assert runtime.sources["cam"].source.stats.reconnects >= 2
    cam = [m["frame"] for m in collector.by_source("cam")]
    assert cam == sorted(set(cam)), "frame indices must stay unique and increasing across reconnects"
    # The pattern source never noticed: no gap in its stream across the outage.
    pattern = [m["publish_ts"] for m in collector.by_source("pattern")]
    assert len(pattern) > 30
    assert max(b - a for a, b in itertools.pairwise(pattern)) < 1.0
    lines = [r.getMessage() for r in source_lines(caplog, "cam")]
    url = rtsp_server.url()
    assert lines[0] == f"source cam: connecting ({url})"
    assert lines[1] == "source cam: up"
    assert lines[2] == f"source cam: end of stream from {url}; retry 1 in 0.10s"
    assert lines[3] == f"source cam: cannot connect to {url}: connection refused; retry 2 in 0.20s"
    # One line per state change: every failed attempt while the server was away, then up.
    second_up = lines.index("source cam: up", 2)
    for retry, line in enumerate(lines[3:second_up], start=2):
        assert line.startswith(f"source cam: cannot connect to {url}: connection refused; retry {retry} in ")
    assert second_up >= 4
    assert lines[second_up + 1 :] == ["source cam: stopped (stop requested)"]
    assert not any(r.getMessage().startswith("source pattern: ") and "backoff" in r.getMessage()
                   for r in caplog.records)  # fmt: skip


@needs_gstreamer
async def test_stalled_stream_is_detected_while_ffmpeg_blocks(
    rtsp_server: RtspTestServer,
    nats_server: EmbeddedNats,
    collector: Collector,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    # read_timeout (3 s) is longer than stall_timeout (1 s): only the watchdog can fire in time.
    cfg = make_config(tmp_path, [{"id": "cam", "url": rtsp_server.url(), **FAST}])
    await collector.start(nats_server.url)
    async with running(cfg, nats_server.url) as runtime:
        await until(lambda: len(collector.by_source("cam")) >= 5, 10, "cam up")
        rtsp_server.pause()  # connection open, nothing sent: FFmpeg waits in a read
        paused = time.monotonic()
        try:
            stalled = await until(
                lambda: runtime.sources["cam"].source.state == SourceState.BACKOFF, 3, "stall"
            )
        finally:
            rtsp_server.resume()
        assert stalled - paused < 1.0 + 0.7
        reason = runtime.sources["cam"].source.reason
        assert reason == f"stalled: no frame for 1s from {rtsp_server.url()}; retry 1 in 0.10s"
        await until(lambda: runtime.sources["cam"].source.state == SourceState.UP, 6, "up again")
        assert metric(runtime, "vidpipe_source_reconnects_total", source="cam", reason="stalled") == 1


@pytest.mark.parametrize("scheme", ["udp", "rtp"])
async def test_a_udp_port_nobody_sends_to_is_no_answer_not_an_io_error(
    nats_server: EmbeddedNats, tmp_path: Path, scheme: str
) -> None:
    url = f"{scheme}://127.0.0.1:{free_port()}"
    cfg = make_config(tmp_path, [{"id": "enc", "url": url, **{**FAST, "read_timeout": 1.0}}])
    async with running(cfg, nats_server.url) as runtime:
        source = runtime.sources["enc"].source
        await until(lambda: source.state == SourceState.BACKOFF, 20, "the first attempt given up")
        assert re.fullmatch(rf"no answer from {url} in 1\.\d+s; retry 1 in 0\.10s", source.reason), (
            source.reason
        )

        def counted(reason: str) -> float:
            return metric(runtime, "vidpipe_source_reconnects_total", source="enc", reason=reason)

        await until(lambda: counted("timeout") >= 1, 20, "the reconnect counted")
        assert counted("error") == 0


async def test_closed_port_is_reported_redacted_and_retried_with_growing_backoff(
    nats_server: EmbeddedNats,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.DEBUG)
    port = free_port()  # nothing listens there
    url = f"rtsp://user:{SECRET}@127.0.0.1:{port}/x"
    shown = f"rtsp://***@127.0.0.1:{port}/x"
    cfg = make_config(
        tmp_path,
        [{"id": "cam", "url": url, "reconnect": {"min_delay": 0.1, "max_delay": 0.8, "jitter": 0.0}}],
    )
    async with running(cfg, nats_server.url) as runtime:
        await until(lambda: len(source_lines(caplog, "cam")) >= 7, 6, "six failed attempts")
        run = runtime.sources["cam"]
        assert run.source.state == SourceState.BACKOFF
        described = run.report()
        rendered = runtime.metrics.render().decode()
    records = [r for r in source_lines(caplog, "cam") if r.levelno == logging.WARNING]
    messages = [r.getMessage() for r in records]
    delays = ["0.10", "0.20", "0.40", "0.80", "0.80"]
    for i, delay in enumerate(delays):
        assert (
            messages[i]
            == f"source cam: cannot connect to {shown}: connection refused; retry {i + 1} in {delay}s"
        )
    times = [r.created for r in records[: len(delays) + 1]]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    for gap, expected in zip(gaps, [0.1, 0.2, 0.4, 0.8, 0.8], strict=True):
        assert expected <= gap < expected + 0.25, gaps
    assert gaps[0] < gaps[1] < gaps[2] < gaps[3]
    assert described.url == shown
    assert described.reason.startswith(f"cannot connect to {shown}: connection refused; retry ")
    assert 'vidpipe_source_reconnects_total{pipeline="cams",reason="refused",source="cam"}' in rendered
    assert 'vidpipe_source_up{pipeline="cams",source="cam"} 0.0' in rendered
    out, err = capfd.readouterr()
    for text in (caplog.text, rendered, str(described), out, err):
        assert SECRET not in text
        assert "user:" not in text


async def test_silent_server_times_out_and_is_retried(
    nats_server: EmbeddedNats, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    accepted: list[float] = []
    writers: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(time.monotonic())
        writers.append(writer)  # keep the connection open, answer nothing

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    url = f"rtsp://127.0.0.1:{port}/x"
    cfg = make_config(
        tmp_path,
        [{"id": "cam", "url": url, "open_timeout": 1.0, "read_timeout": 1.0, "stall_timeout": 1.0,
          "reconnect": {"min_delay": 0.1, "max_delay": 0.2, "jitter": 0.0}}],
    )  # fmt: skip
    try:
        async with running(cfg, nats_server.url) as runtime:
            started = time.monotonic()
            failed = await until(
                lambda: runtime.sources["cam"].source.state == SourceState.BACKOFF, 4, "timeout"
            )
            assert failed - started < 1.0 + 1.0
            assert runtime.sources["cam"].source.reason.startswith(f"no answer from {url} in ")
            await until(lambda: len(accepted) >= 2, 4, "a second attempt")
            await until(
                lambda: (
                    metric(runtime, "vidpipe_source_reconnects_total", source="cam", reason="timeout") >= 1
                ),
                1,
                "reconnect counted",
            )
    finally:
        for w in writers:
            w.close()
        server.close()
        await server.wait_closed()
    warnings = [r.getMessage() for r in source_lines(caplog, "cam") if r.levelno == logging.WARNING]
    assert warnings[0].startswith(f"source cam: no answer from {url} in 1.")
    assert warnings[0].endswith("s; retry 1 in 0.10s")


async def test_a_reconnect_attempt_under_way_says_so_not_the_wait_before_it(
    nats_server: EmbeddedNats, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with RawListener() as silent:  # accepts and never answers: every attempt blocks for open_timeout
        url = f"rtsp://127.0.0.1:{silent.port}/x"
        cfg = make_config(
            tmp_path,
            [{"id": "cam", "url": url, "open_timeout": 1.0, "read_timeout": 1.0,
              "reconnect": {"min_delay": 0.1, "max_delay": 0.2, "jitter": 0.0}}],
        )  # fmt: skip
        async with running(cfg, nats_server.url) as runtime:
            source = runtime.sources["cam"].source
            await until(lambda: silent.connections >= 2, 5, "the second attempt to connect")
            state, reason = source.state, source.reason
            report = runtime.sources["cam"].report()
    warnings = [r.getMessage() for r in source_lines(caplog, "cam") if r.levelno == logging.WARNING]
    # The first attempt timed out; its wait was logged and is over: the second attempt is on.
    first = warnings[0].removeprefix("source cam: ")
    assert first.startswith(f"no answer from {url} in 1.") and first.endswith("s; retry 1 in 0.10s")
    failure = first.removesuffix("; retry 1 in 0.10s")
    assert state == SourceState.BACKOFF  # `connecting` is the first connection only
    assert reason == f"reconnecting (retry 1) after: {failure}"
    assert (report.state, report.reason) == (SourceState.BACKOFF, reason)


async def test_stop_interrupts_a_blocked_open_and_a_backoff_wait() -> None:
    loop = asyncio.get_running_loop()
    with socket.socket() as silent:  # accepts (the kernel does) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        blocked = RtspSource(SourceConfig(url=f"rtsp://127.0.0.1:{port}/x", id="a", open_timeout=30))
        waiting = RtspSource(
            SourceConfig(
                url=f"rtsp://127.0.0.1:{free_port()}/x",
                id="b",
                reconnect=ReconnectConfig(min_delay=30, max_delay=60, jitter=0),
            )
        )
        queues: list[FrameQueue[Frame]] = []
        for src in (blocked, waiting):
            queue: FrameQueue[Frame] = FrameQueue(4, "drop_oldest", loop)
            queues.append(queue)
            src.start(queue)
        deadline = time.monotonic() + 3
        while waiting.state != SourceState.BACKOFF and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        assert blocked.state == SourceState.CONNECTING
        assert waiting.state == SourceState.BACKOFF
        t0 = time.monotonic()
        for src in (blocked, waiting):
            src.stop()
        for src in (blocked, waiting):
            await asyncio.to_thread(src.join, 2.0)
        assert time.monotonic() - t0 < 1.0
        assert blocked.state == waiting.state == SourceState.STOPPED
        for queue in queues:
            assert isinstance(await queue.get(), EndOfStream)


STEP = 0.1  # the slow stage handles 10 frames/s


class OneAtATime(Stage):
    """A stage kind that takes STEP per frame, one frame at a time, like a saturated model."""

    kind = "one_at_a_time"

    def __init__(self, options: StageOptions, context: StageContext) -> None:
        super().__init__(options, context)
        self.busy = asyncio.Lock()

    async def process(self, frame: Frame) -> None:
        async with self.busy:
            await asyncio.sleep(STEP)


async def test_live_queue_drops_oldest_when_the_graph_falls_behind(
    nats_server: EmbeddedNats, collector: Collector, tmp_path: Path
) -> None:
    await collector.start(nats_server.url)
    step = STEP  # the graph handles 10 frames/s of a 30 fps source
    with stage_kinds(OneAtATime):
        cfg = make_config(
            tmp_path,
            [{"id": "pattern", "url": "test://?width=64&height=48&fps=30", "queue_size": 2}],
            runtime={"max_in_flight": 1},
            stages=[{"name": "slow", "type": "one_at_a_time"}],
        )
        runtime = Runtime(cfg, nats_url=nats_server.url)
        await runtime.start()
    try:
        await asyncio.sleep(2.0)
        dropped = metric(runtime, "vidpipe_frames_dropped_total", source="pattern", reason="queue_full")
        assert dropped > 20
        assert runtime.sources["pattern"].dropped["queue_full"] == dropped
    finally:
        await runtime.stop()
    messages = collector.by_source("pattern")
    indices = [m["frame"] for m in messages]
    assert indices == sorted(set(indices))
    assert max(b - a for a, b in itertools.pairwise(indices)) > 1  # frames were skipped
    # Latency stays bounded by what can wait, not by how long the graph has been behind:
    # the queue (2), the frame tasks the intake holds (max_in_flight + 2) and the one in the stage.
    late = [m["publish_ts"] - m["capture_ts"] for m in messages]
    assert max(late) < (2 + 1 + 2 + 1) * step + 0.15


@needs_gstreamer
async def test_clip_end_is_reconnected_with_frame_indices_continuing(
    demo_clip: Path, nats_server: EmbeddedNats, collector: Collector, tmp_path: Path
) -> None:
    with RtspTestServer({"/clip": str(demo_clip)}) as server:  # 45 frames at 15 fps, once per client
        cfg = make_config(tmp_path, [{"id": "clip", "url": server.url("/clip"), **FAST}])
        await collector.start(nats_server.url)
        async with running(cfg, nats_server.url) as runtime:
            await until(
                lambda: (
                    metric(runtime, "vidpipe_source_reconnects_total", source="clip", reason="end_of_stream")
                    == 1
                ),
                10,
                "the clip to end and be reconnected",
            )
            played = len(collector.by_source("clip"))
            await until(lambda: len(collector.by_source("clip")) >= played + 10, 5, "the second play")
    indices = [m["frame"] for m in collector.by_source("clip")]
    assert indices == list(range(len(indices)))  # nothing dropped, nothing repeated
    assert played >= 40
    pts = [m["pts"] for m in collector.by_source("clip")]
    assert all(b > a for a, b in itertools.pairwise(pts))


def test_timeline_is_strictly_increasing_from_zero() -> None:
    from pipeline.sources.live import _Timeline

    line = _Timeline(0.1)
    # No timestamp on the first frame, then 10.0.. ; a reset back to 3.0 continues after 10.2.
    got = [round(line.next(raw), 6) for raw in (None, 10.0, 10.1, None, 3.0, 3.1)]
    assert got == [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]


class OneObject(Stage):
    """A detector stand-in: one sure object in the middle of every frame."""

    kind = "one_object"
    finds_objects = True

    async def process(self, frame: Frame) -> None:
        frame.objects.append(
            DetectedObject(frame.next_object_id(), "car", 0, 0.9, (100.0, 80.0, 200.0, 160.0), self.name)
        )


@needs_gstreamer
async def test_an_outage_ends_the_tracks_of_the_stream_and_a_reconnect_starts_new_ones(
    rtsp_server: RtspTestServer, nats_server: EmbeddedNats, collector: Collector, tmp_path: Path
) -> None:
    with stage_kinds(OneObject):
        cfg = make_config(
            tmp_path,
            [{"id": "cam", "url": rtsp_server.url(), **FAST}],
            stages=[
                {"name": "cars", "type": "one_object"},
                {"name": "track", "type": "track", "min_hits": 1},
                {"name": "gate", "type": "zones",
                 "zones": [{"name": "dock", "polygon": [[0, 0], [320, 0], [320, 240], [0, 240]]}]},
            ],
        )  # fmt: skip
        await collector.start(nats_server.url, "vidpipe.cams.cam.>")
        zone = {"source": "cam", "zone": "dock"}

        def events() -> list[tuple[str, int]]:
            return [(m["type"], m["track_id"]) for m in collector.messages if "type" in m]

        async with running(cfg, nats_server.url) as runtime:
            source = runtime.sources["cam"].source
            await until(lambda: ("zone_enter", 1) in events(), 10, "track 1 in the dock")
            assert metric(runtime, "vidpipe_zone_objects", **zone) == 1.0
            assert metric(runtime, "vidpipe_active_tracks", source="cam") == 1.0
            rtsp_server.kill()
            # The stream's end ends its track at once, while the camera is still away.
            await until(lambda: ("track_end", 1) in events(), 5, "track 1 to end")
            assert source.state == SourceState.BACKOFF
            assert metric(runtime, "vidpipe_zone_objects", **zone) == 0.0
            assert metric(runtime, "vidpipe_active_tracks", source="cam") == 0.0
            assert events() == [("track_start", 1), ("zone_enter", 1), ("zone_exit", 1), ("track_end", 1)]
            rtsp_server.start()
            await until(lambda: ("zone_enter", 2) in events(), 10, "a new track after the reconnect")
            assert metric(runtime, "vidpipe_zone_objects", **zone) == 1.0
            assert metric(runtime, "vidpipe_active_tracks", source="cam") == 1.0
        assert metric(runtime, "vidpipe_zone_objects", **zone) == 0.0
    await until(lambda: ("track_end", 2) in events(), 5, "track 2 to end with the pipeline")
    assert events() == [
        ("track_start", 1), ("zone_enter", 1), ("zone_exit", 1), ("track_end", 1),
        ("track_start", 2), ("zone_enter", 2), ("zone_exit", 2), ("track_end", 2),
    ]  # fmt: skip
    # Track 1 ends at its last frame before the outage; track 2 starts at the first after it.
    messages = collector.messages
    down = next(i for i, m in enumerate(messages) if m.get("type") == "track_end")
    last_before = [m["frame"] for m in messages[:down] if "type" not in m][-1]
    first_after = next(m["frame"] for m in messages[down:] if "type" not in m)
    assert [(m["type"], m["frame"]) for m in messages[down - 1 : down + 1]] == [
        ("zone_exit", last_before), ("track_end", last_before),
    ]  # fmt: skip
    start = next(m for m in messages if m.get("type") == "track_start" and m["track_id"] == 2)
    assert start["frame"] == first_after > last_before
    # Every frame's object carries the track of its own connection.
    ids = {m["frame"]: m["objects"][0]["track_id"] for m in messages if "type" not in m}
    assert {ids[f] for f in ids if f <= last_before} == {1}
    assert {ids[f] for f in ids if f >= first_after} == {2}


@needs_gstreamer
async def test_status_messages_say_each_change_of_a_source_once(
    rtsp_server: RtspTestServer, nats_server: EmbeddedNats, collector: Collector, tmp_path: Path
) -> None:
    import json
    from importlib import resources

    import jsonschema

    cfg = make_config(
        tmp_path,
        [
            {"id": "cam", "url": rtsp_server.url(), **FAST},
            {"id": "short", "url": "test://?width=64&height=48&frames=10"},
            {"id": "gone", "url": str(tmp_path / "missing.mp4")},
        ],
        nats={"status": True},
    )
    await collector.start(nats_server.url, "vidpipe.cams.*.status")

    def said(source: str) -> list[str]:
        return [m["state"] for m in collector.by_source(source)]

    async with running(cfg, nats_server.url) as runtime:
        await until(lambda: said("cam") == ["up"], 10, "cam up")
        await until(lambda: said("short") == ["up", "stopped"], 10, "short ended")
        await until(lambda: said("gone") == ["failed"], 10, "gone failed")
        rtsp_server.kill()
        await until(lambda: said("cam") == ["up", "down"], 5, "cam down")
        # It retries, refused each time: each retry is not news.
        await until(
            lambda: metric(runtime, "vidpipe_source_reconnects_total", source="cam", reason="refused") >= 3,
            10,
            "three refused retries",
        )
        assert said("cam") == ["up", "down"]
        rtsp_server.start()
        await until(lambda: said("cam") == ["up", "down", "up"], 10, "cam up again")
    await until(lambda: said("cam") == ["up", "down", "up", "stopped"], 5, "cam stopped")
    schema = json.loads(resources.files("pipeline").joinpath("schemas/status.v1.json").read_text())
    for message in collector.messages:
        jsonschema.validate(message, schema)
    by_state = {(m["source"], m["state"]): m for m in collector.messages}
    assert by_state[("gone", "failed")]["reason"].startswith("file not found")
    assert by_state[("cam", "down")]["reason"] != ""
    assert set(collector.subjects) == {f"vidpipe.cams.{s}.status" for s in ("cam", "short", "gone")}
