"""Rate-limited error logging: one line per kind of failure per interval, with a count of the rest.

A stage that fails on every frame of a 25 fps camera, or a model whose remote server
is down, must not write 25 lines a second; the metric counts every failure, the log
says what it is. Here rather than in ``pipeline`` so the batcher can use it too.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("vidpipe.errors")


class RateLimitedLog:
    """At most one line (ERROR unless ``level`` says) per key per ``interval`` seconds; thread-safe."""

    def __init__(
        self, interval: float = 10.0, logger: logging.Logger = log, level: int = logging.ERROR
    ) -> None:
        self.interval = interval
        self.logger = logger
        self.level = level
        self._last: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def __call__(self, key: str, message: str, extra: dict[str, str] | None = None) -> None:
        now = time.monotonic()
        with self._lock:
            last, suppressed = self._last.get(key, (float("-inf"), 0))
            if now - last < self.interval:
                self._last[key] = (last, suppressed + 1)
                return
            self._last[key] = (now, 0)
        more = f" ({suppressed} more since last report)" if suppressed else ""
        self.logger.log(self.level, "%s%s", message, more, extra=extra)


__all__ = ["RateLimitedLog"]
