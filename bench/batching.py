"""Batching on a CPU: vidpipe against the program a user would write, and against the model's ceiling.

    python bench/batching.py [--streams 8] [--seconds 10] [--rounds 3] [--quick]

Two runtimes run in the same process and the same rounds: ONNX Runtime and
OpenVINO (the shipped configs' backend), each with its own naive loop.

Everything runs on one synthetic clip (320×320 H.264, five text lines per frame,
drawn by samples/make_clip.py), looped by every stream. The models are the real
PP-OCR ONNX files from the rapidocr-onnxruntime wheel, served from a model
repository built in a temp folder: copies of samples/models/ppocr_det and
ppocr_cls whose only change is ``input.shape: [3, 320, 320]`` for the detector
(the shipped one says 640×640; 320 matches the reference numbers) plus the
tuning under test (``DET_CONFIGS`` / ``CLS_CONFIGS`` below).

Detector (frames/s):

* ``naive``: a thread per stream, PyAV decode → letterbox/normalise in NumPy →
  ``InferenceSession.run`` at batch 1 with default session options, one session
  shared by all threads (the usual way: create the session once, call it from
  anywhere) → the same DB post-processing vidpipe uses → ``json.dumps``.
* ``naive ov``: the same loop on OpenVINO as its docs show it:
  ``core.compile_model("model.onnx", "CPU")`` with default properties, once, and
  an infer request per thread.
* ``vidpipe``: the full runtime (``pipeline.runtime.Runtime``): file sources
  looping with ``realtime: false``, one ``infer`` stage on ppocr_det, core
  publishing to an embedded nats-server. ``q``/``f`` name the source
  ``queue_size`` and ``runtime.max_in_flight``.
* ``layer`` (``--layer``): the inference layer alone: a decode thread per
  stream calling ``Model.submit(image).result()``.
* ``ceiling``: ONNX Runtime alone on pre-made 320×320 inputs, no decode, no
  pipeline: batch 1/2/4/8 × intra-op threads 1/2 on one session, plus two
  1-thread sessions called from two threads. The best median is the ceiling.
* ``ov ceiling``: OpenVINO alone at the shipped precision (``auto``) on pre-made
  inputs: static batch 1 on 1 or 2 streams, the bounded batch axis at batch 2,
  static batch 4 on 2 streams, and static batch 1 on 2 and 4 streams taking uint8
  images normalised inside the compiled model (``u8``: how vidpipe compiles the
  shipped detector; its two instances are two streams).
  The **ideal** for the OpenVINO pipeline is what that model rate and the
  per-frame decode + preprocess + DB cost (measured single-threaded, spread over
  every core) allow together with zero pipeline overhead:
  ``1 / (1 / ov_ceiling + work_per_frame / cores)``.

Crops (crops/s): 16 text-line crops per frame and stream, cut beforehand, through
the orientation classifier (ppocr_cls, 48×192): ``naive`` is a thread per stream
calling one shared default session once per crop; ``vidpipe`` is an asyncio task
per stream awaiting ``Model.infer`` on all 16 crops at once (``asyncio.gather``,
as the pipeline's cascade stage does), so the dynamic batcher forms the batches.
``crops naive ov`` is the per-crop loop on a default OpenVINO compile.

Demo (frames/s): the OCR demo's graph (configs/ocr.yaml: detector 640×640 →
orientation → recogniser → tracker) on one looping 640×360 clip of the demo's
plates, with the shipped model configs (OpenVINO) and with the same configs on
ONNX Runtime as they were tuned for it (two 1-thread instances).

Latency is per frame: from the decoded image being ready (vidpipe: the source's
``capture_ts``, taken when the decode thread hands the frame over) to its
result being published. ONNX Runtime on two threads flips between fast and slow
phases for tens of seconds, and the machine may be shared, so each variant runs
once per round, the order rotates each round, and medians are reported. The last
line is::

    det_limit_fraction=<vidpipe/ceiling> det_speedup_vs_naive=<vidpipe/naive> crops_speedup_vs_naive=<x>
    ov_det_vs_naive_ort=<vidpipe shipped/naive> ov_det_limit_fraction=<vidpipe shipped/ideal>
    ov_crops_vs_naive_ort=<x> demo_speedup=<demo on OpenVINO / demo on ONNX Runtime>

(all on one line; the ORT numbers compare ONNX Runtime configs with the ORT loop).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import av
import cv2
import numpy as np
import onnxruntime as ort
import openvino as ov

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    CpuMeter,
    Window,
    cpu_name,
    describe_load,
    fmt,
    median,
    percentile,
    table,
    utc_now,
    write_model_config,
)
from inference.backends.openvino import preprocesses_in_model, with_preprocessing  # noqa: E402
from inference.batcher import BatcherStats  # noqa: E402
from inference.config import ModelConfig  # noqa: E402
from inference.model import Model, resolve_model_file  # noqa: E402
from inference.processing.db import DBParams, db_boxes  # noqa: E402
from inference.processing.resize import (  # noqa: E402
    ImagePreprocessor,
    ImageResizer,
    ResizeMeta,
    letterbox_geometry,
)
from inference.repository import ModelRepository, read_source  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.frames import Frame  # noqa: E402
from pipeline.nats_server import EmbeddedNats  # noqa: E402
from pipeline.runtime import Runtime  # noqa: E402
from samples.make_clip import DEFAULT_PLATES, Plate, plates_at, text_box, write_clip  # noqa: E402

DET_SIZE = 320
CLIP_FPS = 15
CLIP_FRAMES = 150
CROPS_PER_FRAME = 16
CROP_FRAMES = 30

# Five text lines on a 320×320 frame: three parked, two driving through again and again,
# so every frame shows 3-5 lines and the detector's post-processing has real work.
PLATES = (
    Plate("KA05 MX2231", start=0, y=8, x=10, scale=0.7),
    Plate("GATE B7", start=0, y=108, x=190, scale=0.7),
    Plate("EXIT 12", start=0, y=208, x=20, scale=0.7),
    *(Plate("VIDPIPE 42", start=s, end=s + 45, y=58, speed=4.0, scale=0.7) for s in range(0, 150, 45)),
    *(Plate("NO PARKING", start=s, end=s + 57, y=158, speed=3.0, scale=0.7) for s in range(0, 150, 57)),
)

# Model-config variants, applied to copies of samples/models/<name>/config.yaml.
# "shipped" is the shipped config unchanged (apart from the detector's input size): OpenVINO.
# The others are ONNX Runtime tunings (``backend: onnxruntime`` replaces the shipped backend).
_CPU1 = {"intra_op_threads": 1, "inter_op_threads": 1}
_ORT = {"backend": "onnxruntime"}
DET_CONFIGS: dict[str, dict[str, Any]] = {
    "shipped": {},
    "1x2-b1": {
        **_ORT,
        "max_batch_size": 1,
        "dynamic_batching": {"preferred_batch_size": []},
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
        "backend_options": {"intra_op_threads": 2},
    },
    "2x1": {
        **_ORT,
        "max_batch_size": 2,
        "instance_group": [{"count": 2, "kind": "KIND_CPU"}],
        "backend_options": _CPU1,
    },
    "2x1-b1": {
        **_ORT,
        "max_batch_size": 1,
        "dynamic_batching": {"preferred_batch_size": []},
        "instance_group": [{"count": 2, "kind": "KIND_CPU"}],
        "backend_options": _CPU1,
    },
    "2x1-b2-d0": {
        **_ORT,
        "max_batch_size": 2,
        "dynamic_batching": {"preferred_batch_size": [], "max_queue_delay_microseconds": 0},
        "instance_group": [{"count": 2, "kind": "KIND_CPU"}],
        "backend_options": _CPU1,
    },
}
_ORT_1X2 = {
    **_ORT,
    "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
    "backend_options": {"intra_op_threads": 2},
}
CLS_CONFIGS: dict[str, dict[str, Any]] = {
    "shipped": {},
    "ort": {**_ORT, "instance_group": [{"count": 2, "kind": "KIND_CPU"}], "backend_options": _CPU1},
    "1x2-d0": {**_ORT_1X2, "dynamic_batching": {"max_queue_delay_microseconds": 0}},
    "1x2-b64": {**_ORT_1X2, "max_batch_size": 64, "dynamic_batching": {"preferred_batch_size": [32, 64]}},
}
# The OCR demo on ONNX Runtime: the shipped configs as they were tuned for it.
DEMO_ORT: dict[str, dict[str, Any]] = {
    "ppocr_det": {
        **_ORT,
        "max_batch_size": 2,
        "dynamic_batching": {"preferred_batch_size": []},
        "instance_group": [{"count": 2, "kind": "KIND_CPU"}],
        "backend_options": _CPU1,
    },
    "ppocr_cls": {**_ORT, "backend_options": _CPU1},
    "ppocr_rec": {
        **_ORT,
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
        "backend_options": {"intra_op_threads": 2, "inter_op_threads": 1},
    },
}

# Runtime variants as CONFIG:QxF (source queue_size x runtime.max_in_flight); the first is the
# ONNX Runtime headline. "shipped:8x4" is vidpipe as shipped (OpenVINO): its model config and
# the runtime defaults; it is always run.
DEFAULT_DET = "2x1-b1:1x1,shipped:8x4"
SHIPPED_DET = ("shipped", 8, 4)
# The first is the ONNX Runtime headline; "shipped" (OpenVINO) is always run.
DEFAULT_CLS = "ort,shipped"
DEMO_FRAMES = 120

log = logging.getLogger("bench.batching")


# -- the clip and the inputs ------------------------------------------------------------------


@dataclass
class Setup:
    tmp: Path
    clip: Path
    streams: int
    det_input: np.ndarray  # (8, 3, 320, 320) pre-made detector batch for the ceiling
    det_images: np.ndarray  # (8, 320, 320, 3) the same frames as uint8 RGB (in-graph normalisation)
    det_config: ModelConfig  # the shipped detector's config (input.shape 320×320)
    crop_frames: list[list[np.ndarray]]  # CROP_FRAMES lists of CROPS_PER_FRAME crops
    cls_input: np.ndarray  # (32, 3, 48, 192) pre-made classifier batch for its ceiling
    demo_clip: Path  # 640×360, the demo's plates, for the OCR demo graph
    det_model_path: Path
    cls_model_path: Path
    det_params: DBParams
    nats_url: str = ""
    diagnostics: dict[str, float] = field(default_factory=dict)


def decode_frames(clip: Path, limit: int | None = None) -> list[np.ndarray]:
    frames = []
    with av.open(str(clip)) as container:
        for frame in container.decode(video=0):
            frames.append(frame.to_ndarray(format="rgb24"))
            if limit is not None and len(frames) >= limit:
                break
    return frames


def cut_crops(index: int, image: np.ndarray) -> list[np.ndarray]:
    """16 text-line crops of frame ``index``: its lines in turn, each repeat shifted by 2 px."""
    boxes = []
    by_text = {p.text: p for p in PLATES}
    for text, panel in plates_at(index, image.shape[1], PLATES):
        boxes.append(text_box(by_text[text], panel))
    h, w = image.shape[:2]
    crops = []
    for k in range(CROPS_PER_FRAME):
        x1, y1, x2, y2 = boxes[k % len(boxes)]
        d = 2 * (k // len(boxes)) - 2
        x1, y1 = max(0, x1 - d), max(0, y1 - d)
        x2, y2 = min(w, x2 + d), min(h, y2 + d)
        crops.append(np.ascontiguousarray(image[y1:y2, x1:x2]))
    return crops


def det_overrides(name: str) -> dict[str, Any]:
    return {"input": {"shape": [3, DET_SIZE, DET_SIZE]}, **DET_CONFIGS[name]}


def build_repo(tmp: Path, det: str | None = None, cls: str | None = None) -> Path:
    """A model repository in ``tmp`` holding the chosen det and/or cls variant."""
    repo = tmp / "repos" / f"det-{det}_cls-{cls}"
    if det is not None:
        write_model_config(repo, "ppocr_det", det_overrides(det))
    if cls is not None:
        write_model_config(repo, "ppocr_cls", CLS_CONFIGS[cls])
    return repo


def model_path(repo: Path, name: str) -> Path:
    src = read_source(repo, name)
    return resolve_model_file(src.config, src.model_dir, src.version_dir)


def prepare(tmp: Path, streams: int) -> Setup:
    clip = write_clip(tmp / "plates_320.mp4", CLIP_FRAMES, CLIP_FPS, DET_SIZE, DET_SIZE, plates=PLATES)
    frames = decode_frames(clip)
    repo = build_repo(tmp, "shipped", "shipped")
    det_cfg = read_source(repo, "ppocr_det").config
    det_input = np.empty((8, 3, DET_SIZE, DET_SIZE), dtype=np.float32)
    ImagePreprocessor(det_cfg.input)(frames[:8], det_input)
    det_images = np.empty((8, DET_SIZE, DET_SIZE, 3), dtype=np.uint8)
    ImageResizer(det_cfg.input)(frames[:8], det_images)
    crop_frames = [cut_crops(i, frames[i]) for i in range(CROP_FRAMES)]
    cls_pre = ImagePreprocessor(read_source(repo, "ppocr_cls").config.input)
    cls_input = np.empty((32, 3, 48, 192), dtype=np.float32)
    cls_pre([c for crops in crop_frames[:2] for c in crops], cls_input)
    t = det_cfg.task
    params = DBParams(t.thresh, t.box_thresh, t.unclip_ratio, t.max_candidates, t.min_box_size, dilate=True)
    setup = Setup(
        tmp=tmp,
        clip=clip,
        streams=streams,
        det_input=det_input,
        det_images=det_images,
        det_config=det_cfg,
        crop_frames=crop_frames,
        cls_input=cls_input,
        demo_clip=write_clip(tmp / "demo.mp4", DEMO_FRAMES, 15, plates=DEFAULT_PLATES),
        det_model_path=model_path(repo, "ppocr_det"),
        cls_model_path=model_path(repo, "ppocr_cls"),
        det_params=params,
    )
    setup.diagnostics = per_frame_costs(setup, frames)
    return setup


def per_frame_costs(setup: Setup, frames: list[np.ndarray]) -> dict[str, float]:
    """Single-thread milliseconds per frame of the work around the model (why b < c).

    The preprocessing is what the shipped detector does on the host: with the
    normalisation compiled into the model (OpenVINO's default) that is only the
    letterbox into a uint8 batch; otherwise the full float preprocessing.
    """
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    n = len(decode_frames(setup.clip))
    out["decode_ms"] = (time.perf_counter() - t0) / n * 1e3
    pre: ImagePreprocessor | ImageResizer
    if preprocesses_in_model(setup.det_config):
        pre = ImageResizer(setup.det_config.input)
        buf = np.empty((1, DET_SIZE, DET_SIZE, 3), dtype=np.uint8)
    else:
        pre = ImagePreprocessor(setup.det_config.input)
        buf = np.empty((1, 3, DET_SIZE, DET_SIZE), dtype=np.float32)
    t0 = time.perf_counter()
    for f in frames[:60]:
        pre([f], buf)
    out["vidpipe_preprocess_ms"] = (time.perf_counter() - t0) / 60 * 1e3
    t0 = time.perf_counter()
    for f in frames[:60]:
        naive_det_preprocess(f)
    out["naive_preprocess_ms"] = (time.perf_counter() - t0) / 60 * 1e3
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(setup.det_model_path), so, providers=["CPUExecutionProvider"])
    maps = [sess.run(None, {"x": setup.det_input[i : i + 1]})[0][0, 0] for i in range(8)]
    meta = letterbox_geometry(DET_SIZE, DET_SIZE, DET_SIZE, DET_SIZE)
    t0 = time.perf_counter()
    boxes = 0
    for i in range(80):
        boxes += len(db_boxes(maps[i % 8], meta, setup.det_params))
    out["db_postprocess_ms"] = (time.perf_counter() - t0) / 80 * 1e3
    out["boxes_per_frame"] = boxes / 80
    return out


# -- detector: naive ----------------------------------------------------------------------------


def naive_det_preprocess(image: np.ndarray) -> tuple[np.ndarray, ResizeMeta]:
    """Letterbox to 320×320 (pad 0), BGR, (x/255 - 0.5)/0.5, CHW, batch of 1: what a user writes."""
    h, w = image.shape[:2]
    meta = letterbox_geometry(w, h, DET_SIZE, DET_SIZE)
    if (meta.content_w, meta.content_h) != (w, h):
        image = cv2.resize(image, (meta.content_w, meta.content_h))
    canvas = np.zeros((DET_SIZE, DET_SIZE, 3), dtype=np.uint8)
    canvas[meta.pad_y : meta.pad_y + meta.content_h, meta.pad_x : meta.pad_x + meta.content_w] = image
    x = canvas[:, :, ::-1].astype(np.float32) / 255.0
    x = (x - 0.5) / 0.5
    return np.ascontiguousarray(x.transpose(2, 0, 1)[np.newaxis]), meta


def boxes_json(boxes: Sequence[Any]) -> str:
    return json.dumps([{"polygon": b.corners.round(1).tolist(), "score": round(b.score, 4)} for b in boxes])


def loop_decode(clip: Path, stop: threading.Event, skip: int) -> Any:
    """Decoded RGB frames of ``clip`` over and over, starting ``skip`` frames in, until ``stop``."""
    first = True
    while not stop.is_set():
        with av.open(str(clip)) as container:
            for i, frame in enumerate(container.decode(video=0)):
                if first and i < skip:
                    continue
                yield frame.to_ndarray(format="rgb24")
                if stop.is_set():
                    return
        first = False


def measure_threads(
    threads: list[threading.Thread], stop: threading.Event, samples: list[tuple[float, float]],
    units: int, warmup: float, seconds: float,
) -> Window:  # fmt: skip
    """Start ``threads``, measure their ``samples`` for ``seconds`` after ``warmup``, then stop them."""
    for t in threads:
        t.start()
    window = Window(samples=samples, units_per_sample=units)
    meter = CpuMeter()
    time.sleep(warmup)
    meter.begin(window)
    time.sleep(seconds)
    meter.finish(window)
    stop.set()
    for t in threads:
        t.join()
    return window


def run_threads(
    setup: Setup, target: Callable[[int, threading.Event, list[tuple[float, float]]], None], seconds: float,
    warmup: float, units: int = 1,
) -> Window:  # fmt: skip
    """Start ``setup.streams`` threads running ``target``, measure ``seconds`` after ``warmup``."""
    stop = threading.Event()
    samples: list[tuple[float, float]] = []
    threads = [
        threading.Thread(target=target, args=(i, stop, samples), daemon=True) for i in range(setup.streams)
    ]
    return measure_threads(threads, stop, samples, units, warmup, seconds)


def det_naive(setup: Setup, session: ort.InferenceSession, seconds: float, warmup: float) -> Window:
    params = setup.det_params

    def stream(i: int, stop: threading.Event, samples: list[tuple[float, float]]) -> None:
        for image in loop_decode(setup.clip, stop, skip=i * 17):
            ready = time.time()
            x, meta = naive_det_preprocess(image)
            (prob,) = session.run(None, {"x": x})
            boxes_json(db_boxes(prob[0, 0], meta, params))
            done = time.time()
            samples.append((done, done - ready))

    return run_threads(setup, stream, seconds, warmup)


# -- detector: vidpipe --------------------------------------------------------------------------


def stats_delta(a: BatcherStats, b: BatcherStats, seconds: float, instances: int) -> dict[str, Any]:
    batches = b.batches - a.batches
    reqs = b.batched_requests - a.batched_requests
    compute = b.compute_seconds - a.compute_seconds
    hist = {k: v - a.batch_sizes.get(k, 0) for k, v in sorted(b.batch_sizes.items())}
    return {
        "mean_batch": reqs / batches if batches else math.nan,
        "busy": compute / (seconds * instances),
        "queue_ms": (b.queue_seconds - a.queue_seconds) / reqs * 1e3 if reqs else math.nan,
        "compute_ms_per_batch": compute / batches * 1e3 if batches else math.nan,
        "batch_sizes": {k: v for k, v in hist.items() if v},
    }


PIPELINE_YAML = """\
pipeline: bench
models: {models}
sources:
{sources}
stages:
  - {{name: text, type: infer, model: ppocr_det}}
runtime: {{max_in_flight: {in_flight}}}
nats: {{publish: core}}
"""


def det_runtime(
    setup: Setup, det: str, queue_size: int, in_flight: int, seconds: float, warmup: float
) -> Window:
    repo = build_repo(setup.tmp, det=det)
    sources = "\n".join(
        f"  - {{id: s{i}, url: {setup.clip}, loop: true, realtime: false, queue_size: {queue_size}}}"
        for i in range(setup.streams)
    )
    path = setup.tmp / f"pipeline-{det}-q{queue_size}-f{in_flight}.yaml"
    path.write_text(PIPELINE_YAML.format(models=repo, sources=sources, in_flight=in_flight))
    cfg = load_config(path)
    samples: list[tuple[float, float]] = []
    stage_s: list[tuple[float, float]] = []

    def on_published(frame: Frame) -> None:
        now = time.time()
        samples.append((now, now - frame.capture_ts))
        stage_s.append((now, frame.stage_times.get("text", math.nan)))

    async def main() -> Window:
        runtime = Runtime(cfg, nats_url=setup.nats_url, on_published=on_published)
        await runtime.start()
        try:
            model: Model = runtime.models.get("ppocr_det")
            window = Window(samples=samples)
            meter = CpuMeter()
            await asyncio.sleep(warmup)
            s0 = model.stats
            meter.begin(window)
            await asyncio.sleep(seconds)
            meter.finish(window)
            window.extra = stats_delta(s0, model.stats, window.seconds, model.config.instance_count)
        finally:
            await runtime.stop()
        inside = [s for t, s in stage_s if window.start <= t <= window.end]
        window.extra["stage_p50_ms"] = percentile(inside, 50) * 1e3
        return window

    return asyncio.run(main())


async def load_model(repo: Path, name: str) -> tuple[ModelRepository, Model]:
    models = ModelRepository(repo)
    status = await models.load(name)
    if status.state.value != "ready":
        raise RuntimeError(f"{name}: {status.reason}")
    return models, models.get(name)


def det_layer(setup: Setup, det: str, seconds: float, warmup: float) -> Window:
    models, model = asyncio.run(load_model(build_repo(setup.tmp, det=det), "ppocr_det"))

    def stream(i: int, stop: threading.Event, samples: list[tuple[float, float]]) -> None:
        for image in loop_decode(setup.clip, stop, skip=i * 17):
            ready = time.time()
            dets = model.submit(image).result()
            json.dumps([{"polygon": d.polygon, "score": d.score} for d in dets])  # type: ignore[union-attr]
            done = time.time()
            samples.append((done, done - ready))

    try:
        s0 = model.stats
        window = run_threads(setup, stream, seconds, warmup)
        window.extra = stats_delta(s0, model.stats, window.seconds + warmup, model.config.instance_count)
    finally:
        asyncio.run(models.close())
    return window


# -- detector: ceiling --------------------------------------------------------------------------


@dataclass(frozen=True)
class CeilingConfig:
    threads: int
    batch: int
    sessions: int = 1

    @property
    def name(self) -> str:
        return f"ceiling t={self.threads} b={self.batch} x{self.sessions}"


CEILING_CONFIGS = [
    *(CeilingConfig(t, b) for t in (1, 2) for b in (1, 2, 4, 8)),
    *(CeilingConfig(1, b, sessions=2) for b in (1, 2)),
]


def make_session(path: Path, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def det_ceiling(
    setup: Setup, sessions: dict[int, list[ort.InferenceSession]], cfg: CeilingConfig, seconds: float
) -> Window:
    x = setup.det_input[: cfg.batch]
    stop = threading.Event()
    samples: list[tuple[float, float]] = []

    def caller(sess: ort.InferenceSession) -> None:
        sess.run(None, {"x": x})  # first run at a new shape allocates
        while not stop.is_set():
            t0 = time.time()
            sess.run(None, {"x": x})
            t1 = time.time()
            samples.append((t1, t1 - t0))

    threads = [
        threading.Thread(target=caller, args=(s,), daemon=True) for s in sessions[cfg.threads][: cfg.sessions]
    ]
    return measure_threads(threads, stop, samples, cfg.batch, min(0.5, seconds / 3), seconds)


def cls_ceiling(setup: Setup, session: ort.InferenceSession, batch: int, seconds: float) -> Window:
    """The classifier alone on pre-made 48×192 inputs, one caller."""
    x = setup.cls_input[:batch]
    samples: list[tuple[float, float]] = []
    session.run(None, {"x": x})
    window = Window(samples=samples, units_per_sample=batch)
    meter = CpuMeter()
    meter.begin(window)
    while time.time() < window.start + seconds:
        t0 = time.time()
        session.run(None, {"x": x})
        t1 = time.time()
        samples.append((t1, t1 - t0))
    meter.finish(window)
    return window


# -- OpenVINO: naive loop and ceiling --------------------------------------------------------------


def ov_default(path: Path) -> Any:
    """The model compiled the way OpenVINO's docs start: the ONNX file as it is, default properties."""
    return ov.Core().compile_model(str(path), "CPU")


def det_naive_ov(setup: Setup, compiled: Any, seconds: float, warmup: float) -> Window:
    params = setup.det_params

    def stream(i: int, stop: threading.Event, samples: list[tuple[float, float]]) -> None:
        request = compiled.create_infer_request()  # a request is not shared between threads
        for image in loop_decode(setup.clip, stop, skip=i * 17):
            ready = time.time()
            x, meta = naive_det_preprocess(image)
            prob = request.infer({0: x})[0]
            boxes_json(db_boxes(prob[0, 0], meta, params))
            done = time.time()
            samples.append((done, done - ready))

    return run_threads(setup, stream, seconds, warmup)


@dataclass(frozen=True)
class OvCeilingConfig:
    streams: int
    batch: int
    static: bool = True
    # uint8 RGB images in, normalised inside the compiled model (as vidpipe compiles it by default).
    images: bool = False

    @property
    def name(self) -> str:
        shape = "static" if self.static else "[1..2]"
        return f"ov ceiling streams={self.streams} b={self.batch} {shape}" + (" u8" if self.images else "")


OV_CEILING_CONFIGS = [
    OvCeilingConfig(1, 1),
    OvCeilingConfig(2, 1),
    OvCeilingConfig(2, 2, static=False),
    OvCeilingConfig(2, 4),
    OvCeilingConfig(2, 1, images=True),
    OvCeilingConfig(4, 1, images=True),
]


def ov_compile(setup: Setup, cfg: OvCeilingConfig) -> Any:
    """The detector compiled at the shipped precision (auto) for one ceiling configuration."""
    core = ov.Core()
    model = core.read_model(str(setup.det_model_path))
    batch = cfg.batch if cfg.static else ov.Dimension(1, 2)
    model.reshape({"x": ov.PartialShape([batch, 3, DET_SIZE, DET_SIZE])})
    if cfg.images:
        model = with_preprocessing(ov, model, "x", setup.det_config)
    return core.compile_model(model, "CPU", {"NUM_STREAMS": str(cfg.streams)})


def det_ceiling_ov(setup: Setup, compiled: dict[OvCeilingConfig, Any], cfg: OvCeilingConfig,
                   seconds: float) -> Window:  # fmt: skip
    """OpenVINO alone: one caller per stream, each on its own request, on pre-made inputs."""
    x = np.ascontiguousarray((setup.det_images if cfg.images else setup.det_input)[: cfg.batch])
    stop = threading.Event()
    samples: list[tuple[float, float]] = []

    def caller(request: Any) -> None:
        request.infer({0: x})
        while not stop.is_set():
            t0 = time.time()
            request.infer({0: x}, share_inputs=True)
            t1 = time.time()
            samples.append((t1, t1 - t0))

    requests = [compiled[cfg].create_infer_request() for _ in range(cfg.streams)]
    threads = [threading.Thread(target=caller, args=(r,), daemon=True) for r in requests]
    return measure_threads(threads, stop, samples, cfg.batch, min(0.5, seconds / 3), seconds)


# -- crops --------------------------------------------------------------------------------------


def naive_cls_preprocess(crop: np.ndarray) -> np.ndarray:
    """48 px high keeping aspect, width ≤ 192 padded with 128, BGR, (x/255 - 0.5)/0.5, 1×3×48×192."""
    h, w = crop.shape[:2]
    new_w = min(192, max(1, math.ceil(48 * w / h)))
    canvas = np.full((48, 192, 3), 128, dtype=np.uint8)
    canvas[:, :new_w] = cv2.resize(crop, (new_w, 48))
    x = canvas[:, :, ::-1].astype(np.float32) / 255.0
    x = (x - 0.5) / 0.5
    return np.ascontiguousarray(x.transpose(2, 0, 1)[np.newaxis])


def crops_naive_loop(
    setup: Setup, make_classify: Callable[[], Callable[[np.ndarray], np.ndarray]], seconds: float,
    warmup: float,
) -> Window:  # fmt: skip
    """A thread per stream classifying its frame's crops one by one (``make_classify`` per thread)."""
    labels = ("0", "180")

    def stream(i: int, stop: threading.Event, samples: list[tuple[float, float]]) -> None:
        classify = make_classify()
        k = i * 7
        while not stop.is_set():
            crops = setup.crop_frames[k % len(setup.crop_frames)]
            k += 1
            ready = time.time()
            out = []
            for crop in crops:
                probs = classify(naive_cls_preprocess(crop))
                c = int(np.argmax(probs[0]))
                out.append({"label": labels[c], "score": round(float(probs[0, c]), 4)})
            json.dumps(out)
            done = time.time()
            samples.append((done, done - ready))

    return run_threads(setup, stream, seconds, warmup, units=CROPS_PER_FRAME)


def crops_naive(setup: Setup, session: ort.InferenceSession, seconds: float, warmup: float) -> Window:
    def make_classify() -> Callable[[np.ndarray], np.ndarray]:
        return lambda x: session.run(None, {"x": x})[0]

    return crops_naive_loop(setup, make_classify, seconds, warmup)


def crops_naive_ov(setup: Setup, compiled: Any, seconds: float, warmup: float) -> Window:
    def make_classify() -> Callable[[np.ndarray], np.ndarray]:
        request = compiled.create_infer_request()  # one per thread, as OpenVINO's docs start
        return lambda x: request.infer({0: x})[0]

    return crops_naive_loop(setup, make_classify, seconds, warmup)


def crops_vidpipe(setup: Setup, model: Model, seconds: float, warmup: float) -> Window:
    async def main() -> Window:
        samples: list[tuple[float, float]] = []
        stop = asyncio.Event()

        async def stream(i: int) -> None:
            k = i * 7
            while not stop.is_set():
                crops = setup.crop_frames[k % len(setup.crop_frames)]
                k += 1
                ready = time.time()
                results = await asyncio.gather(*(model.infer(c) for c in crops))
                json.dumps([{"label": r.label, "score": round(r.score, 4)} for r in results])  # type: ignore[union-attr]
                done = time.time()
                samples.append((done, done - ready))

        tasks = [asyncio.create_task(stream(i)) for i in range(setup.streams)]
        window = Window(samples=samples, units_per_sample=CROPS_PER_FRAME)
        meter = CpuMeter()
        await asyncio.sleep(warmup)
        s0 = model.stats
        meter.begin(window)
        await asyncio.sleep(seconds)
        meter.finish(window)
        window.extra = stats_delta(s0, model.stats, window.seconds, model.config.instance_count)
        stop.set()
        await asyncio.gather(*tasks)
        return window

    return asyncio.run(main())


# -- the OCR demo -------------------------------------------------------------------------------


def demo_repo(tmp: Path, runtime_name: str) -> Path:
    """The OCR demo's three models: as shipped (OpenVINO), or on ONNX Runtime as tuned for it."""
    repo = tmp / "repos" / f"demo-{runtime_name}"
    for name in ("ppocr_det", "ppocr_cls", "ppocr_rec"):
        write_model_config(repo, name, DEMO_ORT[name] if runtime_name == "ort" else {})
    return repo


def demo_run(setup: Setup, runtime_name: str, seconds: float, warmup: float) -> Window:
    """configs/ocr.yaml's graph on one looping clip of the demo's plates, frames/s published."""
    # Edited as text: a YAML round trip would turn the stages' ``on:`` keys into booleans.
    text = (ROOT / "configs" / "ocr.yaml").read_text()
    text = text.replace("models: ../samples/models", f"models: {demo_repo(setup.tmp, runtime_name)}")
    text = text.replace(
        "    url: ../samples/generated/demo.mp4\n",
        f"    url: {setup.demo_clip}\n    loop: true\n    realtime: false\n",
    )
    path = setup.tmp / f"ocr-{runtime_name}.yaml"
    path.write_text(text + "\nnats: {publish: core}\n")
    cfg = load_config(path)
    samples: list[tuple[float, float]] = []

    def on_published(frame: Frame) -> None:
        now = time.time()
        samples.append((now, now - frame.capture_ts))

    async def main() -> Window:
        runtime = Runtime(cfg, nats_url=setup.nats_url, on_published=on_published)
        await runtime.start()
        try:
            window = Window(samples=samples)
            meter = CpuMeter()
            await asyncio.sleep(warmup)
            meter.begin(window)
            await asyncio.sleep(seconds)
            meter.finish(window)
        finally:
            await runtime.stop()
        return window

    return asyncio.run(main())


# -- the run ------------------------------------------------------------------------------------


@dataclass
class Variant:
    name: str
    group: str  # "det", "ceiling" or "crops"
    run: Callable[[], Window]


@dataclass
class Summary:
    name: str
    group: str
    rates: list[float]
    p50: float
    p99: float
    cpu: float
    extra: dict[str, Any]

    @property
    def rate(self) -> float:
        return median(self.rates)


def summarise(name: str, group: str, windows: list[Window]) -> Summary:
    extra: dict[str, Any] = {}
    for key in ("mean_batch", "busy", "queue_ms", "compute_ms_per_batch", "stage_p50_ms"):
        vals = [w.extra[key] for w in windows if key in w.extra]
        if vals:
            extra[key] = median(vals)
    if group == "det":
        extra["in_system"] = median(w.in_system for w in windows)
    hist: dict[int, int] = {}
    for w in windows:
        for k, v in w.extra.get("batch_sizes", {}).items():
            hist[k] = hist.get(k, 0) + v
    if hist:
        extra["batch_sizes"] = dict(sorted(hist.items()))
    return Summary(
        name=name,
        group=group,
        rates=[w.rate for w in windows],
        p50=median(w.latency_ms(50) for w in windows),
        p99=median(w.latency_ms(99) for w in windows),
        cpu=median(w.cpu_cores for w in windows),
        extra=extra,
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds per variant and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=float, default=1.5, help="seconds before each measurement")
    p.add_argument("--quick", action="store_true", help="a ~1 minute smoke run (1 round, 3 s each)")
    p.add_argument(
        "--det",
        default=DEFAULT_DET,
        help=f"runtime variants CONFIG:QxF, first = headline; configs: {', '.join(DET_CONFIGS)}",
    )
    p.add_argument(
        "--cls", default=DEFAULT_CLS, help=f"cls configs, first = headline ({', '.join(CLS_CONFIGS)})"
    )
    p.add_argument("--layer", action="store_true", help="also run the inference layer alone (first det)")
    p.add_argument("--no-ceiling-sweep", action="store_true", help="ceiling: only t=1 b=1 x2 and t=2 b=2")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds, args.warmup = 1, 3.0, 1.0
    return args


def det_variants(spec: str, with_shipped: bool = False) -> list[tuple[str, int, int]]:
    """``CONFIG:QxF,...`` → ``[(config, queue_size, max_in_flight), ...]`` (+ the shipped one)."""
    out = []
    for item in (i for i in spec.split(",") if i):
        name, _, knobs = item.partition(":")
        q, _, f = (knobs or "8x4").partition("x")
        if name not in DET_CONFIGS:
            raise SystemExit(f"unknown det config {name!r}; choose from {', '.join(DET_CONFIGS)}")
        out.append((name, int(q), int(f)))
    if with_shipped and SHIPPED_DET not in out:
        out.append(SHIPPED_DET)
    return out


def det_variant_name(det: str, q: int, f: int) -> str:
    return f"det vidpipe [{det}, q{q} f{f}]"


def build_variants(args: argparse.Namespace, setup: Setup, state: dict[str, Any]) -> list[list[Variant]]:
    """The variants of one round, as blocks whose order rotates between rounds."""
    s, w = args.seconds, args.warmup
    cls_names = [c for c in args.cls.split(",") if c]
    blocks: list[list[Variant]] = []
    blocks.append([Variant("det naive", "det", lambda: det_naive(setup, state["det_naive"], s, w))])
    blocks.append([Variant("det naive ov", "det", lambda: det_naive_ov(setup, state["det_naive_ov"], s, w))])
    for det, q, f in det_variants(args.det, with_shipped=True):
        run = partial(det_runtime, setup, det, q, f, s, w)
        blocks.append([Variant(det_variant_name(det, q, f), "det", run)])
    if args.layer:
        det = det_variants(args.det)[0][0]
        blocks.append([Variant(f"det layer [{det}]", "det", partial(det_layer, setup, det, s, w))])
    configs = [CeilingConfig(1, 1, 2), CeilingConfig(2, 2)] if args.no_ceiling_sweep else CEILING_CONFIGS
    sweep_s = max(1.0, s / 5)
    blocks.append(
        [
            Variant(c.name, "ceiling", partial(det_ceiling, setup, state["ceiling"], c, sweep_s))
            for c in configs
        ]
    )
    blocks.append(
        [
            # As long as the pipeline's own windows: the ideal divides by this rate, and a short
            # window can land in a fast phase of the machine.
            Variant(c.name, "ov-ceiling", partial(det_ceiling_ov, setup, state["ov_ceiling"], c, s))
            for c in OV_CEILING_CONFIGS
        ]
    )
    # The classifier's own curve bounds what batching crops can gain: batched vs one by one.
    blocks.append(
        [
            Variant(
                f"cls ceiling t={t} b={b}",
                "cls-ceiling",
                partial(cls_ceiling, setup, state["cls_sessions"][t], b, 1.0),
            )
            for t in (1, 2)
            for b in (1, 32)
        ]
    )
    blocks.append([Variant("crops naive", "crops", lambda: crops_naive(setup, state["cls_naive"], s, w))])
    blocks.append(
        [Variant("crops naive ov", "crops", lambda: crops_naive_ov(setup, state["cls_naive_ov"], s, w))]
    )
    for cls in [*cls_names, *(["shipped"] if "shipped" not in cls_names else [])]:
        run = partial(crops_vidpipe, setup, state["cls"][cls][1], s, w)
        blocks.append([Variant(f"crops vidpipe [{cls}]", "crops", run)])
    for runtime_name in ("ov", "ort"):
        run = partial(demo_run, setup, runtime_name, s, max(w, 3.0))
        blocks.append([Variant(f"demo ocr [{runtime_name}]", "demo", run)])
    return blocks


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    load_before = describe_load()
    print(f"date: {utc_now()}")
    print(
        f"cpu: {cpu_name()}; cores: {os.cpu_count()}; onnxruntime {ort.__version__}; "
        f"openvino {ov.__version__}"
    )
    print(f"load average before: {load_before}")
    print(
        f"streams={args.streams} seconds={args.seconds} rounds={args.rounds} warmup={args.warmup} "
        f"det={args.det} cls={args.cls}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="vidpipe-batching-") as tmp_name, EmbeddedNats() as nats:
        tmp = Path(tmp_name)
        setup = prepare(tmp, args.streams)
        setup.nats_url = nats.url
        d = args.diagnostics = setup.diagnostics
        print(
            "per frame, one thread: "
            f"decode {d['decode_ms']:.2f} ms, vidpipe preprocess {d['vidpipe_preprocess_ms']:.2f} ms, "
            f"naive preprocess {d['naive_preprocess_ms']:.2f} ms, DB post-processing "
            f"{d['db_postprocess_ms']:.2f} ms ({d['boxes_per_frame']:.1f} text lines/frame)",
            flush=True,
        )
        default_so = ort.SessionOptions()
        default_so.log_severity_level = 3
        cpu = ["CPUExecutionProvider"]
        state: dict[str, Any] = {
            "det_naive": ort.InferenceSession(str(setup.det_model_path), default_so, providers=cpu),
            "cls_naive": ort.InferenceSession(str(setup.cls_model_path), default_so, providers=cpu),
            "ceiling": {
                1: [make_session(setup.det_model_path, 1) for _ in range(2)],
                2: [make_session(setup.det_model_path, 2)],
            },
            "cls": {},
            "cls_sessions": {t: make_session(setup.cls_model_path, t) for t in (1, 2)},
            "det_naive_ov": ov_default(setup.det_model_path),
            "cls_naive_ov": ov_default(setup.cls_model_path),
            "ov_ceiling": {c: ov_compile(setup, c) for c in OV_CEILING_CONFIGS},
        }
        cls_names = [c for c in args.cls.split(",") if c]
        for cls in [*cls_names, *(["shipped"] if "shipped" not in cls_names else [])]:
            state["cls"][cls] = asyncio.run(load_model(build_repo(tmp, cls=cls), "ppocr_cls"))
        try:
            results = run_rounds(args, setup, state)
        finally:
            for models, _ in state["cls"].values():
                asyncio.run(models.close())
    load_after = describe_load()
    report(args, results, load_before, load_after, time.monotonic() - started)
    return 0


def run_rounds(args: argparse.Namespace, setup: Setup, state: dict[str, Any]) -> list[Summary]:
    windows: dict[str, list[Window]] = {}
    groups: dict[str, str] = {}
    for r in range(args.rounds):
        blocks = build_variants(args, setup, state)
        shift = r % len(blocks)
        for block in blocks[shift:] + blocks[:shift]:
            for v in block:
                win = v.run()
                windows.setdefault(v.name, []).append(win)
                groups[v.name] = v.group
                unit = "crops/s" if v.group.startswith(("crops", "cls")) else "frames/s"
                print(
                    f"round {r + 1} {v.name:<34} {win.rate:7.1f} {unit}  p50 {fmt(win.latency_ms(50))} ms  "
                    f"p99 {fmt(win.latency_ms(99))} ms  cpu {win.cpu_cores:.2f} cores  "
                    f"load {describe_load()}",
                    flush=True,
                )
    return [summarise(name, groups[name], ws) for name, ws in windows.items()]


def report(
    args: argparse.Namespace, results: list[Summary], load_before: str, load_after: str, elapsed: float
) -> None:
    rows = []
    for s in results:
        unit = "crops/s" if s.group.startswith(("crops", "cls")) else "frames/s"
        batch = s.extra.get("mean_batch", math.nan)
        busy = s.extra.get("busy", math.nan)
        rows.append(
            [
                s.name,
                f"{s.rate:.1f} {unit}",
                " / ".join(f"{r:.0f}" for r in s.rates),
                fmt(s.p50),
                fmt(s.p99),
                f"{s.cpu:.2f}",
                fmt(batch, 2),
                fmt(busy * 100, 0) + ("%" if not math.isnan(busy) else ""),
            ]
        )
    print()
    print(
        table(
            [
                "variant",
                "median",
                "per round",
                "p50 ms",
                "p99 ms",
                "cpu cores",
                "mean batch",
                "instance busy",
            ],
            rows,
        )
    )
    for s in results:
        if "batch_sizes" in s.extra or "in_system" in s.extra:
            bits = []
            if "in_system" in s.extra:
                bits.append(f"frames in flight (rate × mean latency) {fmt(s.extra['in_system'])}")
            if "stage_p50_ms" in s.extra:
                bits.append(f"infer stage p50 {fmt(s.extra['stage_p50_ms'])} ms")
            if "queue_ms" in s.extra:
                bits.append(f"batcher queue {fmt(s.extra['queue_ms'], 2)} ms/request")
            if "compute_ms_per_batch" in s.extra:
                bits.append(f"{fmt(s.extra['compute_ms_per_batch'], 2)} ms/batch")
            if "batch_sizes" in s.extra:
                bits.append(f"batch sizes {s.extra['batch_sizes']}")
            print(f"{s.name}: " + ", ".join(bits))
    by_name = {s.name: s for s in results}
    b = by_name[det_variant_name(*det_variants(args.det)[0])]
    a = by_name["det naive"]
    ceiling = max((s for s in results if s.group == "ceiling"), key=lambda s: s.rate)
    x_vid = by_name[f"crops vidpipe [{args.cls.split(',')[0]}]"]
    x_naive = by_name["crops naive"]
    print()
    single = max((s for s in results if s.group == "ceiling" and s.name.endswith("x1")), key=lambda s: s.rate)
    print(f"headline vidpipe: {b.name}; ceiling: {ceiling.name} ({ceiling.rate:.1f} frames/s)")
    print(
        f"best single session: {single.name} ({single.rate:.1f} frames/s; "
        f"vidpipe/that = {b.rate / single.rate:.2f})"
    )
    cls = {s.name: s.rate for s in results if s.group == "cls-ceiling"}
    if cls:
        one = max(v for k, v in cls.items() if k.endswith("b=1"))
        batched = max(v for k, v in cls.items() if k.endswith("b=32"))
        print(
            f"classifier alone: best one-by-one {one:.0f} crops/s, best at batch 32 {batched:.0f} crops/s "
            f"(batching can gain at most {batched / one:.2f}x over an ideal one-by-one caller)"
        )
    print(
        f"p99: vidpipe {fmt(b.p99)} ms vs naive {fmt(a.p99)} ms "
        f"({'no worse' if b.p99 <= a.p99 else 'WORSE'} than naive)"
    )
    # OpenVINO as shipped against the ONNX Runtime loop, and against its own ideal.
    ov_det = by_name[det_variant_name(*SHIPPED_DET)]
    ov_ceiling = max((s for s in results if s.group == "ov-ceiling"), key=lambda s: s.rate)
    d = args.diagnostics
    work_s = (d["decode_ms"] + d["vidpipe_preprocess_ms"] + d["db_postprocess_ms"]) / 1e3
    cores = os.cpu_count() or 1
    ideal = 1.0 / (1.0 / ov_ceiling.rate + work_s / cores)
    ov_crops = by_name["crops vidpipe [shipped]"]
    demo_ov, demo_ort = by_name["demo ocr [ov]"], by_name["demo ocr [ort]"]
    print(
        f"OpenVINO: shipped det pipeline {ov_det.rate:.1f} frames/s; model alone {ov_ceiling.rate:.1f} "
        f"frames/s ({ov_ceiling.name}); decode + preprocess + DB {work_s * 1e3:.2f} ms/frame on one "
        f"core, {cores} cores: ideal {ideal:.1f} frames/s"
    )
    print(
        f"OpenVINO naive loops: det {by_name['det naive ov'].rate:.1f} frames/s, crops "
        f"{by_name['crops naive ov'].rate:.0f} crops/s; OCR demo {demo_ov.rate:.1f} frames/s on OpenVINO, "
        f"{demo_ort.rate:.1f} on ONNX Runtime"
    )
    print(f"load average after: {load_after}; run took {elapsed:.0f} s")
    print(
        f"det_limit_fraction={b.rate / ceiling.rate:.2f} det_speedup_vs_naive={b.rate / a.rate:.2f} "
        f"crops_speedup_vs_naive={x_vid.rate / x_naive.rate:.2f} "
        f"ov_det_vs_naive_ort={ov_det.rate / a.rate:.2f} ov_det_limit_fraction={ov_det.rate / ideal:.2f} "
        f"ov_crops_vs_naive_ort={ov_crops.rate / x_naive.rate:.2f} "
        f"demo_speedup={demo_ov.rate / demo_ort.rate:.2f}"
    )


if __name__ == "__main__":
    sys.exit(main())
