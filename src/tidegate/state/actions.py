"""Pending actions: a durable record of an action that waits for a human to confirm it.

An operator (or an agent) *proposes* an action with a time to live; someone then *approves* or
*rejects* it exactly once. The decision is one conditional write in the store (``UPDATE ... WHERE
status = 'pending' AND expires_at > now``, or the same test inside one Lua script), so two replicas
that receive the same click at the same moment cannot both act on it: one gets the decided action,
the other :class:`ActionAlreadyDecided`. An action nobody decided in time is refused with
:class:`ActionExpired`.

This module holds the protocol, the values, the errors and two implementations: in memory and in
the SQLite file of :class:`~tidegate.state.sqlite.SQLiteDatabase`. The SQLite table is created
here, by its own forward-only migration, so the shared file gains it without a change to the core
schema. Redis and Postgres implementations live beside their other stores.
"""

from __future__ import annotations

import math
import secrets
import sqlite3
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, Protocol

import orjson

from tidegate.clock import Clock
from tidegate.state.sqlite import SQLiteDatabase

__all__ = [
    "ActionAlreadyDecided",
    "ActionError",
    "ActionExpired",
    "ActionNotFound",
    "ActionStatus",
    "MemoryPendingActionStore",
    "PendingAction",
    "PendingActionStore",
    "SQLitePendingActionStore",
    "as_seen_at",
    "check_ttl",
    "new_action_id",
    "refusal",
]


class ActionStatus(StrEnum):
    PENDING = "pending"  # waiting for a decision
    APPROVED = "approved"
    REJECTED = "rejected"
    EXPIRED = "expired"  # nobody decided before expires_at; never stored, only reported


@dataclass(frozen=True, slots=True, kw_only=True)
class PendingAction:
    """One proposed action and, once made, its decision. Times are Unix seconds."""

    id: str
    kind: str
    payload: dict[str, Any]
    status: ActionStatus
    proposed_by: str
    created_at: float
    expires_at: float
    decided_by: str | None = None
    decided_at: float | None = None


class ActionError(Exception):
    """A decision could not be made; ``action_id`` names the action.

    These are not :class:`~tidegate.errors.TidegateError`\\ s on purpose: each would need its own
    row in the error table. The admin API maps them: not found 404, already decided 409, expired
    410.
    """

    def __init__(self, message: str, *, action_id: str) -> None:
        super().__init__(message)
        self.action_id = action_id


class ActionNotFound(ActionError):
    """No action has this id (or it was forgotten long after it expired)."""


class ActionAlreadyDecided(ActionError):
    """The action was approved or rejected before; ``action`` is it, as decided."""

    def __init__(self, action: PendingAction) -> None:
        super().__init__(
            f"action {action.id} is already {action.status.value}", action_id=action.id
        )
        self.action = action


class ActionExpired(ActionError):
    """Nobody decided the action before it expired; it can no longer be approved."""

    def __init__(self, action: PendingAction) -> None:
        super().__init__(f"action {action.id} expired undecided", action_id=action.id)
        self.action = action


class PendingActionStore(Protocol):
    async def propose(
        self, kind: str, payload: dict[str, Any], *, ttl_s: float, proposed_by: str
    ) -> PendingAction:
        """Record a new pending action that may be decided for ``ttl_s`` seconds."""
        ...

    async def approve(self, action_id: str, who: str) -> PendingAction:
        """Approve a pending action exactly once, or raise an :class:`ActionError`."""
        ...

    async def reject(self, action_id: str, who: str) -> PendingAction:
        """Reject a pending action exactly once, or raise an :class:`ActionError`."""
        ...

    async def get(self, action_id: str) -> PendingAction | None:
        """The action as it stands (an undecided one past its expiry reads as expired)."""
        ...


def new_action_id() -> str:
    """A fresh, unguessable action id (it ends up in URLs an operator clicks)."""
    return secrets.token_hex(16)


def check_ttl(ttl_s: float) -> None:
    """Refuse a time to live that would make an action expire before anyone could see it."""
    if not (math.isfinite(ttl_s) and ttl_s > 0):
        raise ValueError(f"ttl_s must be a finite number > 0, got {ttl_s!r}")


def as_seen_at(action: PendingAction, now: float) -> PendingAction:
    """``action`` as reported at ``now``: undecided past its expiry means expired."""
    if action.status is ActionStatus.PENDING and action.expires_at <= now:
        return replace(action, status=ActionStatus.EXPIRED)
    return action


def refusal(action: PendingAction, now: float) -> ActionError:
    """Why ``action`` cannot be decided at ``now``."""
    seen = as_seen_at(action, now)
    if seen.status is ActionStatus.EXPIRED:
        return ActionExpired(seen)
    return ActionAlreadyDecided(seen)


