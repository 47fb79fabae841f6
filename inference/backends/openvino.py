"""The OpenVINO backend: one compiled model per model, one infer request per instance.

OpenVINO reads ONNX files and its own IR (``model.xml`` with ``model.bin`` next
to it). The model is compiled once for the device and shared by all instances
of the model; each instance runs batches on its own ``InferRequest``, and the
compiled model gets one stream per instance so the requests run side by side::

    backend: openvino
    model_file: {path: model.xml}       # or model.onnx
    max_batch_size: 8                   # batch axis [1..8]; 0 or 1 compile a static shape
    input: {shape: [3, 640, 640]}
    instance_group: [{count: 2, kind: KIND_CPU}]   # two infer requests, two streams
    backend_options:
      device: CPU                       # CPU | GPU (Intel GPU) | AUTO
      precision: auto                   # auto = the device's choice (bf16 on CPUs with
                                        # AVX512-BF16/AMX, else f32) | f32 | bf16 | f16
      streams: 0                        # 0 = one per instance
      threads: 0                        # threads over all streams; 0 = OpenVINO's default
      cache_dir: /var/cache/vidpipe/ov  # compiled models are cached here (OpenVINO CACHE_DIR)
      preprocess: auto                  # auto = model: the compiled model takes uint8 RGB images and
                                        # swaps channels, normalises and transposes itself | cpu

The precision in use is read back from the compiled model
(``INFERENCE_PRECISION_HINT``), or is ``int8`` for a quantized model (one with
8-bit ``FakeQuantize`` ops: what ``vidpipe models quantize`` writes, or an ONNX
QDQ file), and shown by ``vidpipe models list``, ``/v1/models`` and the
``vidpipe_model_info`` metric. Problems carry the config
key to change (``key``), so the repository reports them as
``config.yaml:LINE: backend_options.precision: ...``.

With ``preprocess: auto`` or ``model`` the host only resizes (letterbox, stretch
or keep_height) into a uint8 ``N×H×W×3`` RGB batch; OpenVINO's
``PrePostProcessor`` puts ``input.color``, ``scale``, ``mean``, ``std`` and the
NHWC→NCHW transpose into the compiled graph, where they cost next to nothing.
``preprocess: cpu`` feeds float ``N×C×H×W`` tensors normalised on the host.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from inference.backends.base import Backend, BackendError, InputLocation, TensorSpec
from inference.backends.inputs import check_input
from inference.config import ModelConfig, ModelConfigError, OpenVinoOptions

SUFFIXES = (".onnx", ".xml")
# The device capability each explicit precision needs (OPTIMIZATION_CAPABILITIES).
_CAPABILITY = {"f32": "FP32", "bf16": "BF16", "f16": "FP16"}


class OpenVinoOptionError(ModelConfigError):
    """The model or ``backend_options`` cannot work on this machine; ``path`` is the config key to change."""


def _option_error(config: ModelConfig, key: str, problem: str, hint: str) -> ModelConfigError:
    """An :class:`OpenVinoOptionError` at ``key``'s line in the model's ``config.yaml``."""
    return config.error(key, problem, hint, kind=OpenVinoOptionError)


@dataclass
class _Shared:
    compiled: Any  # openvino.CompiledModel: the only one, or the largest static batch
    metadata: dict[str, str]
    input: TensorSpec  # the image input, checked against the config once, at compile
    int8: bool  # the model file holds 8-bit FakeQuantize ops (quantized, e.g. by NNCF)
    # static_batch_sizes: batch size -> the model compiled for it (sizes include 1).
    by_size: dict[int, Any] = field(default_factory=dict)
    users: int = 0


# Instances of one model (and a reload of unchanged files) share one compiled model.
_cache: dict[tuple[Any, ...], _Shared] = {}
_cache_lock = threading.RLock()
_core: Any = None


def _openvino(config: ModelConfig) -> Any:
    try:
        import openvino
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise BackendError(
            f"{config.name}: the `openvino` package is not installed (pip install openvino, "
            f"or use backend: onnxruntime)"
        ) from exc
    return openvino


def _the_core(ov: Any) -> Any:
    global _core
    with _cache_lock:  # models load on worker threads
        if _core is None:
            _core = ov.Core()
        return _core


def _dims(partial_shape: Any) -> list[int | None]:
    return [d.get_length() if d.is_static else None for d in partial_shape]


def _spec_dims(port: Any, batch: tuple[int | None, ...]) -> tuple[int | None, ...]:
    """A port's dims, the batch axis replaced by ``batch`` when given."""
    dims = _dims(port.get_partial_shape())
    return tuple([*batch, *dims[1:]]) if batch else tuple(dims)


