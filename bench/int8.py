"""INT8 against the float model, in one run: speed in the pipeline and agreement of the answers.

    python bench/int8.py [--streams 2] [--seconds 10] [--rounds 3] [--size 640] [--quick]

Both models are the real PP-OCR ONNX files of the rapidocr-onnxruntime wheel:

* the **detector** (ppocr_det, DB text detector, ``--size`` × ``--size`` letterboxed)
  is quantized by ``vidpipe models quantize``'s code (:func:`inference.quantize.quantize_model`)
  on the frames of a rendered clip of number plates (samples/make_clip.py), and its
  check (boxes paired at IoU ≥ 0.7 and per-frame counts, on every fourth frame,
  held out) is printed. Speed: the whole runtime (``pipeline.runtime.Runtime``),
  ``--streams`` file sources looping the clip as fast as they decode
  (``realtime: false``), one ``infer`` stage, core publishing to an embedded
  nats-server; frames published per second in a window after a warm-up. The
  float and the INT8 model are served with the same config (the shipped one:
  two instances, batches of up to sixteen, OpenVINO ``precision: auto``); only
  ``model_file`` differs.
* the **recogniser** (ppocr_rec, CTC, 48 × 320) is quantized on text-line crops cut
  from the same clip at the plates' known boxes, those of every fourth frame held
  out; the check is text equality.
  Speed: the inference layer (``Model.infer``, 16 callers, as the cascade stage
  sends crops), a number of answers timed after a warm-up.

Float and INT8 runs alternate (float, INT8, INT8, float, ...) over ``--rounds``;
the medians are compared. ``auto`` precision is bf16 on CPUs with AVX512-BF16 or
AMX and f32 elsewhere; the precision the float model ran in is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import cpu_name, describe_load, median, utc_now  # noqa: E402
from inference.quantize import HOLD_OUT_EVERY, QuantizeRefused, QuantizeResult, quantize_model  # noqa: E402
from inference.repository import read_source  # noqa: E402
from inference.tuning import TrialPoint, TrialRunner  # noqa: E402
from samples.make_clip import Plate, plates_at, text_box, write_clip  # noqa: E402

PLATES = (
    Plate("KA05 MX2231", start=0, y=40, x=40),
    Plate("GATE B7", start=0, y=250, x=380),
    Plate("VIDPIPE 42", start=0, y=130, speed=5.0),
    Plate("EXIT 12", start=30, y=190, speed=7.0),
    Plate("BUS 7A", start=60, y=300, speed=4.0),
)
PIPELINE = """\
pipeline: int8
models: {models}
sources:
{sources}
stages:
  - {{name: text, type: infer, model: {model}}}
nats: {{publish: core}}
"""


def decode(clip: Path) -> list[np.ndarray]:
    import av

    with av.open(str(clip)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


def crops_of(frames: Sequence[np.ndarray], indices: Sequence[int] | None = None) -> list[np.ndarray]:
    """The text lines of the frames at ``indices`` (all by default), cut at the plates' ink boxes."""
    by_text = {p.text: p for p in PLATES}
    out = []
    for i in range(len(frames)) if indices is None else indices:
        image = frames[i]
        h, w = image.shape[:2]
        for text, panel in plates_at(i, w, PLATES):
            x1, y1, x2, y2 = text_box(by_text[text], panel)
            out.append(np.ascontiguousarray(image[max(0, y1 - 2) : min(h, y2 + 2), max(0, x1 - 2) : x2 + 2]))
    return out


def add(repo: Path, name: str, shipped: str, wheel_file: str, shape: list[int] | None = None) -> None:
    """``repo/name``: the shipped config with the wheel's ONNX file copied in as version 1."""
    import rapidocr_onnxruntime

    folder = repo / name
    (folder / "1").mkdir(parents=True)
    shutil.copyfile(
        Path(rapidocr_onnxruntime.__file__).parent / "models" / wheel_file, folder / "1" / "model.onnx"
    )
    text = (ROOT / "samples" / "models" / shipped / "config.yaml").read_text()
    text = text.replace(f"name: {shipped}", f"name: {name}")
    text = text.replace(f"{{package: rapidocr_onnxruntime, path: models/{wheel_file}}}", "{path: model.onnx}")
    if shape is not None:
        text = text.replace("shape: [3, 640, 640]", f"shape: {shape}")
    (folder / "config.yaml").write_text(text)


def pipeline_rate(
    tmp: Path, repo: Path, model: str, clip: Path, streams: int, seconds: float, warmup: float
) -> float:
    """Frames/s published by the whole runtime serving ``model`` to ``streams`` looping sources."""
    from pipeline.config import load_config
    from pipeline.runtime import Runtime

    sources = "\n".join(f"  - {{id: s{i}, url: {clip}, loop: true, realtime: false}}" for i in range(streams))
    path = tmp / f"pipeline-{model}.yaml"
    path.write_text(PIPELINE.format(models=repo, sources=sources, model=model))
    cfg = load_config(path)
    stamps: list[float] = []

    async def main() -> float:
        runtime = Runtime(
            cfg, nats_url=NATS_URL, on_published=lambda frame: stamps.append(time.perf_counter())
        )
        await runtime.start()
        try:
            await asyncio.sleep(warmup)
            start = time.perf_counter()
            await asyncio.sleep(seconds)
            end = time.perf_counter()
        finally:
            await runtime.stop()
        return sum(start <= t <= end for t in stamps) / (end - start)

    return asyncio.run(main())


def layer_rate(repo: Path, model: str, images: list[np.ndarray], inferences: int) -> tuple[float, str]:
    """Answers/s of ``model`` under 16 closed-loop callers (the inference layer), and its precision."""
    source = read_source(repo, model)
    runner = TrialRunner(source, concurrency=16, inferences=inferences, images=images)
    result = asyncio.run(runner(TrialPoint.from_config(source.config)))
    if result.error:
        raise RuntimeError(f"{model}: {result.error}")
    return result.throughput, result.precision


