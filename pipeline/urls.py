"""What a source URL may contain before FFmpeg or a log line sees it.

FFmpeg writes an RTSP URL into its requests as it is given, so a CR/LF in the
URL becomes a second, forged request, to any host and port; a newline in a file
path forges a log line. And URL parsers disagree on a password that holds a raw
``@``, ``/``, ``?`` or ``#``: ``rtsp://admin:Pa@127.0.0.1:554/TAIL@10.9.9.9/s``
is a camera at 127.0.0.1 to FFmpeg and Python, but looks like one at 10.9.9.9
to a reader, and the password's tail travels in the request path. So:

* :func:`url_problem` refuses control characters (C0, DEL, C1) anywhere, spaces
  in network URLs, and any ``@`` outside the userinfo, with a message that says
  to percent-encode (``%40`` for ``@``, ``%2F`` for ``/``);
* :func:`protocol_whitelist` is the list of FFmpeg protocols a scheme needs,
  passed as FFmpeg's ``protocol_whitelist`` so a URL (or a redirect, or a
  playlist inside a file) can reach nothing else;
* :data:`FILE_FORMAT_DENYLIST` names the demuxers a file may not be opened
  with: playlist and description formats (``hls``, ``dash``, ``concat``,
  ``sdp``, ``rtsp``...) whose content names other files or hosts to open, and
  capture devices. The file source passes every other demuxer FFmpeg has as its
  ``format_whitelist``; an http(s) source the same list plus ``hls``, which
  its protocol whitelist keeps on the network;
* :data:`STREAM_FORMATS` names the one demuxer each of the other network and
  device schemes may use (MPEG-TS over UDP and SRT, RTP, video4linux2).

It also reads what a source URL names, without knowing which class serves it:
its scheme (:func:`scheme_name`), the file a file source reads (:func:`file_path`),
a webcam's device (:func:`v4l2_device`), a WHIP publisher's name
(:func:`whip_name`) and the id a source gets when the config gives none
(:func:`derive_id`). The source classes and the scheme table
(:mod:`pipeline.sources.schemes`) both read URLs through these.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple
from urllib.parse import parse_qsl, urlsplit

from pipeline.redact import redact_url

__all__ = [
    "FILE_FORMAT_DENYLIST",
    "MAX_URL_CHARS",
    "PROTOCOL_WHITELISTS",
    "STREAM_FORMATS",
    "UrlProblem",
    "derive_id",
    "file_path",
    "normalise_url",
    "protocol_whitelist",
    "resolve_url",
    "scheme_name",
    "url_problem",
    "v4l2_device",
    "whip_name",
]

# Longer than any camera, playlist or file URL; a longer one is refused before parsing.
MAX_URL_CHARS = 4096

# C0 controls, DEL and C1 controls.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
# What urlsplit takes for a scheme: the letters before the first ':' (no '//' needed).
_SCHEME_NAME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")

# FFmpeg protocols each scheme needs, and nothing more. RTSP opens its control
# connection over tcp (tls for rtsps) and, with transport: udp, its media over
# rtp/udp; a file needs the file protocol only (no playlist may point at http).
# An HLS playlist's segments and keys are opened with its URL's list, so a playlist
# fetched over http(s) can name http(s) segments (crypto: AES-128 segments) but
# never a local file; https is http over tls over tcp (FFmpeg needs no "http" for
# it, so a redirect from https to plain http fails). SRT is libsrt's own UDP; a
# webcam is a device the video4linux2 demuxer opens itself, with no protocol.
PROTOCOL_WHITELISTS: dict[str, str] = {
    "file": "file",
    "rtsp": "rtsp,rtp,udp,tcp",
    "rtsps": "rtsps,rtsp,rtp,udp,tcp,tls",
    "http": "http,tcp,crypto",
    "https": "https,tls,tcp,crypto",
    "udp": "udp",
    "rtp": "rtp,udp",
    "srt": "srt",
    "v4l2": "file",
}


# Demuxers a file source may not use: their content names other files or hosts for
# FFmpeg to open (playlists, descriptions, scripts), or they are capture devices. A
# file is probed by content, so clip.mp4 holding an HLS playlist or an SDP
# description would otherwise be read as one. Every other demuxer is allowed.
FILE_FORMAT_DENYLIST = frozenset(
    {
        "hls", "dash", "concat", "sdp", "rtsp", "rtp", "sap", "imf", "webm_dash_manifest",
        "avisynth", "vapoursynth", "lavfi",
        "alsa", "fbdev", "kmsgrab", "oss", "video4linux2", "v4l2", "x11grab", "xcbgrab", "pulse",
        "jack", "openal", "sndio", "decklink", "android_camera", "dshow", "gdigrab", "vfwcap",
        "avfoundation", "libcdio", "libdc1394", "iec61883",
    }
)  # fmt: skip


# The demuxer of each stream scheme that is not probed among the file formats:
# ``format_whitelist`` for the first two, the forced input format for a webcam
# (a device cannot be probed). RTP carries MPEG-TS (payload type 33).
STREAM_FORMATS: dict[str, str] = {
    "udp": "mpegts",
    "srt": "mpegts",
    "rtp": "rtp",
    "v4l2": "video4linux2",
}


def protocol_whitelist(scheme: str) -> str:
    """FFmpeg's ``protocol_whitelist`` for a source scheme (``file`` for plain paths)."""
    return PROTOCOL_WHITELISTS[scheme]


