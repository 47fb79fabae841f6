"""Stopping background tasks without swallowing a cancel of the one who stops them."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.cancel import cancel_and_wait


async def test_a_cancel_of_the_caller_is_raised_while_it_waits_for_a_task_to_stop() -> None:
    release = asyncio.Event()

    async def slow_to_stop() -> None:  # like a watcher that unsubscribes as it stops
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await release.wait()
            raise

    inner = asyncio.create_task(slow_to_stop())
    await asyncio.sleep(0)  # inner is now waiting
    waiting = asyncio.Event()

    async def stopper() -> str:
        waiting.set()
        await cancel_and_wait(inner)
        return "carried on"  # what `suppress(CancelledError): await inner` let happen

    outer = asyncio.create_task(stopper())
    await waiting.wait()  # outer is inside cancel_and_wait, inner is stopping
    outer.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await outer
    await asyncio.wait({inner})
    assert inner.cancelled()


async def test_every_task_is_cancelled_and_finished_and_none_is_skipped() -> None:
    async def fails_as_it_stops() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise RuntimeError("while stopping") from None

    tasks = [asyncio.create_task(asyncio.Event().wait()), asyncio.create_task(fails_as_it_stops())]
    await asyncio.sleep(0)
    await cancel_and_wait(tasks[0], None, tasks[1])
    assert tasks[0].cancelled()
    assert isinstance(tasks[1].exception(), RuntimeError)


async def test_a_task_that_lost_its_cancel_is_cancelled_again() -> None:
    rounds = 0

    async def loses_its_first_cancel() -> None:
        # What Python 3.11's wait_for does when the awaited call finishes as the cancel lands.
        nonlocal rounds
        while True:
            rounds += 1
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                if rounds == 1:
                    continue
                raise

    task = asyncio.create_task(loses_its_first_cancel())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task), 10)
    assert task.cancelled() and rounds == 2
