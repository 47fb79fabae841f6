"""Faults: broker outages, signals, failing stages and bad input never cost accepted frames."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import numpy as np
import pytest

from pipeline.config import NatsConfig, load_config
from pipeline.frames import Frame
from pipeline.metrics import Metrics
from pipeline.nats_server import EmbeddedNats
from pipeline.runtime import Runtime
from pipeline.stages.base import Stage, StageContext, StageOptions
from pipeline.stages.publish import Publisher
from samples.make_clip import write_clip
from tests.conftest import ROOT, Collector, validate_message
from tests.pipeline.stack import stage_kinds, until

SQUARES = """\
pipeline: rel
models: {models}
sources:
{sources}
stages:
  - {{name: objects, type: infer, model: squares}}
"""


def metric(runtime: Runtime, name: str, **labels: str) -> float:
    """A sample of the runtime's registry (0 when the series does not exist yet)."""
    value = runtime.metrics.registry.get_sample_value(name, {"pipeline": "rel", **labels})
    return value or 0.0


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
        # The outage itself: 1.5 s of frames (45 at 30 fps) published while no broker is there.
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


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP])
async def test_sigterm_drains_in_flight_frames_and_exits_0(
    tmp_path: Path, sample_models: Path, nats_server: EmbeddedNats, collector: Collector, stop: signal.Signals
) -> None:
    # SIGHUP (a closed terminal, a supervisor's "reload") killed the run at once (129).
    cfg = config_file(tmp_path, sample_models, "  - {url: 'test://?fps=30&width=320&height=240'}")
    await collector.start(nats_server.url)
    proc = await start_cli("run", str(cfg), "--nats", nats_server.url)
    await collector.wait_for(20, timeout=30)
    assert len(collector.messages) >= 20
    t0 = time.monotonic()
    proc.send_signal(stop)
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    assert ("vidpipe does not reload its config on SIGHUP; stopping" in err.decode()) == (
        stop == signal.SIGHUP
    )
    assert time.monotonic() - t0 < 10
    done = re.search(r"done: (\d+) frame\(s\) published from 1 source\(s\)", err.decode())
    assert done, err.decode()
    await collector.wait_for(int(done.group(1)), timeout=5)
    frames = [m["frame"] for m in collector.messages]
    # Every frame accepted before the signal was published: no holes, in order.
    assert frames == list(range(int(done.group(1))))


def ocr_on_onnxruntime(tmp_path: Path) -> Path:
    """configs/ocr.yaml with the PP-OCR models on single-threaded ONNX Runtime: slow to drain."""
    repo = tmp_path / "models"
    for name in ("ppocr_det", "ppocr_cls", "ppocr_rec"):
        text = (ROOT / "samples" / "models" / name / "config.yaml").read_text()
        text = text.replace("backend: openvino", "backend: onnxruntime")
        text = re.sub(r"(?m)^backend_options: .*$", "backend_options: {intra_op_threads: 1}", text)
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
    assert proc.stderr is not None
    # The second signal counts only once the first one is being handled.
    while b"stopping: finishing frames in flight" not in (line := await proc.stderr.readline()):
        assert line, "the process ended before it said it was stopping"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert time.monotonic() - t0 < 5
    assert "forced exit" in err.decode()
    assert proc.returncode == 130  # forced: not a clean end, whatever was published


@dataclass(frozen=True)
class FailOptions(StageOptions):
    fail_on: list[int] = field(default_factory=list)


class FailOnFrame(Stage):
    """A stage kind that raises on chosen frames: the seam for isolation tests."""

    kind = "fail_on_frame"
    options_type = FailOptions

    async def process(self, frame: Frame) -> None:
        assert isinstance(self.options, FailOptions)
        if frame.index in self.options.fail_on:
            raise ValueError(f"cannot handle frame {frame.index}")


