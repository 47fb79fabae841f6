"""A loopback RTSP server for tests and benchmarks, built on GStreamer's RTSP server.

Run it with the system Python (it needs PyGObject and gst-rtsp-server)::

    /usr/bin/python3 tests/support/rtsp_server.py --port 8554 \
        --mount /live=live --mount /clip=samples/generated/demo.mp4

``/live`` (the value ``live``) is an endless 320x240 15 fps H.264 test pattern
with a keyframe every second; any other value is an MP4 file (H.264) that is
sent once per client. It prints ``READY <port>`` on stdout once it listens and
exits cleanly on SIGTERM or SIGINT.

:class:`RtspTestServer` drives that script from the tests' own interpreter
(which cannot import ``gi``): start, wait for READY, kill, restart on the same
port, stop.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SYSTEM_PYTHON = "/usr/bin/python3"

LIVE_PIPELINE = (
    "( videotestsrc is-live=true pattern=ball "
    "! video/x-raw,width={width},height={height},framerate={fps}/1 "
    "! x264enc tune=zerolatency speed-preset=ultrafast key-int-max={fps} "
    # SPS/PPS before every keyframe, so a client that joins a running stream decodes
    # from the next keyframe instead of waiting for out-of-band parameters.
    "! rtph264pay name=pay0 pt=96 config-interval=-1 )"
)
CLIP_PIPELINE = (
    "( filesrc location={path} ! qtdemux ! h264parse ! rtph264pay name=pay0 pt=96 config-interval=-1 )"
)


# -- the server (system Python, PyGObject) --------------------------------------------------


def serve(port: int, mounts: dict[str, str], width: int, height: int, fps: int) -> int:
    import gi

    gi.require_version("Gst", "1.0")
    gi.require_version("GstRtspServer", "1.0")
    from gi.repository import GLib, Gst, GstRtspServer

    Gst.init(None)
    server = GstRtspServer.RTSPServer()
    server.set_address("127.0.0.1")
    server.set_service(str(port))
    points = server.get_mount_points()
    for path, what in mounts.items():
        factory = GstRtspServer.RTSPMediaFactory()
        if what == "live":
            # One pipeline per client, not one shared by all: gst-rtsp-server 1.22 aborts
            # (an assertion in gst_rtsp_media_get_rates) now and then when clients set up
            # a shared live media at the same moment, and the "camera" is then gone for
            # the rest of a test. A client still joins a live picture, just its own.
            factory.set_launch(LIVE_PIPELINE.format(width=width, height=height, fps=fps))
        else:
            clip = Path(what).resolve()
            if not clip.is_file():
                print(f"clip not found: {clip}", file=sys.stderr)
                return 2
            # A finite clip is not shared: a shared media that reached its end could
            # not be played again, so every client gets the clip from the start.
            factory.set_launch(CLIP_PIPELINE.format(path=str(clip)))
        points.add_factory(path, factory)

    loop = GLib.MainLoop()
    try:
        source_id = server.attach(None)
    except GLib.Error as exc:
        print(f"cannot listen on 127.0.0.1:{port}: {exc.message}", file=sys.stderr)
        return 1
    if source_id == 0:
        print(f"cannot listen on 127.0.0.1:{port}", file=sys.stderr)
        return 1

    def on_signal() -> bool:
        loop.quit()
        return False

    GLib.unix_signal_add(GLib.PRIORITY_HIGH, signal.SIGTERM, on_signal)
    GLib.unix_signal_add(GLib.PRIORITY_HIGH, signal.SIGINT, on_signal)
    print(f"READY {server.get_bound_port()}", flush=True)
    loop.run()
    GLib.source_remove(source_id)
    return 0


def _parse_mount(text: str) -> tuple[str, str]:
    path, sep, what = text.partition("=")
    if not sep or not path.startswith("/") or not what:
        raise argparse.ArgumentTypeError(f"expected /PATH=live or /PATH=FILE.mp4, got {text!r}")
    return path, what


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Loopback RTSP test server (GStreamer).")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mount", type=_parse_mount, action="append", default=[], metavar="/PATH=WHAT")
    parser.add_argument("--width", type=int, default=320)
    parser.add_argument("--height", type=int, default=240)
    parser.add_argument("--fps", type=int, default=15)
    args = parser.parse_args(argv)
    mounts = dict(args.mount) or {"/live": "live"}
    return serve(args.port, mounts, args.width, args.height, args.fps)


# -- the controller (any Python) ------------------------------------------------------------


def gstreamer_available() -> bool:
    """Whether the system Python can run the server (PyGObject and gst-rtsp-server)."""
    if not (os.access(SYSTEM_PYTHON, os.X_OK) and shutil.which("gst-inspect-1.0")):
        return False
    probe = subprocess.run(
        [SYSTEM_PYTHON, "-c",
         "import gi; gi.require_version('GstRtspServer', '1.0'); "
         "from gi.repository import GstRtspServer"],
        capture_output=True,
        timeout=30,
    )  # fmt: skip
    return probe.returncode == 0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RtspTestServer:
    """The server script as a child process on a fixed loopback port."""

    def __init__(self, mounts: dict[str, str] | None = None, port: int | None = None, fps: int = 15) -> None:
        self.mounts = mounts or {"/live": "live"}
        self.port = port or free_port()
        self.fps = fps
        self.proc: subprocess.Popen[str] | None = None

    def url(self, mount: str = "/live", userinfo: str = "") -> str:
        at = f"{userinfo}@" if userinfo else ""
        return f"rtsp://{at}127.0.0.1:{self.port}{mount}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 15.0) -> RtspTestServer:
        """Start (or restart) on :attr:`port` and wait for READY."""
        cmd = [SYSTEM_PYTHON, str(Path(__file__).resolve()), "--port", str(self.port),
               "--fps", str(self.fps)]  # fmt: skip
        for path, what in self.mounts.items():
            cmd += ["--mount", f"{path}={what}"]
        deadline = time.monotonic() + timeout
        while True:
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
            )
            line = self._read_line(deadline)
            if line.startswith("READY"):
                return self
            err = self._collect_stderr()
            # Right after a kill the port can still be held for a moment; try again.
            if "listen" in err and time.monotonic() < deadline:
                time.sleep(0.1)
                continue
            raise RuntimeError(f"RTSP test server did not start: {line!r} {err.strip()}")

    def _read_line(self, deadline: float) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if ready:
                return self.proc.stdout.readline().strip()
            if self.proc.poll() is not None:
                return ""
        return ""

    def _collect_stderr(self) -> str:
        assert self.proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.kill()
            _, err = self.proc.communicate(timeout=5)
            return err or ""
        return ""

    def kill(self) -> None:
        """SIGKILL, like a camera losing power: no RTSP TEARDOWN, sockets just close."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def pause(self) -> None:
        """SIGSTOP: connections stay open but nothing more is sent (a hung camera)."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM and wait; SIGKILL if it does not go."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()

    def __enter__(self) -> RtspTestServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


if __name__ == "__main__":
    sys.exit(main())
