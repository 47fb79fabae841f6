"""Scheduler overhead: microseconds per request through the dynamic batcher.

The instance does nothing (it returns its inputs), so the time measured is the
batcher's own: queueing, batch decisions, the hand-off to the worker thread and
the answer back to the asyncio caller. ``c`` asyncio callers each send requests
back to back; overhead = wall time / requests. The batcher is configured like::

    max_batch_size: 64
    dynamic_batching: {max_queue_delay_microseconds: 0}
    instance_group: [{count: 1}]

Run: ``python bench/scheduler_overhead.py [--requests 20000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import cpu_name
from inference.batch_policy import BatchPolicy
from inference.batcher import DynamicBatcher


def null_instance(items: list[Any]) -> list[Any]:
    return items


async def measure(concurrency: int, requests: int, max_batch_size: int) -> tuple[float, float]:
    batcher = DynamicBatcher("null", BatchPolicy(max_batch_size=max_batch_size), [null_instance])
    batcher.start()
    per_caller = max(1, requests // concurrency)

    async def caller() -> None:
        for i in range(per_caller):
            await batcher.infer(i)

    try:
        await asyncio.gather(*(caller() for _ in range(min(concurrency, 8))))  # warm-up
        start_stats = batcher.stats
        start = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
        stats = batcher.stats
    finally:
        batcher.stop()
    total = per_caller * concurrency
    batches = stats.batches - start_stats.batches
    return elapsed / total * 1e6, total / max(1, batches)


async def handoff_floor(requests: int) -> float:
    """The bare minimum for one request at concurrency 1: hand an item to a worker thread and
    get the answer back into the event loop (a condition variable + call_soon_threadsafe)."""
    loop = asyncio.get_running_loop()
    cond = threading.Condition()
    box: collections.deque[asyncio.Future[int] | None] = collections.deque()

    def worker() -> None:
        while True:
            with cond:
                while not box:
                    cond.wait()
                fut = box.popleft()
            if fut is None:
                return
            loop.call_soon_threadsafe(fut.set_result, 1)

    t = threading.Thread(target=worker)
    t.start()
    start = time.perf_counter()
    for _ in range(requests):
        fut = loop.create_future()
        with cond:
            box.append(fut)
            cond.notify()
        await fut
    elapsed = time.perf_counter() - start
    with cond:
        box.append(None)
        cond.notify()
    t.join()
    return elapsed / requests * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--max-batch-size", type=int, default=64)
    args = parser.parse_args()
    print(f"cpu: {cpu_name()} ({os.cpu_count()} cores), python {platform.python_version()}")
    print(f"{'concurrency':>11}  {'us/request':>10}  {'mean batch':>10}")
    results = {}
    for c in (1, 8, 64):
        us, mean_batch = asyncio.run(measure(c, args.requests, args.max_batch_size))
        results[c] = us
        print(f"{c:>11}  {us:>10.1f}  {mean_batch:>10.1f}")
    floor = asyncio.run(handoff_floor(args.requests))
    print(f"reference: bare thread hand-off at concurrency 1 (no batcher): {floor:.1f} us/request")
    print(" ".join(f"overhead_us_c{c}={us:.1f}" for c, us in results.items()))


if __name__ == "__main__":
    main()
