"""Paced admission: a frame enters the graph as the detector is about to be free.

With the derived graph limit (``runtime.max_in_flight`` unset) the graph holds a
batch at work on each of the detector's instances and the next one ready. Taken
as soon as a slot is free, that next frame waits in the batcher's queue for about
one whole inference, so a frame's time in the graph is about two inferences. Paced,
the frame that would wait is taken from its source only when the instance is
expected to come free (less a short lead), so it waits for little and the instance
still never idles; a live camera's frame taken later is also a fresher one::

    runtime:
      admission: paced      # the default; eager takes a frame as soon as a slot is free

The estimate is the batcher's (:meth:`~inference.batcher.DynamicBatcher.free_in`):
each running batch's start plus the recent compute time of batches of its size.
Frames admitted a moment ago that the batcher has not seen yet count as ahead,
so two frames deciding at once do not both count on the same instance. An
instance that finds its queue empty before its estimate lets the first held
frame in at once (:meth:`~inference.batcher.DynamicBatcher.on_idle`).

With a fixed ``interval: N`` only the frames the detector runs on (every N+1th
of a source) are held; the frames it skips go in at once. ``interval: auto``
decides in the stage, on the tracks, so it is not paced: a frame it lets through
would be held for nothing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from inference.batcher import DynamicBatcher
from inference.config import ModelConfig
from inference.errors import VidpipeError
from inference.repository import ModelRepository
from pipeline.config import PipelineConfig

log = logging.getLogger(__name__)

# The frame enters this much before the expected end of the running batch (a share of a
# batch's time, at least LEAD_MIN_S), so the event loop's wake-up and the stage's entry
# do not leave the instance idle; a batch that ends earlier still wakes the frame.
LEAD_SHARE = 0.1
LEAD_MIN_S = 0.003
# Waits shorter than this are not worth a timer; longer than MAX_WAIT_S, an estimate is
# not trusted (a model that slowed down shows itself in the next batches).
MIN_WAIT_S = 0.001
MAX_WAIT_S = 2.0
# A frame admitted this long ago that its model has not seen yet no longer counts as ahead.
STALE_S = 0.25


def batch_at_work(model: ModelConfig) -> int:
    """Frames one instance works on at once: a batch of the preferred size (1 without one)."""
    # A model without a batch dimension (max_batch_size 0) takes one frame per call.
    return max(model.dynamic_batching.preferred_batch_size, default=1) if model.max_batch_size else 1


def whole_frame_stages(config: PipelineConfig) -> list[Any]:
    """The stages running a model on whole frames (no ``on``): what admission is sized and paced by."""
    return [s for s in config.stages if getattr(s, "on", None) is None and s.models()]


@dataclass(frozen=True)
class PacedModel:
    """A model that paces admission: the batch it counts on, and the frames it runs on."""

    batch: int
    # A frame's model runs when its index is a multiple of one of these (interval + 1):
    # (1,) is every frame.
    every: tuple[int, ...] = (1,)

    def runs_on(self, index: int) -> bool:
        return any(index % n == 0 for n in self.every)


def frames_per_run(stage: Any) -> int:
    """Frames of a source per frame a whole-frame stage runs its model on (``interval: N``: N+1)."""
    interval = getattr(stage, "interval", 0)
    # interval: auto runs on a share the scene decides; it is sized like every frame.
    return interval + 1 if isinstance(interval, int) else 1


def paced_models(config: PipelineConfig, models: dict[str, ModelConfig]) -> dict[str, PacedModel]:
    """The models whose instances pace admission; empty when pacing does not apply.

    Those of the whole-frame ``infer`` stages, when ``runtime.admission`` is
    ``paced``, ``runtime.max_in_flight`` is derived and no such stage has
    ``interval: auto``.
    """
    runtime = config.runtime
    if runtime.admission != "paced" or runtime.max_in_flight is not None:
        return {}
    whole_frame = whole_frame_stages(config)
    if any(getattr(s, "interval", 0) == "auto" for s in whole_frame):
        return {}
    every: dict[str, set[int]] = {}
    for stage in whole_frame:
        for name in stage.models():
            if name in models:
                every.setdefault(name, set()).add(frames_per_run(stage))
    return {name: PacedModel(batch_at_work(models[name]), tuple(sorted(n))) for name, n in every.items()}


@dataclass
class _Pace:
    """One model's admissions that its batcher may not have seen yet."""

    model: PacedModel
    batcher: DynamicBatcher | None = None
    listening: DynamicBatcher | None = None  # the batcher that wakes this pacer's sleepers
    # (when the frame enters the graph, the batcher's received count once it has it)
    coming: collections.deque[tuple[float, int]] = field(default_factory=collections.deque)

    def ahead(self, batcher: DynamicBatcher, now: float) -> int:
        """Frames admitted (or about to be) that have not reached ``batcher`` yet."""
        if batcher is not self.batcher:  # loaded again: a new queue and count
            self.batcher = batcher
            self.coming.clear()
        received = batcher.received
        coming = self.coming
        # A frame that never reaches the model (dropped, end of stream) is forgotten after STALE_S.
        while coming and (coming[0][1] <= received or now - coming[0][0] > STALE_S):
            coming.popleft()
        return sum(1 for due, target in coming if target > received and now - due <= STALE_S)

    def reserve(self, due: float) -> None:
        last = self.coming[-1][1] if self.coming else 0
        assert self.batcher is not None
        self.coming.append((due, max(last, self.batcher.received) + 1))