def _dtype(port: Any) -> str:
    try:
        return str(np.dtype(port.get_element_type().to_dtype()))
    except Exception:  # a type NumPy has no name for (e.g. bf16 on an IR input)
        return str(port.get_element_type().get_type_name())


def _metadata(model: Any) -> dict[str, str]:
    """The ONNX file's metadata_props (OpenVINO keeps them under rt_info "framework", also in IR)."""
    info = model.get_rt_info()
    if "framework" not in info:
        return {}
    out = {}
    for key, value in info["framework"].items():
        out[str(key)] = value.astype(str) if hasattr(value, "astype") else str(value)
    return out


def _device(config: ModelConfig, ov_core: Any, instance: int) -> str:
    group, _ = config.placement(instance)
    device = config.backend_options_as(OpenVinoOptions).device
    if group.kind == "KIND_GPU" and device == "CPU":
        raise _option_error(
            config,
            "backend_options.device",
            "instance_group kind KIND_GPU but backend_options.device is CPU",
            "set device: GPU or AUTO, or kind: KIND_CPU",
        )
    if group.kind == "KIND_CPU" and device != "CPU":
        raise _option_error(
            config,
            "backend_options.device",
            f"instance_group kind KIND_CPU but backend_options.device is {device}",
            "set device: CPU, or kind: KIND_AUTO",
        )
    available = list(ov_core.available_devices)
    if device != "AUTO" and not any(d == device or d.startswith(device + ".") for d in available):
        raise _option_error(
            config,
            "backend_options.device",
            f"OpenVINO device {device} is not present on this machine",
            f"available: {', '.join(available) or 'none'}; set backend_options.device: CPU or AUTO",
        )
    return device


def _compile_options(config: ModelConfig, ov_core: Any, device: str) -> dict[str, str]:
    opts = config.backend_options_as(OpenVinoOptions)
    properties: dict[str, str] = {}
    if opts.precision != "auto":
        if device != "AUTO":
            caps = [str(c) for c in ov_core.get_property(device, "OPTIMIZATION_CAPABILITIES")]
            if _CAPABILITY[opts.precision] not in caps:
                raise _option_error(
                    config,
                    "backend_options.precision",
                    f"precision {opts.precision} is not supported by the {device} device",
                    f"it offers {', '.join(caps)}; set backend_options.precision: auto or f32",
                )
        properties["INFERENCE_PRECISION_HINT"] = opts.precision
    if device != "AUTO":
        # Instances run their requests concurrently: one stream each unless told otherwise.
        properties["NUM_STREAMS"] = str(opts.streams or config.instance_count)
        if opts.threads:
            properties["INFERENCE_NUM_THREADS"] = str(opts.threads)
    elif opts.streams or opts.threads:
        raise _option_error(
            config,
            "backend_options.device",
            "device AUTO picks streams and threads itself",
            "remove backend_options.streams and threads, or name the device",
        )
    if opts.cache_dir:
        properties["CACHE_DIR"] = str(Path(opts.cache_dir).expanduser())
    return properties


