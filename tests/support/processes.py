"""Ending the child processes tests start."""

from __future__ import annotations

import subprocess


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds; always reaped."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
