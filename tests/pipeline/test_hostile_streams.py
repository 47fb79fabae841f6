"""Hostile streams: cameras and files that try to exhaust threads, sockets or memory.

Real FFmpeg through PyAV reads real loopback sockets (an MJPEG camera made with
Python's http.server) and real files; memory peaks are measured in a process of
their own (``tests/support/peak_memory.py``).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from pipeline.config import ReconnectConfig, SourceConfig
from pipeline.frames import Frame
from pipeline.metrics import Metrics
from pipeline.queues import FrameQueue
from pipeline.sources.base import SourceContext
from pipeline.sources.stream import StreamSource
from tests.support.hostile_streams import MjpegServer, flat_jpeg, h264_size_switch, random_parts

ROOT = Path(__file__).resolve().parents[2]


# -- an undecodable stream: the readers the watchdog gives up on -------------------------------


def _threads_and_fds() -> tuple[int, int]:
    return threading.active_count(), len(os.listdir("/proc/self/fd"))


async def _counts_after_reconnect(labels: list[str], count: int, timeout: float) -> tuple[int, int]:
    """The fewest threads and fds seen in the second after the ``count``-th reconnect.

    Right at a reconnect the abandoned reader and the camera's handler may still be on
    their way out; what stays over that second is what leaked.
    """
    deadline = time.monotonic() + timeout
    while len(labels) < count:
        assert time.monotonic() < deadline, f"only {len(labels)} reconnects: {labels}"
        await asyncio.sleep(0.05)
    seen = [_threads_and_fds()]
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        await asyncio.sleep(0.05)
        seen.append(_threads_and_fds())
    return min(t for t, _ in seen), min(f for _, f in seen)


async def test_an_undecodable_stream_leaks_no_thread_and_no_socket() -> None:
    metrics = Metrics()
    with MjpegServer(random_parts()) as camera:
        config = SourceConfig(
            url=camera.url,
            id="garbage",
            open_timeout=2.0,
            read_timeout=2.0,
            stall_timeout=2.0,
            reconnect=ReconnectConfig(min_delay=0.1, max_delay=0.1, jitter=0.0),
        )
        queue: FrameQueue[Frame] = FrameQueue(2, "drop_oldest", asyncio.get_running_loop())
        labels: list[str] = []
        source = StreamSource(config, SourceContext(on_reconnect=lambda _s, label: labels.append(label)))
        started = time.monotonic()
        source.start(queue)
        try:
            # A stall cycle is about 3.5 s (open, 2 s of garbage, 0.1 s backoff): the 5th
            # reconnect comes near 20 s; the late count is taken at the first reconnect
            # after 60 s of garbage.
            early = await _counts_after_reconnect(labels, 5, timeout=60.0)
            while time.monotonic() - started < 60.0:
                await asyncio.sleep(0.1)
            late = await _counts_after_reconnect(labels, len(labels) + 1, timeout=30.0)
            readers = metrics.render().decode()
        finally:
            source.stop()
            await asyncio.to_thread(source.join, 5.0)
    assert set(labels) == {"stalled"}, labels
    assert len(labels) >= 10, labels  # many stalls, each of which leaked a thread and a socket before
    # Flat after the first stalls: no reader thread and no socket per stall.
    # (One fd of slack: on a busy machine the test camera's own thread, in this process, may
    # not have closed its side of the last connection yet; a leak per stall is ten or more.)
    assert late[0] <= early[0], (early, late)
    assert late[1] <= early[1] + 1, (early, late)
    # One reader at most (none for a moment between two connections).
    gauge = [line for line in readers.splitlines() if line.startswith("vidpipe_source_reader_threads ")]
    assert gauge in (["vidpipe_source_reader_threads 1.0"], ["vidpipe_source_reader_threads 0.0"])
    assert camera.connections >= len(labels)


# -- decoder bombs: pictures far over max_pixels -------------------------------------------------

# A cap of 2 Mpx against pictures of 8000x8000 (64 Mpx): one such picture in 4:2:0
# is 96 MB before any conversion, far above what a capped decoder may grow by.
CAP = 2_000_000
HUGE = (8000, 8000)
ONE_HUGE_PICTURE_MB = HUGE[0] * HUGE[1] * 1.5 / 2**20


def _peak_growth(*args: str) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.peak_memory", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
        check=True,
    )
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_an_h264_file_switching_to_a_huge_picture_never_decodes_it(tmp_path: Path) -> None:
    clip = h264_size_switch(tmp_path / "switch.ts", (320, 240), HUGE, frames=60)
    result = _peak_growth(str(clip), str(CAP))
    assert (
        result["reason"]
        == f"source bomb: frame size 8000x8000 is over the limit of {CAP} pixels (max_pixels)"
    )
    assert result["state"] == "SourceState.FAILED"
    assert 0 < int(result["frames"]) <= 60  # type: ignore[call-overload]
    assert float(result["growth_mb"]) < ONE_HUGE_PICTURE_MB, result  # type: ignore[arg-type]


def test_an_mjpeg_camera_switching_to_a_huge_picture_never_decodes_it(tmp_path: Path) -> None:
    small, huge = tmp_path / "small.jpg", tmp_path / "huge.jpg"
    small.write_bytes(flat_jpeg(320, 240))
    huge.write_bytes(flat_jpeg(*HUGE))
    result = _peak_growth("mjpeg", str(CAP), str(small), str(huge))
    assert (
        result["reason"]
        == f"source bomb: frame size 8000x8000 is over the limit of {CAP} pixels (max_pixels)"
    )
    assert result["state"] == "SourceState.FAILED"
    assert result["frames"] == 5
    assert float(result["growth_mb"]) < ONE_HUGE_PICTURE_MB / 4, result  # type: ignore[arg-type]
