"""Tracking: vidpipe's trackers against the peers, then interval and reinfer_interval on real pipelines.

    python bench/tracking.py [--sequences 6] [--frames 300] [--quick]

Needs the ``bench`` extra (motmetrics, norfair, supervision): without motmetrics it
says so and exits 2; without a peer tracker it leaves that peer out.

1. **Trackers on rendered sequences with ground truth.** Each sequence is 1280×720,
   ``--frames`` long, with 14 objects (person-shaped boxes, 30-70 px wide): half walk
   left to right and half right to left through the same band, so paths cross;
   each changes speed at random (2 % a frame, ×0.3-2.0); two pillars hide them
   (fully behind: no detection; at a pillar's edge: a low score, 0.15-0.45).
   Detections are synthesised from the truth: missed at ``MISS_RATE``, boxes
   jittered by ``NOISE`` of their size, scores 0.55-0.95, plus false detections
   (``FALSE_PER_FRAME`` a frame on average, scores 0.1-0.7). Ground truth is the
   visible objects. The same detections go to ``iou`` and ``bytetrack``
   (pipeline.tracking) and to the peers ``norfair`` (IoU distance, Kalman
   filter) and ``supervision``'s ByteTrack. Trackers built to use low scores
   (both ByteTracks) get every detection scoring 0.1 or more; ``iou`` and
   ``norfair`` get those scoring 0.5 or more, their usual operating point.
   At interval 2 the trackers see detections on one frame in three; on the
   others vidpipe's trackers and norfair give their predictions and
   supervision (no prediction call) repeats its last output. Scored with
   motmetrics (IoU ≥ 0.5): IDF1, MOTA, ID switches.
2. **interval_fps_gain**: a detector-bound pipeline (ppocr_det, 640×640 input,
   on every frame of the 640×360 sample clip read as fast as it goes, then
   ``track``) with and without ``interval: 2``: published frames per second,
   from the sources' start to the last frame published.
3. **reinfer_calls_ratio**: the OCR pipeline on the sample clip with the tracker
   before the cascade (``text → track → orientation → read``), with and without
   ``reinfer_interval: 5`` on both cascade stages: the objects the classifier
   (ppocr_cls) ran on, read from the published frames (results it carried do
   not count), each pipeline run twice to show the count does not depend on
   timing; and the texts read per frame compared (spaces ignored: the
   recogniser alone flips between "GATE B7" and "GATEB7" from frame to frame).

The last line::

    idf1_bytetrack=… idf1_iou=… idf1_best_peer=… interval2_fps_gain=… reinfer_calls_ratio=…
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import SAMPLE_MODELS, cpu_name, describe_load, table, utc_now
from pipeline.config import load_config
from pipeline.frames import Frame
from pipeline.nats_server import EmbeddedNats
from pipeline.runtime import Runtime
from pipeline.tracking.assignment import iou_matrix
from pipeline.tracking.bytetrack import ByteTracker
from pipeline.tracking.iou import IouTracker

WIDTH, HEIGHT = 1280, 720
OBJECTS = 14
MISS_RATE = 0.10
NOISE = 0.04
FALSE_PER_FRAME = 0.3
PILLARS = ((420, 470), (820, 860))  # x ranges that hide what walks behind them
LOW_SCORE_FLOOR, HIGH_SCORE_FLOOR = 0.1, 0.5

Box = tuple[float, float, float, float]


@dataclass
class Sequence:
    """Per frame: the visible truth ``(id, box)`` and the detections ``(box, score)``."""

    truth: list[list[tuple[int, Box]]] = field(default_factory=list)
    detections: list[list[tuple[Box, float]]] = field(default_factory=list)


def render(seed: int, frames: int) -> Sequence:
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, max(1, frames // 2), OBJECTS)
    w = rng.uniform(30, 70, OBJECTS)
    h = w * rng.uniform(1.8, 2.4, OBJECTS)
    direction = np.where(np.arange(OBJECTS) % 2 == 0, 1.0, -1.0)
    x = np.where(direction > 0, -w, WIDTH)
    y = rng.uniform(250, 420, OBJECTS)  # one band: paths cross
    vx = direction * rng.uniform(3, 9, OBJECTS)
    vy = rng.uniform(-0.6, 0.6, OBJECTS)
    seq = Sequence()
    for f in range(frames):
        truth: list[tuple[int, Box]] = []
        dets: list[tuple[Box, float]] = []
        for i in range(OBJECTS):
            if f < starts[i]:
                continue
            if rng.random() < 0.02:  # speed changes
                vx[i] = np.clip(vx[i] * rng.uniform(0.3, 2.0), -14, 14) or direction[i] * 3
            x[i] += vx[i]
            y[i] = np.clip(y[i] + vy[i], 0, HEIGHT - h[i])
            box = (float(x[i]), float(y[i]), float(x[i] + w[i]), float(y[i] + h[i]))
            if box[2] <= 0 or box[0] >= WIDTH:
                continue
            cx = (box[0] + box[2]) / 2
            hidden = any(a <= cx <= b for a, b in PILLARS)
            edge = any(a - w[i] / 2 <= cx <= b + w[i] / 2 for a, b in PILLARS)
            if hidden:
                continue
            truth.append((i + 1, box))
            if rng.random() < MISS_RATE:
                continue
            jitter = rng.normal(0, NOISE, 4) * np.array([w[i], h[i], w[i], h[i]])
            score = rng.uniform(0.15, 0.45) if edge else rng.uniform(0.55, 0.95)
            x1, y1, x2, y2 = (float(v) for v in np.array(box) + jitter)
            dets.append(((x1, y1, x2, y2), float(score)))
        for _ in range(rng.poisson(FALSE_PER_FRAME)):
            fw = rng.uniform(30, 70)
            fx, fy = rng.uniform(0, WIDTH - fw), rng.uniform(0, HEIGHT - 2 * fw)
            dets.append(((fx, fy, fx + fw, fy + 2 * fw), float(rng.uniform(0.1, 0.7))))
        seq.truth.append(truth)
        seq.detections.append(dets)
    return seq


# A tracker under test: called once per frame with the detections (None: the detector
# skipped the frame) and returns the (id, box) it reports for that frame.
Step = Callable[[list[tuple[Box, float]] | None], list[tuple[int, Box]]]


def ours(tracker: ByteTracker | IouTracker, floor: float) -> Step:
    def step(dets: list[tuple[Box, float]] | None) -> list[tuple[int, Box]]:
        if dets is None:
            return [(t.track_id, t.box) for t in tracker.predict()]
        kept = [d for d in dets if d[1] >= floor]
        boxes = np.array([b for b, _ in kept], dtype=np.float64).reshape(-1, 4)
        ids = tracker.update(boxes, np.array([s for _, s in kept]), ["person"] * len(kept))
        return [(i, b) for i, (b, _) in zip(ids, kept, strict=True) if i is not None]

    return step


def norfair_step(interval: int) -> Step:
    from norfair import Detection, Tracker

    tracker = Tracker(
        distance_function="iou", distance_threshold=0.8, hit_counter_max=30, initialization_delay=1
    )

    def step(dets: list[tuple[Box, float]] | None) -> list[tuple[int, Box]]:
        kept = [d for d in dets or [] if d[1] >= HIGH_SCORE_FLOOR]
        found = [Detection(np.array([[b[0], b[1]], [b[2], b[3]]]), scores=np.array([s, s])) for b, s in kept]
        # period: how many frames a detection frame stands for (norfair's own frame skipping).
        objs = tracker.update(found, period=interval + 1) if dets is not None else tracker.update()
        out = []
        for o in objs:
            (x1, y1), (x2, y2) = o.estimate
            out.append((int(o.id), (float(x1), float(y1), float(x2), float(y2))))
        return out

    return step


def supervision_step(interval: int) -> Step:
    import supervision as sv

    tracker = sv.ByteTrack(lost_track_buffer=30, frame_rate=30)
    last: list[tuple[int, Box]] = []

    def step(dets: list[tuple[Box, float]] | None) -> list[tuple[int, Box]]:
        nonlocal last
        if dets is None:
            return last  # no prediction call: the last output stands
        kept = [d for d in dets if d[1] >= LOW_SCORE_FLOOR]
        found = sv.Detections(
            xyxy=np.array([b for b, _ in kept], dtype=np.float32).reshape(-1, 4),
            confidence=np.array([s for _, s in kept], dtype=np.float32),
            class_id=np.zeros(len(kept), dtype=int),
        )
        tracked = tracker.update_with_detections(found)
        last = [
            (int(i), (float(b[0]), float(b[1]), float(b[2]), float(b[3])))
            for i, b in zip(tracked.tracker_id, tracked.xyxy, strict=True)
        ]
        return last

    return step


TRACKERS: dict[str, Callable[[int], Step]] = {
    "iou": lambda _: ours(IouTracker(min_iou=0.2, max_age=30), HIGH_SCORE_FLOOR),
    "bytetrack": lambda _: ours(ByteTracker(), LOW_SCORE_FLOOR),
    "norfair": norfair_step,
    "supervision": supervision_step,
}


def score(sequences: list[Sequence], make: Callable[[int], Step], interval: int) -> dict[str, float]:
    import motmetrics as mm

    accs = []
    for seq in sequences:
        acc = mm.MOTAccumulator(auto_id=True)
        step = make(interval)
        for f, (truth, dets) in enumerate(zip(seq.truth, seq.detections, strict=True)):
            out = step(dets if f % (interval + 1) == 0 else None)
            iou = iou_matrix(np.array([b for _, b in truth]), np.array([b for _, b in out]))
            # motmetrics' own iou_matrix uses np.asfarray (gone in NumPy 2): the same distance here.
            dist = np.where(iou >= 0.5, 1.0 - iou, np.nan)
            acc.update([i for i, _ in truth], [i for i, _ in out], dist)
        accs.append(acc)
    mh = mm.metrics.create()
    summary = mh.compute_many(accs, metrics=["idf1", "mota", "num_switches"], generate_overall=True)
    row = summary.loc["OVERALL"]
    return {"idf1": float(row["idf1"]), "mota": float(row["mota"]), "idsw": float(row["num_switches"])}


# -- real pipelines ------------------------------------------------------------------------


async def run_pipeline(yaml_text: str, nats_url: str, tmp: Path) -> tuple[float, dict[str, int], list[Frame]]:
    """Frames per second (first frame taken to last published), requests per model, the frames."""
    path = tmp / f"p{time.monotonic_ns()}.yaml"
    path.write_text(yaml_text)
    frames: list[Frame] = []
    first: list[float] = []

    def published(frame: Frame) -> None:
        frames.append(frame)

    runtime = Runtime(load_config(path), nats_url=nats_url, on_published=published)
    await runtime.prepare()
    first.append(time.perf_counter())
    runtime.start_sources()
    await runtime.wait(600)
    elapsed = time.perf_counter() - first[0]
    assert runtime.models is not None
    calls = {m: runtime.models.get(m).stats.batched_requests for m in runtime.config.models_used()}
    await runtime.stop()
    return len(frames) / elapsed, calls, frames


DETECTOR = """\
pipeline: det
models: {models}
sources: [{{id: a, url: "{clip}", realtime: false}}]
stages:
  - {{name: text, type: infer, model: ppocr_det{extra}}}
  - {{name: track, type: track}}
