"""Overload said out loud: which source cannot keep up, how much it loses, and what to turn.

A live source whose graph is slower than its camera drops frames by design
(drop-oldest queue); the metrics count every drop, but an operator reading the
log should not have to compute a rate to learn that three frames in four are
lost. Every ``interval`` seconds :class:`OverloadMonitor` compares two
:class:`~pipeline.stats.PipelineReport` readings, and for each source that lost
more than ``threshold`` of its decoded frames because the graph was behind
(``queue_full``, ``pool_empty``; ``max_fps`` is intended and ``shutdown`` is a
stop) it logs one WARNING::

    source cam1: overloaded, 76% of frames dropped in the last 10s (76 of 100 decoded);
    bottleneck: stage detect (410 ms per frame, mostly computing in model yolov8n);
    try interval: 4 on stage detect (run it on one frame in 5), a smaller input size ...

The same :class:`~pipeline.stats.Overload` is on the source's report until an
interval without overload clears it (``GET /v1/stats``, the dashboard).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

from pipeline.stats import ModelReport, Overload, PipelineReport, SourceReport

log = logging.getLogger("vidpipe.overload")

# Drops that mean the graph is behind. max_fps is the operator's cap doing its job and
# shutdown happens on every stop; neither is overload.
BEHIND_REASONS = ("queue_full", "pool_empty")


@dataclass(frozen=True, slots=True)
class _Reading:
    decoded: int
    dropped: int
    stages: dict[str, tuple[float, int]]


class OverloadMonitor:
    """Finds overloaded sources in successive reports; logs each one once per ``interval``.

    ``models`` maps an infer stage's name to its model (the stages' ``models()``),
    so the warning can name the model and the knob that belongs to it; ``intervals``
    a whole-frame detector's name to its ``interval`` (a number, or ``"auto"``), so the
    knob suggested is one the stage does not have already.
    """

    def __init__(
        self,
        models: Mapping[str, str],
        *,
        intervals: Mapping[str, int | str] | None = None,
        interval: float = 10.0,
        threshold: float = 0.1,
        logger: logging.Logger = log,
    ) -> None:
        self.models = dict(models)
        # None: not told, every stage taken for a whole-frame detector without an interval.
        self.intervals = dict(intervals) if intervals is not None else None
        self.interval = interval
        self.threshold = threshold
        self.logger = logger
        self._previous: dict[str, _Reading] = {}
        self._current: dict[str, Overload] = {}

    def current(self, source: str) -> Overload | None:
        """The source's overload as of the last check; None when it kept up."""
        return self._current.get(source)

    def check(self, report: PipelineReport) -> list[Overload]:
        """Compare ``report`` with the previous one; log and return the overloaded sources."""
        models = {m.name: m for m in report.models}
        found: list[Overload] = []
        seen: set[str] = set()
        for src in report.sources:
            seen.add(src.id)
            now = _Reading(src.decoded, sum(src.dropped.get(r, 0) for r in BEHIND_REASONS), src.stage_seconds)
            before = self._previous.get(src.id)
            self._previous[src.id] = now
            if before is None or now.decoded < before.decoded:
                # First look, or a new run of the source with the same id: its counts start
                # at zero, so the first interval is judged too (an overload said 10 s in, not 20).
                before = _Reading(0, 0, {})
            overload = self._assess(src, before, now, models)
            if overload is None:
                self._current.pop(src.id, None)
                continue
            self._current[src.id] = overload
            found.append(overload)
            self.logger.warning("%s", overload.message())
        for gone in set(self._previous) - seen:
            self._previous.pop(gone, None)
            self._current.pop(gone, None)
        return found

    def _assess(
        self, src: SourceReport, before: _Reading, now: _Reading, models: Mapping[str, ModelReport]
    ) -> Overload | None:
        decoded = now.decoded - before.decoded
        dropped = now.dropped - before.dropped
        if decoded <= 0 or dropped <= 0 or dropped / decoded < self.threshold:
            return None
        rate = dropped / decoded
        # Mean time per frame of each stage over the interval; the largest is the bottleneck.
        per_frame: dict[str, float] = {}
        for stage, (seconds, frames) in now.stages.items():
            s0, f0 = before.stages.get(stage, (0.0, 0))
            if frames > f0:
                per_frame[stage] = (seconds - s0) / (frames - f0)
        bottleneck = max(per_frame, key=lambda s: per_frame[s]) if per_frame else ""
        model = self.models.get(bottleneck)
        waiting = ""
        report = models.get(model) if model else None
        if report is not None and report.queue_ms.p50 is not None and report.compute_ms.p50 is not None:
            waiting = "queue" if report.queue_ms.p50 > report.compute_ms.p50 else "compute"
        # The stage keeps up with what is decoded now when it runs on 1 / (1 - rate) times
        # fewer frames than it does: `interval` is the frames skipped between two runs.
        current = self.intervals.get(bottleneck) if self.intervals is not None else 0
        now_every = current + 1 if isinstance(current, int) else 1
        skip = max(now_every, math.ceil(now_every / max(1e-6, 1 - rate)) - 1)
        return Overload(
            source=src.id,
            interval_s=self.interval,
            decoded=decoded,
            dropped=dropped,
            drop_rate=round(rate, 4),
            bottleneck=bottleneck,
            stage_ms=round(per_frame[bottleneck] * 1000, 1) if bottleneck else None,
            model=model,
            waiting=waiting,
            hint=_hint(bottleneck, model, waiting, skip, current),
        )


def _hint(stage: str, model: str | None, waiting: str, skip: int, current: int | str | None = 0) -> str:
    """The knob to turn, in the config's words (docs/operations.md, "Overload").

    ``current``: the stage's own ``interval`` (None for a cascade, which has none).
    """
    if not stage:
        return "lower the source's max_fps or give the graph more CPU"
    if model is None:
        return f"stage {stage} is the slowest; lower the source's max_fps or make the stage cheaper"
    if current is None:  # a cascade: it runs on each object, and skipping frames is its tracker's
        interval = f"reinfer_interval or a lower max_objects on stage {stage}"
    elif current == "auto":  # it runs only when the scene needs it already
        interval = "a lower max_fps on the source (interval: auto already skips what it can)"
    else:
        was = f", was {current}" if current else ""
        interval = f"interval: {skip} on stage {stage} (run it on one frame in {skip + 1}{was})"
    instances = f"more instances of {model} (instance_group: [{{count: N}}] in its config.yaml)"
    smaller = f"a smaller input size for {model} (export it at e.g. 320x320)"
    if waiting == "queue":
        return f"try {instances} where cores are free, {interval}, or {smaller}"
    return f"try {interval}, {smaller}, or {instances} where cores are free"


__all__ = ["BEHIND_REASONS", "OverloadMonitor"]
