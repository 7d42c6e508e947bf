"""The request path's steps: the order stated once (the tuple, the package docstring and
docs/ARCHITECTURE.md agree), and each step run alone on a manual clock with ``memory://`` state."""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.gateway.harness import KEY, fake, write_config
from tidegate.clock import ManualClock
from tidegate.errors import (
    BudgetExceeded,
    CircuitOpen,
    Forbidden,
    InvalidRequest,
    ModelNotFound,
    RateLimited,
    Unavailable,
)
from tidegate.gateway import pipeline
from tidegate.gateway.config import load_config
from tidegate.gateway.pipeline import CHAT, EMBEDDINGS, Exchange, Request
from tidegate.gateway.pipeline.budget import reserve_chat
from tidegate.gateway.pipeline.flags import kill_switch
from tidegate.gateway.pipeline.identify import identify, identify_chat
from tidegate.gateway.pipeline.limits import rate_limit
from tidegate.gateway.pipeline.route import plan
from tidegate.gateway.pipeline.settle import settle_shielded
from tidegate.gateway.runtime import Runtime, build_runtime, close_runtime
from tidegate.policy.flags import ANSWER_MODE
from tidegate.state.base import DONE
from tidegate.state.leases import LeasedBuckets

DOCS = Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md"


def test_the_documented_order_is_the_tuple() -> None:
    """docs/ARCHITECTURE.md lists the chat steps in the tuple's order, by the tuple's names."""
    text = DOCS.read_text(encoding="utf-8")
    section = text[text.index("`POST /v1/chat/completions`:") :]
    listed = re.findall(r"^\d+\. \*\*`(\w+)`\*\*", section, re.MULTILINE)
    assert tuple(listed) == CHAT.names()


def test_the_package_docstring_states_the_same_order() -> None:
    """The package docstring's arrow line is the tuple's order."""
    assert pipeline.__doc__ is not None
    line = " ".join(pipeline.__doc__.split("\n\n")[2].split())
    assert tuple(line.split(" → ")) == CHAT.names()


def test_embeddings_are_the_chat_steps_less_what_they_do_not_need() -> None:
    """Embeddings run the chat steps in the same order, less those the docstring names."""
    skipped = {"version", "idempotency", "cache", "degrade"}
    assert EMBEDDINGS.names() == tuple(n for n in CHAT.names() if n not in skipped)
    assert pipeline.__doc__ is not None
    assert all(f"``{name}``" in pipeline.__doc__ for name in skipped)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("settings", "left_out"),
    [
        # No rate limit, budget, canary or cache: none of those steps can do anything.
        (
            {"rate_limits": {}, "cache": {"enabled": False}},
            {"rate_limit", "budget", "version", "cache"},
        ),
        # A rate limit alone keeps the budget step, which waits for its batch to be durable.
        (
            {
                "rate_limits": {"per_user": {"rate_per_s": 1, "burst": 5}},
                "cache": {"enabled": False},
            },
            {"version", "cache"},
        ),
        ({"budgets": {"calls": 3}, "rate_limits": {}}, {"rate_limit", "version"}),
        (
            {
                "rate_limits": {},
                "cache": {"enabled": False},
                "canary": {"salt": "s", "candidate": {"prompt_version": "v2"}},
            },
            {"rate_limit", "budget", "cache"},
        ),
    ],
)
async def test_a_runtime_runs_only_the_steps_its_config_needs(
    tmp_path: Path, settings: dict[str, Any], left_out: set[str]
) -> None:
    """Each endpoint of a runtime is its pipeline less the steps its config turns off, in the
    same order; the gateway serves those (``endpoints``)."""
    canary = settings.pop("canary", None)
    route: dict[str, Any] = {"providers": ["p"]}
    if canary is not None:
        route["canary"] = canary
    config = {"providers": {"p": fake()}, "models": {"chat": route}, **settings}
    path = write_config(tmp_path, config)
    rt = await build_runtime(load_config(path, env={}), path, clock=ManualClock(0.0))
    try:
        served = pipeline.endpoints(rt)
        chat = served["/v1/chat/completions"]
        embed = served["/v1/embeddings"]
        assert isinstance(chat, pipeline.Endpoint)
        assert isinstance(embed, pipeline.Endpoint)
        assert chat.pipeline.names() == tuple(n for n in CHAT.names() if n not in left_out)
        assert embed.pipeline.names() == tuple(n for n in EMBEDDINGS.names() if n not in left_out)
    finally:
        await close_runtime(rt)


