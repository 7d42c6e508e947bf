"""Leases: the wrapped stores decide and count exactly as the stores they wrap.

Every test runs a :class:`LeasedQuotas` / :class:`LeasedBuckets` and the plain memory store side
by side on one :class:`ManualClock`, and compares what each answers.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tidegate.clock import ManualClock
from tidegate.policy.budget import (
    BudgetDecision,
    BudgetOptions,
    BudgetVerdict,
    Cost,
    Quota,
    Reservation,
    Usage,
    seconds_until_midnight,
)
from tidegate.policy.ratelimit import BucketOptions, TakeResult
from tidegate.state.base import BucketStore, QuotaStore
from tidegate.state.leases import BURST_SHARE, LEASE_HOLD_S, LeasedBuckets, LeasedQuotas
from tidegate.state.memory import MemoryBucketStore, MemoryQuotaStore

SUBJECTS = ("a", "b")
Op = tuple[object, ...]


class CountingQuotas:
    """A QuotaStore proxy that counts reserves (and their amounts); with ``clock``, every call
    first yields to the loop, as a networked store would."""

    def __init__(self, inner: QuotaStore, clock: ManualClock | None = None) -> None:
        self.inner = inner
        self._clock = clock
        self.reserved: list[Cost] = []
        self.rebased: list[Cost] = []

    async def _yield(self) -> None:
        if self._clock is not None:
            await self._clock.asleep(0.0)

    async def reserve(
        self, subject: str, options: BudgetOptions, estimate: Cost
    ) -> tuple[Reservation | None, BudgetDecision]:
        await self._yield()
        self.reserved.append(estimate)
        return await self.inner.reserve(subject, options, estimate)

    async def settle(self, reservation: Reservation, actual: Cost) -> bool:
        await self._yield()
        return await self.inner.settle(reservation, actual)

    async def refund(self, reservation: Reservation) -> bool:
        await self._yield()
        return await self.inner.refund(reservation)

    async def rebase(
        self, reservation: Reservation, actual: Cost, keep: Cost
    ) -> Reservation | None:
        await self._yield()
        self.rebased.append(keep)
        return await self.inner.rebase(reservation, actual, keep)

    async def usage(self, subject: str) -> Usage:
        return await self.inner.usage(subject)


class CountingBuckets:
    """A BucketStore proxy that counts takes (and tokens given back) and keeps the last result
    the store gave."""

    def __init__(self, inner: BucketStore) -> None:
        self.inner = inner
        self.takes = 0
        self.given: list[float] = []
        self.last: TakeResult | None = None

    async def take(self, key: str, options: BucketOptions, n: float = 1.0) -> TakeResult:
        self.takes += 1
        self.last = await self.inner.take(key, options, n)
        return self.last

    async def give_back(self, key: str, options: BucketOptions, n: float) -> None:
        self.given.append(n)
        await self.inner.give_back(key, options, n)


def _spent(estimate: Cost, quarters: int) -> Cost:
    """``quarters / 4`` of ``estimate`` (more than it when ``quarters > 4``)."""
    return Cost(
        calls=estimate.calls * quarters // 4,
        tokens=estimate.tokens * quarters // 4,
        cost=estimate.cost * quarters / 4,
    )


# --------------------------------------------------------------------------- the side-by-side driver


async def _drive(options: BudgetOptions, ops: list[Op]) -> tuple[int, int]:
    """Run ``ops`` against a leased and a plain store; assert every decision and every usage
    read is the same, and that after flush() the wrapped store holds exactly the plain use.
    Returns (reserve requests, reserve calls the wrapped store received)."""
    clock = ManualClock()
    plain = MemoryQuotaStore(clock)
    counting = CountingQuotas(MemoryQuotaStore(clock))
    leased = LeasedQuotas(counting, clock)
    open_: list[tuple[Reservation, Reservation]] = []
    requests = 0
    for op in ops:
        match op:
            case ("reserve", str(subject), Cost() as estimate):
                requests += 1
                direct, expected = await plain.reserve(subject, options, estimate)
                drawn, decision = await leased.reserve(subject, options, estimate)
                assert decision == expected, (clock.now(), subject, estimate)
                assert (drawn is None) == (direct is None)
                if direct is not None and drawn is not None:
                    assert (drawn.subject, drawn.day, drawn.amount) == (
                        direct.subject,
                        direct.day,
                        direct.amount,
                    )
                    open_.append((direct, drawn))
            case ("settle", int(index), int(quarters)) if open_:
                direct, drawn = open_.pop(index % len(open_))
                actual = _spent(direct.amount, quarters)
                assert await plain.settle(direct, actual)
                assert await leased.settle(drawn, actual)
            case ("refund", int(index)) if open_:
                direct, drawn = open_.pop(index % len(open_))
                assert await plain.refund(direct)
                assert await leased.refund(drawn)
            case ("advance", float(seconds)):
                clock.advance(seconds)
            case ("midnight", float(offset)):
                clock.advance(max(0.0, seconds_until_midnight(clock.wall()) + offset))
            case ("expire",):
                await leased.expire()
        for subject in SUBJECTS:
            assert await leased.usage(subject) == await plain.usage(subject), (clock.now(), op)
    for direct, drawn in open_:
        assert await plain.settle(direct, direct.amount)
        assert await leased.settle(drawn, direct.amount)
    await leased.flush()
    for subject in SUBJECTS:
        expected_usage = await plain.usage(subject)
        assert await leased.store.usage(subject) == expected_usage
        assert await leased.usage(subject) == expected_usage
        assert expected_usage.reserved_calls == expected_usage.reserved_tokens == 0
        assert expected_usage.reserved_cost == 0.0
    return requests, len(counting.reserved)


# --------------------------------------------------------------------------- strategies

estimates = st.builds(
    Cost,
    calls=st.integers(min_value=1, max_value=2),
    tokens=st.sampled_from([0, 10, 25, 60]),
    cost=st.integers(min_value=0, max_value=4).map(lambda k: k / 8),
)
tight_quotas = st.builds(
    Quota,
    calls=st.none() | st.integers(min_value=3, max_value=120),
    tokens=st.none() | st.integers(min_value=50, max_value=4_000),
    cost=st.none() | st.integers(min_value=4, max_value=240).map(lambda k: k / 8),
)
degrade_ats = st.sampled_from([0.5, 0.8, 1.0])
subjects = st.sampled_from(SUBJECTS)
# Requests in quick succession are what make leases form (the demand of a hold window).
small_gaps = st.sampled_from([0.0, 0.01, 0.02, 0.04, 0.06])
# Mostly quick, sometimes past a lease's hold time, an hour, or up to (or across) a UTC midnight.
gaps: st.SearchStrategy[Op] = st.one_of(
    small_gaps.map(lambda seconds: ("advance", seconds)),
    small_gaps.map(lambda seconds: ("advance", seconds)),
    st.sampled_from(
        [
            ("advance", 0.2),
            ("advance", LEASE_HOLD_S + 0.05),
            ("advance", 3_600.0),
            ("midnight", -0.3),
            ("midnight", -0.002),
            ("midnight", 0.0),
        ]
    ),
)
# How a request ends: settled at quarters of its estimate (up to twice it), or refunded.
outcomes = st.none() | st.integers(min_value=0, max_value=8)


def _round(
    subject: str,
    estimate: Cost,
    requests: list[tuple[Cost | None, int | None]],
    gap: float,
    after: Op,
    expire: bool,
) -> list[Op]:
    """Requests of one subject ``gap`` apart, one at a time (each settled or refunded before the
    next), mostly of one ``estimate``; then the gap ``after`` and maybe expire()."""
    ops: list[Op] = []
    for own, quarters in requests:
        ops.append(("reserve", subject, own or estimate))
        ops.append(("refund", 0) if quarters is None else ("settle", 0, quarters))
        ops.append(("advance", gap))
    ops.append(after)
    if expire:
        ops.append(("expire",))
    return ops


def _flatten(groups: list[list[Op]]) -> list[Op]:
    return [op for group in groups for op in group]


sequential_ops = st.lists(
    st.builds(
        _round,
        subjects,
        estimates,
        st.lists(st.tuples(st.none() | estimates, outcomes), min_size=4, max_size=24),
        small_gaps,
        gaps,
        st.booleans(),
    ),
    min_size=1,
    max_size=6,
).map(_flatten)


def _burst(subject: str, estimate: Cost, n: int, gap: float) -> list[Op]:
    """``n`` requests of one subject ``gap`` apart, left open."""
    ops: list[Op] = []
    for _ in range(n):
        ops += [("reserve", subject, estimate), ("advance", gap)]
    return ops


def _one(op: Op) -> list[Op]:
    return [op]


def overlapping(max_quarters: int) -> st.SearchStrategy[list[Op]]:
    """Bursts of requests left open, settled (at up to ``max_quarters / 4`` of their estimate)
    or refunded later in any order, between gaps and expire() calls."""
    settle: st.SearchStrategy[Op] = st.tuples(
        st.just("settle"), st.integers(0, 99), st.integers(0, max_quarters)
    )
    return st.lists(
        st.one_of(
            st.builds(_burst, subjects, estimates, st.integers(1, 24), small_gaps),
            st.lists(settle, min_size=1, max_size=6),
            st.tuples(st.just("refund"), st.integers(0, 99)).map(_one),
            gaps.map(_one),
            st.just(("expire",)).map(_one),
        ),
        min_size=1,
        max_size=30,
    ).map(_flatten)


# --------------------------------------------------------------------------- budget: equivalence


@settings(max_examples=150, deadline=None)
@given(quota=tight_quotas, degrade_at=degrade_ats, ops=sequential_ops)
def test_one_request_at_a_time_decides_and_counts_as_the_store(
    quota: Quota, degrade_at: float, ops: list[Op]
) -> None:
    """Requests that do not overlap (each settled, at any actual up to twice its estimate, or
    refunded before the next): every verdict, reason and retry_after, and every usage read, is
    the plain store's; after flush() the wrapped store holds exactly the plain use."""
    asyncio.run(_drive(BudgetOptions(quota=quota, degrade_at=degrade_at), ops))


