"""BufferPool: fixed allocations, ref counts, blocking acquire."""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

import numpy as np
import pytest

from inference.memory import BufferPool, PoolExhausted


def test_arrays_are_preallocated_with_shape_and_dtype() -> None:
    pool = BufferPool((4, 3, 8, 8), "float16", count=2)
    assert pool.capacity == 2
    assert pool.allocations == 2
    assert pool.in_use == 0
    with pool.acquire() as buf:
        assert buf.array.shape == (4, 3, 8, 8)
        assert buf.array.dtype == np.float16
        assert pool.in_use == 1
    assert pool.in_use == 0


def test_reuse_never_allocates() -> None:
    pool = BufferPool((2, 2), np.float32, count=2)
    seen = set()
    for _ in range(1000):
        with pool.acquire() as a, pool.acquire() as b:
            seen.add(id(a.array))
            seen.add(id(b.array))
    assert pool.allocations == 2
    assert len(seen) == 2
    assert pool.waits == 0


def test_retain_keeps_the_array_out_of_the_pool_until_the_last_release() -> None:
    pool = BufferPool((1,), np.uint8, count=1)
    buf = pool.acquire()
    buf.retain()
    assert buf.refs == 2
    buf.release()
    assert pool.in_use == 1
    with pytest.raises(PoolExhausted, match="all 1 buffers"):
        pool.acquire(timeout=0.01)
    buf.release()
    assert pool.in_use == 0
    assert buf.refs == 0


def test_over_release_and_retain_after_return_are_errors() -> None:
    pool = BufferPool((1,), np.uint8, count=1)
    buf = pool.acquire()
    buf.release()
    with pytest.raises(RuntimeError, match="released more often than acquired"):
        buf.release()
    with pytest.raises(RuntimeError, match="back in the pool"):
        buf.retain()


def test_acquire_blocks_until_a_buffer_comes_back() -> None:
    pool = BufferPool((1,), np.uint8, count=1)
    held = pool.acquire()
    got: list[int] = []
    waiting = threading.Event()

    def consumer() -> None:
        waiting.set()
        with pool.acquire(timeout=5.0) as buf:
            got.append(buf.index)

    t = threading.Thread(target=consumer)
    t.start()
    assert waiting.wait(5.0)
    # The consumer cannot finish while the only buffer is held.
    t.join(0.05)
    assert t.is_alive()
    held.release()
    t.join(5.0)
    assert got == [0]
    assert pool.waits == 1
    assert pool.allocations == 1


class CountingXp:
    """An array module that counts the arrays it creates."""

    def __init__(self) -> None:
        self.created = 0

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        self.created += 1
        return np.zeros(shape, dtype=dtype)


def test_allocations_counts_the_arrays_the_array_module_created() -> None:
    xp = CountingXp()
    pool = BufferPool((3,), np.float32, count=3, xp=xp)  # type: ignore[arg-type]
    assert pool.xp is xp
    assert (xp.created, pool.allocations) == (3, 3)
    for _ in range(100):
        with pool.acquire() as a, pool.acquire() as b:
            a.retain().release()
            assert b.array.shape == (3,)
    # Steady state: nothing was created after the pool was sized.
    assert (xp.created, pool.allocations, pool.capacity) == (3, 3, 3)


def test_count_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least one buffer"):
        BufferPool((1,), np.uint8, count=0)


def test_a_closed_pool_lets_its_arrays_go_without_the_cyclic_collector() -> None:
    # Pool and handles refer to each other: a removed camera's dropped pool waited for a
    # full garbage collection, which may not come for hours, with its frames resident.
    gc.disable()
    try:
        pool = BufferPool((64, 64, 3), np.uint8, 3, name="frames-gone")
        out = pool.acquire()
        free = [weakref.ref(h.array) for h in pool._handles if h is not out]
        pool.close()
        del pool
        assert [ref() is None for ref in free] == [True, True]
        kept = weakref.ref(out.array)
        out.release()  # a frame given up on comes back after the close: it is let go too
        del out
        assert kept() is None
    finally:
        gc.enable()


def test_a_closed_pool_hands_out_nothing() -> None:
    pool = BufferPool((4,), np.uint8, 1, name="frames-gone")
    pool.close()
    with pytest.raises(PoolExhausted, match="frames-gone: the pool is closed"):
        pool.acquire(timeout=5)
