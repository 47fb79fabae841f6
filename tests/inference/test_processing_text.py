"""Text pipeline pieces: DB box extraction, CTC decoding and crops."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
from rapidocr_onnxruntime.ch_ppocr_det.utils import DBPostProcess
from rapidocr_onnxruntime.ch_ppocr_rec.utils import CTCLabelDecode

from inference.backends.base import TensorSpec
from inference.config import ModelConfig
from inference.processing.crop import crop_box, crop_upright
from inference.processing.ctc import CTCDecoder, parse_dictionary
from inference.processing.db import DBParams, db_boxes, order_corners
from inference.processing.resize import letterbox_geometry, stretch_geometry
from inference.processing.tasks import TextDetectTask, create_task
from inference.results import Detection, Recognition
from inference.schema import build

# --------------------------------------------------------------------------- DB


def rotated_rect(cx: float, cy: float, w: float, h: float, angle: float) -> np.ndarray:
    return order_corners(cv2.boxPoints(((cx, cy), (w, h), angle)))


def draw(prob: np.ndarray, corners: np.ndarray, value: float) -> None:
    cv2.fillPoly(prob, [np.round(corners).astype(np.int32)], value)


def grown(corners: np.ndarray, ratio: float) -> np.ndarray:
    """The rectangle ``corners`` pushed out by DB's unclip distance on every side."""
    w = np.linalg.norm(corners[1] - corners[0])
    h = np.linalg.norm(corners[3] - corners[0])
    d = w * h * ratio / (2 * (w + h))
    center = corners.mean(axis=0)
    ux = (corners[1] - corners[0]) / w
    uy = (corners[3] - corners[0]) / h
    hw, hh = w / 2 + d, h / 2 + d
    return np.stack(
        [
            center - hw * ux - hh * uy,
            center + hw * ux - hh * uy,
            center + hw * ux + hh * uy,
            center - hw * ux + hh * uy,
        ]
    )


# A 600×400 source letterboxed into a 300×300 map: scale 0.5, content rows 50..250.
MAP_META = letterbox_geometry(600, 400, 300, 300)
RECT_A = rotated_rect(100, 100, 120, 20, 10)  # map coordinates
RECT_B = rotated_rect(200, 190, 80, 16, -20)


def two_line_map() -> np.ndarray:
    prob = np.zeros((300, 300), np.float32)
    draw(prob, RECT_A, 0.9)
    draw(prob, RECT_B, 0.8)
    return prob


def test_db_two_rotated_lines_give_unclipped_polygons_in_source_pixels() -> None:
    assert (MAP_META.scale_x, MAP_META.pad_y) == (0.5, 50)
    boxes = db_boxes(two_line_map(), MAP_META, DBParams(box_thresh=0.5, unclip_ratio=1.6))
    assert len(boxes) == 2
    for box, rect, score in zip(boxes, (RECT_A, RECT_B), (0.9, 0.8), strict=True):
        expected = MAP_META.to_source(grown(rect, 1.6))
        # Contours trace pixel centres, so a fitted edge sits up to about a map pixel inside.
        assert np.abs(box.corners - expected).max() <= 2.5, (box.corners, expected)
        # The fitted rectangle's rasterised edge picks up some zero pixels around the fill.
        assert 0.85 * score < box.score <= score + 1e-6
    # Clockwise from top-left: the top edge runs left to right, the right edge top to bottom.
    a = boxes[0].corners
    assert a[0, 0] < a[1, 0] and a[1, 1] < a[2, 1] and a[2, 0] > a[3, 0]


def test_db_matches_the_reference_implementation() -> None:
    prob = two_line_map()
    meta = stretch_geometry(300, 300, 300, 300)
    ours = db_boxes(prob, meta, DBParams(box_thresh=0.5, unclip_ratio=1.6))
    ref_boxes, ref_scores = DBPostProcess(thresh=0.3, box_thresh=0.5, unclip_ratio=1.6)(
        prob[None, None], (300, 300)
    )
    ref = sorted(zip(ref_boxes.tolist(), ref_scores, strict=True), key=lambda r: (r[0][0][1], r[0][0][0]))
    assert len(ours) == len(ref) == 2
    for mine, (theirs, score) in zip(ours, ref, strict=True):
        # The reference rounds its offset path and output to whole pixels; this keeps fractions.
        assert np.abs(mine.corners - np.array(theirs)).max() <= 1.5
        assert mine.score == pytest.approx(score, abs=0.015)


