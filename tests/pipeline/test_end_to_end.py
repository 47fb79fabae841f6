"""End to end: YAML → sources → PyAV decode → ONNX Runtime → NATS, read by a separate subscriber."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.nats_server import EmbeddedNats
from pipeline.sources.pattern import pattern_square_box
from samples.make_clip import square_at, write_clip
from tests.conftest import ROOT, Collector, run_cli, validate_message

PIPELINE = """\
pipeline: e2e
models: {models}
sources:
  - id: pattern
    url: test://?width=320&height=240&fps=20&frames={pattern_frames}
    queue_size: 256        # live sources drop when behind; this run must see every frame
  - id: clip
    url: {clip}
stages:
  - {{name: objects, type: infer, model: squares}}
  - {{name: track, type: track}}
"""


def assert_box(actual: list[float], truth: tuple[int, int, int, int], tolerance: float = 2.0) -> None:
    assert all(abs(a - t) <= tolerance for a, t in zip(actual, truth, strict=True)), (actual, truth)


async def run_async(*args: str, timeout: float = 120) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pipeline.cli", *args,
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_pattern_and_file_sources_publish_one_ordered_message_per_frame(
    tmp_path: Path, nats_server: EmbeddedNats, collector: Collector, sample_models: Path
) -> None:
    clip = write_clip(tmp_path / "clip.mp4", frames=30, fps=15)
    config = tmp_path / "e2e.yaml"
    config.write_text(PIPELINE.format(models=sample_models, pattern_frames=40, clip=clip))
    await collector.start(nats_server.url, "vidpipe.e2e.>")

    code, _, err = await run_async("run", str(config), "--nats", nats_server.url)
    assert code == 0, err
    await collector.wait_for(70)
    assert "Traceback" not in err

    for subject, message in zip(collector.subjects, collector.messages, strict=True):
        validate_message(message)
        assert subject == f"vidpipe.e2e.{message['source']}.detections"

    pattern = collector.by_source("pattern")
    assert [m["frame"] for m in pattern] == list(range(40))
    for m in pattern:
        assert (m["width"], m["height"]) == (320, 240)
        (obj,) = m["objects"]
        assert obj["label"] == "square" and obj["class_id"] == 0
        assert_box(obj["bbox"], pattern_square_box(m["frame"], 320, 240))
        assert m["publish_ts"] >= m["capture_ts"]
        assert m["pts"] == pytest.approx(m["frame"] / 20, abs=1e-6)

    from_clip = collector.by_source("clip")
    assert [m["frame"] for m in from_clip] == list(range(30))
    for m in from_clip:
        (obj,) = m["objects"]
        assert_box(obj["bbox"], square_at(m["frame"], 640, 360))
    # The tracker follows the one square of each source with one id.
    assert {m["objects"][0]["track_id"] for m in from_clip} == {1}
    assert "done: 70 frame(s) published from 2 source(s)" in err


async def test_source_flag_runs_the_graph_on_another_file(
    tmp_path: Path, nats_server: EmbeddedNats, collector: Collector
) -> None:
    clip = write_clip(tmp_path / "parking lot.mp4", frames=12, fps=10)
    await collector.start(nats_server.url)
    code, _, err = await run_async(
        "run", str(ROOT / "configs" / "demo.yaml"), "--source", str(clip), "--nats", nats_server.url
    )
    assert code == 0, err
    await collector.wait_for(12)
    assert collector.subjects == ["vidpipe.demo.parking_lot.detections"] * 12
    assert [m["frame"] for m in collector.messages] == list(range(12))


async def test_max_frames_stops_each_source_after_n(
    squares_config: Path, tmp_path: Path, nats_server: EmbeddedNats, collector: Collector
) -> None:
    await collector.start(nats_server.url)
    code, _, err = await run_async(
        "run", str(squares_config),
        "--source", "test://?fps=50", "--source", "test://?fps=50&width=320&height=180",
        "--nats", nats_server.url, "--max-frames", "15",
    )  # fmt: skip
    assert code == 0, err
    await collector.wait_for(30)
    assert sorted({m["source"] for m in collector.messages}) == ["test", "test_2"]
    for source in ("test", "test_2"):
        assert [m["frame"] for m in collector.by_source(source)] == list(range(15))
        # The log says why each source stopped: the limit, not a stop someone asked for.
        assert f"source {source}: stopped (max frames reached: 15)" in err


def test_embedded_nats_is_started_printed_and_stopped(squares_config: Path, tmp_path: Path) -> None:
    proc = run_cli("run", str(squares_config), "--source", "test://?fps=50&frames=10", "--summary")
    assert proc.returncode == 0, proc.stderr
    match = re.search(r"embedded NATS server at nats://127\.0\.0\.1:(\d+)", proc.stdout)
    assert match, proc.stdout
    # The summary subscribed to the pipeline's own output and saw every frame.
    assert "received 10 messages from 1 source(s)" in proc.stdout
    # The server is gone once run exits.
    import socket

    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", int(match.group(1))), timeout=1):
        pass


async def test_broken_source_is_named_and_the_other_source_goes_on(
    squares_config: Path, tmp_path: Path, nats_server: EmbeddedNats, collector: Collector
) -> None:
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(bytes(range(256)) * 64)
    good = write_clip(tmp_path / "good.mp4", frames=20, fps=10)
    await collector.start(nats_server.url)
    code, _, err = await run_async(
        "run", str(squares_config), "--source", str(garbage), "--source", str(good),
        "--source", str(tmp_path / "missing.mp4"), "--nats", nats_server.url,
    )  # fmt: skip
    assert code == 0, err
    await collector.wait_for(20)
    assert [m["frame"] for m in collector.by_source("good")] == list(range(20))
    assert collector.by_source("garbage") == [] and collector.by_source("missing") == []
    lines = err.splitlines()
    garbage_lines = [line for line in lines if "source garbage:" in line]
    assert len(garbage_lines) == 1 and f"cannot open {garbage}" in garbage_lines[0], err
    missing_lines = [line for line in lines if "source missing:" in line]
    assert len(missing_lines) == 1 and "file not found" in missing_lines[0], err
    assert "Traceback" not in err


async def test_run_exits_1_when_no_source_produced_anything(
    squares_config: Path, tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    code, _, err = await run_async(
        "run", str(squares_config), "--source", str(tmp_path / "nothing.mp4"),
        "--nats", nats_server.url,
    )  # fmt: skip
    assert code == 1
    assert f"source nothing: file not found: {tmp_path / 'nothing.mp4'}" in err
    assert "Traceback" not in err


def test_unreachable_nats_is_a_runtime_error_with_a_hint(squares_config: Path, tmp_path: Path) -> None:
    proc = run_cli(
        "run", str(squares_config), "--source", "test://?frames=5",
        "--nats", "nats://127.0.0.1:9",
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "vidpipe: cannot connect to NATS at nats://127.0.0.1:9: timed out after 5s; last error: "
        "connection refused; check --nats / nats.url, or omit both to start an embedded server"
    )
    assert "Traceback" not in proc.stderr


def test_wrong_nats_credentials_are_named_not_a_bare_timeout(squares_config: Path, tmp_path: Path) -> None:
    from pipeline.nats_server import find_nats_server, free_port

    port = free_port()
    server = subprocess.Popen(
        [find_nats_server(), "-a", "127.0.0.1", "-p", str(port), "--user", "op", "--pass", "s3cret"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        proc = run_cli(
            "run", str(squares_config), "--source", "test://?frames=5",
            "--nats", f"nats://op:wrong@127.0.0.1:{port}",
        )  # fmt: skip
    finally:
        server.kill()
        server.wait()
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"vidpipe: cannot connect to NATS at nats://***@127.0.0.1:{port}: timed out after 5s; last error: "
        "Authorization Violation (check the user and password, or token, in the NATS URL); "
        "check --nats / nats.url, or omit both to start an embedded server"
    )
    assert "wrong" not in proc.stderr


def test_a_run_that_published_nothing_says_why_each_source_never_came_up(squares_config: Path) -> None:
    proc = run_cli(
        "run", str(squares_config), "--source", "rtsp://user:pw@127.0.0.1:9/stream1", "--duration", "5",
    )  # fmt: skip
    assert proc.returncode == 1
    done = [line for line in proc.stderr.splitlines() if " done: " in line]
    assert len(done) == 1, proc.stderr
    assert (
        done[0]
        .split(" done: ", 1)[1]
        .startswith(
            "0 frame(s) published from 1 source(s); stream1 never up "
            "(backoff: cannot connect to rtsp://***@127.0.0.1:9/stream1: connection refused; retry "
        )
    ), done
    assert "pw" not in proc.stderr


def test_subscribe_to_an_unreachable_server_waits_for_its_timeout_and_says_so() -> None:
    proc = run_cli("subscribe", "--nats", "nats://127.0.0.1:9", "--timeout", "3")
    assert proc.returncode == 1
    refused = "[Errno 111] Connect call failed ('127.0.0.1', 9)"
    assert proc.stderr.splitlines() == [
        f"vidpipe: waiting for NATS at nats://127.0.0.1:9 ({refused}); Ctrl-C to stop",
        f"vidpipe: cannot connect to NATS at nats://127.0.0.1:9 in 3s: {refused}",
    ]


async def test_a_subscriber_started_before_its_server_receives_once_the_server_is_up() -> None:
    import nats

    server = EmbeddedNats()  # its port is chosen now; the server starts later
    sub = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pipeline.cli", "subscribe", "--nats", server.url, "--timeout", "120",
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert sub.stdout is not None and sub.stderr is not None
    try:
        waiting = (await asyncio.wait_for(sub.stderr.readline(), 60)).decode()
        assert waiting.startswith(f"vidpipe: waiting for NATS at {server.url} ("), waiting
        server.start()
        nc = await nats.connect(server.url)
        try:
            for _ in range(600):  # until the subscriber has connected and listens
                await nc.publish("vidpipe.p.cam.detections", b'{"frame": 7}')
                try:
                    line = await asyncio.wait_for(sub.stdout.readline(), 0.2)
                    break
                except TimeoutError:
                    continue
            else:
                raise AssertionError("the subscriber never received a message")
        finally:
            await nc.close()
        assert json.loads(line) == {"frame": 7}
        sub.send_signal(signal.SIGTERM)
        await asyncio.wait_for(sub.communicate(), 30)
        assert sub.returncode == 0
    finally:
        if sub.returncode is None:
            sub.kill()
            await sub.wait()
        server.stop()


async def test_subscribe_prints_json_lines(
    squares_config: Path, tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    import nats

    sub = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pipeline.cli", "subscribe", "--nats", nats_server.url, "vidpipe.demo.>",
        "--timeout", "60",
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert sub.stdout is not None
    # Frames must not flow before the subscriber listens: probe until it echoes one.
    nc = await nats.connect(nats_server.url)
    try:
        for _ in range(100):
            await nc.publish("vidpipe.demo.probe", b'{"probe": true}')
            try:
                first = await asyncio.wait_for(sub.stdout.readline(), 0.2)
                break
            except TimeoutError:
                continue
        else:
            raise AssertionError("the subscriber never received a probe")
    finally:
        await nc.close()
    assert json.loads(first) == {"probe": True}
    code, _, err = await run_async(
        "run", str(squares_config), "--source", "test://?fps=50&frames=5",
        "--nats", nats_server.url,
    )  # fmt: skip
    assert code == 0, err
    lines: list[str] = []
    while len(lines) < 5:
        line = (await asyncio.wait_for(sub.stdout.readline(), 30)).decode()
        assert line, "the subscriber ended early"
        if "probe" not in line:  # probes still in flight when the first came back
            lines.append(line)
    sub.send_signal(signal.SIGTERM)
    await asyncio.wait_for(sub.communicate(), 30)
    assert sub.returncode == 0
    assert [json.loads(line)["frame"] for line in lines] == [0, 1, 2, 3, 4]
    for line in lines:
        validate_message(json.loads(line))
