"""Defaults against the ceiling: a model onboarded by ``vidpipe models add``, as it comes, at 1-8 streams.

    python bench/defaults.py [--gflops 5] [--streams 1,2,4,8] [--rounds 2] [--seconds 10] [--onnx FILE]
                             [--instances N] [--admission paced,eager] [--interval N]

1. **The model.** The lane detector of ``bench/capacity.py`` (YOLOv8 output layout,
   a dynamic batch axis) padded with ``--gflops`` of convolutions, so it costs what
   a real detector costs, or any YOLO ONNX file given with ``--onnx``. It is added
   with the real command, ``vidpipe models add FILE --repo DIR`` (the backend and
   the instance count are what the command picks; its output is printed).
2. **The ceiling.** The same ONNX file on OpenVINO alone, as ``benchmark_app``
   measures it in throughput mode: compiled with ``PERFORMANCE_HINT: THROUGHPUT``,
   batch 1, an ``AsyncInferQueue`` of the optimal number of requests, pre-made
   inputs, no decode: inferences per second, and one request's median latency
   there (requests share the cores, so each takes longer than alone). The
   **inference time** is one request's median latency compiled with the latency hint.
3. **The pipeline.** N looping file sources of the capacity scene (640×384, read as
   fast as the graph takes them) → ``infer`` with the added model → core NATS
   publish (embedded server), with the config's defaults (``max_in_flight``
   derived). Frames published per second in a window after a warm-up, and the p50
   of each frame's time in the graph (the sum of its stage times: batcher queue,
   inference, decode of the outputs). Each stream count runs once per
   ``runtime.admission`` of ``--admission`` (default both: ``paced``, the default,
   and ``eager``, what vidpipe did before it), one after the other. With
   ``--interval N`` the stage has ``interval: N``: frames/s and the p50 then count
   only the frames the detector ran on (every N+1th of a source).

Every round runs ceiling, 1 stream paced, ceiling, 1 stream eager, ceiling, 2
streams paced, ... so a busy machine slows both sides alike; a pipeline run's
ratio is against the mean of the two ceilings beside it. The last line (one per
admission, the first being the default's)::

    defaults_ratio_min=… defaults_latency_max=…   (ratio = pipeline / ceiling; latency in inference times)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.capacity import HEIGHT, WIDTH, lane_detector, make_scene, ms_per_frame, write_scene
from bench.common import cpu_name, describe_load, percentile, table, utc_now
from pipeline.config import load_config
from pipeline.frames import Frame
from pipeline.nats_server import EmbeddedNats
from pipeline.runtime import Runtime

Run = tuple[int, str]  # streams, runtime.admission

PIPELINE = """\
pipeline: defaults
models: {repo}
sources:
{sources}
stages:
  - {{name: detect, type: infer, model: {model}, interval: {interval}}}
nats: {{publish: core}}
runtime: {{admission: {admission}}}
"""


def onboard(onnx_path: Path, repo: Path, instances: int = 0) -> tuple[str, str]:
    """``vidpipe models add`` as a user runs it: the model's name and what the command printed."""
    extra = ["--instances", str(instances)] if instances else []
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "models", "add", str(onnx_path), "--repo", str(repo), *extra],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"vidpipe models add failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return onnx_path.stem, proc.stdout


