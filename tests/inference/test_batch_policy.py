"""The batching rules, decided with explicit times and counts (no threads, no clock)."""

from __future__ import annotations

import pytest

from inference.batch_policy import (
    BatchPolicy,
    LevelPolicy,
    PendingQueue,
    Send,
    Wait,
    next_batch,
    split_by_level,
)
from inference.config import (
    DynamicBatching,
    InputConfig,
    ModelConfig,
    ModelFile,
    QueuePolicy,
    TaskConfig,
)


def policy(
    max_batch_size: int = 8,
    preferred: tuple[int, ...] = (),
    delay_s: float = 0.0,
    levels: tuple[LevelPolicy, ...] = (LevelPolicy(),),
    default_level: int = 1,
) -> BatchPolicy:
    return BatchPolicy(
        max_batch_size=max_batch_size,
        preferred_batch_sizes=preferred,
        max_queue_delay_s=delay_s,
        levels=levels,
        default_level=default_level,
    )


# -- next_batch ------------------------------------------------------------------------------


def test_empty_queue_waits_for_a_request() -> None:
    assert next_batch(policy(), [0], None, 10.0) == Wait(None)


def test_no_delay_sends_whatever_is_pending_at_once() -> None:
    assert next_batch(policy(max_batch_size=8), [3], 9.9, 10.0) == Send(3, (3,))


def test_no_delay_caps_at_max_batch_size() -> None:
    assert next_batch(policy(max_batch_size=8), [20], 9.9, 10.0) == Send(8, (8,))


def test_without_preferred_sizes_a_full_batch_goes_before_the_delay() -> None:
    p = policy(max_batch_size=4, delay_s=1.0)
    assert next_batch(p, [4], 10.0, 10.0) == Send(4, (4,))
    assert next_batch(p, [9], 10.0, 10.0) == Send(4, (4,))


def test_with_delay_a_partial_batch_waits_for_the_remaining_delay() -> None:
    p = policy(max_batch_size=8, delay_s=0.002)
    decision = next_batch(p, [3], 10.0, 10.0005)
    assert isinstance(decision, Wait)
    assert decision.seconds == pytest.approx(0.0015)


def test_with_delay_a_partial_batch_goes_once_the_oldest_has_waited_the_delay() -> None:
    p = policy(max_batch_size=8, delay_s=0.002)
    assert next_batch(p, [3], 10.0, 10.002) == Send(3, (3,))
    assert next_batch(p, [3], 10.0, 10.5) == Send(3, (3,))


def test_the_largest_fillable_preferred_size_goes_at_once() -> None:
    p = policy(max_batch_size=16, preferred=(4, 8), delay_s=1.0)
    assert next_batch(p, [4], 10.0, 10.0) == Send(4, (4,))
    # 7 pending fill 4 but not 8: send 4 now, the other 3 wait.
    assert next_batch(p, [7], 10.0, 10.0) == Send(4, (4,))
    assert next_batch(p, [8], 10.0, 10.0) == Send(8, (8,))
    # More than the largest preferred size: still the largest preferred size, not everything.
    assert next_batch(p, [13], 10.0, 10.0) == Send(8, (8,))


def test_below_the_smallest_preferred_size_waits_for_the_delay() -> None:
    p = policy(max_batch_size=16, preferred=(4, 8), delay_s=1.0)
    assert next_batch(p, [3], 10.0, 10.25) == Wait(0.75)


def test_after_the_delay_everything_pending_goes_preferred_or_not() -> None:
    # As in Triton: once the oldest request has waited the delay, the batch is not
    # trimmed to a preferred size; it takes everything up to max_batch_size.
    p = policy(max_batch_size=16, preferred=(4, 8), delay_s=1.0)
    assert next_batch(p, [3], 10.0, 11.0) == Send(3, (3,))
    assert next_batch(p, [13], 10.0, 11.0) == Send(13, (13,))
    assert next_batch(p, [40], 10.0, 11.0) == Send(16, (16,))


def test_zero_delay_with_preferred_sizes_sends_preferred_then_the_rest() -> None:
    p = policy(max_batch_size=16, preferred=(4, 8), delay_s=0.0)
    assert next_batch(p, [5], 10.0, 10.0) == Send(4, (4,))
    assert next_batch(p, [1], 10.0, 10.0) == Send(1, (1,))
    assert next_batch(p, [12], 10.0, 10.0) == Send(8, (8,))


def test_max_batch_size_zero_sends_one_request_per_execution() -> None:
    # Preferred sizes and delays do not apply to a model without a batch axis.
    p = policy(max_batch_size=0, delay_s=5.0)
    assert next_batch(p, [7], 10.0, 10.0) == Send(1, (1,))
    assert p.batch_limit == 1


