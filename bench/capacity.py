"""Cameras per core: how many live-paced cameras a configuration holds with its line counts kept.

    python bench/capacity.py [--seconds 30] [--fps 10] [--max-cameras 32] [--seed 7] [--quick]

1. **The scene.** A pedestrian-like clip rendered with known truth (``--seconds`` at
   ``--fps``, 640×384): walkers in six lanes cross the frame left to right or right
   to left past a counting line across the middle; each changes speed at random,
   stops for a while, and some turn back before the line. The detector is a small
   ONNX graph built here with ``onnx.helper``: it finds each lane's bright walker
   exactly (the ``squares`` idea, per lane), so every count difference comes from
   the schedule and the tracker, not from a detector's misses. ``--gflops`` adds
   that many GFLOPs of convolutions whose result is scaled to nothing, so the model
   costs what a real detector costs (YOLOv8n at 640×384 ≈ 5; the convolutions are
   the cost, their weights do not matter); ``--ultralytics yolov8n.yaml`` builds and
   exports a real YOLOv8 from its architecture file when ``ultralytics`` is
   installed and times it alone (no download; untrained weights cost the same).
2. **Accuracy** (the file read as fast as it goes, detect → track → zones): line
   crossings, distinct track ids and the frames the detector ran on, for every
   frame (``interval: 0``, the default), ``interval: 2``, ``interval: 4`` and
   ``interval: auto``; the truth's crossings beside them.
3. **Capacity.** For each configuration, N sources of the clip paced at its frame
   rate (``realtime: true``) through detect → track → zones; N doubles and then
   bisects to the largest N at which every source published ≥ 95% of the frames
   its camera would have shown in that time, p99 lateness (publish time against the
   frame's place on the camera's clock) ≤ 1 s, and every source's line count within
   ±10% of the every-frame run's. Paced files never drop frames (they wait), so a
   source that falls behind shows it as lateness and missing frames at the end of
   the window, as a camera would by dropping.

The last line::

    cameras_per_core=… cameras_every_frame=… cameras_auto=… auto_capacity_ratio=…
    auto_detector_share=… auto_count_ratio=… auto_ids_ratio=…      (on one line)
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import cpu_name, describe_load, percentile, table, utc_now
from pipeline.config import load_config
from pipeline.frames import Frame
from pipeline.nats_server import EmbeddedNats
from pipeline.runtime import Runtime
from pipeline.stages.infer import InferStage

WIDTH, HEIGHT, LANES = 640, 384, 6
LANE = HEIGHT // LANES
WALKER_W, WALKER_H = 26, 56
LINE_X = WIDTH // 2
Box = tuple[float, float, float, float]


# -- the scene ------------------------------------------------------------------------------


@dataclass
class Walker:
    lane: int
    x: float
    direction: int
    speed: float
    turn_at: float | None  # x where it turns back, or None
    pause: int = 0

    def box(self) -> Box:
        y = self.lane * LANE + (LANE - WALKER_H) // 2
        return (self.x, float(y), self.x + WALKER_W, float(y + WALKER_H))


@dataclass
class Scene:
    boxes: list[list[Box]] = field(default_factory=list)
    crossings: int = 0  # the anchor (bottom centre) passing LINE_X, either way


def make_scene(frames: int, seed: int = 7) -> Scene:
    """Per frame the walkers' boxes; at most one walker per lane at a time."""
    rng = np.random.default_rng(seed)
    lanes: list[Walker | None] = [None] * LANES
    wait = rng.integers(0, 30, LANES)
    scene = Scene()
    for _ in range(frames):
        for lane in range(LANES):
            w = lanes[lane]
            if w is None:
                wait[lane] -= 1
                if wait[lane] <= 0:
                    direction = 1 if rng.random() < 0.5 else -1
                    turn = float(rng.uniform(LINE_X - 120, LINE_X - 20)) if rng.random() < 0.25 else None
                    if turn is not None and direction < 0:
                        turn = 2 * LINE_X - turn
                    x = -WALKER_W + 1.0 if direction > 0 else WIDTH - 1.0
                    lanes[lane] = Walker(lane, x, direction, float(rng.uniform(3.0, 8.0)), turn)
                continue
            if w.pause > 0:
                w.pause -= 1
            else:
                if rng.random() < 0.02:
                    w.speed = float(np.clip(w.speed * rng.uniform(0.7, 1.4), 2.0, 10.0))
                if rng.random() < 0.01:
                    w.pause = int(rng.integers(5, 20))
                before = w.x + WALKER_W / 2
                w.x += w.direction * w.speed
                after = w.x + WALKER_W / 2
                if (before - LINE_X) * (after - LINE_X) < 0:
                    scene.crossings += 1
                if w.turn_at is not None and (w.x - w.turn_at) * w.direction >= 0:
                    w.direction, w.turn_at = -w.direction, None
            if w.x < -WALKER_W or w.x > WIDTH:
                lanes[lane] = None
                wait[lane] = rng.integers(3, 25)
        scene.boxes.append([w.box() for w in lanes if w is not None])
    return scene


