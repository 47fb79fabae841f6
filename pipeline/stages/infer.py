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
        min_size: 8                # skip objects smaller than 8 px
        max_objects: 16            # at most 16 crops per frame, best scores first
      - name: read                 # a recogniser on the same crops
        type: infer
        model: ppocr_rec
        on: text
        upright_by: orientation    # turn crops the classifier says are upside down

Every request goes to the model's dynamic batcher, so crops from all streams
are batched together. Classifier results attach to the parent object as
``attributes``, recogniser results as ``text``; a detector run on crops adds
new objects in frame coordinates.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np

from inference.batcher import SHUTDOWN, InferenceRejected
from inference.model import Model
from inference.results import Classification, Detection, Recognition
from pipeline.frames import Attribute, DetectedObject, Frame
from pipeline.stages.base import Stage

log = logging.getLogger("vidpipe.infer")


class InferStage(Stage):
    """Runs ``model`` through its batcher on frames or on an earlier stage's objects."""

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
        repo, name = self.context.models, self.config.model
        # load_config requires `model` on infer stages; the runtime loads the repository.
        assert repo is not None and name is not None
        return repo.get(name)

    async def process(self, frame: Frame) -> None:
        kwargs = self._request_options()
        if self.config.on is None:
            result = await self._infer(frame.image, kwargs)
            self._attach_detections(frame, result, offset=(0.0, 0.0))
            return
        parents = self._select_parents(frame)
        if not parents:
            return
        crops = [self._crop(frame, obj) for obj in parents]
        results = await asyncio.gather(
            *(self._infer(crop, kwargs) for crop, _ in crops), return_exceptions=True
        )
        for obj, (_, offset), result in zip(parents, crops, results, strict=True):
            if isinstance(result, BaseException):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                # One rejected crop loses its attribute, not the frame; the batcher counted it.
                log.debug("stage %s: object %d of %s: %s", self.name, obj.id, frame.source, result)
                continue
            self._attach(frame, obj, result, offset)

    def _request_options(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if self.config.priority is not None:
            kwargs["priority"] = self.config.priority
        if self.config.timeout_ms is not None:
            kwargs["timeout_us"] = int(self.config.timeout_ms * 1000)
        return kwargs

    def _select_parents(self, frame: Frame) -> list[DetectedObject]:
        cfg = self.config
        chosen = []
        for obj in frame.objects:
            if obj.stage != cfg.on:
                continue
            if cfg.classes and obj.label not in cfg.classes:
                continue
            x1, y1, x2, y2 = obj.bbox
            if min(x2 - x1, y2 - y1) < cfg.min_size:
                continue
            chosen.append(obj)
        chosen.sort(key=lambda o: -o.score)
        return chosen[: cfg.max_objects]

    def _rotation(self, obj: DetectedObject) -> int:
        """Degrees to turn the crop, from the ``upright_by`` stage's label ('0', '90', '180', ...)."""
        if self.config.upright_by is None:
            return 0
        model = self.context.config.stage(self.config.upright_by).model
        for attr in obj.attributes:
            if attr.model == model:
                try:
                    return int(float(attr.label)) % 360
                except ValueError:
                    return 0
        return 0

    def _crop(self, frame: Frame, obj: DetectedObject) -> tuple[np.ndarray, tuple[float, float]]:
        """The crop for ``obj`` (cached on the object so later stages reuse it) and its offset."""
        from inference.processing.crop import crop_box, crop_upright

        rotation = self._rotation(obj)
        use_polygon = self.config.crop == "polygon" and obj.polygon is not None
        kind = "polygon" if use_polygon else "box"
        key = (kind, rotation)
        crop = obj.crops.get(key)
        if crop is None:
            base = obj.crops.get((kind, 0))
            if base is None:
                if use_polygon:
                    assert obj.polygon is not None
                    base = crop_upright(frame.image, np.asarray(obj.polygon, dtype=np.float32))
                else:
                    base = crop_box(frame.image, obj.bbox)
                obj.crops[(kind, 0)] = base
            crop = base if rotation == 0 else _rotate(base, rotation)
            obj.crops[key] = crop
        offset = (0.0, 0.0) if use_polygon else (float(int(obj.bbox[0])), float(int(obj.bbox[1])))
        return crop, offset

    def _attach(self, frame: Frame, obj: DetectedObject, result: Any, offset: tuple[float, float]) -> None:
        model = self.config.model or ""
        if isinstance(result, Classification):
            obj.attributes.append(Attribute(model=model, label=result.label, score=result.score))
        elif isinstance(result, Recognition):
            obj.text = result.text
            obj.text_score = result.score
        elif isinstance(result, list):
            self._attach_detections(frame, result, offset)

    def _attach_detections(self, frame: Frame, result: Any, offset: tuple[float, float]) -> None:
        if not isinstance(result, list):
            raise TypeError(
                f"stage {self.name}: model {self.config.model} returns {type(result).__name__}, "
                "not detections; use it with 'on:' to run it on objects"
            )
        dx, dy = offset
        # On whole frames `classes`/`confidence` filter what the detector found; in a
        # cascade they choose the parents to crop (see _select_parents), not the children.
        whole_frame = self.config.on is None
        for det in result:
            assert isinstance(det, Detection)
            if whole_frame and self.config.classes and det.label not in self.config.classes:
                continue
            if whole_frame and self.config.confidence is not None and det.score < self.config.confidence:
                continue
            x1, y1, x2, y2 = det.box
            polygon = [(x + dx, y + dy) for x, y in det.polygon] if det.polygon else None
            frame.objects.append(
                DetectedObject(
                    id=frame.next_object_id(),
                    label=det.label,
                    class_id=det.class_id,
                    score=det.score,
                    bbox=(x1 + dx, y1 + dy, x2 + dx, y2 + dy),
                    stage=self.name,
                    polygon=polygon,
                )
            )


def _rotate(image: np.ndarray, degrees: int) -> np.ndarray:
    """Turn an image by a multiple of 90 degrees (counter-clockwise), contiguous for the model."""
    quarter_turns = (degrees // 90) % 4
    return np.ascontiguousarray(np.rot90(image, k=quarter_turns))