runtime: {{max_in_flight: 4}}
nats: {{publish: core}}
"""

OCR = """\
pipeline: ocr
models: {models}
sources: [{{id: street, url: "{clip}", realtime: false}}]
stages:
  - {{name: text, type: infer, model: ppocr_det}}
  - {{name: track, type: track}}
  - {{name: orientation, type: infer, model: ppocr_cls, on: text, min_size: 8, max_objects: 16{extra}}}
  - {{name: read, type: infer, model: ppocr_rec, on: text, min_size: 8, max_objects: 16,
      upright_by: orientation{extra}}}
runtime: {{max_in_flight: 4}}
nats: {{publish: core}}
"""


def texts(frame: Frame) -> list[str]:
    # Spaces ignored: the recogniser itself reads "GATE B7" on one frame and "GATEB7" on the next.
    return sorted("".join(o.text.split()) for o in frame.objects if o.text)


def classified(frames: list[Frame]) -> int:
    """Objects the classifier ran on, read from the published frames (carried results do not count).

    Counted from what the file's frames carry, not from the model's request counter,
    so it depends on the clip alone: the same on every run.
    """
    return sum(
        1 for f in frames for o in f.objects for a in o.attributes if a.model == "ppocr_cls" and not a.carried
    )


async def pipelines(frames: int, rounds: int) -> dict[str, Any]:
    from samples.make_clip import write_clip

    nats = EmbeddedNats().start()
    out: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            clip = write_clip(tmp / "clip.mp4", frames=frames, fps=15)
            # All four sample plates cross the OCR clip's frame within its 120 frames.
            ocr_clip = write_clip(tmp / "ocr.mp4", frames=120, fps=15)
            fps: dict[str, list[float]] = {"0": [], "2": []}
            for _ in range(rounds):  # alternate, so load on a shared machine hits both
                for interval in ("0", "2"):
                    extra = f", interval: {interval}" if interval != "0" else ""
                    text = DETECTOR.format(models=SAMPLE_MODELS, clip=clip, extra=extra)
                    rate, calls, _ = await run_pipeline(text, nats.url, tmp)
                    fps[interval].append(rate)
                    out[f"det_calls_{interval}"] = calls["ppocr_det"]
            out["fps"] = {k: float(np.median(v)) for k, v in fps.items()}
            runs = {}
            cls_runs: dict[str, list[int]] = {"0": [], "5": []}
            for _ in range(2):  # twice: a count on a file must come out the same every time
                for reinfer in ("0", "5"):
                    extra = f", reinfer_interval: {reinfer}" if reinfer != "0" else ""
                    _, calls, published = await run_pipeline(
                        OCR.format(models=SAMPLE_MODELS, clip=ocr_clip, extra=extra), nats.url, tmp
                    )
                    ordered = sorted(published, key=lambda f: f.index)
                    runs[reinfer] = (calls, [texts(f) for f in ordered])
                    cls_runs[reinfer].append(classified(ordered))
            out["cls_calls"] = {k: v[0]["ppocr_cls"] for k, v in runs.items()}
            out["rec_calls"] = {k: v[0]["ppocr_rec"] for k, v in runs.items()}
            out["cls_runs"] = cls_runs
            same = sum(a == b for a, b in zip(runs["0"][1], runs["5"][1], strict=True))
            out["frames_same_texts"] = (same, len(runs["0"][1]))
            out["distinct_texts"] = {k: sorted({t for f in v[1] for t in f}) for k, v in runs.items()}
    finally:
        nats.stop()
    return out


# What the bench extra brings: the scorer, then the peer trackers compared against.
BENCH_EXTRA = ("motmetrics", "norfair", "supervision")


def missing_extra() -> list[str]:
    """The bench extra's packages that are not installed."""
    import importlib.util

    return [name for name in BENCH_EXTRA if importlib.util.find_spec(name) is None]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=6)
    parser.add_argument("--frames", type=int, default=300)
    parser.add_argument("--pipeline-frames", type=int, default=90)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2 sequences, 1 round: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.sequences, args.rounds, args.pipeline_frames = 2, 1, 30
    missing = missing_extra()
    if "motmetrics" in missing:
        print(
            "bench/tracking.py scores trackers with motmetrics, which is not installed: "
            "install the bench extra (pip install -e '.[bench]': " + ", ".join(BENCH_EXTRA) + ")",
            file=sys.stderr,
        )
        return 2

    print(f"# tracking bench, {utc_now()}, {cpu_name()}, load {describe_load()}")
    print(
        f"# {args.sequences} sequences × {args.frames} frames, {OBJECTS} objects, miss {MISS_RATE:.0%}, "
        f"box noise {NOISE:.0%}, {FALSE_PER_FRAME} false detections/frame, 2 pillars"
    )
    sequences = [render(seed, args.frames) for seed in range(args.sequences)]
    results: dict[tuple[str, int], dict[str, float]] = {}
    rows = []
    for name, make in TRACKERS.items():
        for interval in (0, 2):
            if name in missing:
                print(f"# {name}: not installed (the bench extra: pip install -e '.[bench]')")
                break
            res = score(sequences, make, interval)
            results[(name, interval)] = res
            rows.append(
                [name, str(interval), f"{res['idf1']:.3f}", f"{res['mota']:.3f}", f"{res['idsw']:.0f}"]
            )
    print(table(["tracker", "interval", "IDF1", "MOTA", "ID switches"], rows))

    pipe = asyncio.run(pipelines(args.pipeline_frames, args.rounds))
    gain = pipe["fps"]["2"] / pipe["fps"]["0"]
    print(
        f"# detector-bound pipeline ({args.pipeline_frames} frames 640×360, ppocr_det): "
        f"{pipe['fps']['0']:.1f} fps, interval 2: {pipe['fps']['2']:.1f} fps "
        f"(detector calls {pipe['det_calls_0']} vs {pipe['det_calls_2']})"
    )
    first = {k: v[0] for k, v in pipe["cls_runs"].items()}
    ratio = first["0"] / max(1, first["5"])
    same_runs = all(len(set(v)) == 1 for v in pipe["cls_runs"].values())
    print(
        f"# classifier runs read from the published frames, two runs each: every frame "
        f"{pipe['cls_runs']['0']}, reinfer_interval 5 {pipe['cls_runs']['5']} "
        f"({'the same' if same_runs else 'DIFFERENT: a count that depends on timing'})"
    )
    same, total = pipe["frames_same_texts"]
    print(
        f"# OCR clip: classifier calls {pipe['cls_calls']['0']} vs {pipe['cls_calls']['5']} "
        f"with reinfer_interval 5, recogniser {pipe['rec_calls']['0']} vs {pipe['rec_calls']['5']}; "
        f"frames with the same texts {same}/{total}; "
        f"distinct texts equal: {pipe['distinct_texts']['0'] == pipe['distinct_texts']['5']}"
    )
    peers = [results[(n, 0)]["idf1"] for n in ("norfair", "supervision") if (n, 0) in results]
    best_peer = max(peers) if peers else float("nan")
    print(
        f"idf1_bytetrack={results[('bytetrack', 0)]['idf1']:.3f} idf1_iou={results[('iou', 0)]['idf1']:.3f} "
        f"idf1_best_peer={best_peer:.3f} interval2_fps_gain={gain:.2f} reinfer_calls_ratio={ratio:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
