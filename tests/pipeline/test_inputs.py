"""Inputs FFmpeg opens by URL, against real servers on loopback.

http.server serves an MP4, an HLS playlist with segments made by the ffmpeg
command, and an endless MJPEG stream (tests/support/media_servers.py); the
ffmpeg command pushes MPEG-TS over UDP and RTP. Every stream shows frame ``i``
as a flat grey ``level(i)``, so a test checks which frames arrived, in which order.
"""

from __future__ import annotations

import asyncio
import glob
import itertools
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from inference.schema import ConfigError
from pipeline.config import PipelineConfig, SourceConfig, load_config
from pipeline.frames import Frame
from pipeline.nats_server import EmbeddedNats
from pipeline.queues import EndOfStream, FrameQueue
from pipeline.runtime import Runtime
from pipeline.sources.base import Source, SourceState
from pipeline.sources.file import FileSource
from pipeline.sources.registry import create_source
from pipeline.sources.schemes import check_url, ffmpeg_protocol_missing, is_live
from pipeline.sources.stream import StreamSource
from pipeline.stages.base import Stage, StageContext, StageOptions
from pipeline.urls import derive_id, protocol_whitelist
from tests.conftest import Collector
from tests.pipeline.stack import Stack, stage_kinds, until
from tests.support.media_servers import FfmpegPush, MediaHttpServer, ffmpeg_cli, level, level_clip, level_of
from tests.support.rtsp_server import free_port

needs_ffmpeg = pytest.mark.skipif(ffmpeg_cli() is None, reason="needs the ffmpeg command (Debian ffmpeg)")

FRAMES = 40  # frames in the test clip: 10 fps, 160x120, a keyframe each second
FAST = {
    "open_timeout": 3.0,
    "read_timeout": 2.0,
    "stall_timeout": 1.5,
    "reconnect": {"min_delay": 0.1, "max_delay": 0.4, "jitter": 0.0},
}


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with clip.mp4 and, when ffmpeg is installed, hls/index.m3u8 and its segments."""
    folder = tmp_path_factory.mktemp("media")
    clip = level_clip(folder / "clip.mp4", FRAMES)
    ffmpeg = ffmpeg_cli()
    if ffmpeg is not None:
        (folder / "hls").mkdir()
        subprocess.run(
            [ffmpeg, "-hide_banner", "-loglevel", "error", "-i", str(clip), "-c", "copy", "-f", "hls",
             "-hls_time", "1", "-hls_list_size", "0", "-hls_playlist_type", "vod",
             str(folder / "hls" / "index.m3u8")],
            check=True,
        )  # fmt: skip
    return folder


@pytest.fixture
def http_server(media: Path) -> Iterator[MediaHttpServer]:
    with MediaHttpServer(media) as server:
        yield server


def config(url: str, **keys: object) -> SourceConfig:
    return SourceConfig(url=url, id=derive_id(url), **keys)  # type: ignore[arg-type]


def timed_config(url: str, **keys: object) -> SourceConfig:
    from pipeline.config import ReconnectConfig

    fast: dict[str, object] = {**FAST, "reconnect": ReconnectConfig(**FAST["reconnect"])}  # type: ignore[arg-type]
    return config(url, **{**fast, **keys})


@dataclass(frozen=True)
class Got:
    """What a test keeps of a frame: its buffer goes back to the source's pool at once."""

    index: int
    pts: float
    shape: tuple[int, ...]
    level: int


def got(frame: Frame) -> Got:
    kept = Got(frame.index, frame.pts, frame.image.shape, level_of(frame.image))
    frame.release()
    return kept


