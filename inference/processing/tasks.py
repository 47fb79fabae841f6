"""Concrete :class:`~inference.processing.base.Task` implementations and the factory that picks one.

``task.kind`` in a model config selects the class, and with it the options the
rest of ``task:`` may hold (the class's ``options_type``; a key another kind
takes is a ``FILE:LINE`` error that names that kind)::

    task: {kind: yolo, confidence: 0.3, iou: 0.5}     # YoloOptions

================  ======================  =================================
kind              class                   result per image
================  ======================  =================================
yolo              :class:`YoloTask`       ``list[Detection]``
classify          :class:`ClassifyTask`   ``Classification``
text_detect       :class:`TextDetectTask` ``list[Detection]`` (label "text")
text_recognize    :class:`TextRecognizeTask` ``Recognition``
================  ======================  =================================

Every task preprocesses with the :class:`~inference.processing.base.Preprocessor`
it is built with (the model picks it by where its backend reads the batch:
:class:`~inference.processing.resize.ImagePreprocessor` for host float tensors)
and returns that image's
:class:`~inference.processing.resize.ResizeMeta` as its meta. A model with
several outputs is read through its first output.

A task trusts its input spec: the backend checked it against ``input.*`` while
loading. Problems a task finds itself (a dictionary missing from the model's
metadata, outputs that do not fit ``task.kind``) are
:class:`~inference.config.ModelConfigError` at the key to change.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from inference.backends.base import TensorSpec
from inference.config import (
    TASK_OPTIONS,
    ClassifyOptions,
    ModelConfig,
    ModelConfigError,
    TextDetectOptions,
    TextRecognizeOptions,
    YoloOptions,
)
from inference.introspect import metadata_labels
from inference.kinds import ClassKinds
from inference.processing.base import Preprocessor, Task
from inference.processing.classify import classify
from inference.processing.ctc import CTCDecoder, parse_dictionary
from inference.processing.db import DBParams, db_boxes
from inference.processing.yolo import decode_yolo, resolve_layout
from inference.results import Detection, NonFiniteOutput, Recognition, Result

__all__ = [
    "TASKS",
    "ClassifyTask",
    "TextDetectTask",
    "TextRecognizeTask",
    "YoloTask",
    "create_task",
    "register_task",
]


class _ImageTask(Task):
    """Shared preprocessing and output access."""

    def preprocess(self, images: Sequence[np.ndarray], out: np.ndarray) -> list[Any]:
        return list(self.preprocessor(images, out))

    def check_outputs(self, outputs: Sequence[TensorSpec]) -> None:
        """The output read (the first) must take every batch size up to ``max_batch_size``.

        A fixed batch axis (``[1, 3]``) would load and then fail every batch of more
        than one: refused here, like a fixed batch axis on the input.
        """
        limit = self.config.max_batch_size
        if not outputs or limit <= 1 or not outputs[0].shape:
            return
        spec = outputs[0]
        batch = spec.shape[0]
        if batch is None or batch < 0:
            return
        fix = "set max_batch_size: 1 or " if batch == 1 else ""
        raise self.config.error(
            "max_batch_size",
            f"{_file_name(self.config)}: output tensor {spec.name!r} has a fixed batch size of {batch} "
            f"(shape {_shown(spec.shape)}), but max_batch_size is {limit} and batches vary in size; "
            f"{fix}export the model with a dynamic batch axis",
        )

    def _output(self, outputs: Mapping[str, np.ndarray], ndim: int, n: int) -> np.ndarray:
        """The first output; it must have ``ndim`` dims and hold at least ``n`` items."""
        if not outputs:
            raise self.config.error("task.kind", "the model returned no outputs")
        arr = np.asarray(next(iter(outputs.values())))
        if self.config.max_batch_size == 0 and arr.ndim == ndim - 1:
            arr = arr[None]  # a model without a batch dimension runs one image at a time
        if arr.ndim != ndim or arr.shape[0] < n:
            raise self.config.error(
                "task.kind",
                f"output of shape {list(arr.shape)} does not fit {self.config.task.kind} "
                f"(expected {ndim} dims with a batch of {n})",
            )
        return arr


def _shown(shape: Sequence[int | None]) -> str:
    """A shape as a list, dynamic dimensions as ``?``."""
    return "[" + ", ".join("?" if d is None or d < 0 else str(d) for d in shape) + "]"


def _file_name(config: ModelConfig) -> str:
    """The model file's name, as the input checks start their messages; a remote model's name."""
    if config.model_file is None:
        return f"the server's model {config.name!r}"
    return Path(config.model_file.path).name


class YoloTask(_ImageTask):
    """YOLOv5/v8/v11 detectors: letterboxed input, decoded and NMS-filtered boxes in source pixels."""

    kind = "yolo"
    options_type = YoloOptions
    finds_objects = True

    def __init__(
        self,
        config: ModelConfig,
        input_spec: TensorSpec,
        metadata: Mapping[str, str],
        labels: Sequence[str],
        *,
        preprocessor: Preprocessor | None = None,
    ) -> None:
        super().__init__(
            config, input_spec, metadata, labels or metadata_labels(metadata), preprocessor=preprocessor
        )
        self.options = config.task_as(YoloOptions)
        self._layouts: dict[tuple[int, ...], str] = {}

    def check_outputs(self, outputs: Sequence[TensorSpec]) -> None:
        if not outputs:
            raise self.config.error("task.kind", "the model has no outputs")
        super().check_outputs(outputs)
        shape = outputs[0].shape
        if self.config.max_batch_size == 0 and len(shape) == 2:
            shape = (1, *shape)  # no batch dimension: one image at a time
        if len(shape) != 3:
            shown = f"output {outputs[0].name!r} of shape {_shown(shape)}"
            raise self.config.error("task.kind", f"{shown} is not a YOLO output [N, D1, D2]")
        _, d1, d2 = shape
        if d1 is None or d2 is None or d1 < 0 or d2 < 0:
            return  # decided by the first batch
        classes = len(self.labels) or None
        try:
            resolve_layout((1, d1, d2), self.options.layout, classes)
        except ValueError as exc:
            hint = ""
            other = {"yolov8": "yolov5", "yolov5": "yolov8"}.get(self.options.layout)
            with contextlib.suppress(ValueError):
                if other is not None and resolve_layout((1, d1, d2), other, classes):
                    hint = f"the output fits {other}: set task.layout: {other}"
            # The layout reads the output, only with another class count: the labels are what
            # is wrong (unless the other layout fits them, or it is an end-to-end export).
            wrong_count = None if hint else self._labels_misfit(outputs[0], d1, d2)
            if wrong_count is not None:
                raise wrong_count from None
            raise self.config.error("task.layout", str(exc), hint) from None

    def _labels_misfit(self, spec: TensorSpec, d1: int, d2: int) -> ModelConfigError | None:
        """The error at ``labels`` (or ``labels_file``) when the configured layout reads the
        output ``[N, d1, d2]`` with another class count than the labels list; None when the
        layout does not read it at all, or it is an end-to-end export ([N, K, 6])."""
        try:
            layout = resolve_layout((1, d1, d2), self.options.layout)
        except ValueError:
            return None
        held = d1 - 4 if layout == "yolov8" else d2 - 5
        n = len(self.labels)
        if held < 1 or (d2 == 6 and n > 1):
            return None
        shown = ", ".join(self.labels[:5]) + (", ..." if n > 5 else "")
        if self.config.labels_file:
            key, source = "labels_file", f"labels_file {self.config.labels_file} has {n}"
            hint = f"give the file one line per class, {held} in class order"
        elif self.config.labels:
            key, source = "labels", f"labels has {n}"
            hint = f"list one label per class, {held} in class order, or leave labels out for class numbers"
        else:
            # The names came from the file's metadata: labels: in config.yaml overrides them.
            key, source = "labels", f"the model file's names metadata has {n}"
            hint = f"set labels: [...] with one label per class, {held} in class order"
        return self.config.error(
            key,
            f"{_file_name(self.config)}: output {spec.name!r} (shape {_shown(spec.shape)}) read as "
            f"{layout} holds {held} class(es) but {source} ({shown})",
            hint,
        )

    def postprocess(self, outputs: Mapping[str, np.ndarray], metas: Sequence[Any]) -> list[Result]:
        out = self._output(outputs, 3, len(metas))
        key = tuple(out.shape[1:])
        layout = self._layouts.get(key)
        if layout is None:
            try:
                layout = resolve_layout(out.shape, self.options.layout, len(self.labels) or None)
            except ValueError as exc:
                raise self.config.error("task.layout", str(exc)) from None
            self._layouts[key] = layout
        t = self.options
        decoded = decode_yolo(
            out,
            metas,
            layout="yolov8" if layout == "yolov8" else "yolov5",
            confidence=t.confidence,
            iou=t.iou,
            max_detections=t.max_detections,
        )
        results: list[Result] = []
        for det in decoded:
            results.append(
                [
                    Detection(box=(b[0], b[1], b[2], b[3]), score=s, class_id=c, label=self._label(c))
                    for b, s, c in zip(
                        det.boxes.tolist(), det.scores.tolist(), det.class_ids.tolist(), strict=True
                    )
                ]
            )
        return results

    def _label(self, class_id: int) -> str:
        return self.labels[class_id] if class_id < len(self.labels) else str(class_id)


class ClassifyTask(_ImageTask):
    """Image classifiers: softmax if needed, top-k labelled classes."""

    kind = "classify"
    options_type = ClassifyOptions

    def check_outputs(self, outputs: Sequence[TensorSpec]) -> None:
        """A fixed class count must match the labels: a mismatch would publish wrong names."""
        if not outputs:
            raise self.config.error("task.kind", "the model has no outputs")
        super().check_outputs(outputs)
        spec = outputs[0]
        shape = tuple(spec.shape)
        item = shape if self.config.max_batch_size == 0 and len(shape) == 1 else shape[1:]
        if not self.labels or not item or any(d is None or d < 0 for d in item):
            return  # class numbers for names, or a class count only a batch tells
        classes = math.prod(d for d in item if d is not None)
        if classes == len(self.labels):
            return
        shown = ", ".join(self.labels[:5]) + (", ..." if len(self.labels) > 5 else "")
        if self.config.labels_file:
            key, source = "labels_file", f"labels_file {self.config.labels_file} has {len(self.labels)}"
            hint = f"give the file one line per class, {classes} in class order"
        else:
            key, source = "labels", f"labels has {len(self.labels)}"
            hint = (
                f"list one label per class, {classes} in class order, or leave labels out for class numbers"
            )
        raise self.config.error(
            key,
            f"{_file_name(self.config)}: output {spec.name!r} (shape {_shown(shape)}) has {classes} "
            f"classes but {source} ({shown})",
            hint,
        )

    def postprocess(
        self, outputs: Mapping[str, np.ndarray], metas: Sequence[Any]
    ) -> list[Result | Exception]:
        if not outputs:
            raise self.config.error("task.kind", "the model returned no outputs")
        out = np.asarray(next(iter(outputs.values())))
        if self.config.max_batch_size == 0 and out.ndim == 1:
            out = out[None]
        n = len(metas)
        if out.ndim < 2 or out.shape[0] < n:
            raise self.config.error("task.kind", f"output of shape {list(out.shape)} is not [N, classes]")
        rows = out[:n].reshape(n, -1)
        top_k = self.config.task_as(ClassifyOptions).top_k
        finite = np.isfinite(rows).all(axis=1)
        if finite.all():
            return list(classify(rows, self.labels, top_k))
        # A NaN row has no top class (argsort puts it anywhere) and no JSON score: that input
        # fails alone, its batch mates are classified as if it were not there.
        good = iter(classify(rows[finite], self.labels, top_k) if finite.any() else [])
        return [next(good) if ok else self._non_finite(row) for ok, row in zip(finite, rows, strict=True)]

    def _non_finite(self, row: np.ndarray) -> NonFiniteOutput:
        value = "NaN" if np.isnan(row).any() else "inf" if np.isposinf(row).any() else "-inf"
        return NonFiniteOutput(self.config.name, value)


class TextDetectTask(_ImageTask):
    """DB text detectors (PP-OCR det): rotated text-line quadrilaterals in source pixels.

    ``dilate`` (on by default, as the runtime that ships the PP-OCR models
    configures it) grows the thresholded map by a 2×2 dilation, which lets the
    boxes reach the outer edge of the glyphs.
    """

    kind = "text_detect"
    options_type = TextDetectOptions
    finds_objects = True

    def __init__(
        self,
        config: ModelConfig,
        input_spec: TensorSpec,
        metadata: Mapping[str, str],
        labels: Sequence[str],
        *,
        dilate: bool = True,
        preprocessor: Preprocessor | None = None,
    ) -> None:
        super().__init__(config, input_spec, metadata, labels, preprocessor=preprocessor)
        t = config.task_as(TextDetectOptions)
        self.params = DBParams(
            thresh=t.thresh,
            box_thresh=t.box_thresh,
            unclip_ratio=t.unclip_ratio,
            max_candidates=t.max_candidates,
            min_box_size=t.min_box_size,
            dilate=dilate,
        )
        self.label = self.labels[0] if self.labels else "text"

    def postprocess(self, outputs: Mapping[str, np.ndarray], metas: Sequence[Any]) -> list[Result]:
        out = self._output(outputs, 4, len(metas))
        _, h, w = self.item_shape
        if out.shape[1] != 1 or out.shape[2:] != (h, w):
            # The letterbox geometry is in input pixels, so the map must be at input resolution.
            raise self.config.error(
                "task.kind", f"expected a [N, 1, {h}, {w}] probability map, got {list(out.shape)}"
            )
        results: list[Result] = []
        for i, meta in enumerate(metas):
            dets = []
            for tb in db_boxes(out[i, 0], meta, self.params):
                c = tb.corners
                box = (float(c[:, 0].min()), float(c[:, 1].min()), float(c[:, 0].max()), float(c[:, 1].max()))
                polygon = [(float(x), float(y)) for x, y in c]
                dets.append(Detection(box=box, score=tb.score, class_id=0, label=self.label, polygon=polygon))
            results.append(dets)
        return results


class TextRecognizeTask(_ImageTask):
    """CTC text recognisers (PP-OCR rec); the dictionary comes from the model's metadata."""

    kind = "text_recognize"
    options_type = TextRecognizeOptions

    def __init__(
        self,
        config: ModelConfig,
        input_spec: TensorSpec,
        metadata: Mapping[str, str],
        labels: Sequence[str],
        *,
        preprocessor: Preprocessor | None = None,
    ) -> None:
        super().__init__(config, input_spec, metadata, labels, preprocessor=preprocessor)
        key = self.dictionary_key = config.task_as(TextRecognizeOptions).dictionary_key
        text = self.metadata.get(key)
        if not text:
            present = ", ".join(sorted(self.metadata)) or "none"
            raise config.error(
                "task.dictionary_key",
                f"the model's metadata has no {key!r} entry holding the recogniser's dictionary "
                f"(one character per line); keys present: {present}",
                "set task.dictionary_key to the key the model uses",
            )
        self.dictionary = parse_dictionary(text)
        self._decoder: CTCDecoder | None = None

    def postprocess(self, outputs: Mapping[str, np.ndarray], metas: Sequence[Any]) -> list[Result]:
        n = len(metas)
        out = self._output(outputs, 3, n)[:n]
        decoder = self._decoder
        if decoder is None or decoder.num_classes != out.shape[2]:
            try:
                decoder = CTCDecoder.from_dictionary(self.dictionary, out.shape[2])
            except ValueError as exc:
                raise self.config.error(
                    "task.dictionary_key", f"dictionary {self.dictionary_key!r}: {exc}"
                ) from None
            self._decoder = decoder
        return [Recognition(text, score) for text, score in decoder.decode(out)]


