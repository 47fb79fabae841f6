"""What an ONNX model file says about itself, and the ``config.yaml`` that follows from it.

``vidpipe models add MODEL.onnx`` writes a model's config from the file alone:

* its declared input (name, dtype, ``[N, 3, H, W]``) and outputs;
* the metadata Ultralytics writes into every export (``metadata_props``)::

      task: detect                 # detect | classify (segment, pose, obb: not served)
      imgsz: [640, 640]            # used when the input's H and W are dynamic
      names: {0: person, 1: bicycle, ...}
      batch: 1
      stride: 32

* the YOLO layout guessed from the output: ``[N, 4+C, A]`` is YOLOv8/11,
  ``[N, A, 5+C]`` is YOLOv5 (see :mod:`inference.processing.yolo`).

A fixed batch axis of 1 becomes ``max_batch_size: 1`` (batches of one image);
a dynamic one ``max_batch_size: 8``; a model without a batch axis ``0``.

The backend is the fastest CPU runtime installed (:func:`default_backend`):
OpenVINO where it is, else ONNX Runtime.

The same reading fills ``input.shape`` at load when a config leaves it out
(:func:`fill_input_shape`). Nothing here imports a runtime: the file is read
with the ``onnx`` package alone.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from inference.backends.base import TensorSpec
from inference.config import ModelConfig, TaskKind
from inference.errors import VidpipeError
from inference.processing.yolo import resolve_layout

__all__ = [
    "ModelDescription",
    "ModelIntrospectionError",
    "config_text",
    "default_backend",
    "describe_model",
    "fill_input_shape",
    "metadata_labels",
    "read_onnx",
]

DEFAULT_MAX_BATCH = 8
# Ultralytics tasks vidpipe serves, and the task kind each becomes.
TASKS: dict[str, TaskKind] = {"detect": "yolo", "classify": "classify"}
# Metadata values are Python literals; a names dict of a few thousand classes is far below this.
MAX_LITERAL = 1 << 20

Layout = Literal["yolov8", "yolov5"]


class ModelIntrospectionError(VidpipeError, ValueError):
    """The model file cannot be read or does not say enough for a config; the message says what to do."""


@dataclass(frozen=True, slots=True)
class ModelDescription:
    """What a model file declares and what vidpipe makes of it."""

    path: Path
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    metadata: dict[str, str]
    task: str  # the Ultralytics task, or "" when the file does not say
    kind: TaskKind
    layout: Layout | None  # yolo only
    labels: list[str]
    input_shape: list[int]  # [C, H, W]
    max_batch_size: int
    notes: tuple[str, ...] = ()  # what the config could not take from the file

    @property
    def input(self) -> TensorSpec:
        return self.inputs[0]


_ONNX_DTYPES = {
    1: "float32", 10: "float16", 11: "float64", 7: "int64", 6: "int32", 2: "uint8", 3: "int8", 9: "bool"
}  # fmt: skip


def _specs(values: Any, skip: frozenset[str] = frozenset()) -> tuple[TensorSpec, ...]:
    specs = []
    for v in values:
        if v.name in skip:
            continue  # an initializer listed as an input is a weight, not something to feed
        t = v.type.tensor_type
        # A named or missing dimension (``batch``, ``anchors``) is dynamic.
        dims = tuple(d.dim_value if d.dim_value > 0 else None for d in t.shape.dim)
        specs.append(TensorSpec(v.name, dims, _ONNX_DTYPES.get(t.elem_type, f"onnx:{t.elem_type}")))
    return tuple(specs)


# A model file of 0 bytes: a copy or download that was cut short, far more often than anything else.
EMPTY_FILE = "the file is empty (0 bytes), likely a copy cut short"
EMPTY_FILE_HINT = "copy the model file again"


def read_onnx(path: Path) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...], dict[str, str]]:
    """The inputs, outputs and ``metadata_props`` an ONNX file declares (weights are not loaded)."""
    import onnx

    path = Path(path)
    if not path.is_file():
        raise ModelIntrospectionError(f"{path}: no such file")
    if path.stat().st_size == 0:
        # ONNX reads 0 bytes as a model with nothing in it; what it is, is a copy cut short.
        raise ModelIntrospectionError(f"{path}: {EMPTY_FILE}; {EMPTY_FILE_HINT}")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise ModelIntrospectionError(
            f"{path}: not a readable ONNX model ({type(exc).__name__}: {exc}); re-export it"
        ) from None
    graph = model.graph
    weights = {i.name for i in graph.initializer}
    meta = {p.key: p.value for p in model.metadata_props}
    return _specs(graph.input, frozenset(weights)), _specs(graph.output), meta


def _literal(metadata: Mapping[str, str], key: str) -> Any:
    raw = metadata.get(key)
    if raw is None or len(raw) > MAX_LITERAL:
        return None
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return raw


def metadata_labels(metadata: Mapping[str, str]) -> list[str]:
    """Class names from an Ultralytics export's ``names`` (``{0: 'person', ...}`` or a list)."""
    names = _literal(metadata, "names")
    if isinstance(names, dict) and names and all(isinstance(k, int) and k >= 0 for k in names):
        return [str(names.get(i, i)) for i in range(max(names) + 1)]
    if isinstance(names, list | tuple):
        return [str(v) for v in names]
    return []


