"""Freed memory goes back to the system once trimmed (glibc keeps it in its arenas)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from pipeline import heap


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(heap.trim() is False, reason="no glibc malloc_trim here")
def test_memory_freed_by_worker_threads_is_returned_when_trimmed() -> None:
    # What a viewer's encoder thread does: many allocations under the mmap threshold,
    # freed again, in its thread's own arena. glibc kept them in the process's RSS.
    kept: list[list[bytes]] = []

    def work() -> None:
        chunks = [bytes(64 * 1024) for _ in range(800)]  # 50 MiB in 64 KiB blocks
        kept.append([bytes(4096)])  # still in use, above them: the heap cannot shrink past it
        del chunks

    heap.trim()
    before = rss_kib()
    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    held = rss_kib()
    assert heap.trim()
    after = rss_kib()
    # Of the 150 MiB freed, glibc held some tens of MiB (it trims the tops of thread heaps
    # itself); trimmed, the process is back within a few MiB of where it started.
    assert held - before > 20 * 1024, (before, held, after)
    assert after - before < 8 * 1024, (before, held, after)