# --------------------------------------------------------------------------- steps alone

CHAT_BODY = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}


@pytest_asyncio.fixture
async def runtime(tmp_path: Path) -> AsyncIterator[Runtime]:
    """A runtime on a manual clock with memory:// state, a per-user bucket of 2 and a daily
    budget of 3 calls; the fake provider never answers (no step here calls it)."""
    config = {
        "providers": {"p": {**fake(), "data_classes": ["internal"]}},
        "models": {"chat": {"providers": ["p"]}},
        "rate_limits": {"per_user": {"rate_per_s": 0.001, "burst": 2}},
        "budgets": {"calls": 3, "degrade_at": 1.0},
    }
    path = write_config(tmp_path, config)
    clock = ManualClock(0.0, wall_start=1_000_000.0)
    rt = await build_runtime(load_config(path, env={}), path, clock=clock, rng=random.Random(1))
    yield rt
    await close_runtime(rt)


def request_for(
    rt: Runtime, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None
) -> Request:
    ex = Exchange(request_id="r-1")
    all_headers = {"authorization": f"Bearer {KEY}", **(headers or {})}
    ex.identity = identify(rt, all_headers)

    async def send(message: Any) -> None:
        raise AssertionError("no step here answers")

    return Request(rt, ex, all_headers, dict(body or CHAT_BODY), send)


async def outcome(done: bool | Awaitable[bool]) -> bool:
    return done if isinstance(done, bool) else await done


@pytest.mark.asyncio
async def test_identify_checks_the_body_the_model_and_the_deadline(runtime: Runtime) -> None:
    """A known model goes on with its route and deadline; an unknown one is 404; a bad body or
    deadline header is 400."""
    request = request_for(runtime, headers={"x-tidegate-deadline-ms": "250"})
    assert identify_chat(request) is False
    assert request.route.alias == "chat"
    assert request.deadline.remaining() == 0.25
    with pytest.raises(ModelNotFound):
        identify_chat(request_for(runtime, {**CHAT_BODY, "model": "nope"}))
    with pytest.raises(InvalidRequest):
        identify_chat(request_for(runtime, {**CHAT_BODY, "messages": []}))
    with pytest.raises(InvalidRequest):
        identify_chat(request_for(runtime, headers={"x-tidegate-deadline-ms": "soon"}))


@pytest.mark.asyncio
async def test_flags_refuse_when_answering_is_switched_off(runtime: Runtime) -> None:
    """answer.mode=unavailable is an honest 503 before anything is spent; full goes on."""
    request = request_for(runtime)
    identify_chat(request)
    assert kill_switch(request) is False
    runtime.flags.set(ANSWER_MODE, "unavailable", who="test", why="drill")
    with pytest.raises(Unavailable):
        kill_switch(request)


@pytest.mark.asyncio
async def test_degraded_mode_with_nothing_to_offer_is_refused_before_the_budget(
    runtime: Runtime,
) -> None:
    """answer.mode=degraded without a corpus or cache: 503, and no budget was reserved."""
    runtime.flags.set(ANSWER_MODE, "degraded", who="test", why="drill")
    request = request_for(runtime)
    identify_chat(request)
    with pytest.raises(Unavailable):
        await outcome(kill_switch(request))
    assert request.reservation is None


@pytest.mark.asyncio
async def test_the_rate_limit_step_takes_one_token_per_request(runtime: Runtime) -> None:
    """Two requests pass a bucket of 2; the third is refused with its RateLimit headers."""
    for _ in range(2):
        request = request_for(runtime)
        identify_chat(request)
        assert await outcome(rate_limit(request)) is False
    request = request_for(runtime)
    identify_chat(request)
    with pytest.raises(RateLimited) as refused:
        await outcome(rate_limit(request))
    assert refused.value.headers["RateLimit-Policy"].startswith('"per-user"')


async def limited_requests(rt: Runtime, count: int) -> Request:
    """``count`` requests through the rate-limit step, each let through; the last one."""
    for _ in range(count):
        request = request_for(rt)
        identify_chat(request)
        assert await outcome(rate_limit(request)) is False
    return request


def count_store_takes(rt: Runtime) -> list[str]:
    """From now on, the key of every take that reaches the store behind the leases."""
    inner = rt.stores.buckets.store  # type: ignore[attr-defined]  # the leased store's
    takes: list[str] = []
    original = inner.take

    async def counted(key: str, *args: Any, **kwargs: Any) -> Any:
        takes.append(key)
        return await original(key, *args, **kwargs)

    inner.take = counted
    return takes


