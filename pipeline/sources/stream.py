"""Live streams FFmpeg opens by URL: webcams, http(s) (MJPEG, HLS), MPEG-TS over UDP, RTP and SRT.

::

    sources:
      - url: /dev/video0                        # or v4l2:///dev/video0?video_size=1280x720&framerate=30
      - url: http://cam.local/video.mjpg        # MJPEG (multipart/x-mixed-replace)
      - url: https://cdn.example/live/index.m3u8
        tls_verify: true                        # the default: the system's CAs check the server
      - url: udp://0.0.0.0:5000                 # MPEG-TS sent to this port (multicast: udp://239.0.0.1:5000)
      - url: rtp://0.0.0.0:5004                 # MPEG-TS over RTP (payload type 33)
      - url: srt://relay.local:9000?streamid=cam1   # when FFmpeg has libsrt
        read_timeout: 5.0
        stall_timeout: 5.0

Reconnects, backoff and the stall watchdog are :class:`~pipeline.sources.live.LiveSource`'s;
this class says how each scheme is opened: which demuxer (``pipeline.urls.STREAM_FORMATS``
and the protocol whitelist), and the few FFmpeg options that make a live stream
start quickly and fail cleanly. An http(s) URL of a file (``.mp4``...) is not live
and is read by :class:`~pipeline.sources.file.FileSource` instead.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlsplit, urlunsplit

from pipeline.config import SourceConfig
from pipeline.sources.base import SourceContext
from pipeline.sources.live import LiveSource
from pipeline.urls import v4l2_device

__all__ = ["StreamSource"]

# Microseconds FFmpeg probes a stream before the first frame: a live MPEG-TS stream
# has its codec parameters in the first keyframe, and the default (5 s) only delays
# every (re)connect.
_ANALYZE_US = 1_000_000
# Bytes of kernel socket buffer for UDP-based streams: a keyframe is tens of datagrams at once.
_UDP_BUFFER = 4 << 20


class StreamSource(LiveSource):
    """A live http(s), udp, rtp, srt or v4l2 stream: reconnects with backoff, never gives up while running."""

    schemes = ("http", "https", "udp", "rtp", "srt", "v4l2")

    def __init__(self, config: SourceConfig, context: SourceContext | None = None) -> None:
        super().__init__(config, context)
        self.scheme = config.scheme
        if self.scheme == "v4l2":
            # The device's options are the URL's query; FFmpeg opens the path.
            parts = urlsplit(config.url)
            self._device_options = dict(parse_qsl(parts.query)) if parts.scheme == "v4l2" else {}
            self.url = v4l2_device(config.url)
        elif self.scheme in ("udp", "rtp"):
            # A socket read that returns nothing for read_timeout ends the read, so an
            # abandoned reader gives its port back (FFmpeg: microseconds, in the URL).
            self.url = _with_query(config.url, timeout=str(int(config.read_timeout * 1_000_000)))

    def input_format(self) -> str | None:
        return "video4linux2" if self.scheme == "v4l2" else None

    def open_options(self) -> dict[str, str]:
        options = super().open_options()
        cfg = self.config
        if self.scheme == "v4l2":
            return {**options, **self._device_options}
        options["analyzeduration"] = str(_ANALYZE_US)
        options["flags"] = "low_delay"
        if self.scheme in ("http", "https"):
            # A live response has no length: no range requests, and a dead server ends
            # the read after read_timeout (microseconds) instead of never.
            options["seekable"] = "0"
            options["rw_timeout"] = str(int(cfg.read_timeout * 1_000_000))
        elif self.scheme in ("udp", "rtp"):
            options["buffer_size"] = str(_UDP_BUFFER)
            # A burst larger than FFmpeg's ring is dropped packets, not a dead stream.
            options["overrun_nonfatal"] = "1"
            options["fifo_size"] = str(_UDP_BUFFER // 188)
        elif self.scheme == "srt":
            options["rw_timeout"] = str(int(cfg.read_timeout * 1_000_000))
            options["connect_timeout"] = str(int(cfg.open_timeout * 1000))  # milliseconds
        return options


def _with_query(url: str, **params: str) -> str:
    """``url`` with ``params`` added to its query unless it sets them already."""
    parts = urlsplit(url)
    given = dict(parse_qsl(parts.query, keep_blank_values=True))
    extra = "&".join(f"{k}={v}" for k, v in params.items() if k not in given)
    if not extra:
        return url
    query = f"{parts.query}&{extra}" if parts.query else extra
    return urlunsplit(parts._replace(query=query))
