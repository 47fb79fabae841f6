"""INT8 post-training quantization of a repository model, checked against the float model.

``vidpipe models quantize NAME --repo DIR --from SOURCE...`` (and :func:`quantize_model`
without the CLI) turns a float model into an INT8 OpenVINO model with NNCF:

1. frames from the user's own files or cameras are split into calibration frames and
   held-out frames (every fourth one is held out);
2. the calibration frames go through the model's own preprocessing
   (:class:`~inference.processing.resize.ImagePreprocessor` with the config's ``input``:
   letterbox or stretch, colour order, mean and std), so the ranges NNCF measures are
   the ranges the served model sees;
3. NNCF quantizes the model as OpenVINO reads it (``nncf.quantize``);
4. the float and the INT8 model both run the held-out frames through
   :class:`~inference.model.Model` (pre- and post-processing included) and their answers
   are compared: detections by box agreement (boxes paired at IoU ≥ 0.7, same class) and
   by per-frame counts, classifications by label, recognised text by equality;
5. only when the agreement reaches the threshold is the INT8 model written, as the next
   version folder of the model::

       models/yolov8s/
         config.yaml          # model_file: {path: model.xml}, backend: openvino (rewritten)
         1/model.onnx         # the float model, untouched: roll back to it
         2/model.xml          # INT8 (OpenVINO IR)
         2/model.bin
         2/quantize.txt       # what was measured: agreement, frames, threshold
         2/config.before.yaml # the config.yaml replaced, serving the float model if copied back

A model that fails the check is refused with :class:`QuantizeRefused`, which carries the
measured agreement and the threshold; nothing is written. The NNCF package is an
optional extra (``pip install 'vidpipe[int8]'``).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from inference.config import ModelConfig, OpenVinoOptions
from inference.errors import VidpipeError
from inference.model import Model, ModelState, resolve_model_file
from inference.processing.crop import crop_box, crop_upright
from inference.processing.nms import iou_matrix
from inference.processing.resize import ImagePreprocessor
from inference.repository import CONFIG_FILE, ModelSource, read_source
from inference.results import Classification, Detection, Recognition, Result
from inference.schema import build, load_yaml_text

__all__ = [
    "Agreement",
    "QuantizeError",
    "QuantizeRefused",
    "QuantizeResult",
    "check_quantizable",
    "compare_results",
    "crops_from",
    "quantize_model",
    "read_frames",
    "split_frames",
    "video_file_problem",
]

# Under "vidpipe." like the pipeline's loggers: one tree to configure, "vidpipe.inference.*" here.
log = logging.getLogger(f"vidpipe.{__name__}")

# Boxes of the float and the INT8 model are the same box at this IoU or more.
MATCH_IOU = 0.7
DEFAULT_MIN_AGREEMENT = 0.95
HOLD_OUT_EVERY = 4  # every fourth frame checks, the others calibrate
MAX_SIDE = 1280  # frames read for calibration are scaled down to this (models take 320-1280)
INT8_FILE = "model.xml"
REPORT_FILE = "quantize.txt"
# The config.yaml the INT8 version replaced, kept in its folder.
BEFORE_FILE = "config.before.yaml"
DETECTION_KINDS = ("yolo", "text_detect")
# Crops smaller than this on a side are not calibrated or checked on (a box of a pixel or
# two says nothing about the ranges a classifier sees).
MIN_CROP_SIDE = 4
# The source schemes read_frames opens (PyAV): files and network streams. vidpipe's own
# sources (test://, whip://, v4l2://) are not among them.
READABLE_SCHEMES = ("file", "rtsp", "rtsps", "http", "https", "udp", "rtp", "srt")


class QuantizeError(VidpipeError, RuntimeError):
    """The model cannot be quantized (missing NNCF, a backend without files, too few frames)."""


class QuantizeRefused(QuantizeError):
    """The INT8 model disagrees with the float model more than allowed; nothing was written."""

    def __init__(self, message: str, agreement: Agreement, threshold: float) -> None:
        super().__init__(message)
        self.agreement = agreement
        self.threshold = threshold


@dataclass(frozen=True, slots=True)
class Agreement:
    """How far the INT8 model's answers agree with the float model's on the held-out frames.

    ``score`` is the number checked against the threshold: for detections the lower of
    box agreement and count agreement, for classifiers and recognisers the share of
    equal answers.
    """

    kind: str  # "detection", "label" or "text"
    frames: int
    score: float
    boxes_float: int = 0
    boxes_int8: int = 0
    boxes_matched: int = 0
    box_agreement: float = 1.0  # 2 × matched / (float boxes + INT8 boxes)
    count_agreement: float = 1.0  # frames with as many INT8 boxes as float ones
    equal: int = 0  # classifiers/recognisers: answers that are the same
    unit: str = "frames"  # what was checked: "frames", or "crops" of a detector's objects

    def describe(self) -> str:
        if self.kind == "detection":
            return (
                f"box agreement {self.box_agreement:.3f} ({self.boxes_matched} of {self.boxes_float} float / "
                f"{self.boxes_int8} INT8 boxes matched at IoU >= {MATCH_IOU}), per-frame counts equal on "
                f"{self.count_agreement:.3f} of {self.frames} {self.unit}"
            )
        return f"{self.kind} equal on {self.equal} of {self.frames} {self.unit} ({self.score:.3f})"


@dataclass(frozen=True, slots=True)
class QuantizeResult:
    """What :func:`quantize_model` wrote."""

    name: str
    version: int
    model_file: Path
    config_file: Path
    agreement: Agreement
    threshold: float
    calibration_frames: int  # images: frames, or crops when ``crops_of`` names a detector
    changes: list[str]
    rollback: str
    crops_of: str | None = None


def video_file_problem(path: Path) -> tuple[str, str] | None:
    """Why the file ``path`` cannot give frames, as (problem, hint); None when it can.

    Opens the container only (no frame is decoded), so a typo'd path or a file that is
    not a video is refused before a camera among the other sources is waited for.
    """
    import av

    if not path.exists():
        return "file not found", "check the path; relative paths start at the current folder"
    if path.is_dir():
        return "is a folder, not a video file", "give a video file (mp4, mkv, ...)"
    if path.stat().st_size == 0:
        return "the file is empty (0 bytes)", "give a video file (mp4, mkv, ...)"
    try:
        with av.open(str(path), timeout=10.0) as container:
            if not container.streams.video:
                return "has no video stream", "give a video file (mp4, mkv, ...)"
    except av.FFmpegError as exc:
        # FFmpeg's own text without its error code: "Invalid data found when processing input".
        why = exc.strerror or type(exc).__name__
        return f"not a video file FFmpeg can read ({why})", "give a video file (mp4, mkv, ...)"
    except OSError as exc:
        return f"cannot read it: {exc.strerror or exc}", "check that the file can be read"
    return None


def read_frames(
    urls: Sequence[str], count: int, *, every: int = 1, max_side: int = MAX_SIDE
) -> list[np.ndarray]:
    """Up to ``count`` RGB frames from files or camera URLs (PyAV), every ``every``-th frame.

    The sources are read in turn, each for an equal share of ``count``, so a
    calibration set covers every camera the model will see. Frames larger than
    ``max_side`` are scaled down (the model sees them smaller still), so a few
    hundred 4K frames fit in memory.
    """
    import av
    import cv2

    frames: list[np.ndarray] = []
    for k, url in enumerate(urls):
        share = (count - len(frames)) // (len(urls) - k)
        options = {"rtsp_transport": "tcp"} if url.startswith(("rtsp://", "rtsps://")) else {}
        try:
            container = av.open(url, options=options, timeout=10.0)
        except (av.FFmpegError, OSError) as exc:
            raise QuantizeError(f"{url}: cannot open: {exc.strerror or exc}") from None
        taken = 0
        with container:
            for i, frame in enumerate(container.decode(video=0)):
                if taken >= share:
                    break
                if i % every == 0:
                    image: np.ndarray = frame.to_ndarray(format="rgb24")
                    scale = max_side / max(image.shape[:2])
                    if scale < 1:
                        size = (round(image.shape[1] * scale), round(image.shape[0] * scale))
                        image = cv2.resize(image, size, interpolation=cv2.INTER_AREA)
                    frames.append(image)
                    taken += 1
        if taken == 0:
            raise QuantizeError(f"{url}: no video frames")
    return frames


def split_frames(frames: Sequence[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Calibration frames and held-out frames: every :data:`HOLD_OUT_EVERY`-th frame is held out."""
    held = [f for i, f in enumerate(frames) if i % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1]
    calib = [f for i, f in enumerate(frames) if i % HOLD_OUT_EVERY != HOLD_OUT_EVERY - 1]
    return calib, held