@pytest.mark.asyncio
async def test_the_rate_limit_step_draws_from_leases_without_a_coroutine(tmp_path: Path) -> None:
    """Once a key's demand has leased tokens (user and tenant), the step answers at once (False,
    not an awaitable) and the store is not asked; the store's bucket still counts every token
    this process took or holds."""
    limit = {"rate_per_s": 0.001, "burst": 1_000}
    config = {
        "providers": {"p": {**fake(), "data_classes": ["internal"]}},
        "models": {"chat": {"providers": ["p"]}},
        "rate_limits": {"per_user": limit, "per_tenant": limit},
    }
    path = write_config(tmp_path, config)
    rt = await build_runtime(load_config(path, env={}), path, clock=ManualClock(0.0))
    try:
        request = await limited_requests(rt, 64)  # demand within one window: leases form
        takes = count_store_takes(rt)
        for _ in range(3):
            request = request_for(rt)
            identify_chat(request)
            assert rate_limit(request) is False  # answered now: no coroutine to await
        assert takes == []
    finally:
        await close_runtime(rt)


@pytest.mark.asyncio
async def test_the_rate_limit_step_asks_the_store_from_the_first_level_no_lease_answers(
    tmp_path: Path,
) -> None:
    """The user's bucket leases (a large burst) and the tenant's never does (a burst too small
    to share out): while the user's lease holds tokens only the tenant's take reaches the store,
    which is asked for the tenant exactly once a request; the tenant's refusal is the answer."""
    config = {
        "providers": {"p": {**fake(), "data_classes": ["internal"]}},
        "models": {"chat": {"providers": ["p"]}},
        "rate_limits": {
            "per_user": {"rate_per_s": 0.001, "burst": 1_000},
            "per_tenant": {"rate_per_s": 0.001, "burst": 30},
        },
    }
    path = write_config(tmp_path, config)
    rt = await build_runtime(load_config(path, env={}), path, clock=ManualClock(0.0))
    try:
        request = await limited_requests(rt, 24)  # the user's demand: its lease forms
        takes = count_store_takes(rt)
        leased = rt.stores.buckets
        assert isinstance(leased, LeasedBuckets)
        drawn: list[str] = []  # every take asked of the user's and the tenant's leases
        draw = leased.take_now

        def counted_now(key: str, *args: Any, **kwargs: Any) -> Any:
            drawn.append(key)
            return draw(key, *args, **kwargs)

        leased.take_now = rt.stores.take_now = counted_now  # type: ignore[method-assign]
        identity = request.identity
        for _ in range(6):  # the tenant's last 6 tokens
            request = request_for(rt)
            identify_chat(request)
            assert await outcome(rate_limit(request)) is False
        assert takes.count(identity.tenant_bucket) == 6
        # A refill of the user's lease goes to the store too; most requests needed none.
        assert takes.count(identity.user_bucket) < 3
        assert set(takes) <= {identity.user_bucket, identity.tenant_bucket}
        # The user's token was taken once a request (asked again only by a refill), never twice.
        assert drawn.count(identity.user_bucket) == 6 + takes.count(identity.user_bucket)
        request = request_for(rt)
        identify_chat(request)
        with pytest.raises(RateLimited) as refused:
            await outcome(rate_limit(request))
        assert refused.value.headers["RateLimit-Policy"].startswith('"per-tenant"')
        assert takes.count(identity.tenant_bucket) == 7
    finally:
        await close_runtime(rt)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("user_burst", "tenant_burst", "binding"),
    [(1_000, 200, "per-tenant"), (150, 1_000, "per-user")],
)
async def test_the_rate_limit_step_passes_exactly_the_binding_burst_at_300_at_once(
    tmp_path: Path, user_burst: int, tenant_burst: int, binding: str
) -> None:
    """300 requests of one key through the step at once, on SQLite state, both buckets large
    enough to lease (and never refilling on the manual clock): exactly the smaller burst
    passes, the rest are refused by that level and no other, whichever level binds."""
    config = {
        "providers": {"p": {**fake(), "data_classes": ["internal"]}},
        "models": {"chat": {"providers": ["p"]}},
        "rate_limits": {
            "per_user": {"rate_per_s": 0.001, "burst": user_burst},
            "per_tenant": {"rate_per_s": 0.001, "burst": tenant_burst},
        },
        "state": {"url": f"sqlite:///{tmp_path / 'state.db'}"},
    }
    path = write_config(tmp_path, config)
    rt = await build_runtime(load_config(path, env={}), path, clock=ManualClock(0.0))

    async def one() -> str:
        request = request_for(rt)
        identify_chat(request)
        try:
            await outcome(rate_limit(request))
        except RateLimited as refused:
            return refused.headers["RateLimit-Policy"].split(";")[0].strip('"')
        return "passed"

    try:
        takes = count_store_takes(rt)
        answers = await asyncio.gather(*(one() for _ in range(300)))
        assert answers.count("passed") == min(user_burst, tenant_burst)
        assert set(answers) == {"passed", binding}
        # Leases engaged: without them every request would take from the store at least once.
        assert len(takes) < 300
    finally:
        await close_runtime(rt)


