"""Soak: N live sources with churn, sampling process resources; prints the slope of each.

    python bench/soak.py [--minutes 10] [--sources 8] [--churn-every 3]

Runs the squares detector graph on ``test://`` sources against an embedded
nats-server. Every ``--churn-every`` seconds one source is removed and a new one
added (new id), the way cameras come and go. Every second it samples RSS, open
file descriptors, threads, asyncio tasks, frames waiting in source queues and
batch buffers in use. After a warm-up it fits a line to each series and prints
its slope per minute. Queued frames, buffers in use and tasks follow the load
(a busy machine fills queues without anything leaking), so they are judged after
the load is gone: every source is removed and nothing may stay queued or held.
With ``--check`` it exits 1 when RSS, fds or threads grow past their allowance or
something is left behind once idle (what the test uses).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.config import SourceConfig, load_config  # noqa: E402
from pipeline.nats_server import EmbeddedNats  # noqa: E402
from pipeline.runtime import Runtime  # noqa: E402

PIPELINE = """\
pipeline: soak
models: {models}
stages:
  - {{name: objects, type: infer, model: squares}}
  - {{name: track, type: track}}
"""

# Growth per minute above which --check fails, after warm-up. RSS allows for
# allocator noise; the others must not grow at all beyond rounding.
ALLOWANCE_PER_MIN = {"rss_mb": 4.0, "fds": 1.0, "threads": 1.0}
# RSS is judged by how far its peak moves from the first half of the run to the second,
# per minute: a leak raises every later peak, while a busy neighbour (more frames in
# flight for a while) raises the slope of a short run but not the peak twice.
PEAK_SERIES = ("rss_mb",)
# A rise of the peak this small (MB) is allocator noise whatever its rate: a minute's run
# judges halves of 20 s, where 4 MB a minute is a rise of 1.3 MB. With two busy loops on
# two cores the peak rose by up to 2.0 MB in a minute with nothing leaking (the same rise
# as on the code before the change under test); a source's frame pool kept after its
# removal would raise it by over 1 MB at each of the ten removals of a half.
PEAK_NOISE_MB = {"rss_mb": 3.0}

# Series that follow the load rather than leak: on a busy machine queues fill and
# batches wait, so a slope over a minute says more about the neighbours than about
# vidpipe. They are judged once the load is gone instead: with every source removed,
# nothing may be left queued or held, and no task may outlive its source.
SETTLED_SERIES = ("tasks", "queued", "pool_in_use")
SETTLE_TIMEOUT_S = 60.0


@dataclass
class Sample:
    t: float
    rss_mb: float
    fds: int
    threads: int
    tasks: int
    queued: int
    pool_in_use: int


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def pool_in_use(runtime: Runtime) -> int:
    """Batch buffers currently held across every model instance."""
    total = 0
    models = runtime.models
    if models is None:
        return 0
    for name in models.names():
        try:
            model = models.get(name)
        except Exception:
            continue
        for inst in getattr(model, "instances", []):
            pool = getattr(inst, "pool", None)
            total += int(getattr(pool, "in_use", 0))
    return total


def sample(runtime: Runtime, t0: float) -> Sample:
    return Sample(
        t=time.monotonic() - t0,
        rss_mb=rss_mb(),
        fds=len(os.listdir("/proc/self/fd")),
        threads=threading.active_count(),
        tasks=len(asyncio.all_tasks()),
        queued=sum(len(r.queue) for r in runtime.sources.values()),
        pool_in_use=pool_in_use(runtime),
    )


def slope_per_minute(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope, in units per minute."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return 0.0
    return 60.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var


def peak_rise(ys: list[float]) -> float:
    """How far the peak of the second half of a series is above the first half's."""
    half = len(ys) // 2
    return max(ys[half:]) - max(ys[:half]) if half >= 2 else 0.0


def peak_growth_per_minute(xs: list[float], ys: list[float]) -> float:
    """:func:`peak_rise` per minute (the halves' distance apart)."""
    minutes = (xs[-1] - xs[0]) / 2 / 60 if len(xs) >= 4 else 0.0
    return peak_rise(ys) / minutes if minutes > 0 else 0.0


