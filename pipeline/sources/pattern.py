"""Test patterns: synthetic, deterministic frames, paced like a live camera.

::

    sources:
      - url: test://?width=640&height=360&fps=25&frames=250   # every parameter optional
      - url: test://?id=left&fps=10                           # id: the source id it derives

Each frame shows a dim gradient and a white square whose box is
:func:`pattern_square_box` of the frame index, so tests know the truth. Without
``frames`` the pattern never ends.
"""

from __future__ import annotations

import time

import numpy as np

from pipeline.config import SourceConfig
from pipeline.sources.base import SourceContext, SourceError, ThreadedSource
from pipeline.sources.schemes import parse_test_url

__all__ = ["TestPatternSource", "pattern_background", "pattern_square_box"]


class TestPatternSource(ThreadedSource):
    """``test://?width=640&height=360&fps=25&frames=N``: the pattern, drawn into pooled buffers."""

    schemes = ("test",)

    __test__ = False  # not a pytest class

    def __init__(self, config: SourceConfig, context: SourceContext | None = None) -> None:
        super().__init__(config, context)
        try:
            pattern = parse_test_url(config.url)  # checked with the config too; an embedder may skip that
        except ValueError as exc:
            raise SourceError(self.id, str(exc)) from None
        self.width, self.height, self.fps, self.frames = (
            pattern.width, pattern.height, pattern.fps, pattern.frames
        )  # fmt: skip

    def run(self) -> None:
        base = pattern_background(self.width, self.height)
        shape = (self.height, self.width, 3)
        start = time.monotonic()
        i = 0
        while not self.stopping and (self.frames is None or i < self.frames):
            due = start + i / self.fps
            delay = due - time.monotonic()
            if delay > 0 and self._stop.wait(delay):
                break
            x1, y1, x2, y2 = pattern_square_box(i, self.width, self.height)

            def draw(out: np.ndarray, box: tuple[int, int, int, int] = (x1, y1, x2, y2)) -> None:
                # Drawn straight into the pooled buffer: one full-frame write per frame.
                np.copyto(out, base)
                out[box[1] : box[3], box[0] : box[2]] = 255

            if not self.emit(i / self.fps, shape, draw):
                break
            i += 1


def pattern_background(width: int, height: int) -> np.ndarray:
    """A dim diagonal gradient, so nothing but the square is bright."""
    ys = np.linspace(0, 60, height, dtype=np.float32)[:, None]
    xs = np.linspace(0, 60, width, dtype=np.float32)[None, :]
    gray = (ys + xs).astype(np.uint8)
    return np.repeat(gray[:, :, None], 3, axis=2)


def pattern_square_box(index: int, width: int, height: int) -> tuple[int, int, int, int]:
    """Where the test pattern's square is in frame ``index`` (x1, y1, x2, y2, exclusive ends)."""
    side = max(8, min(width, height) // 6)
    span_x = width - side
    span_y = height - side
    # Bounce along both axes at different speeds so the path covers the frame.
    tx = (index * 7) % (2 * span_x)
    ty = (index * 3) % (2 * span_y)
    x = tx if tx < span_x else 2 * span_x - tx
    y = ty if ty < span_y else 2 * span_y - ty
    return (x, y, x + side, y + side)
