"""Hostile sources: URLs, cameras and files that try to hurt the process, against real parts.

Every test feeds one attack through a real door (a config file, ``vidpipe run
--source`` in a subprocess, ``POST /v1/sources`` on a live HTTP server) to real
FFmpeg through PyAV, with real loopback sockets standing in for cameras and for
the hosts an attacker would like vidpipe to reach.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from inference.schema import ConfigError
from pipeline.config import load_config
from pipeline.nats_server import EmbeddedNats
from pipeline.sources.base import SourceState
from tests.conftest import run_cli
from tests.pipeline.stack import Stack, until
from tests.support.live_source import run_until_reconnects
from tests.support.raw_rtsp import RawListener, RtspRequest, reply


def crlf_url(port: int) -> str:
    """A URL that, written into an RTSP request as it is, forges a second HTTP request."""
    return (
        f"rtsp://127.0.0.1:{port}/x HTTP/1.1\r\nHost: internal\r\n\r\n"
        "POST /admin/delete HTTP/1.1\r\nHost: internal\r\nContent-Length: 0\r\n\r\n"
    )


def at_in_password(port: int) -> str:
    """A raw '@' in the password: a reader sees 10.9.9.9, FFmpeg connects to 127.0.0.1."""
    return f"rtsp://admin:Pa@127.0.0.1:{port}/TAIL@10.9.9.9:554/s"


def write_config(tmp_path: Path, source_yaml: str, extra: str = "") -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(f"pipeline: hostile\nsources:\n  - {source_yaml}\n{extra}")
    return path


def yaml_string(text: str) -> str:
    """``text`` as a YAML double-quoted scalar (control characters escaped)."""
    return (
        '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\r", "\\r").replace("\n", "\\n") + '"'
    )


API_CONFIG = """\
pipeline: hostile
sources: []
nats: {{url: "{nats}"}}
http: {{listen: "127.0.0.1:0"}}
"""


# -- 1. URLs: refused at every door before FFmpeg sees them --------------------------------


@pytest.mark.parametrize(
    ("make_url", "expected"),
    [
        (crlf_url, "the URL contains a control character (\\r) at position"),
        (at_in_password, "the URL has an '@' after the host; if the password contains '@'"),
    ],
    ids=["crlf-injection", "raw-at-in-password"],
)
def test_config_refuses_hostile_urls_with_file_and_line(
    tmp_path: Path, make_url: object, expected: str
) -> None:
    with RawListener() as camera:
        url = make_url(camera.port)  # type: ignore[operator]
        path = write_config(tmp_path, f"{{id: cam, url: {yaml_string(url)}}}")
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert str(info.value).startswith(f"{path}:3: sources[0].url: {expected}")
        assert "Pa@" not in str(info.value) and "TAIL" not in str(info.value)
        time.sleep(0.3)
        assert (camera.connections, bytes(camera.received)) == (0, b"")


def test_config_refuses_a_file_path_with_a_newline(tmp_path: Path) -> None:
    path = write_config(tmp_path, '{id: clip, url: "clips/a.mp4\\nERROR forged log line"}')
    result = run_cli("validate", str(path), timeout=60)
    assert result.returncode == 2, result.stderr
    assert (
        f"{path}:3: sources[0].url: the URL contains a control character (\\n) at position 11"
        in result.stderr
    )
    assert "forged log line" not in result.stderr
    assert "Traceback" not in result.stderr


def test_source_flag_refuses_a_crlf_url_with_exit_2(tmp_path: Path) -> None:
    path = write_config(tmp_path, '{url: "test://?frames=1"}')
    with RawListener() as camera:
        result = run_cli("run", str(path), "--source", crlf_url(camera.port), "--duration", "5", timeout=60)
        assert result.returncode == 2, result.stderr
        assert "--source: the URL contains a control character (\\r) at position" in result.stderr
        assert "admin/delete" not in result.stderr
        assert "Traceback" not in result.stderr
        assert (camera.connections, bytes(camera.received)) == (0, b"")


def test_source_flag_refuses_a_raw_at_in_the_password(tmp_path: Path) -> None:
    path = write_config(tmp_path, '{url: "test://?frames=1"}')
    with RawListener() as camera:
        result = run_cli(
            "run", str(path), "--source", at_in_password(camera.port), "--duration", "5", timeout=60
        )
        assert result.returncode == 2, result.stderr
        assert "--source: the URL has an '@' after the host" in result.stderr
        assert "Pa@" not in result.stderr and "TAIL" not in result.stderr
        assert (camera.connections, bytes(camera.received)) == (0, b"")


# -- 2. the hostile listener: what a camera receives from vidpipe ----------------------------


def camera_answers(request: RtspRequest) -> bytes:
    """A camera that knows OPTIONS and has no stream: vidpipe sends its requests and retries."""
    if request.method == "OPTIONS":
        return reply(request, "200 OK", "Public: OPTIONS, DESCRIBE, SETUP, PLAY, TEARDOWN")
    return reply(request, "404 Not Found")


def assert_well_formed(requests: list[RtspRequest], port: int) -> None:
    """Each request is ``METHOD rtsp://127.0.0.1:PORT/... RTSP/1.0`` with Name: value headers."""
    assert requests, "the camera received no request"
    prefix = f"rtsp://127.0.0.1:{port}/"
    for request in requests:
        method, target, version = request.line.split(" ")
        assert method in {"OPTIONS", "DESCRIBE", "SETUP", "PLAY", "TEARDOWN", "GET_PARAMETER"}, request.line
        assert target.startswith(prefix), request.line
        assert version == "RTSP/1.0", request.line
        for name, value in request.headers:
            assert name and name.replace("-", "").isalnum(), (request.line, name)
            assert value != "\x00malformed" and "\r" not in value and "\n" not in value, (request.line, name)
        assert request.header("CSeq") is not None, request.line