@settings(max_examples=150, deadline=None)
@given(ops=overlapping(8))
def test_overlapping_requests_count_as_the_store(ops: list[Op]) -> None:
    """Far from the quota, with many requests open at once, retired and expired leases, and UTC
    midnights: usage() is the plain store's after every step, and so is the store's own after
    flush()."""
    asyncio.run(_drive(BudgetOptions(quota=Quota()), ops))


def _steady(
    n: int, *, gap: float = 0.004, subject: str = "a", estimate: Cost | None = None
) -> list[Op]:
    """``n`` requests ``gap`` apart, each settled at its estimate before the next."""
    ops: list[Op] = []
    for _ in range(n):
        ops += [
            ("reserve", subject, estimate or Cost(tokens=10, cost=0.25)),
            ("settle", 0, 4),
            ("advance", gap),
        ]
    return ops


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(quota=tight_quotas, degrade_at=degrade_ats, ops=overlapping(4))
@example(
    quota=Quota(calls=10),
    degrade_at=1.0,
    ops=[
        *_steady(4, gap=0.01, estimate=Cost()),
        ("advance", LEASE_HOLD_S),
        ("reserve", "a", Cost()),  # drawn from a lease of 2 calls, left open
        ("advance", LEASE_HOLD_S),
        ("reserve", "a", Cost(calls=5)),  # 4 used + 1 open + 5 = 10: allowed
    ],
)
def test_overlapping_requests_decide_as_the_store(
    quota: Quota, degrade_at: float, ops: list[Op]
) -> None:
    """The whole claim, near the quota and with requests open at once (actual <= estimate)."""
    asyncio.run(_drive(BudgetOptions(quota=quota, degrade_at=degrade_at), ops))


