"""One contract, run against every store backend through the ``backend`` fixture."""

from __future__ import annotations

import pytest

from tests.state.conftest import Backend
from tidegate.policy.budget import BudgetOptions, BudgetVerdict, Cost, Quota
from tidegate.policy.ratelimit import BucketOptions
from tidegate.state.base import ClaimOutcome, StoredResponse

pytestmark = pytest.mark.asyncio

ANSWER = StoredResponse(200, b'{"ok": true}', {"content-type": "application/json"})


async def test_first_claim_wins_and_a_repeat_sees_in_progress(backend: Backend) -> None:
    """The first claim runs the request; a second claim with the same body waits."""
    first = await backend.idempotency.claim("k", "fp", lease_s=30)
    assert first.outcome is ClaimOutcome.CLAIMED
    second = await backend.idempotency.claim("k", "fp", lease_s=30)
    assert second.outcome is ClaimOutcome.IN_PROGRESS


async def test_completed_key_replays_the_stored_response(backend: Backend) -> None:
    """After complete(), the same key and body get the stored answer back, byte for byte."""
    claim = await backend.idempotency.claim("k", "fp", lease_s=30)
    assert await backend.idempotency.complete("k", claim.token, ANSWER, ttl_s=60)
    again = await backend.idempotency.claim("k", "fp", lease_s=30)
    assert again.outcome is ClaimOutcome.REPLAY
    assert again.response == ANSWER


async def test_same_key_other_body_is_a_mismatch(backend: Backend) -> None:
    """A key reused with a different fingerprint is refused, running or done."""
    claim = await backend.idempotency.claim("k", "fp", lease_s=30)
    assert (
        await backend.idempotency.claim("k", "other", lease_s=30)
    ).outcome is ClaimOutcome.MISMATCH
    await backend.idempotency.complete("k", claim.token, ANSWER, ttl_s=60)
    assert (
        await backend.idempotency.claim("k", "other", lease_s=30)
    ).outcome is ClaimOutcome.MISMATCH


async def test_abandoned_key_may_run_again(backend: Backend) -> None:
    """A failed attempt abandons its key so that a retry can claim it."""
    claim = await backend.idempotency.claim("k", "fp", lease_s=30)
    assert await backend.idempotency.abandon("k", claim.token)
    assert (await backend.idempotency.claim("k", "fp", lease_s=30)).outcome is ClaimOutcome.CLAIMED


async def test_only_the_holder_can_complete_or_abandon(backend: Backend) -> None:
    """A stale or foreign token changes nothing."""
    claim = await backend.idempotency.claim("k", "fp", lease_s=30)
    assert not await backend.idempotency.complete("k", "not-the-token", ANSWER, ttl_s=60)
    assert not await backend.idempotency.abandon("k", "not-the-token")
    assert await backend.idempotency.complete("k", claim.token, ANSWER, ttl_s=60)
    assert not await backend.idempotency.abandon("k", claim.token)


async def test_a_lapsed_lease_frees_the_key(backend: Backend) -> None:
    """A claim whose holder died expires after its lease; its late completion is refused."""
    claim = await backend.idempotency.claim("k", "fp", lease_s=30)
    backend.clock.advance(30)
    retry = await backend.idempotency.claim("k", "fp", lease_s=30)
    assert retry.outcome is ClaimOutcome.CLAIMED
    assert not await backend.idempotency.complete("k", claim.token, ANSWER, ttl_s=60)


async def test_completed_keys_expire(backend: Backend) -> None:
    """A stored answer is replayed until its TTL, then the key is new again."""
    claim = await backend.idempotency.claim("k", "fp", lease_s=30)
    await backend.idempotency.complete("k", claim.token, ANSWER, ttl_s=60)
    backend.clock.advance(59.5)
    assert (await backend.idempotency.claim("k", "fp", lease_s=30)).outcome is ClaimOutcome.REPLAY
    backend.clock.advance(0.5)
    assert (await backend.idempotency.claim("k", "fp", lease_s=30)).outcome is ClaimOutcome.CLAIMED


