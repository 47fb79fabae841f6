"""The dynamic batcher, driven through a real Model with a fake backend and task.

The fakes sit at the backend seam only: the task writes each image's first byte
(its request id) into the pooled batch tensor, the backend records which ids
each batch held and echoes them back. Timing rules run on a fake clock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inference.backends.base import Backend, TensorSpec
from inference.batch_policy import BatchPolicy
from inference.batcher import (
    COMPUTE_WEIGHT,
    BatcherStats,
    DynamicBatcher,
    InferenceFailed,
    InferenceRejected,
    InferenceTimeout,
)
from inference.config import (
    DynamicBatching,
    InputConfig,
    InstanceGroup,
    ModelConfig,
    ModelFile,
    QueuePolicy,
    TaskConfig,
)
from inference.errors import WholeBatchFailure
from inference.model import Model, ModelState, ModelUnavailable
from inference.processing.base import Task
from inference.results import Classification, Result

# What the fake backends are given as a model file: they read none of it, and the loader
# refuses an empty one (a copy cut short).
FAKE_MODEL_FILE = b"not read: the backend is a fake"

WAIT = 5.0  # seconds; only ever reached when something is broken


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    """An InferenceObserver that keeps each model's counters and every state change."""

    def __init__(self) -> None:
        self.models: dict[str, BatcherStats] = {}
        self.states: list[tuple[str, str]] = []

    def counters(self, model: str) -> BatcherStats:
        return self.models.setdefault(model, BatcherStats())

    def on_state(self, model: str, state: str, reason: str) -> None:
        self.states.append((state, reason))


class FakeBackend(Backend):
    """Echoes request ids; a batch holding a ``hold`` id blocks until ``gate`` opens, one
    holding a ``fail`` id raises."""

    def __init__(
        self,
        instance: int,
        log: list[tuple[int, list[int]]],
        gate: threading.Event,
        hold: set[int],
        fail: set[int],
        batched: bool,
    ) -> None:
        shape: tuple[int | None, ...] = (None, 3, 1, 1) if batched else (3, 1, 1)
        self.input = TensorSpec("x", shape, "float32")
        self.inputs = [self.input]
        self.outputs = [TensorSpec("y", shape[:1], "float32")]
        self.metadata = {"kind": "fake"}
        self.instance = instance
        self.log = log
        self.gate = gate
        self.hold = hold
        self.fail = fail
        self.started: queue.Queue[list[int]] = queue.Queue()
        self.pointers: set[int] = set()
        self.ranks: set[int] = set()
        self.closed = False

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = inputs["x"]
        self.ranks.add(x.ndim)
        self.pointers.add(x.__array_interface__["data"][0])
        first = x[:, 0, 0, 0] if x.ndim == 4 else x[0, 0]  # each item's id (the task's first byte)
        ids = [int(v) for v in first.reshape(-1)]
        self.log.append((self.instance, ids))
        self.started.put(ids)
        if self.hold.intersection(ids):
            assert self.gate.wait(WAIT)
        if self.fail.intersection(ids):
            raise ValueError("bad input 13")
        # One value per item; an unbatched model's output has no batch axis either.
        return {"y": first.copy() if x.ndim == 4 else first.reshape(()).copy()}

    def close(self) -> None:
        self.closed = True


class IdTask(Task):
    """Writes each image's first byte into the batch tensor; returns it as the class id."""

    def preprocess(self, images: Sequence[np.ndarray], out: np.ndarray) -> list[Any]:
        for i, img in enumerate(images):
            out[i, 0, 0, 0] = img[0, 0, 0]
        return [None] * len(images)

    def postprocess(self, outputs: Mapping[str, np.ndarray], metas: Sequence[Any]) -> list[Result]:
        y = outputs["y"]
        assert y.shape[0] == len(metas)
        return [Classification(int(v), str(int(v)), 1.0) for v in y]


def image(i: int) -> np.ndarray:
    return np.full((2, 2, 3), i, np.uint8)