def test_higher_priority_levels_drain_first() -> None:
    p = policy(max_batch_size=8, levels=(LevelPolicy(), LevelPolicy(), LevelPolicy()))
    assert next_batch(p, [2, 3, 9], 10.0, 10.0) == Send(8, (2, 3, 3))
    assert next_batch(p, [0, 0, 5], 10.0, 10.0) == Send(5, (0, 0, 5))


def test_batch_size_counts_all_levels_together() -> None:
    p = policy(max_batch_size=8, preferred=(4,), delay_s=1.0, levels=(LevelPolicy(), LevelPolicy()))
    assert next_batch(p, [1, 3], 10.0, 10.0) == Send(4, (1, 3))
    assert next_batch(p, [1, 2], 10.0, 10.0) == Wait(1.0)


def test_split_by_level() -> None:
    assert split_by_level([3, 0, 4], 5) == (3, 0, 2)
    assert split_by_level([3, 0, 4], 0) == (0, 0, 0)


# -- BatchPolicy.from_config ---------------------------------------------------------------


def model_config(**kw: object) -> ModelConfig:
    base: dict[str, object] = {
        "name": "m",
        "model_file": ModelFile(path="m.onnx"),
        "input": InputConfig(shape=[3, 8, 8]),
        "task": TaskConfig(kind="classify"),
    }
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


def test_policy_from_config_reads_triton_fields() -> None:
    cfg = model_config(
        max_batch_size=32,
        dynamic_batching=DynamicBatching(
            preferred_batch_size=[32, 16, 16],
            max_queue_delay_microseconds=2500,
            priority_levels=2,
            default_priority_level=2,
            default_queue_policy=QueuePolicy(max_queue_size=10, default_timeout_microseconds=1000),
            priority_queue_policy={"1": QueuePolicy(timeout_action="DELAY")},
            preserve_ordering=True,
        ),
    )
    p = BatchPolicy.from_config(cfg)
    assert p.max_batch_size == 32
    assert p.preferred_batch_sizes == (16, 32)
    assert p.max_queue_delay_s == pytest.approx(0.0025)
    assert p.levels == (
        LevelPolicy(max_queue_size=0, timeout_s=0.0, delay_on_timeout=True),
        LevelPolicy(max_queue_size=10, timeout_s=0.001),
    )
    assert p.default_level == 2
    assert p.preserve_ordering is True
    assert p.has_timeouts is True


def test_a_queue_policy_for_a_missing_level_is_refused_when_the_config_is_built() -> None:
    with pytest.raises(ValueError, match=r"key '3' is not a priority level in 1\.\.2"):
        DynamicBatching(
            priority_levels=2, default_priority_level=1, priority_queue_policy={"3": QueuePolicy()}
        )
    with pytest.raises(ValueError, match=r"key 'one' is not a priority level in 1\.\.1"):
        DynamicBatching(priority_queue_policy={"one": QueuePolicy()})


def test_priority_levels_outside_the_range_use_the_default() -> None:
    p = policy(levels=(LevelPolicy(), LevelPolicy(), LevelPolicy()), default_level=2)
    assert [p.level_for(x) for x in (None, 0, 1, 2, 3, 4, -1)] == [2, 2, 1, 2, 3, 2, 2]


def test_request_timeouts_only_shorten_and_only_when_allowed() -> None:
    fixed = policy(levels=(LevelPolicy(timeout_s=0.01),))
    assert fixed.timeout_for(1, 500) == 0.01  # override not allowed: ignored
    allowed = policy(levels=(LevelPolicy(timeout_s=0.01, allow_timeout_override=True),))
    assert allowed.timeout_for(1, 500) == pytest.approx(0.0005)
    assert allowed.timeout_for(1, 50_000) == 0.01  # cannot extend the default
    unbounded = policy(levels=(LevelPolicy(allow_timeout_override=True),))
    assert unbounded.timeout_for(1, 50_000) == pytest.approx(0.05)
    assert unbounded.timeout_for(1, None) == 0.0


# -- PendingQueue ----------------------------------------------------------------------------


def test_queue_full_is_per_level() -> None:
    q: PendingQueue[str] = PendingQueue(policy(levels=(LevelPolicy(max_queue_size=2), LevelPolicy())))
    assert q.push("a", 1, 0.0)
    assert q.push("b", 1, 0.0)
    assert not q.push("c", 1, 0.0)
    assert q.push("d", 2, 0.0)
    assert q.counts == [2, 1]
    assert len(q) == 3