def test_a_busy_subject_reserves_in_leases() -> None:
    """200 requests over 0.8 s reach the store in far fewer reserves, deciding and counting the
    same; with a quota of 150 calls, degrades and blocks are the store's, request by request."""
    roomy = BudgetOptions(quota=Quota(calls=1_000, tokens=100_000, cost=1_000.0))
    requests, reserves = asyncio.run(_drive(roomy, _steady(200)))
    assert requests == 200
    assert reserves < requests // 2
    tight = BudgetOptions(quota=Quota(calls=150), degrade_at=0.8)
    requests, reserves = asyncio.run(_drive(tight, _steady(200)))
    assert requests == 200


def test_a_quiet_subject_goes_to_the_store_every_time() -> None:
    """Requests further apart than the hold time never form a lease."""
    options = BudgetOptions(quota=Quota(calls=20), degrade_at=0.8)
    requests, reserves = asyncio.run(_drive(options, _steady(30, gap=LEASE_HOLD_S)))
    assert requests == reserves == 30


def test_a_lease_stops_at_midnight() -> None:
    """A steady stream across a UTC midnight: the requests after it count on the new day, not
    in a lease of the old one; and a quota spent before midnight allows again after it."""
    ops: list[Op] = [("midnight", -0.6), *_steady(120, gap=0.01, estimate=Cost())]
    requests, reserves = asyncio.run(_drive(BudgetOptions(quota=Quota(calls=1_000)), ops))
    assert requests == 120
    assert reserves < requests // 2
    asyncio.run(_drive(BudgetOptions(quota=Quota(calls=40)), ops))


