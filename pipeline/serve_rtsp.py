"""``vidpipe serve-rtsp FILE...``: video files as looping live RTSP cameras, for trials.

::

    $ vidpipe serve-rtsp shop.mp4 door.mp4 --port 8554
    rtsp://127.0.0.1:8554/shop
    rtsp://127.0.0.1:8554/door

Each file plays forever at its own frame rate, like a camera that is always on:
every client that connects joins the same picture at its next keyframe (one a
second), and the stream never ends at the clip's end. Ctrl-C stops it.

The server is GStreamer's RTSP server (Debian ``gir1.2-gst-rtsp-server-1.0``,
``python3-gi``, ``gstreamer1.0-plugins-{good,bad,ugly}``, ``gstreamer1.0-libav``),
which only the system Python can import. So this module is two things:

- :func:`serve_rtsp` (vidpipe's Python): checks the files, starts this same file
  as a script under ``/usr/bin/python3 -I``, prints the URLs, waits for Ctrl-C;
- :func:`gst_serve` (the system Python, no vidpipe imports): per file, one
  pipeline decodes and re-encodes it (H.264, a keyframe a second) in real time and
  seeks back to the start at each end without a flush (a segment seek, so time
  runs on); an ``appsrc`` per RTSP session takes its frames from there.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SYSTEM_PYTHON = "/usr/bin/python3"
DEFAULT_PORT = 8554
KEYFRAME_EVERY = 30  # frames, where a file's frame rate is unknown: about one a second at 30 fps
DEBIAN_PACKAGES = (
    "python3-gi gir1.2-gst-rtsp-server-1.0 gstreamer1.0-plugins-good gstreamer1.0-plugins-bad "
    "gstreamer1.0-plugins-ugly gstreamer1.0-libav"
)


class ServeRtspError(Exception):
    """The server cannot start; the message says why and what to do."""


def mount_names(files: list[Path]) -> list[str]:
    """``/name`` per file: its stem in letters, digits, ``_`` and ``-``; ``_2``, ``_3`` on a clash."""
    used: set[str] = set()
    out = []
    for f in files:
        base = re.sub(r"[^A-Za-z0-9_-]+", "_", f.stem).strip("_") or "video"
        name, n = base, 1
        while name in used:
            n += 1
            name = f"{base}_{n}"
        used.add(name)
        out.append(name)
    return out


def keyframe_interval(path: Path) -> int:
    """Frames between keyframes for one a second at ``path``'s own frame rate (a client
    starts at the next one), or :data:`KEYFRAME_EVERY` where the file does not say."""
    import av  # vidpipe's Python only: the server half of this module runs without it

    try:
        with av.open(str(path)) as container:
            rate = container.streams.video[0].average_rate
    except (av.FFmpegError, IndexError):
        return KEYFRAME_EVERY  # the server says what is wrong with the file
    return max(1, round(float(rate))) if rate else KEYFRAME_EVERY


def serve_rtsp(files: list[str], port: int = DEFAULT_PORT, host: str = "127.0.0.1") -> int:
    """Serve ``files`` until Ctrl-C or SIGTERM; prints one URL per file. Returns the exit code.

    Raises :class:`ServeRtspError` for a missing file, a missing GStreamer, or a
    server that does not start (the port is taken, a file does not decode).
    """
    paths = [Path(f).expanduser().resolve() for f in files]
    for given, path in zip(files, paths, strict=True):
        if not path.is_file():
            raise ServeRtspError(f"{given}: file not found")
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        raise ServeRtspError(f"{SYSTEM_PYTHON} not found; serve-rtsp runs GStreamer's RTSP server with it")
    names = mount_names(paths)
    cmd = [SYSTEM_PYTHON, "-I", str(Path(__file__).resolve()), "--host", host, "--port", str(port)]
    for name, path in zip(names, paths, strict=True):
        cmd += ["--mount", f"/{name}={path}", "--keyint", f"/{name}={keyframe_interval(path)}"]
    from pipeline.nats_server import die_with_parent

    # The same process group: a terminal's Ctrl-C reaches the server too, and it dies with us.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
    stopping = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        bound = _wait_ready(proc, timeout=30.0)
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
        for name in names:
            print(f"rtsp://{shown}:{bound}/{name}", flush=True)
        print("serving; Ctrl-C stops", file=sys.stderr, flush=True)
        while not stopping and proc.poll() is None:
            with contextlib.suppress(InterruptedError):
                time.sleep(0.2)
        # A terminal's Ctrl-C reaches the server too: it may end first, with 0.
        if proc.poll() is not None and proc.returncode != 0 and not stopping:
            raise ServeRtspError(f"the RTSP server stopped (exit {proc.returncode}; its error is above)")
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def _wait_ready(proc: subprocess.Popen[str], timeout: float) -> int:
    """The port from the server's ``READY <port>`` line; its own error when it exits first."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline().strip()
            if line.startswith("READY "):
                return int(line.split()[1])
            if not line and proc.poll() is not None:
                break
        elif proc.poll() is not None:
            break
    if proc.poll() is None:
        raise ServeRtspError(f"the RTSP server did not start within {timeout:.0f}s")
    if proc.returncode == 3:
        raise ServeRtspError(
            f"GStreamer's RTSP server is not installed; on Debian: apt-get install {DEBIAN_PACKAGES}"
        )
    raise ServeRtspError(f"the RTSP server did not start (exit {proc.returncode}; its error is above)")


# -- the server: the system Python, GStreamer only --------------------------------------------------

