"""What post-processing returns, one object per request item.

An item whose output cannot become a result (a classifier row holding NaN) gets a
:class:`NonFiniteOutput` in its place instead of failing its batch: the batcher
fails that request alone and answers its batch mates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inference.errors import VidpipeError


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


class NonFiniteOutput(VidpipeError, ValueError):
    """``model`` gave NaN or infinity for one input: no result can be made of it.

    Returned by post-processing in that item's place (never raised there), so only the
    request of that input fails; ``value`` is ``NaN``, ``inf`` or ``-inf``.
    """

    def __init__(self, model: str, value: str) -> None:
        self.model = model
        self.value = value
        super().__init__(
            f"model {model!r} gave a non-finite output ({value}) for this input, so it has no result "
            "(if it recurs, check the model on such inputs: an overflow at a reduced precision, a "
            "division by zero in the graph)"
        )
