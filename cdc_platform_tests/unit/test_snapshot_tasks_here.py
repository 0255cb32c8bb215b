"""The in-process runner of a job's range tasks (``snapshot/tasks.py`` ``_run_here``, threads
for a small table): cancelled, or with a task that raised, it stops the other tasks through
``RANGE_STOP`` and ends only once they did. Fake range bodies stand in for the real ones,
which need the servers (``integration/test_snapshot.py`` cancels a real one)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from cdc_platform.errors import PublishError
from cdc_platform.snapshot.plan import BlockRange
from cdc_platform.snapshot.reader import (
    RANGE_STOP,
    STOP_CHECK_SECONDS,
    RangeStopped,
    _stalled_after,
    raise_if_stopped,
)
from cdc_platform.snapshot.tasks import _run_here

RANGES = [BlockRange(index, 10 * index, 10 * index + 10) for index in range(6)]


class Bodies:
    """Range bodies as the runner calls them: range ``failing`` raises at once; the others run
    until they see the runner's stop, looking every ``check_seconds`` inside an
    ``asyncio.run`` of their own, as the real tasks do (at most 10 s)."""

    def __init__(self, failing: int | None = None, check_seconds: float = 0.01) -> None:
        self.failing = failing
        self.check_seconds = check_seconds
        self.lock = threading.Lock()
        self.running = 0
        self.started: list[int] = []
        self.stopped: list[int] = []

    def __call__(self, spec, ranges):
        for block_range in ranges:
            with self.lock:
                self.running += 1
                self.started.append(block_range.index)
            try:
                if block_range.index == self.failing:
                    raise ValueError(f"range {block_range.index} failed")
                yield asyncio.run(self._until_stopped(block_range))
            finally:
                with self.lock:
                    self.running -= 1

    async def _until_stopped(self, block_range: BlockRange) -> dict:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                raise_if_stopped(f"range {block_range.index}")
            except RangeStopped:
                self.stopped.append(block_range.index)
                raise
            await asyncio.sleep(self.check_seconds)
        return {"partition": block_range.index}


async def _until_running(bodies: Bodies, count: int) -> None:
    for _ in range(500):
        if bodies.running == count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{bodies.running} bodies running, not {count}")


async def test_a_task_that_raised_stops_the_others_and_is_raised():
    bodies = Bodies(failing=0)
    started = time.monotonic()
    with pytest.raises(ValueError, match="range 0 failed"):
        await _run_here(bodies, None, RANGES, parallelism=2)
    assert bodies.running == 0  # every task ended before the runner did
    assert 1 in bodies.stopped  # (it saw the stop in its own asyncio.run)
    assert len(bodies.started) <= 3 and time.monotonic() - started < 5


async def test_a_cancelled_run_ends_once_its_tasks_stopped():
    bodies = Bodies()
    running = asyncio.create_task(_run_here(bodies, None, RANGES, parallelism=2))
    await _until_running(bodies, 2)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert bodies.running == 0
    assert sorted(bodies.stopped) == [0, 1] and bodies.started == [0, 1]


async def test_a_second_cancellation_does_not_cut_the_wait_short():
    """Tasks that take a while to see the stop (a block being converted, a publish): a second
    cancellation meanwhile is raised only once they ended."""
    bodies = Bodies(check_seconds=0.5)
    running = asyncio.create_task(_run_here(bodies, None, RANGES, parallelism=2))
    await _until_running(bodies, 2)
    await asyncio.sleep(0.1)  # (both in their half-second sleep)
    running.cancel()
    await asyncio.sleep(0.05)
    assert bodies.running == 2
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert bodies.running == 0


async def test_a_wait_for_acknowledgements_sees_the_stop():
    """A task whose publish waits (NATS stalled) stops within STOP_CHECK_SECONDS of the
    runner's stop, not after its stall timeout (6 publish timeouts: 180 s by default)."""
    stop = threading.Event()
    never_acknowledged = asyncio.get_running_loop().create_future()
    token = RANGE_STOP.set(stop)
    try:
        asyncio.get_running_loop().call_later(0.2, stop.set)
        started = time.monotonic()
        with pytest.raises(RangeStopped):
            await _stalled_after(60, never_acknowledged)
        assert time.monotonic() - started < 0.2 + 5 * STOP_CHECK_SECONDS
        assert never_acknowledged.cancelled()
        with pytest.raises(PublishError):  # (the stall timeout still holds)
            stop.clear()
            await _stalled_after(0.1, asyncio.get_running_loop().create_future())
    finally:
        RANGE_STOP.reset(token)
