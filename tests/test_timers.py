"""Shared timeouts behave like ``asyncio.timeout``, behind one timer per loop.

Most tests drive :class:`SharedTimeouts` with a fake loop whose clock moves only when told to
(:meth:`FakeLoop.advance`), while the blocks under test run as real tasks on the running loop and
wait on futures the test resolves. A differential test runs the same scenarios under
``asyncio.timeout_at`` and under a :class:`SharedTimeouts` of the real loop, with deadlines
already past (they fire on the next loop round, no waiting). One test waits 10 ms for real.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any, Protocol, cast

import pytest

from tidegate.clock import ManualClock
from tidegate.timers import _SLACK, SharedTimeouts, _shared, timeout_after, timeout_at

#: Yields to the event loop without any time passing (``asyncio.sleep`` is banned in this repo).
CLOCK = ManualClock()
START = 1_000.0


async def _rounds(n: int = 5) -> None:
    """Let the real loop run ``n`` rounds of callbacks."""
    for _ in range(n):
        await CLOCK.asleep(0)


# --------------------------------------------------------------------------- the fake loop


class FakeHandle:
    """What ``call_at`` returns: remembers whether it was cancelled or has run."""

    def __init__(self, seq: int, when: float, callback: Callable[..., object], args: Any) -> None:
        self.seq = seq
        self.when = when
        self.callback = callback
        self.args: tuple[Any, ...] = args
        self.cancelled = False
        self.ran = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeLoop:
    """``time()`` and ``call_at()`` on a virtual clock; nothing runs until :meth:`advance`."""

    def __init__(self, now: float = START) -> None:
        self.now = now
        self.handles: list[FakeHandle] = []
        self.most_armed = 0  # the most handles ever armed at once

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[..., object], *args: Any) -> FakeHandle:
        handle = FakeHandle(len(self.handles), when, callback, args)
        self.handles.append(handle)
        self.most_armed = max(self.most_armed, len(self.armed()))
        return handle

    def armed(self) -> list[FakeHandle]:
        """Handles armed and neither cancelled nor run yet."""
        return [h for h in self.handles if not h.cancelled and not h.ran]

    def advance(self, dt: float) -> None:
        """Move the clock by ``dt``, running every handle that falls due, in time order."""
        target = self.now + dt
        for _ in range(1_000):
            due = [h for h in self.armed() if h.when <= target]
            if not due:
                break
            handle = min(due, key=lambda h: (h.when, h.seq))
            self.now = max(self.now, handle.when)
            handle.ran = True
            handle.callback(*handle.args)
        else:
            raise AssertionError("the timer keeps firing without the clock moving")
        self.now = target


def _shared_on(fake: FakeLoop) -> SharedTimeouts:
    return SharedTimeouts(cast(asyncio.AbstractEventLoop, fake))


def _heap_len(timeouts: SharedTimeouts) -> int:
    return len(timeouts._heap)


async def _block(timeouts: SharedTimeouts, when: float | None, fut: asyncio.Future[str]) -> str:
    """One block under a timeout, waiting for ``fut``."""
    async with timeouts.at(when):
        return await fut


def _start(coro: Coroutine[Any, Any, str]) -> asyncio.Task[str]:
    return asyncio.get_running_loop().create_task(coro)


def _future() -> asyncio.Future[str]:
    return asyncio.get_running_loop().create_future()


# --------------------------------------------------------------------------- one timeout


@pytest.mark.asyncio
async def test_a_block_ending_in_time_raises_nothing_and_leaves_no_live_entry() -> None:
    fake = FakeLoop()
    timeouts = _shared_on(fake)
    fut = _future()
    task = _start(_block(timeouts, START + 5, fut))
    await _rounds()
    assert len(timeouts) == 1
    assert [h.when for h in fake.armed()] == [START + 5]
    fake.advance(4.9)
    fut.set_result("done")
    await _rounds()
    assert task.done()
    assert task.result() == "done"
    assert task.cancelling() == 0
    assert len(timeouts) == 0
    # The deadline passing later hurts nobody: the done entry is dropped.
    fake.advance(1.0)
    await _rounds()
    assert _heap_len(timeouts) == 0
    assert fake.armed() == []


@pytest.mark.asyncio
async def test_expiry_raises_timeout_error_from_the_cancellation() -> None:
    fake = FakeLoop()
    timeouts = _shared_on(fake)
    fut = _future()
    task = _start(_block(timeouts, START + 5, fut))
    await _rounds()
    fake.advance(4.999)
    await _rounds()
    assert not task.done()
    fake.advance(0.001)  # exactly at the deadline
    await _rounds()
    assert task.done()
    error = task.exception()
    assert type(error) is TimeoutError
    assert isinstance(error.__cause__, asyncio.CancelledError)
    assert fut.cancelled()
    assert task.cancelling() == 0  # the timeout's own cancellation was taken back
    assert len(timeouts) == 0


@pytest.mark.asyncio
async def test_a_deadline_already_past_expires_at_the_next_firing() -> None:
    fake = FakeLoop()
    timeouts = _shared_on(fake)
    task = _start(_block(timeouts, START - 1, _future()))
    await _rounds()
    assert [h.when for h in fake.armed()] == [START - 1]
    fake.advance(0)
    await _rounds()
    assert type(task.exception()) is TimeoutError
    assert task.cancelling() == 0


@pytest.mark.asyncio
async def test_a_block_that_swallows_the_cancellation_ends_normally_and_uncancels() -> None:
    fake = FakeLoop()
    timeouts = _shared_on(fake)
    seen: list[int] = []

    async def stubborn() -> str:
        this = asyncio.current_task()
        assert this is not None
        async with timeouts.at(START + 1):
            try:
                await _future()
            except asyncio.CancelledError:
                seen.append(this.cancelling())
        return "kept going"

    task = _start(stubborn())
    await _rounds()
    fake.advance(1)
    await _rounds()
    assert task.result() == "kept going"
    assert seen == [1]
    assert task.cancelling() == 0


@pytest.mark.asyncio
async def test_an_outer_cancellation_propagates_unchanged() -> None:
    fake = FakeLoop()
    timeouts = _shared_on(fake)
    task = _start(_block(timeouts, START + 5, _future()))
    await _rounds()
    task.cancel()
    await _rounds()
    assert task.cancelled()
    assert task.cancelling() == 1  # the canceller's to take back, not the timeout's
    assert len(timeouts) == 0
    fake.advance(10)  # the deadline passing afterwards changes nothing
    await _rounds()
    assert task.cancelling() == 1


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "cancel_first", [True, False], ids=["cancel-then-expire", "expire-then-cancel"]
)
async def test_an_outer_cancellation_wins_over_a_simultaneous_expiry(cancel_first: bool) -> None:
    """Both before the block sees either: asyncio's rule says the block is cancelled, not timed out."""
    fake = FakeLoop()
    timeouts = _shared_on(fake)
    task = _start(_block(timeouts, START + 5, _future()))
    await _rounds()
    if cancel_first:
        task.cancel()
        fake.advance(5)
    else:
        fake.advance(5)
        task.cancel()
    assert task.cancelling() == 2
    await _rounds()
    assert task.cancelled()
    assert task.cancelling() == 1
    assert len(timeouts) == 0


