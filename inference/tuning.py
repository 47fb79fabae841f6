"""The model tuner: find a model's fastest configuration on this machine by measuring it.

``vidpipe tune REPO MODEL`` (and :func:`tune` without the CLI) loads the model
again and again under closed-loop load (``concurrency`` callers, each awaiting
:meth:`~inference.model.Model.infer` in a loop) of realistic images at the
model's own input size, and searches these knobs::

    backend: openvino                     # openvino | onnxruntime (those installed)
    max_batch_size: 16                    # 1, 2, 4, ... up to the concurrency
    dynamic_batching:
      preferred_batch_size: [8, 16]       # none, [max] or [max/2, max]
      max_queue_delay_microseconds: 500   # 0, 500, 2000, 5000
    instance_group: [{count: 2}]          # 1, 2, 2 × cores
    backend_options:
      precision: auto                     # OpenVINO: auto, f32 (f16 where the CPU has it)
      threads: 0                          # OpenVINO: threads in all; 0 = its default
      intra_op_threads: 0                 # ONNX Runtime: threads per instance

The search is coordinate descent: from the model's current configuration, vary
one knob at a time over its values, keep the best, move to the next knob, and
go round again while time is left and the last round changed something. Every
point is measured once, for a number of answers (``inferences``, after a
warm-up), not a number of seconds, so each point is ranked on as much evidence
as the next. A point counts only when its p99 latency is within the latency
budget; the pick is the fastest such point, except that points within
:data:`TIE` of the fastest are a tie (measurement noise on a shared machine) and
the one with the lowest p99 wins. A model file that fixes its batch (``[1, 3,
H, W]``) is never tried at larger batches.

The tuner never writes a configuration slower than the one it replaces:

* the current configuration is measured first and again last; with the load
  average before and the CPU steal during the search, a change in its speed
  says the machine was busy (:class:`MachineCheck`), and the report says so;
* before writing, the pick and the current configuration run in turns, the
  order swapped each round (:func:`verify`); the pick is written only when the
  median of its turns beats the current one's by more than :data:`TIE`.

``stream_file`` measures under the pipeline's load: each caller decodes its own
copy of a video file (:class:`FileFrames`) before each request, as N cameras would.

:func:`write_tuned_config` puts the pick into ``config.yaml`` with a
round-trip YAML editor: only the tuned keys that changed are rewritten, the
rest of the file (comments, order, flow style) stays as it was.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import io
import math
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from inference.batcher import InferenceRejected
from inference.config import BACKEND_OPTIONS, InstanceGroup, ModelConfig, OnnxRuntimeOptions, OpenVinoOptions
from inference.errors import VidpipeError
from inference.model import Model, ModelState
from inference.repository import ModelSource, read_source
from inference.schema import ConfigOrigin, build, load_yaml_text

# Throughputs within 3% of the best are a tie: the lower p99 wins.
TIE = 0.03
KNOBS = ("backend", "precision", "instances", "threads", "max_batch_size", "preferred", "delay_us")
DELAYS_US = (0, 500, 2000, 5000)
BATCHES = (1, 2, 4, 8, 16, 32, 64)
_NATIVE = "native"  # ONNX Runtime computes in the model file's own types


@dataclass(frozen=True)
class TrialPoint:
    """One configuration to measure: the tuned knobs, nothing else."""

    backend: str
    precision: str  # OpenVINO's precision option; "native" for ONNX Runtime
    instances: int
    threads: int  # OpenVINO: in all; ONNX Runtime: per instance; 0 = the runtime's default
    max_batch_size: int
    preferred: tuple[int, ...]
    delay_us: int

    @classmethod
    def from_config(cls, config: ModelConfig) -> TrialPoint:
        opts = config.backend_options
        precision, threads = _NATIVE, 0
        if isinstance(opts, OpenVinoOptions):
            precision, threads = opts.precision, opts.threads
        elif isinstance(opts, OnnxRuntimeOptions):
            threads = opts.intra_op_threads
        return cls(
            backend=config.backend,
            precision=precision,
            instances=config.instance_count,
            threads=threads,
            max_batch_size=config.max_batch_size,
            preferred=tuple(config.dynamic_batching.preferred_batch_size),
            delay_us=config.dynamic_batching.max_queue_delay_microseconds,
        )

    def apply(self, config: ModelConfig) -> ModelConfig:
        """``config`` with this point's knobs set (and every other setting kept)."""
        # Another backend starts from its own defaults: the old one's keys do not apply.
        opts = config.backend_options
        if self.backend != config.backend:
            opts = BACKEND_OPTIONS[self.backend]()
        if isinstance(opts, OpenVinoOptions):
            opts = dataclasses.replace(opts, precision=self.precision, threads=self.threads)  # type: ignore[arg-type]
        elif isinstance(opts, OnnxRuntimeOptions):
            opts = dataclasses.replace(opts, intra_op_threads=self.threads)
        kind = config.instance_group[0].kind if config.instance_group else "KIND_CPU"
        return dataclasses.replace(
            config,
            backend=self.backend,
            max_batch_size=self.max_batch_size,
            dynamic_batching=dataclasses.replace(
                config.dynamic_batching,
                preferred_batch_size=list(self.preferred),
                max_queue_delay_microseconds=self.delay_us,
            ),
            instance_group=[InstanceGroup(count=self.instances, kind=kind)],
            backend_options=opts,
        )

    def describe(self) -> str:
        pref = ",".join(map(str, self.preferred)) or "-"
        return (
            f"{self.backend} {self.precision} instances={self.instances} threads={self.threads} "
            f"max_batch={self.max_batch_size} preferred={pref} delay={self.delay_us}us"
        )