async def test_hostile_listener_sees_nothing_of_a_crlf_url_and_only_well_formed_requests(
    tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    stack = await Stack.start(tmp_path, API_CONFIG.format(nats=nats_server.url), nats_server.url)
    try:
        with RawListener(camera_answers) as camera:
            status, body = await stack.json(
                "POST", "/v1/sources", json={"id": "evil", "url": crlf_url(camera.port)}
            )
            assert status == 400, body
            assert body["error"].startswith(
                "sources.url: the URL contains a control character (\\r) at position"
            )
            status, body = await stack.json(
                "POST", "/v1/sources", json={"id": "evil2", "url": at_in_password(camera.port)}
            )
            assert status == 400, body
            assert "percent-encode" in body["error"] and "TAIL" not in body["error"]
            await asyncio.sleep(0.5)
            assert (camera.connections, bytes(camera.received)) == (0, b"")
            assert "evil" not in stack.runtime.sources and "evil2" not in stack.runtime.sources

            # A normal URL with credentials: the camera gets RTSP requests for itself, nothing else.
            url = f"rtsp://admin:s3cret@127.0.0.1:{camera.port}/live/main?channel=1"
            status, body = await stack.json(
                "POST",
                "/v1/sources",
                json={
                    "id": "cam",
                    "url": url,
                    "open_timeout": 1,
                    "reconnect": {"min_delay": 0.2, "max_delay": 0.2},
                },
            )
            assert status == 201, body
            await until(
                lambda: stack.runtime.sources["cam"].source.stats.reconnects >= 2, what="two reconnects"
            )
            assert_well_formed(list(camera.requests), camera.port)
            assert {r.target for r in camera.requests} == {
                f"rtsp://127.0.0.1:{camera.port}/live/main?channel=1"
            }
            assert b"s3cret" not in bytes(camera.received)  # never asked for: a 404 is no challenge
            assert stack.runtime.sources["cam"].source.state in (SourceState.BACKOFF, SourceState.CONNECTING)
    finally:
        await stack.close()


# -- 1. what FFmpeg may reach from a file ----------------------------------------------------


def playlists(target: str) -> dict[str, str]:
    """Files whose content makes FFmpeg open ``target``, under a video file's name."""
    return {
        "hls.m3u8": f"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10.0,\n{target}\n#EXT-X-ENDLIST\n",
        "hls-named.mp4": f"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10.0,\n{target}\n#EXT-X-ENDLIST\n",
        "concat.ffconcat": f"ffconcat version 1.0\nfile '{target}'\n",
    }


def test_a_playlist_file_cannot_open_another_file(tmp_path: Path, demo_clip: Path) -> None:
    from pipeline.config import SourceConfig
    from pipeline.sources.base import SourceError
    from pipeline.sources.file import FileSource

    for name, text in playlists(f"file:{demo_clip}").items():
        path = tmp_path / name
        path.write_text(text)
        source = FileSource(SourceConfig(url=str(path), id="clip"))
        with pytest.raises(SourceError) as info:
            source.open().close()
        assert info.value.problem.startswith(f"cannot open {path}: "), (name, info.value.problem)


def test_a_playlist_file_never_connects_to_a_host(tmp_path: Path) -> None:
    # FFmpeg 8 keeps nested opens of a local file to file,crypto,data by itself; the
    # whitelists make this hold whatever the FFmpeg build defaults to.
    from pipeline.config import SourceConfig
    from pipeline.sources.base import SourceError
    from pipeline.sources.file import FileSource

    with RawListener() as host:
        for name, text in playlists(f"http://127.0.0.1:{host.port}/seg.ts").items():
            path = tmp_path / name
            path.write_text(text)
            with pytest.raises(SourceError):
                FileSource(SourceConfig(url=str(path), id="clip")).open().close()
        time.sleep(0.3)
        assert (host.connections, bytes(host.received)) == (0, b"")


def test_ordinary_files_still_open(tmp_path: Path, demo_clip: Path) -> None:
    from pipeline.config import SourceConfig
    from pipeline.sources.file import FileSource

    container = FileSource(SourceConfig(url=str(demo_clip), id="clip")).open()
    try:
        assert container.streams.video[0].codec_context.name == "h264"
    finally:
        container.close()


# -- 3. RTSP redirects to another host -------------------------------------------------------


async def test_a_redirect_to_another_host_is_not_followed_with_credentials() -> None:
    with RawListener() as elsewhere:
        location = f"rtsp://127.0.0.1:{elsewhere.port}/stolen"

        def redirecting(request: RtspRequest) -> bytes:
            return reply(request, "302 Found", f"Location: {location}")

        with RawListener(redirecting) as camera:
            run = await run_until_reconnects(f"rtsp://admin:s3cret@127.0.0.1:{camera.port}/live")
            states, labels = run.states, run.labels
            assert labels[:2] == ["redirect", "redirect"], (labels, states)
            backoffs = [reason for state, reason in states if state == SourceState.BACKOFF]
            assert backoffs[0].startswith(
                f"redirected to {location}; set allow_redirects: true to follow it; retry 1 in"
            ), backoffs
            # The check asked as vidpipe should: well-formed, for this host, without the password.
            assert_well_formed(list(camera.requests), camera.port)
            assert b"s3cret" not in bytes(camera.received) and b"admin" not in bytes(camera.received)
            time.sleep(0.3)
            assert (elsewhere.connections, bytes(elsewhere.received)) == (0, b"")


async def test_allow_redirects_lets_ffmpeg_follow_the_camera() -> None:
    with RawListener() as elsewhere:

        def redirecting(request: RtspRequest) -> bytes:
            return reply(request, "302 Found", f"Location: rtsp://127.0.0.1:{elsewhere.port}/other")

        with RawListener(redirecting) as camera:
            await run_until_reconnects(
                f"rtsp://admin:s3cret@127.0.0.1:{camera.port}/live", allow_redirects=True
            )
            assert elsewhere.connections >= 1
            assert elsewhere.requests[0].target == f"rtsp://127.0.0.1:{elsewhere.port}/other"


def test_allow_redirects_defaults_to_false_in_config(tmp_path: Path) -> None:
    path = write_config(tmp_path, '{id: cam, url: "rtsp://u:p@127.0.0.1:9/x"}')
    assert load_config(path).sources[0].allow_redirects is False


# -- 4. pixels per frame ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def huge_clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One flat 16384x8192 H.264 frame: a few hundred KB on disk, 400 MB as RGB."""
    import subprocess

    path = tmp_path_factory.mktemp("huge") / "huge.mp4"
    subprocess.run(
        ["ffmpeg", "-y", "-loglevel", "error", "-f", "lavfi", "-i", "color=c=blue:size=16384x8192:rate=1",
         "-frames:v", "1", "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p", str(path)],
        check=True, timeout=120,
    )  # fmt: skip
    assert path.stat().st_size < 2_000_000
    return path


def rss_mb() -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) // 1024


