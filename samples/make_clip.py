"""Renders the sample clip: number plates driving past, and a bright square bouncing around.

Everything is drawn, so the truth is known for every frame: :func:`plates_at`
gives each visible plate's text and box, :func:`square_at` the square's box.
The demo and the OCR tests encode clips with it through PyAV.

    python samples/make_clip.py samples/generated/demo.mp4 [--seconds 8] [--fps 15]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import cv2
import numpy as np

FONT = cv2.FONT_HERSHEY_SIMPLEX
PLATE_COLOR = (250, 215, 40)  # yellow: bright to a person, not to the square detector


@dataclass(frozen=True)
class Plate:
    """A plate shown from frame ``start`` (until ``end``, exclusive) on row ``y``.

    It drives in from the right at ``speed`` px/frame, or stands still at ``x`` when given.
    """

    text: str
    start: int
    y: int
    speed: float = 6.0
    scale: float = 1.3
    x: int | None = None
    end: int | None = None


DEFAULT_PLATES = (
    Plate("KA05 MX2231", start=0, y=70),
    Plate("VIDPIPE 42", start=12, y=200, speed=8.0),
    Plate("GATE B7", start=40, y=130, speed=7.0),
    Plate("EXIT 12", start=60, y=250, speed=5.0),
)


def plate_size(plate: Plate) -> tuple[int, int]:
    """Width and height of a plate's panel in pixels."""
    (tw, th), base = cv2.getTextSize(plate.text, FONT, plate.scale, 3)
    return tw + 28, th + base + 24


def plates_at(
    index: int, width: int, plates: Sequence[Plate] = DEFAULT_PLATES
) -> list[tuple[str, tuple[int, int, int, int]]]:
    """``(text, (x1, y1, x2, y2))`` of each plate fully inside a frame of ``width``."""
    out = []
    for plate in plates:
        if index < plate.start or (plate.end is not None and index >= plate.end):
            continue
        w, h = plate_size(plate)
        x = plate.x if plate.x is not None else round(width - (index - plate.start) * plate.speed)
        if x >= 0 and x + w <= width:
            out.append((plate.text, (x, plate.y, x + w, plate.y + h)))
    return out


def text_box(plate: Plate, panel: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """Where the ink of ``plate``'s text is, given its panel box."""
    (tw, th), base = cv2.getTextSize(plate.text, FONT, plate.scale, 3)
    x1, y1 = panel[0] + 14, panel[1] + 12
    return (x1, y1, x1 + tw, y1 + th + base)


def square_at(index: int, width: int, height: int) -> tuple[int, int, int, int]:
    """The white square's box; it bounces along the bottom edge."""
    side = 36
    span = width - side
    t = (index * 9) % (2 * span)
    x = t if t < span else 2 * span - t
    y = height - side - 8
    return (x, y, x + side, y + side)


def render_frame(
    index: int, width: int, height: int, plates: Sequence[Plate] = DEFAULT_PLATES, square: bool = True
) -> np.ndarray:
    """One RGB frame of the clip."""
    img = np.empty((height, width, 3), dtype=np.uint8)
    img[:] = (40, 44, 52)
    # Lane markings give the text detector something that is not text.
    for lane_y in (height // 3, 2 * height // 3):
        for x in range(-(index * 6) % 80, width, 80):
            cv2.line(img, (x, lane_y), (x + 40, lane_y), (120, 120, 120), 2)
    for text, (x1, y1, x2, y2) in plates_at(index, width, plates):
        plate = next(p for p in plates if p.text == text)
        cv2.rectangle(img, (x1, y1), (x2 - 1, y2 - 1), PLATE_COLOR, thickness=-1)
        cv2.rectangle(img, (x1, y1), (x2 - 1, y2 - 1), (20, 20, 20), thickness=2)
        (_, th), _ = cv2.getTextSize(text, FONT, plate.scale, 3)
        cv2.putText(img, text, (x1 + 14, y1 + 12 + th), FONT, plate.scale, (15, 15, 15), 3, cv2.LINE_AA)
    if square:
        x1, y1, x2, y2 = square_at(index, width, height)
        img[y1:y2, x1:x2] = 255
    return img


def write_clip(
    path: str | Path,
    frames: int,
    fps: int = 15,
    width: int = 640,
    height: int = 360,
    plates: Sequence[Plate] = DEFAULT_PLATES,
    square: bool = True,
    codec: str = "libx264",
) -> Path:
    """Encode ``frames`` frames to ``path`` (H.264 in MP4 by default)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(out), mode="w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width = width
        stream.height = height
        stream.pix_fmt = "yuv420p"
        stream.time_base = Fraction(1, fps)
        if codec == "libx264":
            # High quality so text edges survive; tests check recognised strings.
            stream.options = {"crf": "18", "preset": "veryfast", "tune": "stillimage"}
        for i in range(frames):
            image = render_frame(i, width, height, plates, square)
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts = i
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--fps", type=int, default=15)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--height", type=int, default=360)
    args = parser.parse_args(argv)
    frames = int(args.seconds * args.fps)
    path = write_clip(args.output, frames, args.fps, args.width, args.height)
    print(f"wrote {path} ({frames} frames, {args.width}x{args.height} @ {args.fps} fps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