class UrlProblem(NamedTuple):
    """Why a URL cannot be a source, and what to do about it."""

    problem: str
    hint: str = ""

    def __str__(self) -> str:
        return f"{self.problem}; {self.hint}" if self.hint else self.problem


def _show(char: str) -> str:
    return repr(char)[1:-1]


_PERCENT_ENCODE_HINT = "e.g. the password p@ss/1 is written rtsp://user:p%40ss%2F1@cam/stream"


def url_problem(url: str) -> UrlProblem | None:
    """Why ``url`` may not be used as a source, or None. Never echoes the userinfo."""
    if len(url) > MAX_URL_CHARS:
        return UrlProblem(f"the URL is longer than {MAX_URL_CHARS} characters")
    control = _CONTROL.search(url)
    if control:
        return UrlProblem(
            f"the URL contains a control character ({_show(control.group())}) at position {control.start()}",
            "remove it (percent-encode it if it is really part of the URL)",
        )
    scheme = _SCHEME.match(url)
    if scheme is None:
        return None  # a plain file path: any other character is a file name's business
    rest = url[scheme.end() :]
    if " " in rest:
        return UrlProblem("the URL contains a space", "percent-encode it as %20")
    # The authority ends at the first '/', '?' or '#'; userinfo is what precedes its '@'.
    end = len(rest)
    for sep in "/?#":
        pos = rest.find(sep)
        if pos != -1:
            end = min(end, pos)
    authority, tail = rest[:end], rest[end:]
    if "@" in tail:
        return UrlProblem(
            "the URL has an '@' after the host; if the password contains '@', '/', '?' or '#', "
            "percent-encode them (%40, %2F, %3F, %23)",
            _PERCENT_ENCODE_HINT,
        )
    if authority.count("@") > 1:
        return UrlProblem(
            "the URL's user or password contains a raw '@'; percent-encode it as %40", _PERCENT_ENCODE_HINT
        )
    return _address_problem(scheme.group(1).lower(), authority)


# Schemes that connect to a host: the URL must name one (udp://, rtp:// and srt:// may
# leave it out to listen on every address).
_NEEDS_HOST = ("rtsp", "rtsps", "http", "https")
_PORTED = (*_NEEDS_HOST, "udp", "rtp", "srt")


def _address_problem(scheme: str, authority: str) -> UrlProblem | None:
    """A host and port that can never be connected to (before any attempt is made)."""
    if scheme not in _PORTED:
        return None
    hostport = authority.rpartition("@")[2]  # never look at (or echo) the userinfo
    try:
        parts = urlsplit(f"{scheme}://{hostport}")
        port = parts.port  # ValueError: not a number, or outside 0-65535
    except ValueError:
        return UrlProblem(
            f"the URL's host and port {hostport!r} are malformed",
            "write HOST, HOST:PORT or [IPv6]:PORT with a port of 1-65535",
        )
    if port == 0:
        return UrlProblem(f"the URL's port in {hostport!r} is 0", "use a port of 1-65535")
    if scheme in _NEEDS_HOST and not parts.hostname:
        example = "192.168.1.20:554/stream" if scheme.startswith("rtsp") else "192.168.1.20/video.mjpg"
        return UrlProblem(f"the {scheme}:// URL names no host", f"e.g. {scheme}://{example}")
    return None


