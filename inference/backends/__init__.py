"""Backends run one model instance; :func:`create_backend` picks one from ``config.yaml``::

    backend: onnxruntime        # or openvino, tensorrt (NVIDIA GPUs), triton (a remote server)
    instance_group: [{count: 2, kind: KIND_CPU}]
    backend_options:
      intra_op_threads: 2
      execution_providers: [auto]       # default: CPU only; auto = CUDA when present

``backend_options.preprocess: model`` (normalise inside the model) is OpenVINO's
alone; on another backend it is refused here, before anything loads.

Backend modules import their runtime lazily, so importing this package is cheap
and a machine without TensorRT can still serve ONNX Runtime models.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from inference.backends.base import Backend, BackendError, TensorSpec
from inference.config import ModelConfig

__all__ = ["Backend", "BackendError", "TensorSpec", "create_backend"]

# Kept here (not imported from the TensorRT module) so the check costs no import.
_TENSORRT_MISSING = (
    "TensorRT backend needs an NVIDIA GPU with the `tensorrt` and `cupy` packages "
    "(pip install 'vidpipe[gpu]'); use backend: onnxruntime on CPU"
)


# The backends that can normalise images inside the model (backend_options.preprocess: model).
PREPROCESS_IN_MODEL = ("openvino",)


def create_backend(config: ModelConfig, model_path: Path, instance: int) -> Backend:
    """Load instance number ``instance`` (0-based, across all instance groups) of a model."""
    if config.backend_options.preprocess == "model" and config.backend not in PREPROCESS_IN_MODEL:
        # Refused before loading anything: a TensorRT build takes minutes.
        raise config.error(
            "backend_options.preprocess",
            f"backend {config.backend} cannot normalise images inside the model",
            f"set backend_options.preprocess: auto or cpu, or use backend: {PREPROCESS_IN_MODEL[0]}",
        )
    if config.backend == "onnxruntime":
        from inference.backends.onnxruntime import OnnxRuntimeBackend

        return OnnxRuntimeBackend(config, model_path, instance)
    if config.backend == "openvino":
        from inference.backends.openvino import OpenVinoBackend

        return OpenVinoBackend(config, model_path, instance)
    if config.backend == "triton":
        from inference.backends.triton import TritonBackend

        return TritonBackend(config, model_path, instance)
    if config.backend == "tensorrt":
        if importlib.util.find_spec("tensorrt") is None or importlib.util.find_spec("cupy") is None:
            raise BackendError(f"{config.name}: {_TENSORRT_MISSING}")
        try:
            module = importlib.import_module("inference.backends.tensorrt")
        except ImportError as exc:
            raise BackendError(f"{config.name}: {_TENSORRT_MISSING} ({exc})") from exc
        backend: Backend = module.TensorRTBackend(config, model_path, instance)
        return backend
    raise config.error("backend", f"unknown backend {config.backend!r}", "use backend: onnxruntime")
