"""Leases under concurrency, on every backend: hundreds of requests of one key at once, the load at
which leases engage (a burst of 200 leases 10 tokens at a time; a quota of 200 calls, 10 calls).

One process, or three sharing one store, each its own :class:`LeasedBuckets` /
:class:`LeasedQuotas`. Every store call first yields to the event loop, as a call over a network
does, so that concurrent requests interleave on ``memory://`` and ``sqlite://`` as they do on
Redis and Postgres.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from tests.state.conftest import Backend
from tidegate.clock import ManualClock
from tidegate.policy.budget import (
    BudgetDecision,
    BudgetOptions,
    BudgetVerdict,
    Cost,
    Quota,
    Reservation,
    Usage,
)
from tidegate.policy.ratelimit import BucketOptions, TakeResult
from tidegate.state.base import BucketStore, QuotaStore
from tidegate.state.leases import BURST_SHARE, QUOTA_SHARE, LeasedBuckets, LeasedQuotas

pytestmark = pytest.mark.asyncio

BURST = 200
#: Nearly no refill while a test runs: what passes is what the burst holds.
BUCKET = BucketOptions(rate=0.001, burst=float(BURST))
LIMIT = 200
BUDGET = BudgetOptions(quota=Quota(calls=LIMIT), degrade_at=0.8)
THRESHOLD = int(LIMIT * BUDGET.degrade_at)
ALLOWED = BudgetDecision(verdict=BudgetVerdict.ALLOW)
REPLICAS = 3
#: The most a lease of another replica can hold unused when a take or reservation is refused.
TOKEN_SLACK = (REPLICAS - 1) * BURST // BURST_SHARE
CALL_SLACK = (REPLICAS - 1) * LIMIT // QUOTA_SHARE


class NetworkedBuckets:
    """A bucket store whose every call yields to the loop first, as a networked store's does."""

    def __init__(self, inner: BucketStore, clock: ManualClock) -> None:
        self.inner = inner
        self.clock = clock

    async def take(self, key: str, options: BucketOptions, n: float = 1.0) -> TakeResult:
        await self.clock.asleep(0.0)
        return await self.inner.take(key, options, n)

    async def give_back(self, key: str, options: BucketOptions, n: float) -> None:
        await self.clock.asleep(0.0)
        await self.inner.give_back(key, options, n)


class NetworkedQuotas:
    """A quota store whose every call yields to the loop first, as a networked store's does."""

    def __init__(self, inner: QuotaStore, clock: ManualClock) -> None:
        self.inner = inner
        self.clock = clock

    async def reserve(
        self, subject: str, options: BudgetOptions, estimate: Cost
    ) -> tuple[Reservation | None, BudgetDecision]:
        await self.clock.asleep(0.0)
        return await self.inner.reserve(subject, options, estimate)

    async def settle(self, reservation: Reservation, actual: Cost) -> bool:
        await self.clock.asleep(0.0)
        return await self.inner.settle(reservation, actual)

    async def refund(self, reservation: Reservation) -> bool:
        await self.clock.asleep(0.0)
        return await self.inner.refund(reservation)

    async def rebase(
        self, reservation: Reservation, actual: Cost, keep: Cost
    ) -> Reservation | None:
        await self.clock.asleep(0.0)
        return await self.inner.rebase(reservation, actual, keep)

    async def usage(self, subject: str) -> Usage:
        return await self.inner.usage(subject)


#: How long a request waits for its key's store call under way. The stores answer real time
#: here (a Postgres round trip each), and a thousand requests of one key queue behind each
#: other: on a loaded machine that passed the production default (0.5 s) once. What these tests
#: judge is the counting, not that guard.
WAIT_S = 10.0


async def _buckets(backend: Backend, count: int) -> list[LeasedBuckets]:
    """``count`` processes' leased buckets over ``backend``'s state, each on its own connection."""
    replicas = [backend] + [await backend.replica() for _ in range(count - 1)]
    return [
        LeasedBuckets(NetworkedBuckets(r.buckets, backend.clock), backend.clock, wait_s=WAIT_S)
        for r in replicas
    ]


async def _quotas(backend: Backend, count: int) -> list[LeasedQuotas]:
    replicas = [backend] + [await backend.replica() for _ in range(count - 1)]
    return [
        LeasedQuotas(NetworkedQuotas(r.quotas, backend.clock), backend.clock, wait_s=WAIT_S)
        for r in replicas
    ]


async def _takes(processes: list[LeasedBuckets], offered: int) -> int:
    """``offered`` takes of one key at once, round-robin over ``processes``; how many passed."""

    async def take(process: LeasedBuckets) -> TakeResult:
        # As the rate-limit step takes: from the lease at once when it can, else from the store.
        return process.take_now("u", BUCKET) or await process.take("u", BUCKET)

    results = await asyncio.gather(*(take(processes[i % len(processes)]) for i in range(offered)))
    for process in processes:
        await process.flush()
    return sum(result.allowed for result in results)