class AdmissionPacer:
    """Holds a frame's admission until the paced models can start on it (see the module)."""

    def __init__(
        self,
        batchers: Callable[[str], DynamicBatcher | None],
        paced: dict[str, PacedModel],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # The model's batcher now (a reload replaces it), None while it is not ready.
        self._batchers = batchers
        self._clock = clock
        self._paces = {name: _Pace(model) for name, model in paced.items()}
        self.paced = 0  # admissions held (what a test or a benchmark reads)
        self.woken = 0  # of those, let in early by an instance that came free
        # Admissions held now, first come first woken: an instance that comes free before
        # its estimate lets the first of them in at once.
        self._sleepers: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def names(self) -> list[str]:
        return list(self._paces)

    def wait_seconds(self, index: int | None = None) -> float:
        """How long the next admission should wait now (0: at once), reserving its place.

        ``index`` is the frame's number in its source, when known: only the models
        that run on it (``interval``) hold it. Frames already admitted, or waiting to
        be, count as ahead of it until the model's batcher has them: two frames
        deciding in the same instant do not both take the instance that comes free first.
        """
        now = self._clock()
        wait = 0.0
        reserved: list[_Pace] = []
        for name, pace in self._paces.items():
            if index is not None and not pace.model.runs_on(index):
                continue  # the stage skips this frame: nothing to wait for
            batcher = self._batchers(name)
            if batcher is None:
                continue  # unloaded or reloading: nothing to pace on
            batch = pace.model.batch
            free_in = batcher.free_in(ahead=pace.ahead(batcher, now), batch=batch)
            if free_in is None:
                continue  # no batch has run yet
            batch_seconds = batcher.compute_estimate(batch) or 0.0
            wait = max(wait, free_in - max(LEAD_MIN_S, LEAD_SHARE * batch_seconds))
            reserved.append(pace)
        wait = min(wait, MAX_WAIT_S)
        for pace in reserved:
            pace.reserve(now + wait)
        return wait

    async def wait(self, index: int | None = None) -> float:
        """Sleep until the next frame (number ``index``) should enter the graph, or an instance comes free.

        Returns the seconds it held the frame (0.0 when it went in at once).
        """
        seconds = self.wait_seconds(index)
        loop = asyncio.get_running_loop()
        self._listen(loop)
        if seconds < MIN_WAIT_S:
            return 0.0
        self.paced += 1
        started = loop.time()
        woken = loop.create_future()
        self._sleepers.append(woken)
        try:
            await asyncio.wait_for(woken, seconds)
            self.woken += 1
        except TimeoutError:
            pass
        finally:
            if woken in self._sleepers:
                self._sleepers.remove(woken)
        return loop.time() - started

    def _listen(self, loop: asyncio.AbstractEventLoop) -> None:
        def came_free() -> None:  # on the batcher's worker thread
            # A closed event loop raises RuntimeError: nobody is waiting there any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._wake_one)

        for pace in self._paces.values():
            batcher = pace.batcher
            if batcher is not None and pace.listening is not batcher:
                batcher.on_idle(came_free)
                pace.listening = batcher

    def _wake_one(self) -> None:
        while self._sleepers:
            sleeper = self._sleepers.popleft()
            if not sleeper.done():
                sleeper.set_result(None)
                return


def repository_batchers(models: ModelRepository) -> Callable[[str], DynamicBatcher | None]:
    """Looks a ready model's batcher up in ``models`` each time (None while it is not ready)."""

    def batcher(name: str) -> DynamicBatcher | None:
        try:
            return models.get(name).batcher
        except (VidpipeError, LookupError):
            return None

    return batcher
