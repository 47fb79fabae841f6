"""/metrics shows a NATS outage at the next scrape, and the process series the docs name exist."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from pipeline.config import NatsConfig
from pipeline.metrics import Metrics
from pipeline.nats_server import EmbeddedNats
from pipeline.stages.publish import Publisher
from tests.pipeline.stack import Stack

PIPELINE = """\
pipeline: m
sources:
  - {id: cam, url: "test://?fps=30&width=160&height=120"}
nats: {publish: core, outbox_size: 1000}
runtime: {drain_timeout: 1}  # the broker does not come back: do not wait for it at the stop
http: {listen: "127.0.0.1:0"}
"""

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(stack: Stack) -> Samples:
    """One scrape of ``/metrics`` over HTTP, as Prometheus does it."""
    status, body = await stack.json("GET", "/metrics")
    assert status == 200
    assert isinstance(body, bytes)
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def get(s: Samples, name: str, **labels: str) -> float | None:
    return s.get((name, tuple(sorted(labels.items()))))


async def scrape_until(stack: Stack, ok: Callable[[Samples], bool], timeout: float, what: str) -> Samples:
    """Scrape until ``ok(samples)`` holds; fail with ``what`` after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        s = await scrape(stack)
        if ok(s):
            return s
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last scrape: {s}")
        await asyncio.sleep(0.05)


async def test_a_nats_outage_shows_at_the_next_scrape(tmp_path: Path) -> None:
    server = EmbeddedNats().start()
    stack = await Stack.start(tmp_path, PIPELINE, server.url)
    try:
        up = await scrape_until(
            stack,
            lambda s: (get(s, "vidpipe_published_messages_total", pipeline="m", source="cam") or 0) >= 5,
            30,
            "frames published",
        )
        assert get(up, "vidpipe_nats_connected", pipeline="m") == 1.0
        assert get(up, "vidpipe_publish_outbox_messages", pipeline="m") == 0.0
        # The series docs/operations.md names for the process's memory.
        rss = get(up, "process_resident_memory_bytes")
        assert rss is not None and rss > 0

        server.stop(kill=True)
        down = await scrape_until(
            stack,
            lambda s: (
                get(s, "vidpipe_nats_connected", pipeline="m") == 0.0
                and (get(s, "vidpipe_publish_outbox_messages", pipeline="m") or 0) > 0
            ),
            15,
            "the outage on /metrics",
        )
        # Frames keep coming while nothing leaves, and nothing was dropped yet: before
        # these gauges, no series told the outage apart from a quiet camera.
        frames = get(down, "vidpipe_frames_total", pipeline="m", source="cam") or 0
        later = await scrape_until(
            stack,
            lambda s: (get(s, "vidpipe_frames_total", pipeline="m", source="cam") or 0) > frames,
            15,
            "more frames during the outage",
        )
        assert get(later, "vidpipe_nats_connected", pipeline="m") == 0.0
        outbox = get(later, "vidpipe_publish_outbox_messages", pipeline="m") or 0
        assert outbox >= (get(down, "vidpipe_publish_outbox_messages", pipeline="m") or 0)
        assert (
            get(later, "vidpipe_publish_errors_total", pipeline="m", source="cam", reason="outbox_full")
            is None
        )
    finally:
        await stack.close()
        server.cleanup()


def test_several_metrics_in_one_process_each_have_the_process_series() -> None:
    # Each runtime owns a registry; the process collector must not clash between them.
    first, second = Metrics(), Metrics()
    for metrics in (first, second):
        rss = metrics.registry.get_sample_value("process_resident_memory_bytes")
        assert rss is not None and rss > 0


def test_without_nats_there_is_no_connection_series() -> None:
    # An embedding program without NATS has no link that could be down: no 0 to alert on.
    metrics = Metrics()
    Publisher(NatsConfig(), None, "m", metrics)
    assert metrics.registry.get_sample_value("vidpipe_nats_connected", {"pipeline": "m"}) is None
    assert metrics.registry.get_sample_value("vidpipe_publish_outbox_messages", {"pipeline": "m"}) is None