class Harness:
    def __init__(
        self,
        tmp_path: Path,
        *,
        max_batch_size: int = 8,
        instances: int = 1,
        clock: Callable[[], float] | None = None,
        observer: Recorder | None = None,
        **batching: Any,
    ) -> None:
        (tmp_path / "m.onnx").write_bytes(FAKE_MODEL_FILE)
        self.config = ModelConfig(
            name="m",
            model_file=ModelFile(path="m.onnx"),
            input=InputConfig(shape=[3, 1, 1]),
            task=TaskConfig(kind="classify"),
            max_batch_size=max_batch_size,
            dynamic_batching=DynamicBatching(**batching),
            instance_group=[InstanceGroup(count=instances)],
        )
        self.log: list[tuple[int, list[int]]] = []
        self.gate = threading.Event()
        self.hold: set[int] = set()
        self.fail: set[int] = {13}
        self.backends: list[FakeBackend] = []
        self.observer = observer or Recorder()
        self.clock = clock or FakeClock()

        def make_backend(config: ModelConfig, path: Path, index: int) -> FakeBackend:
            b = FakeBackend(index, self.log, self.gate, self.hold, self.fail, max_batch_size > 0)
            self.backends.append(b)
            return b

        self.model = Model(
            self.config,
            tmp_path,
            backend_factory=make_backend,
            task_factory=IdTask,
            observer=self.observer,
            clock=self.clock,
        )
        assert self.model.load() is ModelState.READY, self.model.reason

    def submit(self, *ids: int, priority: int | None = None, timeout_us: int | None = None) -> list[Any]:
        return [self.model.submit(image(i), priority=priority, timeout_us=timeout_us) for i in ids]

    def block_on(self, first: int) -> concurrent.futures.Future[Any]:
        """Occupy the (single) instance with request ``first`` until ``gate`` opens."""
        self.hold.add(first)
        (fut,) = self.submit(first)
        assert self.backends[0].started.get(timeout=WAIT) == [first]
        return fut

    def advance(self, seconds: float) -> None:
        assert isinstance(self.clock, FakeClock)
        self.clock.now += seconds
        self.model.batcher.wakeup()

    def batches(self) -> list[list[int]]:
        return [ids for _, ids in self.log]

    def stats(self) -> BatcherStats:
        return self.model.stats

    def stop(self) -> None:
        self.gate.set()
        self.model.stop(drain=False, timeout=WAIT)


def ids(futures: list[Any]) -> list[int]:
    return [f.result(timeout=WAIT).class_id for f in futures]


