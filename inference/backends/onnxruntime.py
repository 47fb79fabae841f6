"""The ONNX Runtime backend: one ``InferenceSession`` per model instance.

It owns session options, execution-provider choice and the load-time check that
the model's declared input matches the model's ``config.yaml``::

    backend: onnxruntime
    max_batch_size: 16                  # the model's input must have a batch axis (dynamic)
    input: {shape: [3, 640, 640], name: images, dtype: float32}
    instance_group: [{count: 1, kind: KIND_AUTO}]   # KIND_CPU forces the CPU provider
    backend_options:
      intra_op_threads: 2               # 0 = ONNX Runtime's default
      inter_op_threads: 0
      execution_providers: []           # [] = CPU; [auto] = CUDA when present; or names:
                                        # cpu, cuda, tensorrt (or ONNX Runtime's full names)

A mismatch between the model and the config is a :class:`InputMismatchError`
naming the model file, the tensor, what the model declares, what the config
says and which key to change.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from inference.backends.base import Backend, BackendError, TensorSpec
from inference.config import InstanceGroup, ModelConfig

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TENSORRT = "TensorrtExecutionProvider"
_ALIASES = {"cpu": CPU, "cuda": CUDA, "tensorrt": TENSORRT, "trt": TENSORRT}

_DTYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(int16)": "int16",
    "tensor(int8)": "int8",
    "tensor(uint8)": "uint8",
    "tensor(bool)": "bool",
    "tensor(string)": "str",
}


class InputMismatchError(BackendError):
    """The model's input does not fit the config; ``key`` is the config key to change."""

    def __init__(self, message: str, key: str) -> None:
        self.key = key
        super().__init__(message)


def instance_group_of(config: ModelConfig, instance: int) -> tuple[InstanceGroup, int]:
    """The group that instance number ``instance`` belongs to, and its GPU id.

    Instances are numbered across groups in order; a group's instances take its
    ``gpus`` in turn (GPU 0 when none are listed).
    """
    start = 0
    for group in config.instance_group:
        if instance < start + group.count:
            gpus = group.gpus or [0]
            return group, gpus[(instance - start) % len(gpus)]
        start += group.count
    raise BackendError(
        f"{config.name}: instance {instance} does not exist; instance_group has {config.instance_count}"
    )


def choose_providers(
    config: ModelConfig, instance: int, available: list[str]
) -> list[str | tuple[str, dict[str, Any]]]:
    """Execution providers for one instance, best first, always ending with the CPU."""
    group, gpu = instance_group_of(config, instance)
    opts = config.backend_options
    if group.kind == "KIND_CPU":
        return [CPU]
    asked = [_ALIASES.get(p.lower(), p) for p in opts.execution_providers]
    if not asked and group.kind == "KIND_GPU":
        asked = ["auto"]
    names: list[str] = []
    for p in asked:
        if p == "auto":
            # TensorRT is left out of "auto": its engine build on first use takes minutes.
            names.extend(n for n in (CUDA,) if n in available)
        elif p in available:
            names.append(p)
        else:
            raise BackendError(
                f"{config.name}: execution provider {p!r} is not available in this ONNX Runtime "
                f"(available: {', '.join(available)}); change backend_options.execution_providers "
                f"(or use [auto] to take CUDA only when present)"
            )
    if group.kind == "KIND_GPU" and not any(n in (CUDA, TENSORRT) for n in names):
        raise BackendError(
            f"{config.name}: instance_group kind KIND_GPU needs ONNX Runtime with CUDA "
            f"(available providers: {', '.join(available)}); use kind: KIND_CPU or KIND_AUTO"
        )
    chosen: list[str | tuple[str, dict[str, Any]]] = []
    for n in dict.fromkeys(names):
        if n == CUDA:
            chosen.append((CUDA, {"device_id": gpu}))
        elif n == TENSORRT:
            chosen.append(
                (
                    TENSORRT,
                    {
                        "device_id": gpu,
                        "trt_fp16_enable": opts.fp16,
                        "trt_max_workspace_size": opts.workspace_mb << 20,
                    },
                )
            )
        elif n != CPU:
            chosen.append(n)
    chosen.append(CPU)
    return chosen


def _spec(arg: Any) -> TensorSpec:
    shape = tuple(d if isinstance(d, int) and d > 0 else None for d in (arg.shape or []))
    return TensorSpec(arg.name, shape, _DTYPES.get(arg.type, arg.type))


def _shown(shape: Any) -> str:
    return "[" + ", ".join(str(d) if isinstance(d, int) and d > 0 else "dynamic" for d in shape) + "]"