# -- comparing answers ---------------------------------------------------------------------------


def _matched(ref: Sequence[Detection], got: Sequence[Detection]) -> int:
    """Pairs of boxes (same class, IoU ≥ :data:`MATCH_IOU`), each box in at most one pair."""
    if not ref or not got:
        return 0
    from scipy.optimize import linear_sum_assignment

    iou = iou_matrix(np.asarray([d.box for d in ref], float), np.asarray([d.box for d in got], float))
    same = np.asarray([[r.class_id == g.class_id for g in got] for r in ref])
    iou = np.where(same, iou, 0.0)
    rows, cols = linear_sum_assignment(-iou)
    return int(np.sum(iou[rows, cols] >= MATCH_IOU))


def compare_results(reference: Sequence[Result], candidate: Sequence[Result]) -> Agreement:
    """The agreement of ``candidate`` (INT8) with ``reference`` (float), frame by frame."""
    frames = len(reference)
    if frames == 0:
        return Agreement("detection", 0, 0.0)
    first = reference[0]
    if isinstance(first, list):
        n_ref = n_got = matched = counts = 0
        for ref, got in zip(reference, candidate, strict=True):
            assert isinstance(ref, list) and isinstance(got, list)
            n_ref += len(ref)
            n_got += len(got)
            matched += _matched(ref, got)
            counts += len(ref) == len(got)
        boxes = 2 * matched / (n_ref + n_got) if n_ref + n_got else 1.0
        count_share = counts / frames
        return Agreement(
            "detection",
            frames,
            min(boxes, count_share),
            boxes_float=n_ref,
            boxes_int8=n_got,
            boxes_matched=matched,
            box_agreement=boxes,
            count_agreement=count_share,
        )
    if isinstance(first, Recognition):
        equal = sum(
            isinstance(r, Recognition) and isinstance(g, Recognition) and r.text == g.text
            for r, g in zip(reference, candidate, strict=True)
        )
        return Agreement("text", frames, equal / frames, equal=equal)
    if isinstance(first, Classification):
        equal = sum(
            isinstance(r, Classification) and isinstance(g, Classification) and r.class_id == g.class_id
            for r, g in zip(reference, candidate, strict=True)
        )
        return Agreement("label", frames, equal / frames, equal=equal)
    raise QuantizeError(f"cannot compare answers of type {type(first).__name__}")


