"""Greedy CTC decoding of text-recogniser outputs.

The model emits ``[N, T, K]`` per-step class probabilities. Greedy decoding
takes the best class per step, collapses runs of the same class and drops the
blank (class 0). A line's score is the mean probability of the kept steps
(0.0 for an empty line).

The dictionary follows PaddleOCR: class ``0`` is the blank, classes ``1..D``
are the dictionary's lines in order and, when the model has ``D + 2`` classes,
the last class is a space.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from inference.processing.classify import as_probabilities

__all__ = ["CTCDecoder", "parse_dictionary"]

BLANK = "blank"


def parse_dictionary(text: str) -> list[str]:
    """The dictionary's characters: one per line (``\\n`` or ``\\r\\n``), a trailing newline ignored."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


class CTCDecoder:
    """Greedy CTC decoder over a fixed character table (index 0 = blank)."""

    def __init__(self, characters: Sequence[str]) -> None:
        if len(characters) < 2:
            raise ValueError("a CTC character table needs the blank and at least one character")
        self.characters = list(characters)
        self._table = np.array(self.characters, dtype=object)

    @classmethod
    def from_dictionary(cls, dictionary: Sequence[str], num_classes: int) -> CTCDecoder:
        """PaddleOCR's table for a model with ``num_classes`` outputs: blank + dictionary (+ space)."""
        chars = [BLANK, *dictionary]
        if num_classes == len(chars) + 1:
            chars.append(" ")
        elif num_classes != len(chars):
            raise ValueError(
                f"the model has {num_classes} output classes but the dictionary has {len(dictionary)} "
                f"characters; expected {len(chars)} (blank + dictionary) or {len(chars) + 1} (+ space)"
            )
        return cls(chars)

    @property
    def num_classes(self) -> int:
        return len(self.characters)

    def decode(self, probs: np.ndarray) -> list[tuple[str, float]]:
        """Decode ``[N, T, K]`` probabilities (or logits) into ``(text, score)`` per item."""
        probs = np.asarray(probs)
        if probs.ndim != 3 or probs.shape[2] != self.num_classes:
            raise ValueError(
                f"expected [N, T, {self.num_classes}] recogniser output, got {list(probs.shape)}"
            )
        n, t, _ = probs.shape
        probs = as_probabilities(probs, axis=2)
        best = probs.argmax(axis=2)  # N, T
        best_p = np.take_along_axis(probs, best[:, :, None], axis=2)[:, :, 0].astype(np.float64)
        keep = best != 0
        if t > 1:
            keep[:, 1:] &= best[:, 1:] != best[:, :-1]
        counts = keep.sum(axis=1)
        chars = self._table[best[keep]]
        # Sum per row in one pass, then split the kept characters back into rows.
        sums = np.where(keep, best_p, 0.0).sum(axis=1)
        ends = np.cumsum(counts)
        results = []
        for i in range(n):
            start = int(ends[i] - counts[i])
            text = "".join(chars[start : int(ends[i])])
            score = float(sums[i] / counts[i]) if counts[i] else 0.0
            results.append((text, score))
        return results