def _imgsz(metadata: Mapping[str, str]) -> tuple[int, int] | None:
    value = _literal(metadata, "imgsz")
    if isinstance(value, int) and value > 0:
        return value, value
    if isinstance(value, list | tuple) and len(value) == 2:
        h, w = value
        if isinstance(h, int) and isinstance(w, int) and h > 0 and w > 0:
            return h, w
    return None


def _item_shape(spec: TensorSpec, metadata: Mapping[str, str], where: str) -> list[int]:
    """``[C, H, W]`` of one image from the declared input, dynamic H and W from ``imgsz``."""
    shape = list(spec.shape)
    if len(shape) not in (3, 4):
        raise ModelIntrospectionError(
            f"{where}: input {spec.name!r} has shape {_shown(shape)}; an image input is [N, 3, H, W]"
        )
    c, h, w = shape[-3:]
    if c not in (3, None):
        raise ModelIntrospectionError(
            f"{where}: input {spec.name!r} has {c} channels; vidpipe feeds RGB images (3 channels)"
        )
    if h is None or w is None:
        size = _imgsz(metadata)
        if size is None:
            raise ModelIntrospectionError(
                f"{where}: input {spec.name!r} has dynamic height and width {_shown(shape)} and no "
                "imgsz metadata; re-export with a fixed image size, or set input.shape: [3, H, W]"
            )
        h, w = h or size[0], w or size[1]
    return [3, h, w]