def test_a_lease_that_would_degrade_is_refunded_and_the_request_decided_alone() -> None:
    """A lease (5 calls: demand would ask for 23, a twentieth of the quota caps it) would cross
    the degrade line where one call does not: the request is allowed on its own, and the lease
    leaves nothing reserved in the store."""

    async def run() -> None:
        clock = ManualClock()
        options = BudgetOptions(quota=Quota(calls=100), degrade_at=0.5)
        counting = CountingQuotas(MemoryQuotaStore(clock))
        leased = LeasedQuotas(counting, clock)
        for _ in range(46):  # 46 calls in the first window: demand alone would lease 23 calls
            reservation, _ = await leased.reserve("a", options, Cost())
            assert reservation is not None
            await leased.settle(reservation, Cost())
            clock.advance(0.005)
        clock.advance(LEASE_HOLD_S)
        counting.reserved.clear()
        reservation, decision = await leased.reserve("a", options, Cost())
        assert decision == BudgetDecision(verdict=BudgetVerdict.ALLOW)
        assert counting.reserved == [Cost(calls=5), Cost()]  # the lease, then the request alone
        usage = await leased.store.usage("a")
        assert (usage.calls, usage.reserved_calls) == (46, 1)
        assert reservation is not None
        await leased.settle(reservation, Cost())
        assert (await leased.store.usage("a")).calls == 47

    asyncio.run(run())


# --------------------------------------------------------------------------- budget: concurrency


async def _build_demand(leased: LeasedQuotas, clock: ManualClock, options: BudgetOptions) -> None:
    """8 requests in one hold window (the later ones drawn from the leases that form as the
    window's demand grows), the leases flushed to the store, then the next window begins: new
    leases cover 4."""
    for _ in range(8):
        reservation, _ = await leased.reserve("s", options, Cost(tokens=10))
        assert reservation is not None
        await leased.settle(reservation, Cost(tokens=10))
        clock.advance(0.01)
    await leased.flush()
    clock.advance(LEASE_HOLD_S)


@pytest.mark.parametrize("first", [0, 1])
@pytest.mark.asyncio
async def test_two_concurrent_reserves_share_one_lease(first: int) -> None:
    """Two reserves of one subject arrive while the store is slow: the second waits for the
    first's store call and draws from the lease it opened, so the store sees one lease, not two;
    once both requests settle (in either order) and the lease is flushed, the store holds nothing
    reserved and counts exactly the two requests."""
    clock = ManualClock()
    options = BudgetOptions(quota=Quota(tokens=100_000))
    counting = CountingQuotas(MemoryQuotaStore(clock), clock)
    leased = LeasedQuotas(counting, clock)
    await _build_demand(leased, clock, options)
    before = await leased.store.usage("s")
    assert (before.tokens, before.reserved_tokens) == (80, 0)
    counting.reserved.clear()

    results = await asyncio.gather(
        leased.reserve("s", options, Cost(tokens=10)),
        leased.reserve("s", options, Cost(tokens=10)),
    )
    assert counting.reserved == [Cost(calls=4, tokens=40)]
    allowed = BudgetDecision(verdict=BudgetVerdict.ALLOW)
    assert [decision for _, decision in results] == [allowed, allowed]
    drawn = [_opened(found)[0] for found in results]
    assert drawn[0].id != drawn[1].id
    assert await leased.usage("s") == Usage(
        day=before.day, calls=8, tokens=80, reserved_calls=2, reserved_tokens=20
    )

    actual = [Cost(tokens=7), Cost(tokens=3)]
    for index in (first, 1 - first):
        assert await leased.settle(drawn[index], actual[index])
    await leased.flush()
    expected = Usage(day=before.day, calls=10, tokens=90)
    assert await leased.store.usage("s") == expected
    assert await leased.usage("s") == expected
    assert not await leased.settle(drawn[0], actual[0])  # settled once only


@pytest.mark.asyncio
async def test_a_lease_settles_once_its_last_request_has() -> None:
    """A lease retired with a request open gives the store back its unused part at once (the
    store then holds exactly what the open request holds) and closes in the store when that
    request settles, without another expire()."""
    clock = ManualClock()
    options = BudgetOptions(quota=Quota(tokens=100_000))
    leased = LeasedQuotas(MemoryQuotaStore(clock), clock)
    await _build_demand(leased, clock, options)
    reservation, _ = await leased.reserve("s", options, Cost(tokens=10))
    assert reservation is not None
    clock.advance(LEASE_HOLD_S)
    await leased.expire()
    assert (await leased.store.usage("s")).reserved_tokens == 10  # just the open request
    assert (await leased.usage("s")).reserved_tokens == 10
    assert await leased.refund(reservation)
    assert await leased.store.usage("s") == Usage(day=reservation.day, calls=8, tokens=80)


# --------------------------------------------------------------------------- budget: expire()


