"""The batch policy: when to send how many queued requests, and the queue they come from.

This module owns the decisions only; it has no threads and no clock of its own
(every function takes ``now``), so each rule can be checked in isolation. The
scheduler in :mod:`inference.batcher` calls it under its lock. The rules follow
Triton's dynamic batcher and are configured per model in ``config.yaml``::

    max_batch_size: 32                  # 0 = no batching: one request per execution
    dynamic_batching:
      preferred_batch_size: [16, 32]
      max_queue_delay_microseconds: 2000
      priority_levels: 2                # 1 is the highest priority
      default_priority_level: 2
      default_queue_policy:
        max_queue_size: 256             # per priority level; 0 = unbounded
        timeout_action: REJECT          # or DELAY
        default_timeout_microseconds: 0 # 0 = requests never time out
        allow_timeout_override: false
      priority_queue_policy:
        "1": {max_queue_size: 64}

Batch formation (:func:`next_batch`), evaluated whenever an instance is free:

* ``max_batch_size: 0`` sends one request per execution, as soon as one is pending.
* With other instances idle and no queue delay left to wait (the model has
  none, or the oldest request has waited it out), this instance counts only
  its share of the pending requests (rounded up); the rules below apply to
  that share. **This departs from Triton**, whose first free instance takes
  everything up to ``max_batch_size``: with preferred ``[4]``, four pending
  requests and four idle instances, Triton runs one batch of four and vidpipe
  four batches of one, side by side. On a CPU the instances share the cores,
  so an idle instance is throughput left unused, and the frames queued behind a
  batch held by one instance wait for all of it: the one-camera OCR demo, its
  detector at batch 4, ran at 32 frames/s with Triton's rule and 52 with the
  split; two OpenVINO instances fed by four callers with a 2 ms delay ran at
  half the speed of one instance (docs/PERFORMANCE.md). Under load no instance
  is idle and nothing is split; a batch that fills a preferred size before the
  delay runs out is what the operator asked for, and goes whole, as in Triton.
* If the pending requests (capped at ``max_batch_size``) can fill a preferred
  size, the largest such preferred size is sent at once.
* Without preferred sizes, a full ``max_batch_size`` batch is sent at once.
* Otherwise, with ``max_queue_delay_microseconds: 0`` everything pending (up to
  ``max_batch_size``) is sent at once; with a delay, the batcher waits until the
  oldest pending request has waited that long and then sends everything pending
  (up to ``max_batch_size``), preferred size or not.
* Requests leave the queue highest priority first; within a level, oldest first.

Timeouts (:meth:`PendingQueue.expire`): a request whose timeout passes while it is
still queued is, with ``timeout_action: REJECT``, removed and answered with a
timeout error. With ``DELAY`` it stays queued but moves behind every request of
its own priority level that has not timed out (it still goes before all lower
priority levels), and it is never rejected for its timeout afterwards.

Queue size (:meth:`PendingQueue.push`): a level that already holds
``max_queue_size`` requests refuses new ones; the caller rejects them as
``queue_full``.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from inference.config import ModelConfig, QueuePolicy

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class LevelPolicy:
    """The queue policy of one priority level, in seconds."""

    max_queue_size: int = 0
    timeout_s: float = 0.0
    delay_on_timeout: bool = False
    allow_timeout_override: bool = False

    @classmethod
    def from_config(cls, policy: QueuePolicy) -> LevelPolicy:
        return cls(
            max_queue_size=policy.max_queue_size,
            timeout_s=policy.default_timeout_microseconds / 1e6,
            delay_on_timeout=policy.timeout_action == "DELAY",
            allow_timeout_override=policy.allow_timeout_override,
        )


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    """Everything the batching rules need from a model's config."""

    max_batch_size: int = 8
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_s: float = 0.0
    levels: tuple[LevelPolicy, ...] = (LevelPolicy(),)
    default_level: int = 1
    preserve_ordering: bool = False

    def __post_init__(self) -> None:
        if not self.levels:
            raise ValueError("a batch policy needs at least one priority level")
        if not 1 <= self.default_level <= len(self.levels):
            raise ValueError(f"default level {self.default_level} is not in 1..{len(self.levels)}")

    @classmethod
    def from_config(cls, config: ModelConfig) -> BatchPolicy:
        """Translate ``max_batch_size`` and ``dynamic_batching`` into a policy.

        The config was checked when it was built (``priority_queue_policy`` keys
        are level numbers in ``1..priority_levels``).
        """
        db = config.dynamic_batching
        n_levels = max(1, db.priority_levels)
        overrides: dict[int, QueuePolicy] = {
            int(key): policy for key, policy in db.priority_queue_policy.items()
        }
        levels = tuple(
            LevelPolicy.from_config(overrides.get(level, db.default_queue_policy))
            for level in range(1, n_levels + 1)
        )
        preferred = () if config.max_batch_size == 0 else tuple(sorted(set(db.preferred_batch_size)))
        return cls(
            max_batch_size=config.max_batch_size,
            preferred_batch_sizes=preferred,
            max_queue_delay_s=db.max_queue_delay_microseconds / 1e6,
            levels=levels,
            default_level=db.default_priority_level if db.priority_levels else 1,
            preserve_ordering=db.preserve_ordering,
        )

    @property
    def batch_limit(self) -> int:
        """The most requests in one execution (1 for a model without a batch dimension)."""
        return max(1, self.max_batch_size)

    @property
    def has_timeouts(self) -> bool:
        """Whether any request can ever time out under this policy."""
        return any(lv.timeout_s > 0 or lv.allow_timeout_override for lv in self.levels)

    def level_for(self, priority: int | None) -> int:
        """The 1-based level a request with ``priority`` joins.

        As in Triton, no priority, 0, or a number outside ``1..priority_levels``
        means the default level.
        """
        if priority is None or not 1 <= priority <= len(self.levels):
            return self.default_level
        return priority

    def timeout_for(self, level: int, timeout_us: int | None) -> float:
        """Seconds a request may stay queued (0 = forever).

        A request's own timeout counts only when ``allow_timeout_override`` is set,
        and, as in Triton, it can only shorten a configured default, never extend it.
        """
        lp = self.levels[level - 1]
        if timeout_us and timeout_us > 0 and lp.allow_timeout_override:
            own = timeout_us / 1e6
            return min(own, lp.timeout_s) if lp.timeout_s > 0 else own
        return lp.timeout_s


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``count`` requests now: ``per_level[i]`` of them from priority level ``i + 1``."""

    count: int
    per_level: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Wait:
    """Send nothing yet; decide again after ``seconds``, or when something changes if ``None``."""

    seconds: float | None


Decision = Send | Wait


def split_by_level(pending: Sequence[int], count: int) -> tuple[int, ...]:
    """Take ``count`` requests from the levels in order, highest priority (index 0) first."""
    out = []
    left = count
    for n in pending:
        take = n if n < left else left
        out.append(take)
        left -= take
    return tuple(out)


def next_batch(
    policy: BatchPolicy,
    pending: Sequence[int],
    oldest_enqueue: float | None,
    now: float,
    *,
    idle_instances: int = 0,
) -> Decision:
    """Decide, for an instance that is free, whether to send a batch now and how big, or how long to wait.

    ``pending`` counts the queued requests per priority level (index 0 = level 1),
    ``oldest_enqueue`` is the enqueue time of the oldest of them. Timed-out
    requests must have been expired (:meth:`PendingQueue.expire`) before calling.

    ``idle_instances`` counts the other instances waiting for work. Once there is
    no queue delay left to wait, the requests waiting are shared with them (the
    one departure from Triton's rules; the module's docstring says why): four
    requests and four free instances make four batches of one that run at once,
    not one batch of four while three instances sit idle. Under load no instance
    is idle and a free one takes up to ``max_batch_size``, so batches grow as
    before. A preferred size filled within the delay goes whole.
    """
    total = sum(pending)
    if total == 0:
        # Nothing to do until a request arrives; an instance busy until then sees the
        # whole backlog when it is free, which is how batches grow under load.
        return Wait(None)
    if policy.max_batch_size == 0:
        return Send(1, split_by_level(pending, 1))
    limit = policy.max_batch_size
    available = total if total < limit else limit
    delay = policy.max_queue_delay_s
    age = now - oldest_enqueue if oldest_enqueue is not None else 0.0
    delay_exceeded = delay > 0 and age >= delay
    if idle_instances and (delay == 0 or delay_exceeded):
        share = -(-total // (idle_instances + 1))  # this instance's share, rounded up
        available = share if share < available else available
    preferred = policy.preferred_batch_sizes
    if preferred and not delay_exceeded:
        best = 0
        for size in preferred:
            if size <= available:
                best = size
        if best:
            return Send(best, split_by_level(pending, best))
    largest_wanted = preferred[-1] if preferred else limit
    if delay == 0 or delay_exceeded or available >= largest_wanted:
        return Send(available, split_by_level(pending, available))
    return Wait(delay - age)


class _Entry(Generic[T]):
    """One queued request; ``alive`` turns false when it is taken, rejected or moved."""

    __slots__ = ("alive", "deadline", "enqueued", "item", "level")

    def __init__(self, item: T, level: int, enqueued: float, deadline: float | None) -> None:
        self.item = item
        self.level = level
        self.enqueued = enqueued
        self.deadline = deadline
        self.alive = True


class PendingQueue(Generic[T]):
    """Per-priority FIFO queues with queue-size limits and timeouts.

    Each level has a main queue and, for ``timeout_action: DELAY``, a queue of
    timed-out requests that is served after the main one. Not thread-safe: the
    scheduler holds its lock around every call.
    """

    def __init__(self, policy: BatchPolicy) -> None:
        self.policy = policy
        n = len(policy.levels)
        self._main: list[deque[_Entry[T]]] = [deque() for _ in range(n)]
        self._delayed: list[deque[_Entry[T]]] = [deque() for _ in range(n)]
        self._counts = [0] * n
        self._total = 0
        # (deadline, tiebreak, entry) for requests that can still time out; taken
        # entries are skipped lazily and the heap is rebuilt when mostly stale.
        self._deadlines: list[tuple[float, int, _Entry[T]]] = []
        self._live_deadlines = 0
        self._tiebreak = 0
        self.delayed = 0  # requests ever moved behind by timeout_action DELAY

    def __len__(self) -> int:
        return self._total

    @property
    def counts(self) -> list[int]:
        """Queued requests per level, index 0 = level 1 (a copy)."""
        return list(self._counts)

    def push(self, item: T, level: int, now: float, timeout_s: float = 0.0) -> bool:
        """Queue ``item`` at 1-based ``level``; ``False`` if that level is full."""
        idx = level - 1
        limit = self.policy.levels[idx].max_queue_size
        if limit and self._counts[idx] >= limit:
            return False
        deadline = now + timeout_s if timeout_s > 0 else None
        entry = _Entry(item, level, now, deadline)
        self._main[idx].append(entry)
        self._counts[idx] += 1
        self._total += 1
        if deadline is not None:
            self._tiebreak += 1
            heapq.heappush(self._deadlines, (deadline, self._tiebreak, entry))
            self._live_deadlines += 1
        return True

    def oldest_enqueue(self) -> float | None:
        """Enqueue time of the oldest queued request, or ``None`` when empty."""
        oldest: float | None = None
        for queues in (self._main, self._delayed):
            for q in queues:
                if q:
                    t = q[0].enqueued
                    if oldest is None or t < oldest:
                        oldest = t
        return oldest

    def next_deadline(self) -> float | None:
        """The earliest timeout among queued requests, or ``None``."""
        heap = self._deadlines
        while heap and not heap[0][2].alive:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def expire(self, now: float) -> list[T]:
        """Apply timeouts at ``now``: return the rejected items; move DELAY ones behind."""
        heap = self._deadlines
        rejected: list[T] = []
        while heap and heap[0][0] <= now:
            _, _, entry = heapq.heappop(heap)
            if not entry.alive:
                continue
            self._live_deadlines -= 1
            entry.alive = False
            idx = entry.level - 1
            if self.policy.levels[idx].delay_on_timeout:
                # The old slot stays in the main deque as a dead entry; the request
                # lives on, without a deadline, at the back of the delayed queue.
                self._delayed[idx].append(_Entry(entry.item, entry.level, entry.enqueued, None))
                self.delayed += 1
            else:
                self._counts[idx] -= 1
                self._total -= 1
                rejected.append(entry.item)
            self._drop_dead_heads(self._main[idx])
        return rejected

    def take(self, per_level: Sequence[int]) -> list[T]:
        """Remove and return ``per_level[i]`` requests from level ``i + 1``, main queue first."""
        out: list[T] = []
        for idx, want in enumerate(per_level):
            if not want:
                continue
            for q in (self._main[idx], self._delayed[idx]):
                while want and q:
                    entry = q.popleft()
                    if not entry.alive:
                        continue
                    entry.alive = False
                    if entry.deadline is not None:
                        self._live_deadlines -= 1
                    out.append(entry.item)
                    want -= 1
                    self._counts[idx] -= 1
                    self._total -= 1
                self._drop_dead_heads(q)
        if len(self._deadlines) > 64 and len(self._deadlines) > 4 * self._live_deadlines:
            self._deadlines = [d for d in self._deadlines if d[2].alive]
            heapq.heapify(self._deadlines)
        return out

    def take_all(self) -> list[T]:
        """Remove and return everything, in the order it would have been sent."""
        return self.take(self.counts)

    @staticmethod
    def _drop_dead_heads(q: deque[_Entry[T]]) -> None:
        # Keeps q[0] alive so oldest_enqueue() reads one entry per deque.
        while q and not q[0].alive:
            q.popleft()
