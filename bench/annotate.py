"""Per-frame cost of annotation and encoding: what watching or recording a source adds.

For each size, on frames of the test pattern with N objects, the median per-frame time of:
the BGR copy alone (the baseline every output pays), annotate (copy + drawing), JPEG
(one MJPEG/snapshot frame) and the annotated file recording (annotate + libx264 encode).

    python bench/annotate.py [--frames 150] [--objects 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.annotate import annotate, to_bgr
from pipeline.frames import DetectedObject, Frame
from pipeline.outputs.relay import LiveFrame
from pipeline.outputs.video_file import VideoFileWriter
from pipeline.sources.pattern import pattern_background, pattern_square_box


def frames(width: int, height: int, count: int, objects: int) -> list[Frame]:
    base = pattern_background(width, height)
    out = []
    for i in range(count):
        image = base.copy()
        objs = []
        for k in range(objects):
            x1, y1, x2, y2 = pattern_square_box(i + 17 * k, width, height)
            image[y1:y2, x1:x2] = 255
            objs.append(DetectedObject(k + 1, "square", 0, 0.9, (x1, y1, x2, y2), "detect", track_id=k + 1))
        out.append(Frame("bench", i, i / 25, 0.0, image, objs))
    return out


def per_frame_ms(work: Callable[[Frame], object], batch: list[Frame]) -> float:
    times = []
    for frame in batch:
        t0 = time.perf_counter()
        work(frame)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=int, default=150)
    parser.add_argument("--objects", type=int, default=8)
    args = parser.parse_args()
    summary = []
    for width, height in ((640, 360), (1280, 720), (1920, 1080)):
        batch = frames(width, height, args.frames, args.objects)
        copy_ms = per_frame_ms(to_bgr, batch)
        annotate_ms = per_frame_ms(annotate, batch)
        jpeg_ms = per_frame_ms(lambda f: LiveFrame("b", f.index, f.pts, annotate(f)).jpeg(), batch)
        with tempfile.TemporaryDirectory() as tmp:
            writer = VideoFileWriter(Path(tmp) / "out.mp4")
            record_ms = per_frame_ms(lambda f, w=writer: w.write(annotate(f), f.pts), batch)
            writer.close()
        print(
            f"{width}x{height} objects={args.objects}: copy {copy_ms:.2f} ms, annotate {annotate_ms:.2f} ms "
            f"({annotate_ms / copy_ms:.1f}x copy), annotate+jpeg {jpeg_ms:.2f} ms, "
            f"annotate+libx264 {record_ms:.2f} ms per frame"
        )
        summary.append(f"annotate_ms_{height}p={annotate_ms:.2f} record_ms_{height}p={record_ms:.2f}")
    print(" ".join(summary))


if __name__ == "__main__":
    main()
