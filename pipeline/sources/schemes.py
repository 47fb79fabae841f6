"""The source scheme registry: which URL schemes exist, what each means, which class serves it.

::

    sources:
      - url: clips/lobby.mp4          # no scheme (or file://): a file, lossless
      - url: test://?fps=25           # a synthetic pattern, live
      - url: rtsp://cam.local/stream  # rtsp:// or rtsps://: a camera, live
      - url: whip://door              # a WebRTC publisher, live
      - url: /dev/video0              # or v4l2:///dev/video0?video_size=640x480: a webcam, live
      - url: http://cam.local/video.mjpg         # http(s)://: MJPEG or live HLS, live ...
      - url: https://cdn.example/clip.mp4        # ... or a finite file (by extension; see live:)
      - url: https://cdn.example/live/index.m3u8 # HLS
      - url: udp://0.0.0.0:5000       # MPEG-TS over UDP (rtp://: over RTP), live
      - url: srt://relay.local:9000   # SRT, live, when FFmpeg has libsrt

One declarative table, so config validation, the API and the runtime agree on the
schemes without importing the source classes: a class is imported only when
:func:`create_source` makes a source of its kind. A scheme that needs a part of
FFmpeg this build may lack (SRT, video4linux2) says so when the URL is checked,
before anything runs.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlsplit

from pipeline.redact import redact_url
from pipeline.urls import url_problem

if TYPE_CHECKING:
    from pipeline.config import SourceConfig
    from pipeline.sources.base import Source, StateListener

__all__ = [
    "SCHEMES",
    "SCHEME_OPTIONS",
    "Scheme",
    "check_url",
    "create_source",
    "derive_id",
    "file_path",
    "is_live",
    "resolve_live",
    "resolve_url",
    "scheme_of",
    "v4l2_device",
    "whip_name",
]

# An http(s) URL whose path ends in one of these is a finite file (lossless, ends);
# any other (MJPEG, HLS playlists, MPEG-TS streams) is live. ``live:`` overrides it.
FINITE_HTTP_SUFFIXES = (".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi")
# A plain path naming a video4linux2 device is a webcam, not a file.
_V4L2_PATH = re.compile(r"/dev/video\d+")
# What a v4l2:// URL's query may set: FFmpeg's video4linux2 demuxer options.
V4L2_OPTIONS = ("video_size", "framerate", "input_format", "pixel_format", "standard")


def file_path(url: str) -> Path:
    """The path a file source reads: a plain path, or ``file://`` (host part included, as written)."""
    parts = urlsplit(url)
    return Path(parts.netloc + parts.path) if parts.scheme == "file" else Path(url)


def whip_name(url: str) -> str:
    """The ``<id>`` of ``whip://<id>``: the name publishers use in ``/whip/<id>``."""
    parts = urlsplit(url)
    return parts.netloc or parts.path.strip("/")


def _id_from_file(url: str) -> str:
    return file_path(url).stem


def _id_from_test(url: str) -> str:
    return dict(parse_qsl(urlsplit(url).query)).get("id") or "test"


def _id_from_camera(url: str) -> str:
    parts = urlsplit(url)
    return parts.path.strip("/").replace("/", "_") or parts.hostname or "camera"


def _id_from_http(url: str) -> str:
    path = urlsplit(url).path.strip("/")
    stem = path.rsplit(".", 1)[0] if "." in path.rsplit("/", 1)[-1] else path
    return stem.replace("/", "_") or urlsplit(url).hostname or "http"


def _id_from_port(url: str) -> str:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    return f"{parts.scheme}_{port}" if port else parts.scheme


def _id_from_v4l2(url: str) -> str:
    return Path(v4l2_device(url)).name


def _http_live(url: str) -> bool:
    return not urlsplit(url).path.lower().endswith(FINITE_HTTP_SUFFIXES)


def v4l2_device(url: str) -> str:
    """The device path of a webcam URL: ``/dev/video0``, ``v4l2:///dev/video0`` or ``v4l2://0``."""
    parts = urlsplit(url)
    if parts.scheme != "v4l2":
        return url
    if parts.netloc.isdigit():
        return f"/dev/video{parts.netloc}"
    return parts.netloc + parts.path


# -- what this FFmpeg has --------------------------------------------------------------------


@functools.cache
def ffmpeg_protocol_missing(protocol: str) -> str | None:
    """Why FFmpeg (PyAV's build) cannot open ``protocol://`` URLs, or None when it can."""
    try:
        import av
    except ImportError:
        return "PyAV is not installed"
    # FFmpeg looks the protocol up before it checks the whitelist, and the whitelist
    # check comes before any connection: a protocol it has answers "not on whitelist"
    # (EINVAL) without touching the network, one it lacks "protocol not found".
    try:
        av.open(f"{protocol}://127.0.0.1:9/", container_options={"protocol_whitelist": "pipe"}, timeout=1.0)
    except av.error.ProtocolNotFoundError:
        return f"this FFmpeg (PyAV {av.__version__}) has no {protocol!r} protocol"
    except Exception:
        return None
    return None