async def test_a_stage_that_raises_drops_that_frame_only(
    tmp_path: Path, sample_models: Path, nats_server: EmbeddedNats, collector: Collector,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    sources = (
        "  - {url: 'test://?fps=100&frames=30', queue_size: 64}\n"
        "  - {url: 'test://?fps=100&frames=30&id=other', queue_size: 64}"
    )
    path = config_file(tmp_path, sample_models, sources)
    path.write_text(path.read_text() + "  - {name: flaky, type: fail_on_frame, fail_on: [3, 4, 17]}\n")
    await collector.start(nats_server.url)
    with stage_kinds(FailOnFrame):
        runtime = Runtime(load_config(path), nats_url=nats_server.url)
        await runtime.start()
    await runtime.wait(20)
    await runtime.stop()
    await collector.wait_for(54)
    for source in ("test", "other"):
        frames = [m["frame"] for m in collector.by_source(source)]
        assert frames == [f for f in range(30) if f not in (3, 4, 17)]
        assert metric(runtime, "vidpipe_frames_dropped_total", source=source, reason="stage_error") == 3
    # One log line per kind of failure per source and interval, not one per frame; one
    # camera's failures do not hide another's. The line names its source (a JSON field).
    errors = sorted(
        (r.getMessage(), getattr(r, "source", None))
        for r in caplog.records
        if "stage flaky failed" in r.getMessage()
    )
    assert errors == [
        ("stage flaky failed on frame 3 of other: ValueError: cannot handle frame 3; frame dropped", "other"),
        ("stage flaky failed on frame 3 of test: ValueError: cannot handle frame 3; frame dropped", "test"),
    ]


class ConcurrencyProbe(Stage):
    """Records how many frames are inside the graph at once (a seam, not a model)."""

    kind = "concurrency_probe"

    def __init__(self, options: StageOptions, context: StageContext) -> None:
        super().__init__(options, context)
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
    text = SQUARES.format(models=sample_models, sources=f"  - {{url: {clip}}}")
    text += "  - {name: probe, type: concurrency_probe}\nruntime: {max_in_flight: 3}\n"
    path = tmp_path / "inflight.yaml"
    path.write_text(text)
    await collector.start(nats_server.url)
    with stage_kinds(ConcurrencyProbe):
        runtime = Runtime(load_config(path), nats_url=nats_server.url)
        await runtime.start()
    probe = next(s for s in runtime.stages if isinstance(s, ConcurrencyProbe))
    await runtime.wait(30)
    await runtime.stop()
    await collector.wait_for(30)
    assert [m["frame"] for m in collector.messages] == list(range(30))
    assert probe.peak == 3


async def test_core_mode_rides_out_a_broker_outage_and_counts_what_it_drops(
    tmp_path: Path, sample_models: Path, caplog: pytest.LogCaptureFixture
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
        # The broker stays away until the outbox (5) has overflowed by 10 messages.
        await until(
            lambda: metric(runtime, "vidpipe_publish_errors_total", source="cam", reason="outbox_full") >= 10,
            timeout=20,
            what="10 outbox_full drops",
        )
        server = EmbeddedNats(port=server.port, store_dir=str(tmp_path / "js")).start()
        await late.start(server.url, "vidpipe.rel.>")
        await runtime.wait(30)
        await runtime.stop()
        await late.wait_for(1, timeout=5)
    finally:
        await late.close()
        server.cleanup()
    dropped = metric(runtime, "vidpipe_publish_errors_total", source="cam", reason="outbox_full")
    sent = metric(runtime, "vidpipe_published_messages_total", source="cam")
    # Only messages that really left count as published; the rest were dropped and
    # counted because the outbox (5) was full while the broker was away.
    assert runtime.published_total() == sent >= 50
    assert dropped >= 10
    assert sent + dropped <= 90
    # Said, not only counted: once per 10 s, and for the done line.
    assert runtime.publisher.overflowed == {"cam": dropped}
    said = [r.getMessage() for r in caplog.records if "the outbox is full" in r.getMessage()]
    assert said and said[0].startswith(f"NATS at {server.url} is away and the outbox is full (5 messages)")
    assert len(said) <= 2
    # After the broker came back, messages flowed again, in order, to the end.
    frames = [m["frame"] for m in late.messages]
    assert frames and frames[-1] == 89
    assert frames == sorted(set(frames))


async def test_core_outbox_sends_after_a_broker_restart_and_no_task_runs_while_idle(tmp_path: Path) -> None:
    server = EmbeddedNats().start()
    metrics = Metrics()
    sent: list[str] = []  # what the publisher reports as really sent (the runtime counts these)
    publisher = Publisher(NatsConfig(outbox_size=3), server.url, "rel", metrics, on_sent=sent.append)
    received: asyncio.Queue[int] = asyncio.Queue()

    async def on_msg(msg: Any) -> None:
        received.put_nowait(json.loads(msg.data)["frame"])

    async def next_frames(n: int) -> list[int]:
        return [await asyncio.wait_for(received.get(), 30) for _ in range(n)]

    def frame(index: int) -> Frame:
        return Frame("cam", index, index / 30, time.time(), np.zeros((4, 4, 3), np.uint8))

    def outbox_tasks() -> list[asyncio.Task[Any]]:
        return [t for t in asyncio.all_tasks() if t.get_name() == "nats-outbox"]

    try:
        await publisher.connect()
        assert publisher.nc is not None
        # On the publisher's own connection: the client subscribes again on reconnect
        # before anything is sent, so it sees every message the outbox sends then.
        await publisher.nc.subscribe("vidpipe.rel.>", cb=on_msg)
        await publisher.publish(frame(0))  # connected: sent at once
        assert await next_frames(1) == [0]
        assert not publisher.flushing and outbox_tasks() == []
        server.stop(kill=True)
        await until(lambda: not publisher.connected.is_set(), what="the client to see the broker go")
        for index in range(1, 6):
            await publisher.publish(frame(index))
        # The outbox (3) keeps the newest; one task waits for the reconnect event.
        assert publisher.outbox_size == 3 and publisher.flushing and len(outbox_tasks()) == 1
        server = EmbeddedNats(port=server.port).start()
        assert await next_frames(3) == [3, 4, 5]
        # Sent and idle again: no task left behind to wake up on a timer.
        assert publisher.outbox_size == 0 and not publisher.flushing and outbox_tasks() == []
    finally:
        await publisher.close()
        server.cleanup()

    def count(name: str, **labels: str) -> float:
        value = metrics.registry.get_sample_value(name, {"pipeline": "rel", "source": "cam", **labels})
        return value or 0.0

    assert sent == ["cam"] * 4
    assert count("vidpipe_publish_errors_total", reason="outbox_full") == 2
    assert count("vidpipe_publish_errors_total", reason="shutdown") == 0


async def test_a_stop_waits_for_the_broker_and_says_what_it_could_not_send(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = EmbeddedNats().start()
    url = server.url

    def frame(index: int) -> Frame:
        return Frame("cam", index, index / 30, time.time(), np.zeros((4, 4, 3), np.uint8))

    async def queued(publisher: Publisher, n: int) -> None:
        """``n`` frames published after the broker went: all in the outbox."""
        await publisher.connect()
        server.stop(kill=True)
        await until(lambda: not publisher.connected.is_set(), what="the client to see the broker go")
        for index in range(n):
            await publisher.publish(frame(index))
        assert publisher.outbox_size == n

    # The broker comes back while the stop waits for it: everything accepted is sent.
    sent: list[str] = []
    publisher = Publisher(NatsConfig(), url, "rel", Metrics(), on_sent=sent.append)
    try:
        await queued(publisher, 3)
        closing = asyncio.create_task(publisher.close(timeout=60))
        server = EmbeddedNats(port=server.port).start()
        await asyncio.wait_for(closing, 60)
    finally:
        server.cleanup()
    assert (sent, publisher.unsent) == (["cam"] * 3, {})

    # It does not come back: the messages are counted, logged and reported as not sent.
    metrics = Metrics()
    publisher = Publisher(NatsConfig(), url, "rel", metrics)
    server = EmbeddedNats(port=server.port).start()
    try:
        await queued(publisher, 4)
        with caplog.at_level("WARNING", logger="vidpipe"):
            await publisher.close(timeout=0.5)
    finally:
        server.cleanup()
    assert publisher.unsent == {"cam": 4}
    labels = {"pipeline": "rel", "source": "cam", "reason": "shutdown"}
    assert metrics.registry.get_sample_value("vidpipe_publish_errors_total", labels) == 4
    said = [r.getMessage() for r in caplog.records if r.name.startswith("vidpipe")]
    assert said[-2:] == [
        f"stopping: 4 message(s) wait for NATS at {url}, which is not connected; waiting up to 0.5s for it",
        f"4 message(s) not sent: NATS at {url} did not take them before the stop (cam 4)",
    ]


async def test_a_run_that_ends_with_messages_it_could_not_send_says_so_and_exits_1(
    tmp_path: Path, sample_models: Path
) -> None:
    clip = write_clip(tmp_path / "cam.mp4", frames=40, fps=10, width=160, height=120)
    cfg = config_file(tmp_path, sample_models, f"  - {{url: {clip}, realtime: true}}")
    cfg.write_text(cfg.read_text() + "runtime: {drain_timeout: 1}\n")
    server = EmbeddedNats().start()
    try:
        proc = await start_cli("run", str(cfg), "--nats", server.url)
        assert proc.stderr is not None
        lines: list[str] = []
        while "source cam: up" not in (line := (await proc.stderr.readline()).decode()):
            assert line, "".join(lines)
            lines.append(line)
        server.stop(kill=True)  # the broker goes away for good while the clip plays
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        server.cleanup()
    text = "".join(lines) + err.decode()
    assert proc.returncode == 1, text
    done = re.search(r" done: (\d+) frame\(s\) published from 1 source\(s\); not sent: (\d+) message\(s\), "
                     r"NATS unreachable at the stop\n", text)  # fmt: skip
    assert done, text
    published, unsent = int(done.group(1)), int(done.group(2))
    # Every frame of the clip was processed: each was either sent or is counted as not sent.
    assert unsent > 0 and published + unsent == 40, text
    assert (
        f"{unsent} message(s) not sent: NATS at {server.url} did not take them before the stop (cam {unsent})"
        in text
    )


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


async def test_the_stream_vidpipe_makes_has_the_limits_of_its_config(
    tmp_path: Path, sample_models: Path
) -> None:
    # JetStream keeps everything by default: the stream filled the server's disk.
    cfg = config_file(tmp_path, sample_models, "  - {url: 'test://?frames=2&fps=50'}")
    limited = tmp_path / "limited.yaml"
    limited.write_text(cfg.read_text() + "nats: {stream_max_age: 3600, stream_max_bytes: 0}\n")
    with EmbeddedNats(store_dir=str(tmp_path / "js")) as server:
        seen = []
        for config in (cfg, limited):
            proc = await start_cli("run", str(config), "--nats", server.url, "--publish", "jetstream")
            _, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0, err.decode()
            nc = await nats.connect(server.url)
            try:
                stream = (await nc.jetstream().stream_info("VIDPIPE")).config
                seen.append((stream.max_age, stream.max_bytes, stream.discard))
                await nc.jetstream().delete_stream("VIDPIPE")
            finally:
                await nc.close()
            if config is cfg:
                assert (
                    "created JetStream stream VIDPIPE for vidpipe.> (keeps 86400 s, 1073741824 bytes)"
                    in err.decode()
                )
    assert seen == [(86400.0, 1 << 30, "old"), (3600.0, -1, "old")]


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
    """A stage kind that never finishes (a seam standing in for a wedged dependency)."""

    kind = "hang"

    def __init__(self, options: StageOptions, context: StageContext) -> None:
        super().__init__(options, context)
        self.inside = 0  # frames waiting in process() now
        self.cancelled = 0  # frames given up on while inside
        self.finished = 0

    async def process(self, frame: Frame) -> None:
        self.inside += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.inside -= 1
        self.finished += 1


async def test_removing_a_wedged_source_gives_up_after_the_drain_timeout(
    tmp_path: Path, sample_models: Path, nats_server: EmbeddedNats
) -> None:
    path = config_file(tmp_path, sample_models, "  - {id: stuck, url: 'test://?fps=30'}")
    path.write_text(
        path.read_text() + "  - {name: hang, type: hang}\nruntime: {drain_timeout: 0.5, max_in_flight: 4}\n"
    )
    with stage_kinds(Hang):
        runtime = Runtime(load_config(path), nats_url=nats_server.url)
        await runtime.start()
    hang = next(s for s in runtime.stages if isinstance(s, Hang))
    # max_in_flight (4) frames are wedged in the stage and nothing can be published.
    await until(lambda: hang.inside == 4, what="four frames stuck in the hanging stage")
    assert runtime.sources["stuck"].published == 0
    t0 = time.monotonic()
    assert await runtime.remove_source("stuck") is True
    assert time.monotonic() - t0 < 3
    # They really hung: none finished, and each was given up on at the drain timeout.
    assert (hang.inside, hang.cancelled, hang.finished) == (0, 4, 0)
    assert "stuck" not in runtime.sources
    assert 'source="stuck"' not in runtime.metrics.render().decode()
    await runtime.stop()


async def test_sources_that_end_one_after_another_leave_no_task_behind(tmp_path: Path) -> None:
    # Each source that ends wakes the wait for the rest; none of those wake-ups may outlive
    # the run (a pending task at loop close prints "Task was destroyed but it is pending").
    path = tmp_path / "p.yaml"
    path.write_text(
        "pipeline: p\nsources:\n"
        "  - {id: a, url: 'test://?frames=2'}\n  - {id: b, url: 'test://?frames=12'}\n"
        "  - {id: c, url: 'test://?frames=30'}\n"
        "stages:\n  - {name: t, type: track}\n"
    )
    published: list[str] = []
    rt = Runtime(load_config(path), nats_url=None, on_published=lambda f: published.append(f.source))
    await rt.start()
    await rt.wait(60)
    await rt.stop()
    assert sorted(set(published)) == ["a", "b", "c"] and len(published) == 44
    left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert left == []


@pytest.mark.parametrize("mode", ["jetstream", "core"])
def test_a_message_over_the_servers_max_payload_is_dropped_alone_and_said(
    tmp_path: Path, sample_models: Path, mode: str
) -> None:
    # In JetStream mode the server answered the oversized publish by closing the connection,
    # and the run hung; in core mode the frames were lost with no drop counted.
    import subprocess

    from pipeline.nats_server import find_nats_server, free_port
    from tests.conftest import run_cli

    empty = write_clip(tmp_path / "empty.mp4", frames=6, width=160, height=120, plates=[], square=False)
    square = write_clip(tmp_path / "square.mp4", frames=6, width=160, height=120, plates=[])
    # Twenty zones over the whole picture: a frame with the square lists them all (1.6 kB).
    corners = "[[0, 0], [160, 0], [160, 120], [0, 120]]"
    zones = ", ".join(f"{{name: z{i:02d}{'x' * 60}, polygon: {corners}}}" for i in range(20))
    config = tmp_path / "big.yaml"
    config.write_text(
        f"pipeline: big\nmodels: {sample_models}\nsources: [{{url: {empty}}}, {{url: {square}}}]\n"
        f"stages:\n  - {{name: objects, type: infer, model: squares}}\n  - {{name: areas, type: zones, zones: [{zones}]}}\n"
    )
    port = free_port()
    (tmp_path / "nats.conf").write_text(
        f"listen: 127.0.0.1:{port}\nmax_payload: 1024\njetstream: {{store_dir: {tmp_path / 'js'}}}\n"
    )
    server = subprocess.Popen(
        [find_nats_server(), "-c", str(tmp_path / "nats.conf")], stderr=subprocess.DEVNULL
    )
    try:
        proc = run_cli(
            "run", str(config), "--nats", f"nats://127.0.0.1:{port}", "--publish", mode, timeout=60
        )
    finally:
        server.terminate()
        server.wait(timeout=10)
    # The frames of the empty clip are all published; each of the square's is dropped.
    assert "done: 6 frame(s) published from 2 source(s); dropped 6 (publish_failed)" in proc.stderr
    assert re.search(
        r"source square: frame 0 not published: the frame 0 message of square is 1\d{3} bytes, over the "
        rf"NATS server's max_payload \(1024 bytes\) at nats://127\.0\.0\.1:{port}; dropped \(raise max_payload",
        proc.stderr,
    ), proc.stderr
    assert proc.stderr.count("not published") == 1  # once per source and interval, not per frame
    assert proc.returncode == 1  # a run that ended by itself with messages NATS never took
