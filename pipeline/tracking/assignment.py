"""The Hungarian assignment trackers match with, over IoU from ``inference.processing.nms``."""

from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment

from inference.processing.nms import iou_matrix

__all__ = ["iou_matrix", "match"]


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