async def run_to_end(url: str, **options: object) -> tuple[SourceState, str, int]:
    """Run a source of ``url`` until it ends; its final state, reason and frames."""
    from pipeline.config import SourceConfig
    from pipeline.frames import Frame
    from pipeline.queues import EndOfStream, FrameQueue
    from pipeline.sources.registry import create_source

    source = create_source(SourceConfig(url=url, id="big", **options))  # type: ignore[arg-type]
    queue: FrameQueue[Frame] = FrameQueue(4, "block", asyncio.get_running_loop())
    source.start(queue)
    frames = 0
    while not isinstance(item := await asyncio.wait_for(queue.get(), 30), EndOfStream):
        frames += 1
        item.release()
    return source.state, source.reason, frames


async def test_a_frame_over_max_pixels_fails_the_source_before_any_buffer(huge_clip: Path) -> None:
    before = rss_mb()
    state, reason, frames = await run_to_end(str(huge_clip))
    grown = rss_mb() - before
    assert (state, frames) == (SourceState.FAILED, 0)
    assert reason == "source big: frame size 16384x8192 is over the limit of 33177600 pixels (max_pixels)"
    assert grown < 200, f"RSS grew by {grown} MB"


async def test_max_pixels_is_checked_on_every_frame_of_a_source_without_a_declared_size() -> None:
    state, reason, frames = await run_to_end("test://?width=640&height=360&frames=3", max_pixels=100_000)
    assert (state, frames) == (SourceState.FAILED, 0)
    assert reason == "source big: frame size 640x360 is over the limit of 100000 pixels (max_pixels)"
    state, _, frames = await run_to_end("test://?width=320&height=240&frames=3", max_pixels=100_000)
    assert (state, frames) == (SourceState.STOPPED, 3)