async def take(source: Source, count: int | None, timeout: float = 20.0) -> list[Got]:
    """Start ``source`` and take ``count`` frames (None: until it ends); stops it after."""
    loop = asyncio.get_running_loop()
    queue: FrameQueue[Frame] = FrameQueue(64, "block", loop)
    source.start(queue)
    frames: list[Got] = []
    deadline = time.monotonic() + timeout
    try:
        while count is None or len(frames) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"{len(frames)} frames from {source.id} after {timeout}s ({source.reason})"
                )
            try:
                item = await asyncio.wait_for(queue.get(), left)
            except TimeoutError:
                continue
            if isinstance(item, EndOfStream):
                break
            frames.append(got(item))
    finally:
        source.stop()
        await asyncio.to_thread(source.join, 5.0)
    return frames


def levels(frames: list[Got]) -> list[int]:
    return [f.level for f in frames]


def near(got: list[int], want: list[int]) -> bool:
    return len(got) == len(want) and all(abs(a - b) <= 3 for a, b in zip(got, want, strict=True))


def consecutive(got: list[int]) -> bool:
    """Whether grey levels follow level(i), level(i+1), ... from wherever they start."""
    start = min(range(11), key=lambda i: abs(level(i) - got[0]))
    return near(got, [level(start + i) for i in range(len(got))])


# -- the scheme table ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "live", "sid"),
    [
        ("http://cam.local/video.mjpg", True, "video"),
        ("https://cdn.example/live/index.m3u8", True, "live_index"),
        ("https://cdn.example/clips/gate.MP4", False, "clips_gate"),
        ("udp://0.0.0.0:5000", True, "udp_5000"),
        ("rtp://239.0.0.1:5004", True, "rtp_5004"),
        ("/dev/video0", True, "video0"),
        ("v4l2:///dev/video2?video_size=640x480", True, "video2"),
        ("v4l2://1", True, "video1"),
    ],
)
def test_new_schemes_are_live_or_files_by_url(url: str, live: bool, sid: str) -> None:
    assert is_live(url) is live
    assert derive_id(url) == sid
    if url.startswith(("/dev", "v4l2")) and check_url(url) is not None:
        pytest.skip(f"this PyAV has no webcam input: {check_url(url)}")
    assert check_url(url) is None
    source = create_source(config(url))
    assert type(source) is (StreamSource if live else FileSource)
    assert source.live is live


def test_live_false_makes_an_http_stream_a_file_and_is_refused_elsewhere(tmp_path: Path) -> None:
    assert type(create_source(config("http://h/index.m3u8", live=False))) is FileSource
    assert type(create_source(config("http://h/clip.mp4", live=True))) is StreamSource
    path = tmp_path / "p.yaml"
    path.write_text("pipeline: p\nsources:\n  - url: rtsp://cam/x\n    live: false\n")
    with pytest.raises(Exception, match="rtsp:// sources are always live; live: false applies to http"):
        load_config(path)
    with pytest.raises(ValueError, match="file sources are never live"):
        SourceConfig(url="/clips/a.mp4", live=True)
    # One line per problem: a `live:` the scheme cannot be is not also "does not apply".
    for url, live, problem in (
        ("/clips/a.mp4", "true", "sources[0]: live: file sources are never live; remove live: true"),
        ("rtsp://cam/x", "false", "sources[0]: live: rtsp:// sources are always live; live: false applies to http(s) files only"),
        ("test://", "true", "sources[0].live: does not apply to a test source (hint: a test source takes: url, id, max_fps, queue_size, max_pixels)"),
    ):  # fmt: skip
        path.write_text(f"pipeline: p\nsources:\n  - {{url: '{url}', live: {live}}}\n")
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert [str(e) for e in info.value.errors] == [f"{path}:3: {problem}"]


def test_webcam_urls_name_their_options() -> None:
    problem = check_url("v4l2:///dev/video0?size=640x480")
    if problem and "webcams need" in problem:
        pytest.skip(problem)
    assert problem == (
        "unknown webcam option 'size'; use video_size, framerate, input_format, pixel_format, standard"
    )
    assert (
        check_url("v4l2:///tmp/x")
        == "a webcam is /dev/videoN, v4l2:///dev/videoN or v4l2://N, not 'v4l2:///tmp/x'"
    )