def ceiling(onnx_path: Path, seconds: float) -> tuple[float, float]:
    """Inferences per second of OpenVINO alone in throughput mode (batch 1, pre-made inputs),
    and one request's median latency there (seconds), as ``benchmark_app`` reports both."""
    import openvino as ov

    core = ov.Core()
    model = core.read_model(str(onnx_path))
    name = model.inputs[0].get_any_name()
    shape = [1, *[d.get_length() for d in list(model.inputs[0].get_partial_shape())[1:]]]
    model.reshape({name: ov.PartialShape(shape)})
    compiled = core.compile_model(model, "CPU", {"PERFORMANCE_HINT": "THROUGHPUT"})
    requests = compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS")
    image = np.random.default_rng(0).random(shape, dtype=np.float32)
    queue = ov.AsyncInferQueue(compiled, requests)
    latencies: list[float] = []

    def finished(_request: Any, started: float) -> None:
        latencies.append(time.perf_counter() - started)

    queue.set_callback(finished)
    for _ in range(requests):  # warm-up: every request once
        queue.start_async({0: image}, time.perf_counter())
    queue.wait_all()
    latencies.clear()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        queue.start_async({0: image}, time.perf_counter())  # blocks while every request is busy
    queue.wait_all()
    return len(latencies) / (time.perf_counter() - t0), statistics.median(latencies)


async def pipeline(
    clip: Path,
    repo: Path,
    model: str,
    streams: int,
    admission: str,
    seconds: float,
    warmup: float,
    nats_url: str,
    tmp: Path,
    interval: int = 0,
) -> tuple[float, float, int, float]:
    """Frames/s detected, their p50 seconds in the graph, the derived max_in_flight, the share paced."""
    sources = "\n".join(
        f"  - {{id: cam{i}, url: {clip}, realtime: false, loop: true}}" for i in range(streams)
    )
    path = tmp / f"defaults-{streams}-{time.monotonic_ns()}.yaml"
    path.write_text(
        PIPELINE.format(repo=repo, sources=sources, model=model, admission=admission, interval=interval)
    )
    published: list[tuple[float, float]] = []

    def on_published(frame: Frame) -> None:
        if frame.index % (interval + 1) == 0:  # a frame the detector ran on
            published.append((time.perf_counter(), sum(frame.stage_times.values())))

    runtime = Runtime(load_config(path), nats_url=nats_url, on_published=on_published)
    await runtime.start()
    try:
        await asyncio.sleep(warmup)
        start = time.perf_counter()
        held, taken = runtime.pacer.paced, accepted(runtime)
        await asyncio.sleep(seconds)
        end = time.perf_counter()
        # Of the frames the graph took in the window, the share whose admission was held.
        paced = (runtime.pacer.paced - held) / max(1, accepted(runtime) - taken)
        in_flight = runtime.max_in_flight(streams)
    finally:
        await runtime.stop()
    inside = [graph for t, graph in published if start <= t <= end]
    return len(inside) / (end - start), percentile(inside, 50), in_flight, paced


def accepted(runtime: Runtime) -> int:
    """Frames the graph has taken from all sources' queues."""
    return sum(run.counters.accepted for run in runtime.sources.values())


