"""The ONNX Runtime backend: one ``InferenceSession`` per model instance.

It owns session options and execution-provider choice; the model's declared
input is checked against ``config.yaml`` by
:func:`~inference.backends.inputs.check_input`::

    backend: onnxruntime
    max_batch_size: 16                  # the model's input must have a batch axis (dynamic)
    input: {shape: [3, 640, 640], name: images, dtype: float32}
    instance_group: [{count: 1, kind: KIND_AUTO}]   # KIND_CPU forces the CPU provider
    backend_options:
      intra_op_threads: 2               # 0 = ONNX Runtime's default
      inter_op_threads: 0
      execution_providers: []           # [] = CPU; [auto] = CUDA when present; or names:
                                        # cpu, cuda, tensorrt (or ONNX Runtime's full names)

A provider this machine lacks is a :class:`~inference.config.ModelConfigError`
at ``backend_options.execution_providers`` or ``instance_group``.

ONNX Runtime computes in the model file's own types: ``precision`` is ``native``,
or ``int8`` for a quantized file (QDQ ``QuantizeLinear`` to 8 bits, or
``QLinear*``/``*Integer`` operators), as ``vidpipe models list``, ``/v1/models``
and ``vidpipe_model_info`` show.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from inference.backends.base import Backend, BackendError, TensorSpec
from inference.backends.inputs import check_input
from inference.config import ModelConfig, OnnxRuntimeOptions

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


def choose_providers(
    config: ModelConfig, instance: int, available: list[str]
) -> list[str | tuple[str, dict[str, Any]]]:
    """Execution providers for one instance, best first, always ending with the CPU."""
    group, gpu = config.placement(instance)
    opts = config.backend_options_as(OnnxRuntimeOptions)
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
            raise config.error(
                "backend_options.execution_providers",
                f"execution provider {p!r} is not available in this ONNX Runtime "
                f"(available: {', '.join(available)})",
                "change backend_options.execution_providers, or use [auto] to take CUDA only when present",
            )
    if group.kind == "KIND_GPU" and not any(n in (CUDA, TENSORRT) for n in names):
        raise config.error(
            "instance_group",
            f"kind KIND_GPU needs ONNX Runtime with CUDA (available providers: {', '.join(available)})",
            "use kind: KIND_CPU or KIND_AUTO",
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


# Operators that compute on 8-bit integers (ONNX, and ONNX Runtime's com.microsoft domain).
_INT8_OPS = frozenset(
    {"QLinearConv", "QLinearMatMul", "ConvInteger", "MatMulInteger", "DynamicQuantizeLinear",
     "QLinearAdd", "QLinearMul", "QLinearAveragePool", "QLinearGlobalAveragePool", "QLinearConcat",
     "QLinearSigmoid", "QLinearLeakyRelu", "QLinearSoftmax", "DynamicQuantizeMatMul"}
)  # fmt: skip
# QuantizeLinear's output type, from its zero point (absent: uint8) or output_dtype.
_INT8_TYPES = frozenset({2, 3})  # TensorProto.UINT8, TensorProto.INT8


def _quantizes_to_8_bits(node: Any, types: Mapping[str, int]) -> bool:
    if node.op_type != "QuantizeLinear":
        return False
    for attr in node.attribute:
        if attr.name == "output_dtype" and attr.i:
            return attr.i in _INT8_TYPES
    if len(node.input) < 3 or not node.input[2]:
        return True  # no zero point: uint8
    # A zero point that is no initializer (rare) is taken for 8 bits, the common case.
    return types.get(node.input[2], 2) in _INT8_TYPES


@functools.lru_cache(maxsize=64)
def _int8_file(path: str, mtime_ns: int, size: int) -> bool:
    import onnx

    # The graph only: weights kept in external files are not read.
    model = onnx.load(path, load_external_data=False)
    types = {t.name: t.data_type for t in model.graph.initializer}
    return any(node.op_type in _INT8_OPS or _quantizes_to_8_bits(node, types) for node in model.graph.node)


def is_int8(model_path: Path) -> bool:
    """Whether the ONNX file is quantized to 8 bits: QDQ activations (``QuantizeLinear`` to
    int8/uint8) or integer operators. Weight-only ``DequantizeLinear`` computes in float."""
    try:
        st = model_path.stat()
        return _int8_file(str(model_path.resolve()), st.st_mtime_ns, st.st_size)
    except Exception:  # ONNX Runtime loaded it; a graph onnx cannot parse is reported as native
        return False


def _spec(arg: Any) -> TensorSpec:
    shape = tuple(d if isinstance(d, int) and d > 0 else None for d in (arg.shape or []))
    return TensorSpec(arg.name, shape, _DTYPES.get(arg.type, arg.type))


class OnnxRuntimeBackend(Backend):
    """One ONNX Runtime session; called from a single worker thread."""

    kind = "onnxruntime"
    options_type = OnnxRuntimeOptions

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
        opts = config.backend_options_as(OnnxRuntimeOptions)
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
        self.inputs = [_spec(i) for i in self._session.get_inputs()]
        self.outputs = [_spec(o) for o in self._session.get_outputs()]
        self.metadata = dict(self._session.get_modelmeta().custom_metadata_map)
        self.providers = list(self._session.get_providers())
        self.precision = "int8" if is_int8(self.model_path) else "native"
        self.input = check_input(config, self.model_path, self.inputs)
        self._output_names = [o.name for o in self.outputs]
        # A failed run raises with ORT's own message, which vidpipe logs at most once per
        # kind per 10 s; ORT would also print it to stderr itself, on every failed run.
        self._run_options = ort.RunOptions()
        self._run_options.log_severity_level = 4

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            results = self._session.run(self._output_names, dict(inputs), self._run_options)
        except Exception as exc:
            shapes = ", ".join(f"{k}{list(v.shape)}" for k, v in inputs.items())
            raise BackendError(
                f"{self.config.name}: {self.model_path.name} failed on {shapes}: {exc}"
            ) from exc
        return dict(zip(self._output_names, results, strict=True))

    def close(self) -> None:
        # Dropping the session frees its memory (and GPU memory) once the last run returned.
        self.__dict__.pop("_session", None)
