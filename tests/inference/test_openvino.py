"""The OpenVINO backend with the real PP-OCR models and clips encoded by the tests."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import av
import cv2
import numpy as np
import onnx
import onnxruntime as ort
import openvino as ov
import pytest
import rapidocr_onnxruntime
import yaml
from onnx import TensorProto, helper

from inference.backends import create_backend
from inference.backends.base import BackendError, InputLocation, TensorSpec
from inference.backends.openvino import OpenVinoBackend, split_batch
from inference.model import Model, resolve_model_file
from inference.processing.crop import crop_upright
from inference.processing.resize import ImagePreprocessor
from inference.repository import ModelRepository, describe_repository, read_source
from inference.results import Classification, Detection, Recognition
from samples.make_clip import Plate, plates_at, write_clip
from tests.conftest import ROOT

MODELS = Path(rapidocr_onnxruntime.__file__).parent / "models"
CPU_CAPS = [str(c) for c in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")]
# What precision: auto becomes on this CPU.
AUTO = "bf16" if "BF16" in CPU_CAPS else "f32"

PLATES = (
    Plate("OPEN24", start=0, end=10, x=40, y=40),
    Plate("EXIT12", start=5, end=20, x=330, y=150),
    Plate("GATE7", start=10, end=20, x=60, y=260),
)
FRAMES = 20


def shipped(repo: Path, name: str, **changes: Any) -> Path:
    """Copy samples/models/NAME/config.yaml into ``repo`` with top-level keys replaced."""
    data = yaml.safe_load((ROOT / "samples" / "models" / name / "config.yaml").read_text())
    data.update(changes)
    folder = repo / name
    folder.mkdir(parents=True, exist_ok=True)
    if name == "squares":
        (folder / "model.onnx").write_bytes(
            (ROOT / "samples" / "models" / "squares" / "model.onnx").read_bytes()
        )
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def decode(clip: Path) -> list[np.ndarray]:
    with av.open(str(clip)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


def iou(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


async def load(repo: Path) -> ModelRepository:
    models = ModelRepository(repo)
    for status in await models.load_all():
        assert status.state.value == "ready", status.reason
    return models


@pytest.fixture(scope="module")
def signs(tmp_path_factory: pytest.TempPathFactory) -> list[np.ndarray]:
    clip = write_clip(
        tmp_path_factory.mktemp("ov") / "signs.mp4", FRAMES, fps=10, plates=PLATES, square=False
    )
    return decode(clip)


# -- the contract ---------------------------------------------------------------------------------


async def test_instances_are_infer_requests_of_one_compiled_model(tmp_path: Path) -> None:
    shipped(tmp_path, "ppocr_cls", instance_group=[{"count": 2, "kind": "KIND_CPU"}])
    models = await load(tmp_path)
    try:
        model = models.get("ppocr_cls")
        a, b = (inst.backend for inst in model.instances)
        assert isinstance(a, OpenVinoBackend) and isinstance(b, OpenVinoBackend)
        compiled = a._shared.compiled if a._shared else None
        assert compiled is not None and b._shared is not None and b._shared.compiled is compiled
        assert a._request is not b._request
        # One stream per instance, so the two requests run side by side.
        assert int(compiled.get_property("NUM_STREAMS")) == 2
        # The batch axis is bounded by max_batch_size; the item shape is the config's. With
        # preprocess: auto the compiled model takes uint8 RGB images and normalises them itself.
        assert a.input_location is b.input_location is InputLocation.HOST_UINT8
        assert a.inputs == [TensorSpec("x", (None, 48, 192, 3), "uint8")]
        assert compiled.inputs[0].get_partial_shape().to_string() == "[1..32,48,192,3]"
        assert a.input == TensorSpec("x", (None, 3, None, None), "float32")  # what the file declares
    finally:
        await models.close()
    # The last instance closed releases the compiled model.
    assert a._shared is None and b._shared is None


async def test_a_batch_of_crops_runs_as_one_call_and_matches_onnxruntime(tmp_path: Path) -> None:
    shipped(tmp_path, "ppocr_cls", backend_options={"precision": "f32"}, instance_group=[{"count": 1}])
    models = await load(tmp_path)
    try:
        model = models.get("ppocr_cls")
        crops = [np.full((30, 20 + 9 * i, 3), 40 * (i % 6), np.uint8) for i in range(16)]
        for i, c in enumerate(crops):
            cv2.putText(c, "AB", (2, 24), cv2.FONT_HERSHEY_SIMPLEX, 0.8, (255, 255, 255), 2)
            if i % 2:
                crops[i] = np.ascontiguousarray(c[::-1, ::-1])
        before = model.stats.batches
        results = await asyncio.gather(*(model.infer(c) for c in crops))
        # 16 requests arrive together: the batcher sends them as one preferred batch of 16.
        assert model.stats.batches - before == 1 and model.stats.batch_sizes.get(16) == 1

        # The same crops through ONNX Runtime, normalised on the host, give the same
        # probabilities (f32 both) as OpenVINO normalising the uint8 batch in the model.
        inst = model.instances[0]
        images = np.zeros((16, 48, 192, 3), np.uint8)
        inst.task.preprocess(crops, images)
        batch = np.zeros((16, 3, 48, 192), np.float32)
        ImagePreprocessor(model.config.input)(crops, batch)
        session = ort.InferenceSession(
            str(MODELS / "ch_ppocr_mobile_v2.0_cls_infer.onnx"), providers=["CPUExecutionProvider"]
        )
        (want,) = session.run(None, {"x": batch})
        got = inst.backend.run({"x": images})
        (probs,) = got.values()
        assert probs.shape == (16, 2)
        np.testing.assert_allclose(probs, want, atol=1e-4)
        labels = [r.label for r in results if isinstance(r, Classification)]
        assert labels == [("0", "180")[int(np.argmax(p))] for p in want]
        # A batch of another size runs on the same compiled model (dynamic batch axis).
        (five,) = inst.backend.run({"x": images[:5]}).values()
        np.testing.assert_allclose(five, want[:5], atol=1e-4)
    finally:
        await models.close()


def test_ir_model_reads_like_its_onnx_file_with_its_metadata(tmp_path: Path) -> None:
    core = ov.Core()
    # compress_to_fp16=False: save_model halves the weights by default, which is not what is compared here.
    model = core.read_model(str(MODELS / "ch_PP-OCRv4_rec_infer.onnx"))
    ov.save_model(model, str(tmp_path / "rec.xml"), compress_to_fp16=False)
    shipped(
        tmp_path / "ir", "ppocr_rec", model_file={"path": "rec.xml"}, backend_options={"precision": "f32"}
    )
    for suffix in ("xml", "bin"):
        (tmp_path / "ir" / "ppocr_rec" / f"rec.{suffix}").write_bytes(
            (tmp_path / f"rec.{suffix}").read_bytes()
        )
    shipped(tmp_path / "onnx", "ppocr_rec", backend_options={"precision": "f32"})
    ir = read_source(tmp_path / "ir", "ppocr_rec")
    ox = read_source(tmp_path / "onnx", "ppocr_rec")
    a = create_backend(ir.config, ir.model_dir / "rec.xml", 0)
    b = create_backend(ox.config, MODELS / "ch_PP-OCRv4_rec_infer.onnx", 0)
    try:
        # The recogniser's dictionary lives in the ONNX metadata; the IR keeps it.
        assert a.metadata["character"] == b.metadata["character"]
        assert len(a.metadata["character"].splitlines()) == 6623
        # preprocess: auto: both take uint8 RGB images and normalise them in the compiled model.
        x = np.random.default_rng(1).integers(0, 256, (3, 48, 320, 3), np.uint8)
        (ya,) = a.run({"x": x}).values()
        (yb,) = b.run({"x": x}).values()
        assert ya.shape == (3, 40, 6625)
        np.testing.assert_allclose(ya, yb, atol=1e-5)
        assert a.precision == b.precision == "f32"
    finally:
        a.close()
        b.close()


# -- precision ------------------------------------------------------------------------------------


async def test_precision_in_use_is_reported_by_status_and_listing(tmp_path: Path) -> None:
    shipped(tmp_path, "ppocr_det")  # precision: auto
    shipped(tmp_path, "ppocr_cls", backend_options={"precision": "f32"})
    shipped(tmp_path, "ppocr_rec", backend="onnxruntime", backend_options={"intra_op_threads": 1})
    models = await load(tmp_path)
    try:
        status = {s.name: s for s in models.status()}
        det, cls, rec = status["ppocr_det"], status["ppocr_cls"], status["ppocr_rec"]
        assert (det.backend, det.precision, det.preprocess) == ("openvino", AUTO, "model")
        assert (cls.backend, cls.precision, cls.preprocess) == ("openvino", "f32", "model")
        assert (rec.backend, rec.precision, rec.preprocess) == ("onnxruntime", "native", "cpu")
    finally:
        await models.close()
    rows = {line.split()[0]: line.split() for line in describe_repository(tmp_path).text.splitlines()[1:]}
    assert rows["ppocr_det"][3:6] == ["openvino", AUTO, "model"]
    assert rows["ppocr_cls"][3:6] == ["openvino", "f32", "model"]
    assert rows["ppocr_rec"][3:6] == ["onnxruntime", "native", "cpu"]


def tiny_classifier(qdq: bool = False) -> onnx.ModelProto:
    """``images[N,3,8,8]`` → ``scores[N,4]``: a 3×3 convolution and a global average pool.

    Small enough for NNCF to quantize in about a second. With ``qdq`` the image and the
    weights pass QuantizeLinear/DequantizeLinear pairs (uint8, int8), as ONNX
    Runtime's own quantizer writes a model.
    """
    rng = np.random.default_rng(0)
    inits = [onnx.numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")]
    n = helper.make_node
    x, w = "images", "w"
    nodes = []
    if qdq:
        inits += [
            onnx.numpy_helper.from_array(np.array(1 / 255, np.float32), "x_scale"),
            onnx.numpy_helper.from_array(np.array(0, np.uint8), "x_zero"),
            onnx.numpy_helper.from_array(np.array(0.02, np.float32), "w_scale"),
            onnx.numpy_helper.from_array(np.array(0, np.int8), "w_zero"),
        ]
        nodes += [
            n("QuantizeLinear", ["images", "x_scale", "x_zero"], ["x_q"]),
            n("DequantizeLinear", ["x_q", "x_scale", "x_zero"], ["x_dq"]),
            n("QuantizeLinear", ["w", "w_scale", "w_zero"], ["w_q"]),
            n("DequantizeLinear", ["w_q", "w_scale", "w_zero"], ["w_dq"]),
        ]
        x, w = "x_dq", "w_dq"
    nodes += [
        n("Conv", [x, w], ["features"], pads=[1, 1, 1, 1]),
        n("GlobalAveragePool", ["features"], ["pooled"]),
        n("Flatten", ["pooled"], ["scores"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 4])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def tiny_model(repo: Path, name: str, backend: str, versions: dict[int, str]) -> None:
    """Model ``name`` with a version folder per ``versions`` entry: ``float``, ``qdq`` (ONNX)
    or ``int8`` (an OpenVINO IR quantized by NNCF, with quantize.txt beside it, as
    ``vidpipe models quantize`` writes a version). The highest version is served."""
    served = ""
    for version, kind in sorted(versions.items()):
        folder = repo / name / str(version)
        folder.mkdir(parents=True)
        if kind == "int8":
            import nncf

            float_model = ov.Core().read_model(str(repo / name / "1" / "model.onnx"))  # its float version
            frames = [np.random.default_rng(i).random((1, 3, 8, 8), np.float32) for i in range(3)]
            quantized = nncf.quantize(float_model, nncf.Dataset(frames), subset_size=3)
            ov.save_model(quantized, str(folder / "model.xml"), compress_to_fp16=False)
            (folder / "quantize.txt").write_text("box agreement 1.000\n")
            served = "model.xml"
        else:
            onnx.save(tiny_classifier(qdq=kind == "qdq"), folder / "model.onnx")
            served = "model.onnx"
    config = {
        "name": name,
        "backend": backend,
        "model_file": {"path": served},
        "max_batch_size": 2,
        "input": {"name": "images", "shape": [3, 8, 8]},
        "task": {"kind": "classify"},
        "labels": ["a", "b", "c", "d"],
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
    }
    (repo / name / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


async def test_a_quantized_model_reports_int8(tmp_path: Path) -> None:
    pytest.importorskip("nncf")
    tiny_model(tmp_path, "float", "openvino", {1: "float"})
    tiny_model(tmp_path, "quantized", "openvino", {1: "float", 2: "int8"})
    tiny_model(tmp_path, "qdq", "openvino", {1: "qdq"})
    tiny_model(tmp_path, "ort", "onnxruntime", {1: "float"})
    tiny_model(tmp_path, "ort_qdq", "onnxruntime", {1: "qdq"})
    models = await load(tmp_path)
    try:
        got = {s.name: (s.version, s.backend, s.precision) for s in models.status()}
        # The quantized IR answers as its float version does, its quantized layers on 8-bit integers.
        image = np.full((8, 8, 3), 200, np.uint8)
        answers = [await models.get(name).infer(image) for name in ("float", "quantized")]
        assert all(isinstance(a, Classification) for a in answers)
        assert answers[0].class_id == answers[1].class_id  # type: ignore[union-attr]
    finally:
        await models.close()
    assert got == {
        "float": (1, "openvino", AUTO),
        "quantized": (2, "openvino", "int8"),
        "qdq": (1, "openvino", "int8"),
        "ort": (1, "onnxruntime", "native"),
        "ort_qdq": (1, "onnxruntime", "int8"),
    }
    rows = {line.split()[0]: line.split() for line in describe_repository(tmp_path).text.splitlines()[1:]}
    assert rows["quantized"][1:5] == ["2", "ready", "openvino", "int8"]
    assert rows["ort_qdq"][1:5] == ["1", "ready", "onnxruntime", "int8"]


async def cascade(repo: Path, frames: list[np.ndarray]) -> list[list[tuple[str, tuple[float, ...]]]]:
    """Per frame: (text, box) of each line, detector -> orientation -> recogniser, as the pipeline does."""
    models = await load(repo)
    det, cls, rec = (models.get(n) for n in ("ppocr_det", "ppocr_cls", "ppocr_rec"))
    out = []
    try:
        for frame in frames:
            found = await det.infer(frame)
            assert isinstance(found, list)
            lines = [d for d in found if isinstance(d, Detection) and d.polygon is not None]
            crops = [crop_upright(frame, d.polygon) for d in lines if d.polygon is not None]
            turns = await asyncio.gather(*(cls.infer(c) for c in crops))
            upright = [
                cv2.rotate(c, cv2.ROTATE_180) if isinstance(t, Classification) and t.label == "180" else c
                for c, t in zip(crops, turns, strict=True)
            ]
            texts = await asyncio.gather(*(rec.infer(c) for c in upright))
            out.append(
                sorted(
                    (t.text, d.box) for d, t in zip(lines, texts, strict=True) if isinstance(t, Recognition)
                )
            )
    finally:
        await models.close()
    return out


async def test_default_precision_reads_the_same_text_and_boxes_as_f32(
    tmp_path: Path, signs: list[np.ndarray]
) -> None:
    names = ("ppocr_det", "ppocr_cls", "ppocr_rec")
    for name in names:
        shipped(tmp_path / "auto", name)
        shipped(tmp_path / "f32", name, backend_options={"precision": "f32"})
        shipped(tmp_path / "ort", name, backend="onnxruntime", backend_options={"intra_op_threads": 1})
    auto = await cascade(tmp_path / "auto", signs)
    f32 = await cascade(tmp_path / "f32", signs)
    onnx = await cascade(tmp_path / "ort", signs)
    for index, (a, f, o) in enumerate(zip(auto, f32, onnx, strict=True)):
        truth = sorted(text for text, _ in plates_at(index, 640, PLATES))
        assert [t for t, _ in a] == [t for t, _ in f] == [t for t, _ in o] == truth, (index, a, f, o)
        for (_, box_a), (_, box_f), (_, box_o) in zip(a, f, o, strict=True):
            assert iou(box_a, box_f) >= 0.9, (index, box_a, box_f)
            assert iou(box_f, box_o) >= 0.9, (index, box_f, box_o)


async def test_yolo_boxes_at_default_precision_match_f32(tmp_path: Path, demo_clip: Path) -> None:
    shipped(tmp_path / "auto", "squares")
    shipped(tmp_path / "f32", "squares", backend_options={"precision": "f32"})
    frames = decode(demo_clip)
    boxes: dict[str, list[list[Detection]]] = {}
    for variant in ("auto", "f32"):
        models = await load(tmp_path / variant)
        try:
            model = models.get("squares")
            assert model.precision == (AUTO if variant == "auto" else "f32")
            results = await asyncio.gather(*(model.infer(f) for f in frames))
            boxes[variant] = [r for r in results if isinstance(r, list)]
        finally:
            await models.close()
    assert len(boxes["auto"]) == len(frames) == 45
    for index, (a, f) in enumerate(zip(boxes["auto"], boxes["f32"], strict=True)):
        assert len(a) == len(f) == 1, (index, a, f)  # the clip's one bouncing square, every frame
        assert a[0].label == f[0].label == "square"
        assert iou(a[0].box, f[0].box) >= 0.9, (index, a[0].box, f[0].box)


# -- options and errors -------------------------------------------------------------------------


def test_cache_dir_receives_the_compiled_model(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    path = shipped(tmp_path, "ppocr_cls", backend_options={"cache_dir": str(cache), "threads": 1})
    src = read_source(tmp_path, "ppocr_cls")
    backend = create_backend(src.config, MODELS / "ch_ppocr_mobile_v2.0_cls_infer.onnx", 0)
    backend.close()
    assert path.is_file() and [p.suffix for p in cache.iterdir()] == [".blob"]


async def unavailable_reason(repo: Path, name: str) -> str:
    models = ModelRepository(repo)
    status = await models.load(name)
    assert status.state.value == "unavailable"
    return status.reason


def line_of(path: Path, key: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.startswith(key))


@pytest.mark.skipif("FP16" in CPU_CAPS, reason="this CPU computes in f16")
async def test_a_precision_the_cpu_lacks_points_at_the_key(tmp_path: Path) -> None:
    path = shipped(tmp_path, "ppocr_cls", backend_options={"precision": "f16"})
    reason = await unavailable_reason(tmp_path, "ppocr_cls")
    assert reason == (
        f"{path}:{line_of(path, '  precision:')}: backend_options.precision: precision f16 "
        f"is not supported by the CPU device (hint: it offers {', '.join(CPU_CAPS)}; set "
        f"backend_options.precision: auto or f32)"
    )


@pytest.mark.skipif("GPU" in ov.Core().available_devices, reason="this machine has an OpenVINO GPU")
async def test_a_missing_device_points_at_the_key(tmp_path: Path) -> None:
    path = shipped(
        tmp_path,
        "ppocr_cls",
        backend_options={"device": "GPU"},
        instance_group=[{"count": 1, "kind": "KIND_GPU"}],
    )
    reason = await unavailable_reason(tmp_path, "ppocr_cls")
    assert reason.startswith(f"{path}:{line_of(path, '  device:')}: backend_options.device: ")
    assert "OpenVINO device GPU is not present on this machine (hint: available: CPU" in reason


async def test_a_device_that_contradicts_the_instance_kind_is_refused(tmp_path: Path) -> None:
    path = shipped(tmp_path, "ppocr_cls", backend_options={"device": "AUTO"})  # kind: KIND_CPU
    reason = await unavailable_reason(tmp_path, "ppocr_cls")
    assert reason == (
        f"{path}:{line_of(path, '  device:')}: backend_options.device: instance_group "
        f"kind KIND_CPU but backend_options.device is AUTO (hint: set device: CPU, or kind: KIND_AUTO)"
    )


async def test_bad_model_files_point_at_model_file(tmp_path: Path) -> None:
    folder = tmp_path / "ppocr_cls"
    folder.mkdir()
    (folder / "model.pt").write_bytes(b"\x80\x02")
    (folder / "model.xml").write_text("<net/>")
    path = shipped(tmp_path, "ppocr_cls", model_file={"path": "model.pt"})
    reason = await unavailable_reason(tmp_path, "ppocr_cls")
    assert reason == (
        f"{path}:{line_of(path, '  path:')}: model_file.path: OpenVINO reads ONNX (.onnx) and "
        f"IR (.xml + .bin) files, not model.pt (hint: export the model to ONNX or IR)"
    )
    shipped(tmp_path, "ppocr_cls", model_file={"path": "model.xml"})
    reason = await unavailable_reason(tmp_path, "ppocr_cls")
    assert reason.endswith(
        "model_file.path: IR model model.xml has no weights file model.bin next to it (hint: copy it there)"
    )


async def test_an_input_the_model_does_not_take_says_which_key_to_change(tmp_path: Path) -> None:
    data = yaml.safe_load((ROOT / "samples" / "models" / "ppocr_cls" / "config.yaml").read_text())
    path = shipped(tmp_path, "ppocr_cls", input={**data["input"], "name": "images"})
    reason = await unavailable_reason(tmp_path, "ppocr_cls")
    assert reason.startswith(f"{path}:{line_of(path, '  name: images')}: input.name: ")
    assert "the model has no input tensor 'images' (it has: x); set input.name to one of those" in reason


def test_max_batch_size_1_compiles_a_static_shape_used_without_the_repository(tmp_path: Path) -> None:
    data = yaml.safe_load((ROOT / "samples" / "models" / "ppocr_det" / "config.yaml").read_text())
    shipped(
        tmp_path,
        "ppocr_det",
        max_batch_size=1,
        input={**data["input"], "shape": [3, 320, 320]},
        dynamic_batching={"max_queue_delay_microseconds": 0},
        backend_options={"precision": "auto"},
    )
    src = read_source(tmp_path, "ppocr_det")
    model = Model(src.config, src.model_dir)
    assert model.load().value == "ready", model.reason
    try:
        assert model.inputs[0].shape == (1, 320, 320, 3)  # uint8 RGB images, normalised in the model
        image = np.full((240, 320, 3), 255, np.uint8)
        cv2.putText(image, "HELLO", (40, 140), cv2.FONT_HERSHEY_SIMPLEX, 2.0, (0, 0, 0), 5)
        found = model.submit(image).result(timeout=30)
        assert isinstance(found, list) and [d.label for d in found] == ["text"]
        x1, y1, x2, y2 = found[0].box
        assert 30 <= x1 <= 42 and 180 <= x2 <= 260 and 95 <= y1 <= 115 and 135 <= y2 <= 160, found[0].box
    finally:
        model.stop()


def test_split_batch_takes_the_largest_pieces_first() -> None:
    assert split_batch(7, [1, 4]) == [4, 1, 1, 1]
    assert split_batch(7, [4, 2, 1]) == [4, 2, 1]
    assert split_batch(8, [1, 4]) == [4, 4]
    assert split_batch(0, [1, 4]) == []


def test_static_shapes_run_a_batch_as_pieces_with_the_answers_of_single_runs(tmp_path: Path) -> None:
    data = yaml.safe_load((ROOT / "samples" / "models" / "ppocr_det" / "config.yaml").read_text())
    shipped(
        tmp_path,
        "ppocr_det",
        max_batch_size=4,
        input={**data["input"], "shape": [3, 320, 320]},
        dynamic_batching={"preferred_batch_size": [4], "max_queue_delay_microseconds": 0},
        instance_group=[{"count": 1, "kind": "KIND_CPU"}],
        backend_options={"precision": "f32", "static_batch_sizes": [4, 1]},
    )
    src = read_source(tmp_path, "ppocr_det")
    backend = create_backend(src.config, resolve_model_file(src.config, src.model_dir), 0)
    try:
        assert isinstance(backend, OpenVinoBackend) and backend._shared is not None
        by_size = backend._shared.by_size
        # One static shape per listed batch size; none is dynamic.
        assert sorted(by_size) == [1, 4]
        # Each shape normalises uint8 images in the model (preprocess: auto).
        assert [c.inputs[0].get_partial_shape().to_string() for _, c in sorted(by_size.items())] == [
            "[1,320,320,3]",
            "[4,320,320,3]",
        ]
        # The rest of vidpipe sees one model that takes 1..4.
        assert backend.inputs[0].shape == (None, 320, 320, 3)
        rng = np.random.default_rng(7)
        batch = rng.integers(0, 256, (4, 320, 320, 3), dtype=np.uint8)
        singles = [backend.run({"x": batch[i : i + 1]})["sigmoid_0.tmp_0"] for i in range(4)]
        for n in (4, 3):  # one call of 4; three calls of 1
            out = backend.run({"x": batch[:n]})["sigmoid_0.tmp_0"]
            assert out.shape == (n, 1, 320, 320)
            for i in range(n):
                np.testing.assert_allclose(out[i], singles[i][0], atol=1e-5)
    finally:
        backend.close()


# -- preprocessing in the model ----------------------------------------------------------------


async def run_modes(
    tmp_path: Path, name: str, images: list[np.ndarray], **changes: Any
) -> dict[str, list[Any]]:
    """Results of ``images`` with ``preprocess: model`` and ``cpu`` (f32, one instance); checks the pools."""
    found: dict[str, list[Any]] = {}
    for mode in ("model", "cpu"):
        shipped(
            tmp_path / mode,
            name,
            backend_options={"precision": "f32", "preprocess": mode},
            instance_group=[{"count": 1, "kind": "KIND_CPU"}],
            **changes,
        )
        models = await load(tmp_path / mode)
        try:
            model = models.get(name)
            (inst,) = model.instances
            batch, c, h, w = model.batch_shape
            if mode == "model":
                # uint8 RGB images the compiled model normalises: a quarter of a float tensor.
                assert (inst.pool.shape, inst.pool.dtype) == ((batch, h, w, c), "uint8")
                assert inst.backend.input_location is InputLocation.HOST_UINT8 and model.preprocess == "model"
                assert model.inputs == [TensorSpec("x", (batch if batch == 1 else None, h, w, c), "uint8")]
            else:
                assert (inst.pool.shape, inst.pool.dtype) == ((batch, c, h, w), "float32")
                assert inst.backend.input_location is InputLocation.HOST_FLOAT and model.preprocess == "cpu"
            found[mode] = list(await asyncio.gather(*(model.infer(i) for i in images)))
            assert models.status()[0].preprocess == mode
        finally:
            await models.close()
    return found


async def test_text_boxes_are_the_same_normalised_in_the_model_or_on_the_host(
    tmp_path: Path, signs: list[np.ndarray]
) -> None:
    # 640×360 frames letterboxed into 640×640: 140 rows of padding above and below.
    assert signs[0].shape == (360, 640, 3)
    found = await run_modes(tmp_path, "ppocr_det", signs)
    for index, (model, cpu) in enumerate(zip(found["model"], found["cpu"], strict=True)):
        assert len(model) == len(cpu) == len(plates_at(index, 640, PLATES)), (index, model, cpu)
        for a, b in zip(model, cpu, strict=True):
            assert a.polygon is not None and b.polygon is not None
            np.testing.assert_allclose(a.box, b.box, atol=0.5)
            np.testing.assert_allclose(a.polygon, b.polygon, atol=0.5)
            assert a.score == pytest.approx(b.score, abs=1e-3)


async def test_orientation_is_the_same_normalised_in_the_model_or_on_the_host(
    tmp_path: Path, signs: list[np.ndarray]
) -> None:
    crops = []
    for index in (0, 6, 12, 18):
        for _, (x1, y1, x2, y2) in plates_at(index, 640, PLATES):
            crop = np.ascontiguousarray(signs[index][y1:y2, x1:x2])
            crops += [crop, cv2.rotate(crop, cv2.ROTATE_180)]
    assert len(crops) == 14
    found = await run_modes(tmp_path, "ppocr_cls", crops)  # keep_height, 48×192, BGR
    model, cpu = found["model"], found["cpu"]
    assert [r.label for r in model] == [r.label for r in cpu] == ["0", "180"] * 7
    np.testing.assert_allclose([r.score for r in model], [r.score for r in cpu], atol=1e-3)


def channel_means_model(path: Path) -> None:
    """An ONNX model without a batch axis: the mean of each of its [3, 16, 24] input's channels."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 16, 24])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])
    node = helper.make_node("ReduceMean", ["x"], ["y"], axes=[1, 2], keepdims=0)
    graph = helper.make_graph([node], "channel_means", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))