@pytest.mark.asyncio
async def test_expire_settles_a_quiet_subjects_lease_into_the_store() -> None:
    """Three requests drawn from one lease settle; the store sees the whole lease reserved until
    expire() runs after the hold time, and then exactly what the three used."""
    clock = ManualClock()
    options = BudgetOptions(quota=Quota(tokens=100_000))
    leased = LeasedQuotas(MemoryQuotaStore(clock), clock)
    await _build_demand(leased, clock, options)
    day = (await leased.store.usage("s")).day
    for actual in (4, 6, 9):  # three requests drawn from one lease of 4 x 10 tokens
        (reservation,) = _opened(await leased.reserve("s", options, Cost(tokens=10)))
        await leased.settle(reservation, Cost(tokens=actual))
        clock.advance(0.001)
    exact = Usage(day=day, calls=11, tokens=99)
    assert await leased.usage("s") == exact
    assert await leased.store.usage("s") == Usage(
        day=day, calls=8, tokens=80, reserved_calls=4, reserved_tokens=40
    )
    await leased.expire()  # not yet: the lease's hold time has not passed
    assert (await leased.store.usage("s")).reserved_tokens == 40
    clock.advance(LEASE_HOLD_S)
    await leased.expire()
    assert await leased.store.usage("s") == exact
    assert await leased.usage("s") == exact


def _opened(found: tuple[Reservation | None, BudgetDecision]) -> tuple[Reservation]:
    reservation, _ = found
    assert reservation is not None
    return (reservation,)


# --------------------------------------------------------------------------- budget: regressions


@pytest.mark.asyncio
async def test_a_retired_lease_does_not_hold_back_its_unused_part() -> None:
    clock = ManualClock()
    options = BudgetOptions(quota=Quota(calls=10), degrade_at=1.0)
    plain = MemoryQuotaStore(clock)
    leased = LeasedQuotas(MemoryQuotaStore(clock), clock)
    for _ in range(4):  # 4 calls used in the first window: the next lease covers 2
        for store in (plain, leased):
            (reservation,) = _opened(await store.reserve("s", options, Cost()))
            await store.settle(reservation, Cost())
        clock.advance(0.01)
    clock.advance(LEASE_HOLD_S)
    # One long request draws from a lease of 2 calls and stays open; the lease expires.
    for store in (plain, leased):
        _opened(await store.reserve("s", options, Cost()))
    clock.advance(LEASE_HOLD_S)
    # Used 4 + open 1 + 5 = 10 calls: within the quota of 10.
    _, expected = await plain.reserve("s", options, Cost(calls=5))
    _, decision = await leased.reserve("s", options, Cost(calls=5))
    assert expected.verdict is BudgetVerdict.ALLOW
    assert decision == expected  # was BLOCK: the store still held the lease's 2nd call


@pytest.mark.asyncio
async def test_a_lease_does_not_allow_past_the_quota_after_an_overspend() -> None:
    clock = ManualClock()
    options = BudgetOptions(quota=Quota(tokens=1_000), degrade_at=1.0)
    plain = MemoryQuotaStore(clock)
    leased = LeasedQuotas(MemoryQuotaStore(clock), clock)
    estimate = Cost(tokens=100)
    # A long request, reserved on its own (no demand yet), and 3 more that finish at once.
    (long_direct,) = _opened(await plain.reserve("s", options, estimate))
    (long_leased,) = _opened(await leased.reserve("s", options, estimate))
    for _ in range(3):
        for store in (plain, leased):
            (reservation,) = _opened(await store.reserve("s", options, Cost(tokens=0)))
            await store.settle(reservation, Cost(tokens=0))
        clock.advance(0.01)
    clock.advance(LEASE_HOLD_S)
    # The next request opens a lease of 2 x 100 tokens (100 open + 200 <= 1000: allowed).
    for store in (plain, leased):
        _opened(await store.reserve("s", options, estimate))
    # The long request spends 850 tokens: used 850 + open 100 leaves room for 50 more.
    await plain.settle(long_direct, Cost(tokens=850))
    await leased.settle(long_leased, Cost(tokens=850))
    _, expected = await plain.reserve("s", options, estimate)
    _, decision = await leased.reserve("s", options, estimate)
    assert expected.verdict is BudgetVerdict.BLOCK
    assert decision == expected  # was ALLOW, drawn from the lease