@functools.cache
def ffmpeg_format_missing(name: str) -> str | None:
    """Why FFmpeg (PyAV's build) has no demuxer ``name``, or None when it has."""
    try:
        import av
    except ImportError:
        return "PyAV is not installed"
    names = {part for entry in av.formats_available for part in entry.split(",")}
    if name not in names:
        return f"this FFmpeg (PyAV {av.__version__}) has no {name!r} demuxer"
    return None


def _needs_srt() -> str | None:
    missing = ffmpeg_protocol_missing("srt")
    if missing:
        return f"{missing}; srt:// needs PyAV built against an FFmpeg configured with --enable-libsrt"
    return None


def _needs_v4l2() -> str | None:
    missing = ffmpeg_format_missing("video4linux2")
    if missing:
        return f"{missing}; webcams need PyAV with libavdevice's video4linux2 input (Linux)"
    return None


@dataclass(frozen=True)
class Scheme:
    """One URL scheme: how an id derives from its URL, the class serving it live or finite.

    Live sources drop the oldest frame when the graph is behind and reconnect;
    finite ones (files) block, so every frame is processed, and end.
    """

    name: str
    # A readable id from the (already redacted) URL, before cleaning to [A-Za-z0-9_-].
    id_from: Callable[[str], str]
    # "module:Class" serving it live / as a finite file, imported when a source is created.
    live_source: str | None = None
    finite_source: str | None = None
    # When it can be both: whether a URL is live unless ``live:`` says otherwise.
    live_by_url: Callable[[str], bool] | None = None
    # Why this FFmpeg cannot serve the scheme (a protocol or demuxer it lacks), or None.
    requires: Callable[[], str | None] | None = None

    @property
    def live(self) -> bool:
        """Whether its sources are live by default."""
        return self.live_source is not None

    def live_for(self, url: str) -> bool:
        if self.live_source is not None and self.finite_source is not None and self.live_by_url:
            return self.live_by_url(url)
        return self.live


_FILE = "pipeline.sources.file:FileSource"
_STREAM = "pipeline.sources.stream:StreamSource"

SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("file", _id_from_file, finite_source=_FILE),
        Scheme("test", _id_from_test, live_source="pipeline.sources.pattern:TestPatternSource"),
        Scheme("rtsp", _id_from_camera, live_source="pipeline.sources.rtsp:RtspSource"),
        Scheme("rtsps", _id_from_camera, live_source="pipeline.sources.rtsp:RtspSource"),
        Scheme("whip", whip_name, live_source="pipeline.sources.whip:WhipSource"),
        Scheme("http", _id_from_http, live_source=_STREAM, finite_source=_FILE, live_by_url=_http_live),
        Scheme("https", _id_from_http, live_source=_STREAM, finite_source=_FILE, live_by_url=_http_live),
        Scheme("udp", _id_from_port, live_source=_STREAM),
        Scheme("rtp", _id_from_port, live_source=_STREAM),
        Scheme("srt", _id_from_port, live_source=_STREAM, requires=_needs_srt),
        Scheme("v4l2", _id_from_v4l2, live_source=_STREAM, requires=_needs_v4l2),
    )
}


# The scheme-specific source keys each scheme takes: SourceConfig fields beyond url, id,
# queue_size, max_fps and max_pixels, which every scheme takes. A key that some scheme
# takes and a source's scheme does not (``transport:`` on a file) is a config error.
# A scheme missing here is not checked.
_RTSP_OPTIONS = (
    "transport", "open_timeout", "read_timeout", "stall_timeout", "reconnect", "allow_redirects", "decode",
)  # fmt: skip
_STREAM_OPTIONS = ("open_timeout", "read_timeout", "stall_timeout", "reconnect", "decode")
_HTTP_OPTIONS = ("live", "tls_verify", "loop", "realtime", *_STREAM_OPTIONS)
SCHEME_OPTIONS: dict[str, tuple[str, ...]] = {
    "file": ("loop", "realtime", "decode"),
    "test": (),
    "rtsp": _RTSP_OPTIONS,
    "rtsps": _RTSP_OPTIONS,
    "whip": ("open_timeout", "stall_timeout"),
    "http": _HTTP_OPTIONS,
    "https": _HTTP_OPTIONS,
    "udp": _STREAM_OPTIONS,
    "rtp": _STREAM_OPTIONS,
    "srt": _STREAM_OPTIONS,
    "v4l2": ("open_timeout", "read_timeout", "stall_timeout", "reconnect"),
}


