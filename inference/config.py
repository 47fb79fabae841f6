"""Model configuration: one ``models/<name>/config.yaml`` per model.

The batching fields follow Triton's model configuration so that a Triton
user's intuition carries over::

    name: ppocr_cls
    backend: onnxruntime            # onnxruntime | openvino | tensorrt | triton (remote: no model_file)
    model_file: {package: rapidocr_onnxruntime, path: models/ch_ppocr_mobile_v2.0_cls_infer.onnx}
    max_batch_size: 32              # 0 = the model has no batch dimension
    input: {shape: [3, 48, 192], mean: [0.5, 0.5, 0.5], std: [0.5, 0.5, 0.5]}  # shape: default: the model's
    task: {kind: classify}
    labels: ["0", "180"]
    dynamic_batching:
      preferred_batch_size: [16, 32]
      max_queue_delay_microseconds: 2000
      default_queue_policy: {max_queue_size: 256, timeout_action: REJECT}
    instance_group: [{count: 1, kind: KIND_CPU}]
    backend_options: {intra_op_threads: 2}

``task:`` and ``backend_options:`` are per kind: ``task.kind`` selects one of
the task options classes (:data:`TASK_OPTIONS`) and ``backend:`` one of the
backend options classes (:data:`BACKEND_OPTIONS`), so a key of another kind
(``workspace_mb`` on an OpenVINO model) is an error at its line that names the
kind it belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from inference.kinds import Kinds
from inference.schema import ConfigError, ConfigOrigin, spec

TaskKind = Literal["yolo", "classify", "text_detect", "text_recognize"]


@dataclass(frozen=True)
class ModelFile:
    """Where the model file is: a path (relative to the model's folder) or a file in a package."""

    path: str = field(metadata=spec(help="a path relative to the model folder, or inside `package`"))
    package: str | None = field(
        default=None, metadata=spec(help="an installed Python package that ships the file")
    )


@dataclass(frozen=True)
class InputConfig:
    """How an image becomes the model's input tensor (per item, without the batch dim)."""

    # Empty until filled at load from the model file, when the config leaves it out.
    shape: list[int] = field(
        default_factory=list,
        metadata=spec(
            min_len=3,
            help="[channels, height, width] of one item, e.g. [3, 640, 640]; default: the model's",
        ),
    )
    name: str | None = field(default=None, metadata=spec(help="input tensor name; default: the first"))
    color: Literal["rgb", "bgr"] = "rgb"
    scale: float = field(default=1.0 / 255.0, metadata=spec(gt=0))
    mean: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    std: list[float] = field(default_factory=lambda: [1.0, 1.0, 1.0])
    resize: Literal["letterbox", "stretch", "keep_height"] = field(
        default="letterbox",
        metadata=spec(
            help="letterbox keeps aspect and pads; stretch fills; keep_height scales to the height "
            "and pads the width (text recognisers)"
        ),
    )
    pad_value: int = field(default=114, metadata=spec(ge=0, le=255))
    dtype: Literal["float32", "float16"] = "float32"

    def __post_init__(self) -> None:
        if not self.shape:
            if len(self.mean) != 3 or len(self.std) != 3:
                raise ValueError("input.mean and input.std need one value per channel (3)")
            return
        if len(self.shape) != 3 or any(d <= 0 for d in self.shape):
            raise ValueError("input.shape must be three positive integers [C, H, W]")
        if self.shape[0] != 3:
            # Every task kind feeds H×W×3 RGB images; this is the only channel check.
            raise ValueError(f"input.shape {list(self.shape)}: images have 3 channels, so C must be 3")
        if len(self.mean) != self.shape[0] or len(self.std) != self.shape[0]:
            raise ValueError("input.mean and input.std need one value per channel")


@dataclass(frozen=True)
class TaskConfig:
    """``task:``: the pre/post-processing kind; each kind derives its own options from this.

    ``TaskConfig(kind="yolo")`` in code stands for that kind's defaults
    (:class:`ModelConfig` turns it into :class:`YoloOptions`).
    """

    kind: str = field(metadata=spec(help="yolo, classify, text_detect or text_recognize"))


@dataclass(frozen=True)
class YoloOptions(TaskConfig):
    """``task: {kind: yolo}``: YOLOv5/v8/v11 box decoding and NMS."""

    kind: str = "yolo"
    layout: Literal["auto", "yolov8", "yolov5"] = "auto"
    confidence: float = field(default=0.25, metadata=spec(ge=0, le=1))
    iou: float = field(default=0.45, metadata=spec(ge=0, le=1))
    max_detections: int = field(default=300, metadata=spec(ge=1))


@dataclass(frozen=True)
class ClassifyOptions(TaskConfig):
    """``task: {kind: classify}``: softmax where needed, the top classes."""

    kind: str = "classify"
    top_k: int = field(default=1, metadata=spec(ge=1))


@dataclass(frozen=True)
class TextDetectOptions(TaskConfig):
    """``task: {kind: text_detect}``: DB text detection (PP-OCR det)."""

    kind: str = "text_detect"
    thresh: float = field(default=0.3, metadata=spec(ge=0, le=1))
    box_thresh: float = field(default=0.5, metadata=spec(ge=0, le=1))
    unclip_ratio: float = field(default=1.6, metadata=spec(gt=0))
    max_candidates: int = field(default=1000, metadata=spec(ge=1))
    min_box_size: float = field(default=3.0, metadata=spec(ge=0))


@dataclass(frozen=True)
class TextRecognizeOptions(TaskConfig):
    """``task: {kind: text_recognize}``: CTC decoding (PP-OCR rec)."""

    kind: str = "text_recognize"
    dictionary_key: str = field(
        default="character", metadata=spec(help="model metadata key that holds the dictionary")
    )


# task.kind -> its options. The classes that run them register with the same names
# (inference.processing.tasks).
TASK_OPTIONS: Kinds[type[TaskConfig]] = Kinds("task kind")
TASK_OPTIONS.register("yolo", YoloOptions)
TASK_OPTIONS.register("classify", ClassifyOptions)
TASK_OPTIONS.register("text_detect", TextDetectOptions)
TASK_OPTIONS.register("text_recognize", TextRecognizeOptions)


@dataclass(frozen=True)
class QueuePolicy:
    """Triton's ``ModelQueuePolicy``."""

    max_queue_size: int = field(default=0, metadata=spec(ge=0, help="0 = unbounded"))
    timeout_action: Literal["REJECT", "DELAY"] = "REJECT"
    default_timeout_microseconds: int = field(default=0, metadata=spec(ge=0, help="0 = no timeout"))
    allow_timeout_override: bool = False


@dataclass(frozen=True)
class DynamicBatching:
    """Triton's ``ModelDynamicBatching``."""

    preferred_batch_size: list[int] = field(default_factory=list)
    max_queue_delay_microseconds: int = field(default=0, metadata=spec(ge=0))
    preserve_ordering: bool = False
    priority_levels: int = field(default=0, metadata=spec(ge=0))
    default_priority_level: int = field(default=0, metadata=spec(ge=0))
    default_queue_policy: QueuePolicy = field(default_factory=QueuePolicy)
    priority_queue_policy: dict[str, QueuePolicy] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if any(b <= 0 for b in self.preferred_batch_size):
            raise ValueError("dynamic_batching.preferred_batch_size values must be positive")
        if self.priority_levels and not 1 <= self.default_priority_level <= self.priority_levels:
            raise ValueError("dynamic_batching.default_priority_level must be in 1..priority_levels")
        levels = max(1, self.priority_levels)
        for key in self.priority_queue_policy:
            if not (key.isdigit() and 1 <= int(key) <= levels):
                raise ValueError(
                    f"dynamic_batching.priority_queue_policy key {key!r} is not a priority level "
                    f"in 1..{levels} (set priority_levels to cover it)"
                )


@dataclass(frozen=True)
class InstanceGroup:
    """Triton's ``ModelInstanceGroup``: ``count`` instances of ``kind``."""

    count: int = field(default=1, metadata=spec(ge=1, le=64))
    kind: Literal["KIND_CPU", "KIND_GPU", "KIND_AUTO"] = "KIND_AUTO"
    gpus: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class BackendOptions:
    """``backend_options:``; each backend derives its own (an empty one stands for its defaults)."""


@dataclass(frozen=True)
class OnnxRuntimeOptions(BackendOptions):
    """``backend: onnxruntime`` (inference/backends/onnxruntime.py)."""

    intra_op_threads: int = field(default=0, metadata=spec(ge=0, help="0 = the runtime's default"))
    inter_op_threads: int = field(default=0, metadata=spec(ge=0))
    execution_providers: list[str] = field(
        default_factory=list, metadata=spec(help="ONNX Runtime providers; default: best available")
    )
    # For the TensorRT execution provider, as for backend tensorrt.
    fp16: bool = False
    workspace_mb: int = field(default=1024, metadata=spec(ge=16))


@dataclass(frozen=True)
class OpenVinoOptions(BackendOptions):
    """``backend: openvino`` (inference/backends/openvino.py)."""

    device: Literal["CPU", "GPU", "AUTO"] = field(
        default="CPU", metadata=spec(help="OpenVINO device: CPU, GPU (Intel) or AUTO")
    )
    precision: Literal["auto", "f32", "bf16", "f16"] = field(
        default="auto", metadata=spec(help="OpenVINO inference precision; auto = the device's own choice")
    )
    preprocess: Literal["auto", "model", "cpu"] = field(
        default="auto",
        metadata=spec(
            help="where images are normalised: model (or auto) = inside the compiled model, fed uint8 "
            "NHWC; cpu = on the host, fed float NCHW"
        ),
    )
    streams: int = field(default=0, metadata=spec(ge=0, help="OpenVINO streams; 0 = one per instance"))
    threads: int = field(default=0, metadata=spec(ge=0, help="OpenVINO threads in all; 0 = its default"))
    cache_dir: str | None = field(
        default=None, metadata=spec(help="folder for OpenVINO's compiled-model cache (CACHE_DIR)")
    )
    static_batch_sizes: list[int] = field(
        default_factory=list,
        metadata=spec(
            help="OpenVINO: compile these static batch sizes (with 1) instead of a [1..max_batch_size] "
            "axis; a batch runs as pieces of them, side by side"
        ),
    )


@dataclass(frozen=True)
class TensorRTOptions(BackendOptions):
    """``backend: tensorrt`` (inference/backends/tensorrt.py)."""

    fp16: bool = False
    cuda_graphs: bool = False
    workspace_mb: int = field(default=1024, metadata=spec(ge=16))


@dataclass(frozen=True)
class TritonOptions(BackendOptions):
    """``backend: triton``: KServe v2 over gRPC (inference/backends/triton.py)."""

    url: str | None = field(default=None, metadata=spec(help="grpc://HOST:PORT of the inference server"))
    model_name: str | None = field(default=None, metadata=spec(help="the model's name on the server"))
    timeout_ms: int = field(
        default=5000, metadata=spec(ge=1, help="a batch that takes longer on the server fails its requests")
    )


# backend -> its options. The classes that run them register with the same names
# (inference.backends).
BACKEND_OPTIONS: Kinds[type[BackendOptions]] = Kinds("backend")
BACKEND_OPTIONS.register("onnxruntime", OnnxRuntimeOptions)
BACKEND_OPTIONS.register("openvino", OpenVinoOptions)
BACKEND_OPTIONS.register("tensorrt", TensorRTOptions)
BACKEND_OPTIONS.register("triton", TritonOptions)

Opts = TypeVar("Opts")


class ModelConfigError(ConfigError):
    """A model's config.yaml disagrees with what it names (files, the model, this machine).

    Raised after the file parsed, by loading; ``path`` is the key to change and
    ``line`` its line when the config came from a file.
    """

    def __init__(
        self, model: str, file: str, line: int | None, path: str, problem: str, hint: str = ""
    ) -> None:
        self.model = model
        super().__init__(file, line, path, problem, hint)

    @property
    def key(self) -> str:
        return self.path


@dataclass(frozen=True)
class ModelConfig:
    """One model in the repository."""

    name: str
    task: TaskConfig = field(metadata=spec(kinds=TASK_OPTIONS))
    # Every input key has a default, shape included (read from the model), so input: may be left out.
    input: InputConfig = field(default_factory=InputConfig)
    # None only for a remote backend (triton), whose model lives on the server.
    model_file: ModelFile | None = None
    backend: str = field(
        default="onnxruntime",
        metadata=spec(check=BACKEND_OPTIONS.check, help="onnxruntime, openvino, tensorrt or triton"),
    )
    max_batch_size: int = field(default=8, metadata=spec(ge=0, le=4096))
    labels: list[str] = field(default_factory=list)
    labels_file: str | None = None
    version: int | None = field(default=None, metadata=spec(ge=1))
    dynamic_batching: DynamicBatching = field(default_factory=DynamicBatching)
    instance_group: list[InstanceGroup] = field(default_factory=lambda: [InstanceGroup()])
    backend_options: BackendOptions = field(
        default_factory=BackendOptions, metadata=spec(kinds=BACKEND_OPTIONS, kind_key="backend")
    )
    # Set by the repository to the file it read, so later checks can point at lines.
    origin: ConfigOrigin | None = field(default=None, compare=False, repr=False, metadata={"yaml": False})

    def __post_init__(self) -> None:
        # Built in code, an empty BackendOptions or a bare TaskConfig stands for the kind's defaults.
        object.__setattr__(
            self, "backend_options", _of_kind(BACKEND_OPTIONS, self.backend, self.backend_options)
        )
        object.__setattr__(self, "task", _of_kind(TASK_OPTIONS, self.task.kind, self.task))
        if self.labels and self.labels_file:
            raise ValueError("set labels or labels_file, not both")
        if self.model_file is None and self.backend != "triton":
            raise ValueError(f"model_file is required for backend {self.backend}")
        if self.max_batch_size:
            too_big = [b for b in self.dynamic_batching.preferred_batch_size if b > self.max_batch_size]
            if too_big:
                raise ValueError(
                    f"dynamic_batching.preferred_batch_size {too_big} exceeds max_batch_size "
                    f"{self.max_batch_size}"
                )

    def backend_options_as(self, cls: type[Opts]) -> Opts:
        """``backend_options`` as ``cls``, the options of this config's backend (a backend's own view)."""
        return _narrow(self.backend_options, cls, f"backend {self.backend}")

    def task_as(self, cls: type[Opts]) -> Opts:
        """``task`` as ``cls``, the options of this config's task kind (a task's own view)."""
        return _narrow(self.task, cls, f"task kind {self.task.kind}")

    @property
    def instance_count(self) -> int:
        return sum(g.count for g in self.instance_group)

    def placement(self, instance: int) -> tuple[InstanceGroup, int]:
        """The group that instance number ``instance`` (0-based) belongs to, and its GPU id.

        Instances are numbered across groups in order; a group's instances take
        its ``gpus`` in turn (GPU 0 when none are listed).
        """
        start = 0
        for group in self.instance_group:
            if 0 <= instance < start + group.count:
                gpus = group.gpus or [0]
                return group, gpus[(instance - start) % len(gpus)]
            start += group.count
        raise IndexError(f"{self.name}: instance {instance} does not exist; instance_group has {start}")

    def error(
        self, key: str, problem: str, hint: str = "", *, kind: type[ModelConfigError] = ModelConfigError
    ) -> ModelConfigError:
        """A :class:`ModelConfigError` (or subclass ``kind``) at ``key``'s line in this config's file."""
        if self.origin is None:
            return kind(self.name, f"model {self.name!r}", None, key, problem, hint)
        return kind(self.name, self.origin.file, self.origin.line(key), key, problem, hint)


def _of_kind(kinds: Kinds[type[Any]], kind: str, options: Any) -> Any:
    """``options`` checked against ``kind``'s class; the base class itself becomes its defaults."""
    cls = kinds.get(kind)
    if cls is None:
        raise ValueError(kinds.check(kind)[0])  # type: ignore[index]
    if isinstance(options, cls):
        return options
    if type(options) in (BackendOptions, TaskConfig):
        return cls()
    raise ValueError(f"{kinds.what} {kind} takes {cls.__name__}, not {type(options).__name__}")


def _narrow(options: Any, cls: type[Opts], what: str) -> Opts:
    if not isinstance(options, cls):
        raise TypeError(f"{what} has {type(options).__name__}, not {cls.__name__}")
    return options
