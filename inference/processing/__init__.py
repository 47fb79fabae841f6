"""Batched pre/post-processing for the model kinds vidpipe serves.

Images go in as H×W×3 uint8 RGB and results come out in source-image pixels.
The modules own one concept each: ``resize`` (geometry and normalisation into
the batch tensor), ``nms``, ``yolo``, ``classify``, ``db`` (text detection),
``ctc`` (text recognition), ``crop`` (second-stage crops), ``base`` (the
:class:`~inference.processing.base.Task` contract every kind implements) and
``tasks`` (the concrete task per ``task.kind`` and :func:`create_task`).
"""

from __future__ import annotations

from inference.processing.crop import crop_box, crop_upright
from inference.processing.resize import ImagePreprocessor, ResizeMeta
from inference.processing.tasks import (
    ClassifyTask,
    TextDetectTask,
    TextRecognizeTask,
    YoloTask,
    create_task,
)

__all__ = [
    "ClassifyTask",
    "ImagePreprocessor",
    "ResizeMeta",
    "TextDetectTask",
    "TextRecognizeTask",
    "YoloTask",
    "create_task",
    "crop_box",
    "crop_upright",
]