@pytest.mark.asyncio
async def test_expire_racing_a_reserve_keeps_usage_exact() -> None:
    clock = ManualClock()
    options = BudgetOptions(quota=Quota(calls=1_000))
    plain = MemoryQuotaStore(clock)
    leased = LeasedQuotas(CountingQuotas(MemoryQuotaStore(clock), clock), clock)
    for subject in ("a", "b"):
        for _ in range(4):
            for store in (plain, leased):
                (reservation,) = _opened(await store.reserve(subject, options, Cost()))
                await store.settle(reservation, Cost())
    clock.advance(LEASE_HOLD_S + 0.05)
    # "a" holds a lease with nothing open, "b" one with a request open.
    for store in (plain, leased):
        (reservation,) = _opened(await store.reserve("a", options, Cost()))
        await store.settle(reservation, Cost())
    open_b = [_opened(await store.reserve("b", options, Cost()))[0] for store in (plain, leased)]
    clock.advance(LEASE_HOLD_S + 0.05)
    # expire() awaits the store to settle "a"'s lease while a request of "b" retires "b"'s.
    _, (late, _), (direct_late, _) = await asyncio.gather(
        leased.expire(),
        leased.reserve("b", options, Cost()),
        plain.reserve("b", options, Cost()),
    )
    assert late is not None
    assert direct_late is not None
    for direct, drawn in ((open_b[0], open_b[1]), (direct_late, late)):
        await plain.settle(direct, Cost())
        await leased.settle(drawn, Cost())
    await leased.flush()
    assert await leased.store.usage("b") == await plain.usage("b")
    assert await leased.usage("b") == await plain.usage("b")  # was reserved_calls=-2


# --------------------------------------------------------------------------- buckets


@settings(max_examples=150, deadline=None)
@given(
    burst=st.integers(min_value=1, max_value=39).map(float),
    rate=st.sampled_from([0.5, 2.0, 10.0, 50.0]),
    steps=st.lists(
        st.tuples(
            st.sampled_from(["k1", "k2"]),
            st.sampled_from([0.0, 0.0, 0.001, 0.002, 0.01, 0.1, LEASE_HOLD_S, 1.0]),
        ),
        max_size=120,
    ),
)
def test_a_small_burst_never_leases(
    burst: float, rate: float, steps: list[tuple[str, float]]
) -> None:
    """A burst under 40 allows no lease: every take goes to the store and answers as it does."""

    async def run() -> None:
        clock = ManualClock()
        options = BucketOptions(rate=rate, burst=burst)
        plain = MemoryBucketStore(clock)
        counting = CountingBuckets(MemoryBucketStore(clock))
        leased = LeasedBuckets(counting, clock)
        for key, gap in steps:
            clock.advance(gap)
            assert await leased.take(key, options) == await plain.take(key, options)
        assert counting.takes == len(steps)

    asyncio.run(run())


async def _side_by_side(
    options: BucketOptions, gaps: list[float]
) -> tuple[int, int, CountingBuckets, list[TakeResult]]:
    """Take one token per gap from a plain and a leased bucket; assert the leased one never has
    allowed more, and return both allowed counts, the counted store and the leased refusals."""
    clock = ManualClock()
    plain = MemoryBucketStore(clock)
    counting = CountingBuckets(MemoryBucketStore(clock))
    leased = LeasedBuckets(counting, clock)
    allowed_plain = allowed_leased = 0
    refusals: list[TakeResult] = []
    for gap in gaps:
        clock.advance(gap)
        allowed_plain += (await plain.take("k", options)).allowed
        calls = counting.takes
        result = await leased.take("k", options)
        allowed_leased += result.allowed
        assert allowed_leased <= allowed_plain
        if not result.allowed:
            # The refusal is the store's own answer to a take of one token.
            assert counting.takes > calls
            assert result is counting.last
            refusals.append(result)
    return allowed_plain, allowed_leased, counting, refusals


@pytest.mark.asyncio
async def test_a_busy_key_takes_tokens_in_leases() -> None:
    """1000 requests a second for 1.2 s against a burst of 1000 refilling 100 a second: far
    fewer store calls than requests, never more allowed than the plain bucket, and every
    refusal (with its retry_after) is the store's own."""
    options = BucketOptions(rate=100.0, burst=1_000.0)
    allowed_plain, allowed_leased, counting, refusals = await _side_by_side(
        options, [0.001] * 1_200
    )
    assert counting.takes < 1_200 // 2
    assert refusals
    assert all(0.0 < r.retry_after <= 1.0 / options.rate + 1e-9 for r in refusals)
    # What leases lost is at most what was left in one when it expired (< burst / 20).
    assert allowed_plain - allowed_leased < options.burst / 20


@pytest.mark.asyncio
async def test_a_burst_after_a_pause_leases_within_its_first_window() -> None:
    """A key idle for longer than the hold time gets 200 requests in 0.1 s (all inside one
    window): leases form as the window's demand grows, each about half as large again as the
    one before, so the store sees a small fraction of the takes and reserves, not one each
    until the next window; and the leased bucket still never allows more than the plain one."""
    bucket = BucketOptions(rate=10_000.0, burst=100_000.0)
    _plain, _leased, counting, refusals = await _side_by_side(bucket, [0.0005] * 200)
    assert not refusals
    assert counting.takes < 200 // 8

    clock = ManualClock()
    options = BudgetOptions(quota=Quota(calls=100_000, tokens=10_000_000))
    quotas = CountingQuotas(MemoryQuotaStore(clock), clock)
    leased = LeasedQuotas(quotas, clock)
    for _ in range(200):
        reservation, decision = await leased.reserve("s", options, Cost(tokens=10))
        assert reservation is not None
        assert decision.verdict is BudgetVerdict.ALLOW
        await leased.settle(reservation, Cost(tokens=10))
        clock.advance(0.0005)
    assert len(quotas.reserved) < 200 // 8
    await leased.flush()
    usage = await leased.store.usage("s")
    assert (usage.calls, usage.tokens, usage.reserved_calls) == (200, 2_000, 0)