@pytest.mark.asyncio
async def test_no_deadline_never_times_out_and_registers_nothing() -> None:
    fake = FakeLoop()
    timeouts = _shared_on(fake)
    fut = _future()
    task = _start(_block(timeouts, None, fut))
    await _rounds()
    assert len(timeouts) == 0
    assert _heap_len(timeouts) == 0
    assert fake.handles == []
    fake.advance(1e9)
    await _rounds()
    assert not task.done()
    fut.set_result("eventually")
    await _rounds()
    assert task.result() == "eventually"
    assert fake.handles == []


# --------------------------------------------------------------------------- nested


@pytest.mark.asyncio
async def test_nested_inner_fires_first_and_the_outer_carries_on() -> None:
    fake = FakeLoop()
    timeouts = _shared_on(fake)
    after = _future()
    log: list[str] = []

    async def nested() -> str:
        this = asyncio.current_task()
        assert this is not None
        async with timeouts.at(START + 10):
            try:
                async with timeouts.at(START + 2):
                    await _future()
            except TimeoutError:
                log.append(f"inner timed out, cancelling={this.cancelling()}")
            return await after

    task = _start(nested())
    await _rounds()
    assert len(timeouts) == 2
    fake.advance(2)
    await _rounds()
    assert log == ["inner timed out, cancelling=0"]
    assert not task.done()
    assert len(timeouts) == 1
    # The timer is armed again, for the outer deadline.
    assert [h.when for h in fake.armed()] == [START + 10]
    after.set_result("outer done")
    await _rounds()
    assert task.result() == "outer done"
    assert task.cancelling() == 0
    assert len(timeouts) == 0


