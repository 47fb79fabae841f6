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

import contextlib
import dataclasses
import difflib
import logging
import os
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from inference.backends.inputs import check_input
from inference.batch_policy import BatchPolicy
from inference.config import ModelConfig
from inference.introspect import ModelIntrospectionError, fill_input_shape, metadata_labels, read_onnx
from inference.model import load_labels, resolve_model_file
from inference.processing.tasks import TASKS, ClassifyTask, create_task, finds_objects
from inference.processing.yolo import resolve_layout
from inference.repository import CONFIG_FILE, read_source
from inference.schema import ConfigError, LineDict, build, line_of, load_yaml, raise_errors, shown, spec
from pipeline.names import NAME_HELP, check_name
from pipeline.redact import redact_url
from pipeline.sources.schemes import SCHEME_OPTIONS, SCHEMES, resolve_live, scheme_of, url_check
from pipeline.stages.base import StageOptions
from pipeline.stages.registry import stage_kinds
from pipeline.urls import derive_id, missing_file, normalise_url, resolve_url, scheme_name, whip_name
from pipeline.webrtc_guard import parse_network

log = logging.getLogger("vidpipe.config")

# 8K UHD: the largest picture any camera or clip in scope sends. A frame over it is
# refused before a buffer is allocated (a 16384x8192 clip of a few hundred KB would
# otherwise take gigabytes of frame pool).
MAX_PIXELS = 7680 * 4320
# Seconds: the shortest wait between reconnect attempts config or API may ask for.
MIN_RECONNECT_DELAY = 0.1
# Seconds: the longest timeout or reconnect delay a source may ask for; a thread must
# never be handed one that overflows (1e300 did).
MAX_SOURCE_SECONDS = 3600
# Frames per second: the highest max_fps a source may ask for.
MAX_SOURCE_FPS = 1000


def _placeholder_problem(path: str, known: tuple[str, ...]) -> tuple[str, str] | None:
    """A ``{name}`` in an output path that is not filled in (it would stay in the file name)."""
    for name in re.findall(r"\{([^{}]*)\}", path):
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = (
                f"did you mean {{{close[0]}}}?"
                if close
                else f"it takes {', '.join('{' + k + '}' for k in known)}"
            )
            return (f"{{{name}}} is not a placeholder vidpipe fills in", hint)
    return None


def _url_problem(url: str) -> tuple[str, str] | None:
    """The url field's check: the problem with its own hint (never the field's example,
    which would not fit a bad test:// parameter or a whip:// name)."""
    if not url.strip():
        return ("the URL is empty", "e.g. samples/clip.mp4 or rtsp://cam/stream")
    problem = url_check(url)
    return (problem.problem, problem.hint) if problem else None


