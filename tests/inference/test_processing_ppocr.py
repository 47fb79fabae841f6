"""The text tasks end to end with the real PP-OCR det/cls/rec models on rendered text."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import onnxruntime as ort
import pytest
import rapidocr_onnxruntime
from rapidocr_onnxruntime.ch_ppocr_rec.utils import CTCLabelDecode

from inference.backends.base import TensorSpec
from inference.config import ModelConfig
from inference.processing.base import Task
from inference.processing.crop import crop_upright
from inference.processing.tasks import ClassifyTask, TextDetectTask, TextRecognizeTask, create_task
from inference.results import Classification, Detection, Recognition
from inference.schema import build

MODELS = Path(rapidocr_onnxruntime.__file__).parent / "models"
NORM: dict[str, Any] = {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "color": "bgr"}

DET = {
    "name": "ppocr_det",
    "model_file": {"package": "rapidocr_onnxruntime", "path": "models/ch_PP-OCRv4_det_infer.onnx"},
    "input": {"shape": [3, 640, 640], **NORM},
    "task": {"kind": "text_detect", "thresh": 0.3, "box_thresh": 0.5, "unclip_ratio": 1.6},
}
CLS = {
    "name": "ppocr_cls",
    "model_file": {"package": "rapidocr_onnxruntime", "path": "models/ch_ppocr_mobile_v2.0_cls_infer.onnx"},
    "input": {"shape": [3, 48, 192], "resize": "keep_height", "pad_value": 128, **NORM},
    "task": {"kind": "classify"},
    "labels": ["0", "180"],
}
REC = {
    "name": "ppocr_rec",
    "model_file": {"package": "rapidocr_onnxruntime", "path": "models/ch_PP-OCRv4_rec_infer.onnx"},
    "input": {"shape": [3, 48, 320], "resize": "keep_height", "pad_value": 128, **NORM},
    "task": {"kind": "text_recognize"},
}


class Loaded:
    """A session and its task, run the way a model instance runs a batch."""

    def __init__(self, raw: dict[str, Any]) -> None:
        self.config = build(raw, ModelConfig, "test")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 2
        path = MODELS / Path(self.config.model_file.path).name
        self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        inp = self.session.get_inputs()[0]
        spec = TensorSpec(inp.name, tuple(d if isinstance(d, int) else None for d in inp.shape), "float32")
        self.metadata = dict(self.session.get_modelmeta().custom_metadata_map)
        self.task: Task = create_task(self.config, spec, self.metadata, self.config.labels)
        self.last_outputs: dict[str, np.ndarray] = {}

    def __call__(self, images: Sequence[np.ndarray]) -> list[Any]:
        batch = np.zeros((len(images), *self.task.item_shape), np.float32)
        metas = self.task.preprocess(images, batch)
        names = [o.name for o in self.session.get_outputs()]
        feed = {self.session.get_inputs()[0].name: batch}
        self.last_outputs = dict(zip(names, self.session.run(None, feed), strict=True))
        return self.task.postprocess(self.last_outputs, metas)


@pytest.fixture(scope="module")
def det() -> Loaded:
    return Loaded(DET)


@pytest.fixture(scope="module")
def cls() -> Loaded:
    return Loaded(CLS)


@pytest.fixture(scope="module")
def rec() -> Loaded:
    return Loaded(REC)


def render(text: str, size: tuple[int, int] = (800, 240), scale: float = 2.5) -> np.ndarray:
    img = np.full((size[1], size[0], 3), 255, np.uint8)
    cv2.putText(img, text, (40, size[1] * 5 // 8), cv2.FONT_HERSHEY_SIMPLEX, scale, (0, 0, 0), 6, cv2.LINE_AA)
    return img


def ink_bounds(img: np.ndarray) -> tuple[int, int, int, int]:
    ys, xs = np.nonzero(img.min(axis=2) < 128)
    return int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1


def rotate(img: np.ndarray, degrees: float) -> np.ndarray:
    h, w = img.shape[:2]
    m = cv2.getRotationMatrix2D((w / 2, h / 2), degrees, 1.0)
    return cv2.warpAffine(img, m, (w, h), borderValue=(255, 255, 255))


def test_tasks_are_the_text_kinds(det: Loaded, cls: Loaded, rec: Loaded) -> None:
    assert isinstance(det.task, TextDetectTask)
    assert isinstance(cls.task, ClassifyTask)
    assert isinstance(rec.task, TextRecognizeTask)


def test_detect_classify_recognise_rendered_text(det: Loaded, cls: Loaded, rec: Loaded) -> None:
    texts = ["VIDPIPE 2026", "OCR 42"]
    images = [render(texts[0]), render(texts[1], size=(420, 300), scale=2.0)]
    found = det(images)
    crops = []
    for img, dets in zip(images, found, strict=True):
        assert isinstance(dets, list) and len(dets) == 1
        (d,) = dets
        assert isinstance(d, Detection) and d.label == "text" and d.polygon is not None
        x1, y1, x2, y2 = ink_bounds(img)
        # The box covers the ink (to 2 px; anti-aliased edge pixels count as ink) and little else.
        assert d.box[0] <= x1 + 2 and d.box[1] <= y1 + 2 and d.box[2] >= x2 - 2 and d.box[3] >= y2 - 2
        assert d.box[0] >= x1 - 12 and d.box[1] >= y1 - 12 and d.box[2] <= x2 + 12 and d.box[3] <= y2 + 12
        assert d.score > 0.7
        crops.append(crop_upright(img, d.polygon))

    flipped = [cv2.rotate(c, cv2.ROTATE_180) for c in crops]
    orientation = cls(crops + flipped)
    assert all(isinstance(o, Classification) for o in orientation)
    assert [o.label for o in orientation] == ["0", "0", "180", "180"]
    assert min(o.score for o in orientation) > 0.9

    lines = rec(crops)
    assert all(isinstance(r, Recognition) for r in lines)
    assert [r.text for r in lines] == texts
    assert min(r.score for r in lines) > 0.8

    # The dictionary mapping agrees with the reference decoder on the same raw output.
    raw = next(iter(rec.last_outputs.values()))
    reference = CTCLabelDecode(character=rec.metadata["character"].splitlines())(raw)
    assert [t for t, _ in reference] == texts
    assert [r.score for r in lines] == pytest.approx([s for _, s in reference])


def test_rotated_line_is_rectified_and_read(det: Loaded, rec: Loaded) -> None:
    img = rotate(render("Hello, World!", size=(800, 400)), 12)
    (dets,) = det([img])
    assert isinstance(dets, list) and len(dets) == 1
    polygon = np.array(dets[0].polygon)
    top_edge = polygon[1] - polygon[0]
    assert np.degrees(np.arctan2(-top_edge[1], top_edge[0])) == pytest.approx(12, abs=2)
    (line,) = rec([crop_upright(img, polygon)])
    assert isinstance(line, Recognition) and line.text == "Hello, World!"
