"""The process's budget for decoded-frame memory, shared by every source's frame pool.

::

    runtime:
      frame_memory_mb: 2048   # all sources' frame pools together

A source's pool holds ``queue_size + max_in_flight + 4`` frames of its stream's size,
allocated when the first frame's size is known (and again if the stream changes
size). :meth:`FrameMemoryBudget.reserve` is asked before the pool is made; a pool
that would take the total over the budget is refused, and the source fails with a
reason that names ``runtime.frame_memory_mb``. A removed source gives its share back
(:meth:`FrameMemoryBudget.release`).
"""

from __future__ import annotations

import threading

__all__ = ["MIB", "FrameMemoryBudget"]

MIB = 1024 * 1024


class FrameMemoryBudget:
    """Bytes of frame pools reserved per owner (a source), against one limit."""

    key = "runtime.frame_memory_mb"

    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self._lock = threading.Lock()  # sources reserve from their own threads
        self._owners: dict[int, int] = {}

    @property
    def used(self) -> int:
        with self._lock:
            return sum(self._owners.values())

    def reserve(self, owner: object, nbytes: int) -> str | None:
        """Set ``owner``'s share to ``nbytes``; a reason (and no change) if over the limit."""
        with self._lock:
            others = sum(v for k, v in self._owners.items() if k != id(owner))
            if others + nbytes > self.limit:
                return (
                    f"frame pools would need {nbytes / MIB:.0f} MB more, over {self.key} = "
                    f"{self.limit // MIB} with {others / MIB:.0f} MB in use by other sources"
                )
            self._owners[id(owner)] = nbytes
        return None

    def release(self, owner: object) -> None:
        """Give ``owner``'s share back."""
        with self._lock:
            self._owners.pop(id(owner), None)