@pytest.mark.asyncio
async def test_a_refused_bucket_lease_falls_back_to_one_token() -> None:
    """Once the bucket holds less than a lease, each request asks the store for one token: every
    token of the bucket still reaches a request."""
    options = BucketOptions(rate=1.0, burst=400.0)
    allowed_plain, allowed_leased, _counting, refusals = await _side_by_side(options, [0.001] * 600)
    assert allowed_leased == allowed_plain == 400
    assert len(refusals) == 200


@pytest.mark.asyncio
async def test_a_bucket_lease_is_given_back_after_its_hold_time() -> None:
    """Tokens left in a lease when demand stops are not handed out after the hold time: they go
    back to the bucket, and the next take goes to the store."""
    clock = ManualClock()
    options = BucketOptions(rate=400.0, burst=640.0)
    counting = CountingBuckets(MemoryBucketStore(clock))
    leased = LeasedBuckets(counting, clock)
    for _ in range(420):  # 200 requests a second: leases of 25 tokens, the last one not used up
        clock.advance(0.005)
        assert (await leased.take("k", options)).allowed
    calls = counting.takes
    assert calls < 420 // 4
    clock.advance(LEASE_HOLD_S)
    assert not counting.given
    result = await leased.take("k", options)
    assert counting.takes == calls + 1
    assert result is counting.last
    assert len(counting.given) == 1
    assert 0 < counting.given[0] < 25


@pytest.mark.asyncio
async def test_a_bucket_lease_passes_the_burst_by_less_than_one_lease() -> None:
    """Tokens held in a lease are outside the bucket, which refills meanwhile: right after a
    pause a key gets through at most ``k - 1`` more than its burst (the documented bound, a
    twentieth of the burst), never more."""
    clock = ManualClock()
    options = BucketOptions(rate=400.0, burst=640.0)
    plain = MemoryBucketStore(clock)
    leased = LeasedBuckets(MemoryBucketStore(clock), clock)
    for _ in range(420):  # 200 requests a second: leases of 25 tokens
        clock.advance(0.005)
        assert (await plain.take("k", options)).allowed
        assert (await leased.take("k", options)).allowed
    clock.advance(0.1)  # both buckets refill to 640; the lease still holds a few tokens
    burst_plain = sum([(await plain.take("k", options)).allowed for _ in range(700)])
    burst_leased = sum([(await leased.take("k", options)).allowed for _ in range(700)])
    assert burst_plain == 640
    assert burst_plain < burst_leased < burst_plain + options.burst / BURST_SHARE


@pytest.mark.asyncio
async def test_a_budget_lease_holds_at_most_a_twentieth_of_each_quota() -> None:
    """However busy the subject, a lease never reserves more than a twentieth of a limited
    dimension: that bounds how early another replica can be refused near the limit."""
    clock = ManualClock()
    options = BudgetOptions(quota=Quota(tokens=20_000))
    counting = CountingQuotas(MemoryQuotaStore(clock))
    leased = LeasedQuotas(counting, clock)
    for _ in range(600):  # 250 a window: leases of 125 requests, were it not for the quota
        reservation, _ = await leased.reserve("s", options, Cost(tokens=10))
        assert reservation is not None
        await leased.settle(reservation, Cost(tokens=10))
        clock.advance(0.001)
    leases = [amount for amount in counting.reserved if amount.calls > 1]
    assert leases
    assert max(amount.tokens for amount in leases) == 1_000  # 20,000 / 20


@pytest.mark.asyncio
@pytest.mark.parametrize("n", [1.0, 0.75, 2.5])
async def test_a_take_drawn_from_a_lease_answers_what_is_left_in_it(n: float) -> None:
    """A take answered from a lease is allowed and tells what the lease still holds: its size
    less every take drawn from it so far, token by token, as the store would say of a bucket of
    that many tokens."""
    clock = ManualClock()
    options = BucketOptions(rate=1_000.0, burst=10_000.0)
    sizes: list[float] = []

    class Sizes(CountingBuckets):
        async def take(self, key: str, options: BucketOptions, n: float = 1.0) -> TakeResult:
            sizes.append(n)
            return await super().take(key, options, n)

    counting = Sizes(MemoryBucketStore(clock))
    leased = LeasedBuckets(counting, clock)
    left: float | None = None
    drawn = 0
    for _ in range(2_000):
        clock.advance(0.0005)
        calls = counting.takes
        result = await leased.take("k", options, n)
        if counting.takes > calls:  # the store answered; a lease of more than n leaves the rest
            left = sizes[-1] - n if sizes[-1] > n else None
            continue
        assert left is not None
        left -= n
        drawn += 1
        assert result == TakeResult(allowed=True, remaining=left, retry_after=0.0, reset_after=0.0)
    assert drawn > 1_000


