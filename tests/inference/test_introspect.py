"""Reading what an ONNX file declares: task, layout, labels, input size and batch, from real graphs."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from inference.introspect import ModelIntrospectionError, config_text, default_backend, describe_model
from inference.model import ModelState
from inference.repository import ModelRepository
from tests.inference.test_repository import make_onnx

COCO = ["person", "bicycle", "car"] + [f"class{i}" for i in range(3, 80)]


def ultralytics_meta(task: str, names: list[str], imgsz: int = 640, batch: int = 1) -> dict[str, str]:
    """``metadata_props`` as Ultralytics writes them: Python literals as strings."""
    return {
        "description": f"Ultralytics YOLOv8n model ({task})",
        "author": "Ultralytics",
        "stride": "32",
        "task": task,
        "batch": str(batch),
        "imgsz": str([imgsz, imgsz]),
        "names": str(dict(enumerate(names))),
    }


def export(
    path: Path,
    inputs: list[int | str],
    outputs: list[list[int | str]],
    metadata: dict[str, str] | None = None,
) -> Path:
    """A graph that declares these shapes (what introspection reads); each output is a Identity-fed mean."""
    nodes = [helper.make_node("ReduceMean", ["images"], ["pooled"], keepdims=1)]
    outs = []
    for i, shape in enumerate(outputs):
        name = f"output{i}"
        nodes.append(helper.make_node("Identity", ["pooled"], [name]))
        outs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))
    graph = helper.make_graph(
        nodes, "export", [helper.make_tensor_value_info("images", TensorProto.FLOAT, inputs)], outs
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    if metadata:
        helper.set_model_props(model, metadata)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def test_a_yolov8_detect_export_with_dynamic_batch_and_anchors(tmp_path: Path) -> None:
    path = export(
        tmp_path / "yolov8n.onnx",
        ["batch", 3, 640, 640],
        [["batch", 84, "anchors"]],
        ultralytics_meta("detect", COCO),
    )
    desc = describe_model(path)
    assert (desc.task, desc.kind, desc.layout) == ("detect", "yolo", "yolov8")
    assert desc.labels == COCO
    assert desc.input_shape == [3, 640, 640]
    assert desc.max_batch_size == 8
    assert desc.notes == ()


def test_a_yolov5_export_of_batch_one_gets_max_batch_size_one(tmp_path: Path) -> None:
    # The YOLOv5 repository's exporter writes stride and names only.
    meta = {"stride": "32", "names": str(dict(enumerate(COCO)))}
    path = export(tmp_path / "yolov5s.onnx", [1, 3, 640, 640], [[1, 25200, 85]], meta)
    desc = describe_model(path)
    assert (desc.task, desc.kind, desc.layout) == ("", "yolo", "yolov5")
    assert desc.max_batch_size == 1
    assert len(desc.labels) == 80


def test_layout_from_class_count_when_both_dimensions_could_fit(tmp_path: Path) -> None:
    # [1, 9, 6]: channels-first with 5 classes is yolov8 (4+5), channels-last would need 5+C=6 → C=1.
    path = export(
        tmp_path / "m.onnx", [1, 3, 64, 64], [[1, 9, 6]], ultralytics_meta("detect", list("abcde"), 64)
    )
    assert describe_model(path).layout == "yolov8"
    path = export(tmp_path / "m5.onnx", [1, 3, 64, 64], [[1, 9, 6]], {"names": str({0: "a"})})
    assert describe_model(path).layout == "yolov5"


def test_dynamic_image_size_comes_from_imgsz(tmp_path: Path) -> None:
    meta = ultralytics_meta("detect", ["a"], imgsz=480)
    path = export(tmp_path / "m.onnx", ["batch", 3, "height", "width"], [["batch", 5, "anchors"]], meta)
    assert describe_model(path).input_shape == [3, 480, 480]
    bare = export(tmp_path / "bare.onnx", ["batch", 3, "height", "width"], [["batch", 5, "anchors"]])
    with pytest.raises(ModelIntrospectionError) as err:
        describe_model(bare)
    assert str(err.value) == (
        "bare.onnx: input 'images' has dynamic height and width [?, 3, ?, ?] and no imgsz metadata; "
        "re-export with a fixed image size, or set input.shape: [3, H, W]"
    )


def test_a_classify_export(tmp_path: Path) -> None:
    path = export(
        tmp_path / "cls.onnx",
        ["batch", 3, 224, 224],
        [["batch", 3]],
        ultralytics_meta("classify", ["cat", "dog", "owl"], 224),
    )
    desc = describe_model(path)
    assert (desc.kind, desc.layout, desc.labels, desc.input_shape) == (
        "classify",
        None,
        ["cat", "dog", "owl"],
        [3, 224, 224],
    )


def test_without_names_the_labels_are_numbers_and_a_note_says_so(tmp_path: Path) -> None:
    desc = describe_model(export(tmp_path / "m.onnx", [1, 3, 64, 64], [[1, 6, 100]]))
    assert (desc.layout, desc.labels) == ("yolov8", [])
    assert desc.notes == ("the model names no classes: labels are class numbers; add labels: to config.yaml",)


@pytest.mark.parametrize(
    ("inputs", "outputs", "meta", "message"),
    [
        (
            ["batch", 3, 640, 640], [["batch", 116, 8400], ["batch", 32, 160, 160]], ultralytics_meta("segment", COCO),
            "m.onnx: an ultralytics 'segment' export; vidpipe serves detect and classify models, "
            "so export the detect or classify variant",
        ),
        (
            [4, 3, 640, 640], [[4, 84, 8400]], ultralytics_meta("detect", COCO, batch=4),
            "m.onnx: input 'images' has a fixed batch of 4; batches vary in size, so re-export it with a "
            "dynamic batch axis (ultralytics: dynamic=True) or with batch=1",
        ),
        (
            [1, 3, 640, 640], [[1, 85, 8400]], ultralytics_meta("detect", COCO),
            "m.onnx: output output0[1, 85, 8400] holds 85 values per box, but 80 names need 84 in the "
            "yolov8 layout; is this a detect export?",
        ),
        (
            [1, 1, 64, 64], [[1, 6, 100]], None,
            "m.onnx: input 'images' has 1 channels; vidpipe feeds RGB images (3 channels)",
        ),
    ],
)  # fmt: skip
def test_exports_vidpipe_cannot_serve_are_refused_with_the_fix(
    tmp_path: Path,
    inputs: list[int | str],
    outputs: list[list[int | str]],
    meta: dict[str, str] | None,
    message: str,
) -> None:
    with pytest.raises(ModelIntrospectionError) as err:
        describe_model(export(tmp_path / "m.onnx", inputs, outputs, meta))
    assert str(err.value) == message


CONFIG = """\
name: m
model_file: {path: model.onnx}
max_batch_size: 4
task: {kind: classify}
labels: [a, b, c]
"""


async def test_input_shape_is_taken_from_the_model_when_the_config_leaves_it_out(tmp_path: Path) -> None:
    # A model that runs: export() only declares shapes (its output is [1, 1, 1, 1] whatever the
    # batch), which a load now refuses.
    make_onnx(tmp_path / "m" / "model.onnx", shape=("batch", 3, 24, 40), name="images")
    (tmp_path / "m" / "config.yaml").write_text(CONFIG)
    repo = ModelRepository(tmp_path)
    try:
        status = await repo.load("m")
        assert status.state is ModelState.READY, status.reason
        assert repo.get("m").config.input.shape == [3, 24, 40]
        assert repo.get("m").batch_shape == (4, 3, 24, 40)
    finally:
        await repo.close()


async def test_input_shape_left_out_and_undeclared_is_an_error_at_its_line(tmp_path: Path) -> None:
    export(tmp_path / "m" / "model.onnx", ["batch", 3, "h", "w"], [["batch", 3]])
    path = tmp_path / "m" / "config.yaml"
    path.write_text(CONFIG.replace("task:", "input: {resize: stretch}\ntask:"))
    repo = ModelRepository(tmp_path)
    status = await repo.load("m")
    assert status.state is ModelState.UNAVAILABLE
    assert status.reason == (
        f"{path}:4: input.shape: not set, and model.onnx: input 'images' has dynamic height and width "
        "[?, 3, ?, ?] and no imgsz metadata; re-export with a fixed image size, or set input.shape: "
        "[3, H, W]"
    )


def test_the_written_config_runs_on_the_fastest_installed_runtime_unless_told(tmp_path: Path) -> None:
    path = export(
        tmp_path / "yolov8n.onnx", [1, 3, 640, 640], [[1, 84, 8400]], ultralytics_meta("detect", COCO)
    )
    desc = describe_model(path)
    # OpenVINO is a dependency of vidpipe, so it is installed here.
    assert default_backend() == "openvino"
    lines = config_text(desc, "yolov8n").splitlines()
    assert "backend: openvino" in lines
    assert "instance_group: [{count: 1, kind: KIND_CPU}]" in lines
    told = config_text(desc, "yolov8n", backend="onnxruntime", instances=2).splitlines()
    assert "backend: onnxruntime" in told
    assert "instance_group: [{count: 2, kind: KIND_CPU}]" in told