ENCODE = (
    "filesrc name=file ! decodebin ! videoconvert ! "
    "x264enc tune=zerolatency speed-preset=ultrafast key-int-max={keyint} ! "
    "h264parse config-interval=-1 ! video/x-h264,stream-format=byte-stream,alignment=au ! "
    "appsink name=out sync=true emit-signals=true max-buffers=8 drop=true"
)
SESSION = (
    "( appsrc name=src is-live=true format=time do-timestamp=true "
    'caps="video/x-h264,stream-format=byte-stream,alignment=au" '
    # SPS/PPS are in the stream before every keyframe already (h264parse above); a second
    # copy from the payloader makes clients see the keyframe twice.
    "! rtph264pay name=pay0 pt=96 config-interval=0 )"
)


def gst_serve(
    host: str, port: int, mounts: dict[str, str], keyints: dict[str, int] | None = None
) -> int:  # pragma: no cover - system Python
    """Run the RTSP server with one looping camera per mount; READY <port> on stdout once it listens.

    ``keyints``: frames between keyframes per mount (:data:`KEYFRAME_EVERY` where absent).
    """
    try:
        import gi

        gi.require_version("Gst", "1.0")
        gi.require_version("GstRtspServer", "1.0")
        from gi.repository import GLib, Gst, GstRtspServer
    except (ImportError, ValueError) as exc:
        print(f"GStreamer's RTSP server cannot be loaded: {exc}", file=sys.stderr)
        return 3
    Gst.init(None)
    server = GstRtspServer.RTSPServer()
    server.set_address(host)
    server.set_service(str(port))
    loop = GLib.MainLoop()
    failed: list[str] = []
    players = []
    for mount, path in mounts.items():
        # appsrc -> whether it has had its first keyframe (a client starts on one).
        sessions: dict[Any, bool] = {}
        player = Gst.parse_launch(ENCODE.format(keyint=(keyints or {}).get(mount, KEYFRAME_EVERY)))
        player.get_by_name("file").set_property("location", path)

        def on_sample(sink: Any, sessions: dict[Any, bool] = sessions) -> Any:
            buffer = sink.emit("pull-sample").get_buffer()
            keyframe = not buffer.has_flags(Gst.BufferFlags.DELTA_UNIT)
            for src, started in list(sessions.items()):
                if not (started or keyframe):
                    continue
                sessions[src] = True
                out = buffer.copy()
                # The session's appsrc stamps it with its own clock: time runs on across loops.
                out.pts = out.dts = Gst.CLOCK_TIME_NONE
                src.emit("push-buffer", out)
            return Gst.FlowReturn.OK

        player.get_by_name("out").connect("new-sample", on_sample)

        def on_message(bus: Any, message: Any, player: Any = player, path: str = path) -> None:
            if message.type == Gst.MessageType.SEGMENT_DONE:
                # The end of the file: back to the start, no flush, so the stream goes on.
                player.seek(1.0, Gst.Format.TIME, Gst.SeekFlags.SEGMENT,
                            Gst.SeekType.SET, 0, Gst.SeekType.NONE, -1)  # fmt: skip
            elif message.type == Gst.MessageType.ERROR:
                error, _ = message.parse_error()
                failed.append(f"{path}: {error.message}")
                print(f"cannot play {path}: {error.message}", file=sys.stderr, flush=True)
                loop.quit()

        bus = player.get_bus()
        bus.add_signal_watch()
        bus.connect("message", on_message)
        player.set_state(Gst.State.PAUSED)
        result, _, _ = player.get_state(10 * Gst.SECOND)
        if result == Gst.StateChangeReturn.FAILURE:
            print(f"cannot play {path}: it does not decode", file=sys.stderr, flush=True)
            return 1
        player.seek(1.0, Gst.Format.TIME, Gst.SeekFlags.FLUSH | Gst.SeekFlags.SEGMENT,
                    Gst.SeekType.SET, 0, Gst.SeekType.NONE, -1)  # fmt: skip
        player.set_state(Gst.State.PLAYING)
        players.append(player)

        factory = GstRtspServer.RTSPMediaFactory()
        factory.set_launch(SESSION)
        factory.set_shared(True)  # one picture for every client, like a camera

        def on_configure(factory: Any, media: Any, sessions: dict[Any, bool] = sessions) -> None:
            src = media.get_element().get_by_name("src")
            sessions[src] = False
            media.connect("unprepared", lambda _media: sessions.pop(src, None))

        factory.connect("media-configure", on_configure)
        server.get_mount_points().add_factory(mount, factory)

    try:
        source_id = server.attach(None)
    except GLib.Error as exc:
        print(f"cannot listen on {host}:{port}: {exc.message}", file=sys.stderr)
        return 1
    if source_id == 0:
        print(f"cannot listen on {host}:{port} (is the port in use?)", file=sys.stderr)
        return 1

    def on_signal() -> bool:
        loop.quit()
        return False

    GLib.unix_signal_add(GLib.PRIORITY_HIGH, signal.SIGTERM, on_signal)
    GLib.unix_signal_add(GLib.PRIORITY_HIGH, signal.SIGINT, on_signal)
    print(f"READY {server.get_bound_port()}", flush=True)
    loop.run()
    for player in players:
        player.set_state(Gst.State.NULL)
    return 1 if failed else 0


def _mount(text: str) -> tuple[str, str]:
    path, _, file = text.partition("=")
    return path, file


def _keyint(text: str) -> tuple[str, int]:
    path, _, frames = text.partition("=")
    return path, int(frames)


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - system Python
    parser = argparse.ArgumentParser(description="The serve-rtsp server (run by vidpipe serve-rtsp).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--mount", type=_mount, action="append", default=[], metavar="/NAME=FILE")
    parser.add_argument("--keyint", type=_keyint, action="append", default=[], metavar="/NAME=FRAMES")
    args = parser.parse_args(argv)
    return gst_serve(args.host, args.port, dict(args.mount), dict(args.keyint))


if __name__ == "__main__":
    sys.exit(main())