def test_db_filters_by_box_thresh_size_padding_and_max_candidates() -> None:
    prob = np.zeros((300, 300), np.float32)
    draw(prob, rotated_rect(150, 80, 100, 20, 0), 0.9)  # kept
    draw(prob, rotated_rect(150, 130, 90, 20, 0), 0.4)  # above thresh, below box_thresh
    prob[170:172, 50:250] = 0.9  # a 2 px line: shorter side under min_box_size
    prob[10:40, 50:250] = 0.9  # in the letterbox padding (rows < 50): never looked at
    draw(prob, rotated_rect(100, 200, 60, 14, 0), 0.9)  # kept, smaller
    boxes = db_boxes(prob, MAP_META, DBParams(box_thresh=0.5))
    assert [round(float(b.corners[:, 1].mean())) for b in boxes] == [60, 300]
    only_largest = db_boxes(prob, MAP_META, DBParams(box_thresh=0.5, max_candidates=1))
    assert [round(float(b.corners[:, 1].mean())) for b in only_largest] == [60]
    lenient = db_boxes(prob, MAP_META, DBParams(box_thresh=0.3))
    assert [round(float(b.corners[:, 1].mean())) for b in lenient] == [60, 160, 300]


def test_db_dilation_grows_the_box() -> None:
    prob = np.zeros((100, 100), np.float32)
    prob[40:50, 20:80] = 0.9
    meta = stretch_geometry(100, 100, 100, 100)
    plain = db_boxes(prob, meta, DBParams())[0].corners
    dilated = db_boxes(prob, meta, DBParams(dilate=True))[0].corners
    assert (dilated[2] - dilated[0] > plain[2] - plain[0]).all()


def text_config(kind: str, **task: object) -> ModelConfig:
    return build(
        {
            "name": f"ocr_{kind}",
            "model_file": {"path": "m.onnx"},
            "input": {"shape": [3, 300, 300], "mean": [0.5] * 3, "std": [0.5] * 3},
            "task": {"kind": kind, **task},
        },
        ModelConfig,
        "test",
    )


def test_text_detect_task_returns_text_detections_per_image() -> None:
    cfg = text_config("text_detect", box_thresh=0.5)
    task = create_task(cfg, TensorSpec("x", (None, 3, None, None), "float32"), {}, [])
    assert isinstance(task, TextDetectTask)
    batch = np.stack([two_line_map(), np.zeros((300, 300), np.float32)])[:, None]
    out = task.postprocess({"sigmoid": batch}, [MAP_META, MAP_META])
    assert len(out) == 2 and out[1] == []
    dets = out[0]
    assert isinstance(dets, list) and len(dets) == 2
    for d in dets:
        assert isinstance(d, Detection)
        assert (d.label, d.class_id) == ("text", 0)
        assert d.polygon is not None and len(d.polygon) == 4
        xs, ys = [p[0] for p in d.polygon], [p[1] for p in d.polygon]
        assert d.box == (min(xs), min(ys), max(xs), max(ys))


# --------------------------------------------------------------------------- CTC

CHARS = ["a", "b", "c"]  # blank=0, a=1, b=2, c=3, space=4


def one_hot_steps(seq: list[int], probs: list[float] | None = None, k: int = 5) -> np.ndarray:
    out = np.zeros((len(seq), k), np.float32)
    for t, idx in enumerate(seq):
        p = 0.9 if probs is None else probs[t]
        out[t, :] = (1 - p) / (k - 1)
        out[t, idx] = p
    return out


def test_ctc_greedy_decoding_collapses_repeats_and_drops_blanks() -> None:
    dec = CTCDecoder.from_dictionary(CHARS, 5)
    assert dec.characters == ["blank", "a", "b", "c", " "]
    batch = np.stack(
        [
            one_hot_steps([1, 1, 0, 1, 2, 2, 0, 0], [0.9, 0.5, 0.99, 0.7, 0.6, 0.8, 0.9, 0.9]),  # "aab"
            one_hot_steps([0] * 8),  # ""
            one_hot_steps([3, 4, 4, 1, 0, 0, 3, 3]),  # "c ac"
            one_hot_steps([2, 0, 2, 2, 0, 2, 3, 1]),  # "bbbca"
        ]
    )
    res = dec.decode(batch)
    assert [t for t, _ in res] == ["aab", "", "c ac", "bbbca"]
    # Score: mean probability of the first step of each kept run.
    assert res[0][1] == pytest.approx((0.9 + 0.7 + 0.6) / 3)
    assert res[1][1] == 0.0
    assert res[2][1] == pytest.approx(0.9)


def test_ctc_dictionary_without_space_and_mismatches() -> None:
    assert CTCDecoder.from_dictionary(CHARS, 4).characters == ["blank", "a", "b", "c"]
    with pytest.raises(ValueError, match=r"6 output classes but the dictionary has 3"):
        CTCDecoder.from_dictionary(CHARS, 6)
    with pytest.raises(ValueError, match=r"expected \[N, T, 5\]"):
        CTCDecoder.from_dictionary(CHARS, 5).decode(np.zeros((1, 4, 6), np.float32))
    assert parse_dictionary("a\r\nb\nc\n") == ["a", "b", "c"]


