"""Pipeline configuration: the YAML an operator writes, parsed into typed objects.

Everything is validated before anything starts; every problem is reported as
``FILE:LINE: key: what is wrong (hint: what to do)``. A minimal file::

    pipeline: demo
    models: ../samples/models        # model repository, relative to this file
    sources:
      - url: ../samples/generated/demo.mp4
    stages:
      - {name: detect, type: infer, model: squares}

See docs/config.md for every key.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from inference.schema import ConfigError, LineDict, build, line_of, load_yaml, spec
from pipeline.sources.schemes import check_url, derive_id, resolve_url, scheme_of
from pipeline.stages.base import NAME_HELP, StageOptions, check_name
from pipeline.stages.registry import stage_kinds

# 8K UHD: the largest picture any camera or clip in scope sends. A frame over it is
# refused before a buffer is allocated (a 16384x8192 clip of a few hundred KB would
# otherwise take gigabytes of frame pool).
MAX_PIXELS = 7680 * 4320
# Seconds: the shortest wait between reconnect attempts config or API may ask for.
MIN_RECONNECT_DELAY = 0.1


@dataclass(frozen=True)
class ReconnectConfig:
    """Backoff between reconnect attempts of a live source: ``min_delay * 2**n`` capped, with jitter.

    Both delays are at least :data:`MIN_RECONNECT_DELAY`: a camera that refuses at
    once would otherwise be hammered (``min_delay: 1e-300`` made 10,624
    connections in 10 s).
    """

    min_delay: float = field(default=0.5, metadata=spec(ge=MIN_RECONNECT_DELAY, help="seconds, at least 0.1"))
    max_delay: float = field(
        default=10.0, metadata=spec(ge=MIN_RECONNECT_DELAY, help="seconds, at least 0.1")
    )
    jitter: float = field(default=0.2, metadata=spec(ge=0, le=1))

    def __post_init__(self) -> None:
        if self.max_delay < self.min_delay:
            raise ValueError(
                f"max_delay ({self.max_delay:g}) must be at least min_delay ({self.min_delay:g})"
            )


@dataclass(frozen=True)
class SourceConfig:
    """One stream.

    ``url`` is a file path, ``file://``, ``test://?width=&height=&fps=&frames=``,
    ``rtsp://`` or ``whip://<id>``.
    """

    url: str = field(metadata=spec(check=check_url, help="e.g. samples/clip.mp4 or rtsp://cam/stream"))
    id: str | None = field(default=None, metadata=spec(check=check_name, help=NAME_HELP))
    loop: bool = False
    realtime: bool | None = field(
        default=None, metadata=spec(help="pace files at their frame rate; default: as fast as possible")
    )
    max_fps: float | None = field(default=None, metadata=spec(gt=0, help="drop frames above this rate"))
    queue_size: int = field(default=8, metadata=spec(ge=1, le=1024))
    max_pixels: int = field(
        default=MAX_PIXELS,
        metadata=spec(ge=1, help="largest frame (width x height) accepted; default 8K UHD, 7680x4320"),
    )
    transport: Literal["tcp", "udp"] = "tcp"
    open_timeout: float = field(default=10.0, metadata=spec(gt=0))
    read_timeout: float = field(default=5.0, metadata=spec(gt=0))
    stall_timeout: float = field(default=5.0, metadata=spec(gt=0))
    reconnect: ReconnectConfig = field(default_factory=ReconnectConfig)
    allow_redirects: bool = field(
        default=False,
        metadata=spec(help="RTSP: follow a redirect to another host, credentials and all"),
    )
    decode: Literal["cpu", "cuda", "auto"] = field(
        default="cpu",
        metadata=spec(help="cuda decodes on the GPU (NVDEC); auto tries it and falls back to cpu"),
    )

    @property
    def scheme(self) -> str:
        return scheme_of(self.url).name

    @property
    def live(self) -> bool:
        """Live sources drop the oldest frame when behind; files block (lossless)."""
        return scheme_of(self.url).live

    @property
    def source_id(self) -> str:
        assert self.id is not None, "source ids are filled in by load_config"
        return self.id


@dataclass(frozen=True)
class NatsConfig:
    """Where detections go. No ``url`` starts an embedded nats-server on loopback."""

    url: str | None = None
    publish: Literal["core", "jetstream"] = "core"
    subject_prefix: str = field(default="vidpipe", metadata=spec(check=check_name))
    outbox_size: int = field(default=1000, metadata=spec(ge=1))


@dataclass(frozen=True)
class RuntimeConfig:
    """Flow limits."""

    max_in_flight: int = field(
        default=4, metadata=spec(ge=1, le=256, help="frames of one source processed at once")
    )
    drain_timeout: float = field(default=10.0, metadata=spec(gt=0))
    max_sources: int = field(default=64, metadata=spec(ge=1, le=4096, help="sources running at once"))
    frame_memory_mb: int = field(
        default=2048,
        metadata=spec(ge=1, le=1 << 20, help="MB of decoded-frame pools for all sources together"),
    )
    device: Literal["cpu", "gpu", "auto"] = field(
        default="cpu",
        metadata=spec(help="gpu needs an NVIDIA GPU with CuPy; auto uses one when present"),
    )


@dataclass(frozen=True)
class HttpConfig:
    """The HTTP server (metrics, health, API, WHIP). Binds loopback unless told otherwise."""

    listen: str = "127.0.0.1:8080"
    token: str | None = field(
        default=None, metadata=spec(help="bearer token; required off loopback, 16 characters at least")
    )
    max_connections: int = field(
        default=256, metadata=spec(ge=1, le=65536, help="open connections at once; more are closed at once")
    )
    header_timeout: float = field(
        default=10.0, metadata=spec(gt=0, le=3600, help="seconds a client has to send a request's headers")
    )
    keepalive_timeout: float = field(
        default=15.0, metadata=spec(gt=0, le=3600, help="seconds an idle keep-alive connection stays open")
    )
    file_roots: list[str] = field(
        default_factory=list,
        metadata=spec(help="folders whose files POST /v1/sources may open; none by default"),
    )


def _check_worker_id(value: str) -> str | None:
    ok = re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}", value)
    return None if ok else f"{value!r} is not a valid worker id (letters, digits, '_', '-', '.')"


@dataclass(frozen=True)
class FleetConfig:
    """Workers that share the sources over NATS JetStream (docs/fleet.md).

    ::

        fleet:
          name: cameras          # workers with the same name and NATS server share the sources
          lease_ttl: 6           # seconds; a dead worker's sources move after about this long
          max_sources: 16        # sources this worker runs at most; default runtime.max_sources
          worker_id: cam-host-1  # default: <hostname>-<pid>
          replicas: 3            # copies of the fleet's buckets (a 3-node JetStream cluster)
    """

    name: str = field(metadata=spec(check=check_name, help=NAME_HELP))
    lease_ttl: float = field(
        default=6.0, metadata=spec(ge=1, le=300, help="seconds a lease lives without renewal")
    )
    max_sources: int | None = field(default=None, metadata=spec(ge=1, le=4096))
    worker_id: str | None = field(default=None, metadata=spec(check=_check_worker_id))
    replicas: int = field(
        default=1, metadata=spec(ge=1, le=5, help="copies of the fleet's KV buckets in a JetStream cluster")
    )


ClipEvent = Literal["track_start", "detection", "zone_enter", "zone_exit", "line_cross"]


@dataclass(frozen=True)
class FileOutputConfig:
    """``{type: file, path: "out/{source}.mp4"}``: every published frame of a source, as video."""

    type: Literal["file"]
    path: str = field(metadata=spec(help='"{source}" in it becomes the source id, e.g. out/{source}.mp4'))
    annotate: bool = field(default=True, metadata=spec(help="draw boxes, labels and tracks on the frames"))
    codec: str = field(default="libx264", metadata=spec(help="an FFmpeg video encoder, e.g. libx264"))
    crf: int = field(default=23, metadata=spec(ge=0, le=51, help="quality: lower is better and bigger"))
    sources: list[str] = field(default_factory=list, metadata=spec(help="source ids; all when empty"))


@dataclass(frozen=True)
class ClipsOutputConfig:
    """``{type: clips, dir: clips/}``: the camera's own packets around each event, not re-encoded."""

    type: Literal["clips"]
    dir: str = field(metadata=spec(help="folder the clips are written to, e.g. clips/"))
    pre_s: float = field(default=3.0, metadata=spec(ge=0, le=60, help="seconds kept before the event"))
    post_s: float = field(default=5.0, metadata=spec(gt=0, le=600, help="seconds recorded after it"))
    on: list[ClipEvent] = field(default_factory=lambda: ["track_start"])
    labels: list[str] = field(
        default_factory=list,
        metadata=spec(help="only objects with these labels start a clip; all when empty"),
    )
    max_size_mb: float = field(default=1024.0, metadata=spec(gt=0, help="oldest clips go beyond this total"))
    max_age_h: float = field(default=24.0, metadata=spec(gt=0, help="clips older than this are deleted"))
    sources: list[str] = field(default_factory=list, metadata=spec(help="source ids; all when empty"))