@pytest.mark.asyncio
async def test_the_budget_and_settle_steps_use_leases_without_a_coroutine(tmp_path: Path) -> None:
    """Once a subject's demand has leased budget, the budget step answers at once (False, not
    an awaitable) and the settlement is done when asked (the ready DONE), with no store call;
    the store still records every call served once the leases retire."""
    config = {
        "providers": {"p": {**fake(), "data_classes": ["internal"]}},
        "models": {"chat": {"providers": ["p"]}},
        "budgets": {"calls": 100_000},
        "state": {"url": f"sqlite:///{tmp_path / 'state.db'}"},
    }
    path = write_config(tmp_path, config)
    rt = await build_runtime(load_config(path, env={}), path, clock=ManualClock(0.0))
    try:
        quotas = rt.stores.quotas.store  # type: ignore[attr-defined]  # the leased store's
        calls: list[str] = []
        for name in ("reserve", "settle"):
            original = getattr(quotas, name)

            async def counted(*args: Any, _name: str = name, _call: Any = original) -> Any:
                calls.append(_name)
                return await _call(*args)

            setattr(quotas, name, counted)
        fast = 0
        for _ in range(64):  # demand within one window: leases form
            request = request_for(rt)
            identify_chat(request)
            done = reserve_chat(request)
            if isinstance(done, bool):
                assert done is False
                fast += 1
            else:
                assert await done is False
            request.served = True
            settled = settle_shielded(request)
            if fast:
                assert settled is DONE
            await settled
        assert fast > 32  # most requests drew from a lease
        assert calls.count("reserve") < 64 - fast + 1
        await rt.stores.quotas.flush()  # type: ignore[attr-defined]
        usage = await quotas.usage(request.identity.budget_subject)
        assert (usage.calls, usage.reserved_calls) == (64, 0)
    finally:
        await close_runtime(rt)


@pytest.mark.asyncio
async def test_the_budget_step_reserves_and_refuses_past_the_quota(runtime: Runtime) -> None:
    """Three calls are reserved (each request holds its reservation); the fourth is refused."""
    for _ in range(3):
        request = request_for(runtime)
        identify_chat(request)
        assert await outcome(reserve_chat(request)) is False
        assert request.reservation is not None
    request = request_for(runtime)
    identify_chat(request)
    with pytest.raises(BudgetExceeded):
        await outcome(reserve_chat(request))
    assert request.reservation is None


@pytest.mark.asyncio
async def test_the_route_step_plans_and_refuses_without_candidates(runtime: Runtime) -> None:
    """An internal caller gets the provider; with its breaker open the refusal is 503."""
    request = request_for(runtime)
    identify_chat(request)
    assert plan(request) is False
    assert [c.name for c in request.plan.candidates] == ["p"]
    breaker = runtime.breakers["p"]
    for _ in range(breaker.options.consecutive_failures):
        breaker.acquire().failure()
    with pytest.raises(CircuitOpen):
        plan(request)


@pytest.mark.asyncio
async def test_a_data_class_no_provider_may_receive_is_forbidden(tmp_path: Path) -> None:
    """A route whose every provider refuses the caller's data class is 403."""
    config = {
        "providers": {"p": {**fake(), "data_classes": ["public"]}},
        "models": {"chat": {"providers": ["p"]}},
    }
    path = write_config(tmp_path, config)
    rt = await build_runtime(load_config(path, env={}), path, clock=ManualClock())
    try:
        request = request_for(rt)
        identify_chat(request)
        with pytest.raises(Forbidden):
            plan(request)
    finally:
        await close_runtime(rt)
