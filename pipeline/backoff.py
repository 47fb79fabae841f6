"""Exponential backoff with jitter: the one wait between retries, for every retry loop.

A live source's reconnects (``reconnect:`` of a source) and a JetStream
publish that was not acknowledged both wait::

    min(max_delay, min_delay * 2**failures) * (1 + jitter * (2 * rand - 1))

    reconnect: {min_delay: 0.5, max_delay: 10, jitter: 0.2}   # a live source's, in seconds
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["Backoff", "BackoffPolicy", "backoff_delay"]


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