def test_ctc_matches_the_reference_decoder_on_random_batches() -> None:
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(6, 40, 5)).astype(np.float32) * 3
    logits[:, :, 0] += 2  # plenty of blanks, as a real model emits
    probs = np.exp(logits) / np.exp(logits).sum(axis=2, keepdims=True)
    ours = CTCDecoder.from_dictionary(CHARS, 5).decode(probs)
    theirs = CTCLabelDecode(character=list(CHARS))(probs)
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    assert [s for _, s in ours] == pytest.approx([s for _, s in theirs])


def test_text_recognize_task_decodes_batch_and_requires_dictionary() -> None:
    cfg = text_config("text_recognize")
    spec = TensorSpec("x", (None, 3, None, None), "float32")
    task = create_task(cfg, spec, {"character": "a\nb\nc"}, [])
    batch = np.stack([one_hot_steps([1, 2, 2, 0, 3]), one_hot_steps([4, 4, 1, 0, 0])])
    out = task.postprocess({"softmax": batch}, [None, None])
    assert out == [Recognition("abc", pytest.approx(0.9)), Recognition(" a", pytest.approx(0.9))]  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"model 'ocr_text_recognize'.*no 'character' entry.*keys present: other"
    ):
        create_task(cfg, spec, {"other": "x"}, [])
    custom = text_config("text_recognize", dictionary_key="chars")
    with pytest.raises(ValueError, match=r"no 'chars' entry"):
        create_task(custom, spec, {"character": "a"}, [])


# --------------------------------------------------------------------------- crops


def test_crop_box_clips_pads_and_is_never_empty() -> None:
    img = np.arange(10 * 20 * 3, dtype=np.uint32).reshape(10, 20, 3).astype(np.uint8)
    assert crop_box(img, (2, 3, 6, 8)).shape == (5, 4, 3)
    assert np.shares_memory(crop_box(img, (2, 3, 6, 8)), img)
    assert crop_box(img, (2.2, 3.7, 5.1, 7.9)).shape == (5, 4, 3)  # fractional edges round outwards
    assert crop_box(img, (2, 3, 6, 8), pad=2).shape == (9, 8, 3)
    assert crop_box(img, (-5, -5, 100, 100)).shape == (10, 20, 3)
    assert crop_box(img, (4, 4, 4, 4)).shape == (1, 1, 3)  # degenerate: 1×1
    far = crop_box(img, (50, 50, 60, 60))  # outside: the nearest corner pixel
    assert far.shape == (1, 1, 3) and (far[0, 0] == img[9, 19]).all()
    assert crop_box(img, (6, 8, 2, 3)).shape == (5, 4, 3)  # swapped corners


def test_crop_upright_rectifies_a_rotated_line() -> None:
    rng = np.random.default_rng(3)
    patch = cv2.resize(
        rng.integers(0, 255, (10, 40, 3), dtype=np.uint8), (200, 50), interpolation=cv2.INTER_NEAREST
    )
    canvas = np.zeros((400, 400, 3), np.uint8)
    canvas[175:225, 100:300] = patch
    rot = cv2.getRotationMatrix2D((200, 200), 25, 1.0)
    frame = cv2.warpAffine(canvas, rot, (400, 400), flags=cv2.INTER_LINEAR)
    corners = np.array([[100, 175], [300, 175], [300, 225], [100, 225]], np.float64)
    polygon = order_corners(cv2.transform(corners[None], rot)[0])
    crop = crop_upright(frame, polygon)
    assert crop.shape == (50, 200, 3)
    inner = (slice(5, 45), slice(5, 195))
    assert np.abs(crop[inner].astype(int) - patch[inner].astype(int)).mean() < 12
    scaled = crop_upright(frame, polygon, out_height=48)
    assert scaled.shape == (48, 192, 3)


def test_crop_upright_turns_vertical_lines() -> None:
    img = np.zeros((200, 100, 3), np.uint8)
    img[20:40, 30:60] = 255  # top of a 30×120 vertical strip
    polygon = [(30, 20), (60, 20), (60, 140), (30, 140)]
    crop = crop_upright(img, polygon)
    assert crop.shape == (30, 120, 3) and crop.flags.c_contiguous
    # Turned counter-clockwise: the strip's top ends up on the left.
    assert crop[:, :15].mean() > 200 and crop[:, 30:].mean() < 5
    assert crop_upright(img, polygon, out_height=15).shape == (15, 60, 3)
    with pytest.raises(ValueError, match="four"):
        crop_upright(img, [(0, 0), (1, 1)])


def test_text_detect_task_rejects_a_map_not_at_input_resolution() -> None:
    cfg = text_config("text_detect")
    task = create_task(cfg, TensorSpec("x", (None, 3, None, None), "float32"), {}, [])
    with pytest.raises(ValueError, match=r"'ocr_text_detect'.*\[N, 1, 300, 300\].*\[1, 1, 75, 75\]"):
        task.postprocess({"p": np.zeros((1, 1, 75, 75), np.float32)}, [MAP_META])
