"""The backend contract: one object per model instance, running one batch at a time.

A backend is created for each instance in ``instance_group`` and only ever called
from that instance's worker thread, so it never sees two batches at once. While
loading it checks the model's declared image input against the config once, with
:func:`inference.backends.inputs.check_input`, and keeps the result as ``input``.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from inference.config import BackendOptions, ModelConfig
from inference.errors import VidpipeError


@dataclass(frozen=True)
class TensorSpec:
    """A model input or output: name, shape (None = dynamic) and NumPy dtype name."""

    name: str
    shape: tuple[int | None, ...]
    dtype: str


class InputLocation(enum.Enum):
    """Where a backend reads its batch tensor, and so what fills it (:data:`inference.model.INPUT_PLANS`)."""

    # float N×C×H×W in host memory, resized and normalised on the host.
    HOST_FLOAT = "host_float"
    # uint8 N×H×W×3 RGB in host memory, only resized: the model swaps channels,
    # normalises and transposes itself (OpenVINO's backend_options.preprocess: model).
    HOST_UINT8 = "host_uint8"
    # N×C×H×W on the instance's GPU, filled there by the fused kernel and read in place.
    DEVICE = "device"


class BackendError(VidpipeError, RuntimeError):
    """A model file that cannot be loaded or run here; the message names the model and what to do.

    A model that loads but disagrees with its config is a
    :class:`~inference.config.ModelConfigError` instead.
    """


class Backend(ABC):
    """One loaded instance of a model.

    A backend kind names itself (``kind``, the ``backend:`` in config.yaml) and its
    options (``options_type``, what ``backend_options:`` takes); see
    :func:`inference.backends.register_backend`.
    """

    kind: ClassVar[str]
    options_type: ClassVar[type[BackendOptions]] = BackendOptions
    input: TensorSpec  # the image input the config feeds (checked at load)
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    metadata: dict[str, str]
    # The precision the runtime computes in (f32, bf16, f16) where it decides one;
    # "native": the model file's own types.
    precision: str = "native"
    # Where run() reads the batch: the model picks its batch pool and preprocessor by it.
    # A class whose answer depends on the config sets it per instance while loading.
    input_location: InputLocation = InputLocation.HOST_FLOAT

    def __init__(self, config: ModelConfig, model_path: Path, instance: int = 0) -> None:  # noqa: B027
        """Load instance number ``instance`` (0-based, across all instance groups) of a model."""

    @abstractmethod
    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch; arrays carry the batch dimension when the model has one.

        The output arrays are the caller's: later calls do not change them.
        """

    def run_borrowed(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """:meth:`run`, but the outputs may be the backend's own buffers, valid until its next call.

        For a caller that turns the outputs into results before the next batch (a
        model's worker thread): a backend that writes into buffers of its own
        saves copying them. By default, :meth:`run`.
        """
        return self.run(inputs)

    @property
    def stream(self) -> Any:
        """The CUDA stream a ``DEVICE`` backend runs its batches on (its preprocessor queues there).

        None for a backend that reads host memory.
        """
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the instance's resources."""

    def watch_health(self, changed: Callable[[str | None], None]) -> None:  # noqa: B027
        """Call ``changed(reason)`` when a remote server stops serving, ``changed(None)`` when
        it serves again; a backend that runs in this process never calls it."""
