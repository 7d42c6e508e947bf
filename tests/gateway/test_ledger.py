"""The spend ledger end to end: rows per settled request, batches, shutdown, retention, the
admin API, and the daily budget's numbers agreeing with the ledger's."""

from __future__ import annotations

import asyncio
import csv
import hashlib
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from tests.gateway.conftest import AppFactory
from tests.gateway.harness import LOW_KEY, fake
from tidegate.cli import app as cli_app
from tidegate.clock import ManualClock, SystemClock
from tidegate.errors import StoreError
from tidegate.gateway.config import LedgerConfig
from tidegate.gateway.ledger import LedgerWriter
from tidegate.state.ledger import LedgerRow, MemoryLedgerStore, Settled, SpendGroup, row_of
from tidegate.state.url import store_from_url

#: Its ``asleep(0)`` lets the loop run one round (the writer's tasks), waiting for nothing.
LOOP_ROUND = SystemClock()
CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hello there, how much?"}]}
ADMIN = "tg-admin-key"


def priced(**sections: Any) -> dict[str, Any]:
    return {
        "providers": {"p": fake("a priced answer of some words", model="m-1")},
        "models": {"chat": {"providers": ["p"]}},
        "prices": {"m-1": {"input_per_1k": 0.5, "output_per_1k": 1.5}},
        **sections,
    }


async def all_rows(app: Any) -> list[LedgerRow]:
    await app.runtime.ledger.flush()
    rows: list[LedgerRow] = await app.runtime.stores.ledger.rows(0, 1e12)
    return rows


@pytest.mark.asyncio
async def test_the_budget_and_the_ledger_agree(gateway_client: AppFactory) -> None:
    """After a mix of requests (served, cached, replayed, refused by the upstream, streamed, and
    another user's), each user's billed calls, tokens and cost in the ledger are exactly the
    daily budget's recorded use."""
    config = priced(budgets={"calls": 1_000, "tokens": 10_000_000, "cost_usd": 1_000.0})
    async with gateway_client(config) as (client, app):
        for i in range(6):
            assert (
                await client.post("/v1/chat/completions", json={**CHAT, "user": str(i)})
            ).is_success
        assert (await client.post("/v1/chat/completions", json={**CHAT, "user": "0"})).headers[
            "x-tidegate-cache"
        ] == "hit"
        replay = {"Idempotency-Key": "k-1"}
        for _ in range(2):
            body = {**CHAT, "user": "idem", "stream": False}
            assert (await client.post("/v1/chat/completions", json=body, headers=replay)).is_success
        streamed = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert streamed.is_success
        unknown = await client.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
        assert unknown.status_code == 404
        other = {"Authorization": f"Bearer {LOW_KEY}"}
        for i in range(3):
            body = {**CHAT, "user": f"o{i}"}
            assert (await client.post("/v1/chat/completions", json=body, headers=other)).is_success

        rows = await all_rows(app)
        by_user = {g.key: g for g in await app.runtime.stores.ledger.summary("user", 0, 1e12)}
        for subject in ("t1:u1", "t2:u2"):
            usage = await app.runtime.stores.quotas.usage(subject)
            group = by_user[subject]
            assert (group.calls, group.tokens) == (usage.calls, usage.tokens), subject
            assert group.cost_usd == pytest.approx(usage.cost, rel=1e-12, abs=1e-12)
            assert usage.reserved_calls == 0
        assert by_user["t1:u1"].calls == 6 + 1 + 1 + 1  # the replay and the 404 are not billed
        assert by_user["t1:u1"].cost_usd > 0
        flags = {(r.cached, r.replayed, r.billed) for r in rows}
        assert (True, False, True) in flags  # the cache hit: billed, as the budget counts it
        assert (False, True, False) in flags  # the replay: refunded
        assert {r.key_id for r in rows} == {"test", "batch"}
        assert all(r.served_by == "p" for r in rows if r.billed and not r.cached)


@pytest.mark.asyncio
async def test_two_requests_with_one_request_id_are_two_rows(gateway_client: AppFactory) -> None:
    """A caller that sends the same X-Request-ID twice makes two billed calls: the ledger keeps
    both, as the budget counts both."""
    clock = ManualClock(0.0, wall_start=1_800_000_000.0)
    config = priced(budgets={"calls": 1_000})
    async with gateway_client(config, clock=clock, sleep=_never) as (client, app):
        for user in ("a", "b"):  # distinct bodies: the cache answers neither
            body = {**CHAT, "user": user}
            answer = await client.post(
                "/v1/chat/completions", json=body, headers={"X-Request-ID": "same-id"}
            )
            assert answer.headers["x-request-id"] == "same-id"
            clock.advance(0.01)
        rows = await all_rows(app)
        assert [r.request_id for r in rows] == ["same-id", "same-id"]
        usage = await app.runtime.stores.quotas.usage("t1:u1")
        assert usage.calls == 2 == sum(r.billed for r in rows)