async def test_a_model_without_a_batch_axis_takes_one_hwc_image(tmp_path: Path) -> None:
    config = {
        "name": "means",
        "backend": "openvino",
        "model_file": {"path": "means.onnx"},
        "max_batch_size": 0,
        # Channel-specific mean and std, and a colour swap: a slip in the order shows.
        "input": {"shape": [3, 16, 24], "color": "bgr", "mean": [0.1, 0.2, 0.3], "std": [0.5, 0.25, 1.0],
                  "resize": "letterbox", "pad_value": 30},
        "task": {"kind": "classify", "top_k": 3},
        "labels": ["b", "g", "r"],
    }  # fmt: skip
    image = np.zeros((20, 60, 3), np.uint8)  # letterboxed to 24×8 with 4 padding rows above and below
    image[:] = (250, 20, 140)
    results = {}
    for mode in ("model", "cpu"):
        folder = tmp_path / mode / "means"
        folder.mkdir(parents=True)
        channel_means_model(folder / "means.onnx")
        config["backend_options"] = {"precision": "f32", "preprocess": mode}
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
        models = await load(tmp_path / mode)
        try:
            model = models.get("means")
            assert model.instances[0].pool.shape == ((1, 16, 24, 3) if mode == "model" else (1, 3, 16, 24))
            if mode == "model":
                assert model.inputs == [TensorSpec("x", (16, 24, 3), "uint8")]
            results[mode] = await model.infer(image)
        finally:
            await models.close()
    inside, host = results["model"], results["cpu"]
    assert isinstance(inside, Classification) and isinstance(host, Classification)
    # Model channel 0 is blue: (140/255 - 0.1)/0.5 over the content, (30/255 - 0.1)/0.5 on the padding.
    content, pad = 8 / 16, 8 / 16
    means = [
        content * (v / 255 - m) / s + pad * (30 / 255 - m) / s
        for v, m, s in zip((140, 20, 250), (0.1, 0.2, 0.3), (0.5, 0.25, 1.0), strict=True)
    ]
    want = np.exp(means) / np.exp(means).sum()
    order = np.argsort(-want)
    assert (
        [label for label, _ in host.top]
        == [label for label, _ in inside.top]
        == [("b", "g", "r")[i] for i in order]
    )
    np.testing.assert_allclose([s for _, s in inside.top], want[order], atol=1e-5)
    np.testing.assert_allclose([s for _, s in host.top], want[order], atol=1e-5)