OutputConfig = FileOutputConfig | ClipsOutputConfig
OUTPUT_TYPES: dict[str, type[FileOutputConfig] | type[ClipsOutputConfig]] = {
    "file": FileOutputConfig,
    "clips": ClipsOutputConfig,
}


@dataclass(frozen=True)
class PipelineConfig:
    """A whole pipeline file."""

    pipeline: str = field(metadata=spec(check=check_name, help=NAME_HELP))
    sources: list[SourceConfig] = field(default_factory=list)
    # Each entry is its kind's options (InferOptions, TrackOptions, ...; see pipeline.stages.registry).
    stages: list[StageOptions] = field(default_factory=list)
    models: str | None = field(default=None, metadata=spec(help="model repository folder"))
    nats: NatsConfig = field(default_factory=NatsConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    http: HttpConfig | None = None
    # Sources shared with other workers through JetStream (pipeline.fleet); None: run them all here.
    fleet: FleetConfig | None = None
    # Annotated recordings and event clips (FileOutputConfig, ClipsOutputConfig; pipeline.outputs).
    outputs: list[OutputConfig] = field(default_factory=list)
    # Where the file lives; relative paths in it resolve against this.
    base_dir: str = field(default=".", metadata=spec(help="set by the loader"))
    file: str = field(default="<config>", metadata=spec(help="set by the loader"))
    # The line of every key in the file (``stages[1].model`` -> 14), for errors found later.
    lines: dict[str, int] = field(default_factory=dict, metadata=spec(help="set by the loader"))

    def models_path(self) -> Path | None:
        if self.models is None:
            return None
        return (Path(self.base_dir) / self.models).resolve()

    def stage(self, name: str) -> StageOptions:
        return next(s for s in self.stages if s.name == name)

    def line(self, key: str) -> int | None:
        """The line of ``key`` (``models``, ``stages[1].model``) in the file, when known."""
        return self.lines.get(key)

    def models_used(self) -> list[str]:
        """Every model a stage runs, sorted."""
        return sorted({m for s in self.stages for m in s.models()})


def _unique_ids(sources: list[SourceConfig]) -> list[SourceConfig]:
    """Fill in missing ids from the URL; a clash with another id gets a ``_2``, ``_3`` suffix."""
    used = {s.id for s in sources if s.id}
    out = []
    for src in sources:
        if src.id is None:
            base = sid = derive_id(src.url)
            n = 1
            while sid in used:
                n += 1
                sid = f"{base}_{n}"
            used.add(sid)
            src = replace(src, id=sid)
        out.append(src)
    return out


def _check_graph(cfg: PipelineConfig, raw: Any, file: str) -> None:
    """Whole-graph checks that single fields cannot express."""

    def err(path: str, line: int | None, problem: str, hint: str = "") -> ConfigError:
        return ConfigError(file, line, path, problem, hint)

    raw_sources = raw.get("sources") if isinstance(raw, dict) else None
    ids: dict[str, int] = {}
    for i, src in enumerate(cfg.sources):
        line = line_of(raw_sources, i) if raw_sources is not None else None
        sid = src.source_id
        if sid in ids:
            raise err(
                f"sources[{i}].id", line, f"duplicate source id {sid!r}", "give each source a unique id"
            )
        ids[sid] = i
    limit = cfg.runtime.max_sources
    if len(cfg.sources) > limit:
        line = line_of(raw_sources, limit) if raw_sources is not None else None
        raise err(
            "sources",
            line or cfg.line("runtime.max_sources") or line_of(raw),
            f"{len(cfg.sources)} sources, more than runtime.max_sources ({limit})",
            "run fewer sources per process, or raise runtime.max_sources",
        )

    raw_stages = raw.get("stages") if isinstance(raw, dict) else None
    kinds = stage_kinds()
    seen: dict[str, StageOptions] = {}
    for i, stage in enumerate(cfg.stages):
        item = raw_stages[i] if raw_stages is not None else None
        path = f"stages[{i}]"

        def at(key: str, _item: Any = item, _path: str = path) -> tuple[str, int | None]:
            return f"{_path}.{key}", line_of(_item, key) or line_of(_item)

        if stage.name in seen:
            raise err(*at("name"), f"duplicate stage name {stage.name!r}", "stage names must be unique")
        for key, problem in stage.problems():
            raise err(*at(key), problem)
        for ref_key, ref in stage.references().items():
            if ref not in seen:
                later = any(s.name == ref for s in cfg.stages)
                hint = (
                    "stages run in order: move it after the stage it refers to"
                    if later
                    else "name an earlier stage: " + (", ".join(seen) or "(none)")
                )
                raise err(*at(ref_key), f"unknown stage {ref!r}", hint)
            if not kinds[seen[ref].type].finds_objects:
                raise err(*at(ref_key), f"stage {ref!r} is a {seen[ref].type} stage and finds no objects")
        seen[stage.name] = stage
    if cfg.models is None and cfg.models_used():
        raise err("models", line_of(raw), "infer stages need a model repository", "add models: <folder>")


def _build_stages(raw: Any, file: str) -> list[StageOptions]:
    """Each ``stages[]`` entry validated against the options of its ``type``."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ConfigError(file, line_of(raw), "stages", f"expected a list, got {type(raw).__name__}")
    kinds = stage_kinds()
    # Keys some kind takes: on another kind they are misplaced, not misspelled.
    known = {f.name: k for k, cls in kinds.items() for f in dataclasses.fields(cls.options_type)}
    out = []
    for i, item in enumerate(raw):
        path = f"stages[{i}]"
        line = line_of(raw, i)
        if not isinstance(item, dict):
            raise ConfigError(file, line, path, "expected a mapping", "e.g. {name: detect, type: infer}")
        kind = item.get("type")
        if kind is None:
            raise ConfigError(file, line, path, "missing required key 'type'", " or ".join(kinds))
        cls = kinds.get(kind) if isinstance(kind, str) else None
        if cls is None:
            close = difflib.get_close_matches(str(kind), list(kinds), n=1)
            hint = f"did you mean {close[0]!r}?" if close else ""
            choices = ", ".join(repr(k) for k in kinds)
            raise ConfigError(
                file,
                line_of(item, "type") or line,
                f"{path}.type",
                f"expected one of {choices}, got {kind!r}",
                hint,
            )
        takes = [f.name for f in dataclasses.fields(cls.options_type)]
        for key in item:
            if key not in takes and key in known:
                raise ConfigError(
                    file, line_of(item, key) or line, f"{path}.{key}",
                    f"does not apply to a stage of type {kind}", f"type {kind} takes: {', '.join(takes)}",
                )  # fmt: skip
        out.append(build(item, cls.options_type, file, path=path))
    return out


def _build_outputs(raw: Any, file: str) -> list[OutputConfig]:
    """Each ``outputs[]`` entry validated against the options of its ``type``."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ConfigError(file, line_of(raw), "outputs", f"expected a list, got {type(raw).__name__}")
    out: list[OutputConfig] = []
    for i, item in enumerate(raw):
        path = f"outputs[{i}]"
        line = line_of(raw, i)
        if not isinstance(item, dict):
            raise ConfigError(
                file, line, path, "expected a mapping", 'e.g. {type: file, path: "out/{source}.mp4"}'
            )
        kind = item.get("type")
        cls = OUTPUT_TYPES.get(kind) if isinstance(kind, str) else None
        if cls is None:
            choices = " or ".join(repr(k) for k in OUTPUT_TYPES)
            problem = "missing required key 'type'" if kind is None else f"expected {choices}, got {kind!r}"
            raise ConfigError(file, line_of(item, "type") or line, f"{path}.type", problem, choices)
        out.append(build(item, cls, file, path=path))
    return out


def _key_lines(node: Any, path: str = "") -> dict[str, int]:
    """``path -> line`` for every key and list item of parsed YAML."""
    out: dict[str, int] = {}
    if isinstance(node, dict):
        for key, value in node.items():
            child = f"{path}.{key}" if path else str(key)
            line = line_of(node, key)
            if line:
                out[child] = line
            out.update(_key_lines(value, child))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            child = f"{path}[{i}]"
            line = line_of(node, i)
            if line:
                out[child] = line
            out.update(_key_lines(value, child))
    return out


def load_config(
    path: str | Path,
    *,
    sources: list[str] | None = None,
) -> PipelineConfig:
    """Read, validate and resolve a pipeline file.

    ``sources`` (from ``vidpipe run --source``) replaces the file's sources.
    """
    p = Path(path)
    raw = load_yaml(p)
    file = str(path)
    if isinstance(raw, dict):
        for key in ("base_dir", "file", "lines"):
            if key in raw:
                raise ConfigError(file, line_of(raw, key), key, "unknown key", "this is set by vidpipe")
    # Stages are validated per kind (each kind declares its own keys), the rest as one dataclass.
    top = raw
    # Outputs likewise: each type has its own keys.
    own = ("stages", "outputs")
    if isinstance(raw, dict) and any(k in raw for k in own):
        top = LineDict((k, v) for k, v in raw.items() if k not in own)
        top.line, top.key_lines = getattr(raw, "line", 1), getattr(raw, "key_lines", {})
    cfg = build(top, PipelineConfig, file)
    cfg = replace(
        cfg,
        stages=_build_stages(raw.get("stages"), file),
        outputs=_build_outputs(raw.get("outputs"), file),
        lines=_key_lines(raw),
    )
    if sources is not None:
        for u in sources:
            problem = check_url(u)
            if problem:
                raise ConfigError("--source", None, "", problem, "use a file, test://, rtsp:// or whip://")
        cwd = Path.cwd()
        cfg = replace(cfg, sources=[SourceConfig(url=resolve_url(u, cwd)) for u in sources])
    else:
        base = p.parent.resolve()
        cfg = replace(cfg, sources=[replace(s, url=resolve_url(s.url, base)) for s in cfg.sources])
    cfg = replace(cfg, sources=_unique_ids(cfg.sources), base_dir=str(p.parent.resolve()), file=file)
    _check_graph(cfg, raw, file)
    return cfg