# -- what a URL names ---------------------------------------------------------------------

# A plain path naming a video4linux2 device is a webcam, not a file.
V4L2_PATH = re.compile(r"/dev/video\d+")


def normalise_url(url: str) -> str:
    """``url`` as the scheme check should see it: a plain path that is a webcam once
    normalised (``/dev/./video0``, ``/dev/video0/``) becomes that device's path."""
    if url.startswith("/dev/"):  # a path: no scheme
        normal = posixpath.normpath(url)
        if V4L2_PATH.fullmatch(normal):
            return normal
    return url


def scheme_name(url: str) -> str:
    """The scheme a source URL names: ``rtsp``, ``file`` for a plain path, ``v4l2`` for ``/dev/videoN``."""
    # The scheme alone: a malformed rest of the URL (an unclosed '[') is url_problem's to report.
    found = _SCHEME_NAME.match(url)
    scheme = found.group(1).lower() if found else ""
    if not scheme and V4L2_PATH.fullmatch(normalise_url(url)):
        return "v4l2"
    # No scheme, or one letter (a Windows drive, C:\clips\a.mp4): a file path.
    return scheme if len(scheme) > 1 else "file"


def file_path(url: str) -> Path:
    """The path a file source reads: a plain path, or ``file://`` (``file://localhost/p`` is
    ``/p``, RFC 8089; any other host part is kept as written, a path relative to the config)."""
    parts = urlsplit(url)
    if parts.scheme != "file":
        return Path(url)
    return Path(parts.path if parts.netloc == "localhost" else parts.netloc + parts.path)


def missing_file(path: Path) -> tuple[str, str] | None:
    """Why a file source cannot read ``path`` (problem, hint), or None when it is a file."""
    if path.is_file():
        return None
    if path.is_dir():
        return (f"{path} is a folder, not a video file", "name a file in it")
    if path.exists():
        return (f"{path} is not a regular file", "give a video file; a webcam is /dev/videoN")
    return (f"file not found: {path}", "relative paths start at the folder of this file")


def whip_name(url: str) -> str:
    """The ``<id>`` of ``whip://<id>``: the name publishers use in ``/whip/<id>``."""
    parts = urlsplit(url)
    return parts.netloc or parts.path.strip("/")


def v4l2_device(url: str) -> str:
    """The device path of a webcam URL: ``/dev/video0``, ``v4l2:///dev/video0`` or ``v4l2://0``."""
    parts = urlsplit(url)
    if parts.scheme != "v4l2":
        return normalise_url(url)
    if parts.netloc.isdigit():
        return f"/dev/video{parts.netloc}"
    path = parts.netloc + parts.path
    normal = posixpath.normpath(path) if path.startswith("/dev/") else path
    return normal if V4L2_PATH.fullmatch(normal) else path


def resolve_url(url: str, base: Path) -> str:
    """Make a relative file path absolute against ``base``; other URLs pass through."""
    if scheme_name(url) != "file":
        return url
    path = file_path(url)
    return str(path if path.is_absolute() else (base / path).resolve())


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


# How each scheme's URL becomes a readable id (before cleaning to [A-Za-z0-9_-]);
# a scheme not here (an unknown one, refused elsewhere) is named like a file.
_ID_FROM: dict[str, Callable[[str], str]] = {
    "file": _id_from_file,
    "test": _id_from_test,
    "rtsp": _id_from_camera,
    "rtsps": _id_from_camera,
    "whip": whip_name,
    "http": _id_from_http,
    "https": _id_from_http,
    "udp": _id_from_port,
    "rtp": _id_from_port,
    "srt": _id_from_port,
    "v4l2": _id_from_v4l2,
}


def derive_id(url: str) -> str:
    """A readable id from a URL: the file stem, the camera path, the WHIP name, ``udp_5000``..."""
    id_from = _ID_FROM.get(scheme_name(url), _id_from_file)
    # A password must never become part of an id (a subject and a metric label).
    raw = id_from(redact_url(url))
    cleaned = re.sub(r"[^A-Za-z0-9_-]+", "_", raw).strip("_")[:64]
    return cleaned or "source"