def render(boxes: list[Box]) -> np.ndarray:
    img = np.full((HEIGHT, WIDTH, 3), (70, 74, 80), dtype=np.uint8)
    img[::24, :] = (95, 95, 100)  # paving: texture that does not move
    img[:, ::32] = (95, 95, 100)
    for x1, y1, x2, y2 in boxes:
        img[int(y1) : int(y2), max(0, int(x1)) : max(0, int(x2))] = 250
    return img


def write_scene(path: Path, scene: Scene, fps: int) -> Path:
    import av

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        stream.time_base = Fraction(1, fps)
        stream.options = {"crf": "20", "preset": "veryfast"}
        for i, boxes in enumerate(scene.boxes):
            frame = av.VideoFrame.from_ndarray(render(boxes), format="rgb24")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


# -- the detector ---------------------------------------------------------------------------


def lane_detector(gflops: float = 0.0) -> Any:
    """``images[N,3,H,W]`` → ``[N, 5, LANES]`` (YOLOv8 layout): each lane's bright walker, exactly.

    ``gflops`` of 3×3 convolutions at half resolution run beside it; their mean,
    times 1e-12, is added to the scores, so no runtime can leave them out.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    xs = np.arange(WIDTH, dtype=np.float32)
    # Image rows per lane, [LANES, LANE]: the lane's offset is in the table, so nothing but
    # scalars is added after a reduction. OpenVINO's CPU plugin (2026.4) computes
    # ReduceMax(keepdims=0) + a [1, LANES] constant as if the constant ran along the batch
    # axis, so at batch > 1 frame n got lane n's offset in every lane.
    ys = np.arange(HEIGHT, dtype=np.float32).reshape(LANES, LANE)
    inits: dict[str, np.ndarray] = {
        "xs1": xs + 1, "wxs": WIDTH - xs, "ys1": ys + 1, "hys": HEIGHT - ys,
        "thr": np.array(0.9, np.float32), "W": np.array(WIDTH, np.float32),
        "H": np.array(HEIGHT, np.float32), "half": np.array(0.5, np.float32),
        "shape": np.array([0, LANES, LANE, WIDTH], np.int64), "tiny": np.array(1e-12, np.float32),
        "ax1": np.array([1], np.int64),
    }  # fmt: skip
    n = helper.make_node
    nodes = [
        n("ReduceMin", ["images"], ["dark"], axes=[1], keepdims=0),  # [N,H,W]
        n("Greater", ["dark", "thr"], ["bright_b"]),
        n("Cast", ["bright_b"], ["bright_f"], to=TensorProto.FLOAT),
        n("Reshape", ["bright_f", "shape"], ["bright"]),  # [N,L,HB,W]
        n("ReduceMax", ["bright"], ["cols"], axes=[2], keepdims=0),  # [N,L,W]
        n("ReduceMax", ["bright"], ["rows"], axes=[3], keepdims=0),  # [N,L,HB]
        n("Mul", ["cols", "xs1"], ["c_end"]),
        n("ReduceMax", ["c_end"], ["x2"], axes=[2], keepdims=0),  # [N,L]
        n("Mul", ["cols", "wxs"], ["c_start"]),
        n("ReduceMax", ["c_start"], ["w_x1"], axes=[2], keepdims=0),
        n("Sub", ["W", "w_x1"], ["x1"]),
        n("Mul", ["rows", "ys1"], ["r_end"]),
        n("ReduceMax", ["r_end"], ["y2"], axes=[2], keepdims=0),
        n("Mul", ["rows", "hys"], ["r_start"]),
        n("ReduceMax", ["r_start"], ["h_y1"], axes=[2], keepdims=0),
        n("Sub", ["H", "h_y1"], ["y1"]),
        n("ReduceMax", ["cols"], ["score0"], axes=[2], keepdims=0),
        n("Add", ["x1", "x2"], ["xs"]),
        n("Mul", ["xs", "half"], ["cx"]),
        n("Add", ["y1", "y2"], ["ysum"]),
        n("Mul", ["ysum", "half"], ["cy"]),
        n("Sub", ["x2", "x1"], ["bw"]),
        n("Sub", ["y2", "y1"], ["bh"]),
    ]
    score = "score0"
    if gflops > 0:
        # 3x3 convs, 32 channels, at half resolution: 2*9*32*32*(H/2)*(W/2) FLOPs each.
        per_conv = 2 * 9 * 32 * 32 * (HEIGHT // 2) * (WIDTH // 2) / 1e9
        convs = max(1, round(gflops / per_conv))
        rng = np.random.default_rng(0)
        inits["w0"] = (rng.standard_normal((32, 3, 3, 3)) * 0.1).astype(np.float32)
        nodes.append(n("Conv", ["images", "w0"], ["f0"], strides=[2, 2], pads=[1, 1, 1, 1]))
        prev = "f0"
        for i in range(1, convs + 1):
            inits[f"w{i}"] = (rng.standard_normal((32, 32, 3, 3)) * 0.05).astype(np.float32)
            nodes.append(n("Conv", [prev, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1]))
            nodes.append(n("Relu", [f"c{i}"], [f"f{i}"]))
            prev = f"f{i}"
        nodes += [
            n("ReduceMean", [prev], ["pad_mean"], axes=[1, 2, 3], keepdims=0),  # [N]
            n("Mul", ["pad_mean", "tiny"], ["pad_tiny"]),
            n("Unsqueeze", ["pad_tiny", "ax1"], ["pad_col"]),  # [N,1]
            n("Add", ["score0", "pad_col"], ["score"]),
        ]
        score = "score"
    parts = []
    for name in ("cx", "cy", "bw", "bh", score):
        nodes.append(n("Unsqueeze", [name, "ax1"], [f"{name}_u"]))  # [N,1,L]
        parts.append(f"{name}_u")
    nodes.append(n("Concat", parts, ["output0"], axis=1))  # [N,5,L]
    graph = helper.make_graph(
        nodes,
        "lanes",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, HEIGHT, WIDTH])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, ["N", 5, LANES])],
        initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def write_repo(root: Path, gflops: float, backend: str, instances: int) -> Path:
    import onnx

    folder = root / "walkers"
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(lane_detector(gflops), folder / "model.onnx")
    (folder / "config.yaml").write_text(
        f"""name: walkers
