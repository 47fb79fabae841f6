"""Resize/normalise, NMS, YOLO decoding and classification post-processing."""

from __future__ import annotations

from typing import Any

import cv2
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from inference.backends.base import TensorSpec
from inference.config import InputConfig, ModelConfig
from inference.processing.classify import (
    as_probabilities,
    classify,
    is_probability,
    probability_items,
    softmax,
    top_k,
)
from inference.processing.nms import batched_nms, nms
from inference.processing.resize import (
    ImagePreprocessor,
    ImageResizer,
    check_image,
    geometry,
    keep_height_geometry,
    letterbox_geometry,
)
from inference.processing.tasks import YoloTask, create_task
from inference.processing.yolo import decode_yolo, resolve_layout
from inference.results import Classification, Detection, NonFiniteOutput
from inference.schema import build


def model_config(**overrides: Any) -> ModelConfig:
    data: dict[str, Any] = {
        "name": "m",
        "model_file": {"path": "model.onnx"},
        "input": {"shape": [3, 640, 640]},
        "task": {"kind": "yolo"},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return build(data, ModelConfig, "test")


def spec_for(config: ModelConfig) -> TensorSpec:
    return TensorSpec("images", (None, *config.input.shape), "float32")


def raw_input(shape: list[int], **kw: Any) -> InputConfig:
    """An input config that copies pixel values unchanged (scale 1, mean 0, std 1)."""
    return InputConfig(shape=shape, scale=1.0, mean=[0.0] * 3, std=[1.0] * 3, **kw)


def rect_image(w: int, h: int, box: tuple[int, int, int, int]) -> np.ndarray:
    img = np.zeros((h, w, 3), np.uint8)
    x1, y1, x2, y2 = box
    img[y1:y2, x1:x2] = 255
    return img


def bright_bounds(plane: np.ndarray) -> tuple[int, int, int, int]:
    ys, xs = np.nonzero(plane > 127.5)
    return int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1


# --------------------------------------------------------------------------- resize


@pytest.mark.parametrize(
    ("src", "dst", "scale", "content", "pad"),
    [
        ((1280, 720), (640, 640), 0.5, (640, 360), (0, 140)),
        ((720, 1280), (640, 640), 0.5, (360, 640), (140, 0)),
        ((640, 640), (640, 640), 1.0, (640, 640), (0, 0)),
        ((320, 240), (640, 640), 2.0, (640, 480), (0, 80)),
        ((1920, 1080), (640, 384), 1 / 3, (640, 360), (0, 12)),
        ((100, 100), (64, 48), 0.48, (48, 48), (8, 0)),
    ],
)
def test_letterbox_geometry(
    src: tuple[int, int], dst: tuple[int, int], scale: float, content: tuple[int, int], pad: tuple[int, int]
) -> None:
    m = letterbox_geometry(*src, *dst)
    assert (m.content_w, m.content_h) == content
    assert (m.pad_x, m.pad_y) == pad
    assert m.scale_x == pytest.approx(scale) and m.scale_y == pytest.approx(scale)
    pts = np.array([[0.0, 0.0], [src[0], src[1]], [13.25, 7.5]])
    assert np.allclose(m.to_source(m.to_model(pts)), pts, atol=1e-9)


def test_letterbox_odd_padding_goes_right_and_keep_height_caps_width() -> None:
    m = letterbox_geometry(101, 50, 64, 64)  # 64 x 32 content (31.68 rounds up)
    assert (m.content_w, m.content_h, m.pad_x, m.pad_y) == (64, 32, 0, 16)
    m = letterbox_geometry(50, 101, 65, 64)  # 32 wide content, 33 px padding: 16 left, 17 right
    assert (m.content_w, m.pad_x) == (32, 16)
    k = keep_height_geometry(100, 30, 320, 48)  # ceil(48 * 100 / 30) = 160 exactly
    assert (k.content_w, k.content_h, k.pad_x, k.pad_y) == (160, 48, 0, 0)
    k = keep_height_geometry(1000, 30, 320, 48)
    assert (k.content_w, k.content_h) == (320, 48)
    s = geometry("stretch", 1280, 720, 640, 640)
    assert (s.scale_x, s.scale_y, s.pad_x, s.pad_y) == (0.5, 640 / 720, 0, 0)
    with pytest.raises(ValueError, match="unknown resize mode"):
        geometry("crop", 1, 1, 1, 1)


@pytest.mark.parametrize(
    ("size", "shape", "resize", "box"),
    [
        ((1280, 720), [3, 640, 640], "letterbox", (300, 200, 502, 404)),  # landscape, pad top/bottom
        ((720, 1280), [3, 640, 640], "letterbox", (100, 900, 300, 1100)),  # portrait, pad left/right
        ((320, 240), [3, 640, 640], "letterbox", (10, 20, 110, 220)),  # upscaled 2x
        ((640, 640), [3, 640, 640], "letterbox", (1, 2, 3, 4)),  # identity
        ((96, 24), [3, 48, 320], "keep_height", (10, 4, 50, 20)),  # recogniser, pad right
        ((1280, 720), [3, 360, 640], "stretch", (302, 200, 500, 402)),
    ],
)
def test_letterboxed_box_maps_back_to_source_pixels_exactly(
    size: tuple[int, int], shape: list[int], resize: str, box: tuple[int, int, int, int]
) -> None:
    pre = ImagePreprocessor(raw_input(shape, resize=resize))  # type: ignore[arg-type]
    out = np.zeros((1, *shape), np.float32)
    (meta,) = pre([rect_image(*size, box)], out)
    x1, y1, x2, y2 = bright_bounds(out[0, 0])
    back = meta.boxes_to_source(np.array([[x1, y1, x2, y2]], np.float64))[0]
    assert back.tolist() == list(box)


def test_odd_aspect_box_maps_back_within_a_pixel() -> None:
    pre = ImagePreprocessor(raw_input([3, 640, 640]))
    out = np.zeros((1, 3, 640, 640), np.float32)
    box = (123, 77, 456, 301)
    (meta,) = pre([rect_image(1000, 600, box)], out)  # scale 0.64
    x1, y1, x2, y2 = bright_bounds(out[0, 0])
    back = meta.boxes_to_source(np.array([[x1, y1, x2, y2]], np.float64))[0]
    assert np.abs(back - box).max() <= 1.0


def test_padding_is_pad_value_and_content_sits_centred() -> None:
    pre = ImagePreprocessor(raw_input([3, 640, 640], pad_value=114))
    out = np.full((1, 3, 640, 640), -1.0, np.float32)
    img = np.full((720, 1280, 3), 7, np.uint8)
    pre([img], out)
    assert np.all(out[0, :, :140] == 114) and np.all(out[0, :, 500:] == 114)
    assert np.all(out[0, :, 140:500] == 7)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("color", ["rgb", "bgr"])
def test_normalisation_and_channel_order_on_known_pixels(color: str, dtype: type) -> None:
    mean, std, scale = [0.1, 0.2, 0.3], [0.5, 0.25, 0.2], 1 / 255
    cfg = InputConfig(shape=[3, 2, 2], mean=mean, std=std, scale=scale, color=color, resize="stretch")  # type: ignore[arg-type]
    img = np.array([[[255, 0, 10], [20, 30, 40]], [[50, 60, 70], [80, 90, 100]]], np.uint8)
    out = np.zeros((1, 3, 2, 2), dtype)
    ImagePreprocessor(cfg)([img], out)
    order = [0, 1, 2] if color == "rgb" else [2, 1, 0]
    for c in range(3):
        expected = (img[:, :, order[c]].astype(np.float64) * scale - mean[c]) / std[c]
        assert np.allclose(out[0, c].astype(np.float64), expected, atol=1e-6 if dtype is np.float32 else 2e-3)
    # Spot check a value by hand: pixel (0, 0) is R=255, G=0, B=10.
    first = (255 * scale - 0.1) / 0.5 if color == "rgb" else (10 * scale - 0.1) / 0.5
    assert float(out[0, 0, 0, 0]) == pytest.approx(first, abs=2e-3)


def test_batch_resized_colour_and_normalised_padding() -> None:
    cfg = InputConfig(shape=[3, 64, 64], mean=[0.5] * 3, std=[0.5] * 3, color="bgr", pad_value=114)
    pre = ImagePreprocessor(cfg)
    a = np.zeros((200, 300, 3), np.uint8)
    a[:] = (10, 100, 200)
    b = np.zeros((300, 150, 3), np.uint8)
    b[:] = (255, 0, 0)
    out = np.full((4, 3, 64, 64), 9.0, np.float32)
    metas = pre([a, b], out)
    norm = lambda v: (v / 255 - 0.5) / 0.5  # noqa: E731
    ma, mb = metas
    assert (ma.content_w, ma.content_h, ma.pad_y) == (64, 43, 10)
    assert (mb.content_w, mb.content_h, mb.pad_x) == (32, 64, 16)
    content_a = out[0, :, 10:53, :]
    assert np.allclose(content_a[0], norm(200)) and np.allclose(content_a[2], norm(10))
    assert np.allclose(out[0, :, :10], norm(114)) and np.allclose(out[0, :, 53:], norm(114))
    assert np.allclose(out[1, 2, :, 16:48], norm(255)) and np.allclose(out[1, 0, :, 16:48], norm(0))
    assert np.allclose(out[1, :, :, :16], norm(114)) and np.allclose(out[1, :, :, 48:], norm(114))
    assert np.all(out[2:] == 9.0)  # rows past the images are untouched


def test_check_image_names_the_bad_image() -> None:
    check_image(np.zeros((4, 4, 3), np.uint8))
    with pytest.raises(
        ValueError, match=r"^image 1: expected a non-empty H×W×3 uint8 RGB array, got \(4, 4\) uint8$"
    ):
        check_image(np.zeros((4, 4), np.uint8), 1)
    with pytest.raises(ValueError, match=r"^image 0: .* got \(4, 4, 3\) float32$"):
        check_image(np.zeros((4, 4, 3), np.float32))
    with pytest.raises(ValueError, match=r"got \(0, 4, 3\) uint8$"):
        check_image(np.zeros((0, 4, 3), np.uint8))


def test_preprocess_rejects_batch_tensors_that_do_not_fit() -> None:
    pre = ImagePreprocessor(raw_input([3, 8, 8]))
    out = np.zeros((2, 3, 8, 8), np.float32)
    with pytest.raises(ValueError, match=r"expected \(N, 3, 8, 8\)"):
        pre([np.zeros((4, 4, 3), np.uint8)], np.zeros((2, 3, 8, 9), np.float32))
    with pytest.raises(ValueError, match="do not fit"):
        pre([np.zeros((4, 4, 3), np.uint8)] * 3, out)


@pytest.mark.parametrize(
    ("resize", "shape", "size"),
    [
        ("letterbox", [3, 64, 96], (50, 31)),
        ("keep_height", [3, 48, 192], (100, 40)),
        ("stretch", [3, 32, 32], (32, 32)),
    ],
)
def test_uint8_resizer_holds_the_float_writers_pixels_before_normalisation(
    resize: str, shape: list[int], size: tuple[int, int]
) -> None:
    mean, std, scale = [0.1, 0.2, 0.3], [0.5, 0.25, 0.2], 1 / 255
    cfg = InputConfig(shape=shape, mean=mean, std=std, scale=scale, color="bgr", resize=resize, pad_value=77)  # type: ignore[arg-type]
    w, h = size
    img = np.random.default_rng(3).integers(0, 256, (h, w, 3), np.uint8)
    _, mh, mw = shape
    floats = np.zeros((2, *shape), np.float32)
    images = np.full((3, mh, mw, 3), 5, np.uint8)
    metas = ImageResizer(cfg)([img, img[:, ::-1]], images)
    assert metas == ImagePreprocessor(cfg)([img, img[:, ::-1]], floats)
    # Normalising the uint8 pixels (RGB, NHWC) gives the float writer's tensor (BGR, NCHW).
    bgr = images[:2, :, :, ::-1].transpose(0, 3, 1, 2).astype(np.float64)
    normalised = (bgr * scale - np.array(mean)[:, None, None]) / np.array(std)[:, None, None]
    np.testing.assert_allclose(floats, normalised, atol=1e-5)
    m = metas[0]
    content = images[0, m.pad_y : m.pad_y + m.content_h, m.pad_x : m.pad_x + m.content_w]
    if (m.content_w, m.content_h) == (w, h):
        assert np.array_equal(content, img)  # copied as it is, RGB order kept
    else:
        want = cv2.resize(img, (m.content_w, m.content_h), interpolation=cv2.INTER_LINEAR)
        assert np.array_equal(content, want)
    border = np.ones((mh, mw), bool)
    border[m.pad_y : m.pad_y + m.content_h, m.pad_x : m.pad_x + m.content_w] = False
    assert border.any() == (resize != "stretch")
    assert np.all(images[0][border] == 77)
    assert np.all(images[2] == 5)  # rows past the images are untouched


def test_letterboxed_uint8_batch_on_known_pixels() -> None:
    resizer = ImageResizer(raw_input([3, 64, 64], pad_value=114))
    a = np.zeros((200, 300, 3), np.uint8)
    a[:] = (10, 100, 200)
    out = np.zeros((1, 64, 64, 3), np.uint8)
    (meta,) = resizer([a], out)
    assert (meta.content_w, meta.content_h, meta.pad_x, meta.pad_y) == (64, 43, 0, 10)
    assert np.all(out[0, 10:53] == (10, 100, 200))
    assert np.all(out[0, :10] == 114) and np.all(out[0, 53:] == 114)
    with pytest.raises(ValueError, match=r"expected \(N, 64, 64, 3\)"):
        resizer([a], np.zeros((1, 3, 64, 64), np.uint8))
    with pytest.raises(ValueError, match="dtype float32 is not uint8"):
        resizer([a], np.zeros((1, 64, 64, 3), np.float32))
    with pytest.raises(ValueError, match="do not fit"):
        resizer([a, a], out)


# --------------------------------------------------------------------------- NMS


def test_nms_suppresses_overlaps_strictly_above_threshold() -> None:
    boxes = np.array([[0, 0, 10, 10], [1, 0, 11, 10], [50, 50, 60, 60], [1, 0, 11, 5]], float)
    scores = np.array([0.8, 0.9, 0.7, 0.6])
    # IoU(0, 1) = 90 / 110 = 0.818; IoU(1, 3) = 50 / 100 = 0.5 exactly.
    assert nms(boxes, scores, 0.5).tolist() == [1, 2, 3]
    assert nms(boxes, scores, 0.49).tolist() == [1, 2]
    assert nms(boxes, scores, 0.9).tolist() == [1, 0, 2, 3]
    assert nms(boxes, scores, 0.5, max_detections=2).tolist() == [1, 2]
    assert nms(np.zeros((0, 4)), np.zeros(0), 0.5).tolist() == []


def test_batched_nms_is_class_aware() -> None:
    boxes = np.array([[0, 0, 10, 10], [1, 1, 11, 11], [0, 0, 10, 10]], float)
    scores = np.array([0.9, 0.8, 0.7])
    assert batched_nms(boxes, scores, np.array([0, 0, 1]), 0.5).tolist() == [0, 2]
    assert batched_nms(boxes, scores, np.array([0, 1, 2]), 0.5).tolist() == [0, 1, 2]


# --------------------------------------------------------------------------- YOLO


def v8_output(
    dets: list[tuple[float, float, float, float, int, float]], nc: int = 3, anchors: int = 16
) -> np.ndarray:
    out = np.zeros((1, 4 + nc, anchors), np.float32)
    for a, (cx, cy, w, h, cls, score) in enumerate(dets):
        out[0, :4, a] = (cx, cy, w, h)
        out[0, 4 + cls, a] = score
    return out


def v5_output(
    dets: list[tuple[float, float, float, float, float, int, float]], nc: int = 3, anchors: int = 16
) -> np.ndarray:
    out = np.zeros((1, anchors, 5 + nc), np.float32)
    for a, (cx, cy, w, h, obj, cls, score) in enumerate(dets):
        out[0, a, :5] = (cx, cy, w, h, obj)
        out[0, a, 5 + cls] = score
    return out


IDENTITY = letterbox_geometry(640, 640, 640, 640)


def decode(
    out: np.ndarray, layout: str, confidence: float = 0.25, iou: float = 0.45
) -> list[tuple[Any, ...]]:
    (det,) = decode_yolo(out, [IDENTITY], layout=layout, confidence=confidence, iou=iou, max_detections=300)  # type: ignore[arg-type]
    return [
        (tuple(round(v, 3) for v in b), round(s, 4), c)
        for b, s, c in zip(det.boxes.tolist(), det.scores.tolist(), det.class_ids.tolist(), strict=True)
    ]


def test_yolov8_confidence_threshold_and_class_aware_nms() -> None:
    out = v8_output(
        [
            (100, 100, 40, 40, 0, 0.90),
            (102, 100, 40, 40, 0, 0.80),  # same class, IoU 0.90: suppressed
            (101, 100, 40, 40, 2, 0.70),  # other class, same place: kept
            (300, 300, 20, 20, 1, 0.25),  # exactly at the threshold: dropped (strictly above needed)
            (400, 300, 20, 20, 1, 0.26),
        ]
    )
    assert decode(out, "yolov8") == [
        ((80.0, 80.0, 120.0, 120.0), 0.9, 0),
        ((81.0, 80.0, 121.0, 120.0), 0.7, 2),
        ((390.0, 290.0, 410.0, 310.0), 0.26, 1),
    ]
    assert [d[2] for d in decode(out, "yolov8", confidence=0.75)] == [0]


def test_yolov5_score_is_objectness_times_class_and_boxes_are_clipped() -> None:
    out = v5_output(
        [
            (100, 100, 40, 40, 0.5, 1, 0.6),  # 0.30
            (100, 100, 40, 40, 0.9, 2, 0.2),  # 0.18 < 0.25 even though objectness is high
            (630, 5, 40, 20, 0.8, 0, 1.0),  # extends past the right and top edges
            (1000, 1000, 10, 10, 0.9, 0, 1.0),  # entirely outside the image: dropped
        ]
    )
    assert decode(out, "yolov5") == [
        ((610.0, 0.0, 640.0, 15.0), 0.8, 0),
        ((80.0, 80.0, 120.0, 120.0), 0.3, 1),
    ]


def test_max_detections_caps_per_image() -> None:
    out = v8_output([(50 * i + 20, 20, 10, 10, 0, 0.5 + i / 100) for i in range(10)])
    (det,) = decode_yolo(out, [IDENTITY], layout="yolov8", confidence=0.25, iou=0.45, max_detections=3)
    assert det.scores.tolist() == pytest.approx([0.59, 0.58, 0.57])


def test_layout_auto_rule() -> None:
    assert resolve_layout((1, 84, 8400)) == "yolov8"
    assert resolve_layout((1, 25200, 85)) == "yolov5"
    # 1000 classes on a small input: more channels than anchors, but the class count decides.
    assert resolve_layout((1, 1004, 525), num_classes=1000) == "yolov8"
    assert resolve_layout((1, 1004, 525)) == "yolov5"
    assert resolve_layout((2, 9, 9), "yolov8") == "yolov8"
    with pytest.raises(ValueError, match=r"\[1, 9, 9\].*set task.layout"):
        resolve_layout((1, 9, 9))
    with pytest.raises(ValueError, match="N, D1, D2"):
        resolve_layout((1, 84))


def test_a_layout_that_holds_another_class_count_than_the_labels_is_refused() -> None:
    # Decoded with the wrong count, every score comes from the wrong channel: garbage boxes.
    assert resolve_layout((1, 84, 8400), num_classes=80) == resolve_layout((1, 84, 8400), "yolov8", 80)
    with pytest.raises(ValueError) as info:
        resolve_layout((1, 5, 64), "yolov5", 1)  # a YOLOv8 head told it is yolov5
    assert str(info.value) == "output [1, 5, 64] read as yolov5 holds 59 class(es), but labels has 1"
    with pytest.raises(
        ValueError, match=r"^output \[1, 86, 8400\] read as yolov8 holds 82 class\(es\), but labels has 80$"
    ):
        resolve_layout((1, 86, 8400), num_classes=80)
    # An end-to-end export (YOLOv10, or ultralytics with nms=True) read as yolov5 gave
    # "person" at score 1.28; it is named for what it is.
    with pytest.raises(
        ValueError, match=r"^output \[1, 300, 6\] looks like an end-to-end export .*nms=False"
    ):
        resolve_layout((1, 300, 6), num_classes=80)
    # Without labels any count goes, and with the check off the count only breaks ties.
    assert resolve_layout((1, 300, 6)) == "yolov5"
    assert resolve_layout((1, 86, 8400), num_classes=80, check_classes=False) == "yolov8"


def square_detector(layout: str, nc: int = 3, anchors: int = 32, cls: int = 1, score: float = 0.9) -> bytes:
    """An ONNX model that "detects" the bright square in its input and reports it as YOLO would.

    It thresholds channel 0 at 0.9, finds the first and last rows/columns holding
    bright pixels with ArgMax, and writes ``cx, cy, w, h`` (model pixels) and
    the class score into anchor 0; every other anchor is zero.
    """
    f32 = TensorProto.FLOAT
    consts = {
        "c_start": np.array([0], np.int64),
        "c_end": np.array([1], np.int64),
        "c_axis": np.array([1], np.int64),
        "thr": np.array(0.9, np.float32),
        "one": np.array(1.0, np.float32),
        "half": np.array(0.5, np.float32),
        "cls_vec": np.array([[score if i == cls else 0.0 for i in range(nc)]], np.float32),
        "ax1": np.array([1], np.int64),
        "ax2": np.array([2], np.int64),
    }
    if layout == "yolov8":
        consts["pads"] = np.array([0, 0, 0, 0, 0, anchors - 1], np.int64)
    else:
        consts["pads"] = np.array([0, 0, 0, 0, anchors - 1, 0], np.int64)
    nodes = [
        helper.make_node(
            "Constant", [], [k], value=helper.make_tensor(k, _onnx_type(v), v.shape, v.flatten().tolist())
        )
        for k, v in consts.items()
    ]
    nodes += [
        helper.make_node("Slice", ["images", "c_start", "c_end", "c_axis"], ["ch0"]),
        helper.make_node("Greater", ["ch0", "thr"], ["mask_b"]),
        helper.make_node("Cast", ["mask_b"], ["mask"], to=f32),
        helper.make_node("ReduceMax", ["mask"], ["rows"], axes=[1, 3], keepdims=0),
        helper.make_node("ReduceMax", ["mask"], ["cols"], axes=[1, 2], keepdims=0),
        helper.make_node("ReduceMax", ["rows"], ["present"], axes=[1], keepdims=1),
    ]
    for name, src in (("y", "rows"), ("x", "cols")):
        nodes += [
            helper.make_node("ArgMax", [src], [f"{name}1_i"], axis=1, keepdims=1),
            helper.make_node("ArgMax", [src], [f"{name}2_i"], axis=1, keepdims=1, select_last_index=1),
            helper.make_node("Cast", [f"{name}1_i"], [f"{name}1"], to=f32),
            helper.make_node("Cast", [f"{name}2_i"], [f"{name}2l"], to=f32),
            helper.make_node("Add", [f"{name}2l", "one"], [f"{name}2"]),
            helper.make_node("Add", [f"{name}1", f"{name}2"], [f"{name}s"]),
            helper.make_node("Mul", [f"{name}s", "half"], [f"c{name}"]),
            helper.make_node("Sub", [f"{name}2", f"{name}1"], [f"{name}_len"]),
        ]
    nodes.append(helper.make_node("Mul", ["present", "cls_vec"], ["cls_scores"]))
    if layout == "yolov8":
        parts, unsq = ["cx", "cy", "x_len", "y_len", "cls_scores"], "ax2"
    else:
        parts, unsq = ["cx", "cy", "x_len", "y_len", "present", "cls_scores"], "ax1"
    nodes += [
        helper.make_node("Concat", parts, ["row"], axis=1),
        helper.make_node("Unsqueeze", ["row", unsq], ["row3"]),
        helper.make_node("Pad", ["row3", "pads"], ["output0"]),
    ]
    width = 4 + nc if layout == "yolov8" else 5 + nc
    out_shape = ["N", width, anchors] if layout == "yolov8" else ["N", anchors, width]
    graph = helper.make_graph(
        nodes,
        "square_detector",
        [helper.make_tensor_value_info("images", f32, ["N", 3, "H", "W"])],
        [helper.make_tensor_value_info("output0", f32, out_shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _onnx_type(v: np.ndarray) -> int:
    return TensorProto.INT64 if v.dtype == np.int64 else TensorProto.FLOAT


@pytest.mark.parametrize("layout", ["yolov8", "yolov5"])
def test_yolo_onnx_graph_end_to_end_in_source_pixels(layout: str) -> None:
    cfg = model_config(
        input={"shape": [3, 640, 640], "mean": [0, 0, 0], "std": [1, 1, 1]},
        labels=["cat", "dog", "bird"],
    )
    session = ort.InferenceSession(square_detector(layout), providers=["CPUExecutionProvider"])
    task = create_task(cfg, spec_for(cfg), {}, cfg.labels)
    assert isinstance(task, YoloTask)
    images = [
        rect_image(1280, 720, (300, 200, 500, 400)),
        rect_image(500, 300, (100, 50, 201, 150)),  # scale 1.28: edges land between model pixels
        np.zeros((480, 640, 3), np.uint8),  # nothing to find
        rect_image(300, 900, (0, 850, 300, 900)),  # touches three edges of a portrait frame
    ]
    batch = np.zeros((len(images), 3, 640, 640), np.float32)
    metas = task.preprocess(images, batch)
    raw = session.run(None, {"images": batch})[0]
    results = task.postprocess({"output0": raw}, metas)
    expected = [(300, 200, 500, 400), (100, 50, 201, 150), None, (0, 850, 300, 900)]
    assert len(results) == 4
    for dets, box in zip(results, expected, strict=True):
        assert isinstance(dets, list)
        if box is None:
            assert dets == []
            continue
        assert len(dets) == 1
        (d,) = dets
        assert isinstance(d, Detection)
        assert (d.label, d.class_id, d.polygon) == ("dog", 1, None)
        assert d.score == pytest.approx(0.9)
        assert np.abs(np.array(d.box) - box).max() <= 1.5, (d.box, box)
    # The first frame's box is exact: scale 0.5 puts every edge on a model pixel boundary.
    assert results[0][0].box == (300.0, 200.0, 500.0, 400.0)  # type: ignore[index]


def test_yolo_labels_from_ultralytics_metadata_and_ambiguous_layout_names_model() -> None:
    cfg = model_config(name="det9")
    task = create_task(cfg, spec_for(cfg), {"names": "{0: 'person', 1: 'car'}"}, [])
    assert task.labels == ["person", "car"]
    with pytest.raises(ValueError, match=r"'det9'.*\[1, 9, 9\]"):
        task.postprocess({"out": np.zeros((1, 9, 9), np.float32)}, [IDENTITY])


# --------------------------------------------------------------------------- classify


def test_softmax_applied_to_logits_and_top_k_with_labels() -> None:
    logits = np.array([[1.0, 3.0, 2.0], [0.0, 0.0, 5.0]], np.float32)
    res = classify(logits, ["a", "b", "c"], 2)
    p = softmax(logits.astype(np.float64))
    assert [r.label for r in res] == ["b", "c"]
    assert res[0].top == [("b", pytest.approx(p[0, 1])), ("c", pytest.approx(p[0, 2]))]
    assert res[1].class_id == 2 and res[1].score == pytest.approx(p[1, 2])


def test_probabilities_are_left_alone_and_missing_labels_fall_back_to_index() -> None:
    probs = np.array([[0.1, 0.2, 0.7], [0.5, 0.25, 0.25]], np.float32)
    assert is_probability(probs)
    res = classify(probs[:, :, None, None], ["x"], 5)
    assert isinstance(res[0], Classification)
    assert (res[0].class_id, res[0].label, res[0].score) == (2, "2", pytest.approx(0.7))
    assert [label for label, _ in res[0].top] == ["2", "1", "x"]  # k capped at the class count
    assert [s for _, s in res[0].top] == pytest.approx([0.7, 0.2, 0.1])
    assert res[1].top[1][0] == "1"  # tie 0.25/0.25: the lower index first
    idx, best = top_k(probs, 1)
    assert idx.tolist() == [[2], [0]] and best[:, 0].tolist() == pytest.approx([0.7, 0.5])
    assert not is_probability(np.array([[0.6, 0.6]])) and not is_probability(np.array([[1.2, -0.2]]))


def test_classify_task_batch() -> None:
    cfg = model_config(
        input={"shape": [3, 48, 192], "resize": "keep_height"},
        task={"kind": "classify", "top_k": 2},
        labels=["0", "180"],
    )
    task = create_task(cfg, TensorSpec("x", (None, 3, None, None), "float32"), {}, cfg.labels)
    out = task.postprocess({"p": np.array([[0.9, 0.1], [0.2, 0.8], [0.5, 0.5]], np.float32)}, [None, None])
    assert [(r.label, r.score) for r in out] == [("0", pytest.approx(0.9)), ("180", pytest.approx(0.8))]  # type: ignore[union-attr]


def test_probabilities_or_logits_is_decided_per_row_so_batch_mates_never_change_a_row() -> None:
    # A batch mixes crops of every camera: a row of logits (or zeros) beside a row of
    # probabilities must leave the probabilities alone.
    probs = np.array([[0.2, 0.5, 0.3]], np.float32)
    (alone,) = classify(probs, ["a", "b", "c"], 3)
    for odd in ([0.0, 0.0, 0.0], [5.0, -1.0, 2.0]):
        together = classify(np.array([probs[0], odd], np.float32), ["a", "b", "c"], 3)
        assert together[0] == alone
        assert together[1] == classify(np.array([odd], np.float32), ["a", "b", "c"], 3)[0]
    assert alone.score == pytest.approx(0.5)
    # A recogniser's item is all its time steps: one item of logits leaves the other be.
    steps = np.array([[[0.9, 0.1], [0.3, 0.7]], [[4.0, 1.0], [0.0, 2.0]]], np.float32)
    out = as_probabilities(steps, axis=2)
    np.testing.assert_array_equal(out[0], steps[0])
    np.testing.assert_allclose(out[1], softmax(steps[1], axis=1), rtol=1e-6)
    assert probability_items(steps, axis=2).tolist() == [True, False]


def test_classify_task_fails_a_non_finite_row_alone() -> None:
    cfg = model_config(name="cls", input={"shape": [3, 8, 8]}, task={"kind": "classify"}, labels=["a", "b"])
    task = create_task(cfg, TensorSpec("x", (None, 3, 8, 8), "float32"), {}, cfg.labels)
    rows = np.array([[0.9, 0.1], [np.nan, 0.5], [0.2, np.inf], [-np.inf, 1.0], [0.3, 0.7]], np.float32)
    out = task.postprocess({"y": rows}, [None] * 5)
    assert [r.label for r in out if isinstance(r, Classification)] == ["a", "b"]
    errors = [r for r in out if isinstance(r, NonFiniteOutput)]
    assert [(e.model, e.value) for e in errors] == [("cls", "NaN"), ("cls", "inf"), ("cls", "-inf")]
    assert isinstance(out[1], NonFiniteOutput) and isinstance(out[4], Classification)
    assert out[4].score == pytest.approx(0.7)
