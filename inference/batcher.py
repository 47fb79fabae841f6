"""The dynamic batch scheduler: queues requests and runs batches on a model's instances.

:class:`DynamicBatcher` owns one worker thread per model instance (the
``instance_group`` counts, summed). A free worker takes the next batch that the
rules in :mod:`inference.batch_policy` allow, runs it through its instance and
answers every request in it. An instance is only ever called from its own
worker thread, one batch at a time. It is configured by the model's
``config.yaml``::

    max_batch_size: 16
    dynamic_batching:
      preferred_batch_size: [8, 16]
      max_queue_delay_microseconds: 2000
      preserve_ordering: false          # true: answers leave in request order
      default_queue_policy: {max_queue_size: 256, timeout_action: REJECT}
    instance_group: [{count: 2}]

Callers use ``await batcher.infer(item)`` from asyncio, or ``batcher.submit(item)``
(a :class:`concurrent.futures.Future`) from plain threads. A request that cannot
be served raises :class:`InferenceRejected` with a ``reason``: ``queue_full``
(at once, when the priority level's queue is full), ``timeout`` (its queue
timeout passed, :class:`InferenceTimeout`), ``unavailable`` (the batcher is not
running) or ``shutdown`` (the batcher stopped before serving it). A batch whose
instance raised is run again one request at a time, so only a request whose own input
makes the model raise fails (:class:`InferenceFailed`); its batch mates get their
results. An error no input caused (:class:`~inference.errors.WholeBatchFailure`: a
server down) fails the whole batch at once instead. A runner may also put an exception
in one item's place among its results (a NaN output): that request alone fails.
Each reason is counted apart (:class:`BatcherStats` ``rejected`` for ``queue_full``,
``timed_out``, ``unavailable``, ``shutdown``), so a stop does not read as overload.

With ``preserve_ordering``, successful and failed answers are released in the
order their requests were accepted, across all instances. Rejections (timeout,
shutdown) are answered at once and never hold other answers back.

Counts are kept once, in the model's :class:`BatcherStats`: the batcher's
:class:`InferenceObserver` hands it out (``counters(model)``), so every copy of a
model (a reload starts a new one) counts into the same object, and whoever
exports metrics or reports reads that object instead of being told each event.
The observer also hears state changes; it is called from worker threads and must
be quick and thread-safe.

:meth:`DynamicBatcher.free_in` estimates when an instance could start a request
queued now (from each running batch's start and the recent compute time of batches
of its size): what the pipeline's paced admission waits on.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import concurrent.futures
import contextlib
import heapq
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from inference.batch_policy import BatchPolicy, PendingQueue, Send, next_batch, split_by_level
from inference.errors import VidpipeError, WholeBatchFailure
from inference.ratelimit import RateLimitedLog

# Under "vidpipe." like the pipeline's loggers: one tree to configure, "vidpipe.inference.*" here.
log = logging.getLogger(f"vidpipe.{__name__}")

QUEUE_FULL = "queue_full"
TIMEOUT = "timeout"
UNAVAILABLE = "unavailable"
SHUTDOWN = "shutdown"
# A refusal's reason -> the BatcherStats field that counts it.
_REFUSALS = {QUEUE_FULL: "rejected", UNAVAILABLE: "unavailable", SHUTDOWN: "shutdown"}


class InferenceError(VidpipeError, RuntimeError):
    """A request to ``model`` was not answered with a result."""

    def __init__(self, model: str, message: str) -> None:
        self.model = model
        super().__init__(f"{model}: {message}")


class InferenceRejected(InferenceError):
    """The request was refused or dropped before it ran; ``reason`` says why."""

    def __init__(self, model: str, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(model, f"request rejected ({reason})" + (f": {detail}" if detail else ""))


class InferenceTimeout(InferenceRejected):
    """The request's queue timeout passed before a batch took it."""

    def __init__(self, model: str, detail: str = "") -> None:
        super().__init__(model, TIMEOUT, detail)


class InferenceFailed(InferenceError):
    """The model raised on the request (alone or in its batch), or gave no result for its input;
    ``__cause__`` is the original error."""