def wait_until(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


@pytest.fixture
def harnesses() -> Any:
    made: list[Harness] = []
    yield made
    for h in made:
        h.stop()


@pytest.fixture
def make(tmp_path: Path, harnesses: list[Harness]) -> Callable[..., Harness]:
    def factory(**kw: Any) -> Harness:
        h = Harness(tmp_path, **kw)
        harnesses.append(h)
        return h

    return factory


# -- batch formation -----------------------------------------------------------------------


def test_preferred_size_goes_at_once_and_the_rest_waits_for_the_delay(make: Callable[..., Harness]) -> None:
    h = make(max_batch_size=8, preferred_batch_size=[4], max_queue_delay_microseconds=1_000_000)
    first = h.submit(0, 1, 2, 3)
    assert ids(first) == [0, 1, 2, 3]
    rest = h.submit(4, 5)
    h.advance(0.5)  # half the delay: nothing may leave yet
    rest += h.submit(6)
    h.advance(0.5)  # the oldest (4) has now waited the full delay
    assert ids(rest) == [4, 5, 6]
    assert h.batches() == [[0, 1, 2, 3], [4, 5, 6]]
    assert h.stats().batch_sizes == {4: 1, 3: 1}


def test_without_preferred_sizes_full_batches_go_at_once(make: Callable[..., Harness]) -> None:
    h = make(max_batch_size=4, max_queue_delay_microseconds=1_000_000)
    futs = h.submit(*range(10))
    assert ids(futs[:8]) == list(range(8))
    h.advance(1.0)
    assert ids(futs[8:]) == [8, 9]
    assert h.batches() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_zero_delay_sends_what_accumulated_while_the_instance_was_busy(make: Callable[..., Harness]) -> None:
    h = make(max_batch_size=8)
    first = h.block_on(0)
    futs = h.submit(*range(1, 11))
    h.gate.set()
    assert ids([first, *futs]) == list(range(11))
    assert h.batches() == [[0], [1, 2, 3, 4, 5, 6, 7, 8], [9, 10]]
    st = h.stats()
    assert (st.received, st.succeeded, st.batches, st.batched_requests) == (11, 11, 3, 11)
    assert st.batch_sizes == {1: 1, 8: 1, 2: 1}
    # One queue time per request, one compute time per batch, each in a bucket and the recent window.
    assert (sum(st.queue_buckets), len(st.queue_recent)) == (11, 11)
    assert (sum(st.compute_buckets), len(st.compute_recent)) == (3, 3)
    # The batcher counts into the object its observer handed out, nowhere else.
    assert h.observer.models["m"].snapshot().succeeded == 11


def test_a_new_copy_of_a_model_counts_on_where_the_old_one_left(make: Callable[..., Harness]) -> None:
    # A reload builds a new copy (and batcher) of the model; its counts must not start again.
    old = make(max_batch_size=4)
    assert ids(old.submit(1, 2)) == [1, 2]
    new = make(max_batch_size=4, observer=old.observer)
    assert ids(new.submit(3)) == [3]
    assert list(old.observer.models) == ["m"]
    st = new.stats()
    assert (st.received, st.succeeded, st.batched_requests) == (3, 3, 3)
    assert old.stats().succeeded == 3


def test_higher_priority_drains_first(make: Callable[..., Harness]) -> None:
    h = make(max_batch_size=2, priority_levels=2, default_priority_level=2)
    first = h.block_on(0)
    low = h.submit(1, 2, 3)
    high = h.submit(4, 5, priority=1)
    h.gate.set()
    assert ids([first, *low, *high]) == [0, 1, 2, 3, 4, 5]
    assert h.batches() == [[0], [4, 5], [1, 2], [3]]


def test_max_batch_size_zero_runs_one_request_without_a_batch_axis(make: Callable[..., Harness]) -> None:
    h = make(max_batch_size=0)
    first = h.block_on(0)
    futs = h.submit(1, 2, 3)
    h.gate.set()
    assert ids([first, *futs]) == [0, 1, 2, 3]
    assert h.batches() == [[0], [1], [2], [3]]
    assert h.backends[0].ranks == {3}  # (C, H, W): the pooled tensor's first slot


# -- refusals ------------------------------------------------------------------------------


def test_queue_full_is_rejected_at_once_and_counted(make: Callable[..., Harness]) -> None:
    h = make(max_batch_size=4, default_queue_policy=QueuePolicy(max_queue_size=2))
    first = h.block_on(0)
    queued = h.submit(1, 2)
    with pytest.raises(InferenceRejected) as err:
        h.submit(3)
    assert err.value.reason == "queue_full"
    assert err.value.model == "m"
    assert "max_queue_size=2" in str(err.value)
    h.gate.set()
    assert ids([first, *queued]) == [0, 1, 2]
    st = h.stats()
    assert (st.received, st.rejected, st.succeeded) == (3, 1, 3)
    assert (st.unavailable, st.shutdown) == (0, 0)  # a full queue is counted as that alone


def test_timeout_reject_fails_the_request_while_the_instance_is_busy(make: Callable[..., Harness]) -> None:
    h = make(max_batch_size=4, default_queue_policy=QueuePolicy(default_timeout_microseconds=1000))
    first = h.block_on(0)
    (late,) = h.submit(1)
    h.advance(0.0009)
    (fresh,) = h.submit(2)
    h.advance(0.0002)  # 1 has waited 1.1 ms, 2 only 0.2 ms
    with pytest.raises(InferenceTimeout) as err:
        late.result(timeout=WAIT)
    assert err.value.reason == "timeout"
    assert not fresh.done()
    h.gate.set()
    assert ids([first, fresh]) == [0, 2]
    assert h.batches() == [[0], [2]]  # the timed-out request never reached the backend
    st = h.stats()
    assert (st.timed_out, st.succeeded, st.rejected) == (1, 2, 0)


def test_request_timeout_override(make: Callable[..., Harness]) -> None:
    h = make(max_batch_size=4, default_queue_policy=QueuePolicy(allow_timeout_override=True))
    first = h.block_on(0)
    (short,) = h.submit(1, timeout_us=100)
    (forever,) = h.submit(2)
    h.advance(1.0)
    with pytest.raises(InferenceTimeout):
        short.result(timeout=WAIT)
    h.gate.set()
    assert ids([first, forever]) == [0, 2]


def test_timeout_delay_moves_requests_behind_instead_of_rejecting(make: Callable[..., Harness]) -> None:
    h = make(
        max_batch_size=1,
        default_queue_policy=QueuePolicy(default_timeout_microseconds=1000, timeout_action="DELAY"),
    )
    first = h.block_on(0)
    late = h.submit(1, 2)
    h.advance(0.002)
    wait_until(lambda: h.stats().delayed == 2)
    (fresh,) = h.submit(3)
    h.gate.set()
    assert ids([first, *late, fresh]) == [0, 1, 2, 3]
    assert h.batches() == [[0], [3], [1], [2]]
    st = h.stats()
    assert (st.timed_out, st.delayed, st.succeeded) == (0, 2, 4)


# -- ordering, failures, shutdown ----------------------------------------------------------


def test_preserve_ordering_holds_fast_answers_behind_slow_ones(make: Callable[..., Harness]) -> None:
    h = make(max_batch_size=1, instances=2, preserve_ordering=True)
    h.hold.add(0)
    done_order: list[int] = []
    (slow,) = h.submit(0)
    wait_until(lambda: any(b.started.qsize() for b in h.backends))
    (fast,) = h.submit(1)
    # The other instance ran request 1 and would have answered it already...
    wait_until(lambda: h.stats().succeeded == 1)
    assert sorted(len(ids_) for _, ids_ in h.log) == [1, 1]
    assert {inst for inst, _ in h.log} == {0, 1}
    # ...but with preserve_ordering the answer waits for request 0.
    assert not fast.done()
    for fut, i in ((slow, 0), (fast, 1)):
        fut.add_done_callback(lambda _f, i=i: done_order.append(i))
    h.gate.set()
    assert ids([slow, fast]) == [0, 1]
    assert done_order == [0, 1]


def test_without_preserve_ordering_fast_answers_do_not_wait(make: Callable[..., Harness]) -> None:
    h = make(max_batch_size=1, instances=2)
    h.hold.add(0)
    (slow,) = h.submit(0)
    wait_until(lambda: any(b.started.qsize() for b in h.backends))
    (fast,) = h.submit(1)
    assert fast.result(timeout=WAIT).class_id == 1
    assert not slow.done()
    h.gate.set()
    assert slow.result(timeout=WAIT).class_id == 0


def test_an_exception_fails_only_the_request_whose_input_raises(
    make: Callable[..., Harness], caplog: pytest.LogCaptureFixture
) -> None:
    # A batch mixes cameras: the batch that raised runs again request by request, so only
    # the input the model raises on fails; its batch mate and the next batch get results.
    h = make(max_batch_size=2)
    first = h.block_on(0)
    one, bad = h.submit(1, 13)
    good = h.submit(2, 3)
    with caplog.at_level(logging.WARNING, logger="vidpipe.inference.batcher"):
        h.gate.set()
        assert ids([first, one, *good]) == [0, 1, 2, 3]
        with pytest.raises(InferenceFailed) as err:
            bad.result(timeout=WAIT)
    assert str(err.value) == (
        "m: failed when run alone, after its batch of 2 failed: ValueError: bad input 13"
    )
    assert isinstance(err.value.__cause__, ValueError)
    assert h.batches() == [[0], [1, 13], [1], [13], [2, 3]]  # a batch of 2 cost 2 more runs
    st = h.stats()
    # Each request counted once by its outcome; the retried batch counts once, at the size
    # it was formed (what vidpipe_inference_batch_size shows).
    assert (st.failed, st.succeeded) == (1, 4)
    assert (st.batches, st.batched_requests, st.batch_sizes) == (3, 5, {1: 1, 2: 2})
    (line,) = [r.getMessage() for r in caplog.records if "failed on instance" in r.getMessage()]
    assert line == "m: batch of 2 failed on instance 0: bad input 13; retried item by item: 1 of 2 failed"
    # The instance keeps serving after a failed batch.
    assert ids(h.submit(4)) == [4]


def test_a_failed_batch_costs_at_most_one_run_per_request_more_and_only_on_failure() -> None:
    runs: list[list[int]] = []

    def runner(items: list[Any]) -> list[Any]:
        runs.append(list(items))
        if 13 in items:
            raise ValueError("bad input 13")
        return [i * 10 for i in items]

    policy = BatchPolicy(max_batch_size=4, preferred_batch_sizes=(4,), max_queue_delay_s=WAIT)
    b = DynamicBatcher("m", policy, [runner])
    b.start()
    try:
        futures = [b.submit(i) for i in (13, 1, 13, 2)]
        outcomes = [f.exception(timeout=WAIT) or f.result() for f in futures]
        assert [type(o).__name__ if isinstance(o, Exception) else o for o in outcomes] == [
            "InferenceFailed",
            10,
            "InferenceFailed",
            20,
        ]
        assert runs == [[13, 1, 13, 2], [13], [1], [13], [2]]
        runs.clear()
        assert [f.result(timeout=WAIT) for f in [b.submit(i) for i in (1, 2, 3, 4)]] == [10, 20, 30, 40]
        assert runs == [[1, 2, 3, 4]]  # a batch that runs is never run again
    finally:
        b.stop()
    st = b.stats
    assert (st.succeeded, st.failed, st.batches, st.batch_sizes) == (6, 2, 2, {4: 2})


class ServerDown(WholeBatchFailure):
    """What a remote backend raises when its server cannot be reached."""


def test_an_error_no_input_caused_fails_the_batch_without_retries(caplog: pytest.LogCaptureFixture) -> None:
    # A dead server would fail each request alone too, each after as long: no retries.
    runs: list[list[int]] = []

    def runner(items: list[Any]) -> list[Any]:
        runs.append(list(items))
        raise ServerDown("grpc://triton:8001 cannot be reached")

    policy = BatchPolicy(max_batch_size=3, preferred_batch_sizes=(3,), max_queue_delay_s=WAIT)
    b = DynamicBatcher("m", policy, [runner])
    b.start()
    try:
        with caplog.at_level(logging.WARNING, logger="vidpipe.inference.batcher"):
            futures = [b.submit(i) for i in (1, 2, 3)]
            for f in futures:
                with pytest.raises(InferenceFailed, match="batch of 3 failed: ServerDown: grpc://"):
                    f.result(timeout=WAIT)
    finally:
        b.stop()
    assert runs == [[1, 2, 3]]
    (line,) = [r.getMessage() for r in caplog.records if "failed on instance" in r.getMessage()]
    assert line == (
        "m: batch of 3 failed on instance 0: grpc://triton:8001 cannot be reached; "
        "not retried item by item: no input caused it"
    )
    assert (b.stats.failed, b.stats.succeeded, b.stats.batch_sizes) == (3, 0, {3: 1})


def test_an_exception_in_place_of_one_result_fails_that_request_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A task that can make no result of one item (a NaN row) puts an exception in its place.
    def runner(items: list[Any]) -> list[Any]:
        return [ValueError(f"no result for {i}") if i == 13 else i * 10 for i in items]

    policy = BatchPolicy(max_batch_size=2, preferred_batch_sizes=(2,), max_queue_delay_s=WAIT)
    b = DynamicBatcher("m", policy, [runner])
    b.start()
    try:
        with caplog.at_level(logging.WARNING, logger="vidpipe.inference.batcher"):
            bad, good = b.submit(13), b.submit(2)
            assert good.result(timeout=WAIT) == 20
            with pytest.raises(InferenceFailed, match=r"^m: no result for 13$") as err:
                bad.result(timeout=WAIT)
    finally:
        b.stop()
    assert isinstance(err.value.__cause__, ValueError)
    assert (b.stats.failed, b.stats.succeeded, b.stats.batch_sizes) == (1, 1, {2: 1})
    lines = [r.getMessage() for r in caplog.records if "failed on instance" in r.getMessage()]
    assert lines == ["m: 1 of 2 requests of a batch failed on instance 0: no result for 13"]


def test_stop_fails_queued_requests_at_once_and_lets_the_running_batch_finish(
    make: Callable[..., Harness],
) -> None:
    h = make(max_batch_size=2)
    running = h.block_on(0)
    queued = h.submit(1, 2, 3)
    stopper = threading.Thread(target=h.model.stop, kwargs={"drain": False, "timeout": WAIT})
    stopper.start()
    for fut in queued:  # answered while the instance is still blocked
        err = fut.exception(timeout=WAIT)
        assert isinstance(err, InferenceRejected)
        assert err.reason == "shutdown"
    assert not running.done()
    h.gate.set()
    stopper.join(WAIT)
    assert not stopper.is_alive()
    assert running.result(timeout=WAIT).class_id == 0
    assert h.model.state is ModelState.UNLOADED
    assert h.backends[0].closed
    st = h.observer.models["m"].snapshot()  # a stop is not an overload: counted apart from a full queue
    assert (st.shutdown, st.rejected, st.succeeded) == (3, 0, 1)
    with pytest.raises(ModelUnavailable) as err_info:
        h.submit(9)
    assert err_info.value.reason == "unavailable"


def test_stop_does_not_wait_forever_for_a_hung_instance(make: Callable[..., Harness]) -> None:
    h = make(max_batch_size=2)
    running = h.block_on(0)
    t0 = time.monotonic()
    h.model.stop(drain=False, timeout=0.05)
    assert time.monotonic() - t0 < 2.0
    err = running.exception(timeout=WAIT)
    assert isinstance(err, InferenceRejected)
    assert err.reason == "shutdown"


def test_drain_runs_queued_requests_without_waiting_for_the_delay(make: Callable[..., Harness]) -> None:
    h = make(max_batch_size=8, max_queue_delay_microseconds=10_000_000)
    futs = h.submit(1, 2, 3)  # would wait 10 s on the (frozen) clock
    h.model.stop(drain=True, timeout=WAIT)
    assert ids(futs) == [1, 2, 3]
    assert h.batches() == [[1, 2, 3]]


# -- steady state and the asyncio path -----------------------------------------------------


async def test_async_callers_get_their_own_results_and_no_batch_tensor_is_allocated(
    tmp_path: Path,
) -> None:
    h = Harness(tmp_path, max_batch_size=8, instances=2, clock=time.monotonic)
    h.fail.clear()
    try:
        for _ in range(20):
            got = await asyncio.gather(*(h.model.infer(image(i)) for i in range(40)))
            assert [r.class_id for r in got] == list(range(40))  # type: ignore[union-attr]
        pools = [inst.pool for inst in h.model.instances]
        assert [p.allocations for p in pools] == [1, 1]
        assert [p.in_use for p in pools] == [0, 0]
        # Every batch an instance ran was in that instance's one pooled tensor.
        for backend, pool in zip(h.backends, pools, strict=True):
            with pool.acquire() as buf:
                pooled = buf.array.__array_interface__["data"][0]
            ran = any(instance == backend.instance for instance, _ in h.log)
            assert backend.pointers == ({pooled} if ran else set())
        assert sum(len(batch) for _, batch in h.log) == 800
        assert h.model.stats.succeeded == 800
    finally:
        h.stop()


async def test_async_rejection_and_bad_images(make: Callable[..., Harness]) -> None:
    h = make(max_batch_size=2, default_queue_policy=QueuePolicy(max_queue_size=1))
    with pytest.raises(
        ValueError, match=r"image 0: expected a non-empty H×W×3 uint8 RGB array, got \(2, 2\) uint8"
    ):
        await h.model.infer(np.zeros((2, 2), np.uint8))
    first = h.block_on(0)
    task = asyncio.ensure_future(h.model.infer(image(1)))
    await asyncio.sleep(0)  # let it enqueue
    with pytest.raises(InferenceRejected, match="queue_full"):
        await h.model.infer(image(2))
    h.gate.set()
    assert (await task).class_id == 1  # type: ignore[union-attr]
    assert first.result(timeout=WAIT).class_id == 0


def test_a_model_whose_backend_fails_to_load_is_unavailable(tmp_path: Path) -> None:
    (tmp_path / "m.onnx").write_bytes(FAKE_MODEL_FILE)
    rec = Recorder()
    cfg = ModelConfig(
        name="m",
        model_file=ModelFile(path="m.onnx"),
        input=InputConfig(shape=[3, 1, 1]),
        task=TaskConfig(kind="classify"),
    )

    def broken(config: ModelConfig, path: Path, index: int) -> Backend:
        raise RuntimeError("no such device")

    model = Model(cfg, tmp_path, backend_factory=broken, task_factory=IdTask, observer=rec)
    assert model.load() is ModelState.UNAVAILABLE
    assert model.reason == "no such device"
    assert rec.states == [("loading", ""), ("unavailable", "no such device")]
    with pytest.raises(
        ModelUnavailable, match=r"m: request rejected \(unavailable\): the model is unavailable"
    ):
        model.submit(image(1))


def test_batcher_directly_with_plain_runners() -> None:
    seen: list[list[int]] = []

    def runner(items: list[Any]) -> list[Any]:
        seen.append(list(items))
        return [i * 10 for i in items]

    b = DynamicBatcher("plain", BatchPolicy(max_batch_size=4), [runner])
    with pytest.raises(InferenceRejected, match="unavailable"):
        b.submit(1)
    b.start()
    assert b.submit(7).result(timeout=WAIT) == 70
    b.stop()
    with pytest.raises(InferenceRejected, match="shutdown"):
        b.submit(1)
    assert seen == [[7]]
    st = b.stats
    assert (st.unavailable, st.shutdown, st.rejected, st.succeeded) == (1, 1, 0, 1)


def test_a_runner_returning_the_wrong_count_fails_the_batch() -> None:
    b = DynamicBatcher("short", BatchPolicy(max_batch_size=4), [lambda items: []])
    b.start()
    try:
        with pytest.raises(InferenceFailed, match="instance returned 0 results for 1 requests"):
            b.submit(1).result(timeout=WAIT)
    finally:
        b.stop()


def test_without_delay_requests_spread_over_idle_instances_and_run_at_once() -> None:
    together = threading.Barrier(4, timeout=WAIT)
    seen: list[list[int]] = []

    def runner(items: list[Any]) -> list[Any]:
        seen.append(list(items))
        together.wait()  # only passes once four batches run at the same time
        return [i * 10 for i in items]

    policy = BatchPolicy(max_batch_size=4, preferred_batch_sizes=(4,))
    b = DynamicBatcher("spread", policy, [runner] * 4)
    b.start()
    try:
        futures = [b.submit(i) for i in range(4)]
        assert [f.result(timeout=WAIT) for f in futures] == [0, 10, 20, 30]
    finally:
        b.stop()
    assert sorted(seen) == [[0], [1], [2], [3]]
    assert b.stats.batch_sizes == {1: 4}


def test_failing_batches_are_all_counted_and_logged_once_per_interval(
    make: Callable[..., Harness], caplog: pytest.LogCaptureFixture
) -> None:
    # A dead remote server fails every batch: each request fails and is counted, the log
    # says so once (with the model named as a field), not once per batch.
    h = make(max_batch_size=1)
    with caplog.at_level(logging.WARNING, logger="vidpipe.inference.batcher"):
        for _ in range(5):
            (fut,) = h.submit(13)
            with pytest.raises(InferenceFailed, match="bad input 13"):
                fut.result(timeout=WAIT)
    lines = [r for r in caplog.records if "failed on instance" in r.getMessage()]
    name = h.model.name
    assert [r.getMessage() for r in lines] == [f"{name}: batch of 1 failed on instance 0: bad input 13"]
    assert getattr(lines[0], "model", None) == name
    assert h.stats().failed == 5


# -- when an instance comes free (what paced admission waits on) ----------------------------


def test_free_in_counts_the_running_batch_the_queue_and_requests_on_their_way() -> None:
    clock = FakeClock()
    gate = threading.Event()
    started: queue.Queue[list[int]] = queue.Queue()
    idle: list[int] = []

    def runner(items: list[Any]) -> list[Any]:
        # A batch of n costs n × 100 ms on the clock, spent once the gate opens; the test
        # moves the clock only while a batch waits at the gate.
        started.put(list(items))
        assert gate.wait(WAIT)
        clock.now += 0.1 * len(items)
        return items

    b = DynamicBatcher("m", BatchPolicy(max_batch_size=4), [runner], clock=clock)
    b.on_idle(lambda: idle.append(b.received))
    b.start()
    try:
        assert b.free_in() is None  # no batch has run: nothing to estimate from
        wait_until(lambda: idle == [0])  # the instance waits for work, and says so
        gate.set()
        assert b.submit(1).result(timeout=WAIT) == 1
        wait_until(lambda: idle == [0, 1])  # and again once its batch was done
        assert b.compute_estimate(1) == pytest.approx(0.1)
        assert b.compute_estimate(2) == pytest.approx(0.2)  # scaled from the size seen
        assert b.free_in() == 0.0  # idle
        assert b.free_in(ahead=1) == pytest.approx(0.1)  # one on its way takes the instance first

        gate.clear()
        running = b.submit(2)
        assert started.get(timeout=WAIT) == [1] and started.get(timeout=WAIT) == [2]
        clock.now += 0.03
        assert b.free_in() == pytest.approx(0.07)
        assert b.free_in(ahead=1) == pytest.approx(0.17)
        assert b.free_in(ahead=1, batch=2) == pytest.approx(0.07)  # joins the one on its way
        assert b.free_in(ahead=2, batch=2) == pytest.approx(0.27)  # after a batch of two
        queued = b.submit(3)
        assert b.received == 3
        assert b.free_in() == pytest.approx(0.17)  # behind the queued request
        clock.now += 0.5
        assert b.free_in() == pytest.approx(0.1)  # a batch past its estimate counts as ending now

        gate.set()
        assert running.result(timeout=WAIT) == 2 and queued.result(timeout=WAIT) == 3
        # Each size's estimate follows its recent batches: 0.63 s, then 0.1 s.
        after_slow = 0.1 + COMPUTE_WEIGHT * (0.63 - 0.1)
        assert b.compute_estimate(1) == pytest.approx(after_slow + COMPUTE_WEIGHT * (0.1 - after_slow))
        wait_until(lambda: idle[-1] == 3)
    finally:
        gate.set()
        b.stop()
    assert b.free_in() is None  # stopped
