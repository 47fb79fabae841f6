"""The TensorRT backend: an engine built from the model's ONNX file, one execution context per instance.

::

    backend: tensorrt
    model_file: {path: model.onnx}
    max_batch_size: 16                  # engine profile: batch 1..16
    input: {shape: [3, 640, 640], name: images, dtype: float32}
    dynamic_batching: {preferred_batch_size: [8, 16]}   # profile optimum: the largest (16)
    instance_group: [{count: 1, kind: KIND_GPU, gpus: [0]}]
    backend_options:
      fp16: true                        # let TensorRT pick FP16 kernels
      cuda_graphs: true                 # capture each batch size once, then replay
      workspace_mb: 2048                # builder scratch memory limit

Building an engine takes seconds to minutes, so the serialized plan is cached
in ``$VIDPIPE_CACHE_DIR`` (default ``~/.cache/vidpipe/trt``) under a key of
sha256(model bytes), TensorRT version, GPU name and compute capability, FP16
and the optimisation profile; a restart (or a second instance) reuses it. A
plan TensorRT refuses to load is rebuilt.

Inputs may be NumPy arrays (staged through pinned memory and copied to the
device) or device arrays — CuPy, ``__cuda_array_interface__`` or CUDA
``__dlpack__`` objects — used in place. :meth:`TensorRTBackend.run` returns
NumPy arrays, which the CPU post-processing needs;
:meth:`TensorRTBackend.run_device` returns CuPy arrays that are views of the
instance's output buffers, valid until its next run, written on
:attr:`TensorRTBackend.stream` (wait on :attr:`TensorRTBackend.done` before
reading them from another stream).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from inference.backends.base import Backend, BackendError, InputLocation, TensorSpec
from inference.backends.inputs import check_input
from inference.config import ModelConfig, TensorRTOptions
from inference.device import DLPACK_CUDA_DEVICES, gpu_available

# Under "vidpipe." like the pipeline's loggers: one tree to configure, "vidpipe.inference.*" here.
log = logging.getLogger(f"vidpipe.{__name__}")

MISSING = (
    "TensorRT backend needs an NVIDIA GPU with the `tensorrt` and `cupy` packages "
    "(pip install 'vidpipe[gpu]'); use backend: onnxruntime on CPU"
)

# ONNX TensorProto element types, as NumPy dtype names.
_ONNX_DTYPES = {
    1: "float32",
    10: "float16",
    11: "float64",
    7: "int64",
    6: "int32",
    2: "uint8",
    3: "int8",
    9: "bool",
}


def plan_cache_dir() -> Path:
    """Where plans are cached: ``$VIDPIPE_CACHE_DIR`` or ``~/.cache/vidpipe/trt``."""
    configured = os.environ.get("VIDPIPE_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "vidpipe" / "trt"


def batch_profile(config: ModelConfig) -> tuple[int, int, int] | None:
    """``(min, opt, max)`` batch sizes of the optimisation profile; ``None`` without a batch axis.

    The optimum is the largest preferred batch size (what a loaded batcher
    forms most), else ``max_batch_size``.
    """
    if config.max_batch_size <= 0:
        return None
    preferred = config.dynamic_batching.preferred_batch_size
    opt = max(preferred) if preferred else config.max_batch_size
    return 1, min(opt, config.max_batch_size), config.max_batch_size


def plan_cache_key(
    model_sha256: str,
    tensorrt_version: str,
    gpu_name: str,
    fp16: bool,
    profile: tuple[int, int, int] | None,
    item_shape: tuple[int, ...],
) -> str:
    """The cache key of a plan: it changes whenever any input that shapes the engine changes."""
    fields = {
        "model_sha256": model_sha256,
        "tensorrt": tensorrt_version,
        "gpu": gpu_name,
        "fp16": bool(fp16),
        "profile": list(profile) if profile else None,
        "item_shape": list(item_shape),
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _onnx_inputs(model: Any) -> list[TensorSpec]:
    """The graph's real inputs (initializers excluded); unnamed or symbolic dims are dynamic (None)."""
    initializers = {t.name for t in model.graph.initializer}
    found = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        dims = tuple(
            int(d.dim_value) if d.HasField("dim_value") and d.dim_value > 0 else None
            for d in tensor.shape.dim
        )
        dtype = _ONNX_DTYPES.get(tensor.elem_type, f"onnx type {tensor.elem_type}")
        found.append(TensorSpec(value.name, dims, dtype))
    return found


# Engines are shared by the instances on one GPU (weights once); each instance
# has its own execution context, stream and buffers. Entry: [engine, refs, runtime].
# The lock is held through a build, so concurrent loads never build one plan twice.
_engines: dict[tuple[str, int], list[Any]] = {}
_engines_lock = threading.Lock()


