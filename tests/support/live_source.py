"""Run one RTSP source on its own, outside a runtime, until it has retried a few times."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pipeline.config import ReconnectConfig, SourceConfig
from pipeline.frames import Frame
from pipeline.queues import FrameQueue
from pipeline.sources.base import SourceContext, SourceState
from pipeline.sources.rtsp import RtspSource


@dataclass
class SourceRun:
    """What the source said while it ran: its states with reasons, and its reconnect labels."""

    states: list[tuple[SourceState, str]] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    queue: FrameQueue[Frame] | None = None


async def run_until_reconnects(
    url: str, *, min_delay: float = 0.1, timeout: float = 10.0, **options: object
) -> SourceRun:
    """Start an RtspSource on ``url``, stop it once it has counted two reconnects (or at ``timeout``)."""
    config = SourceConfig(
        url=url,
        id="cam",
        open_timeout=2.0,
        read_timeout=2.0,
        reconnect=ReconnectConfig(min_delay=min_delay, max_delay=min_delay, jitter=0.0),
        **options,  # type: ignore[arg-type]
    )
    run = SourceRun(queue=FrameQueue(2, "drop_oldest", asyncio.get_running_loop()))
    context = SourceContext(
        on_state=lambda _s, state, reason: run.states.append((state, reason)),
        on_reconnect=lambda _s, label: run.labels.append(label),
    )
    source = RtspSource(config, context)
    assert run.queue is not None
    source.start(run.queue)
    deadline = time.monotonic() + timeout
    while len(run.labels) < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    source.stop()
    await asyncio.to_thread(source.join, 3.0)
    return run
