"""Prometheus metrics, all prefixed ``vidpipe_``.

Labels stay bounded: pipeline, source (the operator's id, never a URL), stage,
model, status and reason. Each :class:`Runtime` owns one registry so tests and
several pipelines in one process do not collide.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pipeline.events import EVENT_TYPES

if TYPE_CHECKING:
    from inference.repository import ModelStatus

log = logging.getLogger("vidpipe.metrics")

# Video work spans milliseconds to seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 2.0, 5.0, 10.0)  # fmt: skip
# Capture to publish: an overloaded graph runs seconds to a minute behind, and a quantile
# past the last finite bucket cannot be read.
E2E_BUCKETS = (*LATENCY_BUCKETS, 15.0, 20.0, 30.0, 45.0, 60.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)

# The `reason` label values, each a fixed set (docs/operations.md says what each means).
DROP_REASONS = ("queue_full", "max_fps", "pool_empty", "stage_error", "publish_failed", "shutdown")
PUBLISH_ERROR_REASONS = ("outbox_full", "retry", "shutdown", "failed")
OBJECT_SKIP_REASONS = ("max_objects", "min_size", "rejected", "failed")


class Metrics:
    """The metric families vidpipe exports (see docs/operations.md)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.frames = Counter(
            "vidpipe_frames_total",
            "Frames accepted into the graph (decoded, less drops)",
            ["pipeline", "source"],
            registry=r,
        )
        # Read from the sources at scrape time: what the cameras deliver, whether or not the
        # graph keeps up (the source-is-healthy signal; frames_total is the processed one).
        self.frames_decoded = DecodedFramesCollector()
        r.register(self.frames_decoded)
        self.frames_dropped = Counter(
            "vidpipe_frames_dropped_total",
            "Frames dropped, by reason (" + ", ".join(DROP_REASONS) + ")",
            ["pipeline", "source", "reason"],
            registry=r,
        )
        self.source_up = Gauge(
            "vidpipe_source_up", "1 while the source delivers frames", ["pipeline", "source"], registry=r
        )
        self.source_reconnects = Counter(
            "vidpipe_source_reconnects_total",
            "Reconnect attempts of live sources, by reason",
            ["pipeline", "source", "reason"],
            registry=r,
        )
        self.stage_latency = Histogram(
            "vidpipe_stage_latency_seconds",
            "Time a frame spends in each stage",
            ["pipeline", "stage"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "vidpipe_e2e_latency_seconds",
            "Capture to publish latency per frame",
            ["pipeline", "source"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "vidpipe_queue_depth", "Frames waiting in a source's queue", ["pipeline", "source"], registry=r
        )
        self.inference_requests = Counter(
            "vidpipe_inference_requests_total",
            "Inference requests by outcome (success, rejected, timeout, failed)",
            ["model", "status"],
            registry=r,
        )
        self.inference_queue = Histogram(
            "vidpipe_inference_queue_seconds",
            "Time a request waits in the batcher",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inference_compute = Histogram(
            "vidpipe_inference_compute_seconds",
            "Time to run one batch (preprocess, model, postprocess)",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inference_batch_size = Histogram(
            "vidpipe_inference_batch_size",
            "Requests per executed batch",
            ["model"],
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.model_ready = Gauge(
            "vidpipe_model_ready", "1 while the model is loaded and ready", ["model"], registry=r
        )
        self.published = Counter(
            "vidpipe_published_messages_total", "Messages published to NATS", ["pipeline", "source"],
            registry=r,
        )  # fmt: skip
        self.publish_errors = Counter(
            "vidpipe_publish_errors_total",
            "Messages that could not be published, by reason (" + ", ".join(PUBLISH_ERROR_REASONS) + ")",
            ["pipeline", "source", "reason"],
            registry=r,
        )
        self.recording_dropped = Counter(
            "vidpipe_recording_frames_dropped_total",
            "Published frames of a live source left out of its recordings (the drawing worker was behind)",
            ["pipeline", "source"],
            registry=r,
        )
        self.objects_skipped = Counter(
            "vidpipe_objects_skipped_total",
            "Objects a cascade stage got no result for, by reason (" + ", ".join(OBJECT_SKIP_REASONS) + ")",
            ["pipeline", "source", "stage", "reason"],
            registry=r,
        )
        self.detector_frames = Counter(
            "vidpipe_detector_frames_total",
            "Frames of an interval: auto detector by decision: the reason it ran, predicted, or deferred",
            ["pipeline", "source", "stage", "decision"],
            registry=r,
        )
        self.detector_min_gap = Gauge(
            "vidpipe_detector_min_gap", "Frames each camera waits between auto detections (overload share)",
            ["pipeline", "stage"], registry=r,
        )  # fmt: skip
        self.objects = Counter(
            "vidpipe_objects_total",
            "Objects in published frames, by label (an object counts once per frame it is in)",
            ["pipeline", "source", "label"],
            registry=r,
        )
        self.zone_objects = Gauge(
            "vidpipe_zone_objects", "Objects in a zone in the latest frame", ["pipeline", "source", "zone"],
            registry=r,
        )  # fmt: skip
        self.line_crossings = Counter(
            "vidpipe_line_crossings_total",
            "Tracked objects that crossed a line, by direction (in, out) and label",
            ["pipeline", "source", "line", "direction", "label"],
            registry=r,
        )
        self.active_tracks = Gauge(
            "vidpipe_active_tracks", "Tracks started and not yet ended, as a zones stage sees them",
            ["pipeline", "source"], registry=r,
        )  # fmt: skip
        self.events = Counter(
            "vidpipe_events_total",
            "Events published, by type (" + ", ".join(EVENT_TYPES) + ")",
            ["pipeline", "source", "type"],
            registry=r,
        )
        self.pool_buffers = Gauge(
            "vidpipe_pool_buffers", "Buffers in a memory pool, by state", ["pool", "state"], registry=r
        )
        self.reader_threads = Gauge(
            "vidpipe_source_reader_threads",
            "Reader threads of live sources in this process, abandoned ones included",
            registry=r,
        )  # read at scrape time from the sources' own count, wired by the runtime
        self.model_info = ModelInfoCollector()
        r.register(self.model_info)
        gpu = GpuCollector.create()
        if gpu is not None:
            r.register(gpu)

    def forget_source(self, pipeline: str, source: str) -> None:
        """Drop a removed source's series, so camera churn does not grow the registry."""
        per_source: tuple[tuple[Any, tuple[str, ...]], ...] = (
            (self.frames, ("pipeline", "source")),
            (self.frames_dropped, ("pipeline", "source", "reason")),
            (self.source_up, ("pipeline", "source")),
            (self.source_reconnects, ("pipeline", "source", "reason")),
            (self.e2e_latency, ("pipeline", "source")),
            (self.queue_depth, ("pipeline", "source")),
            (self.published, ("pipeline", "source")),
            (self.recording_dropped, ("pipeline", "source")),
            (self.publish_errors, ("pipeline", "source", "reason")),
            (self.objects_skipped, ("pipeline", "source", "stage", "reason")),
            (self.detector_frames, ("pipeline", "source", "stage", "decision")),
            (self.objects, ("pipeline", "source", "label")),
            (self.zone_objects, ("pipeline", "source", "zone")),
            (self.line_crossings, ("pipeline", "source", "line", "direction", "label")),
            (self.active_tracks, ("pipeline", "source")),
            (self.events, ("pipeline", "source", "type")),
        )
        for metric, names in per_source:
            # prometheus_client has no "remove by partial labels": find the children in
            # what the metric collects (public API) and remove each one.
            for values in _children(metric, names):
                if values[:2] == (pipeline, source):
                    metric.remove(*values)
        for values in _children(self.pool_buffers, ("pool", "state")):
            if values[0] == f"frames-{source}":
                self.pool_buffers.remove(*values)

    # The inference layer reports through this observer interface (it never imports pipeline).
    def on_request(self, model: str, status: str) -> None:
        self.inference_requests.labels(model, status).inc()

    def on_batch(
        self, model: str, batch_size: int, queue_seconds: list[float], compute_seconds: float
    ) -> None:
        self.inference_batch_size.labels(model).observe(batch_size)
        self.inference_compute.labels(model).observe(compute_seconds)
        hist = self.inference_queue.labels(model)
        for q in queue_seconds:
            hist.observe(q)

    def on_state(self, model: str, state: str, reason: str) -> None:
        self.model_ready.labels(model).set(1.0 if state.upper() == "READY" else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _children(metric: Any, names: tuple[str, ...]) -> set[tuple[str, ...]]:
    """The label values of every child of ``metric`` (labels in ``names`` order)."""
    out = set()
    for family in metric.collect():
        for sample in family.samples:
            if all(n in sample.labels for n in names):
                out.add(tuple(sample.labels[n] for n in names))
    return out


class DecodedFramesCollector(Collector):
    """``vidpipe_frames_decoded_total{pipeline,source}``: frames each source decoded, read at scrape time.

    It counts every frame the decoder produced, also those dropped later as ``max_fps``,
    ``pool_empty`` or ``queue_full``: decoded = ``vidpipe_frames_total`` + those drops.
    The runtime sets ``pipeline`` and ``counts`` (source id -> frames) when it is built.
    """

    def __init__(self) -> None:
        self.pipeline = ""
        self.counts: Callable[[], dict[str, int]] | None = None

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "vidpipe_frames_decoded",
            "Frames decoded by the source, before any drop (max_fps, pool_empty, queue_full)",
            labels=["pipeline", "source"],
        )
        for source, n in sorted((self.counts() if self.counts is not None else {}).items()):
            family.add_metric([self.pipeline, source], float(n))
        yield family


class ModelInfoCollector(Collector):
    """``vidpipe_model_info{model,backend,precision}`` = 1 per ready model, read at scrape time.

    The precision is the one the backend reports in use (``bf16`` where OpenVINO
    chose it for the CPU), so a dashboard can tell which numbers ran where.
    """

    def __init__(self) -> None:
        self.status: Callable[[], Iterable[ModelStatus]] | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "vidpipe_model_info",
            "1 per ready model: its backend and the precision it computes in",
            labels=["model", "backend", "precision"],
        )
        for s in self.status() if self.status is not None else ():
            if s.state.value == "ready":
                family.add_metric([s.name, s.backend, s.precision], 1.0)
        yield family


def exported_metric_names() -> set[str]:
    """Every series name vidpipe exports, as PromQL sees it (``_total``, ``_bucket``, ...).

    Dashboards and alert rules are checked against this set.
    """
    names: set[str] = set()
    for family in Metrics().registry.collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
    return names


class GpuCollector(Collector):
    """GPU utilisation and memory from NVML (``nvidia-ml-py``), read at scrape time.

    Exported only where NVML and a GPU exist; elsewhere there are no ``vidpipe_gpu_*``
    series at all rather than zeros that look like an idle GPU.
    """

    def __init__(self, nvml: Any, count: int) -> None:
        self.nvml = nvml
        self.count = count

    @classmethod
    def create(cls) -> GpuCollector | None:
        try:
            import pynvml

            pynvml.nvmlInit()
            count = int(pynvml.nvmlDeviceGetCount())
        except Exception:  # no package, no driver or no device: no GPU metrics
            return None
        if count == 0:
            return None
        log.info("exporting metrics for %d GPU(s)", count)
        return cls(pynvml, count)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        util = GaugeMetricFamily(
            "vidpipe_gpu_utilization_ratio", "GPU busy fraction over the last sample period", labels=["gpu"]
        )
        used = GaugeMetricFamily("vidpipe_gpu_memory_used_bytes", "GPU memory in use", labels=["gpu"])
        total = GaugeMetricFamily("vidpipe_gpu_memory_total_bytes", "GPU memory size", labels=["gpu"])
        for i in range(self.count):
            try:
                handle = self.nvml.nvmlDeviceGetHandleByIndex(i)
                rates = self.nvml.nvmlDeviceGetUtilizationRates(handle)
                mem = self.nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception as exc:  # a GPU that fell off the bus must not break /metrics
                log.debug("NVML read of GPU %d failed: %s", i, exc)
                continue
            util.add_metric([str(i)], rates.gpu / 100.0)
            used.add_metric([str(i)], float(mem.used))
            total.add_metric([str(i)], float(mem.total))
        yield util
        yield used
        yield total

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())
