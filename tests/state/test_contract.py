"""One contract, run against every store backend through the ``backend`` fixture."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.state.conftest import Backend
from tidegate.policy.budget import (
    BudgetOptions,
    BudgetVerdict,
    Cost,
    Quota,
    Reservation,
    Usage,
    day_number,
    rollover,
)
from tidegate.policy.budget import rebase as budget_rebase
from tidegate.policy.budget import refund as budget_refund
from tidegate.policy.budget import reserve as budget_reserve
from tidegate.policy.budget import settle as budget_settle
from tidegate.policy.ratelimit import BucketOptions, BucketState, full_bucket, give_back, take
from tidegate.state.actions import (
    ActionAlreadyDecided,
    ActionExpired,
    ActionNotFound,
    ActionStatus,
    PendingAction,
)
from tidegate.state.base import ClaimOutcome, StoredResponse
from tidegate.state.rollout import RolloutRecord, VersionConflict

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


async def test_tokens_given_back_refill_the_bucket_up_to_its_burst(backend: Backend) -> None:
    """Tokens given back are takeable again, but never fill the bucket past its burst."""
    assert all([(await backend.buckets.take("u", BUCKET)).allowed for _ in range(3)])
    await backend.buckets.give_back("u", BUCKET, 2.0)
    results = [await backend.buckets.take("u", BUCKET) for _ in range(3)]
    assert [r.allowed for r in results] == [True, True, False]
    await backend.buckets.give_back("u", BUCKET, 10.0)
    assert sum([(await backend.buckets.take("u", BUCKET)).allowed for _ in range(5)]) == 3


async def test_a_rebase_settles_the_use_and_keeps_the_rest_open(backend: Backend) -> None:
    """A rebase records the use at once and leaves the reservation open for the amount kept,
    which then closes exactly once; a reservation that is not open cannot be rebased."""
    reservation, _ = await backend.quotas.reserve("u", QUOTA, Cost(calls=4, tokens=400))
    assert reservation is not None
    kept = await backend.quotas.rebase(
        reservation, Cost(calls=3, tokens=250), Cost(calls=1, tokens=100)
    )
    assert kept is not None
    assert (kept.id, kept.amount) == (reservation.id, Cost(calls=1, tokens=100))
    usage = await backend.quotas.usage("u")
    assert (usage.calls, usage.tokens, usage.reserved_calls, usage.reserved_tokens) == (
        3,
        250,
        1,
        100,
    )
    assert await backend.quotas.settle(kept, Cost(calls=1, tokens=90))
    assert not await backend.quotas.refund(kept)
    assert await backend.quotas.rebase(kept, Cost(calls=1), Cost(calls=0)) is None
    usage = await backend.quotas.usage("u")
    assert (usage.calls, usage.tokens, usage.reserved_calls, usage.reserved_tokens) == (
        4,
        340,
        0,
        0,
    )


async def test_budget_resets_on_a_new_day(backend: Backend) -> None:
    """Yesterday's use does not count today."""
    for _ in range(5):
        reservation, _ = await backend.quotas.reserve("u", QUOTA, Cost(calls=1))
        assert reservation is not None
        await backend.quotas.settle(reservation, Cost(calls=1))
    backend.clock.advance(86_400)
    _, decision = await backend.quotas.reserve("u", QUOTA, Cost(calls=1))
    assert decision.verdict is BudgetVerdict.ALLOW


# --------------------------------------------------------------------------- races


async def test_concurrent_claims_of_one_key_have_one_winner(backend: Backend) -> None:
    """Fifty claims of one key at once, from five connections, produce exactly one CLAIMED."""
    replicas = [await backend.replica() for _ in range(5)]
    claims = await asyncio.gather(
        *(r.idempotency.claim("k", "fp", lease_s=30) for r in replicas for _ in range(10))
    )
    outcomes = Counter(claim.outcome for claim in claims)
    assert outcomes == {ClaimOutcome.CLAIMED: 1, ClaimOutcome.IN_PROGRESS: 49}


