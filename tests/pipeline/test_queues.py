"""The frame queue between a decode thread and the event loop."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from pipeline.queues import END, FrameQueue, StreamBreak


class CountingLoop:
    """Counts the cross-thread wake-ups a queue asks of its event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.wakes = 0

    def call_soon_threadsafe(self, callback: Any, *args: Any) -> Any:
        self.wakes += 1
        return self.loop.call_soon_threadsafe(callback, *args)


def test_a_waiting_consumer_is_woken_by_each_put_and_by_the_end() -> None:
    async def main() -> tuple[list[Any], int]:
        spy = CountingLoop(asyncio.get_running_loop())
        queue: FrameQueue[int] = FrameQueue(4, "block", spy)  # type: ignore[arg-type]
        got: list[Any] = []

        def produce() -> None:
            for i in range(3):
                while not queue._waiting:  # put only once the consumer waits
                    threading.Event().wait(0.001)
                queue.put(i)
            while not queue._waiting:
                threading.Event().wait(0.001)
            queue.put_end()

        thread = threading.Thread(target=produce)
        thread.start()
        while (item := await asyncio.wait_for(queue.get(), 5)) is not END:
            got.append(item)
        thread.join()
        return got, spy.wakes

    got, wakes = asyncio.run(main())
    assert got == [0, 1, 2]
    assert wakes == 4  # three frames and the end, each found the consumer waiting


def test_frames_put_while_the_consumer_is_busy_need_no_wake_up() -> None:
    async def main() -> tuple[list[Any], int]:
        spy = CountingLoop(asyncio.get_running_loop())
        queue: FrameQueue[int] = FrameQueue(8, "block", spy)  # type: ignore[arg-type]
        thread = threading.Thread(target=lambda: [queue.put(i) for i in range(5)])
        thread.start()
        thread.join()
        got = [await asyncio.wait_for(queue.get(), 5) for _ in range(5)]
        return got, spy.wakes

    got, wakes = asyncio.run(main())
    assert got == [0, 1, 2, 3, 4]
    assert wakes == 0


def test_drop_oldest_keeps_the_newest_frames_and_reports_the_dropped_one() -> None:
    async def main() -> tuple[list[Any], list[int]]:
        dropped: list[int] = []
        queue: FrameQueue[int] = FrameQueue(2, "drop_oldest", asyncio.get_running_loop(), dropped.append)
        for i in range(4):
            assert queue.put(i)
        return [await queue.get(), await queue.get()], dropped

    got, dropped = asyncio.run(main())
    assert got == [2, 3]
    assert dropped == [0, 1]


def test_a_stream_break_is_never_dropped_and_only_a_queue_that_asks_gets_one() -> None:
    async def main() -> tuple[list[Any], list[int], int]:
        dropped: list[int] = []
        loop = asyncio.get_running_loop()
        queue: FrameQueue[int] = FrameQueue(3, "drop_oldest", loop, dropped.append, breaks=True)
        plain: FrameQueue[int] = FrameQueue(3, "drop_oldest", loop)
        for q in (queue, plain):
            q.put(0)
            q.put_break(1)
            for i in range(1, 4):
                q.put(i)
        got = [await queue.get() for _ in range(3)]
        return [repr(g) if isinstance(g, StreamBreak) else g for g in got], dropped, len(plain)

    got, dropped, plain = asyncio.run(main())
    # The full queue dropped the oldest frames around the break, never the break itself.
    assert got == ["StreamBreak(next_index=1)", 2, 3]
    assert dropped == [0, 1]
    assert plain == 3


def test_a_closed_queue_refuses_frames() -> None:
    async def main() -> bool:
        queue: FrameQueue[int] = FrameQueue(1, "block", asyncio.get_running_loop())
        queue.close()
        return queue.put(1)

    assert asyncio.run(main()) is False
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ValueError, match="maxsize must be at least 1"):
            FrameQueue(0, "block", loop)
    finally:
        loop.close()


def test_a_full_queue_lets_its_decoder_resume_only_once_half_is_taken() -> None:
    async def main() -> list[int]:
        queue: FrameQueue[int] = FrameQueue(4, "block", asyncio.get_running_loop())
        for i in range(4):
            queue.put(i)
        resumed = threading.Event()

        def produce() -> None:
            queue.put(4)
            resumed.set()

        thread = threading.Thread(target=produce)
        thread.start()
        got = [await queue.get()]  # three left: the decoder keeps waiting
        await asyncio.sleep(0.3)  # past the producer's 0.1 s re-check
        assert not resumed.is_set()
        got.append(await queue.get())  # two left (half of 4): it resumes
        assert await asyncio.to_thread(resumed.wait, 5)
        thread.join()
        got += [await queue.get() for _ in range(3)]
        return got

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]