async def test_cache_is_fresh_then_stale_then_gone(backend: Backend) -> None:
    """A fresh entry is served; a stale one only when asked for; an old one not at all."""
    await backend.cache.put("q", b"answer", ttl_s=10, stale_ttl_s=100)
    entry = await backend.cache.get("q")
    assert entry is not None
    assert (entry.value, entry.fresh, entry.stored_at) == (b"answer", True, 1_000_000.0)
    backend.clock.advance(10)
    assert await backend.cache.get("q") is None
    stale = await backend.cache.get("q", allow_stale=True)
    assert stale is not None
    assert not stale.fresh
    backend.clock.advance(100)
    assert await backend.cache.get("q", allow_stale=True) is None


async def test_cache_miss_is_none(backend: Backend) -> None:
    """An unknown key is a miss."""
    assert await backend.cache.get("nothing", allow_stale=True) is None


async def test_flag_changes_are_audited(backend: Backend) -> None:
    """set() changes the value and records old, new, who, why and when, newest first."""
    first = await backend.flags.set("answer.mode", "unavailable", who="oncall", why="provider down")
    assert (first.old, first.new, first.at) == (None, "unavailable", 1_000_000.0)
    backend.clock.advance(5)
    await backend.flags.set("answer.mode", "full", who="oncall", why="recovered")
    await backend.flags.set("canary.share", 0.25, who="rollout", why="step")
    assert await backend.flags.values() == {"answer.mode": "full", "canary.share": 0.25}
    history = await backend.flags.history("answer.mode")
    assert [(r.old, r.new, r.who, r.why, r.at) for r in history] == [
        ("unavailable", "full", "oncall", "recovered", 1_000_005.0),
        (None, "unavailable", "oncall", "provider down", 1_000_000.0),
    ]
    assert len(await backend.flags.history(limit=2)) == 2


BUCKET = BucketOptions(rate=2.0, burst=3.0)


async def test_bucket_allows_its_burst_then_refuses_with_a_wait(backend: Backend) -> None:
    """Three takes pass, the fourth is refused with the refill time; refill lets one more in."""
    results = [await backend.buckets.take("u", BUCKET) for _ in range(4)]
    assert [r.allowed for r in results] == [True, True, True, False]
    assert results[3].retry_after == 0.5
    backend.clock.advance(0.5)
    assert (await backend.buckets.take("u", BUCKET)).allowed
    assert (await backend.buckets.take("other", BUCKET)).allowed


QUOTA = BudgetOptions(quota=Quota(calls=5, tokens=1000), degrade_at=0.8)


async def test_budget_degrades_then_blocks_until_midnight(backend: Backend) -> None:
    """Calls 1-4 are allowed, the 5th degrades, the 6th blocks until the next UTC midnight."""
    verdicts = []
    for _ in range(6):
        reservation, decision = await backend.quotas.reserve("u", QUOTA, Cost(calls=1, tokens=10))
        verdicts.append(decision.verdict)
        if reservation is not None:
            assert await backend.quotas.settle(reservation, Cost(calls=1, tokens=10))
    assert verdicts == [BudgetVerdict.ALLOW] * 4 + [BudgetVerdict.DEGRADE, BudgetVerdict.BLOCK]
    _, blocked = await backend.quotas.reserve("u", QUOTA, Cost(calls=1))
    assert blocked.retry_after == 86_400 - (1_000_000.0 % 86_400)
    usage = await backend.quotas.usage("u")
    assert (usage.calls, usage.tokens, usage.reserved_calls) == (5, 50, 0)


async def test_budget_settles_and_refunds_once(backend: Backend) -> None:
    """A reservation closes once: a second settle or a refund after it changes nothing."""
    reservation, _ = await backend.quotas.reserve("u", QUOTA, Cost(calls=1, tokens=100))
    assert reservation is not None
    assert (await backend.quotas.usage("u")).reserved_tokens == 100
    assert await backend.quotas.refund(reservation)
    assert not await backend.quotas.settle(reservation, Cost(calls=1, tokens=100))
    assert not await backend.quotas.refund(reservation)
    usage = await backend.quotas.usage("u")
    assert (usage.calls, usage.tokens, usage.reserved_tokens) == (0, 0, 0)


async def test_budget_resets_on_a_new_day(backend: Backend) -> None:
    """Yesterday's use does not count today."""
    for _ in range(5):
        reservation, _ = await backend.quotas.reserve("u", QUOTA, Cost(calls=1))
        assert reservation is not None
        await backend.quotas.settle(reservation, Cost(calls=1))
    backend.clock.advance(86_400)
    _, decision = await backend.quotas.reserve("u", QUOTA, Cost(calls=1))
    assert decision.verdict is BudgetVerdict.ALLOW
