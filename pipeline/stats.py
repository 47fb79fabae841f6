"""A typed snapshot of a running pipeline: per source, per model, totals.

``GET /v1/stats``, the dashboard and ``/readyz`` read a :class:`PipelineReport`
(from ``Runtime.report()``) instead of the runtime's internals or the metrics
registry. Counts come from the counters objects ``/metrics`` reads too (a
:class:`~pipeline.counters.SourceCounters` per source, a
:class:`~inference.batcher.BatcherStats` per model), so the two always agree.
Latency figures come from a window of recent end-to-end latencies per source
(:class:`LatencyWindow`), the time its frames spent in each stage
(:class:`StageClock`) and each model's recent queue and compute times. A source
that cannot keep up carries an :class:`Overload` (what :mod:`pipeline.overload`
found in the last interval).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

import numpy as np

from inference.model import ModelState
from pipeline.sources.base import SourceState

WINDOW = 256  # recent samples behind each percentile


class LatencyWindow(Sequence[float]):
    """The latest ``size`` samples (seconds), oldest first, with percentiles.

    Written on the event loop only (a source's publisher task), so it needs no lock.
    """

    def __init__(self, size: int = WINDOW) -> None:
        self._values: collections.deque[float] = collections.deque(maxlen=size)

    def add(self, seconds: float) -> None:
        self._values.append(seconds)

    def percentiles_ms(self) -> Percentiles:
        return percentiles_ms(self._values)

    def __len__(self) -> int:
        return len(self._values)

    @overload
    def __getitem__(self, index: int) -> float: ...
    @overload
    def __getitem__(self, index: slice) -> list[float]: ...
    def __getitem__(self, index: int | slice) -> float | list[float]:
        return list(self._values)[index]

    def __iter__(self) -> Iterator[float]:
        return iter(list(self._values))


class StageClock:
    """Seconds one source's published frames spent in each stage, and how many frames: running sums.

    Touched on the event loop only (the publisher task), so it needs no lock; the
    overload monitor takes differences between two readings.
    """

    __slots__ = ("frames", "seconds")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.frames: dict[str, int] = {}

    def add(self, stage_times: dict[str, float]) -> None:
        for stage, seconds in stage_times.items():
            self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds
            self.frames[stage] = self.frames.get(stage, 0) + 1

    def totals(self) -> dict[str, tuple[float, int]]:
        """stage -> (seconds, frames) so far."""
        return {stage: (self.seconds[stage], self.frames[stage]) for stage in self.seconds}


@dataclass(slots=True, frozen=True)
class Percentiles:
    """p50 and p99 in milliseconds; None when nothing was measured yet."""

    p50: float | None = None
    p99: float | None = None


def percentiles_ms(seconds: Iterable[float]) -> Percentiles:
    """p50 and p99 of ``seconds``, in milliseconds rounded to 0.01."""
    values = np.fromiter(seconds, dtype=np.float64)
    if values.size == 0:
        return Percentiles()
    p50, p99 = np.percentile(values, [50, 99]) * 1000.0
    return Percentiles(round(float(p50), 2), round(float(p99), 2))


@dataclass(slots=True, frozen=True)
class Overload:
    """A source that cannot keep up: what it lost in the last interval, where the time went.

    ``bottleneck`` is the stage whose time per frame dominates; for an ``infer``
    stage ``model`` names its model and ``waiting`` says whether the time is spent
    queued for a busy instance (``queue``) or running the model (``compute``).
    ``hint`` is the knob to turn, in the config's own words.
    """

    source: str
    interval_s: float
    decoded: int  # frames decoded in the interval
    dropped: int  # of those, dropped because the graph was behind (queue_full, pool_empty)
    drop_rate: float  # dropped / decoded, 0-1
    bottleneck: str  # stage name; "" when no frame got through to tell
    stage_ms: float | None  # mean time per frame in that stage
    model: str | None
    waiting: str  # "queue", "compute" or "" (not an infer stage, or unknown)
    hint: str

    def message(self) -> str:
        """The log line (and the dashboard's text)."""
        where = "no frame got through to tell which stage is slowest"
        if self.bottleneck:
            where = f"bottleneck: stage {self.bottleneck}"
            if self.stage_ms is not None:
                where += f" ({self.stage_ms:.0f} ms per frame"
                if self.model:
                    busy = {"queue": "mostly queued for", "compute": "mostly computing in"}.get(self.waiting)
                    where += f", {busy} model {self.model}" if busy else f", model {self.model}"
                where += ")"
        return (
            f"source {self.source}: overloaded, {self.drop_rate:.0%} of frames dropped in the last "
            f"{self.interval_s:g}s ({self.dropped} of {self.decoded} decoded); {where}; {self.hint}"
        )


@dataclass(slots=True, frozen=True)
class SourceReport:
    """One source as ``GET /v1/sources`` and ``/v1/stats`` show it."""

    id: str
    url: str  # credentials redacted
    state: SourceState
    reason: str
    live: bool
    frames: int  # handed to the graph's queue (later queue_full drops included)
    decoded: int  # decoded by the source, including frames dropped before the queue
    published: int
    dropped: dict[str, int]  # by reason
    reconnects: int
    queue_depth: int
    latency_ms: Percentiles  # capture to publish, over the recent window
    stage_seconds: dict[str, tuple[float, int]] = field(default_factory=dict)  # StageClock.totals()
    overload: Overload | None = None  # set while the source cannot keep up
    # Messages published per second over about the last 5 s (SourceCounters.fps); None at first.
    fps: float | None = None
    # Frames a stage failed on since its last message (SourceCounters.failing).
    failing: int = 0


@dataclass(slots=True, frozen=True)
class ModelReport:
    """One model the stages use: its state and how its batches ran."""

    name: str
    state: ModelState
    reason: str
    batches: int
    requests: int  # requests that ran in a batch
    batch_sizes: dict[int, int]  # size -> batches of that size
    queue_ms: Percentiles  # time in the batcher, over the recent window
    compute_ms: Percentiles = Percentiles()  # time to run one batch, over the recent window

    @property
    def mean_batch_size(self) -> float | None:
        return round(self.requests / self.batches, 2) if self.batches else None


@dataclass(slots=True, frozen=True)
class PipelineReport:
    """Everything at one moment: sources, the models the stages need, and totals."""

    pipeline: str
    time: float  # unix seconds
    sources: list[SourceReport]
    models: list[ModelReport]  # only models that are loaded (or failed to load)
    models_needed: list[str]
    models_loaded: bool  # False until the repository is open
    nats_connected: bool
    published: int  # across every source, also removed ones


__all__ = [
    "LatencyWindow",
    "ModelReport",
    "Overload",
    "Percentiles",
    "PipelineReport",
    "SourceReport",
    "StageClock",
    "percentiles_ms",
]
