"""IoU between box sets and the Hungarian assignment trackers match with."""

from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment


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


def match(iou: np.ndarray, min_iou: float) -> tuple[list[tuple[int, int]], list[int], list[int]]:
    """The assignment of rows to columns with the largest total IoU, pairs below ``min_iou`` refused.

    Returns the matched ``(row, col)`` pairs and the unmatched rows and columns.
    """
    rows, cols = iou.shape
    if rows == 0 or cols == 0:
        return [], list(range(rows)), list(range(cols))
    # Infeasible pairs get a cost no feasible set can beat, then are dropped afterwards.
    cost = np.where(iou >= min_iou, 1.0 - iou, 1e6)
    pairs = [
        (int(r), int(c)) for r, c in zip(*linear_sum_assignment(cost), strict=True) if iou[r, c] >= min_iou
    ]
    matched_rows = {r for r, _ in pairs}
    matched_cols = {c for _, c in pairs}
    return (
        pairs,
        [r for r in range(rows) if r not in matched_rows],
        [c for c in range(cols) if c not in matched_cols],
    )
