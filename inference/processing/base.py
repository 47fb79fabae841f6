"""The :class:`Task` base: a model kind's batched pre/post-processing contract.

The concrete tasks for each ``task.kind`` live in :mod:`inference.processing.tasks`.
A task turns a list of images into one batch tensor and a batch of raw outputs
into one result per image. It is called from a model instance's worker thread
with a whole batch at a time::

    metas = task.preprocess(images, out)        # fills out[:len(images)]
    outputs = backend.run_borrowed({input_name: out[:n]})
    results = task.postprocess(outputs, metas)  # one Result (or exception) per image

The outputs may be the backend's own buffers, overwritten by the next batch, so a
result never holds a view of them (copy what it keeps).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np

from inference.backends.base import TensorSpec
from inference.config import ModelConfig, TaskConfig
from inference.processing.resize import ImagePreprocessor, ResizeMeta
from inference.results import Result


class Preprocessor(Protocol):
    """Writes a batch of H×W×3 uint8 RGB images into the batch tensor; one geometry per image.

    :class:`~inference.processing.resize.ImagePreprocessor` (host float),
    :class:`~inference.processing.resize.ImageResizer` (host uint8) and
    :class:`~inference.gpu.preprocess.GpuPreprocessor` (device) are the three;
    the model picks one by where its backend reads the batch.
    """

    def __call__(self, images: Sequence[np.ndarray], out: np.ndarray) -> list[ResizeMeta]: ...


class Task(ABC):
    """Batched pre/post-processing for one model.

    A task kind names itself (``kind``, the ``task.kind`` in config.yaml) and its
    options (``options_type``, what the rest of ``task:`` takes); see
    :func:`inference.processing.tasks.register_task`.
    """

    kind: ClassVar[str]
    options_type: ClassVar[type[TaskConfig]] = TaskConfig
    # True for a detector: it finds objects in a whole frame (a list of Detection per image),
    # so it can run without ``on:``; other kinds describe objects another stage found.
    finds_objects: ClassVar[bool] = False

    def __init__(
        self,
        config: ModelConfig,
        input_spec: TensorSpec,
        metadata: Mapping[str, str],
        labels: Sequence[str],
        *,
        preprocessor: Preprocessor | None = None,
    ) -> None:
        self.config = config
        self.input_spec = input_spec
        self.metadata = dict(metadata)
        self.labels = list(labels)
        # Writes images into the batch tensor: the model hands in the one its backend's input
        # location needs; alone (a check, a test), the host float one.
        self.preprocessor: Preprocessor = preprocessor or ImagePreprocessor(config.input)

    @property
    def item_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of one preprocessed item."""
        c, h, w = self.config.input.shape
        return (c, h, w)

    @abstractmethod
    def preprocess(self, images: Sequence[np.ndarray], out: np.ndarray) -> list[Any]:
        """Write ``images`` (H×W×3 uint8 RGB) into ``out[:len(images)]``; return one meta per image."""

    def check_outputs(self, outputs: Sequence[TensorSpec]) -> None:
        """Raise a config error (``task.*``) if the model's outputs, as loaded, cannot be decoded.

        Run when the model loads, so a model that does not fit its ``task:`` is refused
        there (a reload keeps the old copy) rather than failing on every batch. Only
        what the shapes alone tell; a kind with nothing to check keeps this no-op.
        """
        return None

    @abstractmethod
    def postprocess(
        self, outputs: Mapping[str, np.ndarray], metas: Sequence[Any]
    ) -> Sequence[Result | Exception]:
        """Turn the batch's raw outputs into one result per image, in source-image coordinates.

        An image whose output cannot become a result (NaN) gets an exception in its place
        (:class:`~inference.results.NonFiniteOutput`): its request alone fails.
        """
