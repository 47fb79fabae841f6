"""A classifier's outputs with real ONNX graphs on ONNX Runtime: one request's input never
changes or fails another's result, and outputs that cannot fit the config are refused at load.

The graphs average each channel of an 8×8 crop (``input.resize: stretch``, so a crop of
one colour gives exactly that colour / 255) and misbehave on blue crops the way the
tester's models did: NaN out, or a ``Gather`` whose index runs out of range.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from inference.batcher import InferenceFailed
from inference.model import Model, ModelState
from inference.repository import ModelRepository
from inference.results import Classification, NonFiniteOutput

GREEN = (40, 120, 80)
RED = (200, 30, 30)
BLUE = (0, 0, 200)  # blue mean 0.78 > 0.5: what the poisoned graphs misbehave on
BLACK = (0, 0, 0)


def classifier(
    path: Path,
    *,
    classes: int = 3,
    normalise: bool = False,
    poison: str = "",
    fixed_batch: bool = False,
) -> Path:
    """``x[N,3,8,8]`` → ``y[N, classes]``: the channel means (times an identity-like
    ``3×classes`` matrix, so ``classes`` may differ from 3).

    ``normalise`` divides each row by its sum (+1e-3): a colour crop gives a row of
    probabilities, a black crop a row of zeros. ``poison``: ``nan`` makes a blue crop's row
    NaN (``sqrt(0.5 - blue)``), ``raise`` makes ONNX Runtime raise on a batch holding a
    blue crop (``Gather`` at index 100 of 3). ``fixed_batch`` declares the output ``[1, C]``
    (the means of the whole batch), a model exported with a batch of 1 on its output.
    """
    f32 = TensorProto.FLOAT
    n = helper.make_node
    inits = [
        numpy_helper.from_array(np.eye(3, classes, dtype=np.float32), "w"),
        numpy_helper.from_array(np.array([2], np.int64), "b0"),
        numpy_helper.from_array(np.array([3], np.int64), "b1"),
        numpy_helper.from_array(np.array([1], np.int64), "ax1"),
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        numpy_helper.from_array(np.array(1e-3, np.float32), "eps"),
        numpy_helper.from_array(np.array(100, np.int64), "far"),
        numpy_helper.from_array(np.array([1.0, 2.0, 3.0], np.float32), "table"),
    ]
    axes = [0, 2, 3] if fixed_batch else [2, 3]
    nodes = [n("ReduceMean", ["x"], ["means"], axes=axes, keepdims=0)]
    if fixed_batch:
        nodes.append(n("Unsqueeze", ["means", "b0_0"], ["means2"]))
        inits.append(numpy_helper.from_array(np.array([0], np.int64), "b0_0"))
        last = "means2"
    else:
        last = "means"
    nodes.append(n("Slice", [last, "b0", "b1", "ax1"], ["blue"]))  # [N, 1]
    if normalise:
        nodes += [
            n("ReduceSum", [last, "ax1"], ["total"], keepdims=1),
            n("Add", ["total", "eps"], ["total_eps"]),
            n("Div", [last, "total_eps"], ["normed"]),
        ]
        last = "normed"
    if poison == "nan":
        nodes += [
            n("Sub", ["half", "blue"], ["room"]),
            n("Sqrt", ["room"], ["root"]),  # NaN where blue > 0.5
            n("Mul", ["root", "zero"], ["nan_or_zero"]),
            n("Add", [last, "nan_or_zero"], ["poisoned"]),
        ]
        last = "poisoned"
    elif poison == "raise":
        nodes += [
            n("Greater", ["blue", "half"], ["is_blue"]),
            n("Cast", ["is_blue"], ["is_blue_i"], to=TensorProto.INT64),
            n("Mul", ["is_blue_i", "far"], ["index"]),  # 100 for a blue crop, else 0
            n("Gather", ["table", "index"], ["picked"]),  # out of range: ONNX Runtime raises
            n("Mul", ["picked", "zero"], ["nothing"]),
            n("Add", [last, "nothing"], ["poisoned"]),
        ]
        last = "poisoned"
    nodes.append(n("MatMul", [last, "w"], ["y"]))
    batch: int | str = 1 if fixed_batch else "N"
    graph = helper.make_graph(
        nodes,
        "classifier",
        [helper.make_tensor_value_info("x", f32, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("y", f32, [batch, classes])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


CONFIG = """\
name: cls
model_file: {{path: model.onnx}}
max_batch_size: 4
input: {{shape: [3, 8, 8], resize: stretch}}
task: {{kind: classify, top_k: 3}}
labels: [red, green, blue]
dynamic_batching: {{preferred_batch_size: [{together}], max_queue_delay_microseconds: 300000}}
"""


def crop(rgb: tuple[int, int, int]) -> np.ndarray:
    img = np.zeros((6, 10, 3), np.uint8)
    img[...] = rgb
    return img


async def served(root: Path, together: int = 2, text: str | None = None, **graph: Any) -> Model:
    """The model ``cls`` loaded from ``root``; ``together`` requests form one batch at once."""
    folder = root / "cls"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(text or CONFIG.format(together=together))
    classifier(folder / "model.onnx", **graph)
    repo = ModelRepository(root)
    status = await repo.load("cls")
    assert status.state is ModelState.READY, status.reason
    return repo.get("cls")


async def answers(model: Model, *colours: tuple[int, int, int]) -> list[Any]:
    """Each crop's result or exception, the crops submitted together (one batch)."""
    got = await asyncio.gather(*(model.infer(crop(c)) for c in colours), return_exceptions=True)
    return list(got)


