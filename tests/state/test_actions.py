"""Pending actions beyond the shared contract: validation, reporting, the SQLite table."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from tidegate.clock import ManualClock
from tidegate.state.actions import (
    ActionAlreadyDecided,
    ActionExpired,
    ActionStatus,
    MemoryPendingActionStore,
    PendingAction,
    SQLitePendingActionStore,
    as_seen_at,
    check_ttl,
    new_action_id,
    refusal,
)
from tidegate.state.sqlite import SQLiteDatabase

PENDING = PendingAction(
    id="a1",
    kind="refund",
    payload={},
    status=ActionStatus.PENDING,
    proposed_by="agent",
    created_at=100.0,
    expires_at=160.0,
)


@pytest.mark.parametrize("ttl", [0.0, -1.0, math.inf, math.nan])
def test_a_time_to_live_must_be_finite_and_positive(ttl: float) -> None:
    """An action that could never be decided, or never expire, is refused at proposal."""
    with pytest.raises(ValueError, match="ttl_s"):
        check_ttl(ttl)


def test_an_undecided_action_past_its_expiry_reads_as_expired() -> None:
    """Expiry is reported, never stored: pending until expires_at, expired from then on."""
    assert as_seen_at(PENDING, 159.9).status is ActionStatus.PENDING
    assert as_seen_at(PENDING, 160.0).status is ActionStatus.EXPIRED
    decided = replace(PENDING, status=ActionStatus.APPROVED)
    assert as_seen_at(decided, 1_000.0).status is ActionStatus.APPROVED


def test_a_refusal_says_why() -> None:
    """A decided action is refused as already decided, an expired one as expired."""
    assert isinstance(refusal(PENDING, 200.0), ActionExpired)
    decided = replace(PENDING, status=ActionStatus.REJECTED)
    refused = refusal(decided, 120.0)
    assert isinstance(refused, ActionAlreadyDecided)
    assert refused.action_id == "a1"
    assert "already rejected" in str(refused)


def test_action_ids_are_unguessable() -> None:
    """Ids carry 128 random bits and do not repeat."""
    ids = {new_action_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(len(i) == 32 for i in ids)


@pytest.mark.asyncio
async def test_the_memory_store_keeps_its_own_copy_of_the_payload() -> None:
    """Changing the caller's payload afterwards does not change the proposed action."""
    store = MemoryPendingActionStore(ManualClock())
    payload = {"order": 1}
    action = await store.propose("refund", payload, ttl_s=60, proposed_by="agent")
    payload["order"] = 2
    stored = await store.get(action.id)
    assert stored is not None
    assert stored.payload == {"order": 1}


@pytest.mark.asyncio
async def test_sqlite_actions_survive_a_restart(tmp_path: Path) -> None:
    """The table is added once to the shared file; a decision made before a restart is kept."""
    clock = ManualClock(0.0, wall_start=1_000.0)
    db = SQLiteDatabase(tmp_path / "s.db")
    store = SQLitePendingActionStore(db, clock)
    action = await store.propose("refund", {"order": 7}, ttl_s=60, proposed_by="agent")
    approved = await store.approve(action.id, "ana")
    db.close()
    reopened = SQLiteDatabase(tmp_path / "s.db")
    again = SQLitePendingActionStore(reopened, clock)
    assert await again.get(action.id) == approved
    with pytest.raises(ActionAlreadyDecided):
        await again.reject(action.id, "ben")
    reopened.close()