class InferenceObserver(Protocol):
    """Hands out each model's counters and hears its state changes; called from worker threads."""

    def counters(self, model: str) -> BatcherStats:
        """The counters ``model``'s batchers count into (the same object for every copy of it)."""

    def on_state(self, model: str, state: str, reason: str) -> None:
        """The model changed state (``loading``, ``ready``, ``unavailable``, ``unloaded``)."""


class NullObserver:
    """The default observer: counters of the batcher's own, no one told of states."""

    def counters(self, model: str) -> BatcherStats:
        return BatcherStats()

    def on_state(self, model: str, state: str, reason: str) -> None:
        pass


# Upper bounds (seconds) of the buckets queue and compute times are counted in: those of
# vidpipe_inference_queue_seconds and vidpipe_inference_compute_seconds. Video work spans
# milliseconds to seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 2.0, 5.0, 10.0)  # fmt: skip
RECENT = 256  # latest queue and compute times kept for percentiles
# Weight of the newest batch in the compute estimate of its size: about the last ten batches.
COMPUTE_WEIGHT = 0.2


def _recent() -> collections.deque[float]:
    return collections.deque(maxlen=RECENT)


def _buckets() -> list[int]:
    return [0] * (len(LATENCY_BUCKETS) + 1)  # the last one: over the largest bound


@dataclass(slots=True)
class BatcherStats:
    """One model's counters since it was first loaded (``created``, unix s).

    Written by the batcher's worker threads under ``lock``; read through
    :meth:`snapshot` (``DynamicBatcher.stats`` and ``Model.stats`` return one).
    ``queue_buckets``/``compute_buckets`` count times per :data:`LATENCY_BUCKETS`
    bucket (not cumulative; the last counts those over the largest bound).
    """

    received: int = 0  # accepted into the queue
    succeeded: int = 0
    failed: int = 0
    rejected: int = 0  # queue_full: the priority level's queue was full
    unavailable: int = 0  # refused: the batcher was not running (or the model not ready)
    shutdown: int = 0  # refused, or dropped from the queue, because the model was stopping
    timed_out: int = 0
    delayed: int = 0  # requests moved behind by timeout_action DELAY
    cancelled: int = 0  # the caller gave up before its batch ran
    batches: int = 0
    batched_requests: int = 0
    queue_seconds: float = 0.0  # summed over requests
    compute_seconds: float = 0.0  # summed over batches
    batch_sizes: dict[int, int] = field(default_factory=dict)  # size -> batches of that size
    queue_buckets: list[int] = field(default_factory=_buckets)  # per request
    compute_buckets: list[int] = field(default_factory=_buckets)  # per batch
    queue_recent: collections.deque[float] = field(default_factory=_recent)
    compute_recent: collections.deque[float] = field(default_factory=_recent)
    created: float = field(default_factory=time.time)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def batch_ran(self, size: int, queue_seconds: list[float], compute: float, failed: int) -> None:
        """Count one batch of ``size`` requests (each waited ``queue_seconds``) that took ``compute``,
        ``failed`` of them failed (a retried batch counts once, at the size it was formed)."""
        bounds = LATENCY_BUCKETS
        with self.lock:
            self.batches += 1
            self.batched_requests += size
            self.batch_sizes[size] = self.batch_sizes.get(size, 0) + 1
            self.compute_seconds += compute
            self.compute_buckets[bisect.bisect_left(bounds, compute)] += 1
            self.compute_recent.append(compute)
            buckets = self.queue_buckets
            for q in queue_seconds:
                buckets[bisect.bisect_left(bounds, q)] += 1
            self.queue_seconds += sum(queue_seconds)
            self.queue_recent.extend(queue_seconds)
            self.failed += failed
            self.succeeded += size - failed

    def refused(self, reason: str, n: int = 1) -> None:
        """Count ``n`` requests refused or dropped for ``reason`` (``queue_full``,
        ``unavailable``, ``shutdown``), each under a field of its own."""
        field_name = _REFUSALS[reason]
        with self.lock:
            setattr(self, field_name, getattr(self, field_name) + n)

    def snapshot(self) -> BatcherStats:
        """A consistent copy (with a lock of its own)."""
        with self.lock:
            return BatcherStats(
                received=self.received,
                succeeded=self.succeeded,
                failed=self.failed,
                rejected=self.rejected,
                unavailable=self.unavailable,
                shutdown=self.shutdown,
                timed_out=self.timed_out,
                delayed=self.delayed,
                cancelled=self.cancelled,
                batches=self.batches,
                batched_requests=self.batched_requests,
                queue_seconds=self.queue_seconds,
                compute_seconds=self.compute_seconds,
                batch_sizes=dict(self.batch_sizes),
                queue_buckets=list(self.queue_buckets),
                compute_buckets=list(self.compute_buckets),
                queue_recent=collections.deque(self.queue_recent, maxlen=RECENT),
                compute_recent=collections.deque(self.compute_recent, maxlen=RECENT),
                created=self.created,
            )