@pytest.mark.asyncio
async def test_rows_wait_for_a_full_batch_or_the_timer(gateway_client: AppFactory) -> None:
    """A batch is written once it holds ``batch_rows`` rows; the rest ``flush_s`` later."""
    clock = ManualClock(0.0, wall_start=1_800_000_000.0)
    config = priced(ledger={"batch_rows": 3, "flush_s": 5.0})
    async with gateway_client(config, clock=clock, sleep=_never) as (client, app):
        store = app.runtime.stores.ledger
        for i in range(3):
            await client.post("/v1/chat/completions", json={**CHAT, "user": str(i)})
        for _ in range(5):
            await LOOP_ROUND.asleep(0)
        assert len(await store.rows(0, 1e12)) == 3
        await client.post("/v1/chat/completions", json={**CHAT, "user": "3"})
        for _ in range(5):
            await LOOP_ROUND.asleep(0)
        assert len(await store.rows(0, 1e12)) == 3
        assert app.runtime.ledger.buffered == 1
        assert {r.at for r in await store.rows(0, 1e12)} == {clock.wall()}


async def _never(seconds: float) -> None:
    await asyncio.Event().wait()


@pytest.mark.asyncio
async def test_the_timer_writes_a_partial_batch(gateway_client: AppFactory) -> None:
    clock = ManualClock(0.0, wall_start=1_800_000_000.0)
    async with gateway_client(priced(), clock=clock) as (client, app):
        await client.post("/v1/chat/completions", json=CHAT)
        for _ in range(10):  # the manual clock's sleep returns at once: the timer fires
            await LOOP_ROUND.asleep(0)
        assert app.runtime.ledger.buffered == 0
        assert len(await app.runtime.stores.ledger.rows(0, 1e12)) == 1


@pytest.mark.asyncio
async def test_shutdown_writes_what_is_buffered(gateway_client: AppFactory, tmp_path: Path) -> None:
    """SIGTERM's path (the lifespan's shutdown) writes the buffer before the store closes."""
    url = f"sqlite:///{tmp_path / 'state.db'}"
    config = priced(state={"url": url}, ledger={"flush_s": 3600.0})
    async with gateway_client(config, sleep=_never) as (client, app):
        for i in range(7):
            await client.post("/v1/chat/completions", json={**CHAT, "user": str(i)})
        assert app.runtime.ledger.buffered == 7
    async with await store_from_url(url, clock=ManualClock()) as stores:
        assert len(await stores.ledger.rows(0, 1e12)) == 7


@pytest.mark.asyncio
async def test_no_rows_when_the_ledger_is_off(gateway_client: AppFactory) -> None:
    async with gateway_client(priced(ledger={"enabled": False})) as (client, app):
        await client.post("/v1/chat/completions", json=CHAT)
        assert await all_rows(app) == []


class FlakyLedger(MemoryLedgerStore):
    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures
        self.purged: list[float] = []

    async def append(self, settled: Sequence[Settled]) -> None:
        if self.failures:
            self.failures -= 1
            raise StoreError("the store is away")
        await super().append(settled)

    async def purge(self, before: float) -> int:
        self.purged.append(before)
        return await super().purge(before)


class _Ex:
    """What the writer reads of an exchange."""

    settling = True
    billed = True
    budget = ""
    cost = 0.5
    route, served_by, served_model, outcome, status, cache = "chat", "p", "m", "ok", 200, ""

    def __init__(self, identity: Any, request_id: str) -> None:
        self.identity = identity
        self.request_id = request_id


class _Identity:
    key_id, tenant, user = "k", "t", "u"


def fields(n: int) -> dict[str, Any]:
    return {
        "request_id": f"r{n}",
        "route": "chat",
        "served_by": "p",
        "model": "m",
        "prompt_tokens": 3,
        "completion_tokens": None,
        "outcome": "ok",
        "status": 200,
        "cache": None,
    }


@pytest.mark.asyncio
async def test_a_refused_batch_is_kept_and_written_later() -> None:
    clock = ManualClock(0.0, wall_start=1_800_000_000.0)
    store = FlakyLedger(failures=1)
    writer = LedgerWriter(store, LedgerConfig(flush_s=60.0), clock, _never)
    for n in range(3):
        writer.record(fields(n), _Ex(_Identity(), f"r{n}"))  # type: ignore[arg-type]
    assert await writer.flush() == 0
    assert writer.buffered == 3
    writer.record(fields(3), _Ex(_Identity(), "r3"))  # type: ignore[arg-type]
    await writer.close()
    assert [r.request_id for r in await store.rows(0, 1e12)] == ["r0", "r1", "r2", "r3"]
    assert (await store.rows(0, 1e12))[0].completion_tokens == 0


