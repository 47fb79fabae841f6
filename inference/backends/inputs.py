"""The one check that a model's declared image input fits its ``config.yaml``.

Every backend runs it once per instance while loading, on the inputs the
model file declares, before anything expensive (a TensorRT build takes
minutes). The keys it can point at::

    max_batch_size: 16                  # batch axis: dynamic, or fixed at 1 with max_batch_size: 1
    input: {shape: [3, 640, 640], name: images, dtype: float32}

A mismatch is an :class:`InputMismatchError` at the key to change, naming the
model file, the tensor, what the model declares and what the config says.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from inference.backends.base import TensorSpec
from inference.config import ModelConfig, ModelConfigError

__all__ = ["InputMismatchError", "check_input"]


class InputMismatchError(ModelConfigError):
    """The model's declared input does not fit the config; ``key`` is the config key to change."""


def _shown(shape: Sequence[int | None]) -> str:
    return "[" + ", ".join("dynamic" if d is None else str(d) for d in shape) + "]"


def check_input(config: ModelConfig, model_path: Path, inputs: Sequence[TensorSpec]) -> TensorSpec:
    """The input the config feeds images into, or :class:`InputMismatchError`.

    ``inputs`` are the model's declared inputs; a ``None`` dimension is dynamic.
    """

    def mismatch(key: str, problem: str) -> InputMismatchError:
        error = config.error(key, f"{model_path.name}: {problem}", kind=InputMismatchError)
        assert isinstance(error, InputMismatchError)
        return error

    names = [i.name for i in inputs]
    if not inputs:
        raise mismatch("model_file", "the model declares no inputs")
    wanted = config.input.name
    if wanted is not None:
        matches = [i for i in inputs if i.name == wanted]
        if not matches:
            raise mismatch(
                "input.name",
                f"the model has no input tensor {wanted!r} (it has: {', '.join(names)}); "
                f"set input.name to one of those",
            )
        spec = matches[0]
    else:
        spec = inputs[0]
    if len(inputs) > 1:
        raise mismatch(
            "model_file",
            f"the model needs {len(inputs)} inputs ({', '.join(names)}) but is fed only the image "
            f"tensor {spec.name!r}; export it with a single image input",
        )
    tensor = f"input tensor {spec.name!r}"
    if spec.dtype not in ("float32", "float16"):
        raise mismatch(
            "input.dtype",
            f"{tensor} is {spec.dtype}, but images are fed as float tensors; export the model with a "
            f"float32 or float16 input",
        )
    if spec.dtype != config.input.dtype:
        raise mismatch(
            "input.dtype",
            f"{tensor} is {spec.dtype}, config.yaml says input.dtype: {config.input.dtype}; "
            f"set input.dtype: {spec.dtype}",
        )
    shape = list(spec.shape)
    batched = config.max_batch_size > 0
    if batched and len(shape) == 3:
        raise mismatch(
            "max_batch_size",
            f"{tensor} has no batch axis (shape {_shown(shape)}), but max_batch_size is "
            f"{config.max_batch_size}; set max_batch_size: 0",
        )
    if not batched and len(shape) == 4:
        raise mismatch(
            "max_batch_size",
            f"{tensor} has a batch axis (shape {_shown(shape)}), but max_batch_size is 0; "
            f"set max_batch_size to 1 or more",
        )
    if len(shape) not in (3, 4):
        raise mismatch(
            "model_file",
            f"{tensor} has shape {_shown(shape)}; an image input must be [batch, C, H, W] or [C, H, W]",
        )
    if batched:
        batch_dim = shape[0]
        if batch_dim is not None and not (batch_dim == 1 == config.max_batch_size):
            fix = "set max_batch_size: 1 or " if batch_dim == 1 else ""
            raise mismatch(
                "max_batch_size",
                f"{tensor} has a fixed batch size of {batch_dim}, but max_batch_size is "
                f"{config.max_batch_size} and batches vary in size; {fix}export the model with a "
                f"dynamic batch axis",
            )
        item = shape[1:]
    else:
        item = shape
    configured = list(config.input.shape)
    wrong = [
        i
        for i, (declared, want) in enumerate(zip(item, configured, strict=True))
        if declared is not None and declared != want
    ]
    if wrong:
        fixed = [c if d is None else d for d, c in zip(item, configured, strict=True)]
        axes = ", ".join("CHW"[i] for i in wrong)
        raise mismatch(
            "input.shape",
            f"{tensor} expects items of shape {_shown(item)} (C, H, W), but config.yaml has "
            f"input.shape: {configured} (wrong: {axes}); set input.shape: {fixed}",
        )
    return spec