def _check_files(config: ModelConfig, model_path: Path) -> None:
    if not model_path.is_file():
        raise BackendError(
            f"{config.name}: model file not found: {model_path} (check model_file in config.yaml)"
        )
    if model_path.suffix.lower() not in SUFFIXES:
        raise _option_error(
            config,
            "model_file.path",
            f"OpenVINO reads ONNX (.onnx) and IR (.xml + .bin) files, not {model_path.name}",
            "export the model to ONNX or IR",
        )
    if model_path.suffix.lower() == ".xml" and not model_path.with_suffix(".bin").is_file():
        raise _option_error(
            config,
            "model_file.path",
            f"IR model {model_path.name} has no weights file "
            f"{model_path.with_suffix('.bin').name} next to it",
            "copy it there",
        )


def preprocesses_in_model(config: ModelConfig) -> bool:
    """Whether the compiled model normalises the images (``backend_options.preprocess`` auto or model)."""
    return config.backend_options_as(OpenVinoOptions).preprocess in ("auto", "model")


def with_preprocessing(ov: Any, model: Any, name: str, config: ModelConfig) -> Any:
    """``model`` with input ``name`` taking uint8 RGB images (NHWC; HWC without a batch axis).

    The steps are :class:`~inference.processing.resize.ImagePreprocessor`'s
    ``out[c] = (x[src[c]] * scale - mean[c]) / std[c]``, with ``mean`` and ``std``
    in the model's channel order: so they run after the colour swap, in pixel
    units (``mean / scale`` subtracted, divided by ``std / scale``).
    """
    from openvino.preprocess import ColorFormat, PrePostProcessor

    inp = config.input
    batched = config.max_batch_size > 0
    ppp = PrePostProcessor(model)
    port = ppp.input(name)
    tensor = port.tensor()
    tensor.set_element_type(ov.Type.u8)
    tensor.set_layout(ov.Layout("NHWC" if batched else "HWC"))
    tensor.set_color_format(ColorFormat.RGB)
    port.model().set_layout(ov.Layout("NCHW" if batched else "CHW"))
    steps = port.preprocess()
    if inp.color == "bgr":
        steps.convert_color(ColorFormat.BGR)
    # Normalise in f32 and round once to the model's type, as the host path does for float16.
    steps.convert_element_type(ov.Type.f32)
    mean = [m / inp.scale for m in inp.mean]
    std = [s / inp.scale for s in inp.std]
    if any(mean):
        steps.mean(mean)
    if any(s != 1.0 for s in std):
        steps.scale(std)
    element = model.input(name).get_element_type()
    if element != ov.Type.f32:
        steps.convert_element_type(element)
    return ppp.build()


def _load(config: ModelConfig, model_path: Path, ov: Any, device: str) -> _Shared:
    ov_core = _the_core(ov)
    properties = _compile_options(config, ov_core, device)
    try:
        model = ov_core.read_model(str(model_path))
    except Exception as exc:
        raise _option_error(
            config, "model_file.path", f"OpenVINO cannot read {model_path}: {_read_failure(model_path, exc)}",
            "re-export the model",
        ) from exc  # fmt: skip
    inputs = [
        TensorSpec(p.get_any_name(), tuple(_dims(p.get_partial_shape())), _dtype(p)) for p in model.inputs
    ]
    port = check_input(config, model_path, inputs)
    # The config's item shape is fixed; only the batch axis may vary, and only up to
    # max_batch_size, so the device compiles for the shapes the batcher sends.
    c, h, w = config.input.shape
    # Checked whatever max_batch_size says, so a list that cannot apply is not ignored silently.
    sizes = (
        static_batch_sizes(config) if config.backend_options_as(OpenVinoOptions).static_batch_sizes else []
    )
    if config.max_batch_size > 1 and sizes:
        by_size = {
            # Preprocessing rewrites the model's input, so each shape starts from a clean copy.
            size: _compile(
                config, ov, ov_core, model.clone(), model_path, port, ov.PartialShape([size, c, h, w]),
                device, properties,
            )
            for size in sizes
        }  # fmt: skip
        return _Shared(by_size[max(by_size)], _metadata(model), port, is_int8(model), by_size)
    if config.max_batch_size > 1:
        shape = ov.PartialShape([ov.Dimension(1, config.max_batch_size), c, h, w])
    elif config.max_batch_size == 1:
        shape = ov.PartialShape([1, c, h, w])  # static: OpenVINO's fastest kernels
    else:
        shape = ov.PartialShape([c, h, w])
    int8 = is_int8(model)  # before compiling: preprocessing adds ops of its own
    compiled = _compile(config, ov, ov_core, model, model_path, port, shape, device, properties)
    return _Shared(compiled, _metadata(model), port, int8)


