"""Leases against the store alone, in random concurrent schedules (Hypothesis).

Requests of one key from one to three processes (each its own lease layer) share one memory
store reached over a "network" whose every call takes a random number of event-loop rounds, so
every example interleaves the requests, the lease refills and the retirements differently. What
must hold is what docs/state.md promises of leases: one process decides exactly as the store
alone would; several never pass a limit, refuse early by at most the others' unused leases, and
leave the store counting exactly what was served.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

from hypothesis import given, settings
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
)
from tidegate.policy.ratelimit import BucketOptions, TakeResult
from tidegate.state.base import BucketStore, QuotaStore
from tidegate.state.leases import (
    BURST_SHARE,
    LEASE_HOLD_S,
    LEASE_MAX_CHUNK,
    QUOTA_SHARE,
    LeasedBuckets,
    LeasedQuotas,
)
from tidegate.state.memory import MemoryBucketStore, MemoryQuotaStore

#: How long a request waits for the store call of its key in flight, in real seconds: hundreds of
#: requests of one key on the manual clock can take longer than the production default (0.5 s)
#: on a loaded machine, which then fails them. What these tests judge is the counting.
WAIT_S = 30.0


class Jittery:
    """A memory store reached over a "network" whose calls take a random number of loop rounds,
    so that concurrent requests interleave differently in every example."""

    def __init__(self, quotas: QuotaStore, buckets: BucketStore, clock: ManualClock, seed: int):
        self.quotas, self.buckets = quotas, buckets
        self.clock = clock
        self.rng = random.Random(seed)

    async def _rounds(self) -> None:
        for _ in range(self.rng.choice([0, 1, 1, 2, 5])):
            await self.clock.asleep(0.0)

    async def take(self, key: str, options: BucketOptions, n: float = 1.0) -> TakeResult:
        await self._rounds()
        return await self.buckets.take(key, options, n)

    async def give_back(self, key: str, options: BucketOptions, n: float) -> None:
        await self._rounds()
        await self.buckets.give_back(key, options, n)

    async def reserve(
        self, subject: str, options: BudgetOptions, estimate: Cost
    ) -> tuple[Reservation | None, BudgetDecision]:
        await self._rounds()
        return await self.quotas.reserve(subject, options, estimate)

    async def settle(self, reservation: Reservation, actual: Cost) -> bool:
        await self._rounds()
        return await self.quotas.settle(reservation, actual)

    async def refund(self, reservation: Reservation) -> bool:
        await self._rounds()
        return await self.quotas.refund(reservation)

    async def rebase(
        self, reservation: Reservation, actual: Cost, keep: Cost
    ) -> Reservation | None:
        await self._rounds()
        return await self.quotas.rebase(reservation, actual, keep)

    async def usage(self, subject: str) -> Usage:
        return await self.quotas.usage(subject)


@settings(max_examples=60, deadline=None)
@given(
    burst=st.integers(min_value=40, max_value=400),
    offered=st.integers(min_value=1, max_value=900),
    processes=st.integers(min_value=1, max_value=3),
    pauses=st.lists(st.sampled_from([0.0, 0.0, 0.01, LEASE_HOLD_S]), max_size=4),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_random_schedules_of_takes_keep_the_bucket_exact(
    burst: int, offered: int, processes: int, pauses: list[float], seed: int
) -> None:
    """Any number of takes from 1-3 processes, in waves with pauses between them (leases
    expiring and given back): one process passes exactly what the bucket holds; several pass at
    most that, and at least that less the others' leases; the bucket never loses a token."""

    async def run() -> None:
        clock = ManualClock(0.0, wall_start=1_000_000.0)
        store = Jittery(MemoryQuotaStore(clock), MemoryBucketStore(clock), clock, seed)
        options = BucketOptions(rate=1e-9, burst=float(burst))
        leased = [LeasedBuckets(store, clock, wait_s=WAIT_S) for _ in range(processes)]
        waves = [offered // (len(pauses) + 1)] * len(pauses) + [offered]
        passed = sent = 0
        for size, pause in zip(waves, [*pauses, 0.0], strict=True):
            size = min(size, offered - sent)
            results = await asyncio.gather(
                *(leased[(sent + i) % processes].take("k", options) for i in range(size))
            )
            sent += size
            passed += sum(result.allowed for result in results)
            clock.advance(pause)
            for process in leased:
                await process.expire()
        for process in leased:
            await process.flush()
        expected = min(burst, offered)
        slack = (
            0 if processes == 1 else (processes - 1) * min(LEASE_MAX_CHUNK, burst // BURST_SHARE)
        )
        assert expected - slack <= passed <= expected
        left = 0
        while (await store.buckets.take("k", options)).allowed:
            left += 1
        assert left == burst - passed

    asyncio.run(run())


@settings(max_examples=60, deadline=None)
@given(
    limit=st.integers(min_value=20, max_value=400),
    degrade_at=st.sampled_from([0.5, 0.8, 1.0]),
    offered=st.integers(min_value=1, max_value=900),
    processes=st.integers(min_value=1, max_value=3),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_random_schedules_of_reservations_keep_the_budget_exact(
    limit: int, degrade_at: float, offered: int, processes: int, seed: int
) -> None:
    """Any number of one-call requests from 1-3 processes, each running a random while: one
    process decides exactly as the store alone would (allowed up to the degrade threshold,
    degraded up to the limit, the rest blocked); several never serve past the limit nor in full
    past the threshold; and the store ends up counting exactly the calls served."""

    async def run() -> None:
        clock = ManualClock(0.0, wall_start=1_000_000.0)
        store = Jittery(MemoryQuotaStore(clock), MemoryBucketStore(clock), clock, seed)
        options = BudgetOptions(quota=Quota(calls=limit), degrade_at=degrade_at)
        leased = [LeasedQuotas(store, clock, wait_s=WAIT_S) for _ in range(processes)]
        rng = random.Random(seed)

        async def request(quotas: LeasedQuotas, rounds: int) -> BudgetVerdict:
            reservation, decision = await quotas.reserve("s", options, Cost(calls=1))
            if reservation is not None:
                for _ in range(rounds):
                    await clock.asleep(0.0)
                assert await quotas.settle(reservation, Cost(calls=1))
            return decision.verdict

        verdicts = Counter(
            await asyncio.gather(
                *(request(leased[i % processes], rng.choice([0, 1, 3, 30])) for i in range(offered))
            )
        )
        for process in leased:
            await process.flush()
        threshold = sum(1 for k in range(1, limit + 1) if k <= degrade_at * limit)
        served = verdicts[BudgetVerdict.ALLOW] + verdicts[BudgetVerdict.DEGRADE]
        if processes == 1:
            assert verdicts[BudgetVerdict.ALLOW] == min(offered, threshold)
            assert served == min(offered, limit)
        else:
            slack = (processes - 1) * (limit // QUOTA_SHARE)
            assert min(offered, limit) - slack <= served <= limit
            assert verdicts[BudgetVerdict.ALLOW] <= threshold
        usage = await store.usage("s")
        assert (usage.calls, usage.reserved_calls) == (served, 0)

    asyncio.run(run())