Runner = Callable[[list[Any]], Sequence[Any]]
"""Runs one batch on one instance: items in, one result per item out (same order).

A result that is an :class:`Exception` fails that item's request alone."""

_Outcome = tuple["_Request", Any, BaseException | None]

_NEW, _RUNNING, _DRAINING, _STOPPED = "new", "running", "draining", "stopped"


class _Request:
    __slots__ = ("enqueued", "future", "item", "loop", "seq")

    def __init__(
        self,
        item: Any,
        loop: asyncio.AbstractEventLoop | None,
        future: asyncio.Future[Any] | concurrent.futures.Future[Any],
    ) -> None:
        self.item = item
        self.loop = loop
        self.future = future
        self.enqueued = 0.0
        self.seq = -1

    def claim(self) -> bool:
        """Mark the request as running; ``False`` if its caller already cancelled it."""
        if self.loop is None:
            fut: concurrent.futures.Future[Any] = self.future  # type: ignore[assignment]
            return fut.set_running_or_notify_cancel()
        # Reading another loop's future state from this thread is a benign race:
        # at worst a request cancelled this very moment still runs.
        return not self.future.cancelled()


def _settle_async(outcomes: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    for fut, result, exc in outcomes:
        if fut.done():
            continue
        if exc is None:
            fut.set_result(result)
        else:
            fut.set_exception(exc)


class DynamicBatcher:
    """Batches requests for one model and runs them on its instances.

    ``runners`` holds one callable per instance; each is called only from its own
    worker thread. ``clock`` (seconds, monotonic) drives every timing rule; with
    an injected clock, call :meth:`wakeup` after moving it.
    """

    def __init__(
        self,
        name: str,
        policy: BatchPolicy,
        runners: Sequence[Runner],
        *,
        observer: InferenceObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        stop_timeout: float = 10.0,
    ) -> None:
        if not runners:
            raise ValueError(f"{name}: a batcher needs at least one instance")
        self.name = name
        self._failure_log = RateLimitedLog(logger=log, level=logging.WARNING)
        self.policy = policy
        self.observer: InferenceObserver = observer or NullObserver()
        self._runners = list(runners)
        self._clock = clock
        self._stop_timeout = stop_timeout
        self._lock = threading.Lock()
        self._work_cond = threading.Condition(self._lock)
        self._reaper_cond = threading.Condition(self._lock)
        self._queue: PendingQueue[_Request] = PendingQueue(policy)
        self._state = _NEW
        self._idle = 0
        self._inflight: list[list[_Request] | None] = [None] * len(self._runners)
        # When each instance's running batch started (clock), and the recent compute
        # seconds of a batch per size: what free_in() estimates from.
        self._started: list[float] = [0.0] * len(self._runners)
        self._compute: dict[int, float] = {}
        self._received = 0
        self._idle_listeners: list[Callable[[], None]] = []
        self._threads: list[threading.Thread] = []
        self._has_timeouts = policy.has_timeouts
        self._ordered = policy.preserve_ordering
        self._seq = 0
        self._next_seq = 0
        self._reorder: dict[int, _Outcome | None] = {}
        self._reaper_target = math.inf
        # Shared with the model's other copies (a reload); written under its own lock.
        self._stats = self.observer.counters(name)

    # -- lifecycle ---------------------------------------------------------

    @property
    def instance_count(self) -> int:
        return len(self._runners)

    @property
    def running(self) -> bool:
        return self._state == _RUNNING

    def start(self) -> None:
        """Start one worker thread per instance (and a timeout watcher if timeouts are configured)."""
        with self._lock:
            if self._state != _NEW:
                raise RuntimeError(f"{self.name}: the batcher was already started")
            self._state = _RUNNING
        for index, runner in enumerate(self._runners):
            t = threading.Thread(
                target=self._worker, args=(index, runner), name=f"{self.name}-instance-{index}", daemon=True
            )
            self._threads.append(t)
        if self._has_timeouts:
            self._threads.append(
                threading.Thread(target=self._reaper, name=f"{self.name}-timeouts", daemon=True)
            )
        for t in self._threads:
            t.start()

    def stop(self, *, drain: bool = False, timeout: float | None = None) -> None:
        """Stop taking requests and join the worker threads.

        Without ``drain`` every queued request fails at once with reason
        ``shutdown``; with it, queued requests are still run (without waiting for
        batching delays). Batches already running always finish. If a thread is
        still busy after ``timeout`` seconds (default: the batcher's
        ``stop_timeout``) its requests fail with ``shutdown`` too, so no caller waits
        forever.
        """
        with self._lock:
            dropped: list[_Request] = []
            if self._state == _NEW:
                self._state = _STOPPED
            elif self._state in (_RUNNING, _DRAINING):
                if drain and self._state == _RUNNING:
                    self._state = _DRAINING
                else:
                    self._state = _STOPPED
                    dropped = self._queue.take_all()
            self._work_cond.notify_all()
            self._reaper_cond.notify_all()
            deliver = self._reject_locked(dropped, SHUTDOWN)
        self._deliver(deliver)
        limit = self._stop_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._state = _STOPPED
            leftovers = self._queue.take_all()
            for index, t in enumerate(self._threads[: len(self._runners)]):
                batch = self._inflight[index]
                if t.is_alive() and batch:
                    log.warning(
                        "%s: instance %d still busy after %.1fs; failing its batch", self.name, index, limit
                    )
                    leftovers.extend(batch)
                    self._inflight[index] = None
            deliver = self._reject_locked(leftovers, SHUTDOWN)
        self._deliver(deliver)

    def wakeup(self) -> None:
        """Re-evaluate delays and timeouts now (after moving an injected clock)."""
        with self._lock:
            self._work_cond.notify_all()
            self._reaper_cond.notify_all()

    # -- statistics --------------------------------------------------------

    @property
    def stats(self) -> BatcherStats:
        """A consistent copy of the model's counters (``delayed``: this copy's queue)."""
        snap = self._stats.snapshot()
        snap.delayed = self._queue.delayed
        return snap

    @property
    def pending(self) -> int:
        """Requests waiting in the queue."""
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        """Requests in batches that are running now."""
        with self._lock:
            return sum(len(b) for b in self._inflight if b)

    def compute_estimate(self, size: int) -> float | None:
        """Recent seconds of a batch of ``size`` (scaled from the nearest size seen); None before any ran."""
        with self._lock:
            return self._estimate_locked(size)

    def _estimate_locked(self, size: int) -> float | None:
        known = self._compute
        if size in known:
            return known[size]
        if not known:
            return None
        nearest = min(known, key=lambda n: (abs(n - size), n))
        return known[nearest] * size / nearest

    def on_idle(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` whenever an instance finds the queue empty and waits.

        It is called on the worker thread, holding the batcher's lock: it must only
        hand the news on (``loop.call_soon_threadsafe``), never block or call back in.
        """
        with self._lock:
            self._idle_listeners.append(listener)

    @property
    def received(self) -> int:
        """Requests this batcher accepted into its queue (this copy of the model only)."""
        return self._received

    def free_in(self, *, ahead: int = 0, batch: int = 1) -> float | None:
        """Seconds until an instance could start a batch of ``batch`` that a request queued now joins.

        Each running batch ends at its start plus the recent compute time of its size.
        The requests already waiting, and ``ahead`` more that the caller knows are on
        their way, go first in batches of ``batch``: each full one takes the next
        instance to come free, and a request queued now joins what is left. None
        before any batch ran. An estimate: batches vary, and one that runs over its
        estimate counts as ending now.
        """
        with self._lock:
            if not self._compute or self._state != _RUNNING:
                return None
            now = self._clock()
            ends: list[float] = []
            for started, running in zip(self._started, self._inflight, strict=True):
                estimate = self._estimate_locked(len(running)) if running else None
                ends.append(0.0 if estimate is None else max(0.0, started + estimate - now))
            size = max(1, min(batch, self.policy.batch_limit))
            full = (len(self._queue) + ahead) // size
            if full:
                seconds = self._estimate_locked(size) or 0.0
                heapq.heapify(ends)
                for _ in range(full):
                    heapq.heapreplace(ends, ends[0] + seconds)
            return min(ends)

    # -- requests ----------------------------------------------------------

    async def infer(self, item: Any, *, priority: int | None = None, timeout_us: int | None = None) -> Any:
        """Queue ``item`` and wait for its result.

        ``priority`` is a level in ``1..priority_levels`` (1 is the highest); none,
        0 or out of range means the default level. ``timeout_us`` only counts when
        the level's ``allow_timeout_override`` is set and can only shorten its
        default timeout.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._enqueue(_Request(item, loop, fut), priority, timeout_us)
        return await fut

    def submit(
        self, item: Any, *, priority: int | None = None, timeout_us: int | None = None
    ) -> concurrent.futures.Future[Any]:
        """Thread-safe, non-async :meth:`infer`: returns a future of the result.

        A request refused at once (``queue_full``, ``unavailable``, ``shutdown``)
        raises here rather than through the future.
        """
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._enqueue(_Request(item, None, fut), priority, timeout_us)
        return fut

    def _enqueue(self, req: _Request, priority: int | None, timeout_us: int | None) -> None:
        policy = self.policy
        level = policy.level_for(priority)
        timeout = policy.timeout_for(level, timeout_us) if self._has_timeouts else 0.0
        queue = self._queue
        with self._lock:
            state = self._state
            if state == _RUNNING:
                now = self._clock()
                req.enqueued = now
                if queue.push(req, level, now, timeout):
                    self._received += 1
                    if self._ordered:
                        req.seq = self._seq
                        self._seq += 1
                    stats = self._stats
                    with stats.lock:
                        stats.received += 1
                    if self._idle and (
                        len(queue) == 1
                        or type(next_batch(policy, queue.counts, queue.oldest_enqueue(), now)) is Send
                    ):
                        # Wake a worker only when its decision changes: the first
                        # request starts the delay timer, or a batch can go now.
                        self._work_cond.notify()
                    if timeout and now + timeout < self._reaper_target:
                        self._reaper_cond.notify()
                    return
                reason = QUEUE_FULL
                lp = policy.levels[level - 1]
                detail = f"priority level {level} already holds max_queue_size={lp.max_queue_size} requests"
            elif state == _NEW:
                reason, detail = UNAVAILABLE, "the batcher has not been started"
            else:
                reason, detail = SHUTDOWN, "the model is shutting down"
            self._stats.refused(reason)
        raise InferenceRejected(self.name, reason, detail)

    # -- workers -----------------------------------------------------------

    def _worker(self, index: int, runner: Runner) -> None:
        while True:
            batch, deliver = self._next_work(index)
            if deliver:
                self._deliver(deliver)
            if batch is None:
                return
            if batch:
                self._run_batch(index, runner, batch)

    def _next_work(self, index: int) -> tuple[list[_Request] | None, list[_Outcome]]:
        """Block until there is a batch for this worker; ``None`` means exit."""
        policy = self.policy
        queue = self._queue
        with self._lock:
            while True:
                state = self._state
                if state == _STOPPED:
                    return None, []
                if self._has_timeouts:
                    expired = queue.expire(self._clock())
                    if expired:
                        # Answer them outside the lock, then decide again.
                        return [], self._timeout_locked(expired)
                wait: float | None = None
                if len(queue):
                    if state == _DRAINING:
                        n = min(len(queue), policy.batch_limit)
                        decision: Send | None = Send(n, split_by_level(queue.counts, n))
                    else:
                        d = next_batch(
                            policy,
                            queue.counts,
                            queue.oldest_enqueue(),
                            self._clock(),
                            idle_instances=self._idle,
                        )
                        decision = d if type(d) is Send else None
                        wait = None if decision else d.seconds  # type: ignore[union-attr]
                    if decision is not None:
                        batch = queue.take(decision.per_level)
                        self._inflight[index] = batch
                        self._started[index] = self._clock()
                        if len(queue) and self._idle:
                            self._work_cond.notify()
                        return batch, []
                elif state == _DRAINING:
                    return None, []
                else:
                    for listener in self._idle_listeners:
                        listener()
                self._idle += 1
                try:
                    self._work_cond.wait(wait)
                finally:
                    self._idle -= 1

    def _run_batch(self, index: int, runner: Runner, batch: list[_Request]) -> None:
        claimed = [r.claim() for r in batch]
        if all(claimed):
            live, skipped = batch, []
        else:
            live = [r for r, ok in zip(batch, claimed, strict=True) if ok]
            skipped = [r for r, ok in zip(batch, claimed, strict=True) if not ok]
        clock = self._clock
        start = clock()
        n = len(live)
        outcomes: list[_Outcome] = []
        raised = False
        if n:
            items = [r.item for r in live]
            try:
                results = runner(items)
                if len(results) != n:
                    raise RuntimeError(f"instance returned {len(results)} results for {n} requests")
            except Exception as exc:
                raised = True
                outcomes = self._after_failure(index, runner, batch, live, exc)
            else:
                outcomes = [self._answer(r, res) for r, res in zip(live, results, strict=True)]
                self._log_item_failures(index, outcomes)
        compute = clock() - start
        enqueued = [r.enqueued for r in live]
        failures = sum(1 for _, _, err in outcomes if err is not None)
        with self._lock:
            if self._inflight[index] is not batch:
                # stop() gave up on this batch and already answered it.
                return
            self._inflight[index] = None
            # Counted before anyone is answered: a caller that sees its answer sees it counted.
            st = self._stats
            if skipped:
                with st.lock:
                    st.cancelled += len(skipped)
            if n:
                st.batch_ran(n, [start - t for t in enqueued], compute, failures)
                if not raised:
                    # A failed batch's time says nothing of the next one's (a refused remote
                    # call, or a batch and its retries).
                    last = self._compute.get(n)
                    self._compute[n] = compute if last is None else last + COMPUTE_WEIGHT * (compute - last)
            deliver = self._order_locked(outcomes, skipped) if self._ordered else outcomes
        self._deliver(deliver)

    def _answer(self, req: _Request, result: Any) -> _Outcome:
        """``req``'s outcome from its result; an exception in the result's place fails it alone."""
        if isinstance(result, Exception):
            err = InferenceFailed(self.name, str(result))
            err.__cause__ = result
            return (req, None, err)
        return (req, result, None)

    def _after_failure(
        self, index: int, runner: Runner, batch: list[_Request], live: list[_Request], exc: Exception
    ) -> list[_Outcome]:
        """The outcomes of the requests ``live`` whose batch raised ``exc``.

        A batch mixes requests of every camera, so one input the model raises on must
        not fail the others: a batch of more than one runs again request by request (at
        most ``len(live)`` more runs, and only after a failure), and only the requests
        that fail alone fail. An error no input caused fails them all at once.
        """
        n = len(live)
        name = self.name
        whole = n == 1 or isinstance(exc, WholeBatchFailure)
        outcomes: list[_Outcome] = []
        if not whole:
            for pos, r in enumerate(live):
                # Read without the lock: at worst one more request runs after a stop gave up.
                if self._inflight[index] is not batch:
                    return []  # stop() gave up on this batch and answered it
                try:
                    alone = runner([r.item])
                    if len(alone) != 1:
                        raise RuntimeError(f"instance returned {len(alone)} results for 1 request")
                except WholeBatchFailure as gone:
                    # The backend itself failed meanwhile (a server went down): this request and
                    # the ones not yet retried fail with that error, without waiting on it again.
                    for rest in live[pos:]:
                        outcomes.append((rest, None, self._failed(f"batch of {n} failed", gone)))
                    break
                except Exception as err:
                    what = f"failed when run alone, after its batch of {n} failed"
                    outcomes.append((r, None, self._failed(what, err)))
                else:
                    outcomes.append(self._answer(r, alone[0]))
            failed = sum(1 for _, _, err in outcomes if err is not None)
            suffix = f"; retried item by item: {failed} of {n} failed"
        else:
            outcomes = [(r, None, self._failed(f"batch of {n} failed", exc)) for r in live]
            suffix = "; not retried item by item: no input caused it" if n > 1 else ""
        # Every failure is counted; the log says it once per kind of error per 10 s (a dead
        # remote server fails every batch).
        self._failure_log(
            type(exc).__name__,
            f"{name}: batch of {n} failed on instance {index}: {exc}{suffix}",
            extra={"model": name},
        )
        return outcomes

    def _failed(self, what: str, exc: Exception) -> InferenceFailed:
        err = InferenceFailed(self.name, f"{what}: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        return err

    def _log_item_failures(self, index: int, outcomes: list[_Outcome]) -> None:
        """Log requests of a batch that ran but gave no result for their input (rate-limited)."""
        errors = [err for _, _, err in outcomes if err is not None]
        if not errors:
            return
        cause = errors[0].__cause__ or errors[0]
        self._failure_log(
            type(cause).__name__,
            f"{self.name}: {len(errors)} of {len(outcomes)} requests of a batch failed on instance "
            f"{index}: {cause}",
            extra={"model": self.name},
        )

    def _reaper(self) -> None:
        """Fail or move timed-out requests even while every instance is busy."""
        queue = self._queue
        while True:
            with self._lock:
                if self._state != _RUNNING:
                    return
                now = self._clock()
                expired = queue.expire(now)
                if not expired:
                    nd = queue.next_deadline()
                    self._reaper_target = math.inf if nd is None else nd
                    self._reaper_cond.wait(None if nd is None else max(0.0, nd - now))
                    continue
                deliver = self._timeout_locked(expired)
            self._deliver(deliver)

    # -- answers -----------------------------------------------------------

    def _timeout_locked(self, expired: list[_Request]) -> list[_Outcome]:
        with self._stats.lock:
            self._stats.timed_out += len(expired)
        out: list[_Outcome] = [
            (r, None, InferenceTimeout(self.name, "its queue timeout passed before a batch took it"))
            for r in expired
        ]
        return self._order_locked([], expired) + out if self._ordered else out

    def _reject_locked(self, reqs: list[_Request], reason: str) -> list[_Outcome]:
        if not reqs:
            return []
        self._stats.refused(reason, len(reqs))
        detail = "the model stopped before the request ran"
        out: list[_Outcome] = [(r, None, InferenceRejected(self.name, reason, detail)) for r in reqs]
        return self._order_locked([], reqs) + out if self._ordered else out

    def _order_locked(self, done: list[_Outcome], skipped: list[_Request]) -> list[_Outcome]:
        """Release answers in request order; ``skipped`` requests never get an ordered answer."""
        if not self._ordered:
            return done
        ready = self._reorder
        nxt = self._next_seq
        for r in skipped:
            if r.seq >= nxt:
                ready[r.seq] = None
        for o in done:
            if o[0].seq >= nxt:
                ready[o[0].seq] = o
        out: list[_Outcome] = []
        while nxt in ready:
            answer = ready.pop(nxt)
            if answer is not None:
                out.append(answer)
            nxt += 1
        self._next_seq = nxt
        return out

    def _deliver(self, outcomes: list[_Outcome]) -> None:
        if not outcomes:
            return
        by_loop: dict[
            asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Any, BaseException | None]]
        ] = {}
        for req, result, exc in outcomes:
            loop = req.loop
            if loop is None:
                fut: concurrent.futures.Future[Any] = req.future  # type: ignore[assignment]
                try:
                    if exc is None:
                        fut.set_result(result)
                    else:
                        fut.set_exception(exc)
                except concurrent.futures.InvalidStateError:
                    pass  # cancelled by its caller meanwhile
            elif loop in by_loop:
                by_loop[loop].append((req.future, result, exc))  # type: ignore[arg-type]
            else:
                by_loop[loop] = [(req.future, result, exc)]  # type: ignore[list-item]
        # One wake-up per event loop per batch, not per request.
        for loop, items in by_loop.items():
            # A closed event loop raises RuntimeError: nobody is waiting there any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle_async, items)
