"""A camera that stays down: its first failures are each a log line, then one every few
minutes says how many failed meanwhile, and its line when it is up again says how long."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pipeline.backoff import RetryLog
from pipeline.config import load_config
from pipeline.nats_server import EmbeddedNats
from pipeline.runtime import Runtime
from tests.pipeline.stack import until
from tests.support.rtsp_server import free_port


def test_the_first_failures_are_each_a_line_then_one_per_interval() -> None:
    log = RetryLog(every_first=3, interval=300.0)
    said = [log.failed("door", now=t) for t in (0.0, 0.5, 1.5, 3.0, 100.0, 299.0, 302.9, 400.0)]
    assert said == [
        "", "", "", None, None, None,
        " (3 more failed attempt(s) since the last line, 7 since 5m03s ago; one line every 5m while this lasts)",
        None,
    ]  # fmt: skip
    assert log.failed("gate", now=400.0) == ""  # each source has its own count
    assert log.recovered("door", now=3725.0) == " (after 8 failed attempts over 1h02m)"
    # Up again: the next outage starts from its first line.
    assert log.failed("door", now=4000.0) == ""
    assert log.recovered("door", now=4001.0) == ""


async def test_a_camera_that_stays_down_writes_ten_lines_not_one_per_attempt(
    tmp_path: Path, nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="vidpipe.runtime")
    url = f"rtsp://127.0.0.1:{free_port()}/stream"  # nothing listens there
    path = tmp_path / "p.yaml"
    path.write_text(
        f"pipeline: down\nsources:\n  - {{url: '{url}', id: door, reconnect: {{min_delay: 0.1, max_delay: 0.1}}}}\n"
    )
    runtime = Runtime(load_config(path), nats_url=nats_server.url)
    await runtime.start()
    try:
        source = runtime.sources["door"].source
        await until(lambda: source.stats.reconnects >= 15, 30, "fifteen failed attempts")
    finally:
        await runtime.stop()
    lines = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("source door: cannot connect")
    ]
    assert len(lines) == 10
    assert [line.rsplit("; retry ", 1)[1].split(" ")[0] for line in lines] == [str(n) for n in range(1, 11)]
