"""A store that stops or stalls degrades the fleet as documented, and never into a 500.

The replicas reach Redis and Postgres through TCP proxies this module controls, so an outage is
simulated without touching the shared servers: ``stop()`` closes the proxy (connections reset,
new ones refused), ``stall()`` keeps accepting and forwards nothing.

Documented behaviour under test (docs/state.md, "When a store misbehaves"): the rate limit fails
open to a per-process bucket, the cache and the single-flight fail open, a budget kept in Redis
fails closed (503 with Retry-After), idempotency kept in Postgres fails closed; readiness follows
the durable store only; each failure is counted in ``tidegate_store_errors_total``.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fleet.conftest import Services
from tests.fleet.harness import (
    CLOCK,
    Fleet,
    TcpProxy,
    UpstreamServer,
    base_config,
    chat,
    metric,
    running_fleet,
    served_by,
    shared_state,
)

pytestmark = pytest.mark.slow

#: The outage fleet's per-user limit: small, so the per-process fallback shows.
LOCAL_BURST = 5
STORE_ERRORS = "tidegate_store_errors_total"


@pytest.fixture(scope="module")
def redis_proxy(services: Services) -> Iterator[TcpProxy]:
    with TcpProxy.to(services.redis_url) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def postgres_proxy(services: Services) -> Iterator[TcpProxy]:
    with TcpProxy.to(services.postgres_url) as proxy:
        yield proxy


def proxied_fleet(
    workdir: Path,
    services: Services,
    upstream: UpstreamServer,
    nginx: str,
    *,
    redis_proxy: TcpProxy,
    postgres_proxy: TcpProxy | None,
    **sections: Any,
) -> Iterator[Fleet]:
    with shared_state(services.redis_url, services.postgres_url) as state:
        durable = state.durable_url
        if postgres_proxy is not None:
            durable = postgres_proxy.url_through(durable)
        config = base_config(
            durable=durable, fast=redis_proxy.url_through(state.fast_url), upstream=upstream.url
        )
        config.update(sections)
        with running_fleet(workdir, config, nginx=nginx) as fleet:
            yield fleet


@pytest.fixture(scope="module")
def outage_fleet(
    nginx: str,
    services: Services,
    upstream_server: UpstreamServer,
    redis_proxy: TcpProxy,
    postgres_proxy: TcpProxy,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Fleet]:
    """Three replicas whose Redis and Postgres are both behind this module's proxies."""
    yield from proxied_fleet(
        tmp_path_factory.mktemp("outage-fleet"),
        services,
        upstream_server,
        nginx,
        redis_proxy=redis_proxy,
        postgres_proxy=postgres_proxy,
        rate_limits={"per_user": {"rate_per_s": 0.001, "burst": LOCAL_BURST}},
    )


@pytest.fixture(scope="module")
def budget_proxy(services: Services) -> Iterator[TcpProxy]:
    with TcpProxy.to(services.redis_url) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def budget_fleet(
    nginx: str,
    services: Services,
    upstream_server: UpstreamServer,
    budget_proxy: TcpProxy,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Fleet]:
    """Three replicas with a daily budget per user, kept in Redis (behind a proxy)."""
    yield from proxied_fleet(
        tmp_path_factory.mktemp("budget-fleet"),
        services,
        upstream_server,
        nginx,
        redis_proxy=budget_proxy,
        postgres_proxy=None,
        budgets={"calls": 1000},
        rate_limits={"per_user": {"rate_per_s": 100, "burst": 100}},
    )


async def post_many(
    fleet: Fleet, bodies: list[dict[str, Any]], headers: dict[str, str], path: str
) -> list[httpx.Response]:
    """Send ``bodies`` through nginx, six at a time."""
    gate = asyncio.Semaphore(6)

    async def one(client: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
        async with gate:
            return await client.post(path, json=body, headers=headers)

    async with httpx.AsyncClient(base_url=fleet.url, timeout=30.0) as client:
        return await asyncio.gather(*(one(client, body) for body in bodies))


async def store_errors(fleet: Fleet, **labels: str) -> list[float]:
    """Each replica's ``tidegate_store_errors_total`` matching ``labels``."""
    async with httpx.AsyncClient(timeout=10.0) as client:
        pages = [await client.get(f"{r.url}/metrics") for r in fleet.replicas]
    return [metric(page.text, STORE_ERRORS, **labels) for page in pages]


async def readiness(fleet: Fleet) -> list[int]:
    async with httpx.AsyncClient(timeout=10.0) as client:
        return [(await client.get(f"{r.url}/readyz")).status_code for r in fleet.replicas]


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 10.0) -> None:
    """Call ``await check()`` every 0.1 s until it is true; fail naming ``what`` if it never is."""
    deadline = CLOCK.now() + timeout_s
    while not await check():
        assert CLOCK.now() < deadline, f"{what} did not happen within {timeout_s:g} s"
        await CLOCK.asleep(0.1)


