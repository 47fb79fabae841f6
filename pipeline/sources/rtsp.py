"""RTSP cameras: a live source that reconnects on its own and never gives up while running.

::

    sources:
      - id: gate
        url: rtsp://user:secret@10.0.0.7:554/stream1   # shown in logs as rtsp://***@10.0.0.7:554/...
        transport: tcp        # tcp (RTP interleaved in the RTSP connection) | udp
        open_timeout: 10.0    # seconds to connect, negotiate and find the stream
        read_timeout: 5.0     # seconds one socket read may wait before the connection counts as dead
        stall_timeout: 5.0    # seconds without a decoded frame before reconnecting
        queue_size: 8         # frames waiting for the graph; the oldest is dropped when full
        reconnect:
          min_delay: 0.5      # first wait after a failure
          max_delay: 10.0     # cap of the doubling wait
          jitter: 0.2         # +-20% so cameras behind one switch do not retry in lockstep
        allow_redirects: false  # a 3xx to another host fails the attempt (pipeline.sources.redirects)

Reconnects, backoff, the stall watchdog and the timeline across connections are
:class:`~pipeline.sources.live.LiveSource`'s; this module says how FFmpeg opens an
RTSP camera (transport, socket timeout, video only) and asks the camera about
redirects before handing it the credentials.
"""

from __future__ import annotations

from typing import Any

from pipeline.sources.live import LiveSource
from pipeline.sources.redirects import check_redirect, has_credentials

__all__ = ["RtspSource"]

# FFmpeg probes the stream this long (microseconds) before the first frame is returned.
# Its default (5 s cap, ~2 s in practice for H.264 over RTSP) only delays every reconnect:
# the codec parameters come in the SDP and the first keyframe.
_ANALYZE_US = 500_000


class RtspSource(LiveSource):
    """An RTSP/RTSPS camera: reconnects with backoff, detects stalls, never gives up while running."""

    schemes = ("rtsp", "rtsps")

    def open_options(self) -> dict[str, str]:
        cfg = self.config
        options = {
            "rtsp_transport": cfg.transport,
            # Per socket operation, in microseconds (FFmpeg 5+ calls it `timeout`; the old
            # `stimeout` is gone and an unknown option is silently ignored).
            "timeout": str(int(cfg.read_timeout * 1_000_000)),
            # Audio would only cost another RTP session; the graph uses video.
            "allowed_media_types": "video",
            "analyzeduration": str(_ANALYZE_US),
            "flags": "low_delay",
        }
        if cfg.transport == "udp":
            # UDP may reorder: wait at most 0.1 s for a late packet instead of FFmpeg's
            # default queue, and give keyframes (tens of packets at once) socket room.
            options["max_delay"] = "100000"
            options["buffer_size"] = str(1 << 20)
        return options

    def open(self) -> Any:
        # FFmpeg would follow a redirect to another host with the credentials: ask first.
        if not self.config.allow_redirects and has_credentials(self.url):
            check_redirect(self.id, self.url, self.config.open_timeout)
        return super().open()
