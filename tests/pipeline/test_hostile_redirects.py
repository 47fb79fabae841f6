"""Hostile RTSP cameras: redirects written so a reader sees a path and FFmpeg sees another host.

A raw RTSP server (``tests/support/raw_rtsp.py``) plays the camera; a second one
stands where the redirect points. The source's URL carries credentials, so the
redirect check runs before FFmpeg (real FFmpeg through PyAV) may open anything.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from pipeline.sources.base import SourceState
from pipeline.sources.live import reader_threads
from pipeline.sources.redirects import ffmpeg_endpoint, same_endpoint
from tests.support.live_source import run_until_reconnects
from tests.support.raw_rtsp import RawListener, RtspRequest, reply


async def _no_reader_left() -> None:
    """Every reader thread has ended: FFmpeg can connect nowhere any more."""
    deadline = time.monotonic() + 10.0
    while reader_threads():
        assert time.monotonic() < deadline, "a reader thread outlived its source"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize(
    "location",
    [
        "rtsp:127.0.0.1:{port}/stolen",  # no '//': FFmpeg reads a host all the same
        "rtsp:/127.0.0.1:{port}/stolen",
        "RTSP://127.0.0.1:{port}/stolen",
        "http://127.0.0.1:{port}/stolen",  # FFmpeg takes any scheme for rtsp
    ],
)
async def test_a_redirect_without_slashes_is_refused_as_ffmpeg_reads_it(location: str) -> None:
    with RawListener() as elsewhere:
        target = location.format(port=elsewhere.port)

        def redirecting(request: RtspRequest) -> bytes:
            return reply(request, "302 Found", f"Location: {target}")

        with RawListener(redirecting) as camera:
            run = await run_until_reconnects(f"rtsp://admin:s3cret@127.0.0.1:{camera.port}/live")
            await _no_reader_left()
    assert run.labels[:2] == ["redirect", "redirect"], (run.labels, run.states)
    backoffs = [reason for state, reason in run.states if state == SourceState.BACKOFF]
    assert backoffs[0].startswith(f"redirected to {target}; set allow_redirects: true to follow it"), backoffs
    assert (elsewhere.connections, bytes(elsewhere.received)) == (0, b"")


async def test_a_redirect_with_bare_line_feeds_is_seen() -> None:
    """FFmpeg ends header lines at LF; a camera that drops the CRs is read the same way."""
    with RawListener() as elsewhere:
        target = f"rtsp://127.0.0.1:{elsewhere.port}/stolen"

        def redirecting(request: RtspRequest) -> bytes:
            cseq = request.header("CSeq") or "0"
            return f"RTSP/1.0 302 Found\nCSeq: {cseq}\nLocation: {target}\nContent-Length: 0\n\n".encode()

        with RawListener(redirecting) as camera:
            run = await run_until_reconnects(f"rtsp://admin:s3cret@127.0.0.1:{camera.port}/live")
            await _no_reader_left()
    assert run.labels[:2] == ["redirect", "redirect"], (run.labels, run.states)
    assert (elsewhere.connections, bytes(elsewhere.received)) == (0, b"")


@pytest.mark.parametrize(
    ("location", "endpoint", "same"),
    [
        ("/other", None, True),  # a plain path: FFmpeg connects to no host with it
        ("rtsp:cam:554/x", ("rtsp", "cam", 554), True),
        ("rtsp:/CAM/x", ("rtsp", "cam", None), True),
        ("rtsp://u:p@cam:8554/x", ("rtsp", "cam", 8554), False),
        ("/a:1/b", ("/a", "1", None), False),  # the scheme is whatever precedes the first ':'
        ("rtsp://[::1]:554/x", ("rtsp", "::1", 554), False),
        ("rtsps://cam/x", ("rtsps", "cam", None), False),  # port 322
        ("RTSPS://cam/x", ("RTSPS", "cam", None), True),  # not rtsps to FFmpeg: port 554
    ],
)
def test_locations_are_read_as_ffmpeg_reads_them(
    location: str, endpoint: tuple[str, str, int | None] | None, same: bool
) -> None:
    assert ffmpeg_endpoint(location) == endpoint
    assert same_endpoint("rtsp://u:p@cam/live", location) is same
