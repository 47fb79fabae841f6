"""Backends run one model instance; ``backend:`` in ``config.yaml`` picks one by name::

    backend: onnxruntime        # or openvino, tensorrt (NVIDIA GPUs), triton (a remote server)
    instance_group: [{count: 2, kind: KIND_CPU}]
    backend_options:            # what the chosen backend takes (its options_type)
      intra_op_threads: 2
      execution_providers: [auto]       # default: CPU only; auto = CUDA when present

Each backend class names itself and its options (``kind``, ``options_type``);
:func:`register_backend` makes it one of the names ``backend:`` accepts, and
the config loader then checks ``backend_options:`` against its options, so a
key another backend takes is a ``FILE:LINE`` error that names that backend.

Backend modules import their runtime lazily, so importing this package is cheap
and a machine without TensorRT can still serve ONNX Runtime models.
"""

from __future__ import annotations

from pathlib import Path

from inference.backends.base import Backend, BackendError, TensorSpec
from inference.backends.onnxruntime import OnnxRuntimeBackend
from inference.backends.openvino import OpenVinoBackend
from inference.backends.tensorrt import TensorRTBackend
from inference.backends.triton import TritonBackend
from inference.config import BACKEND_OPTIONS, ModelConfig
from inference.kinds import ClassKinds

__all__ = ["BACKENDS", "Backend", "BackendError", "TensorSpec", "create_backend", "register_backend"]


# backend name -> the class that runs it, in step with BACKEND_OPTIONS (what the config
# loader reads).
BACKENDS: ClassKinds[type[Backend]] = ClassKinds(BACKEND_OPTIONS)


def register_backend(cls: type[Backend]) -> type[Backend]:
    """Make ``cls.kind`` a backend, taking ``cls.options_type`` as its ``backend_options``.

    Register before configs are read; a name taken by another class is an error.
    """
    return BACKENDS.add(cls)


for _cls in (OnnxRuntimeBackend, OpenVinoBackend, TensorRTBackend, TritonBackend):
    register_backend(_cls)


def create_backend(config: ModelConfig, model_path: Path, instance: int) -> Backend:
    """Load instance number ``instance`` (0-based, across all instance groups) of a model."""
    cls = BACKENDS.get(config.backend)
    if cls is None:
        # A config built in code; one read from a file was checked against the names.
        problem, hint = BACKENDS.check(config.backend) or ("", "")
        raise config.error("backend", problem, hint)
    return cls(config, model_path, instance)