# task.kind -> the class that runs it, in step with TASK_OPTIONS (what the config loader
# reads).
TASKS: ClassKinds[type[Task]] = ClassKinds(TASK_OPTIONS)


def register_task(cls: type[Task]) -> type[Task]:
    """Make ``cls.kind`` a task kind, taking ``cls.options_type`` as the rest of ``task:``.

    Register before configs are read; a name taken by another class is an error.
    """
    return TASKS.add(cls)


for _cls in (YoloTask, ClassifyTask, TextDetectTask, TextRecognizeTask):
    register_task(_cls)


def finds_objects(kind: str) -> bool:
    """Whether models of task kind ``kind`` find objects in whole frames (unknown kinds: assumed so)."""
    cls = TASKS.get(kind)
    return cls is None or cls.finds_objects


def create_task(
    config: ModelConfig,
    input_spec: TensorSpec,
    metadata: Mapping[str, str],
    labels: Sequence[str],
    *,
    preprocessor: Preprocessor | None = None,
) -> Task:
    """The task for ``config.task.kind``, filling batches with ``preprocessor`` (host float by default).

    A setup it cannot serve is a :class:`~inference.config.ModelConfigError`.
    """
    cls = TASKS.get(config.task.kind)
    if cls is None:
        # A config built in code; one read from a file was checked against the names.
        problem, hint = TASKS.check(config.task.kind) or ("", "")
        raise config.error("task.kind", problem, hint)
    return cls(config, input_spec, metadata, labels, preprocessor=preprocessor)