@pytest.mark.asyncio
async def test_nested_the_outer_still_times_out_after_the_inner_did() -> None:
    fake = FakeLoop()
    timeouts = _shared_on(fake)
    log: list[str] = []

    async def nested() -> str:
        async with timeouts.at(START + 10):
            try:
                async with timeouts.at(START + 2):
                    await _future()
            except TimeoutError:
                log.append("inner")
            return await _future()

    task = _start(nested())
    await _rounds()
    fake.advance(2)
    await _rounds()
    fake.advance(8)
    await _rounds()
    assert log == ["inner"]
    assert type(task.exception()) is TimeoutError
    assert task.cancelling() == 0
    assert len(timeouts) == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("inner_at", [START + 20, START + 5], ids=["inner-later", "same-deadline"])
async def test_nested_outer_fires_first_the_inner_sees_a_plain_cancellation(
    inner_at: float,
) -> None:
    fake = FakeLoop()
    timeouts = _shared_on(fake)
    inner_saw: list[str] = []

    async def nested() -> str:
        async with timeouts.at(START + 5):
            try:
                async with timeouts.at(inner_at):
                    await _future()
            except BaseException as error:
                inner_saw.append(type(error).__name__)
                raise
            return "unreachable"

    task = _start(nested())
    await _rounds()
    fake.advance(5)
    await _rounds()
    assert inner_saw == ["CancelledError"]
    error = task.exception()
    assert type(error) is TimeoutError
    assert isinstance(error.__cause__, asyncio.CancelledError)
    assert task.cancelling() == 0
    assert len(timeouts) == 0


# --------------------------------------------------------------------------- the one timer


@pytest.mark.asyncio
async def test_many_blocks_with_the_same_deadline_share_one_armed_timer() -> None:
    fake = FakeLoop()
    timeouts = _shared_on(fake)
    futures = [_future() for _ in range(200)]
    tasks = [_start(_block(timeouts, START + 100, f)) for f in futures]
    await _rounds()
    assert len(timeouts) == 200
    assert len(fake.handles) == 1
    assert fake.most_armed == 1
    assert [h.when for h in fake.armed()] == [START + 100]

    # An earlier deadline moves the one timer earlier: the old handle is cancelled.
    early = _future()
    early_task = _start(_block(timeouts, START + 3, early))
    await _rounds()
    assert len(fake.handles) == 2
    assert fake.handles[0].cancelled
    assert [h.when for h in fake.armed()] == [START + 3]

    # A later one leaves it be.
    late_task = _start(_block(timeouts, START + 50, _future()))
    await _rounds()
    assert [h.when for h in fake.armed()] == [START + 3]

    # It fires, and the timer is armed again for the next live deadline.
    fake.advance(3)
    await _rounds()
    assert type(early_task.exception()) is TimeoutError
    assert [h.when for h in fake.armed()] == [START + 50]
    fake.advance(47)
    await _rounds()
    assert type(late_task.exception()) is TimeoutError
    assert [h.when for h in fake.armed()] == [START + 100]
    assert all(not t.done() for t in tasks)

    for i, f in enumerate(futures[:100]):
        f.set_result(str(i))
    await _rounds()
    assert len(timeouts) == 100
    fake.advance(50)
    await _rounds()
    assert [t.result() for t in tasks[:100]] == [str(i) for i in range(100)]
    assert all(type(t.exception()) is TimeoutError for t in tasks[100:])
    assert all(t.cancelling() == 0 for t in tasks)
    assert len(timeouts) == 0
    assert _heap_len(timeouts) == 0
    assert fake.armed() == []
    assert fake.most_armed == 1


@pytest.mark.asyncio
async def test_a_firing_for_a_finished_block_skips_it_and_arms_for_the_next_live_one() -> None:
    fake = FakeLoop()
    timeouts = _shared_on(fake)
    first = _future()
    t1 = _start(_block(timeouts, START + 1, first))
    await _rounds()
    t2 = _start(_block(timeouts, START + 2, _future()))
    t3 = _start(_block(timeouts, START + 4, _future()))
    await _rounds()
    first.set_result("quick")
    await _rounds()
    assert t1.result() == "quick"
    # Leaving the block does not disarm the timer (that is the point), ...
    assert [h.when for h in fake.armed()] == [START + 1]
    fake.advance(1)
    await _rounds()
    # ... the firing drops the done entry and re-arms for the next live one.
    assert [h.when for h in fake.armed()] == [START + 2]
    assert not t2.done()
    fake.advance(1)
    await _rounds()
    assert type(t2.exception()) is TimeoutError
    assert [h.when for h in fake.armed()] == [START + 4]
    assert not t3.done()
    fake.advance(2)
    await _rounds()
    assert type(t3.exception()) is TimeoutError
    assert fake.armed() == []
    assert len(timeouts) == 0
    assert _heap_len(timeouts) == 0


