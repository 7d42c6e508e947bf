"""Step 7, cache and single-flight: an exact response cache keyed per tenant, and identical
in-flight requests sharing one upstream call.

A hit is answered at once (the call is skipped). A miss goes on; at the call, the first of
identical concurrent requests leads the upstream call and the others follow it: in this process
they await the leader's future, across replicas (a Redis store) the leader holds a lease in Redis
and the others read its result from there. Only the primary's answers are cached; fallback and
degraded answers never are. Streams are not cached.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson

from tidegate.errors import StoreError
from tidegate.gateway.auth import Identity
from tidegate.gateway.pipeline.answer import answer_json
from tidegate.gateway.pipeline.exchange import Exchange
from tidegate.gateway.pipeline.request import Request
from tidegate.gateway.pipeline.steps import Outcome
from tidegate.gateway.runtime import Flight

__all__ = ["cache_key", "canonical", "look_up", "put", "single_flight"]


def canonical(body: Mapping[str, Any]) -> bytes:
    """``body`` as JSON with sorted keys: equal requests, equal bytes."""
    return orjson.dumps(body, option=orjson.OPT_SORT_KEYS)


def cache_key(identity: Identity, alias: str, body: Mapping[str, Any]) -> str:
    """The cache key of ``body`` for ``alias`` (``route@version``), one key space per tenant."""
    keep = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "user")}
    keep["model"] = alias
    digest = hashlib.sha256(identity.tenant.encode() + b"\0" + canonical(keep)).hexdigest()
    return f"chat:{digest}"


def look_up(request: Request) -> Outcome:
    """A cacheable request answered from the cache (a hit), or marked a miss."""
    if not request.rt.config.cache.enabled or request.stream:
        return False
    return _look_up(request)


async def _look_up(request: Request) -> bool:
    rt, ex = request.rt, request.ex
    key = request.cache_key = cache_key(
        request.identity, f"{request.alias}@{ex.version}", request.body
    )
    try:
        entry = await rt.stores.cache.get(key)
    except StoreError:
        rt.metrics.store_errors.labels("cache", "fail_open").inc()
        entry = None
    rt.metrics.cache.labels("hit" if entry is not None else "miss").inc()
    if entry is None:
        ex.cache = "miss"
        return False
    ex.cache = "hit"
    await answer_json(request, entry.value)
    return True


async def put(request: Request, payload: bytes) -> None:
    """Keep the primary's answer under the request's key (a miss in the cache fails open)."""
    rt = request.rt
    config = rt.config.cache
    try:
        await rt.stores.cache.put(
            request.cache_key, payload, ttl_s=config.ttl_s, stale_ttl_s=config.stale_ttl_s
        )
    except StoreError:
        rt.metrics.store_errors.labels("cache", "fail_open").inc()


async def single_flight(request: Request, lead: Callable[[], Awaitable[Flight]]) -> bytes:
    """The answer of identical in-flight requests' one upstream call: ``lead()`` makes it
    (here, or through the fleet's flight), the others follow."""
    rt, ex, key = request.rt, request.ex, request.cache_key
    flights = rt.flights
    if key in flights:
        rt.metrics.single_flight.inc()
        async with asyncio.timeout(request.deadline.remaining()):
            flight = await asyncio.shield(flights[key])
        _follow(ex, flight)
        return flight[0]
    future: asyncio.Future[Flight] = asyncio.get_running_loop().create_future()
    flights[key] = future
    led = False

    async def leading() -> Flight:
        nonlocal led
        led = True
        return await lead()

    try:
        flight = await (_fleet_flight(request, leading) if rt.fleet_flight else leading())
        if not led:
            rt.metrics.single_flight.inc()
            _follow(ex, flight)
        future.set_result(flight)
        return flight[0]
    except BaseException as error:
        if not future.done():
            future.set_exception(
                error if isinstance(error, Exception) else asyncio.CancelledError()
            )
            future.exception()  # mark retrieved: followers may have gone
        raise
    finally:
        flights.pop(key, None)


def _follow(ex: Exchange, flight: Flight) -> None:
    _, ex.served_by, ex.served_model, ex.usage = flight
    ex.cache = "shared"
    ex.cost = 0.0  # the leader paid for it


async def _fleet_flight(request: Request, lead: Callable[[], Awaitable[Flight]]) -> Flight:
    """The cross-replica flight: the result travels through Redis as one small envelope."""
    rt = request.rt
    assert rt.fleet_flight is not None

    async def call() -> bytes:
        payload, served_by, served_model, usage = await lead()
        return orjson.dumps(
            {"body": payload.decode(), "by": served_by, "model": served_model, "usage": usage}
        )

    try:
        wait_s = request.deadline.remaining()
        envelope = orjson.loads(await rt.fleet_flight.run(request.cache_key, call, wait_s=wait_s))
    except StoreError:
        rt.metrics.store_errors.labels("single_flight", "fail_open").inc()
        return await lead()
    return envelope["body"].encode(), envelope["by"], envelope["model"], envelope["usage"]