async def test_concurrent_takes_admit_exactly_the_burst(backend: Backend) -> None:
    """Two hundred takes at once from a bucket of 10 that barely refills admit exactly 10."""
    options = BucketOptions(rate=0.001, burst=10.0)
    replicas = [await backend.replica() for _ in range(4)]
    results = await asyncio.gather(
        *(r.buckets.take("u", options) for r in replicas for _ in range(50))
    )
    assert sum(result.allowed for result in results) == 10


async def test_concurrent_reservations_never_pass_the_quota(backend: Backend) -> None:
    """Forty reservations at once against a quota of 10 calls hold exactly 10."""
    options = BudgetOptions(quota=Quota(calls=10))
    replicas = [await backend.replica() for _ in range(4)]
    answers = await asyncio.gather(
        *(r.quotas.reserve("u", options, Cost(calls=1)) for r in replicas for _ in range(10))
    )
    held = [reservation for reservation, _ in answers if reservation is not None]
    assert len(held) == 10
    assert len({reservation.id for reservation in held}) == 10
    assert (await backend.quotas.usage("u")).reserved_calls == 10


async def test_concurrent_settles_close_a_reservation_once(backend: Backend) -> None:
    """Ten settles of one reservation at once: one counts, the others change nothing."""
    reservation, _ = await backend.quotas.reserve("u", QUOTA, Cost(calls=1, tokens=10))
    assert reservation is not None
    replicas = [await backend.replica() for _ in range(2)]
    closed = await asyncio.gather(
        *(r.quotas.settle(reservation, Cost(calls=1, tokens=7)) for r in replicas for _ in range(5))
    )
    assert closed.count(True) == 1
    usage = await backend.quotas.usage("u")
    assert (usage.calls, usage.tokens, usage.reserved_calls, usage.reserved_tokens) == (1, 7, 0, 0)


async def test_concurrent_flag_changes_each_audit_the_value_they_replaced(
    backend: Backend,
) -> None:
    """Twenty changes of one flag at once form one chain: each record's old is the one before."""
    replicas = [await backend.replica() for _ in range(2)]
    await asyncio.gather(
        *(replicas[i % 2].flags.set("level", i, who=f"op{i}", why="race") for i in range(20))
    )
    history = list(reversed(await backend.flags.history("level")))
    assert len(history) == 20
    assert history[0].old is None
    assert all(later.old == earlier.new for earlier, later in itertools.pairwise(history))
    assert sorted(record.new for record in history) == list(range(20))
    assert await backend.flags.values() == {"level": history[-1].new}


async def test_concurrent_approvals_decide_once(backend: Backend) -> None:
    """An action approved from two connections at the same moment is approved exactly once."""
    action = await backend.actions.propose("refund", {"order": 42}, ttl_s=300, proposed_by="agent")
    first, second = await backend.replica(), await backend.replica()
    outcomes = await asyncio.gather(
        first.actions.approve(action.id, "ana"),
        second.actions.approve(action.id, "ben"),
        return_exceptions=True,
    )
    approved = [o for o in outcomes if isinstance(o, PendingAction)]
    refused = [o for o in outcomes if isinstance(o, ActionAlreadyDecided)]
    assert len(approved) == 1
    assert len(refused) == 1
    assert refused[0].action.decided_by == approved[0].decided_by
    stored = await backend.actions.get(action.id)
    assert stored == approved[0]


async def test_concurrent_rollout_writes_of_one_version_have_one_winner(
    backend: Backend,
) -> None:
    """Ten writers that read version 1 race to write: one wins, nine see a conflict."""
    await backend.rollout.put("canary", {"share": 0.01}, expected_version=0)
    replicas = [await backend.replica() for _ in range(2)]
    outcomes = await asyncio.gather(
        *(
            replicas[i % 2].rollout.put("canary", {"share": 0.05, "by": i}, expected_version=1)
            for i in range(10)
        ),
        return_exceptions=True,
    )
    assert sum(isinstance(o, RolloutRecord) for o in outcomes) == 1
    assert sum(isinstance(o, VersionConflict) for o in outcomes) == 9
    current = await backend.rollout.get("canary")
    assert current is not None
    assert current.version == 2


