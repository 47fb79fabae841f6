"""The GPU path: device pools, fused pre-processing kernels and their NumPy references.

A model served from the GPU keeps its batch tensors on the GPU of each
instance (``instance_group.gpus``) and fills them there with one kernel launch
per batch::

    backend: tensorrt
    input: {shape: [3, 640, 640], dtype: float16}
    instance_group: [{count: 2, kind: KIND_GPU, gpus: [0, 1]}]   # one instance per GPU
    backend_options: {fp16: true, cuda_graphs: true, workspace_mb: 2048}

Nothing here imports CuPy at module load: :mod:`inference.gpu.kernels` holds
the CUDA source and the NumPy references (usable anywhere); the launches,
:mod:`inference.gpu.memory` and :mod:`inference.gpu.preprocess` import CuPy on
first use and raise a clear error when no GPU is usable.
"""

from __future__ import annotations

from typing import Any

from inference.config import ModelConfig
from inference.memory import BufferPool

__all__ = ["device_batch_pool", "gpu_preprocessor"]


def device_batch_pool(
    config: ModelConfig, count: int = 1, *, name: str | None = None, device: int | None = None
) -> BufferPool:
    """A pool of ``(max(1, max_batch_size), C, H, W)`` batch tensors on GPU ``device``."""
    from inference.gpu.memory import device_pool

    c, h, w = config.input.shape
    shape = (max(1, config.max_batch_size), c, h, w)
    return device_pool(shape, config.input.dtype, count, name=name or f"{config.name}/device", device=device)


def gpu_preprocessor(config: ModelConfig, stream: Any = None, *, device: int | None = None) -> Any:
    """A :class:`~inference.gpu.preprocess.GpuPreprocessor` on GPU ``device``, sized for the largest batch."""
    from inference.gpu.preprocess import GpuPreprocessor

    return GpuPreprocessor(
        config.input, max_batch=max(1, config.max_batch_size), stream=stream, device=device
    )
