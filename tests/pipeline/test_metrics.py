"""Metrics move by exactly what the frames imply; labels stay bounded."""

from __future__ import annotations

import itertools
import logging
import re
import shutil
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inference.backends.openvino import OpenVinoBackend
from inference.batch_policy import BatchPolicy, LevelPolicy
from inference.batcher import DynamicBatcher, InferenceFailed, InferenceRejected, InferenceTimeout
from inference.repository import ModelRepository
from pipeline.api import ApiServer
from pipeline.config import load_config
from pipeline.metrics import GpuCollector, Metrics, exported_metric_names
from pipeline.nats_server import EmbeddedNats
from pipeline.outputs.video_file import VideoFileWriter
from pipeline.overload import OverloadMonitor
from pipeline.runtime import Runtime
from tests.conftest import ARTIFACTS
from tests.inference.test_openvino import AUTO, tiny_model
from tests.pipeline.stack import until
from tests.pipeline.test_dashboard import CHROMIUM, DevTools, chromium, open_dashboard

__all__ = ["chromium"]  # the fixture, used by name

PIPELINE = """\
pipeline: m
models: {models}
sources:
  - {{id: cam, url: "test://?fps=100&frames=24&width=320&height=240", queue_size: 64}}
  - {{id: door, url: "rtsp://admin:hunter2@127.0.0.1:9/stream", open_timeout: 1, reconnect: {{min_delay: 5}}}}
stages:
  - {{name: objects, type: infer, model: squares}}
  - {{name: track, type: track}}
"""


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(all_samples: dict[Any, float], name: str, **labels: str) -> float:
    return all_samples[(name, tuple(sorted(labels.items())))]


async def test_counters_and_histograms_match_the_frames(
    tmp_path: Path, sample_models: Path, nats_server: EmbeddedNats
) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(PIPELINE.format(models=sample_models))
    runtime = Runtime(load_config(path), nats_url=nats_server.url)
    await runtime.start()
    cam = runtime.sources["cam"]
    assert cam.intake is not None
    await cam.intake
    text = runtime.metrics.render().decode()
    pool = cam.source.frame_pool
    assert runtime.models is not None
    precision = runtime.models.get("squares").precision
    await runtime.stop()
    s = samples(text)

    # 24 frames went through a fixed pool of frame buffers (queue 64 + 8 in flight + 4)
    # and all but the newest (kept for the dashboard) went back.
    assert pool is not None
    assert (pool.capacity, pool.allocations, pool.in_use) == (76, 76, 1)

    assert value(s, "vidpipe_frames_total", pipeline="m", source="cam") == 24
    # What alerts tell a camera from a file or a WHIP source by.
    info = sorted(
        (dict(labels)["source"], dict(labels), v)
        for (n, labels), v in s.items()
        if n == "vidpipe_source_info"
    )
    assert info == [
        ("cam", {"live": "true", "pipeline": "m", "scheme": "test", "source": "cam"}, 1.0),
        ("door", {"live": "true", "pipeline": "m", "scheme": "rtsp", "source": "door"}, 1.0),
    ]
    assert value(s, "vidpipe_published_messages_total", pipeline="m", source="cam") == 24
    assert value(s, "vidpipe_e2e_latency_seconds_count", pipeline="m", source="cam") == 24
    for stage in ("objects", "track"):
        assert value(s, "vidpipe_stage_latency_seconds_count", pipeline="m", stage=stage) == 24
    assert value(s, "vidpipe_inference_requests_total", model="squares", status="success") == 24
    # Every request was in exactly one batch: the batch-size histogram's sum is the request count.
    assert value(s, "vidpipe_inference_batch_size_sum", model="squares") == 24
    batches = value(s, "vidpipe_inference_batch_size_count", model="squares")
    assert 1 <= batches <= 24
    assert value(s, "vidpipe_inference_compute_seconds_count", model="squares") == batches
    assert value(s, "vidpipe_inference_queue_seconds_count", model="squares") == 24
    assert value(s, "vidpipe_model_ready", model="squares") == 1
    assert precision in ("bf16", "f32")
    # The sample squares model sits outside a version folder: version "".
    info = {"model": "squares", "version": "", "backend": "openvino", "precision": precision}
    assert value(s, "vidpipe_model_info", **info) == 1
    # Credentials and URLs never become labels.
    assert "hunter2" not in text and "rtsp://" not in text
    # No GPU here: no GPU series rather than zeros.
    assert "vidpipe_gpu_" not in text


