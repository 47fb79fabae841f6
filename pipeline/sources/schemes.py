"""The source scheme registry: which URL schemes exist, what each means, which class serves it.

::

    sources:
      - url: clips/lobby.mp4          # no scheme (or file://): a file, lossless
      - url: test://?fps=25           # a synthetic pattern, live
      - url: rtsp://cam.local/stream  # rtsp:// or rtsps://: a camera, live
      - url: whip://door              # a WebRTC publisher, live

One declarative table, so config validation, the API and the runtime agree on the
schemes without importing the source classes: a class is imported only when
:func:`create_source` makes a source of its kind.
"""

from __future__ import annotations

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
    "is_live",
    "resolve_url",
    "scheme_of",
]


def _id_from_file(url: str) -> str:
    parts = urlsplit(url)
    return Path(parts.path if parts.scheme == "file" else url).stem


def _id_from_test(url: str) -> str:
    return dict(parse_qsl(urlsplit(url).query)).get("id") or "test"


def _id_from_camera(url: str) -> str:
    parts = urlsplit(url)
    return parts.path.strip("/").replace("/", "_") or parts.hostname or "camera"


def _id_from_whip(url: str) -> str:
    parts = urlsplit(url)
    return parts.netloc or parts.path.strip("/")


@dataclass(frozen=True)
class Scheme:
    """One URL scheme: whether it is live, how an id derives from its URL, its class."""

    name: str
    # Live sources drop the oldest frame when the graph is behind; files block (lossless).
    live: bool
    # A readable id from the (already redacted) URL, before cleaning to [A-Za-z0-9_-].
    id_from: Callable[[str], str]
    # "module:Class", imported when a source of this scheme is created.
    source: str


SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("file", live=False, id_from=_id_from_file, source="pipeline.sources.file:FileSource"),
        Scheme("test", live=True, id_from=_id_from_test, source="pipeline.sources.pattern:TestPatternSource"),
        Scheme("rtsp", live=True, id_from=_id_from_camera, source="pipeline.sources.rtsp:RtspSource"),
        Scheme("rtsps", live=True, id_from=_id_from_camera, source="pipeline.sources.rtsp:RtspSource"),
        Scheme("whip", live=True, id_from=_id_from_whip, source="pipeline.sources.whip:WhipSource"),
    )
}


# The scheme-specific source keys each scheme takes: SourceConfig fields beyond url, id,
# queue_size, max_fps and max_pixels, which every scheme takes. A key that some scheme
# takes and a source's scheme does not (``transport:`` on a file) is a config error.
# A scheme missing here is not checked.
_RTSP_OPTIONS = (
    "transport", "open_timeout", "read_timeout", "stall_timeout", "reconnect", "allow_redirects", "decode",
)  # fmt: skip
SCHEME_OPTIONS: dict[str, tuple[str, ...]] = {
    "file": ("loop", "realtime", "decode"),
    "test": (),
    "rtsp": _RTSP_OPTIONS,
    "rtsps": _RTSP_OPTIONS,
    "whip": ("open_timeout", "stall_timeout"),
}


def _scheme_name(url: str) -> str:
    scheme = urlsplit(url).scheme.lower()
    # No scheme, or one letter (a Windows drive, C:\clips\a.mp4): a file path.
    return scheme if len(scheme) > 1 else "file"


def check_url(url: str) -> str | None:
    """Why ``url`` cannot be a source, or None.

    The one check config files, ``--source`` and ``POST /v1/sources`` all go
    through: what :func:`pipeline.urls.url_problem` refuses (control characters,
    spaces, a raw ``@`` in the password), then an unknown scheme.
    """
    return url_problem(url) or _unknown_scheme(url)


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
    """Whether a source of this URL (or scheme name) is live: drops when behind, never ends."""
    scheme = SCHEMES.get(url_or_scheme) or scheme_of(url_or_scheme)
    return scheme.live


def derive_id(url: str) -> str:
    """A readable id from a URL: the file stem, the RTSP path, the WHIP name or ``test``."""
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
    parts = urlsplit(url)
    path = Path(parts.netloc + parts.path) if parts.scheme == "file" else Path(url)
    return str(path if path.is_absolute() else (base / path).resolve())


def create_source(config: SourceConfig, on_state: StateListener | None = None) -> Source:
    """The :class:`~pipeline.sources.base.Source` for a config's URL scheme."""
    module_name, _, class_name = scheme_of(config.url).source.partition(":")
    cls: type[Source] = getattr(importlib.import_module(module_name), class_name)
    return cls(config, on_state)