@pytest.mark.asyncio
async def test_the_writer_deletes_rows_past_their_retention() -> None:
    clock = ManualClock(0.0, wall_start=1_800_000_000.0)
    store = FlakyLedger(failures=0)
    old = ("old", clock.wall() - 8 * 86_400, "k", "t", "u", "c", "p", "m", 1, 1, 0.0,
           "ok", 200, True, "", None)  # fmt: skip
    await store.append([old])
    writer = LedgerWriter(store, LedgerConfig(retention_days=7), clock, _never)
    writer.record(fields(1), _Ex(_Identity(), "r1"))  # type: ignore[arg-type]
    await writer.flush()
    assert [r.request_id for r in await store.rows(0, 1e12)] == ["r1"]
    writer.record(fields(2), _Ex(_Identity(), "r2"))  # type: ignore[arg-type]
    await writer.flush()
    assert len(store.purged) == 1  # once an hour, not after every batch


def test_degraded_cached_and_replayed_flags() -> None:
    base = ("r", 1.0, "k", "t", "u", "c", "p", "m", None, None, 0.0, "ok", 200, True, "", None)
    assert not row_of(base).degraded
    assert row_of((*base[:14], "degraded", None)).degraded
    assert row_of((*base[:11], "degraded_corpus", *base[12:])).degraded
    assert row_of((*base[:15], "stale")).cached
    assert row_of((*base[:15], "idempotent-replay")).replayed


def admin_config(tmp_path: Path, **sections: Any) -> dict[str, Any]:
    digest = hashlib.sha256(ADMIN.encode()).hexdigest()
    (tmp_path / "admin.yaml").write_text(
        yaml.safe_dump({"keys": [{"id": "ops", "sha256": digest}]})
    )
    return priced(auth={"keys_file": "keys.yaml", "admin_keys_file": "admin.yaml"}, **sections)


@pytest.mark.asyncio
async def test_admin_spend_by_group_as_json_and_csv(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    config = admin_config(tmp_path, cache={"enabled": False})
    async with gateway_client(config) as (client, app):
        for i in range(3):
            await client.post("/v1/chat/completions", json={**CHAT, "user": str(i)})
        await app.runtime.ledger.flush()
        refused = await client.get("/admin/spend")
        assert refused.status_code == 401
        answer = (await client.get("/admin/spend?group_by=model", headers=admin)).json()
        assert [g["key"] for g in answer["groups"]] == ["m-1"]
        assert answer["total"]["calls"] == 3
        by_key = await client.get("/admin/spend?group_by=key&format=csv", headers=admin)
        assert by_key.headers["content-type"].startswith("text/csv")
        table = list(csv.DictReader(io.StringIO(by_key.text)))
        assert (table[0]["key"], table[0]["calls"]) == ("test", "3")
        rows = await client.get(
            "/admin/spend/rows?from=2000-01-01&to=2100-01-01&format=csv", headers=admin
        )
        assert len(list(csv.DictReader(io.StringIO(rows.text)))) == 3
        empty = await client.get("/admin/spend?from=2000-01-01&to=2000-01-02", headers=admin)
        assert empty.json()["groups"] == []
        bad = await client.get("/admin/spend?group_by=colour", headers=admin)
        assert bad.status_code == 400
        backwards = await client.get("/admin/spend?from=2001-01-01&to=2000-01-01", headers=admin)
        assert backwards.status_code == 400


@pytest.mark.asyncio
async def test_spend_command_reads_the_store(gateway_client: AppFactory, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    async with gateway_client(priced(state={"url": url})) as (client, _app):
        for i in range(2):
            await client.post("/v1/chat/completions", json={**CHAT, "user": str(i)})
    runner = CliRunner()
    args = ["spend", "--state-url", url, "--from", "2000-01-01", "--to", "2100-01-01"]
    result = await asyncio.to_thread(runner.invoke, cli_app, [*args, "--csv", "-g", "tenant"])
    assert result.exit_code == 0, result.output
    table = list(csv.DictReader(io.StringIO(result.output)))
    assert [(t["tenant"], t["calls"]) for t in table] == [("t1", "2")]
    shown = await asyncio.to_thread(runner.invoke, cli_app, args)
    assert shown.exit_code == 0
    assert "t1:u1" in shown.output
    rows = await asyncio.to_thread(runner.invoke, cli_app, [*args, "--rows", "--csv"])
    assert rows.exit_code == 0
    assert rows.output.count("\n") == 3
    wrong = await asyncio.to_thread(runner.invoke, cli_app, ["spend", "-g", "colour"])
    assert wrong.exit_code == 2


def test_spend_group_tokens() -> None:
    assert SpendGroup("k", 1, 1, 2, 3, 0.0).tokens == 5