def test_protocol_whitelists_name_only_what_each_scheme_needs() -> None:
    assert protocol_whitelist("http") == "http,tcp,crypto"
    assert protocol_whitelist("https") == "https,tls,tcp,crypto"
    assert protocol_whitelist("udp") == "udp"
    assert protocol_whitelist("rtp") == "rtp,udp"
    assert protocol_whitelist("srt") == "srt"


def test_srt_without_libsrt_is_refused_when_the_config_is_checked(tmp_path: Path) -> None:
    missing = ffmpeg_protocol_missing("srt")
    if missing is None:
        assert check_url("srt://127.0.0.1:9000") is None
        return
    path = tmp_path / "p.yaml"
    path.write_text("pipeline: p\nsources:\n  - url: srt://127.0.0.1:9000\n")
    with pytest.raises(Exception) as info:
        load_config(path)
    text = str(info.value)
    assert "srt:// sources are not available" in text
    assert "has no 'srt' protocol" in text and "--enable-libsrt" in text


# -- http(s) -------------------------------------------------------------------------------------


async def test_http_mp4_is_a_file_every_frame_in_order(http_server: MediaHttpServer) -> None:
    source = create_source(timed_config(http_server.url("clip.mp4")))
    assert type(source) is FileSource and not source.live
    frames = await take(source, None)
    assert len(frames) == FRAMES
    assert {f.shape for f in frames} == {(120, 160, 3)}
    assert near(levels(frames), [level(i) for i in range(FRAMES)])
    assert source.state == SourceState.STOPPED and source.reason == "end of stream"


async def test_http_mp4_that_is_missing_fails_with_404(http_server: MediaHttpServer) -> None:
    source = create_source(timed_config(http_server.url("nope.mp4")))
    assert await take(source, None) == []
    assert source.state == SourceState.FAILED
    assert "404" in source.reason or "not found" in source.reason.lower(), source.reason


@needs_ffmpeg
async def test_hls_vod_as_a_file_plays_every_segment(http_server: MediaHttpServer) -> None:
    source = create_source(timed_config(http_server.url("hls/index.m3u8"), live=False))
    frames = await take(source, None)
    assert len(frames) == FRAMES
    assert near(levels(frames), [level(i) for i in range(FRAMES)])


@needs_ffmpeg
async def test_hls_is_live_by_default_and_plays_again_after_the_playlist_ends(
    http_server: MediaHttpServer,
) -> None:
    source = create_source(timed_config(http_server.url("hls/index.m3u8")))
    assert type(source) is StreamSource and source.live
    frames = await take(source, FRAMES + 5)
    assert near(levels(frames[:FRAMES]), [level(i) for i in range(FRAMES)])
    assert source.stats.reconnects == 1  # the end of the VOD playlist, then from the start
    assert [f.index for f in frames] == list(range(FRAMES + 5))
    assert all(b.pts > a.pts for a, b in itertools.pairwise(frames))


async def test_mjpeg_stream_frames_and_reconnect_after_the_server_restarts(media: Path) -> None:
    server = MediaHttpServer(media, fps=20).start()
    port = server.port
    try:
        source = create_source(timed_config(server.url("live.mjpg")))
        assert type(source) is StreamSource and source.live
        loop = asyncio.get_running_loop()
        queue: FrameQueue[Frame] = FrameQueue(256, "block", loop)
        source.start(queue)
        seen: list[Got] = []

        async def take_until(count: int) -> None:
            while len(seen) < count:
                item = await asyncio.wait_for(queue.get(), 10)
                assert not isinstance(item, EndOfStream)
                seen.append(got(item))

        await take_until(10)
        assert {f.shape for f in seen} == {(120, 160, 3)}
        assert near(levels(seen), [level(i) for i in range(10)])  # the server's first ten, in order

        server.stop()  # the camera goes away ...
        await until(lambda: source.state == SourceState.BACKOFF, 10, "backoff after the server stopped")
        time.sleep(0.3)
        server = MediaHttpServer(media, fps=20, port=port).start()  # ... and comes back
        before = len(seen)
        await until(lambda: len(queue) > 0 or source.state == SourceState.UP, 10, "frames again")
        await take_until(before + 10)
        source.stop()
        await asyncio.to_thread(source.join, 5.0)
        assert source.stats.reconnects >= 1
        assert [f.index for f in seen] == list(range(len(seen)))  # indices continue across reconnects
        assert all(b.pts > a.pts for a, b in itertools.pairwise(seen))
        # The new connection starts at the server's frame 0 again.
        assert near(levels(seen[before : before + 5]), [level(i) for i in range(5)])
    finally:
        server.stop()


