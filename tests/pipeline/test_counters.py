"""A source's counters: exact counts from several threads, and an fps on their own clock."""

from __future__ import annotations

import threading

from pipeline.counters import SourceCounters


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_fps_is_the_published_rate_over_the_last_five_seconds_and_falls_to_zero() -> None:
    clock = FakeClock()
    counters = SourceCounters(clock=clock)
    assert counters.fps() is None  # nothing published yet
    counters.message_published()
    assert counters.fps() is None  # no span to measure over
    for k in range(1, 81):  # 10 messages a second for 8 s
        clock.now = k / 10
        counters.message_published()
    assert counters.published == 81
    assert counters.fps() == 10.0
    for k in range(81, 101):  # then 20 a second for 1 s: the 5 s window sees both rates
        clock.now = 8.0 + (k - 80) / 20
        counters.message_published()
    assert counters.fps() == round((101 - 41) / 5.0, 2)  # from the sample at t=4 (41 published)
    clock.now = 13.0
    assert counters.fps() == round((101 - 81) / 5.0, 2)  # since t=8: the burst alone
    clock.now = 14.0
    assert counters.fps() == 0.0  # nothing for 5 s


def test_young_sources_measure_from_their_first_message() -> None:
    clock = FakeClock()
    counters = SourceCounters(clock=clock)
    counters.message_published()
    clock.now = 0.9
    counters.message_published()
    assert counters.fps() is None  # under a second of samples
    clock.now = 2.0
    counters.message_published()
    assert counters.fps() == 1.0  # (3 - 1) messages since the first sample, 2 s ago


def test_drops_and_reconnects_from_threads_count_exactly() -> None:
    counters = SourceCounters()
    start = threading.Barrier(3)

    def producer() -> None:  # a source's thread: frames, its own drops, reconnects
        start.wait()
        for _ in range(20_000):
            counters.frame_queued()
            counters.drop("max_fps")
            counters.drop("queue_full")
        counters.reconnect("timeout")

    def graph() -> None:  # the event loop's drops, at the same time
        start.wait()
        for _ in range(20_000):
            counters.drop("queue_full")
            counters.drop("stage_error")

    threads = [threading.Thread(target=producer), threading.Thread(target=graph)]
    for t in threads:
        t.start()
    start.wait()
    for t in threads:
        t.join()
    assert counters.dropped_by_reason() == {"max_fps": 20_000, "queue_full": 40_000, "stage_error": 20_000}
    assert (counters.frames, counters.decoded, counters.reconnects) == (20_000, 40_000, 1)
    assert counters.reconnects_by_reason() == {"timeout": 1}
