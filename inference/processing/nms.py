"""Greedy non-maximum suppression over axis-aligned boxes, vectorised with NumPy.

Boxes are ``(K, 4)`` arrays of ``x1, y1, x2, y2``. A box is suppressed when its
IoU with an already kept, higher-scoring box is strictly greater than the
threshold. Ties in score keep the earlier box.
"""

from __future__ import annotations

import numpy as np

__all__ = ["batched_nms", "box_iou", "nms"]


def box_iou(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """IoU of one ``(4,)`` box against ``(K, 4)`` boxes; empty boxes give 0."""
    ix1 = np.maximum(box[0], boxes[:, 0])
    iy1 = np.maximum(box[1], boxes[:, 1])
    ix2 = np.minimum(box[2], boxes[:, 2])
    iy2 = np.minimum(box[3], boxes[:, 3])
    inter = np.clip(ix2 - ix1, 0, None) * np.clip(iy2 - iy1, 0, None)
    area = max(float(box[2] - box[0]), 0.0) * max(float(box[3] - box[1]), 0.0)
    areas = np.clip(boxes[:, 2] - boxes[:, 0], 0, None) * np.clip(boxes[:, 3] - boxes[:, 1], 0, None)
    union = area + areas - inter
    return np.divide(inter, union, out=np.zeros_like(inter, dtype=np.float64), where=union > 0)


def nms(
    boxes: np.ndarray, scores: np.ndarray, iou_threshold: float, max_detections: int | None = None
) -> np.ndarray:
    """Indices of the kept boxes, highest score first (at most ``max_detections``)."""
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    scores = np.asarray(scores).reshape(-1)
    if len(boxes) != len(scores):
        raise ValueError(f"{len(boxes)} boxes but {len(scores)} scores")
    limit = len(boxes) if max_detections is None else max(0, max_detections)
    # Stable sort so equal scores keep input order.
    order = np.argsort(-scores, kind="stable")
    keep: list[int] = []
    while order.size and len(keep) < limit:
        best = int(order[0])
        keep.append(best)
        rest = order[1:]
        if not rest.size:
            break
        order = rest[box_iou(boxes[best], boxes[rest]) <= iou_threshold]
    return np.asarray(keep, dtype=np.intp)


def batched_nms(
    boxes: np.ndarray,
    scores: np.ndarray,
    class_ids: np.ndarray,
    iou_threshold: float,
    max_detections: int | None = None,
) -> np.ndarray:
    """Class-aware NMS: boxes only suppress boxes of the same class.

    Each class is moved to its own disjoint region of the plane, so one greedy
    pass handles every class at once.
    """
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    if not len(boxes):
        return np.zeros(0, dtype=np.intp)
    class_ids = np.asarray(class_ids).reshape(-1)
    span = float(np.abs(boxes).max()) * 2.0 + 1.0
    offsets = (class_ids.astype(np.float64) - float(class_ids.min())) * span
    return nms(boxes + offsets[:, None], scores, iou_threshold, max_detections)