async def test_https_checks_the_certificate_unless_told_not_to(media: Path, tmp_path: Path) -> None:
    import ssl

    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command to make a self-signed certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    with MediaHttpServer(media) as server:
        assert server._server is not None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        server._server.socket = context.wrap_socket(server._server.socket, server_side=True)
        url = f"https://127.0.0.1:{server.port}/clip.mp4"
        refused = create_source(timed_config(url))
        assert await take(refused, None) == []
        assert refused.state == SourceState.FAILED
        assert refused.reason.startswith(f"source clip: cannot open {url}: ")
        trusting = create_source(timed_config(url, tls_verify=False))
        assert len(await take(trusting, None)) == FRAMES


# -- udp and rtp ---------------------------------------------------------------------------------


@needs_ffmpeg
@pytest.mark.parametrize(("scheme", "muxer"), [("udp", "mpegts"), ("rtp", "rtp_mpegts")])
async def test_mpegts_pushed_over_udp_and_rtp_arrives_in_order(media: Path, scheme: str, muxer: str) -> None:
    port = free_port()
    source = create_source(timed_config(f"{scheme}://127.0.0.1:{port}"))
    assert type(source) is StreamSource and source.live
    with FfmpegPush(media / "clip.mp4", f"{scheme}://127.0.0.1:{port}", muxer):
        frames = await take(source, 25, timeout=30)
    assert {f.shape for f in frames} == {(120, 160, 3)}
    got = levels(frames)
    # Decoding starts at a keyframe (frame 0, 10, 20 or 30 of the clip) and runs on in order.
    assert got[0] in (level(0), level(10), level(20), level(30)) or consecutive(got), got
    assert consecutive(got[:5]), got


# -- live semantics in the runtime ---------------------------------------------------------------


class Slow(Stage):
    """Takes 0.1 s per frame, one frame at a time, like a saturated model."""

    kind = "slow"

    def __init__(self, options: StageOptions, context: StageContext) -> None:
        super().__init__(options, context)
        self.busy = asyncio.Lock()

    async def process(self, frame: Frame) -> None:
        async with self.busy:
            await asyncio.sleep(0.1)


def pipeline_config(tmp_path: Path, text: str) -> PipelineConfig:
    path = tmp_path / "pipeline.yaml"
    path.write_text(text)
    return load_config(path)


async def test_mjpeg_drops_the_oldest_frame_under_a_slow_graph(
    media: Path, tmp_path: Path, nats_server: EmbeddedNats, collector: Collector
) -> None:
    await collector.start(nats_server.url)
    with MediaHttpServer(media, fps=30) as server, stage_kinds(Slow):
        cfg = pipeline_config(
            tmp_path,
            f"pipeline: inputs\nsources:\n  - {{id: cam, url: '{server.url('live.mjpg')}', queue_size: 2}}\n"
            "runtime: {max_in_flight: 1}\nstages:\n  - {name: slow, type: slow}\n",
        )
        runtime = Runtime(cfg, nats_url=nats_server.url)
        await runtime.start()
        try:
            await until(
                lambda: runtime.sources["cam"].dropped.get("queue_full", 0) > 15, 15, "queue_full drops"
            )
        finally:
            await runtime.stop()
    frames = [m["frame"] for m in collector.by_source("cam")]
    assert frames == sorted(set(frames))
    assert max(b - a for a, b in itertools.pairwise(frames)) > 1  # the oldest frames were dropped
    late = [m["publish_ts"] - m["capture_ts"] for m in collector.by_source("cam")]
    assert max(late) < 1.0  # bounded by the queue, not by how long the graph has been behind