async def test_preprocess_on_a_backend_that_cannot_points_at_the_key(tmp_path: Path) -> None:
    # Normalising inside the model is OpenVINO's alone: the key is OpenVINO's, and the file is
    # refused when it is read, before anything loads.
    path = shipped(tmp_path, "ppocr_cls", backend="onnxruntime", backend_options={"preprocess": "model"})
    reason = await unavailable_reason(tmp_path, "ppocr_cls")
    assert reason == (
        f"{path}:{line_of(path, '  preprocess:')}: backend_options.preprocess: belongs to backend "
        f"openvino, not onnxruntime (hint: backend onnxruntime takes: intra_op_threads, "
        f"inter_op_threads, execution_providers, fp16, workspace_mb)"
    )
    # ONNX Runtime normalises on the host.
    shipped(tmp_path, "ppocr_cls", backend="onnxruntime", backend_options={})
    models = await load(tmp_path)
    try:
        model = models.get("ppocr_cls")
        assert model.preprocess == "cpu" and model.instances[0].pool.dtype == "float32"
    finally:
        await models.close()


def shipped_det_320(tmp_path: Path) -> OpenVinoBackend:
    """Instance 0 of the shipped detector, its input at 320×320."""
    data = yaml.safe_load((ROOT / "samples" / "models" / "ppocr_det" / "config.yaml").read_text())
    shipped(tmp_path, "ppocr_det", input={**data["input"], "shape": [3, 320, 320]})
    src = read_source(tmp_path, "ppocr_det")
    backend = create_backend(src.config, resolve_model_file(src.config, src.model_dir), 0)
    assert isinstance(backend, OpenVinoBackend)
    return backend


