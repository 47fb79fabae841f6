"""Giving freed memory back to the system.

glibc keeps what a thread frees in that thread's arena for the next allocation, and
hands it back to the system only from the top of the heap. Encoding for live viewers
(JPEG, H.264 per WHEP session) runs on worker threads, so after the last viewer leaves
tens of MB stay in the process's RSS for good (6 MJPEG viewers of a 720p source: +36 MB
that never came down). ``malloc_trim(0)`` returns the free pages of every arena.
It runs at moments that free much and are rare (the last viewer gone, a source
removed), on a thread of its own: trimming a large heap takes milliseconds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Callable

log = logging.getLogger("vidpipe.heap")


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``; None elsewhere (musl, macOS), where there is nothing to do."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_TRIM = _malloc_trim()
_running = threading.Lock()


def trim() -> bool:
    """Return the free memory of every arena to the system now; False where it cannot."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


def trim_soon() -> None:
    """:func:`trim` on a thread of its own; skipped while one already runs."""
    if _TRIM is None or not _running.acquire(blocking=False):
        return

    def run() -> None:
        try:
            trim()
        except Exception as exc:  # never worth more than a debug line
            log.debug("malloc_trim failed: %r", exc)
        finally:
            _running.release()

    threading.Thread(target=run, name="heap-trim", daemon=True).start()
