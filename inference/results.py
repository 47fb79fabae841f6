"""What post-processing returns, one object per request item."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Detection:
    """A detected object; ``box`` is ``(x1, y1, x2, y2)`` in the input image's pixels.

    ``polygon`` holds the four corners of a rotated box (text lines), clockwise from top-left.
    """

    box: tuple[float, float, float, float]
    score: float
    class_id: int
    label: str
    polygon: list[tuple[float, float]] | None = None


@dataclass(slots=True)
class Classification:
    """The top class of one crop and the top-k list ``[(label, score), ...]``."""

    class_id: int
    label: str
    score: float
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass(slots=True)
class Recognition:
    """Recognised text and its mean character confidence."""

    text: str
    score: float


Result = list[Detection] | Classification | Recognition
