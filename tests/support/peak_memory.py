"""Run one source in a fresh process and report how much its peak memory grew (VmHWM).

``python -m tests.support.peak_memory URL MAX_PIXELS [SMALL_JPEG HUGE_JPEG]`` starts a
:class:`~pipeline.sources.file.FileSource` or a live source on ``URL`` (with the two
JPEG files: an MJPEG server of this process sends the small one five times, then the
huge one), waits until it fails or ends, and prints one JSON line:
``{"growth_mb": ..., "frames": ..., "state": ..., "reason": ...}``. A process of its
own, because a peak is a process's.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from pipeline.config import ReconnectConfig, SourceConfig
from pipeline.queues import EndOfStream, FrameQueue
from pipeline.sources.base import SourceContext, SourceState
from pipeline.sources.registry import create_source
from tests.support.hostile_streams import MjpegServer, switching_parts


def peak_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


async def run(url: str, max_pixels: int) -> dict[str, object]:
    import av  # noqa: F401  (its libraries loaded before the baseline)

    states: list[tuple[SourceState, str]] = []
    config = SourceConfig(
        url=url, id="bomb", max_pixels=max_pixels, reconnect=ReconnectConfig(min_delay=5.0, max_delay=5.0)
    )
    source = create_source(
        config, SourceContext(on_state=lambda _s, state, reason: states.append((state, reason)))
    )
    queue: FrameQueue[object] = FrameQueue(64, "block", asyncio.get_running_loop())
    baseline = peak_mb()
    source.start(queue)  # type: ignore[arg-type]
    frames = 0
    while True:
        try:
            item = await asyncio.wait_for(queue.get(), 30.0)
        except TimeoutError:
            break
        if isinstance(item, EndOfStream):
            break
        frames += 1
        item.buffer.release()  # type: ignore[attr-defined]
    source.stop()
    await asyncio.to_thread(source.join, 5.0)
    state, reason = states[-1] if states else (None, "")
    return {"growth_mb": peak_mb() - baseline, "frames": frames, "state": str(state), "reason": reason}


def main(argv: list[str]) -> None:
    url, max_pixels = argv[0], int(argv[1])
    if len(argv) == 4:
        small, huge = Path(argv[2]).read_bytes(), Path(argv[3]).read_bytes()
        with MjpegServer(switching_parts(small, huge, after=5)) as server:
            result = asyncio.run(run(server.url, max_pixels))
    else:
        result = asyncio.run(run(url, max_pixels))
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