def _shown(shape: Sequence[int | None]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _max_batch(spec: TensorSpec, where: str) -> int:
    if len(spec.shape) == 3:
        return 0
    batch = spec.shape[0]
    if batch is None:
        return DEFAULT_MAX_BATCH
    if batch == 1:
        return 1
    raise ModelIntrospectionError(
        f"{where}: input {spec.name!r} has a fixed batch of {batch}; batches vary in size, so "
        "re-export it with a dynamic batch axis (ultralytics: dynamic=True) or with batch=1"
    )


def _yolo_layout(shape: Sequence[int | None], classes: int | None, where: str) -> Layout:
    """The layout of a YOLO output ``[N, D1, D2]``; a dynamic dimension is the anchors."""
    if len(shape) != 3:
        raise ModelIntrospectionError(f"{where}: output {_shown(shape)} is not a YOLO output [N, D1, D2]")
    _, d1, d2 = shape
    # YOLOv8 needs 4 box channels and a class, YOLOv5 one more for objectness.
    v8_fits, v5_fits = d1 is None or d1 >= 5, d2 is None or d2 >= 6
    if v8_fits != v5_fits:
        return "yolov8" if v8_fits else "yolov5"
    if d1 is not None and d2 is not None:
        try:
            # The class count is checked below, in the words of an export (values per box).
            return resolve_layout((1, d1, d2), "auto", classes, check_classes=False)
        except ValueError as exc:
            raise ModelIntrospectionError(f"{where}: {exc}") from None
    if d1 is None and d2 is None:
        raise ModelIntrospectionError(
            f"{where}: output {_shown(shape)} has no fixed size to tell the layout by; "
            "set task.layout to yolov8 or yolov5"
        )
    if classes:
        if d1 == 4 + classes:
            return "yolov8"
        if d2 == 5 + classes:
            return "yolov5"
    # The fixed dimension holds the box channels; the dynamic one counts anchors.
    return "yolov8" if d1 is not None else "yolov5"


def describe_model(path: Path) -> ModelDescription:
    """Read ``path`` and decide its task, layout, labels, input shape and batch size."""
    path = Path(path)
    where = path.name
    inputs, outputs, metadata = read_onnx(path)
    if not inputs:
        raise ModelIntrospectionError(f"{where}: the model declares no inputs")
    if len(inputs) > 1:
        raise ModelIntrospectionError(
            f"{where}: the model needs {len(inputs)} inputs ({', '.join(i.name for i in inputs)}); "
            "vidpipe feeds one image tensor, so export it with a single image input"
        )
    if not outputs:
        raise ModelIntrospectionError(f"{where}: the model declares no outputs")
    spec = inputs[0]
    if spec.dtype not in ("float32", "float16"):
        raise ModelIntrospectionError(
            f"{where}: input {spec.name!r} is {spec.dtype}; images are fed as float32 or float16"
        )
    input_shape = _item_shape(spec, metadata, where)
    max_batch = _max_batch(spec, where)
    labels = metadata_labels(metadata)
    task = str(metadata.get("task", ""))
    out = outputs[0]
    if task:
        if task not in TASKS:
            raise ModelIntrospectionError(
                f"{where}: an ultralytics {task!r} export; vidpipe serves {' and '.join(TASKS)} models, "
                "so export the detect or classify variant"
            )
        kind = TASKS[task]
    elif len(out.shape) == 3:
        kind = "yolo"
    elif len(out.shape) == 2:
        kind = "classify"
    else:
        raise ModelIntrospectionError(
            f"{where}: cannot tell what the model does from its output {out.name}{_shown(out.shape)} "
            "and it has no task metadata; write config.yaml by hand (docs/models.md)"
        )
    notes: list[str] = []
    layout: Layout | None = None
    if kind == "yolo":
        layout = _yolo_layout(out.shape, len(labels) or None, where)
        if labels:
            channels = out.shape[1] if layout == "yolov8" else out.shape[2]
            expected = len(labels) + (4 if layout == "yolov8" else 5)
            if channels is not None and channels != expected:
                raise ModelIntrospectionError(
                    f"{where}: output {out.name}{_shown(out.shape)} holds {channels} values per box, "
                    f"but {len(labels)} names need {expected} in the {layout} layout; "
                    "is this a detect export?"
                )
    elif len(out.shape) != 2:
        raise ModelIntrospectionError(
            f"{where}: a classifier's output is [N, classes], this one is {out.name}{_shown(out.shape)}"
        )
    if not labels:
        notes.append("the model names no classes: labels are class numbers; add labels: to config.yaml")
    return ModelDescription(
        path=path,
        inputs=inputs,
        outputs=outputs,
        metadata=metadata,
        task=task,
        kind=kind,
        layout=layout,
        labels=labels,
        input_shape=input_shape,
        max_batch_size=max_batch,
        notes=tuple(notes),
    )


def _flow(value: Any) -> str:
    """``value`` as inline YAML (a scalar quoted only when it must be, a list in brackets)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=100, allow_unicode=True).strip()
    return text.removesuffix("...").rstrip()  # a bare scalar is dumped as a document with an end marker


CPU_BACKENDS = ("openvino", "onnxruntime")  # fastest first


def default_backend() -> str:
    """The fastest CPU runtime installed: OpenVINO (about twice ONNX Runtime on CPUs), else ONNX Runtime."""
    import importlib.util

    for backend in CPU_BACKENDS:
        if importlib.util.find_spec(backend) is not None:
            return backend
    return CPU_BACKENDS[-1]


def config_text(
    desc: ModelDescription,
    name: str,
    model_file: str = "model.onnx",
    *,
    backend: str | None = None,
    instances: int = 1,
) -> str:
    """The ``config.yaml`` for ``desc``: commented, every value taken from the file or a default."""

    def tensors(specs: Sequence[TensorSpec]) -> str:
        return ", ".join(f"{s.name}{_shown(s.shape)} {s.dtype}" for s in specs)

    origin = f"ultralytics {desc.task} export" if desc.task else "no task metadata"
    lines = [
        f"# Written by `vidpipe models add` from {desc.path.name} ({origin}).",
        f"# Input: {tensors(desc.inputs)}. Output: {tensors(desc.outputs)}.",
    ]
    if desc.layout == "yolov8":
        lines.append("# Layout: YOLOv8 [N, 4+C, A] (boxes and class scores, no objectness).")
    elif desc.layout == "yolov5":
        lines.append("# Layout: YOLOv5 [N, A, 5+C] (boxes, objectness and class scores).")
    if desc.max_batch_size == 1:
        lines.append("# A fixed batch of 1: re-export with a dynamic batch axis to batch images.")
    lines += [
        f"name: {_flow(name)}",
        f"backend: {backend or default_backend()}",
        f"model_file: {{path: {_flow(model_file)}}}",
        f"max_batch_size: {desc.max_batch_size}",
    ]
    resize = "letterbox" if desc.kind == "yolo" else "stretch"
    item = f"[{', '.join(map(str, desc.input_shape))}]"
    spec = desc.input
    lines.append(f"input: {{name: {_flow(spec.name)}, shape: {item}, dtype: {spec.dtype}, resize: {resize}}}")
    if desc.kind == "yolo":
        lines.append(f"task: {{kind: yolo, layout: {desc.layout}, confidence: 0.25, iou: 0.45}}")
    else:
        lines.append("task: {kind: classify, top_k: 1}")
    if desc.labels:
        lines.append(f"labels: {_flow(desc.labels)}")
    if desc.max_batch_size > 1:
        lines.append("dynamic_batching: {max_queue_delay_microseconds: 2000}")
    lines.append(f"instance_group: [{{count: {instances}, kind: KIND_CPU}}]")
    return "\n".join(lines) + "\n"


def fill_input_shape(config: ModelConfig, model_path: Path) -> ModelConfig:
    """``config`` with ``input.shape`` taken from the model file when the config leaves it out.

    Raises :class:`~inference.config.ModelConfigError` at ``input.shape`` when the
    file does not declare a fixed image size either, and at ``model_file.path`` when
    the file is empty.
    """
    # Every load reads the file here first (the runtimes' own words for an empty file are
    # "no inputs" or a parser's trace).
    if Path(model_path).is_file() and Path(model_path).stat().st_size == 0:
        raise config.error("model_file.path", f"{model_path}: {EMPTY_FILE}", EMPTY_FILE_HINT)
    if config.input.shape:
        return config
    if Path(model_path).suffix.lower() != ".onnx":
        raise config.error(
            "input.shape",
            f"{Path(model_path).name}: the input size is read only from ONNX files",
            "set input.shape: [3, H, W]",
        )
    try:
        inputs, _, metadata = read_onnx(Path(model_path))
        wanted = config.input.name
        spec = next((i for i in inputs if wanted is None or i.name == wanted), None)
        if spec is None:
            raise ModelIntrospectionError(f"{Path(model_path).name}: the model has no input {wanted!r}")
        shape = _item_shape(spec, metadata, Path(model_path).name)
    except ModelIntrospectionError as exc:
        raise config.error("input.shape", f"not set, and {exc}") from None
    return dataclasses.replace(config, input=dataclasses.replace(config.input, shape=shape))