@pytest.mark.asyncio
async def test_all_entries_due_at_one_firing_expire_together() -> None:
    fake = FakeLoop()
    timeouts = _shared_on(fake)
    tasks = [_start(_block(timeouts, START + 1 + i / 10, _future())) for i in range(5)]
    keeper = _start(_block(timeouts, START + 9, _future()))
    await _rounds()
    fake.advance(2)  # the firings at START + 1 ... + 1.4 expire all five, one after another
    await _rounds()
    assert all(type(t.exception()) is TimeoutError for t in tasks)
    assert not keeper.done()
    assert len(timeouts) == 1
    assert [h.when for h in fake.armed()] == [START + 9]
    assert fake.most_armed == 1
    keeper.cancel()
    await _rounds()
    assert keeper.cancelled()


# --------------------------------------------------------------------------- done entries


@pytest.mark.asyncio
async def test_done_entries_are_dropped_while_blocks_come_and_go() -> None:
    fake = FakeLoop()
    timeouts = _shared_on(fake)
    # A few long-running blocks keep some entries live the whole time.
    holders = [_future() for _ in range(3)]
    held = [_start(_block(timeouts, START + 1e6, f)) for f in holders]
    await _rounds()
    longest = 0
    for i in range(5000):
        async with timeouts.at(START + 100 + i):
            live = len(timeouts)
            assert live == 4
            assert _heap_len(timeouts) <= 2 * live + _SLACK + 1
            longest = max(longest, _heap_len(timeouts))
    assert len(timeouts) == 3
    assert _heap_len(timeouts) <= 2 * 3 + _SLACK + 1
    assert longest > _SLACK  # done entries do wait, lazily, ...
    assert longest <= 2 * 4 + _SLACK + 1  # ... but only so many
    # Still one timer, and the held blocks are still under their deadline.
    assert len(fake.armed()) == 1
    for f in holders:
        f.set_result("ok")
    await _rounds()
    assert [t.result() for t in held] == ["ok"] * 3
    assert len(timeouts) == 0


@pytest.mark.asyncio
async def test_a_crowd_of_concurrent_blocks_is_dropped_once_done() -> None:
    fake = FakeLoop()
    timeouts = _shared_on(fake)
    futures = [_future() for _ in range(3000)]
    tasks = [_start(_block(timeouts, START + 10 + i, f)) for i, f in enumerate(futures)]
    await _rounds()
    assert len(timeouts) == 3000
    assert _heap_len(timeouts) == 3000
    for f in futures:
        f.set_result("ok")
    await _rounds()
    assert all(t.result() == "ok" for t in tasks)
    assert len(timeouts) == 0
    # The next block rebuilds the heap without the done entries.
    fut = _future()
    last = _start(_block(timeouts, START + 5, fut))
    await _rounds()
    assert _heap_len(timeouts) <= 2 * len(timeouts) + _SLACK + 1
    assert _heap_len(timeouts) == 1
    fake.advance(5)
    await _rounds()
    assert type(last.exception()) is TimeoutError
    assert _heap_len(timeouts) == 0
    assert fake.armed() == []


@pytest.mark.asyncio
async def test_after_a_rebuild_a_live_entry_still_expires() -> None:
    fake = FakeLoop()
    timeouts = _shared_on(fake)
    victim = _start(_block(timeouts, START + 7, _future()))
    await _rounds()
    for _ in range(3 * _SLACK):
        async with timeouts.at(START + 1):
            pass
    assert _heap_len(timeouts) <= 2 * len(timeouts) + _SLACK + 1
    fake.advance(6.5)
    await _rounds()
    assert not victim.done()
    fake.advance(0.5)
    await _rounds()
    assert type(victim.exception()) is TimeoutError
    assert victim.cancelling() == 0
    assert len(timeouts) == 0


# --------------------------------------------------------------------------- same as asyncio