# -- running -------------------------------------------------------------------------------------


def _answers(config: ModelConfig, source: ModelSource, frames: Sequence[np.ndarray]) -> list[Result]:
    """Every frame through a freshly loaded :class:`Model` with ``config``, one after another."""
    model = Model(
        config,
        source.model_dir,
        version=source.version,
        version_dir=source.version_dir,
        describe_error=source.describe,
    )
    try:
        if model.load() is not ModelState.READY:
            raise QuantizeError(f"model {source.name} does not load: {model.reason}")
        return [model.submit(frame).result() for frame in frames]
    finally:
        model.stop(drain=False)


def int8_config(config: ModelConfig, model_path: Path) -> ModelConfig:
    """``config`` served from the INT8 IR at ``model_path`` on OpenVINO (other settings kept)."""
    from inference.config import ModelFile

    options = config.backend_options if config.backend == "openvino" else OpenVinoOptions()
    return dataclasses.replace(
        config,
        backend="openvino",
        model_file=ModelFile(path=str(model_path)),
        backend_options=options,
    )


def _to_tensor(config: ModelConfig) -> Callable[[np.ndarray], np.ndarray]:
    """A frame as the model's input tensor, through the model's own preprocessing."""
    preprocess = ImagePreprocessor(config.input)
    c, h, w = config.input.shape

    def tensor(frame: np.ndarray) -> np.ndarray:
        out = np.empty((1, c, h, w), dtype=config.input.dtype)
        preprocess([frame], out)
        return out if config.max_batch_size else out[0]

    return tensor


