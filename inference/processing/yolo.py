"""Decoding of YOLO detector outputs into boxes in source-image pixels.

Two export layouts are understood:

``yolov8``
    Ultralytics YOLOv8/YOLO11: ``[N, 4 + C, A]`` — ``cx, cy, w, h`` followed by
    ``C`` class scores per anchor, no objectness.
``yolov5``
    ``[N, A, 5 + C]`` — ``cx, cy, w, h, objectness`` and ``C`` class scores;
    the score of a class is ``objectness × class score``.

``auto`` resolves the layout from the output shape ``[N, D1, D2]``:

1. with a known class count ``C`` (the model's labels): ``D1 == 4 + C`` means
   yolov8 and ``D2 == 5 + C`` means yolov5; if exactly one holds it wins;
2. otherwise anchors outnumber box channels in every real export, so
   ``D1 < D2`` is yolov8 and ``D1 > D2`` is yolov5;
3. ``D1 == D2`` cannot be decided and raises :class:`ValueError` asking for
   ``task.layout``.

Each anchor keeps its best class; a candidate needs a score strictly above
the confidence threshold. Boxes are in model-input pixels, are mapped back
through the letterbox to source pixels, clipped to the image, and boxes left
empty by clipping are dropped before class-aware NMS.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from inference.processing.nms import batched_nms
from inference.processing.resize import ResizeMeta

__all__ = ["YoloDetections", "decode_yolo", "resolve_layout"]

Layout = Literal["yolov8", "yolov5"]


@dataclass(slots=True)
class YoloDetections:
    """One image's detections: ``boxes`` ``(K, 4)`` in source pixels, best score first."""

    boxes: np.ndarray
    scores: np.ndarray
    class_ids: np.ndarray


def resolve_layout(
    shape: Sequence[int], layout: str = "auto", num_classes: int | None = None, *, check_classes: bool = True
) -> Layout:
    """The layout of an output of ``shape`` (``[N, D1, D2]``); see the module docstring.

    With ``num_classes`` the layout must hold that many classes (``check_classes``), or
    ValueError says so; without, any count goes.
    """
    if not check_classes:
        return _resolve(shape, layout, num_classes, None)
    return _resolve(shape, layout, num_classes, num_classes)


def _resolve(shape: Sequence[int], layout: str, num_classes: int | None, must_hold: int | None) -> Layout:
    if len(shape) != 3:
        raise ValueError(f"a YOLO output must be [N, D1, D2], got shape {list(shape)}")
    _, d1, d2 = shape
    if layout == "yolov8":
        if d1 < 5:
            raise ValueError(f"output {list(shape)} is not yolov8 [N, 4+C, A]: needs at least 5 channels")
        return _with_classes(shape, "yolov8", must_hold)
    if layout == "yolov5":
        if d2 < 6:
            raise ValueError(f"output {list(shape)} is not yolov5 [N, A, 5+C]: needs at least 6 channels")
        return _with_classes(shape, "yolov5", must_hold)
    if layout != "auto":
        raise ValueError(f"unknown YOLO layout {layout!r}; expected auto, yolov8 or yolov5")
    if num_classes:
        v8, v5 = d1 == 4 + num_classes, d2 == 5 + num_classes
        if v8 != v5:
            return "yolov8" if v8 else "yolov5"
    if d1 < d2:
        return _with_classes(shape, "yolov8", must_hold)
    if d1 > d2:
        return _with_classes(shape, "yolov5", must_hold)
    raise ValueError(
        f"cannot tell the YOLO layout of output shape {list(shape)}: both dimensions are {d1}; "
        "set task.layout to yolov8 ([N, 4+C, A]) or yolov5 ([N, A, 5+C])"
    )


def _with_classes(shape: Sequence[int], layout: Layout, num_classes: int | None) -> Layout:
    """``layout``, once the class count it reads from ``shape`` is the labels' count.

    Decoded with another count, every score is read from the wrong channel: boxes and
    labels come out as garbage (an end-to-end export, [N, K, 6] after its own NMS, read
    as yolov5 gave "person" at score 1.28).
    """
    _, d1, d2 = shape
    held = d1 - 4 if layout == "yolov8" else d2 - 5
    if not num_classes or held == num_classes:
        return layout
    if d2 == 6 and num_classes > 1:
        raise ValueError(
            f"output {list(shape)} looks like an end-to-end export ([N, K, 6]: a box, a score and a "
            "class per detection, after the model's own NMS), which vidpipe does not decode; export "
            "the raw head without NMS (ultralytics: nms=False; YOLOv10 has no such export)"
        )
    raise ValueError(
        f"output {list(shape)} read as {layout} holds {held} class(es), but labels has {num_classes}"
    )