def test_take_is_fifo_within_a_level_and_by_level() -> None:
    q: PendingQueue[str] = PendingQueue(policy(levels=(LevelPolicy(), LevelPolicy())))
    for i, item in enumerate(["low1", "high1", "low2", "high2"]):
        q.push(item, 2 if item.startswith("low") else 1, float(i))
    assert q.oldest_enqueue() == 0.0
    assert q.take((2, 1)) == ["high1", "high2", "low1"]
    assert q.counts == [0, 1]
    assert q.oldest_enqueue() == 2.0
    assert q.take_all() == ["low2"]
    assert q.oldest_enqueue() is None


def test_reject_timeout_removes_exactly_the_expired_requests() -> None:
    q: PendingQueue[str] = PendingQueue(policy(levels=(LevelPolicy(timeout_s=1.0),)))
    q.push("a", 1, 0.0, 1.0)
    q.push("b", 1, 0.5, 1.0)
    q.push("c", 1, 0.6, 0.2)  # a shorter own timeout: expires first
    assert q.next_deadline() == pytest.approx(0.8)
    assert q.expire(0.79) == []
    assert q.expire(0.8) == ["c"]
    assert q.expire(1.0) == ["a"]
    assert q.counts == [1]
    assert q.oldest_enqueue() == 0.5
    assert q.take_all() == ["b"]
    assert q.expire(99.0) == []


def test_delay_timeout_moves_the_request_behind_its_level_but_keeps_it() -> None:
    q: PendingQueue[str] = PendingQueue(
        policy(levels=(LevelPolicy(timeout_s=1.0, delay_on_timeout=True), LevelPolicy()))
    )
    q.push("old", 1, 0.0, 1.0)
    q.push("low", 2, 0.1)
    q.push("new", 1, 0.5, 1.0)
    assert q.expire(1.2) == []  # DELAY never rejects
    assert q.delayed == 1
    assert q.counts == [2, 1]
    # "old" timed out: it now goes after "new" (same level) but before level 2.
    assert q.take((2, 1)) == ["new", "old", "low"]
    q.push("again", 1, 2.0, 1.0)
    assert q.expire(3.0) == []
    assert q.expire(100.0) == []  # a delayed request never times out again
    assert q.delayed == 2
    assert q.take_all() == ["again"]


def test_taken_requests_do_not_time_out_later() -> None:
    q: PendingQueue[str] = PendingQueue(policy(levels=(LevelPolicy(timeout_s=1.0),)))
    q.push("a", 1, 0.0, 1.0)
    assert q.take((1,)) == ["a"]
    assert q.expire(5.0) == []
    assert q.next_deadline() is None


def test_the_deadline_heap_stays_small_under_steady_traffic() -> None:
    q: PendingQueue[int] = PendingQueue(policy(levels=(LevelPolicy(timeout_s=60.0),)))
    for i in range(10_000):
        q.push(i, 1, float(i), 60.0)
        assert q.take((1,)) == [i]
    assert len(q._deadlines) <= 65


def test_without_delay_the_waiting_requests_are_shared_with_idle_instances() -> None:
    p = policy(max_batch_size=4, preferred=(4,))
    # Four waiting, this instance and three idle ones: one each, all run at once. Triton would
    # send the filled preferred batch of four to this instance; the split is deliberate.
    assert next_batch(p, [4], 10.0, 10.0, idle_instances=3) == Send(1, (1,))
    # Seven waiting, one other idle instance: this one takes its share, rounded up.
    assert next_batch(p, [7], 10.0, 10.0, idle_instances=1) == Send(4, (4,))
    assert next_batch(p, [5], 10.0, 10.0, idle_instances=1) == Send(3, (3,))
    # No idle instance (under load): the whole batch, as before.
    assert next_batch(p, [9], 10.0, 10.0, idle_instances=0) == Send(4, (4,))


def test_with_a_delay_a_filled_preferred_batch_is_not_split() -> None:
    p = policy(max_batch_size=4, preferred=(4,), delay_s=0.002)
    assert next_batch(p, [4], 10.0, 10.0, idle_instances=3) == Send(4, (4,))


def test_once_the_delay_runs_out_the_waiting_requests_are_shared_with_idle_instances() -> None:
    p = policy(max_batch_size=8, delay_s=0.002)
    # Within the delay: wait for more, idle instances or not.
    assert next_batch(p, [4], 10.0, 10.001, idle_instances=1) == Wait(pytest.approx(0.001))
    # Delay over, one other instance idle: this one takes half; the other takes the rest.
    assert next_batch(p, [4], 10.0, 10.002, idle_instances=1) == Send(2, (2,))
    assert next_batch(p, [2], 10.0, 10.002, idle_instances=0) == Send(2, (2,))
    # Delay over and no instance idle: everything pending, as in Triton.
    assert next_batch(p, [4], 10.0, 10.002, idle_instances=0) == Send(4, (4,))
    # A full batch goes at once and whole, before the delay.
    assert next_batch(p, [8], 10.0, 10.0, idle_instances=1) == Send(8, (8,))