async def measure(args: argparse.Namespace, nats_url: str) -> int:
    counts = [int(n) for n in args.streams.split(",")]
    admissions = args.admission.split(",")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if args.onnx:
            onnx_path = Path(args.onnx).resolve()
        else:
            import onnx

            onnx_path = tmp / "lanes.onnx"
            onnx.save(lane_detector(args.gflops), onnx_path)
        clip = write_scene(tmp / "walkers.mp4", make_scene(args.frames), 10)
        repo = tmp / "models"
        repo.mkdir()
        model, said = onboard(onnx_path, repo, args.instances)
        print("# vidpipe models add " + onnx_path.name + ":")
        print("\n".join("#   " + line for line in said.strip().splitlines()))
        infer_ms = ms_per_frame(onnx_path)
        print(f"# inference time (latency hint, batch 1, median): {infer_ms:.1f} ms; frames {WIDTH}x{HEIGHT}")
        if args.interval:
            print(f"# interval: {args.interval}: frames/s and p50 of the frames the detector ran on")
        runs = [(n, a) for n in counts for a in admissions]
        ratios: dict[Run, list[float]] = {k: [] for k in runs}
        latency: dict[Run, list[float]] = {k: [] for k in runs}
        vs_request: dict[Run, list[float]] = {k: [] for k in runs}
        rates: dict[Run, list[float]] = {k: [] for k in runs}
        ceilings: list[float] = []
        request_ms: list[float] = []
        in_flight: dict[Run, int] = {}
        for r in range(args.rounds):
            before, before_ms = ceiling(onnx_path, args.seconds)
            ceilings.append(before)
            request_ms.append(before_ms * 1e3)
            print(f"# round {r + 1}: ceiling {before:.2f}/s, request {before_ms * 1e3:.1f} ms", flush=True)
            for k in runs:
                n, admission = k
                fps, p50, in_flight[k], paced = await pipeline(
                    clip, repo, model, n, admission, args.seconds, args.warmup, nats_url, tmp, args.interval
                )
                after, after_ms = ceiling(onnx_path, args.seconds)
                ceilings.append(after)
                request_ms.append(after_ms * 1e3)
                ref = (before + after) / 2
                ratios[k].append(fps / ref)
                latency[k].append(p50 * 1e3 / infer_ms)
                vs_request[k].append(p50 / ((before_ms + after_ms) / 2))
                rates[k].append(fps)
                print(
                    f"#   {n} streams {admission}: {fps:.2f} frames/s, ceiling {ref:.2f}/s: {fps / ref:.2f}; "
                    f"p50 in the graph {p50 * 1e3:.0f} ms = {p50 * 1e3 / infer_ms:.2f} inference times; "
                    f"{vs_request[k][-1]:.2f} ceiling requests; "
                    f"max_in_flight {in_flight[k]}; {paced:.0%} of frames paced; "
                    f"ceiling after {after:.2f}/s; load {describe_load()}",
                    flush=True,
                )
                before, before_ms = after, after_ms
        rows = [
            [str(k[0]), k[1], f"{statistics.median(rates[k]):.2f}", f"{statistics.median(ratios[k]):.2f}",
             f"{min(ratios[k]):.2f}-{max(ratios[k]):.2f}", f"{statistics.median(latency[k]):.2f}",
             f"{statistics.median(vs_request[k]):.2f}", str(in_flight[k])]
            for k in runs
        ]  # fmt: skip
        print(
            f"# ceiling {statistics.median(ceilings):.2f}/s (median of {len(ceilings)}), "
            f"a request there {statistics.median(request_ms):.1f} ms"
        )
        header = ["streams", "admission", "frames/s", "vs ceiling (median)", "range", "p50 / inference time"]
        print(table([*header, "p50 / request", "max_in_flight"], rows))
        for admission in admissions:
            worst = min(statistics.median(ratios[(n, admission)]) for n in counts)
            slowest = max(statistics.median(latency[(n, admission)]) for n in counts)
            print(f"{admission}: defaults_ratio_min={worst:.3f} defaults_latency_max={slowest:.2f}")
    return 0


async def main_async(args: argparse.Namespace) -> int:
    nats = EmbeddedNats().start()
    try:
        return await measure(args, nats.url)
    finally:
        nats.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gflops", type=float, default=5.0, help="the lane detector's padding (YOLOv8n ≈ 5)")
    parser.add_argument("--onnx", default="", help="a YOLO ONNX file to add instead of the lane detector")
    parser.add_argument("--streams", default="1,2,4,8")
    parser.add_argument(
        "--instances", type=int, default=0, help="passed to models add (default: what its measurement picks)"
    )
    parser.add_argument(
        "--admission", default="paced,eager", help="runtime.admission values to run, in this order"
    )
    parser.add_argument(
        "--interval", type=int, default=0, help="the stage's interval (0: the detector runs on every frame)"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=4.0)
    parser.add_argument("--frames", type=int, default=100, help="frames of the looping clip")
    parser.add_argument("--quick", action="store_true", help="1 round, 3 s, 1 and 2 streams: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.seconds, args.warmup, args.streams, args.gflops = 1, 3.0, 2.0, "1,2", 1.0
    print(f"# defaults bench, {utc_now()}, {cpu_name()}, load {describe_load()}")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
