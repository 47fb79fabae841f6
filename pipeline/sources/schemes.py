"""The source schemes: which URL schemes exist, what each means and which keys it takes.

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
schemes without importing the source classes (those register themselves in
:mod:`pipeline.sources.registry`, which only the runtime imports). A scheme that
needs a part of FFmpeg this build may lack (SRT, video4linux2) says so when the
URL is checked, before anything runs; a misspelt one gets a did-you-mean.
"""

from __future__ import annotations

import difflib
import functools
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

from pipeline.redact import redact_url
from pipeline.urls import V4L2_PATH, UrlProblem, scheme_name, url_problem, v4l2_device

__all__ = [
    "SCHEMES",
    "SCHEME_OPTIONS",
    "STREAM_QUERY_OPTIONS",
    "Scheme",
    "check_url",
    "is_live",
    "resolve_live",
    "scheme_of",
    "url_check",
]

# An http(s) URL whose path ends in one of these is a finite file (lossless, ends);
# any other (MJPEG, HLS playlists, MPEG-TS streams) is live. ``live:`` overrides it.
FINITE_HTTP_SUFFIXES = (".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi")
# What a v4l2:// URL's query may set: FFmpeg's video4linux2 demuxer options.
V4L2_OPTIONS = ("video_size", "framerate", "input_format", "pixel_format", "standard")
# What a udp:// or rtp:// URL's query may set: the multicast interface and source
# filters, each an IP address (a list for sources/block). Every other FFmpeg option
# (fifo_size, buffer_size, localport, reuse, timeout...) is vidpipe's to set: a
# query's fifo_size=5000000 took 420 MB, its timeout=0 undid the read timeout.
STREAM_QUERY_OPTIONS = ("localaddr", "sources", "block")


def _http_live(url: str) -> bool:
    return not urlsplit(url).path.lower().endswith(FINITE_HTTP_SUFFIXES)


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
    """One URL scheme: whether its sources are live, the keys it takes, what it needs.

    Live sources drop the oldest frame when the graph is behind and reconnect;
    finite ones (files) block, so every frame is processed, and end.
    """

    name: str
    # True: always live; False: always a finite file; None: either, by ``live_by_url``.
    live: bool | None
    # The scheme-specific SourceConfig keys it takes, beyond url, id, queue_size,
    # max_fps and max_pixels, which every source takes. A key that another scheme
    # takes and this one does not (``transport:`` on a file) is a config error.
    options: tuple[str, ...] = ()
    # When it can be both: whether a URL is live unless ``live:`` says otherwise.
    live_by_url: Callable[[str], bool] | None = None
    # Why this FFmpeg cannot serve the scheme (a protocol or demuxer it lacks), or None.
    requires: Callable[[], str | None] | None = None
    # What is wrong with a URL of this scheme beyond the common checks (its query), or None.
    check: Callable[[str], UrlProblem | None] | None = None

    @property
    def can_be_live(self) -> bool:
        return self.live is not False

    @property
    def can_be_finite(self) -> bool:
        return self.live is not True

    def live_for(self, url: str) -> bool:
        """Whether a source of ``url`` is live unless ``live:`` says otherwise."""
        if self.live is None:
            return self.live_by_url(url) if self.live_by_url else True
        return self.live


def _v4l2_problem(url: str) -> UrlProblem | None:
    device = v4l2_device(url)
    if not V4L2_PATH.fullmatch(device):
        return UrlProblem(f"a webcam is /dev/videoN, v4l2:///dev/videoN or v4l2://N, not {redact_url(url)!r}")
    for key, _ in parse_qsl(urlsplit(url).query, keep_blank_values=True):
        if key not in V4L2_OPTIONS:
            return UrlProblem(f"unknown webcam option {key!r}", f"use {', '.join(V4L2_OPTIONS)}")
    return None