def _quantize(config: ModelConfig, float_path: Path, frames: Sequence[np.ndarray], out: Path) -> None:
    try:
        import nncf
    except ImportError:
        raise QuantizeError(
            "INT8 quantization needs NNCF: pip install 'vidpipe[int8]' (or pip install nncf)"
        ) from None
    import openvino as ov

    # NNCF's progress chatter stays out of an operator's log. Its own set_log_level also sets
    # the level of handlers it can reach, which silenced the embedding application's (and
    # the test suite's) log handlers; the logger's level is enough.
    logging.getLogger("nncf").setLevel(logging.ERROR)
    model = ov.Core().read_model(str(float_path))
    name = config.input.name or model.inputs[0].get_any_name()
    tensor = _to_tensor(config)
    # Preprocessed one frame at a time as NNCF asks: a few hundred float tensors would not fit in memory.
    dataset = nncf.Dataset(frames, lambda frame: {name: tensor(frame)})
    quantized = nncf.quantize(model, dataset, subset_size=len(frames))
    ov.save_model(quantized, str(out), compress_to_fp16=False)


def _rollback_from(report: Path) -> str:
    for line in report.read_text(encoding="utf-8").splitlines():
        if line.startswith("to roll back: "):
            return line.removeprefix("to roll back: ")
    return "point model_file at the float model"


def _next_version(folder: Path) -> int:
    versions = [int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit()]
    return max(versions, default=0) + 1


def _model_file_text(config: ModelConfig) -> str:
    mf = config.model_file
    if mf is None:
        return "(unset)"
    package = f"package: {mf.package}, " if mf.package else ""
    return f"{{{package}path: {mf.path}}}"


def _rollback_hint(source: ModelSource, version: int) -> str:
    """Every key the INT8 config changes, back as it was; and the whole previous file, kept."""
    config = source.config
    previous = _model_file_text(config)
    undo = f"set version: {source.version} and model_file: {previous}" if source.version is not None else (
        f"set model_file: {previous}"
    )  # fmt: skip
    if config.backend != "openvino":
        undo += f", backend: {config.backend}"
        if config.backend_options:
            undo += " and its backend_options"
    if source.version is None:
        undo += " and remove the INT8 version folder"
    kept = f"{version}/{BEFORE_FILE}"
    if config.version is None and source.version is not None:
        kept += f" (the previous config with version: {source.version} pinned)"
    return f"{undo}; or copy {kept} over {source.file.name}"


def _before_text(source: ModelSource, version: int) -> str:
    """The config.yaml the INT8 version replaces, as it must read to serve the float model again.

    Copied back over config.yaml it has to serve what it served before, but the INT8
    version folder is then the highest: a config that did not pin ``version:`` (as
    ``models add`` writes it) gets the float version pinned, and a model file that was
    beside config.yaml (no version folders) is named from the INT8 folder, where
    relative paths now start. Anything else is the file as it was.
    """
    text = source.file.read_text(encoding="utf-8")
    mf = source.config.model_file
    if source.config.version is not None:
        return text
    flat = source.version is None and mf is not None and not mf.package and not Path(mf.path).is_absolute()
    if source.version is None and not flat:
        return text  # a package file or an absolute path: found the same from any folder
    from ruamel.yaml.comments import CommentedMap

    from inference.tuning import round_trip_yaml

    y = round_trip_yaml()
    doc = y.load(text)
    if source.version is not None:
        why = f"pinned by `vidpipe models quantize`: version {version} is INT8"
        doc.insert(
            list(doc).index("name") + 1 if "name" in doc else 0, "version", source.version, comment=why
        )
        note = f"version: {source.version} (the float model) pinned"
    else:
        assert mf is not None
        moved = CommentedMap(path=f"../{mf.path}")
        moved.fa.set_flow_style()
        doc["model_file"] = moved
        note = f"model_file: {{path: ../{mf.path}}} (relative paths now start at the folder {version}/)"
    out = io.StringIO()
    y.dump(doc, out)
    head = (
        f"# The config.yaml that INT8 version {version} replaced, with {note}: "
        "copied over config.yaml, it serves the float model again.\n"
    )
    new_text = head + out.getvalue()
    build(load_yaml_text(new_text, str(source.file)), ModelConfig, str(source.file))
    return new_text