NATS_URL = ""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=2, help="pipeline sources looping the clip")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured window per pipeline run")
    parser.add_argument("--warmup", type=float, default=4.0, help="seconds before each window")
    parser.add_argument("--rounds", type=int, default=3, help="float/INT8 pairs, order alternating")
    parser.add_argument("--size", type=int, default=640, help="detector input (the shipped config: 640)")
    parser.add_argument("--frames", type=int, default=120, help="frames of the rendered clip")
    parser.add_argument("--crop-inferences", type=int, default=256, help="answers timed per recogniser run")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round, short windows, 320 px")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    global NATS_URL
    args = parse_args(argv)
    if args.quick:
        args.rounds, args.seconds, args.warmup, args.size, args.frames, args.crop_inferences = (
            1,
            3.0,
            2.0,
            320,
            40,
            64,
        )
    from pipeline.nats_server import EmbeddedNats

    print(f"# bench/int8.py  {utc_now()}  cpu: {cpu_name()}  load before: {describe_load()}")
    with tempfile.TemporaryDirectory(prefix="vidpipe-int8-") as name:
        tmp = Path(name)
        clip = write_clip(tmp / "plates.mp4", args.frames, 15, 640, 360, plates=PLATES)
        frames = decode(clip)
        crops = crops_of(frames)
        repo = tmp / "models"
        shape = [3, args.size, args.size]
        for model in ("det_float", "det_int8"):
            add(repo, model, "ppocr_det", "ch_PP-OCRv4_det_infer.onnx", shape)
        for model in ("rec_float", "rec_int8"):
            add(repo, model, "ppocr_rec", "ch_PP-OCRv4_rec_infer.onnx")

        t0 = time.perf_counter()
        det_q: QuantizeResult = quantize_model(repo, "det_int8", frames)
        det_s = time.perf_counter() - t0
        print(f"detector quantized in {det_s:.0f} s on {det_q.calibration_frames} frames:")
        print(f"  {det_q.agreement.describe()}")
        t0 = time.perf_counter()
        rec_q: QuantizeResult | None = None
        try:
            # Held out by frame, as the detector's frames are: every fourth crop of the list
            # would be the same plate of every frame (four plates a frame), never seen calibrating.
            held = [i for i in range(len(frames)) if i % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1]
            calibrate = [i for i in range(len(frames)) if i % HOLD_OUT_EVERY != HOLD_OUT_EVERY - 1]
            rec_q = quantize_model(
                repo, "rec_int8", crops_of(frames, calibrate), held_out=crops_of(frames, held)
            )
        except QuantizeRefused as exc:
            # The check doing its job: report it, and measure only what was written.
            print(f"recogniser refused after {time.perf_counter() - t0:.0f} s: {exc}")
        else:
            took = time.perf_counter() - t0
            print(f"recogniser quantized in {took:.0f} s on {rec_q.calibration_frames} crops:")
            print(f"  {rec_q.agreement.describe()}")

        nats = EmbeddedNats().start()
        NATS_URL = nats.url
        det = {"det_float": [], "det_int8": []}  # type: dict[str, list[float]]
        rec = {"rec_float": [], "rec_int8": []}  # type: dict[str, list[float]]
        precision = ""
        try:
            for r in range(args.rounds):
                order = ("det_float", "det_int8") if r % 2 == 0 else ("det_int8", "det_float")
                for model in order:
                    rate = pipeline_rate(tmp, repo, model, clip, args.streams, args.seconds, args.warmup)
                    det[model].append(rate)
                    print(
                        f"round {r + 1} {model}: {rate:.2f} frames/s in the pipeline ({args.streams} streams)"
                    )
                order = ("rec_float", "rec_int8") if r % 2 == 0 else ("rec_int8", "rec_float")
                for model in order if rec_q is not None else ():
                    rate, prec = layer_rate(repo, model, crops, args.crop_inferences)
                    if model == "rec_float":
                        precision = prec
                    rec[model].append(rate)
                    print(f"round {r + 1} {model}: {rate:.1f} crops/s ({prec})")
        finally:
            nats.stop()
            nats.cleanup()
        det_f, det_i = median(det["det_float"]), median(det["det_int8"])

        print()
        print("| model | float | INT8 | INT8 / float | agreement (held-out) |")
        print("| --- | --- | --- | --- | --- |")
        a = det_q.agreement
        print(
            f"| ppocr_det {args.size}x{args.size}, pipeline, {args.streams} streams (frames/s) | "
            f"{det_f:.2f} | {det_i:.2f} | {det_i / det_f:.2f}x | box {a.box_agreement:.3f}, "
            f"counts {a.count_agreement:.3f} ({a.frames} frames, {a.boxes_float} boxes) |"
        )
        if rec_q is not None:
            rec_f, rec_i = median(rec["rec_float"]), median(rec["rec_int8"])
            print(
                f"| ppocr_rec 48x320, inference layer, 16 callers (crops/s) | {rec_f:.1f} | {rec_i:.1f} | "
                f"{rec_i / rec_f:.2f}x | text {rec_q.agreement.score:.3f} ({rec_q.agreement.frames} crops) |"
            )
        import openvino

        caps = openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
        float_prec = precision or ("bf16" if "BF16" in caps else "f32")
        print(f"float precision: {float_prec} (auto; CPU offers {', '.join(caps)})")
        print(f"rounds: {args.rounds}, medians")
        print(f"load after: {describe_load()}")
        print(f"det_int8_ratio={det_i / det_f:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