def _scheme_name(url: str) -> str:
    scheme = urlsplit(url).scheme.lower()
    if not scheme and _V4L2_PATH.fullmatch(url):
        return "v4l2"
    # No scheme, or one letter (a Windows drive, C:\clips\a.mp4): a file path.
    return scheme if len(scheme) > 1 else "file"


def check_url(url: str) -> str | None:
    """Why ``url`` cannot be a source, or None.

    The one check config files, ``--source`` and ``POST /v1/sources`` all go
    through: what :func:`pipeline.urls.url_problem` refuses (control characters,
    spaces, a raw ``@`` in the password), then an unknown scheme, then a scheme
    this FFmpeg cannot serve (SRT without libsrt), then a webcam URL's options.
    """
    problem = url_problem(url) or _unknown_scheme(url)
    if problem:
        return problem
    scheme = SCHEMES[_scheme_name(url)]
    if scheme.requires is not None:
        missing = scheme.requires()
        if missing:
            return f"{scheme.name}:// sources are not available: {missing}"
    if scheme.name == "v4l2":
        return _v4l2_problem(url)
    if scheme.name == "whip" and "@" in urlsplit(url).netloc:
        # The name is what publishers put in /whip/<name>: it has no user or password.
        return "a whip:// URL is whip://<name>: it takes no user or password"
    return None


def _v4l2_problem(url: str) -> str | None:
    device = v4l2_device(url)
    if not _V4L2_PATH.fullmatch(device):
        return f"a webcam is /dev/videoN, v4l2:///dev/videoN or v4l2://N, not {redact_url(url)!r}"
    for key, _ in parse_qsl(urlsplit(url).query, keep_blank_values=True):
        if key not in V4L2_OPTIONS:
            return f"unknown webcam option {key!r}; use {', '.join(V4L2_OPTIONS)}"
    return None


def _unknown_scheme(url: str) -> str | None:
    name = _scheme_name(url)
    if name not in SCHEMES:
        return f"unsupported source scheme {name!r} in {redact_url(url)!r}"
    return None


def scheme_of(url: str) -> Scheme:
    """The scheme of a source URL; raises ValueError for an unknown one."""
    problem = _unknown_scheme(url)
    if problem:
        raise ValueError(problem)
    return SCHEMES[_scheme_name(url)]


def is_live(url_or_scheme: str) -> bool:
    """Whether a source of this URL (or scheme name) is live by default: drops when behind, never ends."""
    if url_or_scheme in SCHEMES:
        return SCHEMES[url_or_scheme].live
    return scheme_of(url_or_scheme).live_for(url_or_scheme)


def resolve_live(url: str, live: bool | None) -> bool:
    """Whether a source of ``url`` is live, given the config's ``live:`` (None: by the URL).

    Raises ValueError when the scheme cannot be what ``live`` asks (a live file, a
    finite RTSP camera).
    """
    scheme = scheme_of(url)
    if live is None:
        return scheme.live_for(url)
    if live and scheme.live_source is None:
        raise ValueError(f"live: {scheme.name} sources are never live; remove live: true")
    if not live and scheme.finite_source is None:
        raise ValueError(
            f"live: {scheme.name}:// sources are always live; live: false applies to http(s) files only"
        )
    return live


def derive_id(url: str) -> str:
    """A readable id from a URL: the file stem, the camera path, the WHIP name, ``udp_5000``..."""
    # Never raises: an unknown scheme (refused elsewhere) is named like a file.
    scheme = SCHEMES.get(_scheme_name(url), SCHEMES["file"])
    # A password must never become part of an id (a subject and a metric label).
    raw = scheme.id_from(redact_url(url))
    cleaned = re.sub(r"[^A-Za-z0-9_-]+", "_", raw).strip("_")[:64]
    return cleaned or "source"


def resolve_url(url: str, base: Path) -> str:
    """Make a relative file path absolute against ``base``; other URLs pass through."""
    if _scheme_name(url) != "file":
        return url
    path = file_path(url)
    return str(path if path.is_absolute() else (base / path).resolve())


def create_source(config: SourceConfig, on_state: StateListener | None = None) -> Source:
    """The :class:`~pipeline.sources.base.Source` for a config's URL scheme (and ``live``)."""
    scheme = scheme_of(config.url)
    path = scheme.live_source if config.live else scheme.finite_source
    assert path is not None, "SourceConfig checks live against its scheme"
    module_name, _, class_name = path.partition(":")
    cls: type[Source] = getattr(importlib.import_module(module_name), class_name)
    return cls(config, on_state)
