"""GPU benchmark: decode, pre-processing, TensorRT batches, and the full path against a naive loop.

    python bench/gpu.py                      # a few minutes on one GPU
    python bench/gpu.py --frames 30 --streams 8,16 --seconds 1
    OUT=/tmp/results python bench/gpu.py     # also writes $OUT/gpu_bench.json

Sections:

1. decode: a 1280×720 H.264 clip to RGB arrays, NVDEC (CUDA hwaccel) vs FFmpeg software;
2. preprocess: 16 frames → a 16×3×640×640 letterboxed tensor, the fused kernel vs
   ImagePreprocessor (kernel alone, and including the host→device copy);
3. TensorRT (PP-OCRv4 det at 640×640 and the squares detector at 320×320) at batch
   1/2/4/8/16/32: latency per batch and images per second;
4. full path for 8/16/32 streams: decode → GPU pre-processing → batched TensorRT, against the
   naive per-frame loop (per stream: software decode → OpenCV pre-processing → batch-1 run
   on the same GPU: ONNX Runtime's CUDA provider when installed, else TensorRT at batch 1).

Engine plans are cached in ``$VIDPIPE_CACHE_DIR`` (default ``~/.cache/vidpipe/trt``), so a
second run skips the builds. Without a usable GPU it prints ``no GPU: <reason>`` and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from inference.device import gpu_available  # noqa: E402

BATCHES = (1, 2, 4, 8, 16, 32)


def _det_config(max_batch: int = 32, fp16: bool = True) -> Any:
    from inference.config import (
        InputConfig,
        InstanceGroup,
        ModelConfig,
        ModelFile,
        TaskConfig,
        TensorRTOptions,
    )

    return ModelConfig(
        name="ppocr_det",
        model_file=ModelFile(package="rapidocr_onnxruntime", path="models/ch_PP-OCRv4_det_infer.onnx"),
        input=InputConfig(
            shape=[3, 640, 640], name="x", color="bgr", mean=[0.5] * 3, std=[0.5] * 3, pad_value=0
        ),
        task=TaskConfig(kind="text_detect"),
        backend="tensorrt",
        max_batch_size=max_batch,
        instance_group=[InstanceGroup(kind="KIND_GPU")],
        backend_options=TensorRTOptions(fp16=fp16, workspace_mb=4096),
    )


def _squares_config(max_batch: int = 32, fp16: bool = True) -> Any:
    from inference.config import (
        InputConfig,
        InstanceGroup,
        ModelConfig,
        ModelFile,
        TaskConfig,
        TensorRTOptions,
    )

    return ModelConfig(
        name="squares",
        model_file=ModelFile(path="model.onnx"),
        input=InputConfig(shape=[3, 320, 320], name="images"),
        task=TaskConfig(kind="yolo"),
        backend="tensorrt",
        max_batch_size=max_batch,
        instance_group=[InstanceGroup(kind="KIND_GPU")],
        backend_options=TensorRTOptions(fp16=fp16),
    )


def _model_path(config: Any) -> Path:
    from inference.model import resolve_model_file

    return resolve_model_file(config, ROOT / "samples" / "models" / config.name)


def _decode_all(path: Path, mode: str) -> tuple[list[np.ndarray], str]:
    from pipeline.sources.decode import open_with_hwaccel

    container, how = open_with_hwaccel(str(path), decode=mode)  # type: ignore[arg-type]
    frames = []
    with container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for frame in container.decode(stream):
            frames.append(frame.to_ndarray(format="rgb24"))
    return frames, how


def bench_decode(clip: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("cpu", "cuda"):
        try:
            _decode_all(clip, mode)  # warm-up (hardware context, page cache)
            start = time.perf_counter()
            frames, how = _decode_all(clip, mode)
            elapsed = time.perf_counter() - start
            out[mode] = {"decoder": how, "frames": len(frames), "fps": len(frames) / elapsed}
        except Exception as exc:
            out[mode] = {"error": f"{exc.__class__.__name__}: {exc}"}
    return out


def _timed(fn: Callable[[], Any], sync: Callable[[], Any], seconds: float, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 5:
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def bench_preprocess(frames: Sequence[np.ndarray], seconds: float) -> dict[str, Any]:
    import cupy as cp

    from inference.gpu.preprocess import GpuPreprocessor
    from inference.processing.resize import ImagePreprocessor

    config = _det_config().input
    batch = list(frames[:16])
    n = len(batch)
    host_out = np.empty((n, 3, 640, 640), np.float32)
    cpu = ImagePreprocessor(config)
    cpu_times = _timed(lambda: cpu(batch, host_out), lambda: None, seconds)
    stream = cp.cuda.Stream(non_blocking=True)
    gpu = GpuPreprocessor(config, max_batch=n, stream=stream)
    dev_out = cp.empty((n, 3, 640, 640), cp.float32)
    on_device = [cp.asarray(f) for f in batch]
    kernel_times = _timed(lambda: gpu(on_device, dev_out), stream.synchronize, seconds)
    staged_times = _timed(lambda: gpu(batch, dev_out), stream.synchronize, seconds)
    stream.synchronize()
    diff = float(np.abs(dev_out.get() - host_out).max())
    return {
        "batch": n,
        "source": f"{batch[0].shape[1]}x{batch[0].shape[0]}",
        "cpu_ms": 1e3 * statistics.median(cpu_times),
        "gpu_kernel_ms": 1e3 * statistics.median(kernel_times),
        "gpu_with_upload_ms": 1e3 * statistics.median(staged_times),
        "max_abs_diff_vs_cpu": diff,
    }


def bench_tensorrt(config: Any, seconds: float) -> dict[str, Any]:
    import cupy as cp

    from inference.backends.tensorrt import TensorRTBackend

    started = time.perf_counter()
    backend = TensorRTBackend(config, _model_path(config), 0)
    load_s = time.perf_counter() - started
    c, h, w = config.input.shape
    rows = []
    try:
        for b in BATCHES:
            x = cp.asarray(np.random.default_rng(b).random((b, c, h, w), dtype=np.float32))
            times = _timed(
                lambda x=x: backend.run_device({backend.input_name: x}), backend.stream.synchronize, seconds
            )
            median = statistics.median(times)
            rows.append(
                {
                    "batch": b,
                    "latency_ms": 1e3 * median,
                    "p90_ms": 1e3 * float(np.percentile(times, 90)),
                    "images_per_s": b / median,
                }
            )
    finally:
        backend.close()
    return {"model": config.name, "cache_hit": backend.cache_hit, "load_s": load_s, "batches": rows}


def _decode_into(path: Path, mode: str, sink: Callable[[np.ndarray], None], stop: threading.Event) -> str:
    from pipeline.sources.decode import open_with_hwaccel

    container, how = open_with_hwaccel(str(path), decode=mode)  # type: ignore[arg-type]
    with container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for frame in container.decode(stream):
            if stop.is_set():
                break
            sink(frame.to_ndarray(format="rgb24"))
    return how


def full_path(clip: Path, streams: int, decode: str, max_batch: int = 32) -> dict[str, Any]:
    """Decode threads → shared queue → batches of up to ``max_batch`` → GPU pre-processing → TensorRT."""
    import cupy as cp

    from inference.backends.tensorrt import TensorRTBackend
    from inference.gpu.preprocess import GpuPreprocessor

    config = _det_config(max_batch)
    backend = TensorRTBackend(config, _model_path(config), 0)
    pre = GpuPreprocessor(config.input, max_batch=max_batch, stream=backend.stream)
    tensor = cp.empty((max_batch, 3, 640, 640), cp.float32)
    frames: queue.Queue[np.ndarray | None] = queue.Queue(maxsize=4 * max_batch)
    stop = threading.Event()
    decoders: list[str] = []

    def decoder() -> None:
        try:
            decoders.append(_decode_into(clip, decode, frames.put, stop))
        finally:
            frames.put(None)

    threads = [threading.Thread(target=decoder, daemon=True) for _ in range(streams)]
    done = processed = batches = 0
    start = time.perf_counter()
    for t in threads:
        t.start()
    try:
        while done < streams:
            batch: list[np.ndarray] = []
            item = frames.get()
            while True:
                if item is None:
                    done += 1
                else:
                    batch.append(item)
                if len(batch) >= max_batch or done >= streams:
                    break
                try:
                    item = frames.get_nowait()
                except queue.Empty:
                    break
            if batch:
                pre(batch, tensor)
                backend.run_device({backend.input_name: tensor[: len(batch)]})
                backend.stream.synchronize()
                processed += len(batch)
                batches += 1
        elapsed = time.perf_counter() - start
    finally:
        stop.set()
        backend.close()
    return {
        "frames": processed,
        "fps": processed / elapsed,
        "mean_batch": processed / max(1, batches),
        "decoder": sorted(set(decoders)),
    }


def naive_loop(clip: Path, streams: int) -> dict[str, Any]:
    """Per stream: software decode → OpenCV pre-processing → a batch-1 run, on the same GPU."""
    import onnxruntime as ort

    from inference.processing.resize import ImagePreprocessor

    config = _det_config(max_batch=1)
    path = _model_path(config)
    lock = threading.Lock()
    if "CUDAExecutionProvider" in ort.get_available_providers():
        session = ort.InferenceSession(str(path), providers=["CUDAExecutionProvider"])
        runner = "onnxruntime-cuda"

        def infer(x: np.ndarray) -> Any:
            return session.run(None, {"x": x})
    else:
        from inference.backends.tensorrt import TensorRTBackend

        backend = TensorRTBackend(config, path, 0)
        runner = "tensorrt-batch1"

        def infer(x: np.ndarray) -> Any:
            with lock:  # one execution context: calls take turns
                return backend.run({backend.input_name: x})

    counts = [0] * streams
    stop = threading.Event()

    def worker(i: int) -> None:
        pre = ImagePreprocessor(config.input)
        tensor = np.empty((1, 3, 640, 640), np.float32)

        def sink(image: np.ndarray) -> None:
            pre([image], tensor)
            infer(tensor)
            counts[i] += 1

        _decode_into(clip, "cpu", sink, stop)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(streams)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if runner == "tensorrt-batch1":
        backend.close()
    return {"frames": sum(counts), "fps": sum(counts) / elapsed, "runner": runner}


def _print_report(results: dict[str, Any]) -> None:
    print(f"\nGPU: {results['gpu']}")
    dec = results.get("decode", {})
    print("\ndecode (1280x720 H.264 → RGB)")
    for mode, row in dec.items():
        print(
            f"  {mode:5s} " + (f"{row['fps']:8.1f} fps ({row['decoder']})" if "fps" in row else row["error"])
        )
    if "cpu" in dec and "cuda" in dec and "fps" in dec["cpu"] and "fps" in dec["cuda"]:
        print(f"  NVDEC / CPU: {dec['cuda']['fps'] / dec['cpu']['fps']:.2f}x")
    pre = results.get("preprocess")
    if pre:
        print(f"\npreprocess ({pre['batch']} × {pre['source']} → 640x640 letterbox, float32)")
        print(f"  CPU ImagePreprocessor   {pre['cpu_ms']:8.2f} ms")
        speedup = pre["cpu_ms"] / pre["gpu_kernel_ms"]
        print(f"  GPU kernel (on device)  {pre['gpu_kernel_ms']:8.2f} ms  ({speedup:.1f}x)")
        print(f"  GPU incl. upload        {pre['gpu_with_upload_ms']:8.2f} ms")
        print(f"  max |GPU - CPU|         {pre['max_abs_diff_vs_cpu']:.5f}")
    for entry in results.get("tensorrt", []):
        if "error" in entry:
            print(f"\nTensorRT {entry['model']}: {entry['error']}")
            continue
        hit = "plan cache hit" if entry["cache_hit"] else "built"
        print(f"\nTensorRT {entry['model']} ({hit}, load {entry['load_s']:.1f}s)")
        print("  batch  latency ms   p90 ms   images/s")
        for row in entry["batches"]:
            b, lat, p90, ips = row["batch"], row["latency_ms"], row["p90_ms"], row["images_per_s"]
            print(f"  {b:5d}  {lat:10.2f} {p90:8.2f} {ips:10.1f}")
    rows = results.get("streams", [])
    if rows:
        print("\nfull path, PP-OCR det 640x640 (frames/s over all streams)")
        print("  streams   batched GPU    naive loop   ratio")
        for row in rows:
            g, n = row["gpu"], row["naive"]
            if "fps" in g and "fps" in n:
                ratio = g["fps"] / n["fps"]
                print(f"  {row['streams']:7d}   {g['fps']:11.1f}   {n['fps']:11.1f}   {ratio:5.2f}x")
            else:
                print(
                    f"  {row['streams']:7d}   {g.get('fps', g.get('error'))}   {n.get('fps', n.get('error'))}"
                )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=60, help="frames per generated clip")
    parser.add_argument("--seconds", type=float, default=1.5, help="timing window per measurement")
    parser.add_argument("--streams", default="8,16,32", help="stream counts for the full path")
    args = parser.parse_args(argv)

    ok, reason = gpu_available()
    if not ok:
        print(f"no GPU: {reason}")
        return 0
    import importlib.util

    from samples.make_clip import write_clip

    results: dict[str, Any] = {"gpu": reason}
    have_trt = importlib.util.find_spec("tensorrt") is not None
    with tempfile.TemporaryDirectory() as tmp:
        clip = write_clip(Path(tmp) / "clip720.mp4", frames=args.frames, fps=15, width=1280, height=720)
        print("decode ...", flush=True)
        results["decode"] = bench_decode(clip)
        frames, _ = _decode_all(clip, "cpu")
        print("preprocess ...", flush=True)
        results["preprocess"] = bench_preprocess(frames, args.seconds)
        if not have_trt:
            results["tensorrt"] = [{"model": "all", "error": "tensorrt is not installed"}]
        else:
            results["tensorrt"] = []
            for config in (_det_config(), _squares_config()):
                print(
                    f"TensorRT {config.name} (an engine build takes minutes the first time) ...", flush=True
                )
                try:
                    results["tensorrt"].append(bench_tensorrt(config, args.seconds))
                except Exception as exc:
                    results["tensorrt"].append(
                        {"model": config.name, "error": f"{exc.__class__.__name__}: {exc}"}
                    )
            decode = "cuda" if "fps" in results["decode"].get("cuda", {}) else "cpu"
            results["streams"] = []
            for streams in (int(s) for s in args.streams.split(",") if s.strip()):
                print(f"full path, {streams} streams ...", flush=True)
                row: dict[str, Any] = {"streams": streams}
                for key, fn in (
                    ("gpu", lambda s=streams: full_path(clip, s, decode)),
                    ("naive", lambda s=streams: naive_loop(clip, s)),
                ):
                    try:
                        row[key] = fn()
                    except Exception as exc:
                        row[key] = {"error": f"{exc.__class__.__name__}: {exc}"}
                results["streams"].append(row)
    _print_report(results)
    out_dir = os.environ.get("OUT")
    if out_dir:
        path = Path(out_dir) / "gpu_bench.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2))
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