def static_batch_sizes(config: ModelConfig) -> list[int]:
    """``backend_options.static_batch_sizes``, checked: it holds 1 and nothing over max_batch_size."""
    sizes = sorted(set(config.backend_options_as(OpenVinoOptions).static_batch_sizes))
    key = "backend_options.static_batch_sizes"
    if sizes[0] < 1:
        raise _option_error(
            config, key, f"static_batch_sizes {sizes} holds {sizes[0]}", "list positive sizes"
        )
    if sizes[0] != 1:
        raise _option_error(
            config,
            key,
            f"static_batch_sizes {sizes} has no 1",
            "add 1: a batch of any size runs as pieces of them",
        )
    if sizes[-1] > config.max_batch_size:
        raise _option_error(
            config,
            key,
            f"static_batch_sizes {sizes} exceeds max_batch_size {config.max_batch_size}",
            "list sizes up to max_batch_size",
        )
    return sizes


def split_batch(n: int, sizes: list[int]) -> list[int]:
    """``n`` as a sum of ``sizes`` (which hold 1), largest pieces first: 7 over [1, 4] is [4, 1, 1, 1]."""
    pieces = []
    for size in sorted(sizes, reverse=True):
        while n >= size:
            pieces.append(size)
            n -= size
    return pieces


def _most_pieces(size: int, sizes: list[int], config: ModelConfig) -> int:
    """How many pieces of ``size`` a batch of 1..max_batch_size splits into, at most."""
    return max(1, *(split_batch(n, sizes).count(size) for n in range(1, config.max_batch_size + 1)))


def _compile(
    config: ModelConfig, ov: Any, ov_core: Any, model: Any, model_path: Path, port: TensorSpec, shape: Any,
    device: str, properties: dict[str, str],
) -> Any:  # fmt: skip
    """``model`` compiled with ``port`` reshaped to ``shape`` (and normalising images, if so set)."""
    try:
        model.reshape({port.name: shape})
        if preprocesses_in_model(config):
            model = with_preprocessing(ov, model, port.name, config)
        return ov_core.compile_model(model, device, properties)
    except Exception as exc:
        raise BackendError(
            f"{config.name}: OpenVINO cannot compile {model_path.name} for {device} with input {shape}: {exc}"
        ) from exc


def _key(config: ModelConfig, model_path: Path, device: str) -> tuple[Any, ...]:
    # A changed file (or a changed config) compiles afresh; a reload of the same files shares.
    ir = model_path.suffix.lower() == ".xml"
    files = [model_path, model_path.with_suffix(".bin")] if ir else [model_path]
    stamps = tuple((os.fspath(f.resolve()), f.stat().st_mtime_ns, f.stat().st_size) for f in files)
    return (stamps, device, repr(config))


def _shapes(inputs: Mapping[str, np.ndarray]) -> str:
    """``x[4, 320, 320, 3]``: the inputs as an error message names them."""
    return ", ".join(f"{k}{list(v.shape)}" for k, v in inputs.items())


