"""Faults: broker outages, signals, failing stages and bad input never cost accepted frames."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path
from typing import Any

import nats
import pytest

from pipeline.config import load_config
from pipeline.frames import Frame
from pipeline.nats_server import EmbeddedNats
from pipeline.runtime import Runtime
from pipeline.stages.base import Stage
from samples.make_clip import write_clip
from tests.conftest import ROOT, Collector, validate_message

SQUARES = """\
pipeline: rel
models: {models}
sources:
{sources}
stages:
  - {{name: objects, type: infer, model: squares}}
"""


def config_file(tmp_path: Path, models: Path, sources: str) -> Path:
    path = tmp_path / "rel.yaml"
    path.write_text(SQUARES.format(models=models, sources=sources))
    return path


async def start_cli(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pipeline.cli", *args,
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def stream_count(url: str, stream: str = "VIDPIPE") -> int:
    nc = await nats.connect(url, max_reconnect_attempts=1)
    try:
        info = await nc.jetstream().stream_info(stream)
        return int(info.state.messages)
    except Exception:  # no stream yet, or the server is restarting
        return 0
    finally:
        await nc.close()


async def read_stream(url: str, subject: str) -> list[dict[str, Any]]:
    """Every message in the stream, through a fresh ordered JetStream consumer."""
    import json

    nc = await nats.connect(url)
    js = nc.jetstream()
    sub = await js.subscribe(subject, ordered_consumer=True)
    out: list[dict[str, Any]] = []
    while True:
        try:
            msg = await sub.next_msg(timeout=2.0)
        except TimeoutError:
            break
        out.append(json.loads(msg.data))
    await nc.close()
    return out


async def test_jetstream_mode_loses_and_duplicates_nothing_across_a_broker_kill(
    tmp_path: Path, sample_models: Path
) -> None:
    clip = write_clip(tmp_path / "clip.mp4", frames=300, fps=30, width=320, height=240, square=True)
    cfg = config_file(tmp_path, sample_models, f"  - {{url: {clip}, realtime: true}}")
    store = tmp_path / "js"
    server = EmbeddedNats(store_dir=str(store)).start()
    try:
        proc = await start_cli("run", str(cfg), "--nats", server.url, "--publish", "jetstream")
        deadline = time.monotonic() + 60
        while await stream_count(server.url) < 60 and time.monotonic() < deadline:
            assert proc.returncode is None, (await proc.communicate())[1].decode()
            await asyncio.sleep(0.1)
        assert await stream_count(server.url) >= 60
        server.stop(kill=True)  # SIGKILL mid-run
        await asyncio.sleep(1.5)
        server = EmbeddedNats(port=server.port, store_dir=str(store)).start()
        _, err = await asyncio.wait_for(proc.communicate(), 90)
        assert proc.returncode == 0, err.decode()
        messages = await read_stream(server.url, "vidpipe.rel.>")
    finally:
        server.cleanup()
    frames = [m["frame"] for m in messages]
    assert len(frames) == 300, f"{len(frames)} messages, {len(set(frames))} distinct"
    assert sorted(frames) == list(range(300))
    assert frames == sorted(frames), "per-source order is kept"
    for m in messages[:5]:
        validate_message(m)


async def test_sigterm_drains_in_flight_frames_and_exits_0(
    tmp_path: Path, sample_models: Path, nats_server: EmbeddedNats, collector: Collector
) -> None:
    cfg = config_file(tmp_path, sample_models, "  - {url: 'test://?fps=30&width=320&height=240'}")
    await collector.start(nats_server.url)
    proc = await start_cli("run", str(cfg), "--nats", nats_server.url)
    await collector.wait_for(20, timeout=30)
    assert len(collector.messages) >= 20
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    assert time.monotonic() - t0 < 10
    await asyncio.sleep(0.3)
    frames = [m["frame"] for m in collector.messages]
    # Every frame accepted before the signal was published: no holes, in order.
    assert frames == list(range(len(frames)))
    assert f"done: {len(frames)} frame(s) published from 1 source(s)" in err.decode()


def ocr_on_onnxruntime(tmp_path: Path) -> Path:
    """configs/ocr.yaml with the PP-OCR models on single-threaded ONNX Runtime: slow to drain."""
    repo = tmp_path / "models"
    for name in ("ppocr_det", "ppocr_cls", "ppocr_rec"):
        text = (ROOT / "samples" / "models" / name / "config.yaml").read_text()
        text = text.replace("backend: openvino", "backend: onnxruntime")
        text = text.replace("backend_options: {precision: auto}", "backend_options: {intra_op_threads: 1}")
        (repo / name).mkdir(parents=True)
        (repo / name / "config.yaml").write_text(text)
    config = tmp_path / "ocr.yaml"
    ocr = (ROOT / "configs" / "ocr.yaml").read_text()
    config.write_text(ocr.replace("models: ../samples/models", f"models: {repo}"))
    return config


async def test_second_signal_forces_exit(
    tmp_path: Path, nats_server: EmbeddedNats, collector: Collector
) -> None:
    # The OCR graph on big frames takes long to drain on ONNX Runtime (OpenVINO drains the
    # few frames in flight in a blink); the second signal must not wait for it.
    proc = await start_cli(
        "run", str(ocr_on_onnxruntime(tmp_path)), "--source", "test://?fps=30&width=1920&height=1080",
        "--nats", nats_server.url,
    )  # fmt: skip
    await collector.start(nats_server.url)
    await collector.wait_for(1, timeout=60)
    proc.send_signal(signal.SIGTERM)
    # Long enough for the first signal to be handled, short against draining 4 big frames.
    await asyncio.sleep(0.02)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert time.monotonic() - t0 < 5
    assert "forced exit" in err.decode()
    assert proc.returncode == 0  # it had published frames


class FailOnFrame(Stage):
    """A stage that raises on chosen frames: the seam for isolation tests."""

    def __init__(self, fail_on: set[int], context: Any) -> None:
        from pipeline.config import StageConfig

        super().__init__(StageConfig(name="flaky", type="track"), context)
        self.fail_on = fail_on

    async def process(self, frame: Frame) -> None:
        if frame.index in self.fail_on:
            raise ValueError(f"cannot handle frame {frame.index}")


async def test_a_stage_that_raises_drops_that_frame_only(
    tmp_path: Path, sample_models: Path, nats_server: EmbeddedNats, collector: Collector,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    cfg = load_config(
        config_file(tmp_path, sample_models, "  - {url: 'test://?fps=100&frames=30', queue_size: 64}")
    )
    await collector.start(nats_server.url)
    runtime = Runtime(cfg, nats_url=nats_server.url)
    await runtime.prepare()
    runtime._unordered.append(FailOnFrame({3, 4, 17}, runtime.stages[0].context))
    runtime.start_sources()
    await runtime.wait(20)
    await runtime.stop()
    await collector.wait_for(27)
    frames = [m["frame"] for m in collector.messages]
    assert frames == [f for f in range(30) if f not in (3, 4, 17)]
    assert runtime.metrics.frames_dropped.labels("rel", "test", "stage_error")._value.get() == 3
    # One log line per kind of failure per interval, not one per frame.
    errors = [r.getMessage() for r in caplog.records if "stage flaky failed" in r.getMessage()]
    assert errors == [
        "stage flaky failed on frame 3 of test: ValueError: cannot handle frame 3; frame dropped"
    ]


class ConcurrencyProbe(Stage):
    """Records how many frames are inside the graph at once (a seam, not a model)."""

    def __init__(self, context: Any) -> None:
        from pipeline.config import StageConfig

        super().__init__(StageConfig(name="probe", type="track"), context)
        self.now = 0
        self.peak = 0

    async def process(self, frame: Frame) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)
        await asyncio.sleep(0.02)
        self.now -= 1


async def test_max_in_flight_bounds_frames_in_the_graph_exactly(
    tmp_path: Path, sample_models: Path, nats_server: EmbeddedNats, collector: Collector
) -> None:
    clip = write_clip(tmp_path / "c.mp4", frames=30, fps=30, width=160, height=120)
    text = (
        SQUARES.format(models=sample_models, sources=f"  - {{url: {clip}}}") + "runtime: {max_in_flight: 3}\n"
    )
    path = tmp_path / "inflight.yaml"
    path.write_text(text)
    await collector.start(nats_server.url)
    runtime = Runtime(load_config(path), nats_url=nats_server.url)
    await runtime.prepare()
    probe = ConcurrencyProbe(runtime.stages[0].context)
    runtime._unordered.append(probe)
    runtime.start_sources()
    await runtime.wait(30)
    await runtime.stop()
    await collector.wait_for(30)
    assert [m["frame"] for m in collector.messages] == list(range(30))
    assert probe.peak == 3


async def test_core_mode_rides_out_a_broker_outage_and_counts_what_it_drops(
    tmp_path: Path, sample_models: Path
) -> None:
    clip = write_clip(tmp_path / "clip.mp4", frames=90, fps=30, width=160, height=120)
    cfg_path = config_file(tmp_path, sample_models, f"  - {{id: cam, url: {clip}, realtime: true}}")
    cfg_path.write_text(cfg_path.read_text() + "nats: {publish: core, outbox_size: 5}\n")
    server = EmbeddedNats(store_dir=str(tmp_path / "js")).start()
    runtime = Runtime(load_config(cfg_path), nats_url=server.url)
    late = Collector()
    try:
        await runtime.start()
        deadline = time.monotonic() + 30
        while runtime.published_total() < 20 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        server.stop(kill=True)
        await asyncio.sleep(1.0)  # 30 frames come and go while the broker is away
        server = EmbeddedNats(port=server.port, store_dir=str(tmp_path / "js")).start()
        await late.start(server.url, "vidpipe.rel.>")
        await runtime.wait(30)
        await runtime.stop()
        await late.wait_for(1, timeout=5)
    finally:
        await late.close()
        server.cleanup()
    errors = runtime.metrics.publish_errors
    dropped = errors.labels("rel", "cam", "outbox_full")._value.get()
    sent = runtime.metrics.published.labels("rel", "cam")._value.get()
    # Only messages that really left count as published; the rest were dropped and
    # counted because the outbox (5) was full while the broker was away.
    assert runtime.published_total() == sent >= 50
    assert dropped >= 10
    assert sent + dropped <= 90
    # After the broker came back, messages flowed again, in order, to the end.
    frames = [m["frame"] for m in late.messages]
    assert frames and frames[-1] == 89
    assert frames == sorted(set(frames))


async def test_jetstream_keeps_every_run_of_a_source(tmp_path: Path, sample_models: Path) -> None:
    # Frame numbers start at 0 on every run; a restart must not look like a retry.
    clip = write_clip(tmp_path / "cam.mp4", frames=5, fps=10, width=160, height=120)
    cfg = config_file(tmp_path, sample_models, f"  - {{url: {clip}}}")
    with EmbeddedNats(store_dir=str(tmp_path / "js")) as server:
        for _ in range(2):
            proc = await start_cli("run", str(cfg), "--nats", server.url, "--publish", "jetstream")
            _, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0, err.decode()
        messages = await read_stream(server.url, "vidpipe.rel.>")
    assert [m["frame"] for m in messages] == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]


async def test_a_failing_publish_hook_does_not_stall_the_source(
    tmp_path: Path, sample_models: Path, nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = load_config(
        config_file(tmp_path, sample_models, "  - {url: 'test://?fps=100&frames=20', queue_size: 64}")
    )

    def hook(frame: Frame) -> None:
        if frame.index == 3:
            raise RuntimeError("subscriber bug")

    runtime = Runtime(cfg, nats_url=nats_server.url, on_published=hook)
    await runtime.start()
    await runtime.wait(20)
    await runtime.stop()
    assert runtime.published_total() == 20
    assert "on_published hook failed on frame 3 of test: RuntimeError('subscriber bug')" in caplog.text


class Hang(Stage):
    """A stage that never finishes (a seam standing in for a wedged dependency)."""

    def __init__(self, context: Any) -> None:
        from pipeline.config import StageConfig

        super().__init__(StageConfig(name="hang", type="track"), context)

    async def process(self, frame: Frame) -> None:
        await asyncio.Event().wait()


async def test_removing_a_wedged_source_gives_up_after_the_drain_timeout(
    tmp_path: Path, sample_models: Path, nats_server: EmbeddedNats
) -> None:
    path = config_file(tmp_path, sample_models, "  - {id: stuck, url: 'test://?fps=30'}")
    path.write_text(path.read_text() + "runtime: {drain_timeout: 0.5}\n")
    runtime = Runtime(load_config(path), nats_url=nats_server.url)
    await runtime.prepare()
    runtime._unordered.append(Hang(runtime.stages[0].context))
    runtime.start_sources()
    await asyncio.sleep(0.5)
    t0 = time.monotonic()
    assert await runtime.remove_source("stuck") is True
    assert time.monotonic() - t0 < 3
    assert "stuck" not in runtime.sources
    assert 'source="stuck"' not in runtime.metrics.render().decode()
    await runtime.stop()