class MemoryPendingActionStore:
    """Pending actions in a dict: for tests and a single process."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._actions: dict[str, PendingAction] = {}

    async def propose(
        self, kind: str, payload: dict[str, Any], *, ttl_s: float, proposed_by: str
    ) -> PendingAction:
        check_ttl(ttl_s)
        now = self._clock.wall()
        action = PendingAction(
            id=new_action_id(),
            kind=kind,
            payload=orjson.loads(orjson.dumps(payload)),  # a private copy, as a store would keep
            status=ActionStatus.PENDING,
            proposed_by=proposed_by,
            created_at=now,
            expires_at=now + ttl_s,
        )
        self._actions[action.id] = action
        return action

    def _decide(self, action_id: str, who: str, status: ActionStatus) -> PendingAction:
        now = self._clock.wall()
        action = self._actions.get(action_id)
        if action is None:
            raise ActionNotFound(f"no action {action_id}", action_id=action_id)
        if action.status is not ActionStatus.PENDING or action.expires_at <= now:
            raise refusal(action, now)
        decided = replace(action, status=status, decided_by=who, decided_at=now)
        self._actions[action_id] = decided
        return decided

    async def approve(self, action_id: str, who: str) -> PendingAction:
        return self._decide(action_id, who, ActionStatus.APPROVED)

    async def reject(self, action_id: str, who: str) -> PendingAction:
        return self._decide(action_id, who, ActionStatus.REJECTED)

    async def get(self, action_id: str) -> PendingAction | None:
        action = self._actions.get(action_id)
        return None if action is None else as_seen_at(action, self._clock.wall())


_SQLITE_TABLE = """
CREATE TABLE IF NOT EXISTS pending_actions (
    id TEXT PRIMARY KEY, kind TEXT NOT NULL, payload BLOB NOT NULL, status TEXT NOT NULL,
    proposed_by TEXT NOT NULL, created_at REAL NOT NULL, expires_at REAL NOT NULL,
    decided_by TEXT, decided_at REAL)
"""

_SQLITE_COLUMNS = (
    "id, kind, payload, status, proposed_by, created_at, expires_at, decided_by, decided_at"
)


def _from_sqlite(row: tuple[Any, ...]) -> PendingAction:
    return PendingAction(
        id=row[0],
        kind=row[1],
        payload=orjson.loads(row[2]),
        status=ActionStatus(row[3]),
        proposed_by=row[4],
        created_at=row[5],
        expires_at=row[6],
        decided_by=row[7],
        decided_at=row[8],
    )


class SQLitePendingActionStore:
    """Pending actions in the shared SQLite file; the table is added on first use.

    ``CREATE TABLE IF NOT EXISTS`` is this table's forward-only migration: it never alters a table
    that exists, and it runs inside the database's write lock, so processes opening the file
    together cannot race.
    """

    def __init__(self, db: SQLiteDatabase, clock: Clock) -> None:
        self._db = db
        self._clock = clock
        db.run(lambda conn: conn.execute(_SQLITE_TABLE))

    async def propose(
        self, kind: str, payload: dict[str, Any], *, ttl_s: float, proposed_by: str
    ) -> PendingAction:
        check_ttl(ttl_s)
        now = self._clock.wall()
        action = PendingAction(
            id=new_action_id(),
            kind=kind,
            payload=payload,
            status=ActionStatus.PENDING,
            proposed_by=proposed_by,
            created_at=now,
            expires_at=now + ttl_s,
        )
        blob = orjson.dumps(payload)
        self._db.run(
            lambda conn: conn.execute(
                f"INSERT INTO pending_actions ({_SQLITE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (action.id, kind, blob, "pending", proposed_by, now, action.expires_at, None, None),
            )
        )
        return replace(action, payload=orjson.loads(blob))

    def _decide(self, action_id: str, who: str, status: ActionStatus) -> PendingAction:
        now = self._clock.wall()

        def work(conn: sqlite3.Connection) -> PendingAction:
            row = conn.execute(
                "UPDATE pending_actions SET status = ?, decided_by = ?, decided_at = ?"
                " WHERE id = ? AND status = 'pending' AND expires_at > ?"
                f" RETURNING {_SQLITE_COLUMNS}",
                (status.value, who, now, action_id, now),
            ).fetchone()
            if row is not None:
                return _from_sqlite(row)
            found = conn.execute(
                f"SELECT {_SQLITE_COLUMNS} FROM pending_actions WHERE id = ?", (action_id,)
            ).fetchone()
            if found is None:
                raise ActionNotFound(f"no action {action_id}", action_id=action_id)
            raise refusal(_from_sqlite(found), now)

        return self._db.run(work)

    async def approve(self, action_id: str, who: str) -> PendingAction:
        return self._decide(action_id, who, ActionStatus.APPROVED)

    async def reject(self, action_id: str, who: str) -> PendingAction:
        return self._decide(action_id, who, ActionStatus.REJECTED)

    async def get(self, action_id: str) -> PendingAction | None:
        now = self._clock.wall()
        row = self._db.run(
            lambda conn: conn.execute(
                f"SELECT {_SQLITE_COLUMNS} FROM pending_actions WHERE id = ?", (action_id,)
            ).fetchone()
        )
        return None if row is None else as_seen_at(_from_sqlite(row), now)
