"""One servable model: its config, files, instances and batcher.

A :class:`Model` is built from one ``models/<name>/config.yaml``::

    name: ppocr_cls
    backend: onnxruntime
    model_file: {package: rapidocr_onnxruntime, path: models/ch_ppocr_mobile_v2.0_cls_infer.onnx}
    # or a file next to config.yaml (or in the version folder): model_file: {path: model.onnx}
    max_batch_size: 32
    input: {shape: [3, 48, 192]}
    task: {kind: classify}
    labels: ["0", "180"]                # or labels_file: labels.txt (one per line)
    instance_group: [{count: 2}]

Loading resolves the model file and labels, creates one backend, one task and
one :class:`~inference.memory.BufferPool` of batch tensors per instance, and
starts a :class:`~inference.batcher.DynamicBatcher`. Each batch is::

    metas = task.preprocess(images, pooled_tensor)
    outputs = backend.run_borrowed({input_name: pooled_tensor[:n]})
    results = task.postprocess(outputs, metas)

so a model in steady state allocates no batch tensors. For ``max_batch_size: 0``
(no batch axis) the backend gets ``pooled_tensor[0]`` and the task still sees
outputs with a leading batch axis of 1.

Each backend says where it reads its batch (:attr:`Backend.input_location`), and
:data:`INPUT_PLANS` maps that to the pool and the preprocessor the task is built
with: float ``N×C×H×W`` normalised on the host (ONNX Runtime, Triton); uint8
``N×H×W×3`` RGB images, a quarter of the size, only resized, for a model that
normalises itself (OpenVINO's ``backend_options.preprocess: auto``); or tensors on
the instance's GPU filled by one fused kernel (TensorRT).

A load that fails leaves the model ``UNAVAILABLE`` with the reason instead of
raising; :meth:`Model.infer` then refuses with reason ``unavailable``.
"""

from __future__ import annotations

import concurrent.futures
import enum
import importlib
import importlib.machinery
import importlib.util
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from inference.backends import create_backend
from inference.backends.base import Backend, InputLocation, TensorSpec
from inference.batch_policy import BatchPolicy
from inference.batcher import (
    UNAVAILABLE,
    BatcherStats,
    DynamicBatcher,
    InferenceObserver,
    InferenceRejected,
    NullObserver,
)
from inference.config import ModelConfig
from inference.introspect import fill_input_shape
from inference.memory import BufferPool
from inference.processing.base import Preprocessor, Task
from inference.processing.resize import ImagePreprocessor, ImageResizer, check_image
from inference.processing.tasks import create_task
from inference.results import Result

# Under "vidpipe." like the pipeline's loggers: one tree to configure, "vidpipe.inference.*" here.
log = logging.getLogger(f"vidpipe.{__name__}")


class TaskFactory(Protocol):
    """Builds a model's task (:func:`~inference.processing.tasks.create_task`, or a Task class)."""

    def __call__(
        self,
        config: ModelConfig,
        input_spec: TensorSpec,
        metadata: Mapping[str, str],
        labels: Sequence[str],
        *,
        preprocessor: Preprocessor | None = None,
    ) -> Task: ...


BackendFactory = Callable[[ModelConfig, Path, int], Backend]


class ModelState(enum.Enum):
    """Where a model is in its life."""

    LOADING = "loading"
    READY = "ready"
    UNAVAILABLE = "unavailable"
    UNLOADED = "unloaded"


class ModelUnavailable(InferenceRejected):
    """The model is not ready to serve (reason ``unavailable``)."""

    def __init__(self, model: str, state: ModelState, why: str = "") -> None:
        self.state = state
        super().__init__(model, UNAVAILABLE, f"the model is {state.value}" + (f": {why}" if why else ""))


def package_dirs(name: str) -> list[Path] | None:
    """The folders of an installed package (or a module's folder), found without importing it.

    ``importlib.util.find_spec("a.b")`` imports ``a`` to find ``b``, which runs
    ``a/__init__.py``: a model config naming a package must not execute its code.
    Each dotted part is looked up in its parent's folders instead. None: not found.
    """
    parts = name.split(".")
    if not all(part.isidentifier() for part in parts):
        return None
    spec: importlib.machinery.ModuleSpec | None
    try:
        # A top-level name: find_spec consults the import hooks but runs nothing.
        spec = importlib.util.find_spec(parts[0])
        for part in parts[1:]:
            if spec is None or not spec.submodule_search_locations:
                return None
            spec = importlib.machinery.PathFinder.find_spec(part, list(spec.submodule_search_locations))
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return [Path(p) for p in spec.submodule_search_locations]
    if spec.origin and spec.has_location:
        return [Path(spec.origin).parent]
    return []