# -- 1. a non-finite row fails its own request, never a result -------------------------------


async def test_a_nan_row_fails_its_request_with_the_model_named_and_its_batch_mates_get_results(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = await served(tmp_path, together=3, poison="nan")
    try:
        (alone_green,) = await answers(model, GREEN)
        with caplog.at_level(logging.WARNING, logger="vidpipe.inference.batcher"):
            green, blue, red = await answers(model, GREEN, BLUE, RED)
        assert isinstance(blue, InferenceFailed), blue
        assert str(blue) == (
            "cls: model 'cls' gave a non-finite output (NaN) for this input, so it has no result "
            "(if it recurs, check the model on such inputs: an overflow at a reduced precision, a "
            "division by zero in the graph)"
        )
        assert isinstance(blue.__cause__, NonFiniteOutput) and blue.__cause__.model == "cls"
        assert isinstance(green, Classification) and isinstance(red, Classification)
        assert (green.label, red.label) == ("green", "red")
        assert green == alone_green
        st = model.stats
        # Counted as a failed request, not a success; the batch ran as one of three.
        assert (st.succeeded, st.failed, st.batch_sizes) == (3, 1, {1: 1, 3: 1})
        lines = [r.getMessage() for r in caplog.records if "failed on instance" in r.getMessage()]
        assert lines == [f"cls: 1 of 3 requests of a batch failed on instance 0: {blue.__cause__}"]
    finally:
        model.stop()


# -- 2. a request's result depends on its own input only ----------------------------------------


async def test_a_crops_scores_are_the_same_alone_and_beside_an_odd_row(tmp_path: Path) -> None:
    # The model answers probabilities for a colour crop and a row of zeros (not
    # probabilities) for a black one: the green crop must not be softmaxed for sharing a
    # batch with it, nor with a NaN row.
    model = await served(tmp_path, normalise=True, poison="nan")
    try:
        (alone,) = await answers(model, GREEN)
        assert isinstance(alone, Classification)
        assert (alone.label, alone.score) == ("green", pytest.approx(120 / 240, abs=1e-3))
        together, black = await answers(model, GREEN, BLACK)
        assert together == alone
        assert isinstance(black, Classification) and black.score == pytest.approx(1 / 3)  # softmaxed
        beside_nan = await answers(model, BLUE, GREEN)
        assert isinstance(beside_nan[0], InferenceFailed) and beside_nan[1] == alone
        assert model.stats.batch_sizes == {1: 1, 2: 2}  # the pairs did share their batches
    finally:
        model.stop()


# -- 3. an input the model raises on fails alone -------------------------------------------------


async def test_a_batch_that_raises_is_retried_item_by_item_and_only_the_poisoned_crop_fails(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    model = await served(tmp_path, together=4, poison="raise")
    try:
        with caplog.at_level(logging.WARNING, logger="vidpipe.inference.batcher"):
            got = await answers(model, GREEN, BLUE, RED, GREEN)
        green, blue, red, green2 = got
        assert isinstance(blue, InferenceFailed), blue
        assert str(blue).startswith("cls: failed when run alone, after its batch of 4 failed: ")
        assert "Gather" in str(blue)
        assert [r.label for r in (green, red, green2)] == ["green", "red", "green"]  # type: ignore[union-attr]
        st = model.stats
        # Per request: three successes, one failure; the batch counts once, at the size formed.
        assert (st.succeeded, st.failed, st.batches, st.batch_sizes) == (3, 1, 1, {4: 1})
        (line,) = [r.getMessage() for r in caplog.records if "failed on instance" in r.getMessage()]
        assert line.startswith("cls: batch of 4 failed on instance 0: ")
        assert line.endswith("; retried item by item: 1 of 4 failed")
        # The next batch without the poisoned input runs once, as a batch.
        assert [r.label for r in await answers(model, RED, GREEN, RED, GREEN)] == [  # type: ignore[union-attr]
            "red",
            "green",
            "red",
            "green",
        ]
        assert model.stats.batch_sizes == {4: 2}
        # ONNX Runtime printed its own error line to stderr on every failed run.
        assert "onnxruntime" not in capfd.readouterr().err
    finally:
        model.stop()


# -- 4, 5. outputs that cannot fit the config are refused at load --------------------------------


async def load_reason(root: Path, text: str, **graph: Any) -> tuple[Path, str]:
    folder = root / "cls"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(text)
    classifier(folder / "model.onnx", **graph)
    status = await ModelRepository(root).load("cls")
    assert status.state is ModelState.UNAVAILABLE, "loaded a model whose output does not fit"
    return path, status.reason


@pytest.mark.parametrize("classes", [2, 4])
async def test_a_class_count_other_than_the_labels_is_refused_at_labels(tmp_path: Path, classes: int) -> None:
    path, reason = await load_reason(tmp_path, CONFIG.format(together=2), classes=classes)
    hint = f"list one label per class, {classes} in class order, or leave labels out for class numbers"
    assert reason == (
        f"{path}:6: labels: model.onnx: output 'y' (shape [?, {classes}]) has {classes} classes but "
        f"labels has 3 (red, green, blue) (hint: {hint})"
    )


async def test_a_labels_file_with_too_few_lines_is_refused_at_labels_file(tmp_path: Path) -> None:
    (tmp_path / "cls").mkdir()
    (tmp_path / "cls" / "labels.txt").write_text("cat\ndog\n")
    text = CONFIG.format(together=2).replace("labels: [red, green, blue]", "labels_file: labels.txt")
    path, reason = await load_reason(tmp_path, text)
    assert reason == (
        f"{path}:6: labels_file: model.onnx: output 'y' (shape [?, 3]) has 3 classes but labels_file "
        "labels.txt has 2 (cat, dog) (hint: give the file one line per class, 3 in class order)"
    )


@pytest.mark.parametrize("given", ["labels: [a, b]", "labels_file: labels.txt"])
async def test_a_yolo_model_with_another_label_count_is_refused_at_its_labels(
    tmp_path: Path, sample_models: Path, given: str
) -> None:
    # The squares detector holds 1 class ([N, 4+1, A]): its layout is right, its labels are not.
    shutil.copytree(sample_models / "squares", tmp_path / "squares")
    path = tmp_path / "squares" / "config.yaml"
    (tmp_path / "squares" / "labels.txt").write_text("a\nb\n")
    text = path.read_text()
    path.write_text(text.replace("labels: [square]", given))
    line = text.splitlines().index("labels: [square]") + 1
    status = await ModelRepository(tmp_path).load("squares")
    assert status.state is ModelState.UNAVAILABLE
    key, source, hint = (
        (
            "labels",
            "labels has 2",
            "list one label per class, 1 in class order, or leave labels out for class numbers",
        )
        if given.startswith("labels:")
        else (
            "labels_file",
            "labels_file labels.txt has 2",
            "give the file one line per class, 1 in class order",
        )
    )
    assert status.reason == (
        f"{path}:{line}: {key}: model.onnx: output 'output0' (shape [?, 5, 1]) read as yolov8 holds 1 "
        f"class(es) but {source} (a, b) (hint: {hint})"
    )


async def test_an_output_with_a_fixed_batch_of_one_is_refused_at_max_batch_size(tmp_path: Path) -> None:
    path, reason = await load_reason(tmp_path, CONFIG.format(together=2), fixed_batch=True)
    assert reason == (
        f"{path}:3: max_batch_size: model.onnx: output tensor 'y' has a fixed batch size of 1 "
        "(shape [1, 3]), but max_batch_size is 4 and batches vary in size; set max_batch_size: 1 or "
        "export the model with a dynamic batch axis"
    )
    # With batches of one, as the message suggests, it serves.
    text = CONFIG.format(together=1).replace("max_batch_size: 4", "max_batch_size: 1")
    model = await served(tmp_path, text=text, fixed_batch=True)
    try:
        (red,) = await answers(model, RED)
        assert isinstance(red, Classification) and red.label == "red"
    finally:
        model.stop()
