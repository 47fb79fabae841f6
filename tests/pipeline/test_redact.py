"""One redactor for every place a camera URL can show up: URLs, FFmpeg errors, states, logs, ids.

Each password is tried raw (as operators paste it) and percent-encoded (as RFC 3986
wants it); a real RTSP source fails against a closed loopback port with it.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from urllib.parse import quote, unquote

import av
import pytest

from pipeline.config import SourceConfig
from pipeline.nats_server import EmbeddedNats
from pipeline.queues import EndOfStream
from pipeline.redact import redact_text, redact_url
from pipeline.sources.base import SourceError, SourceState
from pipeline.sources.decode import ffmpeg_reason
from pipeline.sources.rtsp import RtspSource
from pipeline.urls import derive_id
from tests.pipeline.stack import Stack, until
from tests.support.live_source import run_until_reconnects
from tests.support.rtsp_server import free_port

PASSWORDS = [
    "left@right-side",  # '@': a parser that splits at the first '@' shows "right-side@host"
    "left/right-side",  # '/': urlsplit ends the host there and reads the rest as a path
    "left:right-side",
    "100%pure-secret",  # a '%' that is no escape
    "frag#ment-secret",
    "que?ry-secret",
    "pässwörd-geheim",
]
CASES = [
    pytest.param(password, encoded, id=f"{'encoded' if encoded else 'raw'}-{password}")
    for password in PASSWORDS
    for encoded in (False, True)
]


def secrets_of(password: str) -> set[str]:
    """The password in every form it could leak in, and its pieces between URL delimiters."""
    forms = {password, quote(password, safe=""), unquote(password)}
    pieces = {p for form in forms for p in re.split(r"[@/:?#%]+", form) if len(p) >= 4}
    return forms | pieces


def leaks(text: str, password: str) -> list[str]:
    return sorted(s for s in secrets_of(password) if s in text)


def camera_url(password: str, encoded: bool, port: int) -> str:
    written = quote(password, safe="") if encoded else password
    return f"rtsp://admin:{written}@127.0.0.1:{port}/cam"


@pytest.mark.parametrize(("password", "encoded"), CASES)
async def test_no_form_of_the_password_shows_anywhere(
    password: str, encoded: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    port = free_port()  # nothing listens there
    url = camera_url(password, encoded, port)
    shown = f"rtsp://***@127.0.0.1:{port}/cam"

    assert redact_url(url) == shown
    assert derive_id(url) == "cam"  # ids become NATS subjects and metric labels

    # FFmpeg's own error text names the URL it failed on, credentials and all.
    with pytest.raises(av.FFmpegError) as raised:
        av.open(url, options={"rtsp_transport": "tcp"}, timeout=2.0)
    ffmpeg_text = str(raised.value)
    assert leaks(ffmpeg_text, password), "the test should start from a message that leaks"
    echoed = f"{ffmpeg_text}; retrying {unquote(url)} as admin:{password} ({quote(password, safe='')})"
    assert leaks(redact_text(echoed, url), password) == []
    assert leaks(ffmpeg_reason(raised.value, url), password) == []

    config = SourceConfig(url=url, id="cam", open_timeout=2.0, read_timeout=2.0)
    source = RtspSource(config)
    assert source.display_url == shown
    with pytest.raises(SourceError) as failed:
        source.open()
    assert str(failed.value).startswith(f"source cam: cannot open {shown}: ")
    assert leaks(str(failed.value), password) == []
    assert leaks(failed.value.detail, password) == []

    # A running source fails, backs off and retries; nothing it says gives the password away.
    run = await run_until_reconnects(url, min_delay=0.05, timeout=5.0)
    states, labels, queue = run.states, run.labels, run.queue
    assert queue is not None
    assert isinstance(await queue.get(), EndOfStream)
    assert len(labels) >= 2 and set(labels) <= {"refused", "error"}
    backoffs = [reason for state, reason in states if state == SourceState.BACKOFF]
    assert len(backoffs) >= 2 and all(reason.startswith(f"cannot open {shown}: ") or
                                      reason.startswith(f"cannot connect to {shown}: ")
                                      for reason in backoffs), backoffs  # fmt: skip
    texts = [reason for _, reason in states] + [record.getMessage() for record in caplog.records]
    for text in texts:
        assert leaks(text, password) == [], text


def test_short_passwords_and_other_urls_in_a_message() -> None:
    # A short password is too common a string to blank on its own, but never shows in a URL.
    url = "rtsp://cam:pw@10.0.0.7/live"
    text = "401 from rtsp://cam:pw@10.0.0.7/live and nats://bot:hunter2@broker:4222 (user cam:pw)"
    assert redact_text(text, url) == (
        "401 from rtsp://***@10.0.0.7/live and nats://***@broker:4222 (user ***)"
    )
    assert redact_url("rtsp://10.0.0.7/live") == "rtsp://10.0.0.7/live"
    assert redact_text("no url here", "") == "no url here"


def test_credentials_in_a_query_are_redacted_like_user_info() -> None:
    url = "http://cam.local/video.cgi?user=camadmin&pwd=S3cretPass42&fps=5&api_key=K3yValue99&streamid=a"
    shown = "http://cam.local/video.cgi?user=***&pwd=***&fps=5&api_key=***&streamid=a"
    assert redact_url(url) == shown
    assert redact_url("srt://relay:9000?streamid=cam1&PassPhrase=longsecret1") == (
        "srt://relay:9000?streamid=cam1&PassPhrase=***"
    )
    # Keys that only end like a secret key word, and empty values, stay as they are.
    assert (
        redact_url("http://cam/a.mjpg?monkey=1&key=&keyframes=2")
        == "http://cam/a.mjpg?monkey=1&key=&keyframes=2"
    )
    echoed = f"{url}: Server returned 401; retrying with pwd S3cretPass42 (K3yValue99)"
    assert redact_text(echoed, url) == f"{shown}: Server returned 401; retrying with pwd *** (***)"
    assert redact_text(f"failed: {url}") == f"failed: {shown}"
    assert derive_id(url) == "video"


def test_camera_firmware_credential_forms_are_redacted_and_stay_out_of_ids() -> None:
    # Foscam-style CGI keys, and an NVR's credentials in the path (XMEye, some Dahua).
    cgi = "http://cam:88/videostream.cgi?loginuse=admin&loginpas=F0scamPw1&resolution=32"
    assert redact_url(cgi) == "http://cam:88/videostream.cgi?loginuse=***&loginpas=***&resolution=32"
    assert redact_text(f"401 for {cgi} (F0scamPw1)", cgi) == (
        "401 for http://cam:88/videostream.cgi?loginuse=***&loginpas=***&resolution=32 (***)"
    )
    nvr = "rtsp://10.0.0.9:554/user=admin_password=S3cretUnd_channel=1_stream=0.sdp?real_stream"
    shown = "rtsp://10.0.0.9:554/user=***_password=***_channel=1_stream=0.sdp?real_stream"
    assert redact_url(nvr) == shown
    assert redact_text(f"{nvr}: 5XX Server Error; retrying S3cretUnd", nvr) == (
        f"{shown}: 5XX Server Error; retrying ***"
    )
    assert redact_text(f"Could not open {nvr}") == f"Could not open {shown}"
    for url in (cgi, nvr):
        assert "F0scamPw1" not in derive_id(url) and "S3cretUnd" not in derive_id(url)
        assert "admin" not in derive_id(url)
    # A path that only looks like a key stays as it is.
    assert redact_url("rtsp://cam/live/user_guide=1") == "rtsp://cam/live/user_guide=1"


async def test_query_passwords_show_nowhere_through_a_live_server(
    tmp_path: Path, nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    port = free_port()  # nothing listens there: the source fails, backs off and retries
    url = f"http://127.0.0.1:{port}/video.cgi?user=camadmin&pwd=S3cretPass42&token=T0kenValue77"
    shown = f"http://127.0.0.1:{port}/video.cgi?user=***&pwd=***&token=***"
    text = f"pipeline: q\nnats: {{url: '{nats_server.url}'}}\nhttp: {{listen: '127.0.0.1:0'}}\n"
    stack = await Stack.start(tmp_path, text, nats_server.url)
    try:
        body = {"url": url, "open_timeout": 1, "reconnect": {"min_delay": 0.1, "max_delay": 0.2}}
        status, added = await stack.json("POST", "/v1/sources", json=body)
        assert status == 201, added
        assert (added["id"], added["url"]) == ("video", shown)
        run = stack.runtime.sources["video"]
        await until(lambda: run.report().reconnects >= 2, timeout=30, what="two reconnects")
        status, listed = await stack.json("GET", "/v1/sources")
        assert [(s["id"], s["url"]) for s in listed] == [("video", shown)]
        # Connecting, the reason is the last error; backing off, "reconnecting (retry N) after: " it.
        assert f"cannot connect to {shown}: connection refused" in listed[0]["reason"], listed[0]
        async with stack.http.get("/metrics") as resp:
            metrics = await resp.text()
        assert 'source="video"' in metrics
        logged = "\n".join(record.getMessage() for record in caplog.records)
        assert shown in logged
        for secret in ("camadmin", "S3cretPass42", "T0kenValue77"):
            assert secret not in json.dumps(listed) and secret not in metrics and secret not in logged, secret
    finally:
        await stack.close()