backend: {backend}
model_file: {{path: model.onnx}}
max_batch_size: 8
input: {{name: images, shape: [3, {HEIGHT}, {WIDTH}], resize: letterbox, pad_value: 114}}
task: {{kind: yolo, layout: yolov8, confidence: 0.5}}
labels: [person]
dynamic_batching: {{max_queue_delay_microseconds: 2000}}
instance_group: [{{count: {instances}, kind: KIND_CPU}}]
"""
        # bf16 would round box corners near x=640 to 4 px; the option is OpenVINO's alone.
        + ("backend_options: {precision: f32}\n" if backend == "openvino" else "")
    )
    return root


def ultralytics_onnx(arch: str, out: Path) -> Path | None:
    """A YOLOv8 built from its architecture file and exported to ONNX at 640×384; None without ultralytics."""
    os.environ.setdefault("YOLO_OFFLINE", "1")  # no update checks, no downloads
    try:
        from ultralytics import YOLO  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    model = YOLO(arch)  # an architecture file (yolov8n.yaml): built, not downloaded
    exported = model.export(format="onnx", imgsz=(HEIGHT, WIDTH), dynamic=True, simplify=False)
    path = Path(str(exported))
    target = out / path.name
    path.replace(target)
    return target


def ms_per_frame(model_path: Path, runs: int = 20) -> float:
    """Median milliseconds of one 640x384 frame through OpenVINO on the CPU (latency hint)."""
    import openvino as ov

    compiled = ov.Core().compile_model(str(model_path), "CPU", {"PERFORMANCE_HINT": "LATENCY"})
    request = compiled.create_infer_request()
    image = np.random.default_rng(0).random((1, 3, HEIGHT, WIDTH), dtype=np.float32)
    request.infer({0: image})
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        request.infer({0: image})
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


# -- runs -----------------------------------------------------------------------------------

PIPELINE = """\
pipeline: cap
models: {models}
sources:
{sources}
stages:
  - {{name: people, type: infer, model: walkers{interval}}}
  - {{name: track, type: track}}
  - {{name: gate, type: zones, lines: [{{name: middle, points: [[{line}, 0], [{line}, {height}]]}}]}}