def test_every_exported_series_has_the_vidpipe_prefix() -> None:
    names = exported_metric_names()
    assert names and all(n.startswith("vidpipe_") for n in names)
    assert {"vidpipe_frames_total", "vidpipe_inference_batch_size_bucket", "vidpipe_source_up"} <= names


def test_forgetting_a_source_drops_its_series_only() -> None:
    m = Metrics()
    m.e2e_latency.labels("p", "a").observe(0.1)
    m.e2e_latency.labels("p", "b").observe(0.1)
    m.events.labels("p", "a", "line_cross").inc()
    m.forget_source("p", "a")
    text = m.render().decode()
    assert 'source="a"' not in text and 'source="b"' in text


WAIT = 5.0  # seconds; only reached when something is broken


def test_each_refusal_reason_has_a_status_of_its_own() -> None:
    # A real batcher counting into the metrics' counters; the runner is the only fake:
    # request 0 holds its instance until the gate opens, request 13 raises.
    metrics = Metrics()
    gate, started = threading.Event(), threading.Event()
    now = [1000.0]  # the batcher's clock, moved by hand for the queue timeout

    def runner(items: list[int]) -> list[int]:
        if 0 in items:
            started.set()
            assert gate.wait(WAIT)
        if 13 in items:
            raise ValueError("bad input 13")
        return items

    policy = BatchPolicy(max_batch_size=1, levels=(LevelPolicy(max_queue_size=2, timeout_s=1.0),))
    batcher = DynamicBatcher("m", policy, [runner], observer=metrics, clock=lambda: now[0])
    refusals = []
    with pytest.raises(InferenceRejected) as err:  # not started yet
        batcher.submit(1)
    refusals.append(err.value.reason)
    batcher.start()
    assert batcher.submit(1).result(WAIT) == 1
    assert isinstance(batcher.submit(13).exception(WAIT), InferenceFailed)
    running = batcher.submit(0)
    assert started.wait(WAIT)
    late = batcher.submit(2)
    now[0] += 1.5  # past its 1 s queue timeout while the instance is busy
    batcher.wakeup()
    assert isinstance(late.exception(WAIT), InferenceTimeout)
    queued = [batcher.submit(3), batcher.submit(4)]
    with pytest.raises(InferenceRejected) as err:  # the queue holds max_queue_size=2
        batcher.submit(5)
    refusals.append(err.value.reason)
    stopper = threading.Thread(target=batcher.stop, kwargs={"drain": False, "timeout": WAIT})
    stopper.start()
    for fut in queued:  # dropped from the queue by the stop, while 0 still runs
        exc = fut.exception(WAIT)
        assert isinstance(exc, InferenceRejected)
        refusals.append(exc.reason)
    gate.set()
    stopper.join(WAIT)
    assert running.result(WAIT) == 0
    with pytest.raises(InferenceRejected) as err:  # stopped
        batcher.submit(6)
    refusals.append(err.value.reason)
    assert refusals == ["unavailable", "queue_full", "shutdown", "shutdown", "shutdown"]

    s = samples(metrics.render().decode())
    statuses = {
        dict(labels)["status"]: v
        for (name, labels), v in s.items()
        if name == "vidpipe_inference_requests_total"
    }
    # rejected is the full queue only; a stop is a status of its own that an alert can leave out.
    assert statuses == {
        "success": 2, "failed": 1, "timeout": 1, "rejected": 1, "unavailable": 1, "shutdown": 3,
    }  # fmt: skip


async def test_model_info_names_the_served_version_and_precision_and_forgets_the_old_one(
    tmp_path: Path,
) -> None:
    pytest.importorskip("nncf")
    tiny_model(tmp_path, "tiny", "openvino", {1: "float"})
    metrics = Metrics()
    models = ModelRepository(tmp_path)
    metrics.model_info.status = models.status

    def info() -> dict[tuple[tuple[str, str], ...], float]:
        s = samples(metrics.render().decode())
        return {labels: v for (name, labels), v in s.items() if name == "vidpipe_model_info"}

    try:
        assert (await models.load("tiny")).state.value == "ready"
        one = {"model": "tiny", "version": "1", "backend": "openvino", "precision": AUTO}
        assert info() == {tuple(sorted(one.items())): 1.0}
        # `vidpipe models quantize` wrote version 2 (INT8); a reload serves it.
        shutil.rmtree(tmp_path / "tiny")
        tiny_model(tmp_path, "tiny", "openvino", {1: "float", 2: "int8"})
        assert (await models.reload("tiny")).version == 2
        two = {"model": "tiny", "version": "2", "backend": "openvino", "precision": "int8"}
        assert info() == {tuple(sorted(two.items())): 1.0}
    finally:
        await models.close()
    assert info() == {}