def _stream_query_problem(url: str) -> UrlProblem | None:
    """A udp:// or rtp:// query may name the multicast interface and source filters only."""
    scheme = urlsplit(url).scheme.lower()
    allowed = ", ".join(STREAM_QUERY_OPTIONS)
    for key, value in parse_qsl(urlsplit(url).query, keep_blank_values=True):
        if key not in STREAM_QUERY_OPTIONS:
            return UrlProblem(
                f"{scheme}:// URL option {key!r} is not allowed",
                f"a {scheme}:// URL takes {allowed}; vidpipe sets FFmpeg's buffers and timeouts itself",
            )
        for address in value.split(",") if key != "localaddr" else [value]:
            try:
                ipaddress.ip_address(address)
            except ValueError:
                return UrlProblem(
                    f"{scheme}:// URL option {key}={value!r} is not an IP address",
                    "e.g. localaddr=192.168.1.10 or sources=10.0.0.5,10.0.0.6",
                )
    return None


@dataclass(frozen=True)
class TestPattern:
    """What a ``test://`` URL asks for: ``test://?width=640&height=360&fps=25&frames=N&id=NAME``."""

    __test__ = False  # not a pytest class

    width: int = 640
    height: int = 360
    fps: float = 25.0
    frames: int | None = None  # None: it never ends


TEST_OPTIONS = ("width", "height", "fps", "frames", "id")


def parse_test_url(url: str) -> TestPattern:
    """The pattern a ``test://`` URL asks for; ValueError says which parameter is wrong and how."""
    pairs = parse_qsl(urlsplit(url).query, keep_blank_values=True)
    params = dict(pairs)
    if len(params) < len(pairs):
        # Which one wins is a parser's choice (the last, here): say so rather than guess.
        twice = next(key for i, (key, _) in enumerate(pairs) if key in dict(pairs[:i]))
        raise ValueError(f"test:// parameter {twice!r} is given twice; keep one")
    for key in params:
        if key not in TEST_OPTIONS:
            close = difflib.get_close_matches(key, TEST_OPTIONS, n=1)
            hint = f"did you mean {close[0]}?" if close else f"use {', '.join(TEST_OPTIONS)}"
            raise ValueError(f"unknown test:// parameter {key!r}; {hint}")
    bounds = {"width": (16, 7680), "height": (16, 4320), "frames": (1, 1 << 40)}
    values: dict[str, int | float] = {}
    for key, (low, high) in bounds.items():
        if key in params:
            try:
                values[key] = int(params[key])
            except ValueError:
                raise ValueError(f"test:// parameter {key}={params[key]!r} is not a whole number") from None
            if not low <= values[key] <= high:
                raise ValueError(f"test:// parameter {key}={params[key]} is out of range; use {low}-{high}")
    if "fps" in params:
        try:
            fps = float(params["fps"])
        except ValueError:
            fps = float("nan")
        if not 0 < fps <= 240:  # NaN fails this too
            raise ValueError(
                f"test:// parameter fps={params['fps']!r} is out of range; use a number in (0, 240]"
            )
        values["fps"] = fps
    return TestPattern(**values)  # type: ignore[arg-type]


def _test_problem(url: str) -> UrlProblem | None:
    try:
        parse_test_url(url)
    except ValueError as exc:
        problem, _, hint = str(exc).partition("; ")
        return UrlProblem(problem, hint)
    return None


def _whip_problem(url: str) -> UrlProblem | None:
    if "@" in urlsplit(url).netloc:
        # The name is what publishers put in /whip/<name>: it has no user or password.
        return UrlProblem("a whip:// URL is whip://<name>: it takes no user or password")
    return None


_RTSP_OPTIONS = (
    "transport", "open_timeout", "read_timeout", "stall_timeout", "reconnect", "allow_redirects", "decode",
)  # fmt: skip
_STREAM_OPTIONS = ("open_timeout", "read_timeout", "stall_timeout", "reconnect", "decode")
_HTTP_OPTIONS = ("live", "tls_verify", "loop", "realtime", *_STREAM_OPTIONS)

SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("file", live=False, options=("loop", "realtime", "decode")),
        Scheme("test", live=True, check=_test_problem),
        Scheme("rtsp", live=True, options=_RTSP_OPTIONS),
        Scheme("rtsps", live=True, options=_RTSP_OPTIONS),
        Scheme("whip", live=True, options=("open_timeout", "stall_timeout"), check=_whip_problem),
        Scheme("http", live=None, options=_HTTP_OPTIONS, live_by_url=_http_live),
        Scheme("https", live=None, options=_HTTP_OPTIONS, live_by_url=_http_live),
        Scheme("udp", live=True, options=_STREAM_OPTIONS, check=_stream_query_problem),
        Scheme("rtp", live=True, options=_STREAM_OPTIONS, check=_stream_query_problem),
        Scheme("srt", live=True, options=_STREAM_OPTIONS, requires=_needs_srt),
        Scheme(
            "v4l2",
            live=True,
            options=("open_timeout", "read_timeout", "stall_timeout", "reconnect"),
            requires=_needs_v4l2,
            check=_v4l2_problem,
        ),
    )
}
# The scheme-specific keys of each scheme, by name.
SCHEME_OPTIONS: dict[str, tuple[str, ...]] = {name: s.options for name, s in SCHEMES.items()}


def _unknown_scheme(url: str) -> UrlProblem | None:
    name = scheme_name(url)
    if name in SCHEMES:
        return None
    # Swapped letters first (rstp is rtsp, not rtp), then the closest spelling.
    close = [s for s in SCHEMES if sorted(s) == sorted(name)] or difflib.get_close_matches(
        name, list(SCHEMES), n=1, cutoff=0.6
    )
    hint = f"did you mean {close[0]}://?" if close else f"known schemes: {', '.join(SCHEMES)}"
    return UrlProblem(f"unsupported source scheme {name!r} in {redact_url(url)!r}", hint)


def url_check(url: str) -> UrlProblem | None:
    """Why ``url`` cannot be a source and what to do, or None.

    The one check config files, ``--source``, ``POST /v1/sources``, embedding and
    the fleet's desired set all go through: what :func:`pipeline.urls.url_problem`
    refuses (control characters, spaces, a raw ``@`` in the password), then an
    unknown scheme (with a did-you-mean), then a scheme this FFmpeg cannot serve
    (SRT without libsrt), then the scheme's own URL checks (a webcam's or a UDP
    stream's query options).
    """
    problem = url_problem(url) or _unknown_scheme(url)
    if problem:
        return problem
    scheme = SCHEMES[scheme_name(url)]
    if scheme.requires is not None:
        missing = scheme.requires()
        if missing:
            return UrlProblem(f"{scheme.name}:// sources are not available: {missing}")
    return scheme.check(url) if scheme.check is not None else None


def check_url(url: str) -> str | None:
    """:func:`url_check` as one line (problem and hint), or None."""
    problem = url_check(url)
    return str(problem) if problem else None


def scheme_of(url: str) -> Scheme:
    """The scheme of a source URL; raises ValueError for an unknown one."""
    problem = _unknown_scheme(url)
    if problem:
        raise ValueError(str(problem))
    return SCHEMES[scheme_name(url)]


def is_live(url_or_scheme: str) -> bool:
    """Whether a source of this URL (or scheme name) is live by default: drops when behind, never ends."""
    if url_or_scheme in SCHEMES:
        return SCHEMES[url_or_scheme].live is not False
    return scheme_of(url_or_scheme).live_for(url_or_scheme)


def resolve_live(url: str, live: bool | None) -> bool:
    """Whether a source of ``url`` is live, given the config's ``live:`` (None: by the URL).

    Raises ValueError when the scheme cannot be what ``live`` asks (a live file, a
    finite RTSP camera).
    """
    scheme = scheme_of(url)
    if live is None:
        return scheme.live_for(url)
    if live and not scheme.can_be_live:
        raise ValueError(f"live: {scheme.name} sources are never live; remove live: true")
    if not live and not scheme.can_be_finite:
        raise ValueError(
            f"live: {scheme.name}:// sources are always live; live: false applies to http(s) files only"
        )
    return live