async def cache_works_again(fleet: Fleet, tag: str) -> None:
    """After a Redis outage: a repeated question is answered from the shared cache again."""
    auth = {"Authorization": f"Bearer {fleet.new_user()}"}
    body = chat(f"{tag} after the outage {secrets.token_hex(3)}")

    async def hit() -> bool:
        async with httpx.AsyncClient(base_url=fleet.url, timeout=10.0) as client:
            response = await client.post("/v1/chat/completions", json=body, headers=auth)
        assert response.status_code == 200, response.text
        cache: str = response.headers.get("x-tidegate-cache", "")
        return cache == "hit"

    await until(hit, "a cache hit through Redis")


@pytest.mark.asyncio
async def test_redis_stopped_requests_are_served_by_the_fail_open_rules(
    outage_fleet: Fleet, redis_proxy: TcpProxy, upstream: UpstreamServer
) -> None:
    """With Redis gone every replica still answers: the rate limit falls back to a bucket per
    process, the cache fails open, readiness holds, the store errors are counted, no 500."""
    fleet = outage_fleet
    tag = f"redis-stopped-{secrets.token_hex(4)}"
    auth = {"Authorization": f"Bearer {fleet.new_user()}"}
    buckets_before = await store_errors(fleet, store="buckets", action="fail_open")
    cache_before = await store_errors(fleet, store="cache", action="fail_open")
    redis_proxy.stop()
    try:
        bodies = [chat(f"{tag} question {i}") for i in range(8 * len(fleet.replicas))]
        responses = await post_many(fleet, bodies, auth, "/v1/chat/completions")
        ready = await readiness(fleet)
        buckets_after = await store_errors(fleet, store="buckets", action="fail_open")
        cache_after = await store_errors(fleet, store="cache", action="fail_open")
    finally:
        redis_proxy.restore()

    assert {r.status_code for r in responses} <= {200, 429}, [r.text for r in responses]
    seen = Counter(served_by(r) for r in responses)
    passed = Counter(served_by(r) for r in responses if r.status_code == 200)
    # The fallback is a real limit, one per process: each replica admits its own burst.
    assert passed == {port: min(LOCAL_BURST, count) for port, count in seen.items()}
    assert len(seen) == len(fleet.replicas)
    assert all(r.headers["x-tidegate-cache"] == "miss" for r in responses if r.status_code == 200)
    assert ready == [200] * len(fleet.replicas)
    assert all(a > b for a, b in zip(buckets_after, buckets_before, strict=True))
    assert all(a > b for a, b in zip(cache_after, cache_before, strict=True))
    await cache_works_again(fleet, tag)


@pytest.mark.asyncio
async def test_redis_stalled_requests_are_served_within_their_deadline(
    outage_fleet: Fleet, redis_proxy: TcpProxy, upstream: UpstreamServer
) -> None:
    """A Redis that accepts and never answers costs each store call its timeout, not the
    request: every request is answered 200 well within its deadline, and the errors counted."""
    fleet = outage_fleet
    tag = f"redis-stalled-{secrets.token_hex(4)}"
    auth = {"Authorization": f"Bearer {fleet.new_user()}"}
    before = await store_errors(fleet, store="buckets", action="fail_open")
    redis_proxy.stall()
    try:
        started = CLOCK.now()
        bodies = [chat(f"{tag} question {i}") for i in range(2 * len(fleet.replicas))]
        responses = await post_many(fleet, bodies, auth, "/v1/chat/completions")
        took = CLOCK.now() - started
        ready = await readiness(fleet)
        after = await store_errors(fleet, store="buckets", action="fail_open")
    finally:
        redis_proxy.restore()

    assert [r.status_code for r in responses] == [200] * len(bodies), [r.text for r in responses]
    assert took < float(fleet.config["server"]["request_timeout_s"])
    assert ready == [200] * len(fleet.replicas)
    assert all(a > b for a, b in zip(after, before, strict=True))
    await cache_works_again(fleet, tag)