nats: {{publish: core}}
"""

CONFIGS = {
    "every frame": "",
    "interval 2": ", interval: 2",
    "interval 4": ", interval: 4",
    "auto": ", interval: auto",
}


@dataclass
class Result:
    frames: dict[str, int] = field(default_factory=dict)
    crossings: dict[str, int] = field(default_factory=dict)
    ids: dict[str, set[int]] = field(default_factory=dict)
    lateness: dict[str, list[float]] = field(default_factory=dict)
    detector_calls: int = 0
    seconds: float = 0.0
    reasons: dict[str, int] = field(default_factory=dict)  # interval: auto decisions (first reason)
    triggers: dict[str, int] = field(default_factory=dict)  # every reason that held, summed over sources


async def run(text: str, tmp: Path, fps: int, nats_url: str) -> Result:
    path = tmp / f"p{time.monotonic_ns()}.yaml"
    path.write_text(text)
    res = Result()
    starts: dict[str, float] = {}

    def published(frame: Frame) -> None:
        now = time.time()
        sid = frame.source
        res.frames[sid] = res.frames.get(sid, 0) + 1
        res.crossings[sid] = res.crossings.get(sid, 0) + sum(e.type == "line_cross" for e in frame.events)
        res.ids.setdefault(sid, set()).update(o.track_id for o in frame.objects if o.track_id is not None)
        # Lateness against the camera's clock: where this frame is in its stream.
        start = starts.setdefault(sid, t0)
        res.lateness.setdefault(sid, []).append(now - (start + frame.index / fps))

    runtime = Runtime(load_config(path), nats_url=nats_url, on_published=published)
    await runtime.prepare()
    t0 = time.time()
    runtime.start_sources()
    await runtime.wait(3600)
    res.seconds = time.time() - t0
    assert runtime.models is not None
    res.detector_calls = runtime.models.get("walkers").stats.batched_requests
    for family in text_string_to_metric_families(runtime.metrics.render().decode()):
        for sample in family.samples:
            if sample.name == "vidpipe_detector_frames_total":
                decision = sample.labels["decision"]
                res.reasons[decision] = res.reasons.get(decision, 0) + int(sample.value)
    for stage in runtime.stages:
        if isinstance(stage, InferStage):
            for counts in stage.detector_triggers().values():
                for reason, n in counts.items():
                    res.triggers[reason] = res.triggers.get(reason, 0) + n
    await runtime.stop()
    return res


def sources(clip: Path, n: int, realtime: bool) -> str:
    return "\n".join(
        f"  - {{id: cam{i}, url: {clip}, realtime: {str(realtime).lower()}, queue_size: 16}}"
        for i in range(n)
    )


async def accuracy(clip: Path, repo: Path, tmp: Path, fps: int, nats_url: str) -> dict[str, Result]:
    out = {}
    for name, interval in CONFIGS.items():
        text = PIPELINE.format(
            models=repo, sources=sources(clip, 1, False), interval=interval, line=LINE_X, height=HEIGHT
        )
        out[name] = await run(text, tmp, fps, nats_url)
    return out


def holds(res: Result, n: int, frames: int, reference: int) -> tuple[bool, str]:
    """Whether every one of ``n`` sources kept its frames, its lateness and its count."""
    problems = []
    for i in range(n):
        sid = f"cam{i}"
        kept = res.frames.get(sid, 0) / frames
        p99 = percentile(res.lateness.get(sid, []), 99)
        count = res.crossings.get(sid, 0)
        if kept < 0.95:
            problems.append(f"{sid} kept {kept:.0%}")
        if not p99 <= 1.0:
            problems.append(f"{sid} p99 {p99:.2f} s")
        if abs(count - reference) > 0.1 * reference:
            problems.append(f"{sid} counted {count} of {reference}")
    return not problems, "; ".join(problems[:3])


async def capacity(
    clip: Path, repo: Path, tmp: Path, fps: int, frames: int, interval: str, reference: int, limit: int,
    nats_url: str,
) -> tuple[int, list[list[str]]]:  # fmt: skip
    """The largest N (≤ ``limit``) that holds, and a row per N tried."""
    rows: list[list[str]] = []
    tried: dict[int, bool] = {}

    async def attempt(n: int) -> bool:
        text = PIPELINE.format(
            models=repo, sources=sources(clip, n, True), interval=interval, line=LINE_X, height=HEIGHT
        )
        # Every frame of a paced clip is due by its end: the window is the clip's length.
        res = await run(text, tmp, fps, nats_url)
        ok, why = holds(res, n, frames, reference)
        late = [v for lat in res.lateness.values() for v in lat]
        rows.append(
            [str(n), f"{min(res.frames.values(), default=0) / frames:.0%}", f"{percentile(late, 99):.2f}",
             f"{res.detector_calls / max(1, sum(res.frames.values())):.2f}", "yes" if ok else f"no: {why}"]
        )  # fmt: skip
        print(f"#   N={n}: {rows[-1][-1]}", flush=True)
        tried[n] = ok
        return ok

    n = 1
    while n <= limit and await attempt(n):
        n *= 2
    good = max([k for k, v in tried.items() if v], default=0)
    bad = min([k for k, v in tried.items() if not v], default=limit + 1)
    while bad - good > 1:
        mid = (good + bad) // 2
        if await attempt(mid):
            good = mid
        else:
            bad = mid
    return good, rows


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


async def main_async(args: argparse.Namespace) -> int:
    frames = args.seconds * args.fps
    scene = make_scene(frames, args.seed)
    nats = EmbeddedNats().start()
    try:
        return await measure(args, frames, scene, nats.url)
    finally:
        nats.stop()


async def measure(args: argparse.Namespace, frames: int, scene: Scene, nats_url: str) -> int:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        clip = write_scene(tmp / "walkers.mp4", scene, args.fps)
        repo = write_repo(tmp / "models", args.gflops, args.backend, args.instances)
        print(
            f"# scene: {frames} frames ({args.seconds} s at {args.fps} fps), {WIDTH}x{HEIGHT}, "
            f"{LANES} lanes, "
            f"{scene.crossings} true crossings; detector: lanes + {args.gflops:g} GFLOPs of convolutions, "
            f"{args.backend}, {args.instances} instance(s)"
        )
        if args.ultralytics:
            onnx_path = ultralytics_onnx(args.ultralytics, tmp)
            if onnx_path is None:
                print("# ultralytics is not installed (pip install -e '.[bench]'): the padded lanes stand in")
            else:
                yolo_ms = ms_per_frame(onnx_path)
                lanes_ms = ms_per_frame(repo / "walkers" / "model.onnx")
                print(
                    f"# {args.ultralytics} exported ({onnx_path.name}): {yolo_ms:.1f} ms a frame alone "
                    f"on OpenVINO; the lane detector with {args.gflops:g} GFLOPs: {lanes_ms:.1f} ms"
                )
        acc = await accuracy(clip, repo, tmp, args.fps, nats_url)
        every = acc["every frame"]
        ref_count = every.crossings.get("cam0", 0)
        ref_ids = len(every.ids.get("cam0", set()))
        rows = []
        for name, res in acc.items():
            count, ids, seen = (
                res.crossings.get("cam0", 0),
                len(res.ids.get("cam0", set())),
                res.frames.get("cam0", 0),
            )
            rows.append(
                [name, str(count), f"{count / max(1, ref_count):.2f}", str(ids),
                 f"{ids / max(1, ref_ids):.2f}", f"{res.detector_calls}/{seen}",
                 f"{res.detector_calls / max(1, seen):.2f}", f"{seen / max(1e-9, res.seconds):.1f}"]
            )  # fmt: skip
        print(f"# accuracy (the file as fast as it goes); true crossings {scene.crossings}")
        reasons = sorted(acc["auto"].reasons.items(), key=lambda kv: -kv[1])
        print("# auto decisions (first reason): " + ", ".join(f"{k} {v}" for k, v in reasons))
        auto_runs = max(1, acc["auto"].detector_calls)
        held = sorted(acc["auto"].triggers.items(), key=lambda kv: -kv[1])
        print(
            "# auto triggers (every reason that held; share of the frames the detector ran on): "
            + ", ".join(f"{k} {v} ({v / auto_runs:.2f})" for k, v in held)
        )
        print(table(["config", "crossings", "vs every frame", "track ids", "vs every frame", "detector runs",
                     "share", "fps"], rows))  # fmt: skip
        found: dict[str, int] = {}
        if not args.accuracy_only:
            for name in ("every frame", "auto"):
                print(f"# capacity: {name}")
                n, cap_rows = await capacity(
                    clip, repo, tmp, args.fps, frames, CONFIGS[name], ref_count, args.max_cameras, nats_url
                )
                found[name] = n
                print(
                    table(
                        ["cameras", "min frames kept", "p99 lateness s", "detector share", "holds"], cap_rows
                    )
                )
        auto = acc["auto"]
        share = auto.detector_calls / max(1, auto.frames.get("cam0", 0))
        count_ratio = auto.crossings.get("cam0", 0) / max(1, ref_count)
        ids_ratio = len(auto.ids.get("cam0", set())) / max(1, ref_ids)
        n_every, n_auto = found.get("every frame", math.nan), found.get("auto", math.nan)
        per_core = n_auto / cores() if found else math.nan
        ratio = n_auto / n_every if found and n_every else math.nan
        print(
            f"cameras_per_core={per_core:.2f} cameras_every_frame={n_every} cameras_auto={n_auto} "
            f"auto_capacity_ratio={ratio:.2f} auto_detector_share={share:.3f} "
            f"auto_count_ratio={count_ratio:.3f} auto_ids_ratio={ids_ratio:.3f}"
        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--fps", type=int, default=10)
    parser.add_argument(
        "--gflops", type=float, default=5.0, help="extra detector cost (YOLOv8n at 640x384 ≈ 5)"
    )
    parser.add_argument("--backend", default="openvino", choices=["openvino", "onnxruntime"])
    parser.add_argument("--instances", type=int, default=1)
    parser.add_argument("--max-cameras", type=int, default=32)
    parser.add_argument("--seed", type=int, default=7, help="another scene: other walkers, speeds and stops")
    parser.add_argument("--accuracy-only", action="store_true", help="only the counts; no capacity search")
    parser.add_argument("--ultralytics", default="", help="e.g. yolov8n.yaml: build and export it too")
    parser.add_argument("--quick", action="store_true", help="10 s, no padding, counts only: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.gflops, args.accuracy_only = 10, 0.0, True
    print(f"# capacity bench, {utc_now()}, {cpu_name()}, {cores()} cores, load {describe_load()}")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
