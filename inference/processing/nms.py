"""Greedy non-maximum suppression over axis-aligned boxes, vectorised with NumPy.

Boxes are ``(K, 4)`` arrays of ``x1, y1, x2, y2``. A box is suppressed when its
IoU with an already kept, higher-scoring box is strictly greater than the
threshold. Ties in score keep the earlier box.
"""

from __future__ import annotations

import numpy as np

__all__ = ["batched_nms", "iou_matrix", "nms"]


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
    idx = np.argsort(-scores, kind="stable")
    ordered = boxes[idx]
    x1, y1, x2, y2 = (np.ascontiguousarray(ordered[:, i]) for i in range(4))
    area = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    keep: list[int] = []
    # The candidate arrays shrink every round; the head is always the best box left.
    while idx.size and len(keep) < limit:
        keep.append(int(idx[0]))
        if idx.size == 1:
            break
        inter = np.minimum(x2[0], x2[1:])
        inter -= np.maximum(x1[0], x1[1:])
        np.maximum(inter, 0.0, out=inter)
        h = np.minimum(y2[0], y2[1:])
        h -= np.maximum(y1[0], y1[1:])
        np.maximum(h, 0.0, out=h)
        inter *= h
        # IoU <= t  <=>  inter <= t * union, which also keeps pairs with an empty union.
        survive = inter <= iou_threshold * (area[1:] + area[0] - inter)
        x1, y1, x2, y2 = x1[1:][survive], y1[1:][survive], x2[1:][survive], y2[1:][survive]
        area, idx = area[1:][survive], idx[1:][survive]
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


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box in ``a`` (N×4) against every box in ``b`` (M×4)."""
    a = np.asarray(a, dtype=np.float64).reshape(-1, 4)
    b = np.asarray(b, dtype=np.float64).reshape(-1, 4)
    x1 = np.maximum(a[:, None, 0], b[None, :, 0])
    y1 = np.maximum(a[:, None, 1], b[None, :, 1])
    x2 = np.minimum(a[:, None, 2], b[None, :, 2])
    y2 = np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.maximum(union, 1e-9), 0.0)