def check_input(config: ModelConfig, model_path: Path, inputs: list[Any]) -> Any:
    """Return the ONNX Runtime input the config feeds, or raise :class:`InputMismatchError`."""
    where = f"{config.name}: {model_path.name}"
    names = [i.name for i in inputs]
    if not inputs:
        raise InputMismatchError(f"{where}: the model declares no inputs", "model_file")
    wanted = config.input.name
    if wanted is not None:
        matches = [i for i in inputs if i.name == wanted]
        if not matches:
            raise InputMismatchError(
                f"{where}: the model has no input tensor {wanted!r} (it has: {', '.join(names)}); "
                f"set input.name to one of those",
                "input.name",
            )
        arg = matches[0]
    else:
        arg = inputs[0]
    if len(inputs) > 1:
        raise InputMismatchError(
            f"{where}: the model needs {len(inputs)} inputs ({', '.join(names)}) but is fed only "
            f"the image tensor {arg.name!r}; export it with a single image input",
            "model_file",
        )
    tensor = f"{where}: input tensor {arg.name!r}"
    dtype = _DTYPES.get(arg.type, arg.type)
    if dtype not in ("float32", "float16"):
        raise InputMismatchError(
            f"{tensor} is {dtype}, but images are fed as float tensors; export the model with a "
            f"float32 or float16 input",
            "input.dtype",
        )
    if dtype != config.input.dtype:
        raise InputMismatchError(
            f"{tensor} is {dtype}, config.yaml says input.dtype: {config.input.dtype}; "
            f"set input.dtype: {dtype}",
            "input.dtype",
        )
    shape = list(arg.shape or [])
    batched = config.max_batch_size > 0
    if batched and len(shape) == 3:
        raise InputMismatchError(
            f"{tensor} has no batch axis (shape {_shown(shape)}), but max_batch_size is "
            f"{config.max_batch_size}; set max_batch_size: 0",
            "max_batch_size",
        )
    if not batched and len(shape) == 4:
        raise InputMismatchError(
            f"{tensor} has a batch axis (shape {_shown(shape)}), but max_batch_size is 0; "
            f"set max_batch_size to 1 or more",
            "max_batch_size",
        )
    if len(shape) not in (3, 4):
        raise InputMismatchError(
            f"{tensor} has shape {_shown(shape)}; an image input must be [batch, C, H, W] or [C, H, W]",
            "model_file",
        )
    if batched:
        batch_dim = shape[0]
        if isinstance(batch_dim, int) and batch_dim > 0 and not (batch_dim == 1 == config.max_batch_size):
            fix = "set max_batch_size: 1 or " if batch_dim == 1 else ""
            raise InputMismatchError(
                f"{tensor} has a fixed batch size of {batch_dim}, but max_batch_size is "
                f"{config.max_batch_size} and batches vary in size; {fix}export the model with a "
                f"dynamic batch axis",
                "max_batch_size",
            )
        item = shape[1:]
    else:
        item = shape
    configured = list(config.input.shape)
    wrong = [
        i
        for i, (declared, want) in enumerate(zip(item, configured, strict=True))
        if isinstance(declared, int) and declared > 0 and declared != want
    ]
    if wrong:
        fixed = [d if isinstance(d, int) and d > 0 else c for d, c in zip(item, configured, strict=True)]
        axes = ", ".join("CHW"[i] for i in wrong)
        raise InputMismatchError(
            f"{tensor} expects items of shape {_shown(item)} (C, H, W), but config.yaml has "
            f"input.shape: {configured} (wrong: {axes}); set input.shape: {fixed}",
            "input.shape",
        )
    return arg


class OnnxRuntimeBackend(Backend):
    """One ONNX Runtime session; called from a single worker thread."""

    def __init__(self, config: ModelConfig, model_path: Path, instance: int = 0) -> None:
        try:
            import onnxruntime as ort
        except ImportError as exc:  # pragma: no cover - a dependency of the package
            raise BackendError(f"{config.name}: the `onnxruntime` package is not installed") from exc
        self.config = config
        self.model_path = Path(model_path)
        self.instance = instance
        if not self.model_path.is_file():
            raise BackendError(
                f"{config.name}: model file not found: {self.model_path} (check model_file in config.yaml)"
            )
        opts = config.backend_options
        so = ort.SessionOptions()
        so.intra_op_num_threads = opts.intra_op_threads
        so.inter_op_num_threads = opts.inter_op_threads
        so.log_severity_level = 3  # errors only; ORT's warnings are about graph optimisations
        providers = choose_providers(config, instance, ort.get_available_providers())
        try:
            self._session = ort.InferenceSession(str(self.model_path), sess_options=so, providers=providers)
        except Exception as exc:
            raise BackendError(
                f"{config.name}: cannot load model file {self.model_path}: {exc} "
                f"(is it a valid ONNX model? re-export or re-download it)"
            ) from exc
        ort_inputs = self._session.get_inputs()
        self.inputs = [_spec(i) for i in ort_inputs]
        self.outputs = [_spec(o) for o in self._session.get_outputs()]
        self.metadata = dict(self._session.get_modelmeta().custom_metadata_map)
        self.providers = list(self._session.get_providers())
        self.input_name: str = check_input(config, self.model_path, ort_inputs).name
        self._output_names = [o.name for o in self.outputs]

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            results = self._session.run(self._output_names, dict(inputs))
        except Exception as exc:
            shapes = ", ".join(f"{k}{list(v.shape)}" for k, v in inputs.items())
            raise BackendError(
                f"{self.config.name}: {self.model_path.name} failed on {shapes}: {exc}"
            ) from exc
        return dict(zip(self._output_names, results, strict=True))

    def close(self) -> None:
        # Dropping the session frees its memory (and GPU memory) once the last run returned.
        self.__dict__.pop("_session", None)