# -- 6. backoff floors -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reconnect", "key", "problem"),
    [
        ("{min_delay: 1.0e-300}", "min_delay", "must be at least 0.1, got 1e-300"),
        ("{max_delay: 0.001}", "max_delay", "must be at least 0.1, got 0.001"),
        ("{min_delay: 5, max_delay: 1}", "", "max_delay (1) must be at least min_delay (5)"),
    ],
    ids=["min-delay", "max-delay", "max-below-min"],
)
def test_config_refuses_reconnect_delays_below_the_floor(
    tmp_path: Path, reconnect: str, key: str, problem: str
) -> None:
    path = write_config(tmp_path, f"id: cam\n    url: rtsp://127.0.0.1:9/x\n    reconnect: {reconnect}")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    where = f"sources[0].reconnect.{key}" if key else "sources[0].reconnect"
    assert str(info.value).startswith(f"{path}:5: {where}: {problem}")


async def test_api_refuses_reconnect_delays_below_the_floor(
    tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    stack = await Stack.start(tmp_path, API_CONFIG.format(nats=nats_server.url), nats_server.url)
    try:
        with RawListener() as camera:
            url = f"rtsp://127.0.0.1:{camera.port}/x"
            status, body = await stack.json(
                "POST", "/v1/sources", json={"id": "cam", "url": url, "reconnect": {"min_delay": 1e-300}}
            )
            assert (status, body["error"]) == (
                400,
                "sources.reconnect.min_delay: must be at least 0.1, got 1e-300 (hint: seconds, at least 0.1)",
            )
            status, body = await stack.json(
                "POST",
                "/v1/sources",
                json={"id": "cam", "url": url, "reconnect": {"min_delay": 2, "max_delay": 1}},
            )
            assert (status, body["error"]) == (
                400,
                "sources.reconnect: max_delay (1) must be at least min_delay (2)",
            )
            assert "cam" not in stack.runtime.sources
            time.sleep(0.3)
            assert camera.connections == 0
    finally:
        await stack.close()


# -- 7. a file cut short ---------------------------------------------------------------------


def cut_clip(path: Path, frames: int, keep: float) -> Path:
    """An mp4 of ``frames`` frames, index at the front, then cut to ``keep`` of its size."""
    import av
    import numpy as np

    with av.open(str(path), "w", options={"movflags": "faststart"}) as out:
        stream = out.add_stream("libx264", rate=25)
        stream.width, stream.height, stream.pix_fmt = 160, 120, "yuv420p"
        stream.options = {"g": "5"}
        rng = np.random.default_rng(7)
        for _ in range(frames):
            image = rng.integers(0, 255, (120, 160, 3), dtype=np.uint8)  # noise: every frame costs bytes
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    with av.open(str(path)) as check:
        assert check.streams.video[0].frames == frames
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


async def test_a_file_cut_short_logs_one_warning_with_both_counts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging
    import re

    caplog.set_level(logging.WARNING, "vidpipe.source")
    clip = cut_clip(tmp_path / "cut.mp4", frames=40, keep=0.5)
    state, _, frames = await run_to_end(str(clip))
    assert state == SourceState.STOPPED and 0 < frames < 40
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert re.fullmatch(
        rf"source big: {re.escape(str(clip))} ended after {frames} of the 40 frames its container declares.*",
        warnings[0],
    ), warnings


async def test_a_whole_file_logs_no_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    caplog.set_level(logging.WARNING, "vidpipe.source")
    clip = cut_clip(tmp_path / "whole.mp4", frames=20, keep=1.0)
    state, _, frames = await run_to_end(str(clip))
    assert (state, frames) == (SourceState.STOPPED, 20)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


# -- 5. the frame memory budget --------------------------------------------------------------


async def test_frame_pools_over_the_budget_fail_the_source_naming_the_key(
    tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    text = API_CONFIG.format(nats=nats_server.url) + "runtime: {frame_memory_mb: 40, max_in_flight: 4}\n"
    stack = await Stack.start(tmp_path, text, nats_server.url)
    try:
        # 8 queued + 4 in flight + 4 = 16 frames of 640x360x3: about 11 MB each pool.
        small = {"url": "test://?width=640&height=360&fps=30", "queue_size": 8}
        for sid in ("a", "b", "c"):
            status, body = await stack.json("POST", "/v1/sources", json={**small, "id": sid})
            assert status == 201, body
            await until(lambda sid=sid: stack.runtime.sources[sid].source.stats.frames > 0, what=f"{sid} up")
        assert stack.runtime.frame_memory.used == 3 * 16 * 640 * 360 * 3
        status, body = await stack.json("POST", "/v1/sources", json={**small, "id": "d"})
        assert status == 201, body
        source = stack.runtime.sources["d"].source
        await until(lambda: source.state == SourceState.FAILED, what="d failed")
        assert source.reason == (
            "source d: frame pools would need 11 MB more, over runtime.frame_memory_mb = 40 with 32 MB "
            "in use by other sources (16 frames of 640x360)"
        )
        assert source.stats.frames == 0
    finally:
        await stack.close()


async def test_removed_sources_give_their_frame_pools_back(tmp_path: Path, nats_server: EmbeddedNats) -> None:
    text = API_CONFIG.format(nats=nats_server.url) + "runtime: {frame_memory_mb: 40, max_in_flight: 4}\n"
    stack = await Stack.start(tmp_path, text, nats_server.url)
    try:
        budget = stack.runtime.frame_memory
        for round_ in range(6):  # 6 x 2 x 11 MB would be far over 40 MB without giving back
            for sid in ("x", "y"):
                url = f"test://?width=640&height=360&fps=30&id={sid}"
                status, body = await stack.json("POST", "/v1/sources", json={"url": url, "id": sid})
                assert status == 201, body
            await until(
                lambda: all(stack.runtime.sources[s].source.stats.frames > 0 for s in ("x", "y")),
                what=f"round {round_}: both sources up",
            )
            assert budget.used == 2 * 16 * 640 * 360 * 3
            for sid in ("x", "y"):
                status, _ = await stack.json("DELETE", f"/v1/sources/{sid}")
                assert status == 204
            assert budget.used == 0
    finally:
        await stack.close()