class TensorRTBackend(Backend):
    """One TensorRT execution context with its own stream and preallocated buffers."""

    kind = "tensorrt"
    options_type = TensorRTOptions
    # Batch tensors stay on the instance's GPU, filled there by one fused kernel on its stream.
    input_location = InputLocation.DEVICE

    def __init__(self, config: ModelConfig, model_path: Path, instance: int = 0) -> None:
        self.config = config
        self.model_path = Path(model_path)
        self.instance = instance
        try:
            import cupy as cp
            import tensorrt as trt
        except ImportError as exc:
            raise BackendError(f"{config.name}: {MISSING} ({exc})") from exc
        ok, reason = gpu_available()
        if not ok:
            raise BackendError(f"{config.name}: {MISSING} ({reason})")
        group, gpu = config.placement(instance)
        if group.kind == "KIND_CPU":
            raise config.error(
                "instance_group",
                "kind KIND_CPU cannot run on TensorRT",
                "use kind: KIND_GPU (or KIND_AUTO), or backend: onnxruntime",
            )
        if not self.model_path.is_file():
            raise BackendError(
                f"{config.name}: model file not found: {self.model_path} (check model_file in config.yaml)"
            )
        self._cp = cp
        self._trt = trt
        self.gpu = gpu
        self._device = cp.cuda.Device(gpu)
        self._engine_key: tuple[str, int] | None = None
        self._graphs: dict[int, Any] = {}
        self._graphs_failed: set[int] = set()
        self._closed = False
        self._bound: tuple[int, int] | None = None  # (batch, input pointer) last bound
        with self._device:
            self._load(cp, trt)

    # -- loading ---------------------------------------------------------------

    def _load(self, cp: Any, trt: Any) -> None:
        config = self.config
        import onnx

        try:
            model = onnx.load(str(self.model_path), load_external_data=False)
        except Exception as exc:
            raise BackendError(
                f"{config.name}: cannot load model file {self.model_path}: {exc} "
                f"(is it a valid ONNX model? re-export or re-download it)"
            ) from exc
        # The one input check every backend runs, here before a build that can take minutes.
        self.input = check_input(config, self.model_path, _onnx_inputs(model))
        self.input_name = self.input.name
        self.metadata = {p.key: p.value for p in model.metadata_props}
        del model

        self.profile = batch_profile(config)
        props = cp.cuda.runtime.getDeviceProperties(self.gpu)
        name = props["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        cc = self._device.compute_capability
        self.gpu_name = f"{name} (sm_{cc})"
        self.cache_key = plan_cache_key(
            file_sha256(self.model_path),
            str(trt.__version__),
            self.gpu_name,
            config.backend_options_as(TensorRTOptions).fp16,
            self.profile,
            tuple(config.input.shape),
        )
        self.plan_path = plan_cache_dir() / f"{_safe(config.name)}-{self.cache_key[:32]}.plan"
        self.cache_hit = False
        self._engine = self._acquire_engine()
        self._context = self._engine.create_execution_context()
        if self._context is None:
            raise BackendError(f"{config.name}: TensorRT could not create an execution context (GPU memory?)")
        self._stream = cp.cuda.Stream(non_blocking=True)
        self.done: Any = None
        self._describe_io()
        self._allocate()

    def _acquire_engine(self) -> Any:
        key = (str(self.plan_path), self.gpu)
        with _engines_lock:
            shared = _engines.get(key)
            if shared is not None:
                shared[1] += 1
                self.cache_hit = True
                self._engine_key = key
                log.info(
                    "%s: instance %d shares the loaded engine %s", self.config.name, self.instance, key[0]
                )
                return shared[0]
            engine = self._load_or_build()
            # The runtime is kept with the engine: it must outlive the engines it deserialised.
            _engines[key] = [engine, 1, self._runtime]
            self._engine_key = key
            return engine

    def _load_or_build(self) -> Any:
        trt = self._trt
        logger = _logger(trt)
        runtime = trt.Runtime(logger)
        self._runtime = runtime
        if self.plan_path.is_file():
            engine = runtime.deserialize_cuda_engine(self.plan_path.read_bytes())
            if engine is not None:
                self.cache_hit = True
                log.info("%s: reusing cached TensorRT plan %s", self.config.name, self.plan_path)
                return engine
            log.warning(
                "%s: TensorRT cannot load the cached plan %s (corrupt or from another build); rebuilding",
                self.config.name,
                self.plan_path,
            )
        started = time.monotonic()
        log.info(
            "%s: building a TensorRT engine (fp16=%s, batch profile %s); this can take minutes",
            self.config.name,
            self.config.backend_options_as(TensorRTOptions).fp16,
            self.profile,
        )
        plan = self._build(logger)
        self.plan_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.plan_path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(plan)
        os.replace(tmp, self.plan_path)  # atomic: another process never reads half a plan
        self.plan_path.with_suffix(".json").write_text(
            json.dumps(
                {
                    "model": self.config.name,
                    "model_file": str(self.model_path),
                    "tensorrt": str(trt.__version__),
                    "gpu": self.gpu_name,
                    "fp16": self.config.backend_options_as(TensorRTOptions).fp16,
                    "profile": self.profile,
                    "item_shape": list(self.config.input.shape),
                    "key": self.cache_key,
                    "build_seconds": round(time.monotonic() - started, 1),
                },
                indent=2,
            )
        )
        log.info(
            "%s: built the TensorRT engine in %.1fs, cached as %s",
            self.config.name,
            time.monotonic() - started,
            self.plan_path,
        )
        engine = runtime.deserialize_cuda_engine(plan)
        if engine is None:
            raise BackendError(f"{self.config.name}: TensorRT could not load the engine it just built")
        return engine

    def _build(self, logger: Any) -> bytes:
        trt = self._trt
        config = self.config
        builder = trt.Builder(logger)
        # TensorRT 10 networks are always explicit-batch (the flag is gone or
        # ignored); older versions need it set.
        major = int(str(trt.__version__).split(".")[0])
        flags = 0 if major >= 10 else 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(self.model_path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise BackendError(
                f"{config.name}: TensorRT cannot parse {self.model_path.name}: {errors or 'unknown error'} "
                f"(export the model with an opset TensorRT supports, or use backend: onnxruntime)"
            )
        build = builder.create_builder_config()
        build.set_memory_pool_limit(
            trt.MemoryPoolType.WORKSPACE, config.backend_options_as(TensorRTOptions).workspace_mb << 20
        )
        if config.backend_options_as(TensorRTOptions).fp16:
            build.set_flag(trt.BuilderFlag.FP16)
        profile = builder.create_optimization_profile()
        c, h, w = config.input.shape
        for i in range(network.num_inputs):
            tensor = network.get_input(i)
            if self.profile is None:
                shape = (c, h, w)
                profile.set_shape(tensor.name, shape, shape, shape)
            else:
                low, opt, high = self.profile
                profile.set_shape(tensor.name, (low, c, h, w), (opt, c, h, w), (high, c, h, w))
        build.add_optimization_profile(profile)
        plan = builder.build_serialized_network(network, build)
        if plan is None:
            raise BackendError(
                f"{config.name}: TensorRT failed to build an engine for {self.model_path.name} "
                f"(see the TensorRT messages above; a larger backend_options.workspace_mb can help)"
            )
        return bytes(plan)

    def _describe_io(self) -> None:
        trt = self._trt
        engine = self._engine
        self.inputs: list[TensorSpec] = []
        self.outputs: list[TensorSpec] = []
        self._dtypes: dict[str, np.dtype[Any]] = {}
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            dtype = np.dtype(trt.nptype(engine.get_tensor_dtype(name)))
            shape = tuple(int(d) if int(d) >= 0 else None for d in engine.get_tensor_shape(name))
            spec = TensorSpec(name, shape, dtype.name)
            self._dtypes[name] = dtype
            if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
                self.inputs.append(spec)
            else:
                self.outputs.append(spec)
        if len(self.inputs) != 1:
            raise BackendError(f"{self.config.name}: the engine has {len(self.inputs)} inputs; expected one")

    def _item_shape(self, batch: int) -> tuple[int, ...]:
        c, h, w = self.config.input.shape
        return (c, h, w) if self.profile is None else (batch, c, h, w)

    def _allocate(self) -> None:
        """Input and output buffers for the largest batch, device and pinned host, made once."""
        from inference.gpu.memory import pinned_array

        cp = self._cp
        largest = self.profile[2] if self.profile else 1
        in_shape = self._item_shape(largest)
        in_dtype = self._dtypes[self.input_name]
        self._input = cp.empty(in_shape, dtype=in_dtype)
        self._input_host = pinned_array(in_shape, in_dtype)
        if not self._context.set_input_shape(self.input_name, in_shape):
            raise BackendError(f"{self.config.name}: the engine refuses input shape {in_shape}")
        self._out_dev: dict[str, Any] = {}
        self._out_host: dict[str, np.ndarray] = {}
        for spec in self.outputs:
            shape = tuple(int(d) for d in self._context.get_tensor_shape(spec.name))
            if any(d < 0 for d in shape):
                raise BackendError(
                    f"{self.config.name}: output {spec.name!r} has a data-dependent shape {shape}, "
                    f"which this backend does not support; use backend: onnxruntime"
                )
            self._out_dev[spec.name] = cp.empty(shape, dtype=self._dtypes[spec.name])
            self._out_host[spec.name] = pinned_array(shape, self._dtypes[spec.name])

    # -- running -----------------------------------------------------------------

    @property
    def stream(self) -> Any:
        """The instance's CUDA stream (every copy and the engine run on it)."""
        return self._stream

    def run(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Run one batch and return NumPy outputs (fresh arrays, safe to keep).

        Every output is queued as an asynchronous device→pinned-host copy on the
        instance's stream; the host then waits once for the whole batch.
        """
        outputs = self.run_device(inputs)
        try:
            with self._device:
                hosts = {}
                for name, arr in outputs.items():
                    host = self._out_host[name].reshape(-1)[: arr.size].reshape(arr.shape)
                    # blocking=False: queue the copy without a host wait per output.
                    arr.get(stream=self._stream, out=host, blocking=False)
                    hosts[name] = host
                self._stream.synchronize()  # the one wait of this batch
                # Copies, so results outlive the next batch (the pinned buffers are reused).
                return {name: host.copy() for name, host in hosts.items()}
        except Exception as exc:
            raise BackendError(
                f"{self.config.name}: copying TensorRT outputs to the host failed: {exc}"
            ) from exc

    def run_device(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Run one batch; outputs are CuPy views of this instance's buffers, written on :attr:`stream`."""
        if self._closed:
            raise BackendError(f"{self.config.name}: the TensorRT instance {self.instance} is closed")
        if set(inputs) != {self.input_name}:
            raise BackendError(
                f"{self.config.name}: expected input {self.input_name!r}, got {', '.join(inputs) or 'none'}"
            )
        value = inputs[self.input_name]
        try:
            with self._device:
                batch, pointer = self._stage_input(value)
                outputs = self._execute(batch, pointer)
                self.done = self._cp.cuda.Event(disable_timing=True)
                self.done.record(self._stream)
                return outputs
        except BackendError:
            raise
        except Exception as exc:
            shape = list(getattr(value, "shape", ()))
            raise BackendError(
                f"{self.config.name}: {self.model_path.name} failed on {self.input_name}{shape}: {exc}"
            ) from exc

    def _stage_input(self, value: Any) -> tuple[int, int]:
        """Validate the input; return (batch size, device pointer of the data to bind)."""
        cp = self._cp
        shape = tuple(int(d) for d in value.shape)
        want = self._dtypes[self.input_name]
        item = tuple(self.config.input.shape)
        batched = self.profile is not None
        if (batched and (len(shape) != 4 or shape[1:] != item)) or (not batched and shape != item):
            expected = f"(N, {', '.join(map(str, item))})" if batched else str(item)
            raise BackendError(
                f"{self.config.name}: input {self.input_name} has shape {shape}, expected {expected}"
            )
        batch = shape[0] if batched else 1
        largest = self.profile[2] if self.profile is not None else 1
        if not 1 <= batch <= largest:
            raise BackendError(
                f"{self.config.name}: batch of {batch} is outside the engine's profile 1..{largest}"
            )
        if np.dtype(value.dtype) != want:
            raise BackendError(
                f"{self.config.name}: input {self.input_name} is {np.dtype(value.dtype).name}, the engine "
                f"takes {want.name}; set input.dtype: {want.name}"
            )
        if isinstance(value, np.ndarray):
            host = self._input_host.reshape(-1)[: value.size].reshape(shape)
            np.copyto(host, value)
            target = self._input.reshape(-1)[: value.size].reshape(shape)
            target.set(host, stream=self._stream)
            return batch, int(self._input.data.ptr)
        device = self._device_input(value)
        if self.config.backend_options_as(TensorRTOptions).cuda_graphs:
            # Graphs replay fixed addresses: bring the batch into the instance's own buffer (D2D).
            target = self._input.reshape(-1)[: device.size].reshape(shape)
            with self._stream:
                cp.copyto(target, device)
            return batch, int(self._input.data.ptr)
        return batch, int(device.data.ptr)

    def _device_input(self, value: Any) -> Any:
        """A C-contiguous CuPy view of a device input, ordered after the work that produced it."""
        cp = self._cp
        wait = getattr(value, "wait", None)
        if callable(wait):
            wait(self._stream)
        if isinstance(value, cp.ndarray):
            array = value
        elif hasattr(value, "__cuda_array_interface__"):
            array = cp.asarray(value)
        elif hasattr(value, "__dlpack__") and _dlpack_device(value) in DLPACK_CUDA_DEVICES:
            array = cp.from_dlpack(value)
        else:
            raise BackendError(
                f"{self.config.name}: input {self.input_name} is a {type(value).__name__}, "
                f"neither a NumPy nor a CUDA array"
            )
        if array.device.id != self.gpu:
            raise BackendError(
                f"{self.config.name}: input is on GPU {array.device.id}, this instance runs on GPU {self.gpu}"
            )
        # The producer wrote it on the caller's current stream; order this stream after it
        # on the device rather than synchronising the host.
        ready = cp.cuda.Event(disable_timing=True)
        ready.record(cp.cuda.get_current_stream())
        self._stream.wait_event(ready)
        if not array.flags.c_contiguous:
            with self._stream:
                array = cp.ascontiguousarray(array)
        return array

    def _bind(self, batch: int, pointer: int) -> dict[str, Any]:
        context = self._context
        if self._bound is None or self._bound[0] != batch:
            if not context.set_input_shape(self.input_name, self._item_shape(batch)):
                raise BackendError(f"{self.config.name}: the engine refuses batch size {batch}")
        outputs = {}
        for spec in self.outputs:
            shape = tuple(int(d) for d in context.get_tensor_shape(spec.name))
            full = self._out_dev[spec.name]
            view = full.reshape(-1)[: int(np.prod(shape, dtype=np.int64))].reshape(shape)
            outputs[spec.name] = view
            context.set_tensor_address(spec.name, int(full.data.ptr))
        context.set_tensor_address(self.input_name, pointer)
        self._bound = (batch, pointer)
        return outputs

    def _execute(self, batch: int, pointer: int) -> dict[str, Any]:
        outputs = self._bind(batch, pointer)
        if not self.config.backend_options_as(TensorRTOptions).cuda_graphs or batch in self._graphs_failed:
            self._enqueue()
            return outputs
        graph = self._graphs.get(batch)
        if graph is None:
            graph = self._capture(batch)
            if graph is None:
                return outputs  # _capture ran the batch eagerly
        graph.launch(self._stream)
        return outputs

    def _enqueue(self) -> None:
        if not self._context.execute_async_v3(self._stream.ptr):
            raise BackendError(f"{self.config.name}: TensorRT enqueue failed (see the TensorRT log)")

    def _capture(self, batch: int) -> Any:
        """Capture this batch size's enqueue as a CUDA graph; ``None`` (after running eagerly) on failure."""
        # One eager run first: TensorRT finishes shape-dependent setup outside capture.
        self._enqueue()
        stream = self._stream
        graph = None
        # Thread-local capture: other instances' threads may keep using CUDA meanwhile.
        mode = getattr(self._cp.cuda.runtime, "streamCaptureModeThreadLocal", None)
        try:
            stream.begin_capture() if mode is None else stream.begin_capture(mode=mode)
            try:
                self._enqueue()
            finally:
                graph = stream.end_capture()
        except Exception as exc:
            self._graphs_failed.add(batch)
            log.warning(
                "%s: CUDA graph capture failed for batch %d (%s); running it without graphs",
                self.config.name,
                batch,
                exc,
            )
            stream.synchronize()
            return None
        self._graphs[batch] = graph
        log.info("%s: captured a CUDA graph for batch size %d", self.config.name, batch)
        # The eager run already produced this batch's outputs.
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            with self._device:
                self._stream.synchronize()
        except Exception:
            log.debug("%s: stream synchronise on close failed", self.config.name, exc_info=True)
        self._graphs.clear()
        self.__dict__.pop("_context", None)
        key = self._engine_key
        self.__dict__.pop("_engine", None)
        if key is not None:
            with _engines_lock:
                shared = _engines.get(key)
                if shared is not None:
                    shared[1] -= 1
                    if shared[1] <= 0:
                        del _engines[key]
        for name in ("_input", "_input_host", "_out_dev", "_out_host"):
            self.__dict__.pop(name, None)


def _dlpack_device(value: Any) -> int | None:
    try:
        return int(value.__dlpack_device__()[0])
    except Exception:
        return None


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name) or "model"


_loggers: dict[int, Any] = {}


def _logger(trt: Any) -> Any:
    # TensorRT wants one logger per process; warnings and errors go to stderr.
    logger = _loggers.get(id(trt))
    if logger is None:
        logger = trt.Logger(trt.Logger.WARNING)
        _loggers[id(trt)] = logger
    return logger