# -- the API's scheme allowlist ------------------------------------------------------------------


API = """\
pipeline: apitest
sources: []
nats: {{url: "{nats}"}}
http: {{listen: "127.0.0.1:0"{extra}}}
"""


async def test_api_refuses_webcams_by_default_and_follows_source_schemes(
    tmp_path: Path, nats_server: EmbeddedNats, media: Path
) -> None:
    stack = await Stack.start(tmp_path, API.format(nats=nats_server.url, extra=""), nats_server.url)
    try:
        status, body = await stack.json("POST", "/v1/sources", json={"url": "/dev/video0"})
        assert status == 403
        assert body["error"] == (
            "sources.url: v4l2:// sources cannot be added over the API (http.source_schemes allows: "
            "file, test, rtsp, rtsps, whip, http, https, udp, rtp, srt)"
        )
        with MediaHttpServer(media) as server:
            status, added = await stack.json("POST", "/v1/sources", json={"url": server.url("live.mjpg")})
            assert status == 201, added
            assert (added["id"], added["live"]) == ("live", True)
    finally:
        await stack.close()

    (tmp_path / "narrow").mkdir()
    narrow = API.format(nats=nats_server.url, extra=", source_schemes: [test]")
    stack = await Stack.start(tmp_path / "narrow", narrow, nats_server.url)
    try:
        status, body = await stack.json("POST", "/v1/sources", json={"url": "udp://0.0.0.0:5000"})
        assert (status, body["error"]) == (
            403,
            "sources.url: udp:// sources cannot be added over the API (http.source_schemes allows: test)",
        )
        status, added = await stack.json("POST", "/v1/sources", json={"url": "test://?id=t&fps=5"})
        assert status == 201, added
        assert set(stack.runtime.sources) == {"t"}
    finally:
        await stack.close()


