"""The model repository: a folder of models, loaded, reloaded and unloaded by name.

Layout (Triton-like)::

    models/
      yolov8n/
        config.yaml          # name: yolov8n  (must equal the folder name)
        model.onnx           # model_file: {path: model.onnx}
        labels.txt           # labels_file: labels.txt
      ppocr_det/
        config.yaml
        1/model.onnx         # numbered version folders: the highest is served
        2/model.onnx         # unless config.yaml pins one with  version: 1

Every ``config.yaml`` is validated by :mod:`inference.schema`, so mistakes read
``models/x/config.yaml:12: input.shape: ... (hint: ...)``. Problems found while
loading (a missing model file, an input the model does not declare) point at
the config key to change in the same way. A model that fails to load becomes
``UNAVAILABLE`` with that reason; the other models are unaffected.

:func:`add_model` (``vidpipe models add``) puts an ONNX file into the layout above
as ``NAME/1/model.onnx`` with a config written from the file
(:mod:`inference.introspect`: the fastest CPU runtime installed unless told),
and loads it once to prove the config. The CLI then measures a few instance
counts (:func:`inference.tuning.choose_instances`) and writes the fastest.

``reload`` builds a new copy next to the one being served, swaps it in only
once it is ready, and then drains the old copy, so requests already queued on
the old one still finish. If the new copy fails, the old one keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference.backends import create_backend
from inference.backends.base import TensorSpec
from inference.batcher import UNAVAILABLE, InferenceObserver, NullObserver
from inference.config import ModelConfig, YoloOptions
from inference.errors import VidpipeError
from inference.introspect import (
    ModelDescription,
    ModelIntrospectionError,
    config_text,
    describe_model,
    fill_input_shape,
    metadata_labels,
)
from inference.model import (
    BackendFactory,
    Model,
    ModelState,
    ModelUnavailable,
    TaskFactory,
    load_labels,
    preprocess_site,
    resolve_model_file,
)
from inference.processing.tasks import create_task
from inference.schema import ConfigError, ConfigOrigin, build, line_of, load_yaml

CONFIG_FILE = "config.yaml"

# Under "vidpipe." like the pipeline's loggers: one tree to configure, "vidpipe.inference.*" here.
log = logging.getLogger(f"vidpipe.{__name__}")


class ModelNotFoundError(VidpipeError, LookupError):
    """No folder with a config.yaml for that model name."""


class ModelLoadError(VidpipeError, RuntimeError):
    """A model added to the repository did not load; nothing of it was left behind."""


@dataclass(frozen=True, slots=True)
class ModelStatus:
    """What ``status()`` reports for one model."""

    name: str
    version: int | None
    state: ModelState
    reason: str
    backend: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    instance_count: int
    max_batch_size: int
    precision: str = ""  # what the backend computes in (bf16, f32, native); "" until loaded
    preprocess: str = ""  # where images are normalised (model, cpu, gpu); "" until loaded


def _served(model: Model) -> str:
    """``version 2 on openvino``: which copy serves, in a log line."""
    version = f"version {model.version}" if model.version is not None else "the model file"
    return f"{version} on {model.config.backend}"


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A parsed config.yaml and the version chosen from its folder."""

    name: str
    file: Path
    data: Any
    config: ModelConfig
    version: int | None
    version_dir: Path | None

    @property
    def model_dir(self) -> Path:
        return self.file.parent

    def describe(self, exc: BaseException) -> str:
        """Render a load error; config errors already say ``FILE:LINE: key``."""
        if isinstance(exc, ConfigError):
            return exc.render()
        return f"{self.file}: {exc}"


def read_source(root: Path, name: str) -> ModelSource:
    """Parse ``root/name/config.yaml`` and pick the version; errors are :class:`ConfigError`."""
    folder = Path(root) / name
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"no model {name!r} in {root} (expected {path})")
    data = load_yaml(path)
    config = build(data, ModelConfig, str(path))
    # Later checks (model file, labels, the model's input) point at lines of this file.
    config = dataclasses.replace(config, origin=ConfigOrigin(str(path), data))
    if config.name != name:
        raise ConfigError(
            str(path),
            line_of(data, "name"),
            "name",
            f"{config.name!r} does not match the model's folder {name!r}",
            f"set name: {name} or rename the folder to {config.name}",
        )
    versions = sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit())
    if config.version is not None:
        if config.version not in versions:
            raise ConfigError(
                str(path),
                line_of(data, "version"),
                "version",
                f"version folder {folder / str(config.version)} does not exist",
                f"versions present: {', '.join(map(str, versions))}" if versions else "remove version:",
            )
        version: int | None = config.version
    else:
        version = versions[-1] if versions else None
    version_dir = folder / str(version) if version is not None else None
    _check_link(config, version_dir or folder)
    return ModelSource(name, path, data, config, version, version_dir)


