"""Stopping a background task: cancel it and wait until it has finished.

Written once because the obvious form is wrong twice over::

    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task

swallows a cancel of the *caller* too: a loop that restarts a watcher this way and
is itself cancelled meanwhile carries on as if nothing happened. And on Python 3.11
a cancel can be lost inside the task: ``asyncio.wait_for`` returns its result when
the awaited call finishes in the same turn as the cancel arrives, so a ``while
True`` loop of requests goes round again (CPython issue 86296, fixed in 3.12).
Whoever waits for either waits for ever.
"""

from __future__ import annotations

import asyncio
from typing import Any

# How long a cancelled task gets to finish before it is cancelled again.
RECANCEL_AFTER = 1.0


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None) -> None:
    """Cancel ``tasks`` (``None`` skipped) and wait until each has finished; outcomes dropped.

    A task that is still running after :data:`RECANCEL_AFTER` seconds is cancelled
    again (its first cancel was lost). A cancel of the caller while it waits is
    raised as usual; the tasks still get theirs.
    """
    pending = {t for t in tasks if t is not None}
    live = list(pending)
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_AFTER)
    for task in live:
        if not task.cancelled():
            task.exception()  # retrieved: a task that failed as it stopped is not reported again