def test_borrowed_outputs_are_the_instances_buffer_and_run_returns_copies(tmp_path: Path) -> None:
    backend = shipped_det_320(tmp_path)
    try:
        rng = np.random.default_rng(5)
        images = np.ascontiguousarray(rng.integers(0, 256, (3, 320, 320, 3), dtype=np.uint8))
        blank = np.zeros((3, 320, 320, 3), np.uint8)
        kept = backend.run({"x": images})["sigmoid_0.tmp_0"]
        first = backend.run_borrowed({"x": images})["sigmoid_0.tmp_0"]
        np.testing.assert_array_equal(first, kept)
        expected = first.copy()
        second = backend.run_borrowed({"x": blank[:2]})["sigmoid_0.tmp_0"]
        # The same memory, rewritten by the next batch: a borrowed output lasts one call.
        assert second.shape == (2, 1, 320, 320) and np.shares_memory(first, second)
        assert not np.array_equal(first[:2], expected[:2])
        # run() hands out copies, untouched by later batches.
        np.testing.assert_array_equal(kept, expected)
        assert not np.shares_memory(kept, second)
        # The bound input is read in place: new pixels in the same array give new answers.
        images[:] = blank
        again = backend.run_borrowed({"x": images})["sigmoid_0.tmp_0"]
        np.testing.assert_array_equal(again[:2], second)
    finally:
        backend.close()


