"""Prometheus metrics, all prefixed ``vidpipe_``.

Labels stay bounded: pipeline, source (the operator's id, never a URL), stage,
model, status and reason. Each :class:`Runtime` owns one registry so tests and
several pipelines in one process do not collide.

Counts kept for the report too are not kept here a second time: the families of
a source's frames, drops, reconnects and messages, and of a model's requests and
batches, are read at scrape time from the counters objects themselves (a
:class:`~pipeline.counters.SourceCounters` per source, a
:class:`~inference.batcher.BatcherStats` per model) by :class:`CountersCollector`;
``Runtime.report()`` reads the same objects. The rest (what stages count) are
prometheus_client metrics that only this registry holds.

The registry also holds prometheus_client's ``process_*`` series (memory, CPU,
open files of this process), which docs/operations.md names: they are not in the
default registry vidpipe does not serve.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from inference.batcher import LATENCY_BUCKETS, BatcherStats
from pipeline.events import EVENT_TYPES

if TYPE_CHECKING:
    from inference.memory import BufferPool
    from inference.repository import ModelStatus
    from pipeline.counters import SourceCounters

log = logging.getLogger("vidpipe.metrics")

# Capture to publish: an overloaded graph runs seconds to a minute behind, and a quantile
# past the last finite bucket cannot be read.
E2E_BUCKETS = (*LATENCY_BUCKETS, 15.0, 20.0, 30.0, 45.0, 60.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)

# The `reason` label values, each a fixed set (docs/operations.md says what each means).
DROP_REASONS = ("queue_full", "max_fps", "pool_empty", "stage_error", "publish_failed", "shutdown")
PUBLISH_ERROR_REASONS = ("outbox_full", "retry", "shutdown", "failed", "too_large")
OBJECT_SKIP_REASONS = ("max_objects", "min_size", "rejected", "failed")


class CountedSource(Protocol):
    """What the collector reads of a running source (the runtime's ``SourceRun``)."""

    @property
    def id(self) -> str: ...
    @property
    def counters(self) -> SourceCounters: ...
    @property
    def up(self) -> bool: ...
    @property
    def queue_depth(self) -> int: ...
    @property
    def frame_pool(self) -> BufferPool | None: ...
    @property
    def scheme(self) -> str: ...
    @property
    def live(self) -> bool: ...


class Metrics:
    """The metric families vidpipe exports (see docs/operations.md).

    It is also the model repository's observer: it hands each model its
    :class:`BatcherStats` (one per model name, kept across reloads) and sets
    ``vidpipe_model_ready`` on state changes.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.collector = CountersCollector()
        c = self.collector
        # Registered in the order they always had, so the exposition reads the same.
        r.register(_Family(c.frames))
        # What the cameras deliver, whether or not the graph keeps up (the
        # source-is-healthy signal; frames_total is the processed one).
        r.register(_Family(c.frames_decoded))
        r.register(_Family(c.frames_dropped))
        r.register(_Family(c.source_up))
        r.register(_Family(c.source_info))
        r.register(_Family(c.source_reconnects))
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
        r.register(_Family(c.queue_depth))
        r.register(_Family(c.inference_requests))
        r.register(_Family(c.inference_queue))
        r.register(_Family(c.inference_compute))
        r.register(_Family(c.inference_batch_size))
        self.model_ready = Gauge(
            "vidpipe_model_ready", "1 while the model is loaded and ready", ["model"], registry=r
        )
        r.register(_Family(c.published))
        self.publish_errors = Counter(
            "vidpipe_publish_errors_total",
            "Messages that could not be published, by reason (" + ", ".join(PUBLISH_ERROR_REASONS) + ")",
            ["pipeline", "source", "reason"],
            registry=r,
        )
        # Both read at scrape time from the publisher (which sets their function), so an
        # outage shows at the next scrape, long before the outbox is full and drops.
        self.nats_connected = Gauge(
            "vidpipe_nats_connected", "1 while the NATS connection is up, 0 while it is not",
            ["pipeline"], registry=r,
        )  # fmt: skip
        self.publish_outbox = Gauge(
            "vidpipe_publish_outbox_messages",
            "Messages waiting in the core-mode outbox for NATS to come back",
            ["pipeline"],
            registry=r,
        )
        self.recording_dropped = Counter(
            "vidpipe_recording_frames_dropped_total",
            "Published frames of a live source left out of its recordings (the drawing worker was behind)",
            ["pipeline", "source"],
            registry=r,
        )
        self.admission_held = Counter(
            "vidpipe_admission_held_total",
            "Frames held before entering the graph until the detector was about to be free (paced admission)",
            ["pipeline"],
            registry=r,
        )
        self.admission_held_seconds = Counter(
            "vidpipe_admission_held_seconds_total",
            "Seconds frames were held before entering the graph, summed (admission: paced)",
            ["pipeline"],
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
        r.register(_Family(c.pool_buffers))
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
        # A registry handed in may have them already (the default one does).
        with contextlib.suppress(ValueError):
            ProcessCollector(registry=r)

    def forget_source(self, pipeline: str, source: str) -> None:
        """Drop a removed source's series, so camera churn does not grow the registry.

        The families read from the counters need nothing: a removed source is no longer read.
        """
        per_source: tuple[tuple[Any, tuple[str, ...]], ...] = (
            (self.e2e_latency, ("pipeline", "source")),
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

    # -- the model repository's observer (inference never imports pipeline) ------------------

    def counters(self, model: str) -> BatcherStats:
        return self.collector.model(model)

    def on_state(self, model: str, state: str, reason: str) -> None:
        if state.upper() == "UNLOADED":
            # Unloaded is not down: no series, so a `vidpipe_model_ready == 0` alert stays quiet
            # for a model let go on purpose (DELETE /v1/models/{name}, a failed forced load).
            with contextlib.suppress(KeyError):
                self.model_ready.remove(model)
            return
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


class _Family(Collector):
    """One family of :class:`CountersCollector`, registered where its old metric stood."""

    def __init__(self, build: Callable[[], Metric]) -> None:
        self.build = build

    def collect(self) -> Iterator[Metric]:
        yield self.build()


# vidpipe_inference_requests_total's status label -> the BatcherStats field it reads.
# rejected: the queue was full (reason queue_full); unavailable: the model was not serving;
# shutdown: the model stopped (a reload or exit) before the request ran.
STATUSES = {
    "success": "succeeded",
    "rejected": "rejected",
    "timeout": "timed_out",
    "failed": "failed",
    "unavailable": "unavailable",
    "shutdown": "shutdown",
}


class CountersCollector:
    """The families read from the counters objects at scrape time.

    ``watch`` tells it the pipeline's name and how to list its running sources;
    :meth:`model` hands out (and keeps) each model's :class:`BatcherStats`. A
    labelled series appears once it has counted something, as prometheus_client's
    own children do; each series' ``_created`` is when its source or model started.
    """

    def __init__(self) -> None:
        self.pipeline = ""
        self._sources: Callable[[], Iterable[CountedSource]] = tuple
        self._models: dict[str, BatcherStats] = {}
        self._models_lock = threading.Lock()  # models load on worker threads

    def watch(self, pipeline: str, sources: Callable[[], Iterable[CountedSource]]) -> None:
        self.pipeline = pipeline
        self._sources = sources

    def model(self, name: str) -> BatcherStats:
        """The counters of model ``name``, the same object for every copy of it."""
        with self._models_lock:
            stats = self._models.get(name)
            if stats is None:
                stats = self._models[name] = BatcherStats()
            return stats

    def models(self) -> dict[str, BatcherStats]:
        """A consistent copy of every model's counters, by name."""
        with self._models_lock:
            models = dict(self._models)
        return {name: stats.snapshot() for name, stats in models.items()}

    def _runs(self) -> list[CountedSource]:
        return sorted(self._sources(), key=lambda run: run.id)

    # -- sources -----------------------------------------------------------------------------

    def frames(self) -> Metric:
        family = CounterMetricFamily(
            "vidpipe_frames_total", "Frames accepted into the graph (decoded, less drops)",
            labels=["pipeline", "source"],
        )  # fmt: skip
        for run in self._runs():
            c = run.counters
            family.add_metric([self.pipeline, run.id], c.accepted, created=c.created)
        return family

    def frames_decoded(self) -> Metric:
        """Every frame the decoder produced, also those dropped later as ``max_fps``,
        ``pool_empty`` or ``queue_full``: decoded = ``vidpipe_frames_total`` + those drops."""
        family = CounterMetricFamily(
            "vidpipe_frames_decoded",
            "Frames decoded by the source, before any drop (max_fps, pool_empty, queue_full)",
            labels=["pipeline", "source"],
        )
        for run in self._runs():
            family.add_metric([self.pipeline, run.id], float(run.counters.decoded))
        return family

    def frames_dropped(self) -> Metric:
        family = CounterMetricFamily(
            "vidpipe_frames_dropped_total",
            "Frames dropped, by reason (" + ", ".join(DROP_REASONS) + ")",
            labels=["pipeline", "source", "reason"],
        )
        for run in self._runs():
            c = run.counters
            for reason, n in sorted(c.dropped_by_reason().items()):
                family.add_metric([self.pipeline, run.id, reason], n, created=c.created)
        return family

    def source_up(self) -> Metric:
        family = GaugeMetricFamily(
            "vidpipe_source_up", "1 while the source delivers frames", labels=["pipeline", "source"]
        )
        for run in self._runs():
            family.add_metric([self.pipeline, run.id], 1.0 if run.up else 0.0)
        return family

    def source_info(self) -> Metric:
        """1 per source, labelled with what alerts tell sources apart by: a camera that
        should always stream (``live="true"``) from a file that ends, or a WHIP source
        whose publisher comes and goes (``scheme="whip"``)."""
        family = GaugeMetricFamily(
            "vidpipe_source_info",
            "1 per source: its URL scheme and whether it is live",
            labels=["pipeline", "source", "scheme", "live"],
        )
        for run in self._runs():
            family.add_metric([self.pipeline, run.id, run.scheme, "true" if run.live else "false"], 1.0)
        return family

    def source_reconnects(self) -> Metric:
        family = CounterMetricFamily(
            "vidpipe_source_reconnects_total",
            "Reconnect attempts of live sources, by reason",
            labels=["pipeline", "source", "reason"],
        )
        for run in self._runs():
            c = run.counters
            for reason, n in sorted(c.reconnects_by_reason().items()):
                family.add_metric([self.pipeline, run.id, reason], n, created=c.created)
        return family

    def queue_depth(self) -> Metric:
        family = GaugeMetricFamily(
            "vidpipe_queue_depth", "Frames waiting in a source's queue", labels=["pipeline", "source"]
        )
        for run in self._runs():
            family.add_metric([self.pipeline, run.id], float(run.queue_depth))
        return family

    def published(self) -> Metric:
        family = CounterMetricFamily(
            "vidpipe_published_messages_total", "Messages published to NATS", labels=["pipeline", "source"]
        )
        for run in self._runs():
            c = run.counters
            family.add_metric([self.pipeline, run.id], c.published, created=c.created)
        return family

    def pool_buffers(self) -> Metric:
        family = GaugeMetricFamily(
            "vidpipe_pool_buffers", "Buffers in a memory pool, by state", labels=["pool", "state"]
        )
        for run in self._runs():
            pool = run.frame_pool
            if pool is not None:
                family.add_metric([pool.name, "in_use"], float(pool.in_use))
                family.add_metric([pool.name, "capacity"], float(pool.capacity))
        return family

    # -- models ------------------------------------------------------------------------------

    def inference_requests(self) -> Metric:
        family = CounterMetricFamily(
            "vidpipe_inference_requests_total",
            "Inference requests by outcome (" + ", ".join(STATUSES) + "; rejected: the queue was full)",
            labels=["model", "status"],
        )
        for name, st in sorted(self.models().items()):
            for status, attr in STATUSES.items():
                n = getattr(st, attr)
                if n:
                    family.add_metric([name, status], n, created=st.created)
        return family

    def inference_queue(self) -> Metric:
        family = HistogramMetricFamily(
            "vidpipe_inference_queue_seconds", "Time a request waits in the batcher", labels=["model"]
        )
        for name, st in sorted(self.models().items()):
            if st.batches:
                _add_histogram(family, name, LATENCY_BUCKETS, st.queue_buckets, st.queue_seconds, st.created)
        return family

    def inference_compute(self) -> Metric:
        family = HistogramMetricFamily(
            "vidpipe_inference_compute_seconds",
            "Time to run one batch (preprocess, model, postprocess)",
            labels=["model"],
        )
        for name, st in sorted(self.models().items()):
            if st.batches:
                _add_histogram(
                    family, name, LATENCY_BUCKETS, st.compute_buckets, st.compute_seconds, st.created
                )
        return family

    def inference_batch_size(self) -> Metric:
        family = HistogramMetricFamily(
            "vidpipe_inference_batch_size", "Requests per executed batch", labels=["model"]
        )
        for name, st in sorted(self.models().items()):
            if st.batches:
                counts = [0] * (len(BATCH_BUCKETS) + 1)
                for size, n in st.batch_sizes.items():
                    counts[next((i for i, b in enumerate(BATCH_BUCKETS) if size <= b), -1)] += n
                _add_histogram(family, name, BATCH_BUCKETS, counts, st.batched_requests, st.created)
        return family


def _add_histogram(
    family: HistogramMetricFamily,
    model: str,
    bounds: tuple[float, ...],
    counts: list[int],
    total: float,
    created: float,
) -> None:
    """One model's histogram from per-bucket ``counts`` (the last: over the largest bound)."""
    cumulative = 0
    buckets: list[tuple[str, float]] = []
    for bound, n in zip((*bounds, float("inf")), counts, strict=True):
        cumulative += n
        buckets.append((floatToGoString(bound), float(cumulative)))
    family.add_metric([model], buckets, total)
    # prometheus_client's own histograms export when each series began; so do these.
    family.samples.append(Sample(family.name + "_created", {"model": model}, created))


class ModelInfoCollector(Collector):
    """``vidpipe_model_info{model,version,backend,precision}`` = 1 per ready model, read at scrape time.

    The precision is the one the backend reports in use (``bf16`` where OpenVINO
    chose it for the CPU, ``int8`` for a quantized model), so a dashboard can tell
    which numbers ran where; ``version`` is the version folder served ("" for a
    model file outside one). Read from the repository's status at each scrape, a
    reload to another version, backend or precision leaves no old series behind.
    """

    def __init__(self) -> None:
        self.status: Callable[[], Iterable[ModelStatus]] | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "vidpipe_model_info",
            "1 per ready model: the version served, its backend and the precision it computes in",
            labels=["model", "version", "backend", "precision"],
        )
        for s in self.status() if self.status is not None else ():
            if s.state.value == "ready":
                version = "" if s.version is None else str(s.version)
                family.add_metric([s.name, version, s.backend, s.precision], 1.0)
        yield family


def exported_metric_names() -> set[str]:
    """Every series name vidpipe exports, as PromQL sees it (``_total``, ``_bucket``, ...).

    Dashboards and alert rules are checked against this set. prometheus_client's
    ``process_*`` families are not vidpipe's and are left out.
    """
    names: set[str] = set()
    for family in Metrics().registry.collect():
        if not family.name.startswith("vidpipe_"):
            continue
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