async def _left_in_bucket(backend: Backend) -> int:
    """Whole tokens the store's bucket holds (taking them all)."""
    left = 0
    while (await backend.buckets.take("u", BUCKET)).allowed:
        left += 1
    return left


@pytest.mark.parametrize("offered", [100, 200, 300, 1_000])
async def test_one_process_passes_exactly_what_the_store_would(
    backend: Backend, offered: int
) -> None:
    """However many takes of one key arrive at once, exactly min(burst, offered) pass, and once
    the leases are given back the bucket holds exactly the rest: no token is lost or doubled."""
    (process,) = await _buckets(backend, 1)
    passed = await _takes([process], offered)
    assert passed == min(BURST, offered)
    assert await _left_in_bucket(backend) == BURST - passed


@pytest.mark.parametrize("offered", [100, 300, 1_000])
async def test_three_processes_pass_the_burst_within_one_lease_each(
    backend: Backend, offered: int
) -> None:
    """Three processes on one shared bucket never pass more than the burst, refuse early by at
    most the unused part of the other processes' leases, and lose no token."""
    processes = await _buckets(backend, REPLICAS)
    passed = await _takes(processes, offered)
    expected = min(BURST, offered)
    assert expected - TOKEN_SLACK <= passed <= expected
    assert await _left_in_bucket(backend) == BURST - passed


async def _requests(
    processes: list[LeasedQuotas], backend: Backend, offered: int
) -> Counter[BudgetVerdict]:
    """``offered`` requests of one subject at once, round-robin over ``processes``: each reserves
    a call, runs a while (some long enough to outlive the lease they drew from) and settles one
    call. Returns the decisions; every lease is flushed afterwards."""
    rng = random.Random(offered)
    durations = [rng.choice([0, 1, 2, 5, 40]) for _ in range(offered)]

    async def request(quotas: LeasedQuotas, steps: int) -> BudgetVerdict:
        # As the budget and settle steps do: from the lease at once when it can, else the store.
        reservation = quotas.reserve_now("s", BUDGET, Cost(calls=1))
        decision = ALLOWED
        if reservation is None:
            reservation, decision = await quotas.reserve("s", BUDGET, Cost(calls=1))
        if reservation is None:
            return decision.verdict
        for _ in range(steps):
            await backend.clock.asleep(0.0)
        assert quotas.settle_now(reservation, Cost(calls=1)) or await quotas.settle(
            reservation, Cost(calls=1)
        )
        return decision.verdict

    verdicts = await asyncio.gather(
        *(request(processes[i % len(processes)], d) for i, d in enumerate(durations))
    )
    for process in processes:
        await process.flush()
    return Counter(verdicts)


@pytest.mark.parametrize("offered", [150, 300, 1_000])
async def test_one_process_decides_a_budget_exactly_as_the_store(
    backend: Backend, offered: int
) -> None:
    """One process: the first 160 calls are allowed, the next 40 degraded, the rest blocked, as
    the store alone decides them; the store then records exactly the calls served."""
    (process,) = await _quotas(backend, 1)
    verdicts = await _requests([process], backend, offered)
    allowed = min(offered, THRESHOLD)
    degraded = min(offered, LIMIT) - allowed
    assert (
        verdicts
        == Counter(
            {
                BudgetVerdict.ALLOW: allowed,
                BudgetVerdict.DEGRADE: degraded,
                BudgetVerdict.BLOCK: offered - allowed - degraded,
            }
        )
        - Counter()
    )
    usage = await backend.quotas.usage("s")
    assert (usage.calls, usage.reserved_calls) == (allowed + degraded, 0)


@pytest.mark.parametrize("offered", [300, 1_000])
async def test_three_processes_never_spend_past_a_budget(backend: Backend, offered: int) -> None:
    """Three processes on one shared budget: never more calls served than the quota, never one
    served in full past the degrade threshold, every call served recorded in the store once the
    requests settle, and early refusals bounded by the other processes' unused leases."""
    processes = await _quotas(backend, REPLICAS)
    verdicts = await _requests(processes, backend, offered)
    served = verdicts[BudgetVerdict.ALLOW] + verdicts[BudgetVerdict.DEGRADE]
    assert served <= LIMIT
    assert verdicts[BudgetVerdict.ALLOW] <= THRESHOLD
    assert served >= LIMIT - CALL_SLACK
    usage = await backend.quotas.usage("s")
    assert (usage.calls, usage.reserved_calls) == (served, 0)
