"""Stopping a background task: cancel it and wait until it has finished.

Written once because the obvious form is wrong::

    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task

swallows a cancel of the *caller* too: a loop that restarts a watcher this way and
is itself cancelled meanwhile carries on as if nothing happened, and whoever waits
for it to stop waits for ever.
"""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None) -> None:
    """Cancel ``tasks`` (``None`` skipped) and wait until each has finished; outcomes dropped.

    A cancel of the caller while it waits is raised as usual; the tasks still get theirs.
    """
    live = [t for t in tasks if t is not None]
    for task in live:
        task.cancel()
    if live:
        await asyncio.wait(live)
    for task in live:
        if not task.cancelled():
            task.exception()  # retrieved: a task that failed as it stopped is not reported again
