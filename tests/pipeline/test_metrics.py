"""Metrics move by exactly what the frames imply; labels stay bounded."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pipeline.config import load_config
from pipeline.metrics import GpuCollector, Metrics, exported_metric_names
from pipeline.nats_server import EmbeddedNats
from pipeline.runtime import Runtime

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

    # 24 frames went through a fixed pool of frame buffers (queue 64 + 4 in flight + 4)
    # and all but the newest (kept for the dashboard) went back.
    assert pool is not None
    assert (pool.capacity, pool.allocations, pool.in_use) == (72, 72, 1)

    assert value(s, "vidpipe_frames_total", pipeline="m", source="cam") == 24
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
    assert value(s, "vidpipe_model_info", model="squares", backend="openvino", precision=precision) == 1
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
    m.frames.labels("p", "a").inc()
    m.frames.labels("p", "b").inc()
    m.frames_dropped.labels("p", "a", "queue_full").inc()
    m.forget_source("p", "a")
    text = m.render().decode()
    assert 'source="a"' not in text and 'source="b"' in text


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