CLIP = """\
pipeline: m
models: {models}
sources:
  - {{id: clip, url: "{clip}", max_fps: 5}}
stages:
  - {{name: objects, type: infer, model: squares}}
  - {{name: track, type: track}}
"""


async def test_metrics_and_the_report_read_one_set_of_counters(
    tmp_path: Path, sample_models: Path, nats_server: EmbeddedNats, demo_clip: Path
) -> None:
    # The clip has 45 frames at 15 fps; max_fps 5 keeps one in three.
    path = tmp_path / "m.yaml"
    path.write_text(CLIP.format(models=sample_models, clip=demo_clip))
    config = load_config(path)
    runtime = Runtime(config, nats_url=nats_server.url)
    await runtime.start()
    try:
        first = runtime.sources["clip"]
        assert first.intake is not None
        await first.intake
        assert runtime.models is not None
        # A reload makes a new copy of the model (and batcher); it counts on where the old one left.
        assert (await runtime.models.reload("squares")).state.value == "ready"
        second = runtime.add_source(config.sources[0])  # the same clip again: a new run of "clip"
        assert second.intake is not None
        await second.intake
        text = runtime.metrics.render().decode()
        report = runtime.report()
        squares = runtime.models.get("squares").stats
    finally:
        await runtime.stop()

    s = samples(text)
    labels = {"pipeline": "m", "source": "clip"}
    # This run of the source: 45 decoded, 30 dropped by max_fps, 15 through the graph and out.
    assert value(s, "vidpipe_frames_decoded_total", **labels) == 45
    assert value(s, "vidpipe_frames_dropped_total", **labels, reason="max_fps") == 30
    assert value(s, "vidpipe_frames_total", **labels) == 15
    assert value(s, "vidpipe_published_messages_total", **labels) == 15
    assert value(s, "vidpipe_source_up", **labels) == 0  # ended
    assert value(s, "vidpipe_queue_depth", **labels) == 0
    assert value(s, "vidpipe_pool_buffers", pool="frames-clip", state="in_use") == 1  # the snapshot's
    (src,) = report.sources
    assert (src.id, src.decoded, src.frames, src.published, src.dropped) == (
        "clip",
        45,
        15,
        15,
        {"max_fps": 30},
    )
    assert src.reconnects == 0  # (fps depends on timing; tests/pipeline/test_counters.py pins it)
    # Capture-to-publish latency: the report's window holds the histogram's own observations.
    assert len(second.latencies) == value(s, "vidpipe_e2e_latency_seconds_count", **labels) == 15
    assert sum(second.latencies) == pytest.approx(value(s, "vidpipe_e2e_latency_seconds_sum", **labels))
    # Both runs of the source, as the report totals them.
    assert report.published == runtime.published_total() == 30

    # The model, across the reload: 30 requests, the same in every view.
    assert value(s, "vidpipe_inference_requests_total", model="squares", status="success") == 30
    assert value(s, "vidpipe_inference_queue_seconds_count", model="squares") == 30
    assert value(s, "vidpipe_inference_batch_size_sum", model="squares") == 30
    batches = value(s, "vidpipe_inference_batch_size_count", model="squares")
    assert value(s, "vidpipe_inference_compute_seconds_count", model="squares") == batches
    (model,) = report.models
    assert (model.name, model.requests, model.batches) == ("squares", 30, batches)
    assert sum(size * n for size, n in model.batch_sizes.items()) == 30
    assert model.queue_ms.p50 is not None and model.compute_ms.p50 is not None
    assert (squares.succeeded, squares.batches, squares.batch_sizes) == (30, batches, model.batch_sizes)
    buckets = [
        value(s, "vidpipe_inference_batch_size_bucket", model="squares", le=le)
        for le in ("1.0", "2.0", "+Inf")
    ]
    assert buckets == [model.batch_sizes.get(1, 0), sum(model.batch_sizes.get(n, 0) for n in (1, 2)), batches]


def test_gpu_collector_reports_each_device() -> None:
    class FakeNvml:
        # The NVML seam only: values a driver would report for two GPUs.
        def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
            return i

        def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
            return SimpleNamespace(gpu=[35, 90][h])

        def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
            return SimpleNamespace(used=[1 << 30, 3 << 30][h], total=80 << 30)

    families = {f.name: f for f in GpuCollector(FakeNvml(), 2).collect()}
    util = {s.labels["gpu"]: s.value for s in families["vidpipe_gpu_utilization_ratio"].samples}
    assert util == {"0": 0.35, "1": 0.9}
    used = {s.labels["gpu"]: s.value for s in families["vidpipe_gpu_memory_used_bytes"].samples}
    assert used == {"0": float(1 << 30), "1": float(3 << 30)}