def _check_link(config: ModelConfig, start: Path) -> None:
    """A model file that is a symlink (``models add --link``) to a file that is gone: name the
    missing target, not the link, which is where it belongs."""
    mf = config.model_file
    if mf is None or mf.package:
        return
    link = Path(mf.path) if Path(mf.path).is_absolute() else start / mf.path
    if not link.is_symlink() or link.exists():
        return
    target = link.resolve()  # through every link of a chain, to the name that is missing
    raise config.error(
        "model_file.path",
        f"{link} is a link to {target}, which does not exist (moved or deleted)",
        f"put the model file back at {target}, or point the link at where it is now: ln -sfn FILE {link}",
    )


class ModelRepository:
    """Loads the models under ``root`` and hands them out by name."""

    def __init__(
        self,
        root: Path,
        *,
        observer: InferenceObserver | None = None,
        backend_factory: BackendFactory = create_backend,
        task_factory: TaskFactory = create_task,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = Path(root)
        self.observer: InferenceObserver = observer or NullObserver()
        self._backend_factory = backend_factory
        self._task_factory = task_factory
        self._clock = clock
        self._models: dict[str, Model] = {}
        self._failed: dict[str, tuple[ModelConfig | None, str]] = {}  # config errors: no Model exists
        self._reload_errors: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    # -- reading -----------------------------------------------------------

    def names(self) -> list[str]:
        """Model folders that hold a config.yaml, sorted."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if (p / CONFIG_FILE).is_file())

    def config(self, name: str) -> ModelConfig:
        """The validated config of ``name`` (raises :class:`ConfigError` with FILE:LINE)."""
        return read_source(self.root, name).config

    def holds(self, name: str) -> bool:
        """Whether a copy of ``name`` is held: loaded, loading, or failed to load (what
        :meth:`unload` releases); False once unloaded, or before it was ever loaded."""
        model = self._models.get(name)
        return name in self._failed or (model is not None and model.state is not ModelState.UNLOADED)

    # -- lifecycle ---------------------------------------------------------

    def _lock(self, name: str) -> asyncio.Lock:
        lock = self._locks.get(name)
        if lock is None:
            lock = self._locks[name] = asyncio.Lock()
        return lock

    async def _build(self, name: str, *, quiet: bool = False) -> Model | str:
        """A loaded (READY or UNAVAILABLE) model, or the config error that prevented one."""
        try:
            src = read_source(self.root, name)
        except ConfigError as exc:
            return exc.render()
        model = Model(
            src.config,
            src.model_dir,
            version=src.version,
            version_dir=src.version_dir,
            backend_factory=self._backend_factory,
            task_factory=self._task_factory,
            observer=self.observer,
            clock=self._clock,
            describe_error=src.describe,
        )
        model.report_states = not quiet
        await asyncio.to_thread(model.load)
        return model

    def _record(self, name: str, built: Model | str) -> None:
        if isinstance(built, str):
            self._models.pop(name, None)
            self._failed[name] = (None, built)
            self._report(name, ModelState.UNAVAILABLE, built)
        else:
            self._models[name] = built
            self._failed.pop(name, None)
        self._reload_errors.pop(name, None)

    def _report(self, name: str, state: ModelState, reason: str) -> None:
        try:
            self.observer.on_state(name, state.value, reason)
        except Exception:  # an observer must not break loading
            log.exception("%s: observer.on_state failed", name)

    async def load(self, name: str) -> ModelStatus:
        """Load ``name`` unless it is already ready; a failure leaves it UNAVAILABLE (no exception).

        Raises :class:`ModelNotFoundError` only when the repository has no such folder.
        """
        async with self._lock(name):
            current = self._models.get(name)
            if current is not None and current.ready:
                return self._status_of(name)
            if not (self.root / name / CONFIG_FILE).is_file():
                raise ModelNotFoundError(
                    f"no model {name!r} in {self.root}; models: {', '.join(self.names())}"
                )
            self._record(name, await self._build(name))
            return self._status_of(name)

    async def load_all(self) -> list[ModelStatus]:
        """Load every model in the repository, one after another."""
        return [await self.load(name) for name in self.names()]

    async def unload(self, name: str) -> ModelStatus:
        """Stop serving ``name``; queued and running requests still finish."""
        async with self._lock(name):
            model = self._models.get(name)
            if model is None and name not in self._failed and name not in self.names():
                raise ModelNotFoundError(f"no model {name!r} in {self.root}")
            self._failed.pop(name, None)
            self._reload_errors.pop(name, None)
            if model is not None:
                await asyncio.to_thread(model.stop, drain=True)
            else:
                self._report(name, ModelState.UNLOADED, "unloaded")
            return self._status_of(name)

    async def reload(self, name: str, fits: Callable[[Model], str | None] | None = None) -> ModelStatus:
        """Build a fresh copy of ``name`` and swap it in once ready; then drain the old copy.

        ``fits`` says why a fresh copy that loaded cannot serve its users (a
        pipeline's stages), or None; such a copy counts as failed. If the fresh
        copy fails while an old one is serving, the old one keeps serving and the
        status reason says the reload failed.
        """
        async with self._lock(name):
            old = self._models.get(name)
            serving = old is not None and old.ready
            built = await self._build(name, quiet=serving)
            misfit = fits(built) if fits is not None and isinstance(built, Model) and built.ready else None
            if misfit is not None:
                assert isinstance(built, Model)
                await asyncio.to_thread(built.stop, drain=True)
                built = misfit
            if isinstance(built, Model) and built.ready:
                # One dict assignment: get() returns either the old or the new model, never neither.
                self._models[name] = built
                self._failed.pop(name, None)
                self._reload_errors.pop(name, None)
                built.report_states = True
                if serving:
                    self._report(name, ModelState.READY, "")
                if old is not None:
                    old.report_states = False
                    await asyncio.to_thread(old.stop, drain=True)
                was = f" (was {_served(old)})" if old is not None else ""
                log.info("model %s reloaded: %s%s", name, _served(built), was)
            elif serving:
                assert old is not None
                reason = built if isinstance(built, str) else built.reason
                self._reload_errors[name] = f"reload failed, still serving the previous load: {reason}"
                # The API answers 422 with the reason; the log keeps it for whoever was not asking.
                log.warning("model %s: reload failed, still serving %s: %s", name, _served(old), reason)
            else:
                if old is not None:
                    await asyncio.to_thread(old.stop, drain=True)
                self._record(name, built)
            return self._status_of(name)

    async def close(self) -> None:
        """Unload every model (draining their queues)."""
        for name in list(self._models):
            await self.unload(name)

    # -- serving -----------------------------------------------------------

    def get(self, name: str) -> Model:
        """The ready model ``name``; :class:`ModelUnavailable` if it is not ready."""
        model = self._models.get(name)
        if model is not None and model.ready:
            return model
        if model is not None:
            raise ModelUnavailable(name, model.state, model.reason)
        if name in self._failed:
            raise ModelUnavailable(name, ModelState.UNAVAILABLE, self._failed[name][1])
        if name in self.names():
            raise ModelUnavailable(name, ModelState.UNLOADED, "not loaded yet")
        raise ModelNotFoundError(
            f"no model {name!r} in {self.root}; models: {', '.join(self.names()) or 'none'}"
        )

    def for_request(self, name: str) -> Model:
        """:meth:`get` for a request about to be sent: a refusal is counted as one of the
        model's ``unavailable`` requests (``vidpipe_inference_requests_total``)."""
        try:
            return self.get(name)
        except ModelUnavailable:
            self.observer.counters(name).refused(UNAVAILABLE)
            raise

    def status(self) -> list[ModelStatus]:
        """One entry per model folder (and per loaded model whose folder went away)."""
        names = sorted(set(self.names()) | set(self._models) | set(self._failed))
        return [self._status_of(n) for n in names]

    def _status_of(self, name: str) -> ModelStatus:
        model = self._models.get(name)
        if model is not None:
            cfg = model.config
            reason = self._reload_errors.get(name, model.reason if not model.ready else "")
            return ModelStatus(
                name=name,
                version=model.version,
                state=model.state,
                reason=reason,
                backend=cfg.backend,
                inputs=tuple(model.inputs),
                outputs=tuple(model.outputs),
                instance_count=cfg.instance_count,
                max_batch_size=cfg.max_batch_size,
                precision=model.precision,
                preprocess=model.preprocess,
            )
        if name in self._failed:
            return ModelStatus(name, None, ModelState.UNAVAILABLE, self._failed[name][1], "", (), (), 0, 0)
        return ModelStatus(name, None, ModelState.UNLOADED, "not loaded", "", (), (), 0, 0)


def _specs(specs: tuple[TensorSpec, ...] | list[TensorSpec]) -> str:
    def dims(shape: tuple[int | None, ...]) -> str:
        return ",".join("?" if d is None else str(d) for d in shape)

    return ", ".join(f"{s.name}:{s.dtype}[{dims(s.shape)}]" for s in specs) or "-"


@dataclass(frozen=True, slots=True)
class RepositoryTable:
    """What ``vidpipe models list REPO`` prints, and which models could not be opened."""

    text: str
    unavailable: list[str]


def _labels_cell(labels: list[str], shown: int = 3) -> str:
    if not labels:
        return "-"
    more = ", …" if len(labels) > shown else ""
    return f"{len(labels)} ({', '.join(labels[:shown])}{more})"


def _task_cell(cfg: ModelConfig) -> str:
    if isinstance(cfg.task, YoloOptions) and cfg.task.layout != "auto":
        return f"yolo/{cfg.task.layout}"
    return cfg.task.kind


def describe_repository(root: Path, *, backend_factory: BackendFactory = create_backend) -> RepositoryTable:
    """The table ``vidpipe models list REPO`` prints: each model opened once to read its tensors.

    Models whose config, file or task setup is broken are listed as
    ``unavailable`` and their reasons follow the table. PREPROCESS is where images
    are normalised (``model``: inside the compiled model). LABELS is the class
    count and the first few names (from the config, else the model's metadata).
    """
    root = Path(root)
    header = (
        "NAME",
        "VERSION",
        "STATE",
        "BACKEND",
        "PRECISION",
        "PREPROCESS",
        "INPUTS",
        "OUTPUTS",
        "BATCH",
        "TASK",
        "LABELS",
    )
    rows: list[tuple[str, ...]] = []
    problems: list[str] = []
    unavailable: list[str] = []
    repo = ModelRepository(root)
    for name in repo.names():
        try:
            src = read_source(root, name)
        except ConfigError as exc:
            rows.append((name, "-", "unavailable", "-", "-", "-", "-", "-", "-", "-", "-"))
            problems.append(f"{name}: {exc.render()}")
            unavailable.append(name)
            continue
        cfg = src.config
        version = str(src.version) if src.version is not None else "-"
        batch = str(cfg.max_batch_size)
        if cfg.dynamic_batching.preferred_batch_size:
            batch += " (preferred " + ",".join(map(str, cfg.dynamic_batching.preferred_batch_size)) + ")"
        task = _task_cell(cfg)
        try:
            path = resolve_model_file(cfg, src.model_dir, src.version_dir)
            cfg = fill_input_shape(cfg, path)
            labels = load_labels(cfg, src.model_dir)
            backend = backend_factory(cfg, path, 0)
        except Exception as exc:
            rows.append((name, version, "unavailable", cfg.backend, "-", "-", "-", "-", batch, task, "-"))
            problems.append(f"{name}: {src.describe(exc)}")
            unavailable.append(name)
            continue
        try:
            inputs, outputs = _specs(backend.inputs), _specs(backend.outputs)
            labels = labels or (metadata_labels(backend.metadata) if cfg.task.kind == "yolo" else [])
            state = "ready"
            try:
                # The task checks what only the model can tell (a recogniser's dictionary).
                create_task(cfg, backend.input, backend.metadata, labels).check_outputs(backend.outputs)
            except Exception as exc:
                state = "unavailable"
                problems.append(f"{name}: {src.describe(exc)}")
                unavailable.append(name)
            site = preprocess_site(backend)
            cells = (cfg.backend, backend.precision, site, inputs, outputs, batch, task, _labels_cell(labels))
            rows.append((name, version, state, *cells))
        finally:
            backend.close()
    # A folder with a model file but no config.yaml is not a model yet: say how to make one.
    notes = []
    folders = root.iterdir() if root.is_dir() else []
    for folder in sorted(p for p in folders if p.is_dir() and not p.name.startswith(".")):
        if (folder / CONFIG_FILE).is_file():
            continue
        found = sorted(folder.glob("*.onnx")) + sorted(folder.glob("*/*.onnx"))
        versioned = model_in_folder(folder)
        if versioned is not None:
            # Triton's layout (N/model.onnx, often with a config.pbtxt): the config goes beside it.
            notes.append(
                f"{folder.name}: a model folder ({versioned.relative_to(root)}) but no {CONFIG_FILE}, "
                f"so not a model; vidpipe models add {folder} --repo {root} writes one"
            )
        elif found:
            notes.append(
                f"{folder.name}: a model file ({found[0].relative_to(root)}) but no {CONFIG_FILE}, so not a "
                f"model; vidpipe models add {found[0]} --repo {root} --name NAME writes one"
            )
    if not rows:
        empty = f"no models in {root} (expected {root}/<name>/{CONFIG_FILE})"
        return RepositoryTable("\n".join([empty, *notes]), [])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    if problems or notes:
        lines.append("")
        lines.extend([*problems, *notes])
    return RepositoryTable("\n".join(lines), unavailable)


@dataclass(frozen=True, slots=True)
class AddedModel:
    """What :func:`add_model` wrote and how the model loaded."""

    name: str
    folder: Path
    config_file: Path
    model_file: Path
    config_text: str
    description: ModelDescription
    status: ModelStatus


# A model folder's name, as `models add` makes one: a path part with no surprises.
MODEL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


def model_in_folder(folder: Path) -> Path | None:
    """The ONNX file of a model folder laid out as Triton's (``N/model.onnx``): the highest
    version's; None when there is none."""
    versions = [int(p.name) for p in folder.iterdir() if p.name.isdigit() and (p / "model.onnx").is_file()]
    return folder / str(max(versions)) / "model.onnx" if versions else None


async def add_model(
    model: Path,
    root: Path,
    name: str | None = None,
    *,
    link: bool = False,
    backend: str | None = None,
    instances: int = 1,
    in_place: bool = False,
    version: int = 1,
) -> AddedModel:
    """Add an ONNX file to the repository as ``root/NAME/VERSION/model.onnx`` with a config written from it.

    ``name`` defaults to the stem of the file as given (a symlink's own name, not its
    target's); ``version`` to 1 (a Triton folder's keeps its number); ``backend`` to the fastest CPU runtime
    installed (:func:`~inference.introspect.default_backend`). The model is then loaded through
    :class:`ModelRepository` to prove the config works; if it does not load,
    the folder is removed again and :class:`ModelLoadError` says why; a file it
    cannot describe is a :class:`ModelIntrospectionError`, before anything is written.
    An existing model folder is never overwritten. ``in_place``: ``model`` is already
    ``root/NAME/N/model.onnx`` (a Triton-style folder in the repository): only the config
    is written beside it, and only it is removed again if the model does not load.
    """
    name = name or Path(model).stem  # the name the user sees, not a link's target's
    model = Path(model).resolve()
    root = Path(root)
    desc = describe_model(model)  # before anything is written: an unusable file leaves no trace
    if not MODEL_NAME.fullmatch(name):
        raise ModelIntrospectionError(
            f"{name!r} is not a usable model name (1-64 letters, digits, '_', '-' or '.', "
            "not starting with '.' or '-'); pass --name"
        )
    folder = root / name
    text = config_text(desc, name, backend=backend, instances=instances)
    if in_place:
        if (
            model.name != "model.onnx"
            or model.parent.parent != folder.resolve()
            or not model.parent.name.isdigit()
        ):
            raise ModelIntrospectionError(
                f"{model} is not {folder}/N/model.onnx; it cannot be added in place"
            )
        if (folder / CONFIG_FILE).exists():
            raise ModelIntrospectionError(
                f"{folder / CONFIG_FILE} already exists; the model is in the repository"
            )
        try:
            (folder / CONFIG_FILE).write_text(text, encoding="utf-8")
            status = await _load_once(root, name)
        except BaseException:
            (folder / CONFIG_FILE).unlink(missing_ok=True)
            raise
        return AddedModel(name, folder, folder / CONFIG_FILE, model, text, desc, status)
    if folder.exists():
        raise ModelIntrospectionError(f"{folder} already exists; pass --name or remove it first")
    target = folder / str(version) / "model.onnx"
    target.parent.mkdir(parents=True)
    try:
        if link:
            target.symlink_to(model)
        else:
            shutil.copyfile(model, target)
        (folder / CONFIG_FILE).write_text(text, encoding="utf-8")
        status = await _load_once(root, name)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return AddedModel(name, folder, folder / CONFIG_FILE, target, text, desc, status)


async def _load_once(root: Path, name: str) -> ModelStatus:
    """Load ``name`` from ``root`` to prove its written config works (:class:`ModelLoadError` if not)."""
    repo = ModelRepository(root)
    status = await repo.load(name)
    await repo.close()
    if status.state is not ModelState.READY:
        raise ModelLoadError(f"model {name}: the written config does not load: {status.reason}")
    return status
