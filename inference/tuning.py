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
point is measured once. A point counts only when its p99 latency is within the
latency budget; the pick is the fastest such point, except that points within
:data:`TIE` of the fastest are a tie (measurement noise on a shared machine) and
the one with the lowest p99 wins.

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
from inference.config import InstanceGroup, ModelConfig
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
        ov = config.backend == "openvino"
        return cls(
            backend=config.backend,
            precision=opts.precision if ov else _NATIVE,
            instances=config.instance_count,
            threads=opts.threads if ov else opts.intra_op_threads,
            max_batch_size=config.max_batch_size,
            preferred=tuple(config.dynamic_batching.preferred_batch_size),
            delay_us=config.dynamic_batching.max_queue_delay_microseconds,
        )

    def apply(self, config: ModelConfig) -> ModelConfig:
        """``config`` with this point's knobs set (and every other setting kept)."""
        opts = config.backend_options
        if self.backend == "openvino":
            opts = dataclasses.replace(opts, precision=self.precision, threads=self.threads)  # type: ignore[arg-type]
        else:
            opts = dataclasses.replace(opts, intra_op_threads=self.threads)
        kind = config.instance_group[0].kind if config.instance_group else "KIND_CPU"
        return dataclasses.replace(
            config,
            backend=self.backend,  # type: ignore[arg-type]
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


@dataclass(frozen=True)
class SearchSpace:
    """The values each knob may take; :meth:`neighbours` keeps combinations valid."""

    backends: tuple[str, ...]
    precisions: tuple[str, ...]  # OpenVINO's; ONNX Runtime has only "native"
    instances: tuple[int, ...]
    threads: tuple[int, ...]
    batches: tuple[int, ...]  # () = the model has no batch axis (max_batch_size 0)
    delays_us: tuple[int, ...]

    @classmethod
    def for_model(cls, config: ModelConfig, *, concurrency: int, cpus: int | None = None) -> SearchSpace:
        """The knobs' values for ``config`` on this machine under ``concurrency`` callers."""
        cpus = cpus or os.cpu_count() or 1
        backends = [b for b in ("openvino", "onnxruntime") if importlib.util.find_spec(b) is not None]
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
        return cls(
            backends=tuple(backends),
            precisions=tuple(precisions),
            instances=_sorted_unique([1, 2, 2 * cpus, start.instances], upto=max(8, start.instances)),
            threads=_sorted_unique([0, 1, cpus, start.threads]),
            batches=_sorted_unique(batches),
            delays_us=_sorted_unique([*DELAYS_US, start.delay_us]),
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


class TrialRunner:
    """Measures a point: load the model with it, drive closed-loop load, unload."""

    def __init__(
        self,
        source: ModelSource,
        *,
        concurrency: int = 8,
        trial_seconds: float = 2.0,
        warmup_seconds: float = 0.5,
        images: Sequence[np.ndarray] | None = None,
    ) -> None:
        self.source = source
        self.concurrency = max(1, concurrency)
        self.trial_seconds = trial_seconds
        self.warmup_seconds = warmup_seconds
        self.images = list(images) if images is not None else sample_images(source.config)

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
        """Closed-loop load: warm up, then count the answers that arrive inside the window."""
        window_start = time.perf_counter() + self.warmup_seconds
        window_end = window_start + self.trial_seconds
        latencies: list[float] = []
        rejected = 0
        n = len(self.images)

        async def caller(offset: int) -> None:
            nonlocal rejected
            i = offset
            while (t0 := time.perf_counter()) < window_end:
                try:
                    await model.infer(self.images[i % n])
                except InferenceRejected:
                    rejected += 1
                    await asyncio.sleep(0.001)  # a full queue: let the instances drain it
                    continue
                t1 = time.perf_counter()
                # An answer inside the window counts, even if it was asked during the warm-up.
                if window_start <= t1 <= window_end:
                    latencies.append(t1 - t0)
                i += self.concurrency

        async def batches_at_window_start() -> tuple[int, int]:
            await asyncio.sleep(self.warmup_seconds)
            return model.stats.batches, model.stats.batched_requests

        callers = asyncio.gather(*(caller(k) for k in range(self.concurrency)))
        (b0, r0), _ = await asyncio.gather(batches_at_window_start(), callers)
        stats = model.stats
        result.requests = len(latencies)
        result.rejected = rejected
        result.throughput = len(latencies) / self.trial_seconds
        if latencies:
            ms = np.asarray(latencies) * 1000.0
            result.p50_ms = float(np.percentile(ms, 50))
            result.p99_ms = float(np.percentile(ms, 99))
        if stats.batches > b0:
            result.mean_batch = (stats.batched_requests - r0) / (stats.batches - b0)


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


async def tune(
    root: Path,
    name: str,
    *,
    concurrency: int = 8,
    budget_s: float = 120.0,
    trial_seconds: float = 2.0,
    latency_budget_ms: float | None = None,
    on_result: Callable[[int, TrialResult], None] | None = None,
) -> TuneReport:
    """Search ``name``'s configuration in the repository at ``root``; nothing is written."""
    source = read_source(root, name)
    start = TrialPoint.from_config(source.config)
    space = SearchSpace.for_model(source.config, concurrency=concurrency)
    runner = TrialRunner(
        source,
        concurrency=concurrency,
        trial_seconds=trial_seconds,
        warmup_seconds=min(0.5, trial_seconds / 4),
    )
    log = await coordinate_descent(
        start,
        space,
        runner,
        budget_s=budget_s,
        latency_budget_ms=latency_budget_ms,
        on_result=on_result,
    )
    return TuneReport(
        name, source.file, start, space, log, latency_budget_ms, pick(log.results, latency_budget_ms)
    )


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
    opts = config.backend_options
    if point.backend == "openvino":
        if point.precision != opts.precision:
            set_key(
                _section(doc, "backend_options"),
                "precision",
                point.precision,
                changes,
                "backend_options.precision",
            )
        if point.threads != opts.threads:
            set_key(
                _section(doc, "backend_options"), "threads", point.threads, changes, "backend_options.threads"
            )
    elif point.threads != opts.intra_op_threads:
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