# --------------------------------------------------------------------------- pending actions


async def test_a_proposed_action_reads_back_pending(backend: Backend) -> None:
    """propose() records the action with its payload, proposer and expiry on the store's clock."""
    action = await backend.actions.propose(
        "refund", {"order": 42, "amount": 9.5}, ttl_s=300, proposed_by="agent"
    )
    assert action.status is ActionStatus.PENDING
    assert (action.created_at, action.expires_at) == (1_000_000.0, 1_000_300.0)
    assert await backend.actions.get(action.id) == action
    assert action.payload == {"order": 42, "amount": 9.5}
    assert (action.decided_by, action.decided_at) == (None, None)


async def test_an_action_is_decided_once(backend: Backend) -> None:
    """Approval records who and when; a second approval or a rejection after it is refused."""
    action = await backend.actions.propose("refund", {}, ttl_s=300, proposed_by="agent")
    backend.clock.advance(10)
    approved = await backend.actions.approve(action.id, "ana")
    assert (approved.status, approved.decided_by, approved.decided_at) == (
        ActionStatus.APPROVED,
        "ana",
        1_000_010.0,
    )
    with pytest.raises(ActionAlreadyDecided) as again:
        await backend.actions.approve(action.id, "ben")
    assert again.value.action == approved
    with pytest.raises(ActionAlreadyDecided):
        await backend.actions.reject(action.id, "ben")
    assert await backend.actions.get(action.id) == approved


async def test_a_rejected_action_cannot_be_approved(backend: Backend) -> None:
    """A rejection is final too."""
    action = await backend.actions.propose("refund", {}, ttl_s=300, proposed_by="agent")
    rejected = await backend.actions.reject(action.id, "ana")
    assert rejected.status is ActionStatus.REJECTED
    with pytest.raises(ActionAlreadyDecided):
        await backend.actions.approve(action.id, "ben")


async def test_an_expired_action_is_refused(backend: Backend) -> None:
    """Nobody may decide an action once its time to live is over; it reads as expired."""
    action = await backend.actions.propose("refund", {}, ttl_s=60, proposed_by="agent")
    backend.clock.advance(60)
    with pytest.raises(ActionExpired) as refused:
        await backend.actions.approve(action.id, "ana")
    assert refused.value.action.status is ActionStatus.EXPIRED
    seen = await backend.actions.get(action.id)
    assert seen is not None
    assert seen.status is ActionStatus.EXPIRED


async def test_an_unknown_action_is_not_found(backend: Backend) -> None:
    """Deciding an id nobody proposed is refused as not found; get() says None."""
    with pytest.raises(ActionNotFound):
        await backend.actions.approve("no-such-action", "ana")
    assert await backend.actions.get("no-such-action") is None


# --------------------------------------------------------------------------- rollout state


async def test_rollout_state_is_written_by_version(backend: Backend) -> None:
    """The first write needs version 0, each next one the version it read; a stale one conflicts."""
    assert await backend.rollout.get("canary") is None
    first = await backend.rollout.put("canary", {"share": 0.01}, expected_version=0)
    assert (first.version, first.value, first.updated_at) == (1, {"share": 0.01}, 1_000_000.0)
    backend.clock.advance(5)
    second = await backend.rollout.put("canary", {"share": 0.05}, expected_version=1)
    assert (second.version, second.updated_at) == (2, 1_000_005.0)
    with pytest.raises(VersionConflict) as stale:
        await backend.rollout.put("canary", {"share": 1.0}, expected_version=1)
    assert (stale.value.expected, stale.value.current) == (1, 2)
    with pytest.raises(VersionConflict):
        await backend.rollout.put("canary", {"share": 1.0}, expected_version=0)
    assert await backend.rollout.get("canary") == second


# --------------------------------------------------------------------------- exact arithmetic

_keys = itertools.count()