class _FailingStart:
    """An infer request whose start fails (a device lost mid-batch); the rest is the real request."""

    def __init__(self, request: Any) -> None:
        self._request = request

    def start_async(self) -> None:
        raise RuntimeError("device lost")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


def test_a_piece_that_fails_leaves_the_requests_free_for_the_next_batch(tmp_path: Path) -> None:
    backend = shipped_det_320(tmp_path)
    try:
        images = np.zeros((16, 320, 320, 3), np.uint8)
        with pytest.raises(
            BackendError,
            match=r"a batch of 17 \(x\[17, 320, 320, 3\]\) is outside 1\.\.max_batch_size \(16\)",
        ):
            backend.run({"x": np.zeros((17, 320, 320, 3), np.uint8)})
        real = backend._requests[1][15]
        backend._requests[1][15] = _FailingStart(real)
        with pytest.raises(BackendError, match=r"ppocr_det: .* failed on x\[16, 320, 320, 3\]: device lost"):
            backend.run({"x": images})
        backend._requests[1][15] = real
        # The fifteen pieces that did start finished before the error was raised.
        out = backend.run({"x": images})["sigmoid_0.tmp_0"]
        assert out.shape == (16, 1, 320, 320)
    finally:
        backend.close()


def first_k_model(path: Path) -> None:
    """An ONNX model whose output size depends on the data: the first max(x) values of each image."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 4, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "K"])
    nodes = [
        helper.make_node("Flatten", ["x"], ["flat"], axis=1),
        helper.make_node("ReduceMax", ["x"], ["top"], keepdims=0),
        helper.make_node("Cast", ["top"], ["k0"], to=TensorProto.INT64),
        helper.make_node("Unsqueeze", ["k0", "axis0"], ["k"]),
        helper.make_node("Slice", ["flat", "axis0", "k", "axis1"], ["y"]),
    ]
    constants = [
        helper.make_tensor("axis0", TensorProto.INT64, [1], [0]),
        helper.make_tensor("axis1", TensorProto.INT64, [1], [1]),
    ]
    graph = helper.make_graph(nodes, "first_k", [x], [y], initializer=constants)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))


def test_static_pieces_with_a_data_dependent_output_are_gathered(tmp_path: Path) -> None:
    folder = tmp_path / "firstk"
    folder.mkdir()
    first_k_model(folder / "model.onnx")
    config = {
        "name": "firstk",
        "backend": "openvino",
        "model_file": {"path": "model.onnx"},
        "max_batch_size": 4,
        "input": {"shape": [3, 4, 4]},
        "task": {"kind": "classify"},
        "backend_options": {"precision": "f32", "preprocess": "cpu", "static_batch_sizes": [1]},
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    src = read_source(tmp_path, "firstk")
    backend = create_backend(src.config, resolve_model_file(src.config, src.model_dir), 0)
    try:
        batch = np.arange(3 * 48, dtype=np.float32).reshape(3, 3, 4, 4) % 7
        for run in (backend.run, backend.run_borrowed):
            out = run({"x": batch})["y"]
            # max is 6 in every image: six values each, in the order of the batch.
            np.testing.assert_array_equal(out, batch.reshape(3, -1)[:, :6])
    finally:
        backend.close()


def test_static_batch_size_1_runs_a_batch_as_single_requests_side_by_side(tmp_path: Path) -> None:
    backend = shipped_det_320(tmp_path)
    try:
        # The shipped detector: batches of up to 16, one compiled [1, ...] shape.
        config = backend.config
        assert (config.max_batch_size, config.backend_options.static_batch_sizes) == (16, [1])
        assert backend._shared is not None
        assert sorted(backend._shared.by_size) == [1]
        # Sixteen requests of the one shape, so a full batch runs as sixteen at once.
        assert len(backend._requests[1]) == 16
        rng = np.random.default_rng(3)
        batch = rng.integers(0, 256, (5, 320, 320, 3), dtype=np.uint8)
        out = backend.run({"x": batch})["sigmoid_0.tmp_0"]
        assert out.shape == (5, 1, 320, 320)
        for i in range(5):
            single = backend.run({"x": batch[i : i + 1]})["sigmoid_0.tmp_0"]
            np.testing.assert_array_equal(out[i], single[0])
    finally:
        backend.close()


@pytest.mark.parametrize(
    ("sizes", "problem"),
    [
        (
            [2, 4],
            "static_batch_sizes [2, 4] has no 1 (hint: add 1: a batch of any size runs as pieces of them)",
        ),
        (
            [1, 32],
            "static_batch_sizes [1, 32] exceeds max_batch_size 16 (hint: list sizes up to max_batch_size)",
        ),
    ],
)
async def test_bad_static_batch_sizes_point_at_the_key(
    tmp_path: Path, sizes: list[int], problem: str
) -> None:
    path = shipped(tmp_path, "ppocr_det", backend_options={"static_batch_sizes": sizes})
    reason = await unavailable_reason(tmp_path, "ppocr_det")
    line = line_of(path, "  static_batch_sizes:")
    assert reason == f"{path}:{line}: backend_options.static_batch_sizes: {problem}", reason


def test_a_model_file_openvino_cannot_read_is_one_line_naming_why(tmp_path: Path) -> None:
    # OpenVINO's own message is a C++ trace, a line per source file it went through.
    config = shipped(tmp_path, "squares")
    (config.parent / "model.onnx").write_text("this is not an ONNX file")
    table = describe_repository(tmp_path)
    assert table.unavailable == ["squares"]
    assert table.text.strip().splitlines()[-1] == (
        f"squares: {config}:4: model_file.path: OpenVINO cannot read {config.parent / 'model.onnx'}: "
        "it is not an ONNX model (hint: re-export the model)"
    )


# Run in a fresh interpreter: counts the forks (os.register_at_fork) while vidpipe's
# OpenVINO backend module, OpenVINO and NNCF load, then lists the home folder.
_TELEMETRY_PROBE = """
import os, sys
forks = []
os.register_at_fork(before=lambda: forks.append(1))
import inference.backends.openvino
import openvino, nncf
print(len(forks), sorted(os.listdir(os.environ["HOME"])), sys.modules["openvino_telemetry"])
"""


def test_loading_openvino_sends_no_telemetry_and_forks_nothing(tmp_path: Path) -> None:
    # OpenVINO posts a usage event to Google Analytics on import, from a forked child that
    # inherits the event loop's signal fd; vidpipe must neither send it nor fork for it.
    import subprocess
    import sys

    home = tmp_path / "home"
    home.mkdir()
    probe = subprocess.run(
        [sys.executable, "-c", _TELEMETRY_PROBE],
        cwd=ROOT,
        env={"HOME": str(home), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "0 [] None"