def _rewrite_config(source: ModelSource, version: int) -> tuple[str, list[str], str]:
    """config.yaml served from the INT8 version: model_file, backend (and a pinned version)."""
    from ruamel.yaml.comments import CommentedMap

    from inference.tuning import round_trip_yaml, set_key

    text = source.file.read_text(encoding="utf-8")
    rollback = _rollback_hint(source, version)
    y = round_trip_yaml()
    doc = y.load(text)
    changes: list[str] = []
    if source.config.backend != "openvino":
        set_key(doc, "backend", "openvino", changes, "backend")
        if "backend_options" in doc:
            del doc["backend_options"]  # the other runtime's options do not apply to OpenVINO
            changes.append("backend_options: removed (they were the previous runtime's)")
    mf = CommentedMap(path=INT8_FILE)
    mf.fa.set_flow_style()
    doc["model_file"] = mf
    changes.append(f"model_file: {_model_file_text(source.config)} -> {{path: {INT8_FILE}}}")
    if source.config.version is not None:
        set_key(doc, "version", version, changes, "version")
    out = io.StringIO()
    y.dump(doc, out)
    # A first line on top of the file's own comments, which stay.
    new_text = f"# INT8 version {version} written by `vidpipe models quantize`; to roll back, {rollback}.\n"
    new_text += out.getvalue()
    build(load_yaml_text(new_text, str(source.file)), ModelConfig, str(source.file))
    return new_text, changes, rollback


def is_detector(config: ModelConfig) -> bool:
    """Whether the model finds objects in whole frames (the rest read crops of them)."""
    return config.task.kind in DETECTION_KINDS


def crops_from(root: Path, detector: str, frames: Sequence[np.ndarray]) -> list[np.ndarray]:
    """What ``detector`` (a model of the same repository) finds in ``frames``, cut the way an
    infer stage with ``on:`` cuts it: rotated text lines warped upright, boxes as they are.

    A classifier or recogniser reads these crops in a pipeline, so they, not whole frames,
    hold the ranges its INT8 model must be calibrated for and the answers it must keep.
    """
    source = read_source(Path(root), detector)
    if not is_detector(source.config):
        raise QuantizeError(
            f"--crops-of {detector}: a {source.config.task.kind} model finds no objects to crop; "
            f"name a detector: a model of task kind {' or '.join(DETECTION_KINDS)}"
        )
    from inference.introspect import fill_input_shape

    path = resolve_model_file(source.config, source.model_dir, source.version_dir)
    config = fill_input_shape(source.config, path)
    crops: list[np.ndarray] = []
    for frame, found in zip(frames, _answers(config, source, frames), strict=True):
        assert isinstance(found, list)
        for det in found:
            crop = crop_upright(frame, det.polygon) if det.polygon else crop_box(frame, det.box)
            if min(crop.shape[:2]) >= MIN_CROP_SIDE:
                crops.append(np.ascontiguousarray(crop))
    return crops


def check_quantizable(root: Path, name: str) -> tuple[ModelSource, Path]:
    """``root/name`` and its float model file, or why it cannot be quantized: a runtime that
    builds its own INT8 (TensorRT, Triton), or a served version that is INT8 already. Cheap:
    the CLI calls it before it reads a frame."""
    source = read_source(Path(root), name)
    config = source.config
    if config.backend in ("tensorrt", "triton"):
        raise QuantizeError(
            f"model {name}: INT8 here is for CPU runtimes (OpenVINO); {config.backend} builds its own"
        )
    float_path = resolve_model_file(config, source.model_dir, source.version_dir)
    if (float_path.parent / REPORT_FILE).is_file():
        raise QuantizeError(
            f"model {name}: version {source.version} is already INT8 ({float_path.parent / REPORT_FILE}); "
            f"quantize the float model: {_rollback_from(float_path.parent / REPORT_FILE)}"
        )
    return source, float_path


