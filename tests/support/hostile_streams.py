"""Hostile MJPEG cameras on loopback (Python's http.server): streams that try to hurt the reader.

* :class:`MjpegServer` answers ``GET /live.mjpg`` with an endless
  ``multipart/x-mixed-replace`` stream whose parts come from ``parts(i)``:
  :func:`random_parts` (bytes no decoder accepts) or :func:`growing_jpegs`
  (small JPEGs, then one of a huge size).
"""

from __future__ import annotations

import http.server
import os
import threading
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import cv2
import numpy as np

__all__ = ["MjpegServer", "flat_jpeg", "h264_size_switch", "random_parts", "switching_parts"]

BOUNDARY = "hostileframe"

Parts = Callable[[int], bytes]


def random_parts(size: int = 20_000) -> Parts:
    """Parts of ``size`` random bytes: they demux as packets and never decode."""
    return lambda _index: os.urandom(size)


def flat_jpeg(width: int, height: int) -> bytes:
    """A flat grey JPEG (4:2:0) of ``width`` x ``height``: a few KB whatever the size."""
    ok, data = cv2.imencode(".jpg", np.full((height, width, 3), 90, np.uint8))
    assert ok
    return bytes(data)


def switching_parts(small: bytes, huge: bytes, after: int) -> Parts:
    """``small`` for the first ``after`` parts, then ``huge``."""
    return lambda index: small if index < after else huge


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        srv = self.server
        self.send_response(200)
        self.send_header("Content-Type", f"multipart/x-mixed-replace; boundary={BOUNDARY}")
        self.end_headers()
        index = 0
        with srv.lock:
            srv.connections += 1
        try:
            while not srv.closing.is_set():
                body = srv.parts(index)
                head = f"--{BOUNDARY}\r\nContent-Type: image/jpeg\r\nContent-Length: {len(body)}\r\n\r\n"
                self.wfile.write(head.encode() + body + b"\r\n")
                self.wfile.flush()
                index += 1
                srv.closing.wait(srv.interval)
        except OSError:
            pass  # the reader went away


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, parts: Parts, interval: float) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.parts, self.interval = parts, interval
        self.closing = threading.Event()
        self.lock = threading.Lock()
        self.connections = 0


class MjpegServer:
    """An endless MJPEG stream at ``/live.mjpg`` on 127.0.0.1, one part every ``interval`` s."""

    def __init__(self, parts: Parts, interval: float = 0.05) -> None:
        self._server = _Server(parts, interval)
        self.port: int = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/live.mjpg"

    @property
    def connections(self) -> int:
        return self._server.connections

    def __enter__(self) -> MjpegServer:
        threading.Thread(target=self._server.serve_forever, name="hostile-mjpeg", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.closing.set()
        self._server.shutdown()
        self._server.server_close()


def _h264_annexb(width: int, height: int, frames: int) -> bytes:
    """``frames`` flat frames encoded by libx264 as an Annex B stream (SPS/PPS in band)."""
    codec = av.CodecContext.create("libx264", "w")
    codec.width, codec.height, codec.pix_fmt = width, height, "yuv420p"
    codec.time_base = Fraction(1, 10)
    codec.options = {"preset": "ultrafast", "g": "10"}
    data = bytearray()
    image = np.full((height, width, 3), 100, np.uint8)
    for i in range(frames):
        frame = av.VideoFrame.from_ndarray(image, format="rgb24")
        frame.pts = i
        for packet in codec.encode(frame):
            data += bytes(packet)
    for packet in codec.encode(None):
        data += bytes(packet)
    return bytes(data)


def h264_size_switch(path: Path, small: tuple[int, int], huge: tuple[int, int], frames: int = 60) -> Path:
    """An MPEG-TS of ``frames`` small H.264 frames whose last frame is an I-frame of ``huge`` size.

    Two encodes concatenated: the stream's declared size is the small one, so only
    the decoder meets the huge picture.
    """
    raw = path.with_suffix(".h264")
    raw.write_bytes(_h264_annexb(*small, frames) + _h264_annexb(*huge, 1))
    with av.open(str(raw), format="h264") as src, av.open(str(path), "w", format="mpegts") as out:
        stream = out.add_stream("h264", rate=10)
        stream.width, stream.height = small
        for index, packet in enumerate(src.demux(src.streams.video[0])):
            if packet.size == 0:
                continue
            packet.stream = stream
            packet.pts = packet.dts = index * 9000  # 90 kHz, 10 fps
            packet.time_base = Fraction(1, 90000)
            out.mux(packet)
    raw.unlink()
    return path