async def soak(minutes: float, sources: int, churn_every: float, fps: int) -> dict[str, Any]:
    tmp = ROOT / ".cache"
    tmp.mkdir(exist_ok=True)
    cfg_path = tmp / "soak.yaml"
    cfg_path.write_text(PIPELINE.format(models=ROOT / "samples" / "models"))
    cfg = load_config(cfg_path)
    with EmbeddedNats() as server:
        runtime = Runtime(cfg, nats_url=server.url)
        runtime.keep_running()
        await runtime.start()
        baseline_tasks = len(asyncio.all_tasks())
        serial = 0

        def new_source() -> None:
            nonlocal serial
            serial += 1
            url = f"test://?width=320&height=240&fps={fps}"
            runtime.add_source(SourceConfig(url=url, id=f"cam{serial}"))

        for _ in range(sources):
            new_source()
        t0 = time.monotonic()
        end = t0 + minutes * 60
        samples: list[Sample] = []
        next_churn = t0 + churn_every
        churned = 0
        while time.monotonic() < end:
            await asyncio.sleep(1.0)
            if time.monotonic() >= next_churn:
                oldest = next(iter(runtime.sources))
                await runtime.remove_source(oldest)
                new_source()
                churned += 1
                next_churn += churn_every
            gc.collect()
            samples.append(sample(runtime, t0))
        published = runtime.published_total()
        settled = await settle(runtime, t0)
        await runtime.stop()
    warm = [s for s in samples if s.t >= min(20.0, minutes * 60 / 3)]
    xs = [s.t for s in warm]
    series = (*ALLOWANCE_PER_MIN, *SETTLED_SERIES)
    slopes = {key: slope_per_minute(xs, [float(getattr(s, key)) for s in warm]) for key in series}
    rises = {}
    for key in PEAK_SERIES:
        ys = [float(getattr(s, key)) for s in warm]
        slopes[key] = peak_growth_per_minute(xs, ys)
        rises[key] = peak_rise(ys)
    return {
        "minutes": minutes,
        "sources": sources,
        "churned": churned,
        "published": published,
        "first": samples[0].__dict__ if samples else {},
        "last": samples[-1].__dict__ if samples else {},
        "slope_per_min": slopes,
        "peak_rise": rises,
        "baseline_tasks": baseline_tasks,
        "settled": settled.__dict__,
    }


async def settle(runtime: Runtime, t0: float) -> Sample:
    """Remove every source, then sample once nothing is queued or held (or the timeout passes)."""
    for source_id in list(runtime.sources):
        await runtime.remove_source(source_id)
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        gc.collect()
        now = sample(runtime, t0)
        if (now.queued == 0 and now.pool_in_use == 0) or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.1)


def leftovers(result: dict[str, Any]) -> list[str]:
    """What the settled sample still holds that an idle pipeline must not."""
    settled = result["settled"]
    out = [f"{key}={settled[key]}" for key in ("queued", "pool_in_use") if settled[key]]
    if settled["tasks"] > result["baseline_tasks"]:
        out.append(f"tasks={settled['tasks']} (before any source: {result['baseline_tasks']})")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--sources", type=int, default=8)
    parser.add_argument("--churn-every", type=float, default=3.0)
    parser.add_argument("--fps", type=int, default=10)
    parser.add_argument("--check", action="store_true", help="exit 1 on a growth trend")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    result = asyncio.run(soak(args.minutes, args.sources, args.churn_every, args.fps))
    if args.json:
        print(json.dumps(result))
    else:
        print(f"soak: {args.minutes} min, {args.sources} sources, {result['churned']} churned, "
              f"{result['published']} messages")  # fmt: skip
        print(f"{'series':12s} {'first':>10s} {'last':>10s} {'growth/min':>10s} {'allowed':>8s}")
        for key, allowed in ALLOWANCE_PER_MIN.items():
            first, last = result["first"].get(key, 0), result["last"].get(key, 0)
            print(f"{key:12s} {first:10.1f} {last:10.1f} {result['slope_per_min'][key]:10.2f} {allowed:8.1f}")
        settled = ", ".join(f"{key}={result['settled'][key]}" for key in SETTLED_SERIES)
        print(f"after removing every source: {settled} (tasks before any source: {result['baseline_tasks']})")
    # A series grew when its rate is over the allowance and (RSS) its rise is over the noise.
    grown = [
        k
        for k, allowed in ALLOWANCE_PER_MIN.items()
        if result["slope_per_min"][k] > allowed
        and result["peak_rise"].get(k, math.inf) > PEAK_NOISE_MB.get(k, 0.0)
    ]
    left = leftovers(result)
    if grown:
        print("growth trend: " + ", ".join(grown), file=sys.stderr)
    if left:
        print("left behind once idle: " + ", ".join(left), file=sys.stderr)
    return 1 if (args.check and (grown or left)) else 0


if __name__ == "__main__":
    sys.exit(main())
