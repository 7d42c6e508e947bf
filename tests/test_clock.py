import asyncio
import time

import pytest

from tidegate.clock import Clock, ClockWentBackwards, ManualClock, SystemClock
from tidegate.testing import compiled


def test_manual_clock_starts_where_told_and_advances_exactly() -> None:
    """advance() moves now() by exactly the amount given and returns the new time."""
    clock = ManualClock(10.0)
    assert clock.now() == 10.0
    assert clock.advance(0.25) == 10.25
    assert clock.now() == 10.25


def test_manual_clock_refuses_to_go_backwards() -> None:
    """Neither advance() with a negative step nor set() into the past is allowed."""
    clock = ManualClock(5.0)
    with pytest.raises(ClockWentBackwards):
        clock.advance(-0.1)
    with pytest.raises(ClockWentBackwards):
        clock.set(4.9)
    assert clock.now() == 5.0


def test_manual_clock_set_jumps_forward() -> None:
    """set() jumps to an absolute instant that is not in the past."""
    clock = ManualClock()
    assert clock.set(3.5) == 3.5
    assert clock.set(3.5) == 3.5
    assert clock.now() == 3.5


def test_manual_wall_clock_moves_with_monotonic_time() -> None:
    """wall() is a fixed epoch plus elapsed virtual time."""
    clock = ManualClock(0.0, wall_start=1000.0)
    clock.advance(2.5)
    assert clock.wall() == 1002.5


def test_manual_sleeps_advance_instead_of_waiting() -> None:
    """sleep() and asleep() advance the clock; negative sleeps are no-ops."""
    clock = ManualClock()
    clock.sleep(1.5)
    clock.sleep(-3.0)
    asyncio.run(clock.asleep(0.5))
    assert clock.now() == 2.0


def test_both_clocks_satisfy_the_protocol() -> None:
    """SystemClock and ManualClock are Clocks; the system clock is monotonic."""
    system = SystemClock()
    # Structural: mypy checks these assignments; the loop checks the methods exist at run time.
    clocks: list[Clock] = [system, ManualClock()]
    for clock in clocks:
        assert callable(clock.now)
        assert callable(clock.wall)
    first = system.now()
    assert system.now() >= first
    assert system.wall() > 1_600_000_000


def test_the_system_clock_reads_the_real_time() -> None:
    """The gateway's clock: monotonic and wall time, read through the clock (in the compiled build
    through Clock's method table; as plain Python straight from the time module, no frame)."""
    clock = SystemClock()
    before, wall_before = time.monotonic(), time.time()
    now, wall = clock.now(), clock.wall()
    assert before <= now <= time.monotonic()
    assert wall_before <= wall <= time.time()
    if not compiled("tidegate.clock"):
        assert vars(SystemClock)["now"].__func__ is time.monotonic
        assert vars(SystemClock)["wall"].__func__ is time.time