def is_int8(model: Any) -> bool:
    """Whether ``model`` (an ``openvino.Model``) is quantized to 8 bits.

    NNCF's post-training quantization (``vidpipe models quantize``) writes
    ``FakeQuantize`` ops with 256 levels (255 for symmetric weights), and OpenVINO
    reads an ONNX QDQ model's ``QuantizeLinear``/``DequantizeLinear`` pairs as the
    same op; the device then runs the layers between them on 8-bit integers,
    whatever ``INFERENCE_PRECISION_HINT`` says for the rest.
    """
    for op in model.get_ops():
        if op.get_type_name() == "FakeQuantize" and int(op.get_attributes().get("levels", 0)) in (255, 256):
            return True
    return False


def precision_of(compiled: Any) -> str:
    """The precision a compiled model computes in (``bf16``, ``f32``, ...), as the device reports it."""
    try:
        return str(compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name())
    except Exception:  # AUTO before it has picked a device, or a device without the property
        return "unknown"


class OpenVinoBackend(Backend):
    """One infer request of the model's shared compiled model; called from a single worker thread."""

    kind = "openvino"
    options_type = OpenVinoOptions

    def __init__(self, config: ModelConfig, model_path: Path, instance: int = 0) -> None:
        ov = _openvino(config)
        self.config = config
        self.model_path = Path(model_path)
        self.instance = instance
        _check_files(config, self.model_path)
        self.device = _device(config, _the_core(ov), instance)
        self._key = _key(config, self.model_path, self.device)
        with _cache_lock:
            shared = _cache.get(self._key)
            if shared is None:
                shared = _cache[self._key] = _load(config, self.model_path, ov, self.device)
            shared.users += 1
        self._shared: _Shared | None = shared
        compiled = shared.compiled
        # static_batch_sizes: per size, as many requests as a batch can have pieces
        # of that size, so the pieces of one batch run side by side on the model's streams.
        self._sizes = sorted(shared.by_size, reverse=True)
        self._requests: dict[int, list[Any]] = {}
        for size in self._sizes:
            count = _most_pieces(size, self._sizes, config)
            self._requests[size] = [shared.by_size[size].create_infer_request() for _ in range(count)]
        # One request on the single compiled shape; static pieces use _requests instead.
        self._request: Any = None if self._sizes else compiled.create_infer_request()
        # Static pieces still take any batch of 1..max_batch_size: say so (batch axis None).
        batch: tuple[int | None, ...] = (None,) if self._sizes else ()
        self.inputs = [TensorSpec(p.get_any_name(), _spec_dims(p, batch), _dtype(p)) for p in compiled.inputs]
        self.outputs = [
            TensorSpec(p.get_any_name(), _spec_dims(p, batch), _dtype(p)) for p in compiled.outputs
        ]
        self.metadata = dict(shared.metadata)
        self.input = shared.input
        # A quantized model computes its quantized layers in int8: the hint (f32 or bf16)
        # covers only the layers left in float, so it would hide the change that matters.
        self.precision = "int8" if shared.int8 else precision_of(compiled)
        if preprocesses_in_model(config):  # the compiled model normalises uint8 images
            self.input_location = InputLocation.HOST_UINT8
        self._output_names = [o.name for o in self.outputs]
        self._ov = ov
        # Static pieces write into these (one row per batch item) and read the inputs in
        # place; _bound remembers what each request points at.
        self._bound: dict[tuple[int, str | int], tuple[tuple[int, tuple[int, ...], str], np.ndarray]] = {}
        self._outputs: dict[str, np.ndarray] = {}
        # An output whose size depends on the data cannot be written into a fixed buffer:
        # such pieces are gathered after they run.
        if self._sizes and all(p.get_partial_shape().is_static for p in shared.by_size[1].outputs):
            one = self._requests[1][0]
            for i, spec in enumerate(self.outputs):
                item = one.get_output_tensor(i).data
                self._outputs[spec.name] = np.empty((config.max_batch_size, *item.shape[1:]), item.dtype)

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not self._sizes:
            return self._infer(self._request, inputs)
        outputs = self._run_pieces(inputs)
        return {name: out.copy() for name, out in outputs.items()} if self._outputs else outputs

    def run_borrowed(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not self._sizes:
            return self._infer(self._request, inputs)
        return self._run_pieces(inputs)

    def _run_pieces(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A batch on the static shapes: views of this instance's output buffers (or gathered copies)."""
        n = len(next(iter(inputs.values())))
        if not 0 < n <= self.config.max_batch_size:
            raise BackendError(
                f"{self.config.name}: a batch of {n} ({_shapes(inputs)}) is outside 1..max_batch_size "
                f"({self.config.max_batch_size})"
            )
        running: list[Any] = []
        try:
            # Start every piece, then collect them: they run at once on the model's streams,
            # so a partial batch takes about as long as its largest piece.
            start, used = 0, dict.fromkeys(self._sizes, 0)
            for size in split_batch(n, self._sizes):
                request = self._requests[size][used[size]]
                used[size] += 1
                end = start + size
                for name, array in inputs.items():
                    self._bind(request, name, np.ascontiguousarray(array[start:end]))
                for i, out in enumerate(self._outputs.values()):  # in the model's output order
                    self._bind(request, i, out[start:end])
                request.start_async()
                running.append(request)
                start = end
            for request in running:
                request.wait()
        except Exception as exc:
            # Let the pieces already started finish: the next batch needs their requests free.
            for request in running:
                with contextlib.suppress(Exception):
                    request.wait()
            raise self._failed(inputs, exc) from exc
        if not self._outputs:
            # np.concatenate copies, so these outlive the requests' next runs.
            return {
                name: np.concatenate([r.get_output_tensor(i).data for r in running])
                for i, name in enumerate(self._output_names)
            }
        return {name: out[:n] for name, out in self._outputs.items()}

    def _bind(self, request: Any, port: str | int, array: np.ndarray) -> None:
        """Point ``request``'s input ``port`` (a name) or output ``port`` (an index) at ``array``'s memory.

        OpenVINO then reads the pooled batch and writes the outputs in place: no
        copies, and none of the Python-side input conversion a call with arrays
        pays per request. The instance's buffers stay put, so binding happens once.
        """
        where = (array.ctypes.data, array.shape, array.dtype.str)
        slot = (id(request), port)
        held = self._bound.get(slot)
        if held is not None and held[0] == where:
            return
        tensor = self._ov.Tensor(array, shared_memory=True)
        if isinstance(port, int):
            request.set_output_tensor(port, tensor)
        else:
            request.set_tensor(port, tensor)
        # Keeping the array keeps the memory the request points at alive.
        self._bound[slot] = (where, array)

    def _infer(self, request: Any, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            # share_inputs: the pooled batch tensor is read in place; outputs are copies, so the
            # results outlive the request's next run.
            results = request.infer(dict(inputs), share_inputs=True)
        except Exception as exc:
            raise self._failed(inputs, exc) from exc
        return {name: results[i] for i, name in enumerate(self._output_names)}

    def _failed(self, inputs: Mapping[str, np.ndarray], exc: Exception) -> BackendError:
        return BackendError(f"{self.config.name}: {self.model_path.name} failed on {_shapes(inputs)}: {exc}")

    def close(self) -> None:
        shared, self._shared = self._shared, None
        if shared is None:
            return
        self.__dict__.pop("_request", None)
        self._requests, self._sizes = {}, []
        self._bound, self._outputs = {}, {}
        with _cache_lock:
            shared.users -= 1
            if shared.users == 0 and _cache.get(self._key) is shared:
                del _cache[self._key]


def _read_failure(model_path: Path, exc: Exception) -> str:
    """Why OpenVINO could not read a model, in one line: its own message is a C++ trace of
    several lines (one per source file it passed through)."""
    if model_path.suffix.lower() == ".onnx":
        from inference.introspect import ModelIntrospectionError, read_onnx

        try:
            read_onnx(model_path)
        except ModelIntrospectionError:
            return "it is not an ONNX model"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    useful = [line for line in lines if not line.startswith("Exception from ")]
    return (useful or lines or [type(exc).__name__])[0]