def quantize_model(
    root: Path,
    name: str,
    frames: Sequence[np.ndarray],
    *,
    held_out: Sequence[np.ndarray] | None = None,
    min_agreement: float = DEFAULT_MIN_AGREEMENT,
    crops_of: str | None = None,
) -> QuantizeResult:
    """Quantize ``root/name`` with ``frames`` (RGB uint8) and write it as a new version if it agrees.

    Every :data:`HOLD_OUT_EVERY`-th frame is held out for the check unless ``held_out``
    gives the check its own frames (then all of ``frames`` calibrate). With ``crops_of``
    (a detector of the repository), the model is calibrated and checked on the objects
    that detector finds in those frames (:func:`crops_from`), as a pipeline feeds it. Raises
    :class:`QuantizeRefused` (nothing written) when the INT8 model's agreement with the
    float model on the held-out frames is below ``min_agreement``.
    """
    source, float_path = check_quantizable(Path(root), name)
    config = source.config
    if held_out is None:
        calib, held = split_frames(frames)
    else:
        calib, held = list(frames), list(held_out)
    if len(held) < 1 or len(calib) < 2:
        raise QuantizeError(
            f"model {name}: {len(frames)} frame(s) are too few: at least {HOLD_OUT_EVERY} are needed "
            "(three calibrate, one checks); give a longer clip or more sources"
        )
    unit = "frame(s)"
    if crops_of is not None:
        # Held out by frame: no crop of a checking frame calibrates.
        log.info("%s: cutting the objects %s finds in %d frame(s)", name, crops_of, len(calib) + len(held))
        calib, held = crops_from(root, crops_of, calib), crops_from(root, crops_of, held)
        if len(held) < 1 or len(calib) < 2:
            raise QuantizeError(
                f"model {name}: {crops_of} found {len(calib) + len(held)} object(s) in "
                f"{len(frames)} frame(s), too few to calibrate and check on; give frames that show "
                "what it detects"
            )
        unit = f"crop(s) of {crops_of}'s objects"
    from inference.introspect import fill_input_shape

    config = fill_input_shape(config, float_path)
    # Absolute: the INT8 model is loaded from the staging folder by path, and a relative
    # repository would be joined onto the model folder a second time.
    folder = Path(source.model_dir).resolve()
    version = _next_version(folder)
    staging = folder / f".{version}.int8-tmp"
    target = folder / str(version)
    tmp = source.file.with_name(CONFIG_FILE + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        int8_path = staging / INT8_FILE
        log.info("%s: calibrating on %d %s", name, len(calib), unit)
        _quantize(config, float_path, calib, int8_path)
        log.info("%s: checking against the float model on %d held-out %s", name, len(held), unit)
        reference = _answers(config, source, held)
        candidate = _answers(int8_config(config, int8_path), source, held)
        if all(isinstance(r, list) and not r for r in reference):
            raise QuantizeError(
                f"model {name}: the float model finds nothing on the {len(held)} held-out frame(s), so "
                "the check would prove nothing; give frames that show what the model detects"
            )
        agreement = compare_results(reference, candidate)
        if crops_of is not None:
            agreement = dataclasses.replace(agreement, unit="crops")
        if agreement.score < min_agreement:
            raise QuantizeRefused(
                f"model {name}: the INT8 model agrees with the float model at {agreement.score:.3f}, below "
                f"the threshold {min_agreement:g} ({agreement.describe()}); nothing was written. "
                "Calibrate on more (or more typical) frames, or keep the float model",
                agreement,
                min_agreement,
            )
        new_text, changes, rollback = _rewrite_config(source, version)
        (staging / REPORT_FILE).write_text(
            f"INT8 by NNCF from {float_path.name}, calibrated on {len(calib)} {unit}\n"
            f"checked on {len(held)} held-out {unit}: {agreement.describe()}\n"
            f"threshold: {min_agreement:g}\n"
            f"to roll back: {rollback}\n",
            encoding="utf-8",
        )
        (staging / BEFORE_FILE).write_text(_before_text(source, version), encoding="utf-8")  # the way back
        tmp.write_text(new_text, encoding="utf-8")
        staging.rename(target)
        # The last step: until config.yaml is replaced, an interruption (Ctrl-C) leaves nothing.
        tmp.replace(source.file)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if tmp.exists():  # config.yaml not replaced: the version folder serves nothing
            shutil.rmtree(target, ignore_errors=True)
            tmp.unlink(missing_ok=True)
        raise
    return QuantizeResult(
        name=name,
        version=version,
        model_file=target / INT8_FILE,
        config_file=source.file,
        agreement=agreement,
        threshold=min_agreement,
        calibration_frames=len(calib),
        changes=changes,
        rollback=rollback,
        crops_of=crops_of,
    )