def decode_yolo(
    output: np.ndarray,
    metas: Sequence[ResizeMeta],
    *,
    layout: Layout,
    confidence: float,
    iou: float,
    max_detections: int,
) -> list[YoloDetections]:
    """Decode a ``[N, ...]`` YOLO output batch; one :class:`YoloDetections` per meta."""
    n = len(metas)
    if output.ndim != 3 or output.shape[0] < n:
        raise ValueError(f"YOLO output of shape {list(output.shape)} does not hold a batch of {n}")
    out = output[:n]
    # Candidate selection runs over the whole batch at once.
    if layout == "yolov8":
        cls_scores = out[:, 4:, :]  # N, C, A
        class_ids = cls_scores.argmax(axis=1)
        scores = np.take_along_axis(cls_scores, class_ids[:, None, :], axis=1)[:, 0, :]
        img_idx, anchor_idx = np.nonzero(scores > confidence)
        xywh = out[img_idx, :4, anchor_idx]
        cand_scores = scores[img_idx, anchor_idx]
        cand_cls = class_ids[img_idx, anchor_idx]
    else:
        # The product only passes the threshold where objectness does (class scores are <= 1),
        # so the per-class products are formed for those anchors alone.
        img_idx, anchor_idx = np.nonzero(out[:, :, 4] > confidence)
        rows = out[img_idx, anchor_idx]  # K, 5 + C
        products = rows[:, 5:] * rows[:, 4:5]
        cand_cls = products.argmax(axis=1)
        cand_scores = products[np.arange(len(rows)), cand_cls]
        passed = cand_scores > confidence
        img_idx, xywh = img_idx[passed], rows[passed, :4]
        cand_scores, cand_cls = cand_scores[passed], cand_cls[passed]

    cand_scores = cand_scores.astype(np.float64)
    boxes = _xywh_to_source(xywh.astype(np.float64), img_idx, metas)

    results: list[YoloDetections] = []
    # Candidates come out of np.nonzero grouped by image, in order.
    bounds = np.searchsorted(img_idx, np.arange(n + 1))
    for i in range(n):
        sl = slice(bounds[i], bounds[i + 1])
        b, s, c = boxes[sl], cand_scores[sl], cand_cls[sl]
        nonempty = (b[:, 2] > b[:, 0]) & (b[:, 3] > b[:, 1])
        b, s, c = b[nonempty], s[nonempty], c[nonempty]
        keep = batched_nms(b, s, c, iou, max_detections)
        results.append(YoloDetections(b[keep], s[keep], c[keep].astype(np.intp)))
    return results


def _xywh_to_source(xywh: np.ndarray, img_idx: np.ndarray, metas: Sequence[ResizeMeta]) -> np.ndarray:
    """``cx, cy, w, h`` in model pixels → clipped ``x1, y1, x2, y2`` in each image's source pixels."""
    geo = np.array(
        [(m.pad_x, m.pad_y, m.scale_x, m.scale_y, m.src_w, m.src_h) for m in metas], dtype=np.float64
    ).reshape(-1, 6)[img_idx]
    half_w, half_h = xywh[:, 2] / 2, xywh[:, 3] / 2
    boxes = np.empty((len(xywh), 4), dtype=np.float64)
    boxes[:, 0] = (xywh[:, 0] - half_w - geo[:, 0]) / geo[:, 2]
    boxes[:, 1] = (xywh[:, 1] - half_h - geo[:, 1]) / geo[:, 3]
    boxes[:, 2] = (xywh[:, 0] + half_w - geo[:, 0]) / geo[:, 2]
    boxes[:, 3] = (xywh[:, 1] + half_h - geo[:, 1]) / geo[:, 3]
    np.clip(boxes[:, 0::2], 0.0, geo[:, 4:5], out=boxes[:, 0::2])
    np.clip(boxes[:, 1::2], 0.0, geo[:, 5:6], out=boxes[:, 1::2])
    return boxes