def test_source_schemes_must_be_known(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("pipeline: p\nhttp: {source_schemes: [rtsp, ftp]}\n")
    with pytest.raises(Exception, match="unknown source scheme 'ftp'"):
        load_config(path)


# -- devices and SRT where this machine has them -------------------------------------------------


def _loopback_devices() -> list[str]:
    devices = []
    for path in sorted(glob.glob("/dev/video*")):
        name = Path("/sys/class/video4linux") / Path(path).name / "name"
        try:
            if "loopback" in name.read_text().lower() or "dummy" in name.read_text().lower():
                devices.append(path)
        except OSError:
            continue
    return devices


@needs_ffmpeg
async def test_v4l2_loopback_webcam(media: Path) -> None:
    devices = _loopback_devices()
    if not devices:
        pytest.skip("needs a v4l2loopback device (/dev/video* whose name says loopback); none here")
    problem = check_url(devices[0])
    if problem:
        pytest.skip(problem)
    ffmpeg = ffmpeg_cli()
    assert ffmpeg is not None
    feeder = subprocess.Popen(
        [ffmpeg, "-hide_banner", "-loglevel", "error", "-re", "-stream_loop", "-1", "-i",
         str(media / "clip.mp4"), "-pix_fmt", "yuv420p", "-f", "v4l2", devices[0]],
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        time.sleep(0.5)
        frames = await take(create_source(timed_config(devices[0])), 10, timeout=20)
    finally:
        feeder.terminate()
        feeder.wait(5)
    assert {f.shape for f in frames} == {(120, 160, 3)}
    assert consecutive(levels(frames))


@needs_ffmpeg
async def test_srt_from_the_ffmpeg_command(media: Path) -> None:
    missing = ffmpeg_protocol_missing("srt")
    if missing:
        pytest.skip(f"PyAV's FFmpeg cannot read SRT: {missing}")
    cli = subprocess.run([str(ffmpeg_cli()), "-hide_banner", "-protocols"], capture_output=True, text=True)
    if " srt\n" not in cli.stdout:
        pytest.skip("the ffmpeg command has no srt protocol")
    port = free_port()
    with FfmpegPush(media / "clip.mp4", f"srt://127.0.0.1:{port}?mode=listener"):
        frames = await take(create_source(timed_config(f"srt://127.0.0.1:{port}")), 10, timeout=20)
    assert consecutive(levels(frames))


# -- udp and rtp query options -------------------------------------------------------------------

UDP_REFUSED = "is not allowed (hint: a {scheme}:// URL takes localaddr, sources, block; vidpipe sets FFmpeg's buffers and timeouts itself)"


async def test_udp_and_rtp_queries_take_only_the_documented_keys(
    tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    port = free_port()
    stack = await Stack.start(tmp_path, API.format(nats=nats_server.url, extra=""), nats_server.url)
    try:
        for scheme in ("udp", "rtp"):
            for query in (
                "fifo_size=5000000",
                "localport=5001",
                "reuse=1",
                "timeout=0",
                "buffer_size=1",
                "ttl=9",
            ):
                key = query.split("=")[0]
                status, body = await stack.json(
                    "POST", "/v1/sources", json={"url": f"{scheme}://127.0.0.1:{port}?{query}"}
                )
                assert (status, body["error"]) == (
                    400, f"sources.url: {scheme}:// URL option {key!r} " + UDP_REFUSED.format(scheme=scheme)
                )  # fmt: skip
        status, body = await stack.json(
            "POST", "/v1/sources", json={"url": f"udp://239.0.0.1:{port}?sources=cam"}
        )
        assert (status, body["error"]) == (
            400,
            "sources.url: udp:// URL option sources='cam' is not an IP address "
            "(hint: e.g. localaddr=192.168.1.10 or sources=10.0.0.5,10.0.0.6)",
        )
        assert stack.runtime.sources == {}
    finally:
        await stack.close()
    path = tmp_path / "udp.yaml"
    path.write_text(f"pipeline: p\nsources:\n  - id: enc\n    url: udp://0.0.0.0:{port}?fifo_size=5000000\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(
        info.value
    ) == f"{path}:4: sources[0].url: udp:// URL option 'fifo_size' " + UDP_REFUSED.format(scheme="udp")


@needs_ffmpeg
async def test_udp_with_an_allowed_query_key_still_plays(media: Path) -> None:
    port = free_port()
    url = f"udp://127.0.0.1:{port}?localaddr=127.0.0.1"
    assert check_url(url) is None
    source = create_source(timed_config(url))
    with FfmpegPush(media / "clip.mp4", f"udp://127.0.0.1:{port}", "mpegts"):
        frames = await take(source, 10, timeout=30)
    assert {f.shape for f in frames} == {(120, 160, 3)}
    assert consecutive(levels(frames)[:5])


async def test_webcam_paths_through_the_api_are_normalised_not_a_500(
    tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    refused = (
        "sources.url: v4l2:// sources cannot be added over the API (http.source_schemes allows: "
        "file, test, rtsp, rtsps, whip, http, https, udp, rtp, srt)"
    )
    extra = ", file_roots: ['/dev']"
    stack = await Stack.start(tmp_path, API.format(nats=nats_server.url, extra=extra), nats_server.url)
    try:
        for url in ("/dev/./video0", "/dev/video0/", "/dev//video0", "/dev/video0"):
            status, body = await stack.json("POST", "/v1/sources", json={"url": url})
            assert (status, body) == (403, {"error": refused}), url
        assert stack.runtime.sources == {}
    finally:
        await stack.close()