@pytest.mark.asyncio
async def test_take_now_answers_from_a_live_lease_only_and_never_refuses() -> None:
    """``take_now`` is the take when the key's lease holds it (the same answer ``take`` gives,
    no store call), None otherwise: before any lease, for other options, once the lease's hold
    time is up, and once it is empty; it never answers a refusal."""
    clock = ManualClock()
    options = BucketOptions(rate=100.0, burst=1_000.0)
    counting = CountingBuckets(MemoryBucketStore(clock))
    leased = LeasedBuckets(counting, clock)
    assert leased.take_now("k", options) is None  # no lease yet
    for _ in range(64):  # demand grows: leases form
        await leased.take("k", options)
        clock.advance(0.001)
    while leased.take_now("k", options) is None:  # the lease of the last store call is spent
        assert (await leased.take("k", options)).allowed
    assert leased.take_now("k", BucketOptions(rate=100.0, burst=1_000.0)) is None  # other options
    calls, drawn = counting.takes, 1
    while (result := leased.take_now("k", options)) is not None:
        assert result.allowed
        drawn += 1
    assert drawn >= 2
    assert counting.takes == calls  # drawn from the lease; an empty one answers None
    assert (await leased.take("k", options)).allowed  # the store is asked instead
    clock.advance(LEASE_HOLD_S * 2)
    assert leased.take_now("k", options) is None  # the hold time is up


@pytest.mark.asyncio
async def test_reserve_now_and_settle_now_answer_from_the_current_lease_only() -> None:
    """``reserve_now`` draws from a subject's current lease (no store call) or answers None;
    ``settle_now`` settles a draw of the current lease there and answers True, and False with
    nothing done for a reservation the store made or a lease already retired. Together they
    count exactly what reserve and settle count."""
    clock = ManualClock()
    options = BudgetOptions(quota=Quota(calls=100_000, tokens=10_000_000))
    quotas = CountingQuotas(MemoryQuotaStore(clock))
    leased = LeasedQuotas(quotas, clock)
    assert leased.reserve_now("s", options, Cost(tokens=10)) is None  # an unknown subject
    alone, _ = await leased.reserve("s", options, Cost(tokens=10))  # asks the store
    assert alone is not None
    assert not leased.settle_now(alone, Cost(tokens=10))  # the store's own reservation
    assert await leased.settle(alone, Cost(tokens=10))

    async def one() -> None:  # as the pipeline reserves and settles
        held = leased.reserve_now("s", options, Cost(tokens=10))
        if held is None:
            held, _ = await leased.reserve("s", options, Cost(tokens=10))
        assert held is not None
        assert leased.settle_now(held, Cost(tokens=10)) or await leased.settle(
            held, Cost(tokens=10)
        )

    for _ in range(64):  # demand grows: leases form, each larger
        await one()
    reserves = len(quotas.reserved)
    while len(quotas.reserved) == reserves:  # until the store is asked for a new lease
        await one()
    reserves = len(quotas.reserved)
    before = await leased.usage("s")
    calls_before, tokens_before = before.calls, before.tokens
    drawn = [leased.reserve_now("s", options, Cost(tokens=10)) for _ in range(4)]
    assert all(reservation is not None for reservation in drawn)
    assert len(quotas.reserved) == reserves  # no store call
    assert leased.reserve_now("s", BudgetOptions(quota=Quota(calls=5)), Cost()) is None
    for reservation in drawn[:3]:
        assert reservation is not None
        assert leased.settle_now(reservation, Cost(tokens=12))
    assert drawn[0] is not None
    assert not leased.settle_now(drawn[0], Cost(tokens=12))  # settled already: nothing done
    clock.advance(LEASE_HOLD_S * 2)
    await leased.expire()  # the lease retires with one request still open
    assert drawn[3] is not None
    assert not leased.settle_now(drawn[3], Cost(tokens=10))
    assert await leased.settle(drawn[3], Cost(tokens=10))
    await leased.flush()
    spent = await leased.store.usage("s")
    assert spent.reserved_calls == 0
    assert (spent.calls, spent.tokens) == (calls_before + 4, tokens_before + 3 * 12 + 10)
