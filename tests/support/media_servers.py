"""Real media servers on loopback for input tests: http.server (files, HLS, MJPEG) and ffmpeg pushers.

* :class:`MediaHttpServer` serves a folder (an MP4, an HLS playlist and its
  segments) and, at ``/live.mjpg``, an endless ``multipart/x-mixed-replace``
  stream of JPEGs whose frame ``i`` is filled with :func:`level` ``(i)``. It can be
  stopped and started again on the same port, as a camera that reboots.
* :func:`level_clip` writes an H.264 MP4 whose frame ``i`` is filled with ``level(i)``.
* :class:`FfmpegPush` runs ``ffmpeg -re`` sending a clip as MPEG-TS over UDP or RTP.
"""

from __future__ import annotations

import functools
import http.server
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import av
import cv2
import numpy as np

__all__ = ["FfmpegPush", "MediaHttpServer", "ffmpeg_cli", "level", "level_clip", "level_of"]

BOUNDARY = "vidpipeframe"


def level(index: int) -> int:
    """The grey level of frame ``index`` in every test stream: steps of 20, so codecs cannot blur them."""
    return 20 + (index * 20) % 220


def level_of(image: np.ndarray) -> int:
    """The grey level a decoded frame shows (the nearest step of :func:`level`)."""
    return round(float(image.mean()))


def level_clip(path: Path, frames: int, width: int = 160, height: int = 120, fps: int = 10) -> Path:
    """An H.264 MP4 of ``frames`` flat grey frames, frame ``i`` at ``level(i)``; a keyframe each second."""
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"g": str(fps), "bf": "0"}
        for i in range(frames):
            image = np.full((height, width, 3), level(i), np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def _jpeg(index: int, width: int, height: int) -> bytes:
    ok, data = cv2.imencode(".jpg", np.full((height, width, 3), level(index), np.uint8))
    assert ok
    return bytes(data)


class _Handler(http.server.SimpleHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        if self.path.split("?")[0] != "/live.mjpg":
            super().do_GET()
            return
        srv = self.server
        self.send_response(200)
        self.send_header("Content-Type", f"multipart/x-mixed-replace; boundary={BOUNDARY}")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        index = 0
        try:
            while not srv.closing.is_set():
                body = _jpeg(index, srv.width, srv.height)
                head = f"--{BOUNDARY}\r\nContent-Type: image/jpeg\r\nContent-Length: {len(body)}\r\n\r\n"
                self.wfile.write(head.encode() + body + b"\r\n")
                self.wfile.flush()
                index += 1
                srv.sent += 1
                srv.closing.wait(1.0 / srv.fps)
        except (BrokenPipeError, ConnectionResetError):
            pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int, directory: Path, fps: float, width: int, height: int) -> None:
        handler = functools.partial(_Handler, directory=str(directory))
        super().__init__(("127.0.0.1", port), handler)
        self.closing = threading.Event()
        self.fps, self.width, self.height = fps, width, height
        self.sent = 0


class MediaHttpServer:
    """Files from ``directory`` and an endless MJPEG stream at ``/live.mjpg``, on 127.0.0.1."""

    def __init__(
        self, directory: Path, fps: float = 20.0, width: int = 160, height: int = 120, port: int = 0
    ) -> None:
        self.directory, self.fps, self.width, self.height = directory, fps, width, height
        self.port = port
        self._server: _Server | None = None

    def start(self) -> MediaHttpServer:
        self._server = _Server(self.port, self.directory, self.fps, self.width, self.height)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, name="media-http", daemon=True).start()
        return self

    def stop(self) -> None:
        """Close the listener and every open response (a live stream ends mid-frame)."""
        if self._server is None:
            return
        self._server.closing.set()
        self._server.shutdown()
        self._server.server_close()
        self._server = None

    @property
    def mjpeg_sent(self) -> int:
        return self._server.sent if self._server is not None else 0

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path.lstrip('/')}"

    def __enter__(self) -> MediaHttpServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def ffmpeg_cli() -> str | None:
    """The ffmpeg command, or None when it is not installed."""
    return shutil.which("ffmpeg")


class FfmpegPush:
    """``ffmpeg -re -stream_loop -1 -i CLIP -c copy -f mpegts|rtp_mpegts URL``, stopped on exit."""

    def __init__(self, clip: Path, url: str, muxer: str = "mpegts") -> None:
        ffmpeg = ffmpeg_cli()
        assert ffmpeg is not None, "needs the ffmpeg command"
        self.cmd = [ffmpeg, "-hide_banner", "-loglevel", "error", "-re", "-stream_loop", "-1"]
        self.cmd += ["-i", str(clip), "-c", "copy", "-f", muxer, url]
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> FfmpegPush:
        self._proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.1)
        if self._proc.poll() is not None:
            raise RuntimeError(
                f"ffmpeg exited: {self._proc.stderr.read().decode() if self._proc.stderr else ''}"
            )
        return self

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def __enter__(self) -> FfmpegPush:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