class _AsyncBlock(Protocol):
    """What ``async with`` needs: asyncio's Timeout (coroutines) and ours (ready awaitables)."""

    def __aenter__(self) -> Awaitable[object]: ...

    def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> Awaitable[bool | None]: ...


TimeoutAt = Callable[[float | None], _AsyncBlock]


async def _scenario_expiry(at: TimeoutAt, past: float) -> list[str]:
    log: list[str] = []
    try:
        async with at(past):
            await _future()
    except TimeoutError as error:
        log.append(f"TimeoutError from {type(error.__cause__).__name__}")
    return log


async def _scenario_nested_both_past(at: TimeoutAt, past: float) -> list[str]:
    log: list[str] = []
    try:
        async with at(past):
            try:
                async with at(past):
                    await _future()
            except BaseException as error:
                log.append(f"inner {type(error).__name__}")
                raise
    except TimeoutError:
        log.append("outer TimeoutError")
    return log


async def _scenario_inner_past_outer_never(at: TimeoutAt, past: float) -> list[str]:
    log: list[str] = []
    async with at(None):
        try:
            async with at(past):
                await _future()
        except TimeoutError:
            log.append("inner TimeoutError")
        log.append("outer continues")
    return log


async def _scenario_swallowed(at: TimeoutAt, past: float) -> list[str]:
    log: list[str] = []
    async with at(past):
        try:
            await _future()
        except asyncio.CancelledError:
            log.append("swallowed")
    log.append("returned")
    return log


async def _scenario_self_cancelled(at: TimeoutAt, past: float) -> list[str]:
    """The block is cancelled from elsewhere as its deadline passes: a plain cancellation."""
    this = asyncio.current_task()
    assert this is not None
    log: list[str] = []
    try:
        async with at(past):
            this.cancel()
            await _future()
    except asyncio.CancelledError:
        log.append(f"CancelledError, cancelling={this.cancelling()}")
        this.uncancel()
    return log


async def _scenario_entered_while_cancelling(at: TimeoutAt, past: float) -> list[str]:
    """A task with a cancellation it has not taken back (say, a settlement under way) can still
    time out: the count from before the block is the baseline."""
    this = asyncio.current_task()
    assert this is not None
    log: list[str] = []
    this.cancel()
    try:
        await _future()
    except asyncio.CancelledError:
        log.append(f"cancelled first, cancelling={this.cancelling()}")
    try:
        async with at(past):
            await _future()
    except TimeoutError:
        log.append(f"TimeoutError, cancelling={this.cancelling()}")
    this.uncancel()
    return log


SCENARIOS = [
    _scenario_expiry,
    _scenario_entered_while_cancelling,
    _scenario_nested_both_past,
    _scenario_inner_past_outer_never,
    _scenario_swallowed,
    _scenario_self_cancelled,
]


@pytest.mark.asyncio
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__.removeprefix("_scenario_"))
async def test_the_same_outcome_as_asyncio_timeout_at(
    scenario: Callable[[TimeoutAt, float], Awaitable[list[str]]],
) -> None:
    loop = asyncio.get_running_loop()

    async def run(at: TimeoutAt) -> tuple[list[str], int]:
        this = asyncio.current_task()
        assert this is not None
        log = await scenario(at, loop.time() - 1)
        return log, this.cancelling()

    expected = await loop.create_task(run(asyncio.timeout_at))
    shared = SharedTimeouts(loop)
    actual = await loop.create_task(run(shared.at))
    assert actual == expected
    assert expected[0]
    assert expected[1] == 0
    assert len(shared) == 0


# --------------------------------------------------------------------------- the real loop


@pytest.mark.asyncio
async def test_timeout_after_on_the_running_loop() -> None:
    loop = asyncio.get_running_loop()
    this = asyncio.current_task()
    assert this is not None
    fut = _future()
    started = loop.time()
    with pytest.raises(TimeoutError) as info:
        async with timeout_after(0.01):
            await fut
    assert loop.time() - started >= 0.009
    assert isinstance(info.value.__cause__, asyncio.CancelledError)
    assert fut.cancelled()
    assert this.cancelling() == 0
    assert len(_shared(loop)) == 0
    # The module functions share the loop's one instance.
    assert _shared(loop) is _shared(loop)
    async with timeout_at(None):
        pass
    with pytest.raises(TimeoutError):
        async with timeout_at(loop.time() - 1):
            await _future()
    assert this.cancelling() == 0
    assert len(_shared(loop)) == 0