async def timed_post(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[httpx.Response, float]:
    """The answer and how long it took."""
    started = CLOCK.now()
    response = await client.post(url, json=body, headers=headers)
    return response, CLOCK.now() - started


@pytest.mark.asyncio
async def test_postgres_stalled_idempotent_requests_get_503_and_others_continue(
    outage_fleet: Fleet, postgres_proxy: TcpProxy, upstream: UpstreamServer
) -> None:
    """With the durable store stalled, a request with an Idempotency-Key is refused 503 with
    Retry-After on every replica, within the store's timeout (never run unguarded, never held
    past its deadline); one without a key is answered; no 500."""
    fleet = outage_fleet
    tag = f"pg-stalled-{secrets.token_hex(4)}"
    # A caller each for the guarded and the plain requests: both spend rate-limit tokens.
    auth = {"Authorization": f"Bearer {fleet.new_user()}"}
    plain_auth = {"Authorization": f"Bearer {fleet.new_user()}"}
    before = await store_errors(fleet, store="idempotency", action="fail_closed")
    postgres_proxy.stall()
    try:
        async with httpx.AsyncClient(timeout=30.0) as client:
            # At once on every replica, so each meets the stall on a pooled connection.
            guarded = await asyncio.gather(
                *(
                    timed_post(
                        client,
                        f"{r.url}/v1/chat/completions",
                        chat(f"{tag} guarded {r.index}"),
                        {**auth, "Idempotency-Key": f"{tag}-{r.index}"},
                    )
                    for r in fleet.replicas
                )
            )
            plain = [
                await client.post(
                    f"{r.url}/v1/chat/completions",
                    json=chat(f"{tag} plain {r.index}"),
                    headers=plain_auth,
                )
                for r in fleet.replicas
            ]
        ready = await readiness(fleet)
        after = await store_errors(fleet, store="idempotency", action="fail_closed")
    finally:
        postgres_proxy.restore()

    for response, _ in guarded:
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "store_unavailable"
        assert int(response.headers["retry-after"]) >= 1
    assert [r.status_code for r in plain] == [200] * len(fleet.replicas), [r.text for r in plain]
    assert len(upstream.attempts(f"{tag} guarded")) == 0
    # Readiness follows the durable store: a replica without it says so.
    assert ready == [503] * len(fleet.replicas)
    assert all(a > b for a, b in zip(after, before, strict=True))
    # Refused within a few store timeouts (state.timeout_s), not after the request's deadline.
    bound = 4 * float(fleet.config["state"]["timeout_s"])
    assert [took <= bound for _, took in guarded] == [True] * len(guarded), [
        round(took, 2) for _, took in guarded
    ]

    async def guarded_again() -> bool:
        async with httpx.AsyncClient(base_url=fleet.url, timeout=10.0) as client:
            response = await client.post(
                "/v1/chat/completions",
                json=chat(f"{tag} after"),
                headers={**plain_auth, "Idempotency-Key": f"{tag}-after"},
            )
        assert response.status_code in (200, 503), response.text
        return response.status_code == 200

    await until(guarded_again, "an idempotent request answered after the stall")


@pytest.mark.asyncio
async def test_a_budget_in_redis_fails_closed_when_redis_stops(
    budget_fleet: Fleet, budget_proxy: TcpProxy, upstream: UpstreamServer
) -> None:
    """With budgets kept in a Redis that is gone, chat and embeddings (which spend the same
    budget) are refused 503 with Retry-After on every replica: money nobody can account for is
    not spent."""
    fleet = budget_fleet
    tag = f"budget-{secrets.token_hex(4)}"
    auth = {"Authorization": f"Bearer {fleet.new_user()}"}
    before = await store_errors(fleet, store="quotas", action="fail_closed")
    budget_proxy.stop()
    try:
        count = 2 * len(fleet.replicas)
        chats = await post_many(
            fleet, [chat(f"{tag} {i}") for i in range(count)], auth, "/v1/chat/completions"
        )
        embeddings = await post_many(
            fleet,
            [{"model": "chat", "input": f"{tag} {i}"} for i in range(count)],
            auth,
            "/v1/embeddings",
        )
        after = await store_errors(fleet, store="quotas", action="fail_closed")
    finally:
        budget_proxy.restore()

    for response in [*chats, *embeddings]:
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "store_unavailable"
        assert int(response.headers["retry-after"]) >= 1
    assert len({served_by(r) for r in chats}) == len(fleet.replicas)
    assert len(upstream.attempts(tag)) == 0  # nothing reached the upstream
    assert all(a > b for a, b in zip(after, before, strict=True))