_bucket_steps = st.lists(
    st.tuples(
        st.floats(min_value=0.0, max_value=5.0, allow_nan=False),
        st.floats(min_value=0.0, max_value=4.0, allow_nan=False),
        st.booleans(),
    ),
    min_size=1,
    max_size=12,
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rate=st.floats(min_value=0.01, max_value=50.0, allow_nan=False),
    burst=st.floats(min_value=0.5, max_value=20.0, allow_nan=False),
    steps=_bucket_steps,
)
async def test_buckets_repeat_the_policy_arithmetic_exactly(
    backend: Backend, rate: float, burst: float, steps: list[tuple[float, float, bool]]
) -> None:
    """Every take and give-back agrees bit for bit with ratelimit.take and give_back on the same
    state and clock (a give-back is checked by the take that follows it)."""
    options = BucketOptions(rate=rate, burst=burst)
    key = f"prop-{next(_keys)}"
    state: BucketState | None = None
    for advance, n, giving in steps:
        backend.clock.advance(advance)
        now = backend.clock.wall()
        if giving:
            state = give_back(state or full_bucket(options, now), options, now, n)
            await backend.buckets.give_back(key, options, n)
            continue
        state, expected = take(state or full_bucket(options, now), options, now, n)
        assert await backend.buckets.take(key, options, n) == expected


_budget_steps = st.lists(
    st.tuples(
        st.sampled_from(["reserve", "settle", "refund", "rebase"]),
        st.floats(min_value=0.0, max_value=40_000.0, allow_nan=False),
        st.integers(min_value=0, max_value=3),
        st.integers(min_value=0, max_value=400),
        st.floats(min_value=0.0, max_value=3.0, allow_nan=False),
    ),
    min_size=1,
    max_size=12,
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    calls=st.none() | st.integers(min_value=0, max_value=8),
    tokens=st.none() | st.integers(min_value=0, max_value=1000),
    cost=st.none() | st.floats(min_value=0.0, max_value=6.0, allow_nan=False),
    degrade_at=st.floats(min_value=0.05, max_value=1.0, allow_nan=False),
    steps=_budget_steps,
)
async def test_budgets_repeat_the_policy_arithmetic_exactly(
    backend: Backend,
    calls: int | None,
    tokens: int | None,
    cost: float | None,
    degrade_at: float,
    steps: list[tuple[str, float, int, int, float]],
) -> None:
    """Reserve, settle, refund and rebase agree exactly with the pure budget functions, across
    midnights."""
    options = BudgetOptions(
        quota=Quota(calls=calls, tokens=tokens, cost=cost), degrade_at=degrade_at
    )
    subject = f"prop-{next(_keys)}"
    usage = Usage(day=day_number(backend.clock.wall()))
    open_: list[Reservation] = []
    for op, advance, n_calls, n_tokens, amount in steps:
        backend.clock.advance(advance)
        now = backend.clock.wall()
        usage = rollover(usage, now)
        spend = Cost(calls=n_calls, tokens=n_tokens, cost=amount)
        if op == "reserve" or not open_:
            usage, expected, decision = budget_reserve(usage, options, now, spend, subject=subject)
            reservation, got = await backend.quotas.reserve(subject, options, spend)
            assert got == decision
            assert (reservation is None) == (expected is None)
            if reservation is not None:
                assert replace(reservation, id="") == expected
                open_.append(reservation)
        else:
            reservation = open_.pop(0)
            if op == "rebase":
                keep = Cost(calls=n_calls // 2, tokens=n_tokens // 2, cost=amount / 2)
                usage = budget_rebase(usage, reservation, spend, keep)
                kept = await backend.quotas.rebase(reservation, spend, keep)
                closed = kept is not None
                if kept is not None:
                    assert replace(kept, amount=reservation.amount) == reservation
                    assert kept.amount == keep
                    open_.append(kept)
            elif op == "settle":
                usage = budget_settle(usage, reservation, spend)
                closed = await backend.quotas.settle(reservation, spend)
            else:
                usage = budget_refund(usage, reservation)
                closed = await backend.quotas.refund(reservation)
            # A past day's reservation changes nothing; a store may already have forgotten it.
            assert closed or reservation.day < usage.day
        assert await backend.quotas.usage(subject) == usage