def resolve_model_file(config: ModelConfig, model_dir: Path, version_dir: Path | None = None) -> Path:
    """The model file's absolute path; relative paths are taken from the version folder or model folder.

    A remote model (no ``model_file``) gets its folder: the server holds the model.
    """
    mf = config.model_file
    if mf is None:
        return version_dir or model_dir
    if mf.package:
        roots = package_dirs(mf.package)
        if roots is None:
            raise config.error(
                "model_file.package",
                f"package {mf.package!r} is not installed",
                # The sample PP-OCR models' wheel is the case a fresh install meets: it is in
                # the samples group, not a dependency (its own would pull the GUI OpenCV).
                "install it; the sample models' package comes with `make install`, or"
                " `pip install --no-deps --group samples` in the source tree;"
                " or point model_file.path at a local file",
            )
        for root in roots:
            candidate = root / mf.path
            if candidate.is_file():
                return candidate
        where = roots[0] if roots else mf.package
        raise config.error(
            "model_file.path", f"package {mf.package!r} has no file {mf.path!r} (looked in {where})"
        )
    path = Path(mf.path)
    if not path.is_absolute():
        path = (version_dir or model_dir) / path
    if not path.is_file():
        raise config.error(
            "model_file.path",
            f"model file not found: {path}",
            f"relative paths start at {version_dir or model_dir}",
        )
    return path


def load_labels(config: ModelConfig, model_dir: Path) -> list[str]:
    """Class labels from ``labels`` or ``labels_file`` (one per line, relative to the model folder)."""
    if not config.labels_file:
        return list(config.labels)
    path = Path(config.labels_file)
    if not path.is_absolute():
        path = model_dir / path
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise config.error("labels_file", f"cannot read {path}: {exc.strerror or exc}") from exc
    # Blank lines inside the file keep their class id; trailing ones are just the file's end.
    while lines and not lines[-1].strip():
        lines.pop()
    return [line.strip() for line in lines]


def batch_shape(config: ModelConfig) -> tuple[int, int, int, int]:
    """Shape of each host-normalised batch tensor: ``(max(1, max_batch_size), C, H, W)``."""
    c, h, w = config.input.shape
    return (max(1, config.max_batch_size), c, h, w)


def image_batch_shape(config: ModelConfig) -> tuple[int, int, int, int]:
    """Shape of each uint8 image batch a model that normalises itself takes: ``(N, H, W, 3)``."""
    _, h, w = config.input.shape
    return (max(1, config.max_batch_size), h, w, 3)


@dataclass(frozen=True, slots=True)
class InputPlan:
    """What fills the batches of a backend reading from one :class:`InputLocation`."""

    # Where images are normalised, as `models list` and /v1/models show it.
    site: str
    # (config, pool name, the instance's GPU id) -> one pool of batch tensors.
    pool: Callable[[ModelConfig, str, int], BufferPool]
    # (config, backend, the instance's GPU id) -> what writes images into a batch tensor.
    preprocessor: Callable[[ModelConfig, Backend, int], Preprocessor]


def _device_pool(config: ModelConfig, name: str, gpu: int) -> BufferPool:
    from inference.gpu import device_batch_pool  # imports CuPy: only a GPU model gets here

    return device_batch_pool(config, name=name, device=gpu)


def _device_preprocessor(config: ModelConfig, backend: Backend, gpu: int) -> Preprocessor:
    from inference.gpu import gpu_preprocessor

    # On the backend's stream, so the engine's run waits for the kernel without a host sync.
    preprocessor: Preprocessor = gpu_preprocessor(config, stream=backend.stream, device=gpu)
    return preprocessor


# Where a backend reads its batch -> the pool and preprocessor its instances get.
INPUT_PLANS: dict[InputLocation, InputPlan] = {
    InputLocation.HOST_FLOAT: InputPlan(
        "cpu",
        lambda config, name, _gpu: BufferPool(batch_shape(config), config.input.dtype, count=1, name=name),
        lambda config, _backend, _gpu: ImagePreprocessor(config.input),
    ),
    # The compiled model swaps channels, normalises and transposes: the host only
    # resizes into uint8 images, a quarter of a float tensor.
    InputLocation.HOST_UINT8: InputPlan(
        "model",
        lambda config, name, _gpu: BufferPool(image_batch_shape(config), "uint8", count=1, name=name),
        lambda config, _backend, _gpu: ImageResizer(config.input),
    ),
    # Batch tensors stay on the instance's GPU, filled there by one fused kernel on the
    # instance's stream; the engine reads them in place.
    InputLocation.DEVICE: InputPlan("gpu", _device_pool, _device_preprocessor),
}


