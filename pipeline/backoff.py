"""Exponential backoff with jitter: the one wait between retries, for every retry loop.

A live source's reconnects (``reconnect:`` of a source) and a JetStream
publish that was not acknowledged both wait::

    min(max_delay, min_delay * 2**failures) * (1 + jitter * (2 * rand - 1))

    reconnect: {min_delay: 0.5, max_delay: 10, jitter: 0.2}   # a live source's, in seconds

:class:`RetryLog` thins the log of a retry loop that goes on for hours (a camera that
is off): every failure of the first minute or so is a line, then one line every few
minutes says how many failed meanwhile.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Backoff", "BackoffPolicy", "RetryLog", "backoff_delay"]


class BackoffPolicy(Protocol):
    """The bounds of a backoff (a source's ``ReconnectConfig`` is one)."""

    @property
    def min_delay(self) -> float: ...

    @property
    def max_delay(self) -> float: ...

    @property
    def jitter(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Backoff:
    """A backoff fixed in code (a source's comes from its config)."""

    min_delay: float
    max_delay: float
    jitter: float = 0.0


def backoff_delay(failures: int, policy: BackoffPolicy, rand: float) -> float:
    """The wait before the next attempt after ``failures`` failed ones in a row.

    ``min_delay * 2**failures`` capped at ``max_delay``, then scaled by
    ``1 + jitter * (2 * rand - 1)`` with ``rand`` in [0, 1).
    """
    # 2**n overflows a float long before anyone waits that long; the cap applies first.
    exponent = min(failures, 60)
    base = min(policy.max_delay, policy.min_delay * (2.0**exponent))
    return base * (1.0 + policy.jitter * (2.0 * rand - 1.0))


class RetryLog:
    """Which failures of a retry loop to log: the first ``every_first`` of an outage each,
    then at most one per ``interval`` seconds, per key (a source id); thread-safe.

    A camera that is off for a day retried every 10 s wrote 8,600 warnings; with the
    defaults it writes ten, then one every five minutes (about 300), each saying how
    many attempts failed since the line before.
    """

    def __init__(self, every_first: int = 10, interval: float = 300.0) -> None:
        self.every_first = every_first
        self.interval = interval
        # key -> (failures in this outage, when the outage began, last line's time, failures not logged)
        self._state: dict[str, tuple[int, float, float, int]] = {}
        self._lock = threading.Lock()

    def failed(self, key: str, now: float | None = None) -> str | None:
        """A failure of ``key``: None to leave it out of the log, else the text to add to
        its line ("" for one of the first, or how many went unlogged since the last)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            count, began, last, unlogged = self._state.get(key, (0, now, now, 0))
            count += 1
            if count <= self.every_first:
                self._state[key] = (count, began, now, 0)
                return ""
            if now - last < self.interval:
                self._state[key] = (count, began, last, unlogged + 1)
                return None
            self._state[key] = (count, began, now, 0)
        return (
            f" ({unlogged} more failed attempt(s) since the last line, {count} since "
            f"{_duration(now - began)} ago; one line every {_duration(self.interval)} while this lasts)"
        )

    def recovered(self, key: str, now: float | None = None) -> str:
        """``key`` is up again: what to add to its line ("" after a short outage)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            count, began, _, _ = self._state.pop(key, (0, now, now, 0))
        if count <= self.every_first:
            return ""
        return f" (after {count} failed attempts over {_duration(now - began)})"

    def forget(self, key: str) -> None:
        """``key`` is gone (a removed source)."""
        with self._lock:
            self._state.pop(key, None)


def _duration(seconds: float) -> str:
    """``45s``, ``5m``, ``2h05m``: an outage's length as an operator reads it."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m" if s % 60 == 0 else f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