OVERLOADED = """\
pipeline: m
models: {models}
sources:
  - {{id: cam, url: "test://?fps=60&width=320&height=240", queue_size: 2}}
runtime: {{max_in_flight: 1}}
stages:
  - {{name: objects, type: infer, model: squares}}
"""

WARNING = re.compile(
    r"source cam: overloaded, (\d+)% of frames dropped in the last 1s \((\d+) of (\d+) decoded\); "
    r"bottleneck: stage objects \((\d+) ms per frame, mostly (?:queued for|computing in) model squares\); "
    r"try interval: (\d+) on stage objects \(run it on one frame in (\d+)\), "
    r"a smaller input size for squares .*"
)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def test_an_overloaded_source_is_named_with_its_drop_rate_and_bottleneck_once_per_interval(
    tmp_path: Path, sample_models: Path, nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The model is the narrow seam slowed down: 0.25 s a batch, a 60 fps camera in front of it.
    run_borrowed = OpenVinoBackend.run_borrowed

    def slow(self: OpenVinoBackend, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        time.sleep(0.25)
        return run_borrowed(self, inputs)

    monkeypatch.setattr(OpenVinoBackend, "run_borrowed", slow)
    path = tmp_path / "m.yaml"
    path.write_text(OVERLOADED.format(models=sample_models))
    handler = Records()
    logger = logging.getLogger("vidpipe.overload")
    logger.addHandler(handler)
    runtime = Runtime(load_config(path), nats_url=nats_server.url, overload_interval=1.0)
    try:
        await runtime.start()
        try:
            await until(lambda: len(handler.records) >= 3, 60, "three overload warnings")
            report = runtime.report()
            overload = report.sources[0].overload
        finally:
            await runtime.stop()
    finally:
        logger.removeHandler(handler)
    text = runtime.metrics.render().decode()

    warnings = handler.records[:3]
    for record in warnings:
        assert record.levelno == logging.WARNING
        match = WARNING.fullmatch(record.getMessage())
        assert match, record.getMessage()
        percent, dropped, decoded = (int(g) for g in match.groups()[:3])
        assert percent == round(100 * dropped / decoded) and percent >= 50
        assert int(match.group(4)) >= 250  # the stage's time is the model's
        # Running the detector on one frame in N keeps up with what was decoded.
        skip, every = int(match.group(5)), int(match.group(6))
        assert every == skip + 1 and every >= decoded / (decoded - dropped)
    # One line per interval: a tick of the monitor, never a line per dropped frame.
    times = [r.created for r in warnings]
    assert all(b - a >= 0.9 for a, b in itertools.pairwise(times)), times
    assert overload is not None
    assert (overload.source, overload.bottleneck, overload.model) == ("cam", "objects", "squares")
    # A monitor's first look judges the counts since the source started: the first warning
    # comes one interval in, not two.
    first = OverloadMonitor({"objects": "squares"}, interval=1.0, logger=logging.getLogger("first-look"))
    (found,) = first.check(report)
    assert (found.source, found.decoded) == ("cam", report.sources[0].decoded)
    # A detector that skips frames already is told a larger interval, not its own again; one
    # on interval: auto, that it already skips what it can; a cascade, its own knobs.
    quiet = logging.getLogger("hints")
    (found,) = OverloadMonitor({"objects": "squares"}, intervals={"objects": 3}, logger=quiet).check(report)
    hinted = re.search(
        r"interval: (\d+) on stage objects \(run it on one frame in (\d+), was 3\)", found.hint
    )
    assert hinted, found.hint
    assert int(hinted.group(1)) > 3 and int(hinted.group(2)) >= 4 / (1 - found.drop_rate), found
    (found,) = OverloadMonitor({"objects": "squares"}, intervals={"objects": "auto"}, logger=quiet).check(
        report
    )
    assert found.hint.startswith(
        "try a lower max_fps on the source (interval: auto already skips what it can)"
    )
    (found,) = OverloadMonitor({"objects": "squares"}, intervals={}, logger=quiet).check(report)
    assert "reinfer_interval or a lower max_objects on stage objects" in found.hint

    s = samples(text)
    decoded_total = value(s, "vidpipe_frames_decoded_total", pipeline="m", source="cam")
    accepted = value(s, "vidpipe_frames_total", pipeline="m", source="cam")
    drops = {
        reason: value(s, "vidpipe_frames_dropped_total", pipeline="m", source="cam", reason=reason)
        for reason in ("queue_full", "pool_empty", "max_fps", "shutdown")
        if ("vidpipe_frames_dropped_total", (("pipeline", "m"), ("reason", reason), ("source", "cam"))) in s
    }
    assert drops["queue_full"] > accepted
    assert decoded_total == accepted + sum(drops.values())


def test_e2e_latency_buckets_reach_a_minute() -> None:
    m = Metrics()
    m.e2e_latency.labels("p", "cam").observe(11.0)
    buckets = {
        sample.labels["le"]: sample.value
        for family in m.registry.collect()
        if family.name == "vidpipe_e2e_latency_seconds"
        for sample in family.samples
        if sample.name.endswith("_bucket")
    }
    assert (buckets["10.0"], buckets["15.0"]) == (0.0, 1.0)
    assert list(buckets)[-2:] == ["60.0", "+Inf"]


RECORDED = """\
pipeline: m
sources:
  - {id: cam, url: "test://?fps=60&width=320&height=240"}
outputs: [{type: file, path: "out/{source}.mp4", annotate: true}]
"""


DROPPED = "vidpipe_recording_frames_dropped_total"


async def test_frames_left_out_of_a_live_recording_are_counted_and_logged_once_per_interval(
    tmp_path: Path, nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The encoder is the narrow seam slowed down: 0.1 s a frame behind a 60 fps camera.
    write = VideoFileWriter.write

    def slow(self: VideoFileWriter, image: np.ndarray, pts: float) -> None:
        time.sleep(0.1)
        write(self, image, pts)

    monkeypatch.setattr(VideoFileWriter, "write", slow)
    path = tmp_path / "m.yaml"
    path.write_text(RECORDED)
    handler = Records()
    logger = logging.getLogger("vidpipe.runtime")
    logger.addHandler(handler)
    runtime = Runtime(load_config(path), nats_url=nats_server.url)
    try:
        await runtime.start()
        try:
            await until(
                lambda: (
                    (
                        runtime.metrics.registry.get_sample_value(DROPPED, {"pipeline": "m", "source": "cam"})
                        or 0
                    )
                    >= 20
                ),
                60,
                "frames left out of the recording",
            )
        finally:
            await runtime.stop()
    finally:
        logger.removeHandler(handler)
    s = samples(runtime.metrics.render().decode())
    dropped = value(s, "vidpipe_recording_frames_dropped_total", pipeline="m", source="cam")
    published = value(s, "vidpipe_published_messages_total", pipeline="m", source="cam")
    assert 20 <= dropped < published
    lines = [r.getMessage() for r in handler.records if "recording" in r.getMessage()]
    # Well within one 10 s interval: one line, however many frames were left out.
    assert lines == [
        "source cam: a frame left out of its recording: drawing and encoding are slower than the "
        "source (vidpipe_recording_frames_dropped_total counts them; lower max_fps, or record "
        "without annotate)"
    ]


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (make test installs it with apt)")
async def test_the_dashboard_shows_an_overloaded_source_as_the_log_says_it(
    tmp_path: Path,
    sample_models: Path,
    nats_server: EmbeddedNats,
    monkeypatch: pytest.MonkeyPatch,
    chromium: DevTools,
) -> None:
    run_borrowed = OpenVinoBackend.run_borrowed

    def slow(self: OpenVinoBackend, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        time.sleep(0.25)
        return run_borrowed(self, inputs)

    monkeypatch.setattr(OpenVinoBackend, "run_borrowed", slow)
    path = tmp_path / "m.yaml"
    path.write_text(OVERLOADED.format(models=sample_models) + 'http: {listen: "127.0.0.1:0"}\n')
    config = load_config(path)
    assert config.http is not None
    runtime = Runtime(config, nats_url=nats_server.url, overload_interval=1.0)
    await runtime.start()
    api = ApiServer(runtime, config.http)
    try:
        await api.start()
        await open_dashboard(chromium, api.url + "/")
        shown = await chromium.poll(
            "(() => { const o = document.querySelector('[data-source-id=\"cam\"] .overload');"
            " return o && !o.hidden ? o.textContent : null; })()",
            lambda v: bool(v),
            timeout=60,
        )
        assert WARNING.fullmatch(shown), shown
        await chromium.screenshot(ARTIFACTS / "dashboard-overload.png")
    finally:
        await api.stop()
        await runtime.stop()