def preprocess_site(backend: Backend) -> str:
    """Where a model's images are normalised: ``cpu``, ``model`` (inside the compiled model) or ``gpu``."""
    return INPUT_PLANS[backend.input_location].site


@dataclass(slots=True)
class ModelInstance:
    """One instance: its backend, task and pool of batch tensors."""

    index: int
    backend: Backend
    task: Task
    pool: BufferPool
    input_name: str


class Model:
    """A model's instances behind one dynamic batcher."""

    def __init__(
        self,
        config: ModelConfig,
        model_dir: Path,
        *,
        version: int | None = None,
        version_dir: Path | None = None,
        backend_factory: BackendFactory = create_backend,
        task_factory: TaskFactory = create_task,
        observer: InferenceObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        describe_error: Callable[[BaseException], str] | None = None,
        buffer_timeout: float = 30.0,
    ) -> None:
        self.config = config
        self.name = config.name
        self.model_dir = Path(model_dir)
        self.version = version
        self.version_dir = version_dir
        self.model_path: Path | None = None
        self.labels: list[str] = []
        self.state = ModelState.UNLOADED
        self.reason = "not loaded"
        self.error: BaseException | None = None
        self.instances: list[ModelInstance] = []
        self.observer: InferenceObserver = observer or NullObserver()
        self._backend_factory = backend_factory
        self._task_factory = task_factory
        self._clock = clock
        self._describe_error = describe_error or str
        self._buffer_timeout = buffer_timeout
        self._batcher: DynamicBatcher | None = None
        # A replacement built by a reload stays quiet until it is swapped in, so
        # observers never see the served model flip to loading or unavailable.
        self.report_states = True

    # -- state -------------------------------------------------------------

    def _set_state(self, state: ModelState, reason: str = "") -> None:
        self.state = state
        self.reason = reason
        if not self.report_states:
            return
        try:
            self.observer.on_state(self.name, state.value, reason)
        except Exception:
            log.exception("%s: observer.on_state failed", self.name)

    @property
    def ready(self) -> bool:
        return self.state is ModelState.READY

    @property
    def batcher(self) -> DynamicBatcher:
        if self._batcher is None:
            raise ModelUnavailable(self.name, self.state, self.reason)
        return self._batcher

    @property
    def stats(self) -> BatcherStats:
        return self._batcher.stats if self._batcher else BatcherStats()

    @property
    def inputs(self) -> list[TensorSpec]:
        return list(self.instances[0].backend.inputs) if self.instances else []

    @property
    def outputs(self) -> list[TensorSpec]:
        return list(self.instances[0].backend.outputs) if self.instances else []

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self.instances[0].backend.metadata) if self.instances else {}

    @property
    def precision(self) -> str:
        """The precision the backend computes in (``bf16``, ``f32``, ``native``); "" until loaded."""
        return self.instances[0].backend.precision if self.instances else ""

    @property
    def preprocess(self) -> str:
        """Where images are normalised (see :func:`preprocess_site`); "" until loaded."""
        return preprocess_site(self.instances[0].backend) if self.instances else ""

    @property
    def batch_shape(self) -> tuple[int, int, int, int]:
        """Shape of each host-normalised batch tensor: ``(max(1, max_batch_size), C, H, W)``."""
        return batch_shape(self.config)

    @property
    def image_batch_shape(self) -> tuple[int, int, int, int]:
        """Shape of each uint8 image batch a model that normalises itself takes: ``(N, H, W, 3)``."""
        return image_batch_shape(self.config)

    def load(self) -> ModelState:
        """Create the instances and start serving; blocking (a session can take seconds to build).

        Never raises for a bad model: the state becomes ``UNAVAILABLE`` with the reason.
        """
        if self.state in (ModelState.READY, ModelState.LOADING):
            return self.state
        self._set_state(ModelState.LOADING)
        config = self.config
        instances: list[ModelInstance] = []
        try:
            self.model_path = resolve_model_file(config, self.model_dir, self.version_dir)
            # A config may leave input.shape to the model; backends, tasks and pools need it.
            config = self.config = fill_input_shape(config, self.model_path)
            self.labels = load_labels(config, self.model_dir)
            policy = BatchPolicy.from_config(config)
            for index in range(config.instance_count):
                backend = self._backend_factory(config, self.model_path, index)
                try:
                    plan = INPUT_PLANS[backend.input_location]
                    _, gpu = config.placement(index)
                    preprocessor = plan.preprocessor(config, backend, gpu)
                    # The backend checked its input against the config while loading.
                    task = self._task_factory(
                        config, backend.input, backend.metadata, self.labels, preprocessor=preprocessor
                    )
                    task.check_outputs(backend.outputs)
                    pool = plan.pool(config, f"{self.name}/instance-{index}", gpu)
                except BaseException:
                    backend.close()
                    raise
                instances.append(ModelInstance(index, backend, task, pool, backend.input.name))
            runners = [partial(self._execute, inst) for inst in instances]
            batcher = DynamicBatcher(self.name, policy, runners, observer=self.observer, clock=self._clock)
            batcher.start()
        except Exception as exc:
            for inst in instances:
                inst.backend.close()
            self.error = exc
            reason = self._describe_error(exc)
            if self.report_states:  # a reload's candidate: the repository says what became of it
                log.warning("%s: unavailable: %s", self.name, reason, extra={"model": self.name})
            self._set_state(ModelState.UNAVAILABLE, reason)
            return self.state
        self.instances = instances
        self._batcher = batcher
        self.error = None
        self._set_state(ModelState.READY)
        for inst in instances:  # a remote server's health decides the state from now on
            inst.backend.watch_health(self._remote_health)
        return self.state

    def _remote_health(self, problem: str | None) -> None:
        if self._batcher is not None and self.state in (ModelState.READY, ModelState.UNAVAILABLE):
            self._set_state(ModelState.UNAVAILABLE if problem else ModelState.READY, problem or "")

    def stop(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop serving and release the instances.

        With ``drain`` (the default) queued and running requests are still
        answered; without it, queued ones fail with reason ``shutdown``.
        """
        batcher = self._batcher
        if batcher is not None:
            # Kept reachable while draining so late callers get a precise "shutdown" refusal.
            batcher.stop(drain=drain, timeout=timeout)
        self._batcher = None
        for inst in self.instances:
            try:
                inst.backend.close()
            except Exception:
                log.exception("%s: closing instance %d failed", self.name, inst.index)
        self.instances = []
        self._set_state(ModelState.UNLOADED, "unloaded")

    # -- inference ---------------------------------------------------------

    async def infer(
        self, image: np.ndarray, *, priority: int | None = None, timeout_us: int | None = None
    ) -> Result:
        """Run one H×W×3 uint8 RGB image through the model (batched with others)."""
        batcher = self._batcher
        if batcher is None or self.state is not ModelState.READY:
            raise self._unavailable()
        # Refused at the caller, before it reaches (and fails) a batch.
        check_image(image, model=self.name)
        result: Result = await batcher.infer(image, priority=priority, timeout_us=timeout_us)
        return result

    def submit(
        self, image: np.ndarray, *, priority: int | None = None, timeout_us: int | None = None
    ) -> concurrent.futures.Future[Result]:
        """Thread-safe, non-async :meth:`infer`; returns a future of the result."""
        batcher = self._batcher
        if batcher is None or self.state is not ModelState.READY:
            raise self._unavailable()
        # Refused at the caller, before it reaches (and fails) a batch.
        check_image(image, model=self.name)
        return batcher.submit(image, priority=priority, timeout_us=timeout_us)

    def _unavailable(self) -> ModelUnavailable:
        """The refusal of a request while the model does not serve, counted where its
        served requests are (``vidpipe_inference_requests_total{status="unavailable"}``)."""
        self.observer.counters(self.name).refused(UNAVAILABLE)
        return ModelUnavailable(self.name, self.state, self.reason)

    def _execute(self, inst: ModelInstance, images: list[Any]) -> Sequence[Result | Exception]:
        """One batch on one instance (runs on that instance's worker thread).

        An image the task could make no result of has an exception in its place: the
        batcher fails that request alone.
        """
        n = len(images)
        with inst.pool.acquire(timeout=self._buffer_timeout) as buf:
            tensor = buf.array
            metas = inst.task.preprocess(images, tensor)
            # Borrowed: the task turns the outputs into results before this instance's next batch.
            if self.config.max_batch_size:
                outputs = inst.backend.run_borrowed({inst.input_name: tensor[:n]})
            else:
                raw = inst.backend.run_borrowed({inst.input_name: tensor[0]})
                outputs = {k: v[np.newaxis] for k, v in raw.items()}
            return inst.task.postprocess(outputs, metas)

    def __repr__(self) -> str:
        return f"Model({self.name!r}, version={self.version}, state={self.state.value})"
