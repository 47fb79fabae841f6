"""Classifier outputs → probabilities → top-k labelled classes.

A model may end in a softmax or emit raw logits. Each item (a row, or for a
recogniser all its time steps) is taken as probabilities when it is non-negative
and sums to 1 (within :data:`PROB_TOLERANCE`, loose enough for float16);
otherwise softmax is applied to it. The choice is made per item, never per
batch: a batch mixes crops of every camera, and one odd row must not change
another request's scores.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from inference.results import Classification

__all__ = [
    "PROB_TOLERANCE",
    "as_probabilities",
    "classify",
    "is_probability",
    "probability_items",
    "softmax",
    "top_k",
]

PROB_TOLERANCE = 1e-2


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax (float32 or wider) along ``axis``."""
    x = np.asarray(x)
    z = x.astype(np.promote_types(x.dtype, np.float32), copy=True)
    z -= z.max(axis=axis, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=axis, keepdims=True)
    return z


def is_probability(x: np.ndarray, axis: int = -1, tolerance: float = PROB_TOLERANCE) -> bool:
    """Whether every slice along ``axis`` is non-negative and sums to 1 within ``tolerance``."""
    x = np.asarray(x)
    if x.size == 0:
        return True
    if float(x.min()) < -1e-6:
        return False
    sums = x.sum(axis=axis, dtype=np.float64)
    return bool(np.all(np.abs(sums - 1.0) <= tolerance))


def probability_items(x: np.ndarray, axis: int = -1, tolerance: float = PROB_TOLERANCE) -> np.ndarray:
    """Per item of ``x`` (its first axis): whether every slice of it along ``axis`` is
    non-negative and sums to 1 within ``tolerance``. A NaN makes its item ``False``."""
    x = np.asarray(x)
    n = x.shape[0] if x.ndim else 1
    if x.size == 0:
        return np.ones(n, bool)
    non_negative = (x >= -1e-6).reshape(n, -1).all(axis=1)
    sums = x.sum(axis=axis, dtype=np.float64)
    return non_negative & (np.abs(sums - 1.0) <= tolerance).reshape(n, -1).all(axis=1)


def as_probabilities(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """``x`` with softmax applied to each item (first axis) that does not already hold probabilities.

    Decided item by item (:func:`probability_items`), so an item's probabilities depend
    on that item alone, whatever shares its batch. ``axis`` must not be the first axis.
    """
    x = np.asarray(x)
    if x.ndim < 2:
        return x if is_probability(x, axis) else softmax(x, axis)
    ready = probability_items(x, axis)
    if ready.all():
        return x
    probs = softmax(x, axis)  # row by row: each row's softmax reads only that row
    if ready.any():
        probs[ready] = x[ready]
    return probs


def top_k(probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``(N, K)`` probabilities: the ``k`` best class indices and scores, best first.

    Equal scores keep the lower class index first.
    """
    k = max(1, min(k, probs.shape[1]))
    order = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(probs, order, axis=1)


def classify(output: np.ndarray, labels: Sequence[str], k: int) -> list[Classification]:
    """One :class:`Classification` per row of an ``(N, K, ...)`` output (trailing 1-dims allowed)."""
    out = np.asarray(output)
    if out.ndim == 1:
        out = out[None, :]
    out = out.reshape(out.shape[0], -1)
    probs = as_probabilities(out, axis=1)
    idx, scores = top_k(probs, k)
    names = list(labels)

    def name(i: int) -> str:
        return names[i] if i < len(names) else str(i)

    results = []
    for row_idx, row_scores in zip(idx.tolist(), scores.tolist(), strict=True):
        top = [(name(i), float(s)) for i, s in zip(row_idx, row_scores, strict=True)]
        results.append(Classification(row_idx[0], top[0][0], top[0][1], top))
    return results