@dataclass
class TrialResult:
    """What one point measured."""

    point: TrialPoint
    throughput: float = 0.0  # answers per second
    p50_ms: float = math.nan
    p99_ms: float = math.nan
    mean_batch: float = math.nan
    requests: int = 0
    rejected: int = 0
    precision: str = ""  # what the backend computed in (auto resolved), "" when it did not load
    error: str = ""  # why the point could not be measured
    seconds: float = 0.0  # wall time of the trial, load included

    def fits(self, latency_budget_ms: float | None) -> bool:
        """Measured without errors and, with a budget, with p99 within it."""
        if self.error or self.requests == 0 or self.rejected:
            return False
        return latency_budget_ms is None or self.p99_ms <= latency_budget_ms


Measure = Callable[[TrialPoint], Awaitable[TrialResult]]


class TuneError(VidpipeError, RuntimeError):
    """The search cannot start: the model's current configuration does not run."""


@dataclass(frozen=True)
class SearchSpace:
    """The values each knob may take; :meth:`neighbours` keeps combinations valid."""

    backends: tuple[str, ...]
    precisions: tuple[str, ...]  # OpenVINO's; ONNX Runtime has only "native"
    instances: tuple[int, ...]
    threads: tuple[int, ...]
    batches: tuple[int, ...]  # () = the model has no batch axis (max_batch_size 0)
    delays_us: tuple[int, ...]
    skipped_batches: tuple[int, ...] = ()  # refused by a model file with a fixed batch
    fixed_batch: int | None = None

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        *,
        concurrency: int,
        cpus: int | None = None,
        fixed_batch: int | None = None,
    ) -> SearchSpace:
        """The knobs' values for ``config`` on this machine under ``concurrency`` callers.

        ``fixed_batch``: the batch the model file declares, when it is not dynamic;
        larger batches are left out (the runtime would refuse them), except where
        OpenVINO runs a batch as pieces of a static size (``static_batch_sizes``).
        """
        cpus = cpus or os.cpu_count() or 1
        backends = [b for b in ("openvino", "onnxruntime") if importlib.util.find_spec(b) is not None]
        if _is_openvino_ir(config):
            backends = [b for b in backends if b != "onnxruntime"]  # ONNX Runtime reads ONNX only
        if config.backend not in backends:
            backends.insert(0, config.backend)
        start = TrialPoint.from_config(config)
        precisions = ["auto", "f32", *_extra_precisions()]
        if start.backend == "openvino" and start.precision not in precisions:
            precisions.append(start.precision)
        if config.max_batch_size == 0:
            batches: list[int] = []
        else:
            # A batch larger than the callers in flight can never fill.
            batches = [b for b in BATCHES if b <= max(1, concurrency)]
            batches.append(config.max_batch_size)
        skipped: list[int] = []
        pieces = config.backend == "openvino" and bool(
            config.backend_options_as(OpenVinoOptions).static_batch_sizes
        )
        if fixed_batch is not None and not pieces:
            skipped = sorted({b for b in batches if b > fixed_batch})
            batches = [b for b in batches if b <= fixed_batch] or [fixed_batch]
        return cls(
            backends=tuple(backends),
            precisions=tuple(precisions),
            instances=_sorted_unique([1, 2, 2 * cpus, start.instances], upto=max(8, start.instances)),
            threads=_sorted_unique([0, 1, cpus, start.threads]),
            batches=_sorted_unique(batches),
            delays_us=_sorted_unique([*DELAYS_US, start.delay_us]),
            skipped_batches=tuple(skipped),
            fixed_batch=fixed_batch,
        )

    def preferred_for(self, max_batch: int) -> list[tuple[int, ...]]:
        """Preferred-size choices for a max batch: none, [max] or [max/2, max]."""
        if max_batch <= 1:
            return [()]
        out: list[tuple[int, ...]] = [(), (max_batch,)]
        if max_batch >= 4:
            out.append((max_batch // 2, max_batch))
        return out

    def values(self, knob: str, point: TrialPoint) -> list[Any]:
        """The values ``knob`` may take when the other knobs are as in ``point``."""
        if knob == "backend":
            return list(self.backends)
        if knob == "precision":
            return list(self.precisions) if point.backend == "openvino" else [_NATIVE]
        if knob == "instances":
            return list(self.instances)
        if knob == "threads":
            return list(self.threads)
        if knob == "max_batch_size":
            return list(self.batches) or [0]
        if knob == "preferred":
            return list(self.preferred_for(point.max_batch_size))
        if knob == "delay_us":
            return list(self.delays_us)
        raise KeyError(knob)

    def neighbours(self, point: TrialPoint, knob: str) -> list[TrialPoint]:
        """``point`` with ``knob`` set to each of its values, the rest adjusted to stay valid."""
        out = []
        for value in self.values(knob, point):
            p = dataclasses.replace(point, **{knob: value})
            if knob == "backend" and value != point.backend:
                p = dataclasses.replace(p, precision="auto" if value == "openvino" else _NATIVE)
            if knob == "max_batch_size":
                p = dataclasses.replace(p, preferred=_rescale(point.preferred, value, self))
            out.append(p)
        return list(dict.fromkeys(out))

    def size(self) -> int:
        """How many points a full grid would measure."""
        per_backend = 0
        for backend in self.backends:
            precisions = len(self.precisions) if backend == "openvino" else 1
            batch_pref = sum(len(self.preferred_for(b)) for b in (self.batches or (0,)))
            per_backend += precisions * len(self.instances) * len(self.threads) * batch_pref
        return per_backend * len(self.delays_us)


def _is_openvino_ir(config: ModelConfig) -> bool:
    """Whether the model file is an OpenVINO IR (``model.xml``), which only OpenVINO reads."""
    mf = config.model_file
    return mf is not None and mf.path.lower().endswith(".xml")


def _extra_precisions() -> list[str]:
    # bf16 is what auto already picks on CPUs that have it; f16 is worth a trial where present.
    if importlib.util.find_spec("openvino") is None:
        return []
    try:
        import openvino

        caps = openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    except Exception:
        return []
    return ["f16"] if "FP16" in caps else []


def _sorted_unique(values: Iterable[int], upto: int | None = None) -> tuple[int, ...]:
    return tuple(sorted({v for v in values if upto is None or v <= upto}))


def _rescale(preferred: tuple[int, ...], max_batch: int, space: SearchSpace) -> tuple[int, ...]:
    """The same kind of preferred sizes (none, [max], [max/2, max]) for a new max batch."""
    choices = space.preferred_for(max_batch)
    for choice in choices:
        if len(choice) == len(preferred):
            return choice
    return choices[-1] if preferred else ()


def score(result: TrialResult, latency_budget_ms: float | None) -> tuple[int, float]:
    """Higher is better: points within the budget by throughput, the others by lower p99."""
    if result.fits(latency_budget_ms):
        return (2, result.throughput)
    if result.error or result.requests == 0:
        return (0, 0.0)
    return (1, -result.p99_ms)


def pick(results: Sequence[TrialResult], latency_budget_ms: float | None) -> TrialResult | None:
    """The chosen point: the fastest within the budget, ties (within :data:`TIE`) to the lowest p99."""
    fitting = [r for r in results if r.fits(latency_budget_ms)]
    if not fitting:
        return None
    top = max(r.throughput for r in fitting)
    tied = [r for r in fitting if r.throughput >= top * (1 - TIE)]
    return min(tied, key=lambda r: (r.p99_ms, -r.throughput))


@dataclass
class SearchLog:
    """Every result in the order it was measured, and how long the search took."""

    results: list[TrialResult] = field(default_factory=list)
    seconds: float = 0.0
    passes: int = 0
    stopped_by_budget: bool = False


async def coordinate_descent(
    start: TrialPoint,
    space: SearchSpace,
    measure: Measure,
    *,
    budget_s: float,
    latency_budget_ms: float | None = None,
    max_passes: int = 3,
    clock: Callable[[], float] = time.monotonic,
    on_result: Callable[[int, TrialResult], None] | None = None,
) -> SearchLog:
    """Vary one knob at a time from the best point so far; stop when time or improvements run out.

    A trial starts only while the time spent plus the longest trial so far fits
    in ``budget_s``; the first point (``start``) is always measured.
    """
    log = SearchLog()
    seen: dict[TrialPoint, TrialResult] = {}
    began = clock()

    async def trial(point: TrialPoint) -> TrialResult | None:
        if point in seen:
            return seen[point]
        longest = max((r.seconds for r in log.results), default=0.0)
        if seen and clock() - began + longest > budget_s:
            log.stopped_by_budget = True
            return None
        t0 = clock()
        result = await measure(point)
        result.seconds = clock() - t0
        seen[point] = result
        log.results.append(result)
        if on_result is not None:
            on_result(len(log.results), result)
        return result

    first = await trial(start)
    assert first is not None  # the first trial always runs
    best = first
    for _ in range(max_passes):
        log.passes += 1
        changed = False
        for knob in KNOBS:
            for point in space.neighbours(best.point, knob):
                result = await trial(point)
                if result is None:
                    break
                if score(result, latency_budget_ms) > score(best, latency_budget_ms):
                    best = result
                    changed = True
            if log.stopped_by_budget:
                break
        if log.stopped_by_budget or not changed:
            break
    log.seconds = clock() - began
    return log


# -- inputs ----------------------------------------------------------------------------------

_WORDS = ("KA05 MX2231", "VIDPIPE 42", "GATE B7", "EXIT 12", "NO PARKING", "BUS 7A", "LOADING BAY 3")
_FONT = cv2.FONT_HERSHEY_SIMPLEX


def _text_line(index: int, height: int) -> np.ndarray:
    """A crop of one dark text line on a light panel, as a detector would cut it (RGB)."""
    text = _WORDS[index % len(_WORDS)]
    scale = height / 40
    (tw, th), base = cv2.getTextSize(text, _FONT, scale, 2)
    pad = max(2, height // 8)
    img = np.full((th + base + 2 * pad, tw + 2 * pad, 3), (235, 230, 215), np.uint8)
    cv2.putText(img, text, (pad, pad + th), _FONT, scale, (20, 20, 20), 2, cv2.LINE_AA)
    # Every third line is upside down, the case an orientation classifier is there for.
    return np.ascontiguousarray(img[::-1, ::-1]) if index % 3 == 2 else img


def _scene(index: int, width: int, height: int) -> np.ndarray:
    """A street-like frame: lane markings, a few text plates and a bright square (RGB)."""
    img = np.empty((height, width, 3), np.uint8)
    img[:] = (40, 44, 52)
    for lane_y in (height // 3, 2 * height // 3):
        for x in range(-(index * 6) % 80, width, 80):
            cv2.line(img, (x, lane_y), (x + 40, lane_y), (120, 120, 120), 2)
    scale = max(0.4, min(width, height) / 500)
    for k in range(3):
        text = _WORDS[(index + k) % len(_WORDS)]
        (tw, th), base = cv2.getTextSize(text, _FONT, scale, 2)
        x = (index * 17 + k * width // 3) % max(1, width - tw - 20)
        y = (k + 1) * height // 4 - th
        cv2.rectangle(img, (x, y), (x + tw + 16, y + th + base + 12), (250, 215, 40), -1)
        cv2.putText(img, text, (x + 8, y + 6 + th), _FONT, scale, (15, 15, 15), 2, cv2.LINE_AA)
    side = max(8, min(width, height) // 10)
    sx = (index * 23) % max(1, width - side)
    img[height - side - 4 : height - 4, sx : sx + side] = 255
    return img


def sample_images(config: ModelConfig, count: int = 16) -> list[np.ndarray]:
    """Realistic inputs for ``config``'s task at its input size: text-line crops or street scenes."""
    _, height, width = config.input.shape
    if config.task.kind in ("classify", "text_recognize"):
        return [_text_line(i, height) for i in range(count)]
    return [_scene(i, width, height) for i in range(count)]


# -- measuring -------------------------------------------------------------------------------


class FileFrames:
    """Frames of a video file decoded in a loop (PyAV), as one camera of the pipeline would decode them.

    Under ``--source FILE --streams N`` every caller owns one, so the CPU decodes
    N streams while the model runs: the load the model shares the machine with.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._container: Any = None
        self._frames: Any = None

    def _open(self) -> None:
        import av

        self.close()
        self._container = av.open(self.path)
        self._frames = self._container.decode(video=0)

    def next(self) -> np.ndarray:
        """The next frame as RGB uint8; the file starts again at its end (blocking: run it on a thread)."""
        for _ in range(2):
            if self._frames is None:
                self._open()
            frame = next(self._frames, None)
            if frame is not None:
                return np.asarray(frame.to_ndarray(format="rgb24"))
            self._frames = None
        raise ValueError(f"{self.path}: no video frames")

    def close(self) -> None:
        if self._container is not None:
            self._container.close()
        self._container = self._frames = None


class TrialRunner:
    """Measures a point: load the model with it, drive closed-loop load, unload.

    A trial lasts a number of answers, not seconds: ``warmup`` answers are not
    counted, then ``inferences`` answers (at least four per caller) are, so a slow
    model is measured on as many answers as a fast one and a busy second does not
    decide a ranking. With ``stream_file``, each caller decodes its own copy of
    that video file in a loop before each request (the pipeline's sources × streams).
    """

    def __init__(
        self,
        source: ModelSource,
        *,
        concurrency: int = 8,
        inferences: int = 64,
        warmup: int | None = None,
        images: Sequence[np.ndarray] | None = None,
        stream_file: str | None = None,
    ) -> None:
        self.source = source
        self.concurrency = max(1, concurrency)
        self.inferences = max(inferences, 4 * self.concurrency)
        self.warmup = max(1, warmup if warmup is not None else max(self.concurrency, inferences // 4))
        self.images = list(images) if images is not None else sample_images(source.config)
        self.stream_file = stream_file

    async def __call__(self, point: TrialPoint) -> TrialResult:
        src = self.source
        model = Model(
            point.apply(src.config),
            src.model_dir,
            version=src.version,
            version_dir=src.version_dir,
            describe_error=src.describe,
        )
        result = TrialResult(point)
        try:
            state = await asyncio.to_thread(model.load)
            if state is not ModelState.READY:
                result.error = model.reason
                return result
            result.precision = model.precision
            await self._drive(model, result)
        finally:
            await asyncio.to_thread(model.stop, drain=False)
        return result

    async def _drive(self, model: Model, result: TrialResult) -> None:
        """Closed-loop load until ``warmup + inferences`` answers; the last ``inferences`` are timed."""
        target = self.warmup + self.inferences
        latencies: list[float] = []
        answered = rejected = 0
        window = [0.0, 0.0]
        batches = [0, 0]
        n = len(self.images)
        streams = [FileFrames(self.stream_file) for _ in range(self.concurrency)] if self.stream_file else []

        async def caller(k: int) -> None:
            nonlocal answered, rejected
            i = k
            while answered < target:
                if streams:
                    image = await asyncio.to_thread(streams[k].next)
                else:
                    image = self.images[i % n]
                t0 = time.perf_counter()
                try:
                    await model.infer(image)
                except InferenceRejected:
                    rejected += 1
                    await asyncio.sleep(0.001)  # a full queue: let the instances drain it
                    continue
                t1 = time.perf_counter()
                answered += 1
                if answered == self.warmup:
                    window[0] = t1
                    batches[:] = [model.stats.batches, model.stats.batched_requests]
                elif self.warmup < answered <= target:
                    latencies.append(t1 - t0)
                    if answered == target:
                        window[1] = t1
                i += self.concurrency

        try:
            await asyncio.gather(*(caller(k) for k in range(self.concurrency)))
        finally:
            for stream in streams:
                stream.close()
        stats = model.stats
        result.requests = len(latencies)
        result.rejected = rejected
        seconds = window[1] - window[0]
        result.throughput = len(latencies) / seconds if seconds > 0 else 0.0
        if latencies:
            ms = np.asarray(latencies) * 1000.0
            result.p50_ms = float(np.percentile(ms, 50))
            result.p99_ms = float(np.percentile(ms, 99))
        if stats.batches > batches[0]:
            result.mean_batch = (stats.batched_requests - batches[1]) / (stats.batches - batches[0])


# -- is the machine quiet? -------------------------------------------------------------------

# The start point measured at the start and again at the end: more apart than this, the
# machine's speed changed during the search and the ranking cannot be trusted.
DRIFT = 0.15
BUSY_LOAD = 0.5  # 1-minute load average per CPU before the search, from other work
BUSY_STEAL = 0.05  # share of CPU time the hypervisor gave to other guests during the search


def _cpu_times() -> tuple[int, int] | None:
    """(steal, total) jiffies from /proc/stat; None where there is no such file."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    values = [int(v) for v in fields[1:]]
    steal = values[7] if len(values) > 7 else 0
    return steal, sum(values[:8])


@dataclass
class MachineProbe:
    """Reads the load average and the CPU steal; injectable so a test can play a busy machine."""

    loadavg: Callable[[], float] = field(default=lambda: os.getloadavg()[0])
    cpu_times: Callable[[], tuple[int, int] | None] = field(default=_cpu_times)
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)


@dataclass
class MachineCheck:
    """How quiet the machine was: load before, steal during, the start point at start and end."""

    cpus: int
    load_before: float
    steal: float | None = None
    baseline_start: float = math.nan
    baseline_end: float = math.nan

    @property
    def drift(self) -> float:
        a, b = self.baseline_start, self.baseline_end
        if math.isnan(a) or math.isnan(b) or max(a, b) <= 0:
            return math.nan
        return abs(a - b) / max(a, b)

    def reasons(self) -> list[str]:
        """Why the measurements may be off; empty on a quiet machine."""
        out = []
        if self.load_before >= BUSY_LOAD * self.cpus:
            out.append(f"load average {self.load_before:.1f} on {self.cpus} CPU(s) before the search")
        if self.steal is not None and self.steal >= BUSY_STEAL:
            out.append(f"{self.steal:.0%} of CPU time stolen by other guests during the search")
        if not math.isnan(self.drift) and self.drift > DRIFT:
            out.append(
                f"the current configuration ran {self.baseline_start:.1f}/s at the start and "
                f"{self.baseline_end:.1f}/s at the end ({self.drift:.0%} apart)"
            )
        return out

    @property
    def busy(self) -> bool:
        return bool(self.reasons())


@dataclass
class Verification:
    """The pick against the current configuration, measured in turns (A B, B A, ...)."""

    current: list[TrialResult]
    picked: list[TrialResult]
    margin: float

    @staticmethod
    def _rate(results: Sequence[TrialResult]) -> float:
        ok = [r.throughput for r in results if not r.error and r.requests]
        return float(np.median(ok)) if len(ok) == len(results) and ok else 0.0

    @property
    def current_rate(self) -> float:
        return self._rate(self.current)

    @property
    def picked_rate(self) -> float:
        return self._rate(self.picked)

    @property
    def faster(self) -> bool:
        """The pick beat the current configuration by more than the margin in the median of the turns."""
        return self.picked_rate > self.current_rate * (1 + self.margin)

    def describe(self) -> str:
        turns = len(self.picked)
        ratio = self.picked_rate / self.current_rate if self.current_rate else math.inf
        return (
            f"the pick ran {self.picked_rate:.1f}/s against the current {self.current_rate:.1f}/s "
            f"({ratio:.2f}x, median of {turns} interleaved turn(s) each)"
        )


async def verify(
    current: TrialPoint, picked: TrialPoint, measure: Measure, *, rounds: int = 3, margin: float = TIE
) -> Verification:
    """Measure ``picked`` and ``current`` in turns, the order swapped each round, so drift hits both."""
    out = Verification([], [], margin)
    for r in range(rounds):
        order = ((current, out.current), (picked, out.picked))
        for point, into in order if r % 2 == 0 else order[::-1]:
            into.append(await measure(point))
    return out


# -- the whole run ---------------------------------------------------------------------------


@dataclass
class TuneReport:
    """A finished search: every result, the pick and the best measured."""

    model: str
    config_file: Path
    start: TrialPoint
    space: SearchSpace
    log: SearchLog
    latency_budget_ms: float | None
    picked: TrialResult | None
    machine: MachineCheck | None = None
    verification: Verification | None = None

    @property
    def to_write(self) -> TrialPoint | None:
        """The point to write: a pick that differs from the current one and beat it when verified."""
        if self.picked is None or self.picked.point == self.start:
            return None
        if self.verification is not None and not self.verification.faster:
            return None
        return self.picked.point

    @property
    def best_measured(self) -> TrialResult | None:
        """The highest throughput of any point measured without errors, budget or not."""
        ok = [r for r in self.log.results if not r.error and r.requests]
        return max(ok, key=lambda r: r.throughput, default=None)

    def table(self) -> str:
        return format_table(self.log.results, self.picked)

    def summary(self) -> str:
        """The closing lines: the best measured, the pick, and how the search went."""
        lines = []
        best = self.best_measured
        if best is not None:
            lines.append(f"best measured: {best.throughput:.1f}/s  {best.point.describe()}")
        budget = f"{self.latency_budget_ms:g} ms" if self.latency_budget_ms is not None else "none"
        if self.picked is None:
            lines.append(f"picked: nothing: no point ran without errors within the p99 budget ({budget})")
        else:
            p = self.picked
            share = p.throughput / best.throughput * 100 if best and best.throughput else 100.0
            lines.append(
                f"picked: {p.throughput:.1f}/s = {share:.1f}% of the best measured, "
                f"p50 {p.p50_ms:.1f} ms, p99 {p.p99_ms:.1f} ms (budget {budget})  {p.point.describe()}"
            )
        lines.append(
            f"searched {len(self.log.results)} of {self.space.size()} points in {self.log.seconds:.1f} s "
            f"({self.log.passes} pass(es){', time budget reached' if self.log.stopped_by_budget else ''})"
        )
        if self.space.skipped_batches:
            lines.append(
                f"skipped max_batch_size {', '.join(map(str, self.space.skipped_batches))}: the model file "
                f"fixes its batch at {self.space.fixed_batch}"
            )
        if self.machine is not None:
            reasons = self.machine.reasons()
            if reasons:
                lines.append(
                    "busy machine: " + "; ".join(reasons) + ". The ranking may be wrong: tune again on a "
                    "quiet machine"
                )
        if self.verification is not None:
            verdict = "faster" if self.verification.faster else "not faster: the current configuration stays"
            lines.append(f"verified: {self.verification.describe()}: {verdict}")
        return "\n".join(lines)


HEADER = (
    "#",
    "backend",
    "precision",
    "instances",
    "threads",
    "max_batch",
    "preferred",
    "delay_us",
    "throughput/s",
    "p50_ms",
    "p99_ms",
    "mean_batch",
)


def _num(value: float, digits: int = 1) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def format_table(results: Sequence[TrialResult], picked: TrialResult | None = None) -> str:
    """One row per trial, fastest first; the pick is marked ``*``, failures say why below."""
    rows = []
    notes = []
    order = sorted(range(len(results)), key=lambda i: -results[i].throughput)
    for i in order:
        r = results[i]
        p = r.point
        precision = p.precision
        if r.precision and r.precision != p.precision and p.precision != _NATIVE:
            precision = f"{p.precision} ({r.precision})"
        mark = "*" if r is picked else ""
        rows.append(
            (
                f"{i + 1}{mark}",
                p.backend,
                precision,
                str(p.instances),
                str(p.threads),
                str(p.max_batch_size),
                ",".join(map(str, p.preferred)) or "-",
                str(p.delay_us),
                _num(r.throughput),
                _num(r.p50_ms),
                _num(r.p99_ms),
                _num(r.mean_batch),
            )
        )
        if r.error:
            notes.append(f"trial {i + 1}: {r.error}")
        elif r.rejected:
            notes.append(f"trial {i + 1}: {r.rejected} request(s) rejected")
    widths = [max(len(row[k]) for row in [HEADER, *rows]) for k in range(len(HEADER))]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(HEADER), sep, *(line(r) for r in rows), *notes])


def fixed_batch_of(source: ModelSource) -> int | None:
    """The batch an ONNX model file fixes on its input (``[1, 3, H, W]``), None when it is dynamic."""
    from inference.introspect import ModelIntrospectionError, read_onnx
    from inference.model import resolve_model_file

    try:
        path = resolve_model_file(source.config, source.model_dir, source.version_dir)
        if path.suffix.lower() != ".onnx":
            return None
        inputs, _, _ = read_onnx(path)
    except (ModelIntrospectionError, ValueError, OSError):
        return None  # the trials will say what is wrong with the file
    wanted = source.config.input.name
    spec = next((i for i in inputs if wanted is None or i.name == wanted), None)
    if spec is None or len(spec.shape) != 4 or spec.shape[0] is None:
        return None
    return spec.shape[0]


async def tune(
    root: Path,
    name: str,
    *,
    concurrency: int = 8,
    budget_s: float = 120.0,
    inferences: int = 64,
    latency_budget_ms: float | None = None,
    on_result: Callable[[int, TrialResult], None] | None = None,
    verify_rounds: int = 3,
    stream_file: str | None = None,
    measure: Measure | None = None,
    probe: MachineProbe | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> TuneReport:
    """Search ``name``'s configuration in the repository at ``root``; nothing is written.

    The current configuration is measured first and again last (a changed speed
    means a busy machine); with ``verify_rounds``, a pick that differs from it is
    then measured against it in turns (:func:`verify`). ``measure`` replaces the
    real trial runner (a test's seam); ``probe`` the load and steal readings.
    """
    source = read_source(root, name)
    start = TrialPoint.from_config(source.config)
    probe = probe or MachineProbe()
    space = SearchSpace.for_model(
        source.config, concurrency=concurrency, cpus=probe.cpus, fixed_batch=fixed_batch_of(source)
    )
    if measure is None:
        measure = TrialRunner(source, concurrency=concurrency, inferences=inferences, stream_file=stream_file)
    runner = measure
    started = False

    async def measure_start_first(point: TrialPoint) -> TrialResult:
        # The first trial is the current configuration: when it fails (a missing model file,
        # a config the runtime refuses) every other point fails the same way, so stop here.
        nonlocal started
        result = await runner(point)
        if not started and result.error:
            raise TuneError(
                f"model {name}: the current configuration ({source.file}) does not run: {result.error}; "
                "fix it and tune again"
            )
        started = True
        return result

    machine = MachineCheck(probe.cpus, probe.loadavg())
    times_before = probe.cpu_times()
    log = await coordinate_descent(
        start,
        space,
        measure_start_first,
        budget_s=budget_s,
        latency_budget_ms=latency_budget_ms,
        on_result=on_result,
        clock=clock,
    )
    machine.baseline_start = log.results[0].throughput
    again = await measure(start)
    machine.baseline_end = again.throughput
    times_after = probe.cpu_times()
    if times_before is not None and times_after is not None and times_after[1] > times_before[1]:
        machine.steal = (times_after[0] - times_before[0]) / (times_after[1] - times_before[1])
    picked = pick(log.results, latency_budget_ms)
    verification = None
    if verify_rounds > 0 and picked is not None and picked.point != start:
        verification = await verify(start, picked.point, measure, rounds=verify_rounds)
    return TuneReport(name, source.file, start, space, log, latency_budget_ms, picked, machine, verification)


@dataclass
class InstanceChoice:
    """What ``models add`` measured per instance count, and the count it chose."""

    results: list[TrialResult]
    chosen: int

    def describe(self) -> str:
        rates = ", ".join(f"{r.point.instances} -> {r.throughput:.1f}/s" for r in self.results)
        return f"instances: {self.chosen} (measured {rates})"


async def choose_instances(
    root: Path,
    name: str,
    *,
    counts: Sequence[int] | None = None,
    inferences: int = 16,
    measure: Measure | None = None,
) -> InstanceChoice:
    """Measure ``name`` with each instance count (a few inferences each) and choose the fastest.

    Counts default to 1, 2 and one per CPU. A larger count wins only when it is
    faster by more than :data:`TIE`: instances cost memory, and noise is no reason
    to spend it.
    """
    source = read_source(root, name)
    cpus = os.cpu_count() or 1
    counts = sorted(set(counts or [c for c in (1, 2, cpus) if c <= max(2, cpus)]))
    start = TrialPoint.from_config(source.config)
    results = []
    for count in counts:
        point = dataclasses.replace(start, instances=count)
        if measure is None:
            # Two callers per instance keep every instance busy without batching for it.
            runner = TrialRunner(source, concurrency=2 * count, inferences=inferences, warmup=2 * count)
            results.append(await runner(point))
        else:
            results.append(await measure(point))
    chosen = results[0]
    for r in results[1:]:
        if not r.error and r.throughput > chosen.throughput * (1 + TIE):
            chosen = r
    return InstanceChoice(results, chosen.point.instances)


# -- writing the pick ------------------------------------------------------------------------


def round_trip_yaml() -> Any:
    """A YAML editor that keeps a config file's comments, order and flow style."""
    from ruamel.yaml import YAML

    y = YAML(typ="rt")
    y.preserve_quotes = True
    y.width = 4096  # never re-wrap a long line
    return y


def _flow_list(values: Sequence[Any]) -> Any:
    from ruamel.yaml.comments import CommentedSeq

    seq = CommentedSeq(values)
    seq.fa.set_flow_style()
    return seq


def _section(doc: Any, key: str) -> Any:
    from ruamel.yaml.comments import CommentedMap

    if not isinstance(doc.get(key), dict):
        doc[key] = CommentedMap()
    return doc[key]


def set_key(mapping: Any, key: str, value: Any, changes: list[str], label: str) -> None:
    """Set ``key`` in a round-trip mapping when it differs, and say so in ``changes``."""
    old = mapping.get(key)
    if old == value:
        return
    changes.append(f"{label}: {_show(old)} -> {_show(value)}")
    if isinstance(value, list):
        if isinstance(old, list):
            old[:] = value  # in place: the list keeps its flow or block style
        else:
            mapping[key] = _flow_list(value)
    else:
        mapping[key] = value


def _show(value: Any) -> str:
    return "(unset)" if value is None else str(list(value) if isinstance(value, list) else value)


def tuned_config_text(text: str, config: ModelConfig, point: TrialPoint, file: str) -> tuple[str, list[str]]:
    """``text`` (a config.yaml) with ``point``'s knobs written in, and a line per changed key.

    A key is written only where the point differs from what ``config`` (the
    file's parsed content, defaults included) already says, so an unchanged
    knob leaves its line, or its absence, alone.
    """
    current = TrialPoint.from_config(config)
    y = round_trip_yaml()
    doc = y.load(text)
    changes: list[str] = []
    if point.backend != config.backend:
        set_key(doc, "backend", point.backend, changes, "backend")
        # Keys of the old backend's options would make the file invalid for the new one.
        section = doc.get("backend_options")
        takes = BACKEND_OPTIONS.keys_of(point.backend)
        for key in [k for k in section or {} if k not in takes]:
            changes.append(f"backend_options.{key}: {_show(section[key])} -> (unset)")
            del section[key]
    if point.max_batch_size != config.max_batch_size:
        set_key(doc, "max_batch_size", point.max_batch_size, changes, "max_batch_size")
    if point.preferred != current.preferred or point.delay_us != current.delay_us:
        db = _section(doc, "dynamic_batching")
        if point.preferred != current.preferred:
            set_key(
                db,
                "preferred_batch_size",
                list(point.preferred),
                changes,
                "dynamic_batching.preferred_batch_size",
            )
        if point.delay_us != current.delay_us:
            set_key(
                db,
                "max_queue_delay_microseconds",
                point.delay_us,
                changes,
                "dynamic_batching.max_queue_delay_microseconds",
            )
    if point.instances != config.instance_count:
        groups = doc.get("instance_group")
        if isinstance(groups, list) and len(groups) == 1 and isinstance(groups[0], dict):
            set_key(groups[0], "count", point.instances, changes, "instance_group[0].count")
        else:
            from ruamel.yaml.comments import CommentedMap

            group = CommentedMap(count=point.instances, kind=config.instance_group[0].kind)
            group.fa.set_flow_style()
            doc["instance_group"] = _flow_list([group])
            changes.append(
                f"instance_group: {config.instance_count} instance(s) -> [{{count: {point.instances}}}]"
            )
    # What the file says now, for the point's backend (its defaults after a switch).
    was = current
    if point.backend != config.backend:
        defaults = BACKEND_OPTIONS[point.backend]()
        was = TrialPoint.from_config(
            dataclasses.replace(config, backend=point.backend, backend_options=defaults)
        )
    if point.backend == "openvino":
        if point.precision != was.precision:
            set_key(
                _section(doc, "backend_options"),
                "precision",
                point.precision,
                changes,
                "backend_options.precision",
            )
        if point.threads != was.threads:
            set_key(
                _section(doc, "backend_options"), "threads", point.threads, changes, "backend_options.threads"
            )
    elif point.threads != was.threads:
        set_key(
            _section(doc, "backend_options"),
            "intra_op_threads",
            point.threads,
            changes,
            "backend_options.intra_op_threads",
        )
    out = io.StringIO()
    y.dump(doc, out)
    new_text = out.getvalue()
    # The result must still be a valid config: check it before anything is written.
    build(load_yaml_text(new_text, file), ModelConfig, file)
    return new_text, changes


def write_tuned_config(path: Path, point: TrialPoint) -> list[str]:
    """Write ``point`` into the model's ``config.yaml`` at ``path``; returns the changed keys."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    data = load_yaml_text(text, str(path))
    config = build(data, ModelConfig, str(path))
    config = dataclasses.replace(config, origin=ConfigOrigin(str(path), data))
    new_text, changes = tuned_config_text(text, config, point, str(path))
    if changes:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(new_text, encoding="utf-8")
        os.replace(tmp, path)
    return changes
