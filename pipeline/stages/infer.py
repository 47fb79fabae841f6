"""Inference stages: a model on whole frames, or on crops of an earlier stage's objects.

::

    stages:
      - name: text                 # a detector on the whole frame
        type: infer
        model: ppocr_det
      - name: orientation          # a classifier on each text line
        type: infer
        model: ppocr_cls
        on: text                   # crops of the objects found by `text`
        classes: [text]            # only these labels
        confidence: 0.6            # only parents at least this sure
        min_size: 8                # skip objects smaller than 8 px
        max_objects: 16            # at most 16 crops per frame, best scores first
      - name: read                 # a recogniser on the same crops
        type: infer
        model: ppocr_rec
        on: text
        upright_by: orientation    # turn crops the classifier says are upside down

Tracking lets both kinds run less often (``type: track`` between them)::

      - {name: people, type: infer, model: yolo, interval: 2}   # detect on 1 frame in 3
      - {name: track, type: track}                               # predicts the other 2
      - name: colour
        type: infer
        model: colour_cls
        on: people
        reinfer_interval: 5        # per track: on a new track, a box that moved, or every 5th frame
        reinfer_iou: 0.5           # "moved": overlap with the box at the last run below this

Every request goes to the model's dynamic batcher, so crops from all streams
are batched together. Classifier results attach to the parent object as
``attributes``, recogniser results as ``text``; a detector run on crops adds
new objects in frame coordinates (mapped back through each crop's warp and
turn). Cutting crops (copies, warps, turns) runs on a worker thread, not on
the event loop. Objects a cascade does not run its model on, or gets no answer
for, are counted in ``vidpipe_objects_skipped_total{reason}``.

``interval: N`` follows DeepStream's ``interval``: the detector runs on frames
whose index is a multiple of N+1 and skips the N between, marking the frame
(``Frame.skipped``) so the track stage publishes its predicted boxes. The
decision depends on the index alone, so frames of one source in flight
together decide the same way whatever order they finish in.

``interval: auto`` runs the detector only when the scene needs it (motion no
track explains, a track near a line or zone, fast or uncertain, a new object,
a maximum gap; :mod:`pipeline.auto_interval`), deciding on the tracks as the
track stage left them after the frame before, so a file gives the same
decisions on every run. Under overload, live cameras share the detector evenly.

``reinfer_interval: N`` (a cascade after a track stage, so it runs in frame
order) keeps each track's last result: between runs the object gets the
track's attributes (``carried``) and text (``text_carried``) instead of a new
request. Only classifier and recogniser results are carried; a detector on
crops runs every frame.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from inference.batcher import SHUTDOWN, InferenceRejected
from inference.results import Classification, Detection, Recognition
from inference.schema import spec
from pipeline.auto_interval import AutoSchedule, FairShare, Places
from pipeline.crops import Crop, cut_box, cut_polygon, map_box, map_points, rotate
from pipeline.frames import Attribute, DetectedObject, Frame
from pipeline.stages.base import Stage, StageContext, StageOptions
from pipeline.stages.zones import ZonesOptions
from pipeline.tracking.assignment import iou_matrix

if TYPE_CHECKING:
    from inference.model import Model

log = logging.getLogger("vidpipe.infer")

# Why an object of a cascade got no result (the `reason` of vidpipe_objects_skipped_total).
SKIP_REASONS = ("max_objects", "min_size", "rejected", "failed")
# interval: auto: how long a frame waits for the one before it to be tracked before deciding anyway.
PREVIOUS_TIMEOUT = 10.0


@dataclass(frozen=True)
class InferOptions(StageOptions):
    """``type: infer``: a model on whole frames, or with ``on:`` on crops of earlier objects."""

    # What problems() reads; and what the graph's checks read (references, order_problems, a
    # track stage's later_problems) and the models' (model_misfits, model_warnings in
    # pipeline.config) where a stand-in default would judge wrongly. A wrong interval or
    # reinfer_interval stands in as 0, which asks nothing of the graph (it can only hide an
    # order problem, never make one up); priority stays, since timeout_ms is judged by its
    # level. A wrong confidence, min_size, max_objects, crop or reinfer_iou leaves the rest
    # checked, the stage's model and its files included.
    problem_keys = frozenset({"model", "on", "upright_by", "upright_score", "interval", "reinfer_interval"})
    graph_keys = frozenset({"model", "on", "classes", "upright_by", "priority", "timeout_ms"})

    model: str = field(default="", metadata=spec(help="a model name in the repository"))
    on: str | None = field(default=None, metadata=spec(help="an earlier stage whose objects to crop"))
    classes: list[str] = field(default_factory=list, metadata=spec(help="labels to keep / to crop"))
    confidence: float | None = field(
        default=None, metadata=spec(ge=0, le=1, help="keep detections / crop parents at least this sure")
    )
    min_size: int = field(default=2, metadata=spec(ge=1, help="never crop objects smaller than this (px)"))
    max_objects: int = field(default=32, metadata=spec(ge=1, le=1024))
    crop: Literal["box", "polygon"] = field(
        default="polygon", metadata=spec(help="polygon warps rotated text lines upright")
    )
    upright_by: str | None = field(
        default=None, metadata=spec(help="a stage whose label ('0'/'180') says how to rotate the crop")
    )
    # PP-OCR's own pipeline turns a line only when its classifier is this sure (cls_thresh):
    # below it, an upright line the classifier doubts would be read upside down.
    upright_score: float = field(
        default=0.9,
        metadata=spec(ge=0, le=1, help="turn a crop only when the upright_by stage is at least this sure"),
    )
    priority: int | None = field(default=None, metadata=spec(ge=1))
    timeout_ms: float | None = field(default=None, metadata=spec(gt=0))
    interval: int | Literal["auto"] = field(
        default=0,
        metadata=spec(
            ge=0,
            help="whole-frame detectors: run on one frame, skip this many; auto: when the scene needs it",
        ),
    )
    reinfer_interval: int = field(
        default=0, metadata=spec(ge=0, help="cascades after a track stage: re-run on a track every N frames")
    )
    reinfer_iou: float = field(
        default=0.5,
        metadata=spec(ge=0, le=1, help="re-run earlier when the box overlaps its last-run box less"),
    )

    def models(self) -> tuple[str, ...]:
        return (self.model,) if self.model else ()

    def references(self) -> dict[str, str]:
        refs = {"on": self.on, "upright_by": self.upright_by}
        return {key: ref for key, ref in refs.items() if ref is not None}

    def problems(self) -> list[tuple[str, str]]:
        out = []
        if not self.model:
            out.append(("type", "an infer stage needs 'model'"))
        if self.upright_by is not None and self.on is None:
            out.append(("upright_by", "upright_by only applies to a stage with 'on'"))
        if self.upright_score != 0.9 and self.upright_by is None:
            out.append(("upright_score", "upright_score only applies with upright_by"))
        if self.interval and self.on is not None:
            out.append(
                (
                    "interval",
                    "interval applies to a detector on whole frames; a cascade takes reinfer_interval",
                )
            )
        if self.reinfer_interval and self.on is None:
            out.append(("reinfer_interval", "reinfer_interval only applies to a stage with 'on'"))
        return out

    def order_problems(self, earlier: list[StageOptions]) -> list[tuple[str, str]]:
        out = []
        tracked = any(s.type == "track" for s in earlier)
        if self.reinfer_interval and not tracked:
            out.append(
                ("reinfer_interval", "reinfer_interval needs a track stage before this stage (move it above)")
            )
        elif self.interval and tracked:
            out.append(
                ("interval", "a detector with interval must come before the track stage that predicts for it")
            )
        by = next((s for s in earlier if s.name == self.upright_by), None)
        # The turn is read from the attributes a classifier added to the very object being
        # cropped: a stage on other objects (or on whole frames) never labels it, and every
        # crop would silently stay unturned. A stage that runs no model (track, zones) is
        # refused by the graph's reference check already.
        if by is not None and self.on is not None and by.models() and getattr(by, "on", None) != self.on:
            runs_on = getattr(by, "on", None)
            where = f"the objects of {runs_on!r}" if runs_on else "whole frames"
            out.append((
                "upright_by",
                f"stage {by.name!r} runs on {where}, not on the objects of {self.on!r} this stage crops: "
                f"upright_by needs a classifier stage with on: {self.on}",
            ))  # fmt: skip
        return out


class InferStage(Stage):
    """Runs ``model`` through its batcher on frames or on an earlier stage's objects."""

    kind = "infer"
    options_type = InferOptions
    finds_objects = True

    def __init__(self, options: StageOptions, context: StageContext) -> None:
        super().__init__(options, context)
        assert isinstance(options, InferOptions)  # the registry builds kinds from their own options
        self.opts = options
        # Sources already told that this stage leaves objects beyond max_objects out.
        self._warned_max_objects: set[str] = set()
        self._upright_model = self._upright_by_model()
        # reinfer_interval: per source, per track id, the last run's result.
        self._last_runs: dict[str, dict[int, _LastRun]] = {}
        self._auto = self._auto_schedule() if options.interval == "auto" else None
        self._share = FairShare()
        # interval: auto shares detections out under overload on live sources only: a file
        # waits for the graph instead of dropping frames, and its decisions never depend on timing.
        self._files = {s.source_id for s in context.config.sources if not s.live}

    def _auto_schedule(self) -> AutoSchedule:
        stages = self.context.config.stages
        later = stages[next(i for i, s in enumerate(stages) if s.name == self.name) + 1 :]
        # Without a track stage nobody records the frames: the stage marks its own.
        self._tracked = any(s.type == "track" for s in later)
        places = [
            Places.of([ln.points for ln in s.lines], [z.polygon for z in s.zones], s.anchor, s.normalized)
            for s in later
            if isinstance(s, ZonesOptions)
        ]
        return AutoSchedule(self.name, self.context.tracks, places)

    def detector_triggers(self) -> dict[str, dict[str, int]]:
        """``interval: auto``: per source, how often each reason held on a frame (several at once)."""
        if self._auto is None:
            return {}
        return {source: dict(counts) for source, counts in self._auto.triggered.items()}

    def _upright_by_model(self) -> str | None:
        if self.opts.upright_by is None:
            return None
        other = next(s for s in self.context.config.stages if s.name == self.opts.upright_by)
        return other.models()[0] if other.models() else None

    async def _infer(self, image: np.ndarray, kwargs: dict[str, Any]) -> Any:
        """One request through the model's batcher.

        The model is looked up per request, and a request that reached a copy being
        drained by a hot reload (rejected with ``shutdown``) goes once to the new copy.
        """
        try:
            return await self._model().infer(image, **kwargs)
        except InferenceRejected as exc:
            if exc.reason != SHUTDOWN:
                raise
            return await self._model().infer(image, **kwargs)

    def _model(self) -> Model:
        repo = self.context.models
        # The runtime loads every model an infer stage names before any frame flows.
        assert repo is not None
        return repo.for_request(self.opts.model)

    async def process(self, frame: Frame) -> None:
        kwargs = self._request_options()
        if self._auto is not None:
            await self._auto_process(frame, kwargs)
            return
        if self.opts.on is None:
            interval = self.opts.interval
            if isinstance(interval, int) and interval and frame.index % (interval + 1):
                frame.skipped.add(self.name)
                return
            result = await self._infer(frame.image, kwargs)
            self._attach_detections(frame, result, None)
            return
        parents = self._select_parents(frame)
        if self.opts.reinfer_interval:
            parents = self._carry_or_run(frame, parents)
        if not parents:
            return
        crops = await asyncio.to_thread(self._cut_all, frame, parents)
        chosen = [(obj, crop) for obj, crop in zip(parents, crops, strict=True) if crop is not None]
        if len(chosen) < len(parents):
            self._skipped(frame.source, "min_size", len(parents) - len(chosen))
        results = await asyncio.gather(
            *(self._infer(crop.image, kwargs) for _, crop in chosen), return_exceptions=True
        )
        for (obj, crop), result in zip(chosen, results, strict=True):
            if isinstance(result, BaseException):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                self._failed(frame, obj, result)
                continue
            self._attach(frame, obj, result, crop)
            if self.opts.reinfer_interval and obj.track_id is not None:
                self._remember(frame, obj, result)

    async def _auto_process(self, frame: Frame, kwargs: dict[str, Any]) -> None:
        """``interval: auto``: decide on the tracks up to the frame before, then detect or let them stand."""
        assert self._auto is not None
        board = self.context.tracks
        previous = board.enter(frame.source, self.name, frame.index)
        try:
            if previous is not None:
                await self._wait_previous(frame, previous)
            decision = self._auto.decide(frame, self._min_gap(frame))
            pipeline = self.context.config.pipeline
            label = decision.reason if decision.run else decision.reason or "predicted"
            self.context.metrics.detector_frames.labels(pipeline, frame.source, self.name, label).inc()
            if not decision.run:
                frame.skipped.add(self.name)
            else:
                result = await self._infer(frame.image, kwargs)
                self._attach_detections(frame, result, None)
        except BaseException:
            board.give_up(frame.source, self.name, frame.index)
            raise
        if not self._tracked:
            board.mark(frame, self.name)

    async def _wait_previous(self, frame: Frame, previous: asyncio.Future[None]) -> None:
        """Until the frame before is tracked; a frame dropped on its way there is given up on."""
        try:
            await asyncio.wait_for(asyncio.shield(previous), timeout=PREVIOUS_TIMEOUT)
        except TimeoutError:
            self.context.errors(
                f"{self.name}:auto:previous",
                f"stage {self.name}: the frame before {frame.index} of {frame.source} did not reach the "
                f"track stage in {PREVIOUS_TIMEOUT:.0f} s (dropped on its way?); deciding without it",
            )

    def _min_gap(self, frame: Frame) -> int:
        """The overload share: frames every live camera waits between detections (0: none)."""
        if frame.source in self._files:
            return 0
        changed = self._share.observe(time.time() - frame.capture_ts, time.monotonic())
        if changed is not None:
            pipeline = self.context.config.pipeline
            self.context.metrics.detector_min_gap.labels(pipeline, self.name).set(changed)
            if changed == 1 and self._share.rising:
                log.warning(
                    "stage %s: live frames arrive over %.1f s old: the detector falls behind; every "
                    "camera now waits at least %d frame(s) between detections, raised evenly before "
                    "frames are dropped (vidpipe_detector_min_gap)",
                    self.name, self._share.behind, changed,
                )  # fmt: skip
            elif changed == 0:
                log.info("stage %s: the detector keeps up again; no wait between detections", self.name)
        return self._share.min_gap

    def _carry_or_run(self, frame: Frame, parents: list[DetectedObject]) -> list[DetectedObject]:
        """The parents to run the model on; the others get their track's last result, flagged carried."""
        runs = self._last_runs.setdefault(frame.source, {})
        to_run = []
        for obj in parents:
            last = runs.get(obj.track_id) if obj.track_id is not None else None
            if (
                last is None
                or frame.index - last.frame >= self.opts.reinfer_interval
                or _iou(last.box, obj.bbox) < self.opts.reinfer_iou
            ):
                to_run.append(obj)
                continue
            last.seen = frame.index
            obj.attributes.extend(
                Attribute(model=a.model, label=a.label, score=a.score, carried=True) for a in last.attributes
            )
            if last.text is not None:
                obj.text, obj.text_score, obj.text_carried = last.text, last.text_score, True
        # Tracks not seen for a long while are gone: their results go too.
        horizon = frame.index - 10 * self.opts.reinfer_interval - 100
        for track_id in [t for t, last in runs.items() if last.seen < horizon]:
            del runs[track_id]
        return to_run

    def _remember(self, frame: Frame, obj: DetectedObject, result: Any) -> None:
        assert obj.track_id is not None
        if isinstance(result, Classification):
            attrs = [Attribute(model=self.opts.model, label=result.label, score=result.score)]
            last = _LastRun(frame.index, obj.bbox, frame.index, attributes=attrs)
        elif isinstance(result, Recognition):
            last = _LastRun(frame.index, obj.bbox, frame.index, text=result.text, text_score=result.score)
        else:
            return  # detections on crops are not carried
        self._last_runs.setdefault(frame.source, {})[obj.track_id] = last

    def _request_options(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if self.opts.priority is not None:
            kwargs["priority"] = self.opts.priority
        if self.opts.timeout_ms is not None:
            kwargs["timeout_us"] = int(self.opts.timeout_ms * 1000)
        return kwargs

    def _select_parents(self, frame: Frame) -> list[DetectedObject]:
        """The objects of ``on`` to crop: chosen by label, confidence and size, best first."""
        opts = self.opts
        chosen = []
        too_small = 0
        for obj in frame.objects:
            if obj.stage != opts.on:
                continue
            if opts.classes and obj.label not in opts.classes:
                continue
            if opts.confidence is not None and obj.score < opts.confidence:
                continue
            # The size that is left once the box is clipped to the frame, as the crop will be.
            x1, y1, x2, y2 = obj.bbox
            w = min(x2, frame.width) - max(x1, 0)
            h = min(y2, frame.height) - max(y1, 0)
            if min(w, h) < opts.min_size:
                too_small += 1
                continue
            chosen.append(obj)
        if too_small:
            self._skipped(frame.source, "min_size", too_small)
        chosen.sort(key=lambda o: -o.score)
        left_out = len(chosen) - opts.max_objects
        if left_out > 0:
            self._skipped(frame.source, "max_objects", left_out)
            if frame.source not in self._warned_max_objects:
                self._warned_max_objects.add(frame.source)
                log.warning(
                    "stage %s: frame %d of %s has %d objects to crop, max_objects is %d; the "
                    "lowest-scored get no result (counted in vidpipe_objects_skipped_total, "
                    "said once per source)",
                    self.name, frame.index, frame.source, len(chosen), opts.max_objects,
                )  # fmt: skip
        return chosen[: opts.max_objects]

    def _skipped(self, source: str, reason: str, count: int = 1) -> None:
        pipeline = self.context.config.pipeline
        self.context.metrics.objects_skipped.labels(pipeline, source, self.name, reason).inc(count)

    def _failed(self, frame: Frame, obj: DetectedObject, exc: BaseException) -> None:
        """One object loses this stage's result, not the frame; counted and logged like a frame error."""
        reason = "rejected" if isinstance(exc, InferenceRejected) else "failed"
        self._skipped(frame.source, reason)
        self.context.errors(
            f"{self.name}:object:{type(exc).__name__}",
            f"stage {self.name} failed on object {obj.id} of frame {frame.index} of {frame.source}: "
            f"{type(exc).__name__}: {exc}; object left without a result",
        )

    def _cut_all(self, frame: Frame, parents: list[DetectedObject]) -> list[Crop | None]:
        """Every parent's crop, or None where it is smaller than ``min_size`` (on a worker thread)."""
        out: list[Crop | None] = []
        for obj in parents:
            crop = self._crop(frame, obj)
            out.append(crop if crop.min_side >= self.opts.min_size else None)
        return out

    def _rotation(self, obj: DetectedObject) -> int:
        """Degrees to turn the crop, from the ``upright_by`` stage's label ('0', '90', '180', ...)."""
        if self._upright_model is None:
            return 0
        for attr in obj.attributes:
            if attr.model == self._upright_model:
                if attr.score < self.opts.upright_score:
                    return 0  # not sure enough to turn it: as it stands is the better bet
                try:
                    return int(float(attr.label)) % 360
                except ValueError:
                    return 0
        return 0

    def _crop(self, frame: Frame, obj: DetectedObject) -> Crop:
        """The crop for ``obj``, cached on the object so later cascade stages reuse it."""
        rotation = self._rotation(obj)
        use_polygon = self.opts.crop == "polygon" and obj.polygon is not None
        kind = "polygon" if use_polygon else "box"
        crop = obj.crops.get((kind, rotation))
        if crop is None:
            base = obj.crops.get((kind, 0))
            if base is None:
                if use_polygon:
                    assert obj.polygon is not None
                    base = cut_polygon(frame.image, obj.polygon)
                else:
                    base = cut_box(frame.image, obj.bbox)
                obj.crops[(kind, 0)] = base
            crop = base if rotation == 0 else rotate(base, rotation)
            obj.crops[(kind, rotation)] = crop
        return crop

    def _attach(self, frame: Frame, obj: DetectedObject, result: Any, crop: Crop) -> None:
        if isinstance(result, Classification):
            obj.attributes.append(Attribute(model=self.opts.model, label=result.label, score=result.score))
        elif isinstance(result, Recognition):
            obj.text = result.text
            obj.text_score = result.score
        elif isinstance(result, list):
            self._attach_detections(frame, result, crop.to_source)

    def _attach_detections(self, frame: Frame, result: Any, to_source: np.ndarray | None) -> None:
        """Detections as new objects; ``to_source`` maps crop to frame pixels (None: whole frame)."""
        if not isinstance(result, list):
            raise TypeError(
                f"stage {self.name}: model {self.opts.model} returns {type(result).__name__}, "
                "not detections; use it with 'on:' to run it on objects"
            )
        # On whole frames `classes`/`confidence` filter what the detector found; in a
        # cascade they choose the parents to crop (see _select_parents), not the children.
        whole_frame = to_source is None
        for det in result:
            assert isinstance(det, Detection)
            if whole_frame and self.opts.classes and det.label not in self.opts.classes:
                continue
            if whole_frame and self.opts.confidence is not None and det.score < self.opts.confidence:
                continue
            bbox = tuple(float(v) for v in det.box)
            polygon = [(float(x), float(y)) for x, y in det.polygon] if det.polygon else None
            if to_source is not None:
                bbox = map_box(to_source, bbox)
                polygon = map_points(to_source, polygon) if polygon else None
            x1, y1, x2, y2 = bbox
            frame.objects.append(
                DetectedObject(
                    id=frame.next_object_id(),
                    label=det.label,
                    class_id=det.class_id,
                    score=det.score,
                    bbox=(x1, y1, x2, y2),
                    stage=self.name,
                    polygon=polygon,
                )
            )

    def forget_source(self, source: str) -> None:
        self._warned_max_objects.discard(source)
        self._last_runs.pop(source, None)
        if self._auto is not None:
            self._auto.forget_source(source)
            self.context.tracks.forget_source(source)


@dataclass(slots=True)
class _LastRun:
    """A track's result from this stage's last run on it (reinfer_interval)."""

    frame: int
    box: tuple[float, float, float, float]
    seen: int
    attributes: list[Attribute] = field(default_factory=list)
    text: str | None = None
    text_score: float | None = None


def _iou(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> float:
    return float(iou_matrix(np.array([a]), np.array([b]))[0, 0])