@dataclass(frozen=True)
class ReconnectConfig:
    """Backoff between reconnect attempts of a live source: ``min_delay * 2**n`` capped, with jitter.

    Both delays are at least :data:`MIN_RECONNECT_DELAY`: a camera that refuses at
    once would otherwise be hammered (``min_delay: 1e-300`` made 10,624
    connections in 10 s).
    """

    min_delay: float = field(
        default=0.5,
        metadata=spec(ge=MIN_RECONNECT_DELAY, le=MAX_SOURCE_SECONDS, help="seconds, at least 0.1"),
    )
    max_delay: float = field(
        default=10.0,
        metadata=spec(ge=MIN_RECONNECT_DELAY, le=MAX_SOURCE_SECONDS, help="seconds, at least 0.1"),
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
    ``rtsp://``, ``whip://<id>``, ``http(s)://``, ``udp://``, ``rtp://``, ``srt://``,
    ``/dev/videoN`` or ``v4l2://`` (docs/sources.md).
    """

    url: str = field(metadata=spec(check=_url_problem, help="e.g. samples/clip.mp4 or rtsp://cam/stream"))
    id: str | None = field(default=None, metadata=spec(check=check_name, help=NAME_HELP))
    loop: bool = False
    realtime: bool = field(
        default=False, metadata=spec(help="pace files at their frame rate; default: as fast as possible")
    )
    max_fps: float | None = field(
        default=None, metadata=spec(gt=0, le=MAX_SOURCE_FPS, help="drop frames above this rate")
    )
    queue_size: int = field(default=8, metadata=spec(ge=1, le=1024))
    max_pixels: int = field(
        default=MAX_PIXELS,
        metadata=spec(ge=1, help="largest frame (width x height) accepted; default 8K UHD, 7680x4320"),
    )
    transport: Literal["tcp", "udp"] = "tcp"
    open_timeout: float = field(default=10.0, metadata=spec(gt=0, le=MAX_SOURCE_SECONDS))
    read_timeout: float = field(default=5.0, metadata=spec(gt=0, le=MAX_SOURCE_SECONDS))
    stall_timeout: float = field(default=5.0, metadata=spec(gt=0, le=MAX_SOURCE_SECONDS))
    reconnect: ReconnectConfig = field(default_factory=ReconnectConfig)
    allow_redirects: bool = field(
        default=False,
        metadata=spec(help="RTSP: follow a redirect to another host, credentials and all"),
    )
    decode: Literal["cpu", "cuda", "auto"] = field(
        default="cpu",
        metadata=spec(help="cuda decodes on the GPU (NVDEC); auto tries it and falls back to cpu"),
    )
    # Filled in from the URL when not given, so it is a bool on every built config.
    live: bool | None = field(
        default=None,
        metadata=spec(help="http(s) only: true for a stream, false for a file; default: .mp4 etc. are files"),
    )
    tls_verify: bool = field(
        default=True, metadata=spec(help="https: check the server's certificate against the system's CAs")
    )

    def __post_init__(self) -> None:
        if SCHEMES.get(self.scheme_name) is None:
            return  # an unknown scheme: the url check has refused it already
        # Live sources drop the oldest frame when behind and reconnect; files block (lossless).
        object.__setattr__(self, "live", resolve_live(self.url, self.live))

    @property
    def scheme_name(self) -> str:
        try:
            return scheme_of(self.url).name
        except ValueError:
            return ""

    @property
    def scheme(self) -> str:
        return scheme_of(self.url).name

    @property
    def source_id(self) -> str:
        assert self.id is not None, "source ids are filled in by load_config"
        return self.id


# The schemes the NATS client connects with (TLS: tls://; websockets: ws://, wss://).
NATS_SCHEMES = ("nats", "tls", "ws", "wss")


def nats_url_problem(urls: str | list[str]) -> tuple[str, str] | None:
    """Why a NATS server URL (or each of a list) cannot be connected to, with a hint; None if fine."""
    for url in [urls] if isinstance(urls, str) else urls:
        # HOST:PORT alone is a nats:// URL to the client.
        scheme = url.split("://", 1)[0].lower() if "://" in url else "nats"
        if scheme not in NATS_SCHEMES:
            return (
                f"{redact_url(url)!r} is not a NATS server URL",
                f"use {', '.join(s + '://' for s in NATS_SCHEMES)}, e.g. nats://127.0.0.1:4222",
            )
    return None


def _subject_prefix_problem(value: str) -> str | None:
    if value == "_INBOX":
        # Where NATS clients get their request replies (JetStream acks among them).
        return "_INBOX is where NATS clients receive replies; choose another prefix"
    return check_name(value)


@dataclass(frozen=True)
class NatsConfig:
    """Where detections go. No ``url`` (and no ``servers``) starts an embedded nats-server on loopback.

    ``servers`` lists several seed URLs of one cluster (the client tries each and
    learns the rest from the server): ``servers: [nats://n1:4222, nats://n2:4222]``.
    """

    url: str | None = field(default=None, metadata=spec(check=nats_url_problem))
    servers: list[str] = field(default_factory=list, metadata=spec(check=nats_url_problem))
    publish: Literal["core", "jetstream"] = "core"
    subject_prefix: str = field(default="vidpipe", metadata=spec(check=_subject_prefix_problem))
    outbox_size: int = field(default=1000, metadata=spec(ge=1))
    port: int | None = field(
        default=None,
        metadata=spec(ge=1, le=65535, help="the embedded server's port (no url); default 4222 when free"),
    )
    # The JetStream stream vidpipe makes: without limits it would fill the server's disk.
    stream_max_age: float = field(
        default=86400.0, metadata=spec(ge=0, help="seconds a message is kept in the stream; 0: no limit")
    )
    stream_max_bytes: int = field(
        default=1 << 30, metadata=spec(ge=0, help="bytes the stream keeps, oldest dropped first; 0: no limit")
    )
    # Off by default: a consumer of vidpipe.<pipeline>.> that takes every message there for
    # detections, events or clips would otherwise meet a fourth kind.
    status: bool = field(
        default=False,
        metadata=spec(
            help="publish each source's up, down, failed and stopped to vidpipe.<pipeline>.<source>.status"
        ),
    )


@dataclass(frozen=True)
class RuntimeConfig:
    """Flow limits."""

    max_in_flight: int | None = field(
        default=None,
        metadata=spec(
            ge=1, le=256, help="frames of one source processed at once; unset: from instances and sources"
        ),
    )
    admission: Literal["paced", "eager"] = field(
        default="paced",
        metadata=spec(
            help="paced: a frame enters the graph as the detector is about to be free; eager: once a slot is"
        ),
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


# What POST /v1/sources accepts unless http.source_schemes says otherwise: every
# scheme but webcams (a device of this host; a config file names those). Files are
# also held to http.file_roots, which is empty by default.
API_SOURCE_SCHEMES = ("file", "test", "rtsp", "rtsps", "whip", "http", "https", "udp", "rtp", "srt")


def _web_origins(origins: list[str]) -> str | None:
    for origin in origins:
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
            return f"{origin!r} is not a web origin (scheme://host[:port], e.g. https://intranet.example)"
    return None


def _check_networks(ranges: list[str]) -> str | None:
    bad = [r for r in ranges if parse_network(r) is None]
    if bad:
        return f"{bad[0]!r} is not an address range (CIDR, e.g. 192.168.1.0/24 or fd00::/8)"
    return None


def _known_schemes(names: list[str]) -> str | None:
    unknown = [n for n in names if n not in SCHEMES]
    if unknown:
        return f"unknown source scheme {unknown[0]!r}; known: {', '.join(SCHEMES)}"
    return None


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
    max_connections_per_client: int = field(
        default=64, metadata=spec(ge=1, le=65536, help="open connections from one client address at once")
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
    source_schemes: list[str] = field(
        default_factory=lambda: list(API_SOURCE_SCHEMES),
        metadata=spec(check=_known_schemes, help="URL schemes POST /v1/sources accepts"),
    )
    allowed_origins: list[str] = field(
        default_factory=list,
        metadata=spec(
            check=_web_origins, help="pages (scheme://host[:port]) that may embed MJPEG views and snapshots"
        ),
    )
    ice_networks: list[str] | None = field(
        default=None,
        metadata=spec(
            check=_check_networks,
            help="address ranges a WHIP/WHEP offer's ICE candidates may name; default: those of listen",
        ),
    )
    max_pending_webrtc_per_client: int = field(
        default=4, metadata=spec(ge=1, le=1024, help="WHIP/WHEP sessions per client not yet connected")
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
          lease_ttl: 12          # seconds; a dead worker's sources move after about this long
          max_sources: 16        # sources this worker runs at most; default runtime.max_sources
          worker_id: cam-host-1  # default: <hostname>-<pid>
          replicas: 3            # copies of the fleet's buckets (a 3-node JetStream cluster)
          max_desired: 4096      # sources the fleet's desired set holds at most
    """

    name: str = field(metadata=spec(check=check_name, help=NAME_HELP))
    lease_ttl: float = field(
        default=12.0, metadata=spec(ge=1, le=300, help="seconds a lease lives without renewal")
    )
    max_sources: int | None = field(default=None, metadata=spec(ge=1, le=4096))
    worker_id: str | None = field(default=None, metadata=spec(check=_check_worker_id))
    replicas: int = field(
        default=1, metadata=spec(ge=1, le=5, help="copies of the fleet's KV buckets in a JetStream cluster")
    )
    max_desired: int = field(
        default=4096, metadata=spec(ge=1, le=65536, help="sources the fleet's desired set holds at most")
    )


ClipEvent = Literal["track_start", "detection", "zone_enter", "zone_exit", "line_cross"]


def encoder_problem(codec: str) -> tuple[str, str] | None:
    """Why ``codec`` cannot encode video here (FFmpeg has no such video encoder), with a hint."""
    import av

    try:
        found = av.codec.Codec(codec, "w")
    except Exception:  # UnknownCodecError, or a name FFmpeg cannot parse
        found = None
    if found is None or found.type != "video":
        return f"FFmpeg has no video encoder {codec!r}", "e.g. libx264 (H.264), libx265, mpeg4 or libvpx-vp9"
    return None


@dataclass(frozen=True)
class FileOutputConfig:
    """``{type: file, path: "out/{source}.mp4"}``: every published frame of a source, as video."""

    type: Literal["file"]
    path: str = field(
        metadata=spec(
            check=lambda path: _placeholder_problem(path, ("source", "start")),
            help='"{source}" in it becomes the source id, e.g. out/{source}.mp4',
        )
    )
    annotate: bool = field(default=True, metadata=spec(help="draw boxes, labels and tracks on the frames"))
    codec: str = field(
        default="libx264", metadata=spec(check=encoder_problem, help="an FFmpeg video encoder, e.g. libx264")
    )
    crf: int = field(default=23, metadata=spec(ge=0, le=51, help="quality: lower is better and bigger"))
    sources: list[str] = field(default_factory=list, metadata=spec(help="source ids; all when empty"))


@dataclass(frozen=True)
class ClipsOutputConfig:
    """``{type: clips, dir: clips/}``: the camera's own packets around each event, not re-encoded."""

    type: Literal["clips"]
    dir: str = field(
        metadata=spec(
            check=lambda path: _placeholder_problem(path, ("source",)),
            help="folder the clips are written to, e.g. clips/",
        )
    )
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
    base_dir: str = field(default=".", metadata={"yaml": False})
    file: str = field(default="<config>", metadata={"yaml": False})
    # The line of every key in the file (``stages[1].model`` -> 14), for errors found later.
    lines: dict[str, int] = field(default_factory=dict, metadata={"yaml": False})

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


class SchemeKeyError(ConfigError):
    """A key that another scheme takes on a source whose scheme does not (``transport:`` on a file)."""


class SourceRefused(ConfigError):
    """A source that is well formed but that this door does not allow: a scheme
    ``http.source_schemes`` leaves out, a file outside ``http.file_roots`` (HTTP 403)."""


@dataclass(frozen=True)
class SourcePolicy:
    """Which sources a door lets in. The default (a config file, ``--source``, embedding)
    allows every scheme and every path; :meth:`from_http` is the API's and the fleet's."""

    # None: every scheme.
    schemes: tuple[str, ...] | None = None
    # None: any path; else absolute folders a file source must lie in.
    file_roots: tuple[Path, ...] | None = None

    @classmethod
    def from_http(cls, http: HttpConfig | None, base_dir: str | Path) -> SourcePolicy:
        """What ``POST /v1/sources`` (and so the fleet's desired set) may hold: ``http.source_schemes``
        and ``http.file_roots`` (relative to ``base_dir``), their defaults without ``http:``."""
        http = http or HttpConfig()
        base = Path(base_dir)
        return cls(tuple(http.source_schemes), tuple((base / root).resolve() for root in http.file_roots))

    def refusal(self, config: SourceConfig, file: str, path: str) -> SourceRefused | None:
        """Why this policy refuses a built source, or None."""
        if self.schemes is not None and config.scheme not in self.schemes:
            # Config files may name any scheme; over the API a caller reaches only these.
            allowed = ", ".join(self.schemes) or "none"
            return SourceRefused(
                file,
                None,
                f"{path}.url",
                f"{config.scheme}:// sources cannot be added over the API "
                f"(http.source_schemes allows: {allowed})",
            )
        if self.file_roots is not None and config.scheme == "file":
            # Decided on the path alone, before anything looks at the file: a caller
            # learns nothing about which paths exist outside the roots.
            where = Path(config.url).resolve()
            if not any(where.is_relative_to(root) for root in self.file_roots):
                return SourceRefused(
                    file,
                    None,
                    f"{path}.url",
                    "files can be added over the API only from the folders in http.file_roots",
                    # Which folders is the operator's business; that there are none is the
                    # usual first-day surprise.
                    ""
                    if self.file_roots
                    else "it lists none: add a folder to http.file_roots in the pipeline file",
                )
        return None


# Keys some scheme takes and others do not (SCHEME_OPTIONS); every source takes the rest.
_SCHEME_KEYS = {key for keys in SCHEME_OPTIONS.values() for key in keys}
# Integers beyond this are no timeout, size or count anything could use; converting
# one to float overflows (a 400-digit queue_size or timeout).
_MAX_INT = 2**63 - 1


def _scheme_key_errors(item: dict[str, Any], url: str, path: str, file: str) -> list[ConfigError]:
    """Keys some scheme takes on a source whose scheme does not (``transport:`` on a file)."""
    scheme = scheme_name(url)
    takes = SCHEME_OPTIONS.get(scheme)
    if takes is None:
        return []
    common = [f.name for f in dataclasses.fields(SourceConfig) if f.name not in _SCHEME_KEYS]
    return [
        SchemeKeyError(
            file,
            line_of(item, key) or line_of(item),
            f"{path}.{key}",
            f"does not apply to a {scheme} source",
            f"a {scheme} source takes: {', '.join(common + list(takes))}",
        )
        for key in item
        if key in _SCHEME_KEYS and key not in takes
    ]


def _live_refused(url: str, live: Any) -> bool:
    """Whether ``live:`` is a value the URL's scheme cannot be (the build refuses it)."""
    if not isinstance(live, bool):
        return False
    try:
        resolve_live(url, live)
    except ValueError:
        return True
    return False


def parse_source(
    data: Any,
    *,
    base_dir: str | Path,
    taken_ids: Collection[str] = (),
    policy: SourcePolicy = SourcePolicy(),
    file: str = "<source>",
    path: str = "sources",
) -> SourceConfig:
    """One source, as a config file, ``--source``, ``POST /v1/sources``, embedding and the
    fleet's desired set give it (a mapping, the YAML keys), checked the same way for all::

        {url: rtsp://cam-7/stream, id: cam-7, transport: tcp, reconnect: {min_delay: 1}}

    Types and bounds, numbers that are finite and in range, the URL (a webcam path
    normalised, its scheme known, with a did-you-mean), keys of another scheme;
    then a relative file path is resolved against ``base_dir``, ``policy`` is
    applied (:class:`SourceRefused`), and a missing id is derived from the URL,
    unique among ``taken_ids``. An explicit id that is taken is the caller's to
    refuse. Every problem is raised at once (:class:`~inference.schema.ConfigErrors`),
    each as ``FILE:LINE: path.key: problem (hint)``.
    """
    if not isinstance(data, dict):
        build(data, SourceConfig, file, path=path)  # says what a source should be
        raise AssertionError("unreachable: build refuses a source that is not a mapping")
    url = data.get("url")
    item: Any = data
    if isinstance(url, str) and normalise_url(url) != url:
        item = LineDict(data)
        item.line, item.key_lines = line_of(data), getattr(data, "key_lines", {})
        item["url"] = url = normalise_url(url)
    found = url_check(url) if isinstance(url, str) else None
    errors: list[ConfigError] = []
    if isinstance(url, str) and found is None:
        # A key of another scheme is an error, but the source is still checked further.
        errors.extend(
            err
            for err in _scheme_key_errors(item, url, path, file)
            # A `live:` the scheme cannot be is the build's to say, in better words
            # ("file sources are never live"): one line, not two.
            if err.path != f"{path}.live" or not _live_refused(url, item["live"])
        )
    config: SourceConfig | None = None
    try:
        config = build(item, SourceConfig, file, path=path)
    except ConfigError as exc:
        # The url's own hint (a did-you-mean, how to encode a password) says more than the field's.
        for err in exc.errors:
            if err.path == f"{path}.url" and found is not None and found.hint:
                err = ConfigError(err.file, err.line, err.path, err.problem, found.hint)
            errors.append(err)
    raise_errors(errors)
    assert config is not None, "a source that did not build has errors"
    config = replace(config, url=resolve_url(config.url, Path(base_dir)))
    refused = policy.refusal(config, file, path)
    if refused is not None:
        raise refused
    if policy.file_roots is not None and config.scheme == "file":
        config = replace(config, url=str(Path(config.url).resolve()))
    if config.id is None:
        base = sid = derive_id(config.url)
        n = 1
        while sid in taken_ids:
            n += 1
            sid = f"{base}_{n}"
        config = replace(config, id=sid)
    return config


def source_keys(data: dict[str, Any]) -> dict[str, Any]:
    """A source's keys (``dataclasses.asdict`` of a :class:`SourceConfig`, or a stored copy of
    one) without those at their default, ``live`` included when the URL implies it: what
    a store keeps, so that reading it back is the same :func:`parse_source` as a config file
    (a file source stored with ``transport: tcp`` would be a key of another scheme)."""
    # Every field's default (``live`` is filled in from the URL at construction; its default is None).
    defaults = {**dataclasses.asdict(SourceConfig(url="")), "live": None}
    del defaults["url"], defaults["id"]
    out = {k: v for k, v in data.items() if k not in defaults or v != defaults[k]}
    url = data.get("url")
    if isinstance(url, str) and isinstance(out.get("live"), bool) and url_check(url) is None:
        with contextlib.suppress(ValueError):
            if resolve_live(url, None) == out["live"]:
                del out["live"]
    return out


def _check_graph(
    cfg: PipelineConfig,
    raw: Any,
    file: str,
    stages: list[tuple[int, StageOptions]],
    source_index: list[int],
    outputs: list[tuple[int, OutputConfig]],
    unchecked: Collection[int] = (),
    replaced: Collection[str] = (),
) -> list[ConfigError]:
    """Whole-graph checks that single fields cannot express.

    ``stages`` are the entries that built, with their index in the file; one that
    did not build is already an error, and references to it are not reported again.
    The stages at ``unchecked`` indexes stand in for entries with a wrong key their
    ``problems()`` read, which are not run; ``replaced`` are the top-level keys that
    were wrong (the checks that read one are skipped). ``outputs`` are those that
    built, with their index.
    """
    errors: list[ConfigError] = []

    def err(path: str, line: int | None, problem: str, hint: str = "") -> None:
        errors.append(ConfigError(file, line, path, problem, hint))

    raw_sources = raw.get("sources") if isinstance(raw, dict) else None
    ids: dict[str, int] = {}
    whip_names: dict[str, int] = {}
    for i, src in zip(source_index, cfg.sources, strict=True):
        line = line_of(raw_sources, i) if raw_sources is not None else None
        sid = src.source_id
        if sid in ids:
            err(f"sources[{i}].id", line, f"duplicate source id {sid!r}", "give each source a unique id")
        ids[sid] = i
        if src.scheme == "whip":
            # Publishers reach a WHIP source by its name (/whip/<name>): a second one would never be reached.
            name = whip_name(src.url)
            if name in whip_names:
                err(
                    f"sources[{i}].url",
                    line,
                    f"whip name {name!r} is already used by sources[{whip_names[name]}]",
                    "give each WHIP source its own name: whip://door, whip://yard",
                )
            whip_names.setdefault(name, i)
    limit = cfg.runtime.max_sources
    if len(cfg.sources) > limit and not _replaced(replaced, "runtime.max_sources"):
        line = line_of(raw_sources, limit) if raw_sources is not None else None
        err(
            "sources",
            line or cfg.line("runtime.max_sources") or line_of(raw),
            f"{len(cfg.sources)} sources, more than runtime.max_sources ({limit})",
            "run fewer sources per process, or raise runtime.max_sources",
        )
    for i, out in outputs:
        if not isinstance(out, FileOutputConfig) or "{source}" in out.path:
            continue
        recorded = [s.source_id for s in cfg.sources if not out.sources or s.source_id in out.sources]
        if len(recorded) > 1:
            # One name for several recordings: each would get .1, .2 in the order they
            # happened to start, and only the log would say which is which.
            shown = ", ".join(recorded[:4]) + (", ..." if len(recorded) > 4 else "")
            stem, dot, suffix = out.path.rpartition(".")
            example = f"{stem}-{{source}}.{suffix}" if dot else f"{out.path}-{{source}}"
            err(
                f"outputs[{i}].path",
                cfg.line(f"outputs[{i}].path") or cfg.line(f"outputs[{i}]"),
                f"{len(recorded)} sources ({shown}) would record to the one file {out.path!r}",
                f"put {{source}} in the path, e.g. {example}, or name one source in outputs[{i}].sources",
            )

    raw_stages = raw.get("stages") if isinstance(raw, dict) else None
    unbuilt = {
        item.get("name")
        for item in (raw_stages if isinstance(raw_stages, list) else [])
        if isinstance(item, dict) and not any(s.name == item.get("name") for _, s in stages)
    }
    kinds = stage_kinds()
    seen: dict[str, StageOptions] = {}
    for i, stage in stages:
        item = raw_stages[i] if isinstance(raw_stages, list) else None
        path = f"stages[{i}]"

        def at(key: str, _item: Any = item, _path: str = path) -> tuple[str, int | None]:
            # A nested key (zones[0].polygon) has its own line in the file, as a top-level one.
            full = f"{_path}.{key}"
            return full, cfg.line(full) or line_of(_item, key) or line_of(_item)

        if stage.name in seen:
            err(*at("name"), f"duplicate stage name {stage.name!r}", "stage names must be unique")
        after = [s for j, s in stages if j > i]
        for key, problem in [
            *(stage.problems() if i not in unchecked else []),
            *stage.order_problems(list(seen.values())),
            *stage.later_problems(after),
        ]:
            err(*at(key), problem)
        for ref_key, ref in stage.references().items():
            if ref not in seen:
                if ref in unbuilt:
                    continue
                later = any(s.name == ref for _, s in stages)
                hint = (
                    "stages run in order: move it after the stage it refers to"
                    if later
                    else "name an earlier stage: " + (", ".join(seen) or "(none)")
                )
                err(*at(ref_key), f"unknown stage {ref!r}", hint)
            elif not kinds[seen[ref].type].finds_objects:
                # What to name instead: the infer stages before this one.
                infer = ", ".join(n for n, s in seen.items() if s.type == "infer")
                if ref_key == "upright_by":
                    problem = (
                        f"stage {ref!r} is a {seen[ref].type} stage: upright_by names the classifier "
                        "stage whose label says how to turn each crop"
                    )
                    hint = "a classifier stage with the same on: as this one"
                else:
                    problem = f"stage {ref!r} is a {seen[ref].type} stage and finds no objects"
                    hint = "an infer stage whose model finds objects (a detector)"
                where = f"name one of: {infer}" if infer else "add one before this stage"
                err(*at(ref_key), problem, f"{hint}; {where}")
        seen.setdefault(stage.name, stage)
    if cfg.models is None and cfg.models_used() and not _replaced(replaced, "models"):
        err("models", line_of(raw), "infer stages need a model repository", "add models: <folder>")
    return errors


# What a recording's file name may end in: the formats FFmpeg writes video to, by extension.
# Which of them a recording may use depends on its codec (.webm holds no H.264): see
# pipeline.outputs.video_file.format_problem.
RECORDING_SUFFIXES = (".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".ts", ".flv", ".nut")


def _recording_problem(out: FileOutputConfig) -> tuple[str, str] | None:
    """Why a recording's file cannot hold its codec's video: no video extension, or a
    format that refuses the codec (tried for real, so that run never finds out instead)."""
    from pipeline.outputs.video_file import format_problem

    suffix = Path(out.path).suffix.lower()
    known = suffix in RECORDING_SUFFIXES
    refused = format_problem(suffix, out.codec) if known else None
    if known and refused is None:
        return None
    # Only a refused file pays for trying the other endings (a trial is tens of ms).
    works = [s for s in RECORDING_SUFFIXES if format_problem(s, out.codec) is None]
    choices = (
        f"end it in one of {', '.join(works)}, e.g. out/{{source}}{works[0]}"
        if works
        else "choose another codec, e.g. codec: libx264"
    )
    if not known:
        return f"{out.path!r} does not end in a video file extension FFmpeg writes", choices
    hint = f"with codec {out.codec}, {choices}" if works else choices
    if suffix == ".webm":
        hint += ", or use codec: libvpx-vp9 (WebM holds VP8, VP9 and AV1 only)"
    return f"a {suffix} file cannot hold {out.codec} video: {refused}", hint


def _output_problem(cfg: PipelineConfig, out: OutputConfig) -> tuple[str, str] | None:
    """Why ``run`` could not write an output there (checked without making anything but a
    scratch file elsewhere): a file where its folder should be, a folder it may not write,
    a file name with no format, a format that cannot hold the codec."""
    template = out.path if isinstance(out, FileOutputConfig) else out.dir.rstrip("/") + "/x"
    if isinstance(out, FileOutputConfig) and (unrecordable := _recording_problem(out)) is not None:
        return unrecordable
    # The folder up to the first placeholder; what follows is made per source.
    fixed = template.split("{", 1)[0]
    folder = Path(cfg.base_dir) / fixed.rsplit("/", 1)[0] if "/" in fixed else Path(cfg.base_dir)
    for parent in (folder, *folder.parents):
        if parent.exists():
            if not parent.is_dir():
                return (f"{parent} is a file, not a folder", "choose another folder")
            if not os.access(parent, os.W_OK | os.X_OK):
                return (f"cannot write to {parent}: permission denied", "choose a folder vidpipe may write")
            return None
    return None


def missing_source_files(sources: list[SourceConfig], file: str, key: str, hint: str) -> list[ConfigError]:
    """A ConfigError for each file source that cannot be read (missing, a folder, not a file),
    for sources given outside a config file (``--source``, ``add_source``): ``file`` and
    ``key`` (``sources[{i}]``) name where, ``hint`` says where relative paths start.

    Only files: a camera or stream URL is not tried, as a config file's is not.
    """
    errors = []
    for i, src in enumerate(sources):
        if src.scheme == "file" and (found := missing_file(Path(src.url))) is not None:
            problem, own_hint = found
            # The caller's hint says where relative paths start; a folder's own says what to do.
            chosen = hint if problem.startswith("file not found") else own_hint
            errors.append(ConfigError(file, None, key.format(i=i), problem, chosen))
    return errors


def _check_resources(
    cfg: PipelineConfig,
    stages: list[tuple[int, StageOptions]],
    source_index: list[int] | None,
    outputs: list[tuple[int, OutputConfig]],
    loose: Mapping[int, tuple[str, ...]] | None = None,
) -> list[ConfigError]:
    """What ``run`` would refuse once it looks outside the file: source files, the model
    repository, each model's own config.yaml, its model and labels files, and ``classes:``
    that no model's labels contain. Nothing is loaded.

    ``loose`` holds the models of entries left out of ``stages`` for a wrong key the graph's
    checks read (by index): each model's own files are still checked.
    """
    errors: list[ConfigError] = []

    def err(key: str, problem: str, hint: str = "") -> None:
        line = cfg.line(key) or cfg.line(key.rsplit(".", 1)[0]) or None
        errors.append(ConfigError(cfg.file, line, key, problem, hint))

    # Sources from the command line (source_index None) are not checked: run goes on
    # without a missing one, as with a camera that is down.
    if source_index is not None:
        for i, src in zip(source_index, cfg.sources, strict=True):
            if src.scheme == "file" and (missing := missing_file(Path(src.url))) is not None:
                err(f"sources[{i}].url", *missing)
    for i, out in outputs:
        unwritable = _output_problem(cfg, out)
        if unwritable is not None:
            key = f"outputs[{i}].path" if isinstance(out, FileOutputConfig) else f"outputs[{i}].dir"
            err(key, *unwritable)
    used = {name: i for i, s in reversed(stages) for name in s.models()}
    for i, names in (loose or {}).items():
        for name in names:
            used[name] = min(i, used.get(name, i))
    root = cfg.models_path()
    if not used or root is None:
        return errors
    if not root.is_dir():
        err(
            "models", f"repository folder {root} not found", "relative paths start at the folder of this file"
        )
        return errors
    # Task kind and labels of each model read, for checks across models (track classes);
    # the class numbers of those that have no labels.
    read: dict[str, tuple[str, list[str]]] = {}
    numbered: dict[str, list[str]] = {}
    for name, i in sorted(used.items(), key=lambda kv: kv[1]):
        hint = missing_model_hint(root, name)
        if hint is not None:
            err(f"stages[{i}].model", f"model {name!r} is not in the repository {root}", hint)
            continue
        try:
            model = read_source(root, name)
            path = resolve_model_file(model.config, model.model_dir, model.version_dir)
            found = load_labels(model.config, model.model_dir)
        except ConfigError as exc:
            errors.extend(exc.errors)
            continue
        read[name] = (model.config.task.kind, found)
        # Other models name their classes inside the model file, which validation does not open,
        # unless it is an ONNX file that names none: then its classes are numbers.
        numbers = numbered_classes(model.config, path) if not found else None
        if numbers is not None:
            numbered[name] = numbers
        for key, problem, hint in model_misfits(
            stages, name, model.config.task.kind, found, class_numbers=numbers
        ):
            err(key, problem, hint)
        errors.extend(_output_misfits(model.config, path, found))
        # Settings the model ignores: the pipeline still runs as meant otherwise, so a
        # warning (validate's log on stderr), not an error.
        for key, problem, hint in model_warnings(stages, name, model.config):
            line = cfg.line(key) or cfg.line(key.rsplit(".", 1)[0]) or None
            log.warning("%s", ConfigError(cfg.file, line, key, problem, hint).render())
    for key, problem, hint in track_misfits(stages, read, numbered=numbered):
        err(key, problem, hint)
    return errors


def _output_misfits(config: ModelConfig, path: Path, labels: list[str]) -> list[ConfigError]:
    """An ONNX model that is not one, whose input the config does not fit (``input.shape``,
    ``max_batch_size``), or whose outputs its ``task:`` cannot decode (a yolov5 file under
    ``layout: yolov8``), read from the file's declarations without a runtime: the checks
    a load makes. Anything else it cannot tell is left to the load."""
    if path.suffix.lower() != ".onnx":
        return []
    try:
        inputs, outputs, metadata = read_onnx(path)
    except ModelIntrospectionError as exc:
        return [config.error("model_file", str(exc))]
    try:
        filled = fill_input_shape(config, path)
        image = check_input(filled, path, inputs)
        create_task(filled, image, metadata, labels or metadata_labels(metadata)).check_outputs(outputs)
    except ConfigError as exc:
        return list(exc.errors)
    except Exception:
        return []  # not for validation to judge: the load says what it is
    return []


def missing_model_hint(repo: Path, name: str) -> str | None:
    """None when the model repository ``repo`` has a model ``name`` (a folder with a config.yaml);
    else what to say: a did-you-mean, or the models it has (``validate``, ``run``, ``tune``)."""
    names = sorted(p.name for p in repo.iterdir() if (p / CONFIG_FILE).is_file())
    if name in names:
        return None
    close = difflib.get_close_matches(name, names, n=1)
    return f"did you mean {close[0]!r}?" if close else f"it has: {', '.join(names) or 'no models'}"


def numbered_classes(config: ModelConfig, path: Path) -> list[str] | None:
    """The labels a detector without names gives its objects: its class numbers, as text.

    For a ``yolo`` model whose config has no labels and whose ONNX file names no classes
    (no ``names`` metadata): ``["0", "1", ...]``, or ``[]`` when the class count is only
    known once the model runs. None when the names may be in a file validation does not
    read (not ONNX) or the task labels its objects otherwise.
    """
    if config.task.kind != "yolo" or path.suffix.lower() != ".onnx":
        return None
    try:
        _, outputs, metadata = read_onnx(path)
    except ModelIntrospectionError:
        return None  # the model file's own check says what is wrong with it
    if metadata_labels(metadata) or not outputs:
        return None
    shape = tuple(outputs[0].shape)
    if config.max_batch_size == 0 and len(shape) == 2:
        shape = (1, *shape)  # no batch dimension: one image at a time
    if len(shape) != 3 or any(d is None or d < 1 for d in shape[1:]):
        return []  # a class count only a batch tells
    _, d1, d2 = shape
    assert d1 is not None and d2 is not None
    try:
        layout = resolve_layout((1, d1, d2), getattr(config.task, "layout", "auto"))
    except ValueError:
        return []
    held = d1 - 4 if layout == "yolov8" else d2 - 5
    return [str(i) for i in range(held)]


def model_misfits(
    stages: Sequence[tuple[int, StageOptions]],
    name: str,
    kind: str,
    labels: Sequence[str] | None,
    *,
    class_numbers: Sequence[str] | None = None,
) -> list[tuple[str, str, str]]:
    """Why model ``name`` (its task kind, its labels if known) cannot serve the stages that use it.

    Each as (key, problem, hint). An ``infer`` stage on whole frames needs a model
    that finds objects; its ``classes:`` must be labels of the model they filter
    (the stage's own, or in a cascade the one of the stage named by ``on:``); of a
    model known to have no labels (``class_numbers``, see :func:`numbered_classes`), its
    class numbers. A cascade's ``on:`` stage must run a model that finds objects; an
    ``upright_by`` stage a classifier whose labels are angles.
    What ``vidpipe validate`` checks, and a model reload before the new copy serves.
    """
    # Without labels in the config, a text detector says "text".
    known = list(labels or (["text"] if kind == "text_detect" else []))
    numbered = not known and class_numbers is not None
    by_name = {s.name: s for _, s in stages}
    out: list[tuple[str, str, str]] = []
    for i, stage in stages:
        if stage.type != "infer":
            continue
        on = getattr(stage, "on", None)
        if on is None and name in stage.models() and not finds_objects(kind):
            out.append((
                f"stages[{i}].model",
                f"model {name!r} is a {kind} model: it finds no objects, so it cannot run on whole frames",
                "run it on the objects of a detector stage: on: <that stage's name>",
            ))  # fmt: skip
        parent = by_name.get(on or "", stage)
        if on is not None and parent is not stage and name in parent.models()[:1] and not finds_objects(kind):
            # A classifier (or recogniser) adds attributes (text) to its parents' objects and
            # finds none of its own: a cascade on it would never be given an object.
            grand = getattr(parent, "on", None)
            out.append((
                f"stages[{i}].on",
                f"stage {on!r} runs model {name!r}, a {kind} model: it finds no objects, so this stage "
                "has none to run on",
                f"run it on the objects {on!r} runs on: on: {grand}" if grand
                else "run it on the objects of a detector stage: on: <that stage's name>",
            ))  # fmt: skip
        out.extend(_upright_misfits(i, stage, by_name, name, kind, labels))
        classes = getattr(stage, "classes", None)
        if not classes or name not in parent.models()[:1]:
            continue
        if numbered:
            assert class_numbers is not None
            out.extend(_unnumbered_classes(i, name, classes, class_numbers))
            continue
        if not known:
            continue
        for c in classes:
            if c not in known:
                close = difflib.get_close_matches(c, known, n=1)
                shown = ", ".join(known[:12]) + (", ..." if len(known) > 12 else "")
                hint = f"did you mean {close[0]!r}?" if close else f"its labels: {shown}"
                out.append((f"stages[{i}].classes", f"{c!r} is not a label of model {name!r}", hint))
    return out


def _unnumbered_classes(
    i: int, name: str, classes: Sequence[str], numbers: Sequence[str]
) -> list[tuple[str, str, str]]:
    """``classes:`` of stage ``i`` that model ``name``, which has no labels, never gives: its
    objects are labelled by class number, so any name would drop every object without a word."""
    out: list[tuple[str, str, str]] = []
    if len(numbers) == 1:
        which = "0, its only class"
    elif numbers:
        which = f"0 to {len(numbers) - 1}"
    else:
        which = "0, 1, ..."
    for c in classes:
        if (c in numbers) if numbers else c.isdigit():
            continue
        out.append((
            f"stages[{i}].classes",
            f"{c!r} is not a class of model {name!r}: the model has no labels, so its objects are "
            f"labelled by class number ({which})",
            f"name its classes with labels: [...] in {name}/{CONFIG_FILE} (one per class, in class "
            f"order), or filter by number: classes: ['0']",
        ))  # fmt: skip
    return out


# The labels an upright_by classifier may answer: the degrees InferStage turns a crop by.
UPRIGHT_ANGLES = ("0", "90", "180", "270")


def _upright_misfits(
    i: int,
    stage: StageOptions,
    by_name: dict[str, StageOptions],
    name: str,
    kind: str,
    labels: Sequence[str] | None,
) -> list[tuple[str, str, str]]:
    """Why model ``name`` cannot be the ``upright_by`` classifier of stage ``i``.

    InferStage reads the turn from the label as a number and takes any other label as
    0: a detector, a recogniser or a classifier of colours would leave every crop unturned
    without a word. (Which objects the classifier runs on is the graph's check.)
    """
    upright = getattr(stage, "upright_by", None)
    by = by_name.get(upright or "")
    if by is None or name not in by.models()[:1] or getattr(by, "on", None) != getattr(stage, "on", None):
        return []
    key = f"stages[{i}].upright_by"
    hint = f"name a classifier stage on the same objects whose labels are {', '.join(UPRIGHT_ANGLES)}"
    task = TASKS.get(kind)
    if task is not None and not issubclass(task, ClassifyTask):
        problem = f"stage {upright!r} runs model {name!r}, a {kind} model, not a classifier of angles"
        return [(key, problem, hint)]
    bad = [label for label in labels or () if label not in UPRIGHT_ANGLES]
    if bad:
        shown = ", ".join(repr(b) for b in bad[:6]) + (", ..." if len(bad) > 6 else "")
        return [(key, f"model {name!r} of stage {upright!r} has labels that are not angles: {shown}", hint)]
    return []


def track_misfits(
    stages: Sequence[tuple[int, StageOptions]],
    models: dict[str, tuple[str, list[str]]],
    *,
    numbered: Mapping[str, Sequence[str]] | None = None,
) -> list[tuple[str, str, str]]:
    """A ``track`` stage's ``classes:`` that no detector before it can label.

    ``models`` holds each model's task kind and labels as read from its config;
    ``numbered`` the class numbers of those known to have no labels at all (see
    :func:`numbered_classes`), which label their objects "0", "1", ... A detector model
    in neither, or whose labels are only in its model file, makes the check impossible,
    and it is skipped. Each as (key, problem, hint).
    """
    numbered = numbered or {}
    out: list[tuple[str, str, str]] = []
    earlier: list[str] = []  # the models of the stages before, in order
    for i, stage in stages:
        classes = getattr(stage, "classes", None) if stage.type == "track" else None
        if classes:
            labels: dict[str, list[str]] = {}
            any_number = False  # a model without labels whose class count is unknown here
            for model in dict.fromkeys(earlier):
                kind, found = models.get(model, ("", []))
                if kind and not finds_objects(kind):
                    continue  # a classifier adds attributes, not objects to track
                known = list(found or (["text"] if kind == "text_detect" else []))
                if not known and model in numbered:
                    known = list(numbered[model])
                    any_number = any_number or not known
                    labels[model] = known
                    continue
                if not known:
                    labels = {}  # a detector whose labels are unknown here: any class may be one of them
                    break
                labels[model] = known
            union = list(dict.fromkeys(label for found in labels.values() for label in found))
            named = " or ".join(repr(m) for m in labels)
            only = next(iter(labels)) if len(labels) == 1 else None
            for c in classes if labels else ():
                if c in union or (any_number and c.isdigit()):
                    continue
                if only is not None and only in numbered:
                    # Its only detector labels objects by number: a name would track none of them.
                    out.extend(_unnumbered_classes(i, only, [c], numbered[only]))
                    continue
                close = difflib.get_close_matches(c, union, n=1)
                shown = ", ".join(union[:12]) + (", ..." if len(union) > 12 else "")
                hint = f"did you mean {close[0]!r}?" if close else f"the detectors' labels: {shown}"
                what = "model" if len(labels) == 1 else "models"
                out.append((f"stages[{i}].classes", f"{c!r} is not a label of {what} {named}", hint))
        earlier.extend(stage.models()[:1])
    return out


def model_warnings(
    stages: Sequence[tuple[int, StageOptions]], name: str, config: ModelConfig
) -> list[tuple[str, str, str]]:
    """Stage settings model ``name``'s batcher ignores (docs/models.md): a ``priority`` that is
    not one of its levels, a ``timeout_ms`` on a level without ``allow_timeout_override``.
    Each as (key, problem, hint)."""
    policy = BatchPolicy.from_config(config)
    levels = config.dynamic_batching.priority_levels
    out: list[tuple[str, str, str]] = []
    for i, stage in stages:
        if name not in stage.models()[:1]:
            continue
        priority = getattr(stage, "priority", None)
        if priority is not None and not 1 <= priority <= levels:
            out.append((
                f"stages[{i}].priority",
                f"model {name!r} has no priority level {priority} (dynamic_batching.priority_levels: "
                f"{levels}), so the stage's requests join its default level",
                "set dynamic_batching.priority_levels in the model's config.yaml, or drop priority",
            ))  # fmt: skip
        timeout = getattr(stage, "timeout_ms", None)
        if timeout is not None and not policy.levels[policy.level_for(priority) - 1].allow_timeout_override:
            out.append((
                f"stages[{i}].timeout_ms",
                f"model {name!r} does not let a request set its own timeout, so timeout_ms is ignored",
                "set allow_timeout_override: true in the queue policy of its config.yaml, or drop timeout_ms",
            ))  # fmt: skip
    return out


# What each top-level list looks like, for the hint when it is not a list.
LIST_EXAMPLES = {
    "sources": "sources: [{url: clip.mp4}], or one '- url: ...' line per source",
    "stages": "stages: [{name: detect, type: infer, model: NAME}], or one '- name: ...' line per stage",
    "outputs": "outputs: [{type: clips, dir: clips/}], or one '- type: ...' line per output",
}


def _not_a_list(raw: Any, file: str, key: str, line: int | None) -> ConfigError:
    """``key:`` holds a scalar or a mapping: its line (a scalar has none of its own) and an example."""
    return ConfigError(
        file,
        line_of(raw) or line,
        key,
        f"expected a list, got {shown(raw)}",
        f"e.g. {LIST_EXAMPLES[key]}",
    )


def _without(data: dict[str, Any], paths: Collection[str]) -> LineDict:
    """A copy of the mapping ``data`` without the keys at ``paths``, with its lines.

    A dotted path (``runtime.max_sources``) drops the key inside its section and keeps the
    section's other keys; a list item's (``nats.servers[1]``) drops the whole list.
    """
    out = LineDict(data)
    out.line, out.key_lines = getattr(data, "line", 0), getattr(data, "key_lines", {})
    inner: dict[str, list[str]] = {}
    for path in paths:
        if path in out:
            del out[path]
            continue
        first, dot, rest = path.partition(".")
        key = first.split("[", 1)[0]
        if dot and key == first and isinstance(out.get(key), dict):
            inner.setdefault(key, []).append(rest)
        else:
            out.pop(key, None)
    for key, rests in inner.items():
        if key in out:  # not dropped whole by another path
            out[key] = _without(out[key], rests)
    return out


def _entry_keys(errors: list[ConfigError], path: str, item: dict[str, Any]) -> set[str] | None:
    """The keys of the entry at ``path`` (``stages[2]``) its errors are about; None when one
    is about the entry as a whole (a required key missing, keys that do not go together)."""
    keys: set[str] = set()
    for err in errors:
        if not err.path.startswith(path + "."):
            return None
        key = err.path[len(path) + 1 :]
        keys.add(key if key in item else re.split(r"[.\[]", key, maxsplit=1)[0])
    return keys


def _meant(keys: Collection[str], fields: Collection[str]) -> set[str]:
    """The fields ``keys`` may stand for: each key that is one, and the one an unknown key
    looks like (its error's did-you-mean). A check that reads one of them would judge its
    default where the file may have meant to set it: ``modle: x`` is not "no model"."""
    meant = set()
    for key in keys:
        meant.update([key] if key in fields else difflib.get_close_matches(key, list(fields), n=1))
    return meant


def _replaced(replaced: Collection[str], key: str) -> bool:
    """Whether ``key`` (``runtime.max_sources``) stands at its default in the config the later
    checks see while the file set it: it, or its section, was wrong, or a misspelling of it
    was found in its place (``runtime.max_source``). A check that reads it would judge the
    default, not the file."""
    section, _, name = key.rpartition(".")
    for r in replaced:
        if key == r or key.startswith(r + "."):
            return True
        r_section, _, r_name = r.rpartition(".")
        if r_section == section and difflib.get_close_matches(r_name, [name], n=1):
            return True
    return False


def _build_sources(
    raw: Any, file: str, base_dir: Path, errors: list[ConfigError], line: int | None = None
) -> list[tuple[int, SourceConfig]]:
    """Each ``sources[]`` entry parsed on its own, so every bad entry is reported; with its index."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        errors.append(_not_a_list(raw, file, "sources", line))
        return []
    # Ids derived from URLs avoid every id the file gives, wherever it is given.
    taken = {item["id"] for item in raw if isinstance(item, dict) and isinstance(item.get("id"), str)}
    out = []
    for i, item in enumerate(raw):
        path = f"sources[{i}]"
        if not isinstance(item, dict):
            errors.append(
                ConfigError(file, line_of(raw, i), path, "expected a mapping", "e.g. {url: clip.mp4}")
            )
            continue
        try:
            src = parse_source(item, base_dir=base_dir, taken_ids=taken, file=file, path=path)
        except ConfigError as exc:
            errors.extend(exc.errors)
            misplaced = {e.path.rsplit(".", 1)[-1] for e in exc.errors if isinstance(e, SchemeKeyError)}
            if len(misplaced) < len(exc.errors):
                continue
            # Only keys of another scheme: the source without them is still checked further
            # (its file, its id), so every problem is reported at once.
            rest = LineDict((k, v) for k, v in item.items() if k not in misplaced)
            rest.line, rest.key_lines = getattr(item, "line", 0), getattr(item, "key_lines", {})
            try:
                src = parse_source(rest, base_dir=base_dir, taken_ids=taken, file=file, path=path)
            except ConfigError:
                continue
        taken.add(src.source_id)
        out.append((i, src))
    return out


def _misspelt_type(item: dict[str, Any], file: str, path: str) -> ConfigError | None:
    """An entry without ``type`` but with a key that looks like it (``typ:``): that key, named."""
    keys = [k for k in item if isinstance(k, str)]
    close = difflib.get_close_matches("type", keys, n=1, cutoff=0.7)
    if not close:
        return None
    return ConfigError(
        file, line_of(item, close[0]), f"{path}.{close[0]}", "unknown key", "did you mean 'type'?"
    )


def _build_stages(
    raw: Any,
    file: str,
    errors: list[ConfigError],
    line: int | None,
    unchecked: set[int],
    loose: dict[int, tuple[str, ...]] | None = None,
) -> list[tuple[int, StageOptions]]:
    """Each ``stages[]`` entry validated against the options of its ``type``, with its index.

    An entry with wrong keys that its kind's checks do not read (``problem_keys``,
    ``graph_keys``) is returned too, built without them, so the graph is still checked
    with it; its index goes into ``unchecked`` when its own ``problems()`` cannot be judged.
    One with a wrong key the graph's checks read is left out, and the models it names
    (when its ``model`` is not what is wrong) go into ``loose``: their own files can still
    be checked.
    """
    if raw is None:
        return []
    if not isinstance(raw, list):
        # Not a list: there are no stages, and nothing can be said about the graph.
        errors.append(_not_a_list(raw, file, "stages", line))
        return []
    kinds = stage_kinds()
    # Keys some kind takes: on another kind they are misplaced, not misspelled.
    known = {f.name: k for k, cls in kinds.items() for f in dataclasses.fields(cls.options_type)}
    out = []
    for i, item in enumerate(raw):
        path = f"stages[{i}]"
        line = line_of(raw, i)
        if not isinstance(item, dict):
            errors.append(
                ConfigError(file, line, path, "expected a mapping", "e.g. {name: detect, type: infer}")
            )
            continue
        kind = item.get("type")
        # Without a known type the entry's keys mean nothing: they are checked once it has one.
        if kind is None:
            errors.append(
                _misspelt_type(item, file, path)
                or ConfigError(file, line, path, "missing required key 'type'", " or ".join(kinds))
            )
            continue
        cls = kinds.get(kind) if isinstance(kind, str) else None
        if cls is None:
            close = difflib.get_close_matches(str(kind), list(kinds), n=1)
            hint = f"did you mean {close[0]!r}?" if close else ""
            choices = ", ".join(repr(k) for k in kinds)
            errors.append(
                ConfigError(
                    file,
                    line_of(item, "type") or line,
                    f"{path}.type",
                    f"expected one of {choices}, got {kind!r}",
                    hint,
                )
            )
            continue
        takes = [f.name for f in dataclasses.fields(cls.options_type)]
        misplaced = [
            ConfigError(
                file,
                line_of(item, key) or line,
                f"{path}.{key}",
                f"does not apply to a stage of type {kind}",
                f"type {kind} takes: {', '.join(takes)}",
            )
            for key in item
            if key not in takes and key in known
        ]
        # The entry is checked without them: the kind's own unknown-key check would repeat
        # them as typos, and no check of the kind reads a key it does not take.
        errors.extend(misplaced)
        rest = _without(item, [e.path[len(path) + 1 :] for e in misplaced])
        options = cls.options_type
        try:
            out.append((i, build(rest, options, file, path=path)))
            continue
        except ConfigError as exc:
            errors.append(exc)
            wrong = _entry_keys(exc.errors, path, rest)
        if wrong is None:
            continue
        # A key the kind does not take is read by no check; one it takes (or meant) may be.
        judged = _meant(wrong, [f.name for f in dataclasses.fields(options)])
        try:
            stand_in = build(_without(rest, wrong), options, file, path=path)
        except ConfigError:
            continue
        if judged and (options.graph_keys is None or judged & options.graph_keys):
            # The graph's checks would judge a stand-in's defaults, not the file; the models
            # it names are the file's own (a wrong model key leaves none), and so are their files.
            if loose is not None and stand_in.models():
                loose[i] = stand_in.models()
            continue
        out.append((i, stand_in))
        if judged and (options.problem_keys is None or judged & options.problem_keys):
            unchecked.add(i)
    return out


# The keys of an output the file's checks read (where it writes, which sources): an output
# with another key wrong is still checked, built without that key.
_OUTPUT_CHECKED_KEYS = frozenset({"type", "path", "dir", "sources"})


def _build_outputs(
    raw: Any, file: str, errors: list[ConfigError], line: int | None = None
) -> list[tuple[int, OutputConfig]]:
    """Each ``outputs[]`` entry validated against the options of its ``type``, with its index."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        errors.append(_not_a_list(raw, file, "outputs", line))
        return []
    out: list[tuple[int, OutputConfig]] = []
    for i, item in enumerate(raw):
        path = f"outputs[{i}]"
        line = line_of(raw, i)
        if not isinstance(item, dict):
            errors.append(
                ConfigError(
                    file, line, path, "expected a mapping", 'e.g. {type: file, path: "out/{source}.mp4"}'
                )
            )
            continue
        kind = item.get("type")
        cls = OUTPUT_TYPES.get(kind) if isinstance(kind, str) else None
        # Without a known type the entry's keys mean nothing: they are checked once it has one.
        if kind is None and (misspelt := _misspelt_type(item, file, path)) is not None:
            errors.append(misspelt)
            continue
        if cls is None:
            choices = " or ".join(repr(k) for k in OUTPUT_TYPES)
            problem = "missing required key 'type'" if kind is None else f"expected {choices}, got {kind!r}"
            errors.append(ConfigError(file, line_of(item, "type") or line, f"{path}.type", problem, choices))
            continue
        try:
            out.append((i, build(item, cls, file, path=path)))
            continue
        except ConfigError as exc:
            errors.append(exc)
            wrong = _entry_keys(exc.errors, path, item)
        if wrong is None or _meant(wrong, [f.name for f in dataclasses.fields(cls)]) & _OUTPUT_CHECKED_KEYS:
            continue  # its path and sources are what the later checks read
        with contextlib.suppress(ConfigError):
            out.append((i, build(_without(item, wrong), cls, file, path=path)))
    return out


def _near_source(name: str, ids: Collection[str]) -> str | None:
    """The file's source id ``name`` is a typo of: the same in another case, or a close
    match, unless it differs from a source only in its numbers (``cam2`` beside ``cam1``
    is another camera, maybe one to be added)."""
    same_case = [sid for sid in ids if sid.lower() == name.lower()]
    if same_case:
        return same_case[0]
    if any(re.sub(r"\d", "", sid) == re.sub(r"\d", "", name) for sid in ids):
        return None
    close = difflib.get_close_matches(name, list(ids), n=1)
    return close[0] if close else None


def _output_source_problems(
    cfg: PipelineConfig, outputs: list[tuple[int, OutputConfig]]
) -> list[ConfigError]:
    """``outputs[].sources`` ids that name no source of the file: a near miss of one is an
    error (it would record nothing, silently); any other is logged as a warning, since a
    source of that id may still be added later (the HTTP API, a fleet)."""
    errors: list[ConfigError] = []
    ids = [s.source_id for s in cfg.sources]
    shown = ", ".join(ids[:6]) + (", ..." if len(ids) > 6 else "") if ids else "(none)"
    for i, out in outputs:
        for j, name in enumerate(out.sources):
            if name in ids:
                continue
            key = f"outputs[{i}].sources"
            line = cfg.line(f"{key}[{j}]") or cfg.line(key) or cfg.line(f"outputs[{i}]")
            near = _near_source(name, ids)
            if near is not None:
                hint = f"did you mean {near!r}?"
                errors.append(ConfigError(cfg.file, line, key, f"no source {name!r}", hint))
                continue
            warning = ConfigError(
                cfg.file,
                line,
                key,
                f"no source {name!r} in this file: the output applies only to a source added later "
                "with that id (through the HTTP API or a fleet)",
                f"the file's sources: {shown}",
            )
            log.warning("%s", warning.render())
    return errors


# Stands in for a pipeline name that is missing or wrong, so the file's other checks still
# run (none of them reads the name).
_STAND_IN_NAME = "pipeline"


def _build_top(raw: LineDict, file: str, errors: list[ConfigError]) -> tuple[PipelineConfig | None, set[str]]:
    """The top-level keys, and the (dotted) keys that were wrong.

    When some are wrong, a stand-in config is built without them (a section keeps its
    other keys; a wrong or missing name is stood in for), so that the sources, the graph,
    the files and the models are still checked: every problem is reported at once. Later
    checks that read a key that was wrong are skipped (:func:`_replaced`). None: no
    stand-in could be built.
    """
    try:
        return build(raw, PipelineConfig, file), set()
    except ConfigError as exc:
        errors.extend(exc.errors)
        wrong = {e.path for e in exc.errors}
    fields = {f.name for f in dataclasses.fields(PipelineConfig)}
    # Unknown keys are read by nothing; the name is the one required key.
    replaced = {k for k in raw if k not in fields} | ({"pipeline"} if "pipeline" not in raw else set())
    while True:
        replaced |= wrong - {""}
        stand_in = _without(raw, replaced)
        if "pipeline" in replaced:
            stand_in["pipeline"] = _STAND_IN_NAME
        try:
            return build(stand_in, PipelineConfig, file), replaced
        except ConfigError as exc:
            # A section without its wrong key can lack a required one (fleet.name): the
            # next round drops the section.
            wrong = {e.path for e in exc.errors}
        if wrong - {""} <= replaced:
            return None, replaced


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
    data: Any = None,
    require_sources: bool = False,
    check_resources: bool = False,
    fleet_name: str | None = None,
) -> PipelineConfig:
    """Read, validate and resolve a pipeline file.

    ``sources`` (from ``vidpipe run --source``) replaces the file's sources.
    ``fleet_name`` (``--fleet NAME``) names a ``fleet:`` section that has no name.
    ``data`` is a config already in memory (a dict, as YAML would parse): it is
    used instead of reading ``path``, which then only names it in errors and
    anchors its relative paths (at ``path``'s folder).

    ``require_sources`` makes a pipeline without sources an error unless it
    serves HTTP or joins a fleet (sources may then come through the API or the
    fleet's desired set). ``check_resources``
    also checks what lies outside the file: the file sources, the model
    repository and the model configs it uses (what ``vidpipe validate`` adds).
    Every problem found is raised at once, as one
    :class:`~inference.schema.ConfigErrors` when there are several.
    """
    p = Path(path)
    raw = load_yaml(p) if data is None else data
    file = str(path)
    if not isinstance(raw, dict):
        build(raw, PipelineConfig, file)  # says what the top level should be
    errors: list[ConfigError] = []
    internal = ("base_dir", "file", "lines")
    for key in internal:
        if key in raw:
            errors.append(ConfigError(file, line_of(raw, key), key, "unknown key", "this is set by vidpipe"))
    # Sources, stages and outputs are validated entry by entry (stages and outputs per
    # kind, each kind declaring its own keys), the rest as one dataclass.
    own = ("sources", "stages", "outputs", *internal)
    top = LineDict((k, v) for k, v in raw.items() if k not in own)
    top.line, top.key_lines = getattr(raw, "line", 1), getattr(raw, "key_lines", {})
    fleet = top.get("fleet")
    if fleet_name is not None and isinstance(fleet, dict) and "name" not in fleet:
        named = LineDict({**fleet, "name": fleet_name})
        named.line, named.key_lines = getattr(fleet, "line", 0), getattr(fleet, "key_lines", {})
        top["fleet"] = named
    cfg, replaced = _build_top(top, file, errors)
    file_sources = _build_sources(
        raw.get("sources"), file, p.parent.resolve(), errors, line_of(raw, "sources")
    )
    unchecked: set[int] = set()
    loose: dict[int, tuple[str, ...]] = {}
    stages = _build_stages(raw.get("stages"), file, errors, line_of(raw, "stages"), unchecked, loose)
    outputs = _build_outputs(raw.get("outputs"), file, errors, line_of(raw, "outputs"))
    if cfg is None:
        raise_errors(errors)
        raise AssertionError("unreachable: a config that did not build has errors")
    cfg = replace(
        cfg,
        stages=[s for _, s in stages],
        outputs=[o for _, o in outputs],
        lines=_key_lines(raw),
        base_dir=str(p.parent.resolve()),
    )
    if sources is not None:
        built: list[SourceConfig] = []
        for u in sources:
            try:
                built.append(
                    parse_source({"url": u}, base_dir=Path.cwd(), taken_ids={s.source_id for s in built})
                )
            except ConfigError as exc:
                hint = exc.hint or "docs/sources.md lists the URLs"
                errors.append(ConfigError("--source", None, "", exc.problem, hint))
        cfg = replace(cfg, sources=built)
    else:
        cfg = replace(cfg, sources=[s for _, s in file_sources])
    cfg = replace(cfg, file=file)
    # Where each source is in the file (an entry that did not build is not among them).
    source_index = [i for i, _ in file_sources] if sources is None else list(range(len(cfg.sources)))
    errors.extend(_check_graph(cfg, raw, file, stages, source_index, outputs, unchecked, replaced))
    if sources is None and not any(e.path.startswith("sources") for e in errors):
        # Against the file's own sources (--source ones replace them; a source entry that
        # did not build has no id to compare with).
        errors.extend(_output_source_problems(cfg, outputs))
    if (
        require_sources
        and not cfg.sources
        and cfg.http is None
        and cfg.fleet is None
        # A wrong http: or fleet: is still one: sources may come through it once it is fixed.
        and not _replaced(replaced, "http")
        and not _replaced(replaced, "fleet")
        and "sources" not in {e.path.split("[")[0] for e in errors}
        and not any(e.file == "--source" for e in errors)  # a --source refused says it all
    ):
        errors.append(
            ConfigError(
                file,
                line_of(raw, "sources") or line_of(raw),
                "sources",
                "no sources",
                "add sources: in the file, or pass --source URL",
            )
        )
    if check_resources:
        errors.extend(
            _check_resources(cfg, stages, source_index if sources is None else None, outputs, loose)
        )
    raise_errors(errors)
    return cfg
