"""The request path of ``POST /v1/chat/completions``, in the order a request meets it.

identify (by the app, before the body is read) -> validate -> flags -> rate limit -> budget ->
deadline -> idempotency -> cache and single-flight -> admission -> route -> call (retries,
breaker, failover) -> answer -> settle (shielded).

Each step asks a policy object from :mod:`tidegate.policy`; this module only sequences them,
turns their verdicts into HTTP, and makes sure the bookkeeping happens whatever goes wrong.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import orjson
import structlog

from tidegate.errors import (
    BudgetExceeded,
    CircuitOpen,
    Forbidden,
    IdempotencyConflict,
    IdempotencyMismatch,
    InvalidRequest,
    ModelNotFound,
    ProviderError,
    ProviderErrorKind,
    RateLimited,
    StoreError,
    Unavailable,
    http_error,
)
from tidegate.gateway.auth import Identity
from tidegate.gateway.canary import apply_version, validation_failed
from tidegate.gateway.http import Send, send_bytes, send_raw, start_stream
from tidegate.gateway.runtime import Flight, Route, Runtime
from tidegate.ids import new_id
from tidegate.policy.budget import BudgetVerdict, Cost, Reservation
from tidegate.policy.deadline import Deadline
from tidegate.policy.flags import KillSwitchMode, check_answering
from tidegate.policy.ratelimit import BucketOptions, TakeResult, ratelimit_headers
from tidegate.policy.retry import RetryBudgetDenied, RetryEvent, RetryScheduled, acall_with_deadline
from tidegate.policy.routing import (
    ProviderSpec,
    RoutePlan,
    Skip,
    SkipReason,
    describe_attempts,
    next_candidates,
    plan_route,
)
from tidegate.providers.base import StreamEnd, StreamItem
from tidegate.state.base import ClaimOutcome, StoredResponse

__all__ = ["Exchange", "chat_completions", "embeddings"]

log = structlog.get_logger("tidegate")

#: Errors that say nothing about the provider's health: the breaker permit is released.
NOT_EVIDENCE = frozenset(
    {
        ProviderErrorKind.BAD_REQUEST,
        ProviderErrorKind.CONTEXT_LENGTH,
        ProviderErrorKind.CONTENT_FILTER,
        ProviderErrorKind.CANCELLED,
    }
)
#: How often a request waiting on an in-progress idempotency key looks again.
IDEMPOTENCY_POLL_S = 0.05
#: Route plans remembered (combinations of route, data class, approved fallbacks and open
#: breakers) before they are all forgotten.
PLANS_REMEMBERED = 1024
_NO_NAMES: frozenset[str] = frozenset()
# Enum members read on every request, as module constants: reading one off its class costs a
# metaclass lookup on Python 3.11.
_ALLOW: Final = BudgetVerdict.ALLOW
_BLOCK: Final = BudgetVerdict.BLOCK
_DEGRADED_MODE: Final = KillSwitchMode.DEGRADED
DEADLINE_HEADER = "x-tidegate-deadline-ms"
#: Digits of a deadline header worth reading: 12 are over 30 years, and a float takes them all.
_DEADLINE_DIGITS = 12
PRIORITY_HEADER = "x-tidegate-priority"


class Exchange:
    """What one request did, for its response headers, its log line and its metrics.

    A plain class rather than a dataclass: one is made for every request, and only the two
    mutable fields need setting per instance; the others start as the class's defaults.
    """

    route: str = "-"
    identity: Identity | None = None
    served_by: str = "-"
    served_model: str = "-"
    outcome: str = "ok"
    status: int = 200
    cache: str = ""
    budget: str = ""
    skipped: tuple[Skip, ...] = ()
    cost: float = 0.0
    first_token_s: float | None = None
    #: Set once the request is settling: a disconnect from then on cancels nothing.
    settling: bool = False
    #: The canary version that served (``baseline`` or ``candidate``), when the route has one.
    version: str = ""
    #: A truncated answer, or not the JSON the request asked for (judged by the canary gate).
    validation_failed: bool = False
    _tried_memo: tuple[tuple[int, tuple[Skip, ...]], str] | None = None
    #: The task handling the request, when the caller knows it (saves looking it up again).
    task: asyncio.Task[Any] | None = None

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.tried: list[tuple[str, ProviderErrorKind | SkipReason | None]] = []
        self.usage: dict[str, int] = {}

    def __repr__(self) -> str:
        return (
            f"Exchange(request_id={self.request_id!r}, route={self.route!r}, "
            f"served_by={self.served_by!r}, outcome={self.outcome!r}, status={self.status})"
        )

    def tried_header(self) -> str:
        # Asked for the answer's headers, the log line and the span: described once per change.
        seen = (len(self.tried), self.skipped)
        memo = self._tried_memo
        if memo is not None and memo[0] == seen:
            return memo[1]
        text = describe_attempts(self.tried, self.skipped)
        self._tried_memo = (seen, text)
        return text

    def raw_answer_headers(self) -> list[tuple[bytes, bytes]]:
        """The headers every answer carries, as ASGI takes them (names lower-case)."""
        headers = [(b"x-request-id", self.request_id.encode("latin-1"))]
        if self.served_by != "-":
            headers.append((b"x-tidegate-served-by", self.served_by.encode("latin-1")))
        tried = self.tried_header()
        if tried:
            headers.append((b"x-tidegate-tried", tried.encode("latin-1")))
        if self.cache:
            headers.append((b"x-tidegate-cache", self.cache.encode("latin-1")))
        if self.budget:
            headers.append((b"x-tidegate-budget", self.budget.encode("latin-1")))
        if self.version:
            headers.append((b"x-tidegate-version", self.version.encode("latin-1")))
        return headers

    def answer_headers(self) -> list[tuple[str, str]]:
        """:meth:`raw_answer_headers` as text, for adding more headers to."""
        return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in self.raw_answer_headers()]


# --------------------------------------------------------------------------- request checks


#: The most completions one request may ask for (``n``), as OpenAI allows.
MAX_CHOICES = 128
#: The largest ``max_tokens`` (and token id) a body may hold: far above any model's limit, and
#: small enough that a day of them, times ``n``, fits the stores' 64-bit integers.
MAX_INTEGER = 2**31 - 1


def validate_chat(body: dict[str, Any]) -> int:
    """Refuse a body the gateway cannot route or budget; returns the completions asked for.

    An integer field takes what JSON Schema calls an integer: a number without a fraction, ``2``
    or ``2.0`` (the latter rewritten as ``2`` for the provider). ``true`` is not one, though it
    is an ``int`` to ``isinstance``; the common case is checked with ``type(...) is int``.
    """
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' must be a non-empty string")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a 'role'")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise InvalidRequest("'stream' must be true or false")
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and (
        type(max_tokens) is not int or not 0 < max_tokens <= MAX_INTEGER
    ):
        body["max_tokens"] = _integer("max_tokens", max_tokens, 1, MAX_INTEGER)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object")
    if "n" not in body:  # nearly every request: one completion
        return 1
    n = body["n"]
    if n is None:
        return 1
    if type(n) is not int or not 0 < n <= MAX_CHOICES:
        n = body["n"] = _integer("n", n, 1, MAX_CHOICES)
    return n


def _whole(value: Any) -> Any:
    """``value`` as an ``int`` if it is a float without a fraction (``2.0``), else as it is."""
    return int(value) if type(value) is float and value.is_integer() else value


def _integer(name: str, value: Any, low: int, high: int) -> int:
    """The integer field ``name`` as an ``int`` from ``low`` to ``high``, or ``InvalidRequest``."""
    value = _whole(value)
    if type(value) is not int or not low <= value <= high:
        raise InvalidRequest(f"'{name}' must be an integer from {low} to {high}")
    return value


def _tokens(values: list[Any]) -> list[int] | None:
    """``values`` as token ids (integers from 0 to MAX_INTEGER), or None if one is not."""
    tokens = [_whole(value) for value in values]
    if all(type(t) is int and 0 <= t <= MAX_INTEGER for t in tokens):
        return tokens
    return None


def embeddings_input(value: Any) -> str | list[Any]:
    """An embeddings ``input`` in one of OpenAI's four shapes (a string, or a non-empty array
    of strings, of token ids, or of non-empty arrays of token ids), or ``InvalidRequest``.
    Token ids written as ``2.0`` come back as ``2``."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            return value
        tokens = _tokens(value)
        if tokens is not None:
            return tokens
        if all(isinstance(item, list) and item for item in value):
            nested = [_tokens(item) for item in value]
            if None not in nested:
                return nested
    raise InvalidRequest(
        "'input' must be a string, or a non-empty array of strings, of token ids"
        f" (integers from 0 to {MAX_INTEGER}), or of non-empty arrays of token ids"
    )


def check_choices(rt: Runtime, route: Route, alias: str, choices: int) -> None:
    """Refuse ``n`` above 1 on a route whose primary cannot answer with several choices.

    An Anthropic provider returns one choice, and refuses ``n`` above 1 as a bad request, which
    ends the route there (no fallback is tried): so the request is refused now, before it is
    counted against a budget or waits for a slot. A route with such a provider as a fallback
    only is served by the primary; failing over to that fallback ends in the same refusal.
    """
    primary = route.specs[0].name
    if rt.provider_configs[primary].type == "anthropic":
        raise InvalidRequest(
            f"'n' is {choices}, but model {alias!r} is served by an Anthropic provider"
            f" ({primary!r}), which answers with one choice"
        )


def deadline_for(rt: Runtime, headers: Mapping[str, str]) -> Deadline:
    """The request's deadline from config, shortened (never lengthened) by the caller's header."""
    clock = rt.clock  # the configured timeout is validated positive at load
    deadline = Deadline(clock, clock.now() + rt.request_timeout_s)
    raw = headers.get(DEADLINE_HEADER)
    if raw is None:
        return deadline
    # Decimal digits only: int() would also take "1_000", "+5" and other scripts' digits.
    if not (raw.isascii() and raw.isdigit()):
        raise InvalidRequest(f"{DEADLINE_HEADER} must be whole milliseconds, got {raw!r}")
    digits = raw.lstrip("0")
    if not digits:
        raise InvalidRequest(f"{DEADLINE_HEADER} must be positive, got {raw!r}")
    if len(digits) > _DEADLINE_DIGITS:  # longer than any configured timeout: shortens nothing
        return deadline
    return deadline.shorten(int(digits) / 1000.0)


def identify(rt: Runtime, headers: Mapping[str, str]) -> Identity:
    if rt.no_keys_file and len(rt.keys) == 0:
        # No keys configured (dev only: production refuses to start like this).
        classes = rt.config.admission.classes
        return Identity(
            "anonymous",
            "anonymous",
            "anonymous",
            classes[min(1, len(classes) - 1)],
            rt.config.default_data_class,
            frozenset({"*"}),
        )
    return rt.keys.identify(headers.get("authorization"))


def canonical(body: Mapping[str, Any]) -> bytes:
    return orjson.dumps(body, option=orjson.OPT_SORT_KEYS)


def estimate_prompt_tokens(body: Mapping[str, Any]) -> int:
    """About four characters a token: good enough to reserve a budget, never to bill."""
    chars = 0
    for message in body.get("messages", ()):
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(
                len(str(part.get("text", ""))) for part in content if isinstance(part, dict)
            )
    return max(1, chars // 4)


def price(rt: Runtime, model: str, prompt_tokens: int, completion_tokens: int) -> float:
    entry = rt.prices_per_1k.get(model)
    if entry is None:
        return 0.0
    return (prompt_tokens * entry[0] + completion_tokens * entry[1]) / 1000.0


# --------------------------------------------------------------------------- limits


async def apply_rate_limits(rt: Runtime, identity: Identity) -> None:
    for options, key, name in (
        (rt.user_bucket, identity.user_bucket, "per-user"),
        (rt.tenant_bucket, identity.tenant_bucket, "per-tenant"),
    ):
        if options is None:
            continue
        try:
            result = await rt.stores.buckets.take(key, options)
        except StoreError as exc:
            result = await rt.take_failing_open(key, options, exc)
        if not result.allowed:
            raise _rate_limited(options, result, name)


def _rate_limited(options: BucketOptions, result: TakeResult, name: str) -> RateLimited:
    retry_after = result.retry_after if result.retry_after != float("inf") else None
    return RateLimited(
        f"{name} rate limit: {options.burst:g} requests, refilling {options.rate:g}/s",
        policy="ratelimit",
        retry_after=retry_after,
        reason=name,
        headers=ratelimit_headers(options, result, policy_name=name),
    )


async def reserve_budget(
    rt: Runtime, identity: Identity, body: dict[str, Any], ex: Exchange, choices: int = 1
) -> tuple[Reservation | None, str]:
    """Hold the estimated cost; returns the reservation and the route alias (maybe degraded).

    ``choices`` completions (``n``) may each be ``max_tokens`` long: one call, their tokens.
    """
    alias = body["model"]
    if rt.budget is None:
        return None, alias
    max_tokens = body.get("max_tokens") or rt.default_max_tokens
    completion = max_tokens * choices
    prompt = estimate_prompt_tokens(body)
    model = rt.model_ids[rt.routes[alias].specs[0].name]
    estimate = Cost(calls=1, tokens=prompt + completion, cost=price(rt, model, prompt, completion))
    subject = identity.budget_subject
    try:
        reservation, decision = await rt.stores.quotas.reserve(subject, rt.budget, estimate)
    except StoreError:
        rt.metrics.store_errors.labels("quotas", "fail_closed").inc()
        raise
    verdict = decision.verdict
    if verdict is _ALLOW:
        return reservation, alias
    if verdict is _BLOCK:
        dimension = decision.reason.value if decision.reason is not None else "calls"
        rt.metrics.budget_denials.labels(dimension).inc()
        retry_after = decision.retry_after if decision.retry_after != float("inf") else None
        raise BudgetExceeded(
            f"the daily {dimension} budget is spent", policy="budget", retry_after=retry_after
        )
    # The one verdict left: degrade (a cheaper model or fewer tokens, as configured).
    budgets = rt.config.budgets
    assert budgets is not None  # rt.budget is made from it
    rt.metrics.budget_degraded.inc()
    ex.budget = "degraded"
    if budgets.degrade.max_tokens is not None:
        body["max_tokens"] = min(max_tokens, budgets.degrade.max_tokens)
    if budgets.degrade.model is not None:
        alias = budgets.degrade.model
    return reservation, alias


def _entry_lost(rt: Runtime, settle: Settlement) -> None:
    """The commit of the entry decisions failed and undid them all: no reservation is held, and
    the request fails closed as a failed reservation would."""
    settle.reservation = None
    rt.metrics.store_errors.labels("quotas" if rt.budget else "buckets", "fail_closed").inc()


# --------------------------------------------------------------------------- routing and calls


def plan_for(rt: Runtime, route: Route, identity: Identity) -> RoutePlan:
    """The route's plan for this request: worked out once per combination of its inputs (the
    route, the data class, the approved fallbacks and the open breakers), then remembered."""
    approved = rt.approved_fallbacks()
    breakers = rt.breakers
    open_breakers = _NO_NAMES
    for spec in route.specs:
        if not breakers[spec.name].would_admit():
            open_breakers = open_breakers | {spec.name}
    key = (id(route), identity.data_class, approved, open_breakers)
    plans = rt.plans
    known = plans.get(key)
    if known is not None and known[0] is route:
        return known[1]
    if len(plans) >= PLANS_REMEMBERED:
        plans.clear()
    plan = plan_route(
        route.specs, data_class=identity.data_class, approved=approved, open_breakers=open_breakers
    )
    plans[key] = (route, plan)
    return plan


def no_candidates(rt: Runtime, plan: RoutePlan, identity: Identity) -> Exception:
    if any(s.reason is SkipReason.BREAKER_OPEN for s in plan.skipped):
        wait = min(
            rt.breakers[s.name].retry_after()
            for s in plan.skipped
            if s.reason is SkipReason.BREAKER_OPEN
        )
        return CircuitOpen(
            "every provider that may serve this request is failing; its breaker is open",
            policy="breaker",
            retry_after=max(wait, 0.001),
        )
    return Forbidden(f"no provider on this route may receive data class {identity.data_class!r}")


def _on_retry_event(rt: Runtime, provider: str) -> Callable[[RetryEvent], None]:
    """The retry planner's event handler for ``provider``: made once per runtime."""
    handle = rt.retry_events.get(provider)
    if handle is not None:
        return handle

    def handle_event(event: RetryEvent) -> None:
        if isinstance(event, RetryScheduled):
            rt.metrics.retries.labels(provider).inc()
        elif isinstance(event, RetryBudgetDenied):
            rt.metrics.retry_budget_denials.inc()

    rt.retry_events[provider] = handle_event
    return handle_event


def _record_failure(rt: Runtime, ex: Exchange, spec: ProviderSpec, error: ProviderError) -> None:
    ex.tried.append((spec.name, error.kind))
    rt.metrics.attempts.labels(spec.name, error.kind.value).inc()


R = TypeVar("R")


async def _failover(
    rt: Runtime,
    ex: Exchange,
    route: Route,
    deadline: Deadline,
    plan: RoutePlan,
    attempt_on: Callable[[ProviderSpec], Callable[[float], Awaitable[R]]],
    *,
    only: ProviderSpec | None = None,
) -> R:
    """Try the plan's candidates in order: retries on one provider (the retry planner), then
    failover as the routing rules allow. A candidate whose breaker opened meanwhile is skipped.
    With ``only``, just that provider is tried.
    """
    queue = [only] if only is not None else list(plan.candidates)
    last: ProviderError | None = None
    retry_on = rt.retry_on
    while queue:
        spec = queue.pop(0)
        try:
            return await acall_with_deadline(
                _fleet_budgeted(rt, attempt_on(spec)),
                deadline,
                rt.retry_policy,
                per_try=route.per_try_timeout_s,
                sleep=rt.sleep,
                rng=rt.rng,
                budget=rt.retry_budget,
                retry_on=retry_on,
                on_event=_on_retry_event(rt, spec.name),
            )
        except CircuitOpen:
            ex.tried.append((spec.name, SkipReason.BREAKER_OPEN))
        except ProviderError as error:
            last = error.original if isinstance(error, _FleetBudgetSpent) else error
            queue = [] if only is not None else list(next_candidates(plan, spec, error))
            if queue:
                rt.metrics.failovers.labels(spec.name, error.kind.value).inc()
    if last is not None:
        raise last
    raise CircuitOpen(
        "every candidate provider's breaker opened", policy="breaker", retry_after=1.0
    )


class _FleetBudgetSpent(ProviderError):
    """Stops the retries on one provider; the caller is told the provider's own error."""

    def __init__(self, original: ProviderError) -> None:
        super().__init__(
            original.kind,
            original.message,
            provider=original.provider,
            retryable=False,
            retry_after=original.retry_after,
            status=original.status,
        )
        self.original = original


def _fleet_budgeted(
    rt: Runtime, attempt: Callable[[float], Awaitable[R]]
) -> Callable[[float], Awaitable[R]]:
    """With a Redis store, a retry needs the fleet's retry budget too, not only this process's.

    The planner asks the local budget before every retry; this wrapper then asks the budget
    shared by every replica. A refusal ends the retries on this provider as if the error could
    not be retried (failover still applies).
    """
    fleet = rt.fleet_retry_budget
    if fleet is None:
        return attempt
    tries = 0
    last: ProviderError | None = None

    async def budgeted(limit: float) -> R:
        nonlocal tries, last
        tries += 1
        try:
            if tries == 1:
                await fleet.record_first_try()
            elif not await fleet.try_spend():
                rt.metrics.retry_budget_denials.inc()
                assert last is not None
                raise _FleetBudgetSpent(last)
        except StoreError:
            rt.metrics.store_errors.labels("retry_budget", "fail_open").inc()
        try:
            return await attempt(limit)
        except ProviderError as error:
            last = error
            raise

    return budgeted


def _failed(
    rt: Runtime, ex: Exchange, spec: ProviderSpec, permit: Any, error: ProviderError
) -> None:
    """Record a failed attempt and end its permit: errors about the request say nothing of health."""
    _record_failure(rt, ex, spec, error)
    permit.release() if error.kind in NOT_EVIDENCE else permit.failure()


class _Completion:
    """The non-streaming attempts of one request on one provider: the retry planner calls it
    with each attempt's time limit (an object, cheaper than a pair of closures per request)."""

    __slots__ = ("breaker", "ex", "provider", "rt", "spec", "upstream")

    def __init__(self, rt: Runtime, ex: Exchange, body: dict[str, Any], spec: ProviderSpec) -> None:
        self.rt = rt
        self.ex = ex
        self.spec = spec
        self.provider = rt.providers[spec.name]
        self.breaker = rt.breakers[spec.name]
        self.upstream = {**body, "model": rt.model_ids[spec.name]}

    async def __call__(self, limit: float) -> tuple[ProviderSpec, dict[str, Any]]:
        rt, spec = self.rt, self.spec
        permit = self.breaker.acquire(deadline_at=rt.clock.now() + limit)
        try:
            if rt.tracing.enabled:
                with rt.tracing.span("tidegate.attempt", **{"tidegate.provider": spec.name}):
                    answer: dict[str, Any] = await self.provider.complete(
                        self.upstream, timeout=limit
                    )
            else:
                answer = await self.provider.complete(self.upstream, timeout=limit)
        except ProviderError as error:
            _failed(rt, self.ex, spec, permit, error)
            raise
        except BaseException:
            permit.release()
            raise
        permit.success()
        self.ex.tried.append((spec.name, None))
        rt.metrics.attempts.labels(spec.name, "ok").inc()
        return spec, answer


def call_route(
    rt: Runtime,
    ex: Exchange,
    route: Route,
    body: dict[str, Any],
    deadline: Deadline,
    plan: RoutePlan,
) -> Awaitable[tuple[ProviderSpec, dict[str, Any]]]:
    """One non-streaming answer, to await: retries on a provider, then failover down the plan.

    A plain function returning the failover's coroutine: one coroutine level fewer for every
    suspension of the upstream call to pass through.
    """
    return _failover(rt, ex, route, deadline, plan, functools.partial(_Completion, rt, ex, body))


@dataclass
class OpenStream:
    """A provider stream that has produced its first chunk (the point of commitment)."""

    spec: ProviderSpec
    items: AsyncIterator[StreamItem]
    first: list[dict[str, Any]]
    permit: Any


async def open_stream(
    rt: Runtime,
    ex: Exchange,
    route: Route,
    body: dict[str, Any],
    deadline: Deadline,
    plan: RoutePlan,
    *,
    only: ProviderSpec | None = None,
) -> OpenStream:
    """Failover is transparent until the first chunk: try candidates until one starts talking.

    With ``only``, just that provider is tried (with its retries): a rescue picks its own order.
    """

    def attempt_on(spec: ProviderSpec) -> Callable[[float], Awaitable[OpenStream]]:
        provider = rt.providers[spec.name]
        breaker = rt.breakers[spec.name]
        pcfg = rt.provider_configs[spec.name]
        upstream = {
            **body,
            "model": pcfg.model,
            "stream": True,
            "stream_options": {**(body.get("stream_options") or {}), "include_usage": True},
        }

        async def attempt(limit: float) -> OpenStream:
            first_timeout = min(limit, pcfg.stream.first_token_timeout_s)
            permit = breaker.acquire(deadline_at=rt.clock.now() + first_timeout)
            items = provider.stream(
                upstream,
                timeout=first_timeout,
                chunk_timeout=pcfg.stream.stall_timeout_s,
                total_timeout=min(deadline.remaining(), pcfg.stream.max_duration_s),
            )
            first: list[dict[str, Any]] = []
            span = rt.tracing.span("tidegate.attempt", **{"tidegate.provider": spec.name})
            try:
                with span:
                    await _first_chunks(items, first)
            except ProviderError as error:
                _failed(rt, ex, spec, permit, error)
                await _close(items)
                raise
            except BaseException:
                permit.release()
                await _close(items)
                raise
            return OpenStream(spec, items, first, permit)

        return attempt

    return await _failover(rt, ex, route, deadline, plan, attempt_on, only=only)


async def _first_chunks(items: AsyncIterator[StreamItem], first: list[dict[str, Any]]) -> None:
    """Read a stream up to its first content chunk (the point of commitment)."""
    async for item in items:
        if isinstance(item, dict):
            first.append(item)
            if _has_content(item):
                return
        elif isinstance(item, StreamEnd):
            return


def _has_content(chunk: Mapping[str, Any]) -> bool:
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls") or choice.get("finish_reason"):
            return True
    return False


async def _close(items: AsyncIterator[StreamItem]) -> None:
    closer = getattr(items, "aclose", None)
    if closer is not None:
        await closer()


# --------------------------------------------------------------------------- the handler


def _sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


def _usage_of(
    answer: Mapping[str, Any], body: Mapping[str, Any], text_chars: int
) -> dict[str, int]:
    usage = answer.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        prompt = int(usage["prompt_tokens"])
        completion = int(usage.get("completion_tokens") or 0)
    else:
        prompt = estimate_prompt_tokens(body)
        completion = max(0, text_chars // 4)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


class Settlement:
    """The bookkeeping a request owes, done once, shielded from the caller going away."""

    def __init__(self, rt: Runtime, ex: Exchange) -> None:
        self.rt = rt
        self.ex = ex
        self.reservation: Reservation | None = None
        self.idempotency: tuple[str, str] | None = None
        self.stored: StoredResponse | None = None
        self.ticket: Any = None
        self.served = False

    async def run(self) -> None:
        """Settle what is owed, in one SQLite transaction committed with the other batches of
        this round; a store that fails (or whose commit fails) is logged as lost."""
        rt, ex = self.rt, self.ex
        written: list[str] = []
        with rt.stores.batch():
            if self.ticket is not None:
                rt.admission.exit(self.ticket, completed=self.served)
                self.ticket = None
            if self.reservation is not None:
                reservation, self.reservation = self.reservation, None
                try:
                    if self.served:
                        tokens = ex.usage.get("total_tokens", 0)
                        await rt.stores.quotas.settle(
                            reservation, Cost(calls=1, tokens=tokens, cost=ex.cost)
                        )
                    else:
                        await rt.stores.quotas.refund(reservation)
                    written.append("quotas")
                except StoreError as exc:
                    self._lost("quotas", exc)
            if self.idempotency is not None:
                key, token = self.idempotency
                self.idempotency = None
                try:
                    if self.stored is not None:
                        await rt.stores.idempotency.complete(
                            key, token, self.stored, ttl_s=rt.config.idempotency.ttl_s
                        )
                    else:
                        await rt.stores.idempotency.abandon(key, token)
                    if rt.stores.one_backend:  # in the same transaction as the budget's
                        written.append("idempotency")
                except StoreError as exc:
                    self._lost("idempotency", exc)
        if not written:
            return
        try:
            await rt.stores.committed()
        except StoreError as exc:
            for store in written:
                self._lost(store, exc)

    async def complete_idempotency(self) -> None:
        """Store the answer under the request's idempotency key now, if it has one. On a store
        error the key stays owed, and the settlement tries again (or abandons it)."""
        if self.idempotency is None or self.stored is None:
            return
        key, token = self.idempotency
        try:
            await self.rt.stores.idempotency.complete(
                key, token, self.stored, ttl_s=self.rt.config.idempotency.ttl_s
            )
        except StoreError as exc:
            log.warning(
                "idempotency_complete_deferred", request_id=self.ex.request_id, error=str(exc)
            )
            return
        self.idempotency = None

    def _lost(self, store: str, exc: StoreError) -> None:
        self.rt.metrics.store_errors.labels(store, "settle_lost").inc()
        event = "budget_settle_failed" if store == "quotas" else "idempotency_settle_failed"
        log.warning(event, request_id=self.ex.request_id, error=str(exc))


def _record_canary(rt: Runtime, ex: Exchange, started: float) -> None:
    """Count the request in its version's window (client errors are not the version's fault)."""
    canary = rt.canaries.get(ex.route)
    if canary is None or not ex.version or 400 <= ex.status < 500:
        return
    failed = ex.status >= 500 or ex.outcome.startswith(("degraded", "stream_incomplete"))
    canary.windows[ex.version].record(
        error=failed,
        invalid=ex.validation_failed,
        latency=rt.clock.now() - started,
        cost=ex.cost,
    )


def settle_shielded(settle: Settlement, ex: Exchange) -> Awaitable[None]:
    """The settlement, to await: it runs so that no cancellation can cut it short.

    Normally it runs inline (a task per request would cost more than the settlement); the
    disconnect watcher leaves a settling request alone. When a cancellation is already under way
    (a disconnect before the answer, or the drain deadline at shutdown) it runs shielded.
    """
    ex.settling = True
    task = ex.task or asyncio.current_task()
    if task is not None and task.cancelling():
        return asyncio.shield(settle.run())
    return settle.run()


async def _claim_idempotency(
    rt: Runtime, scoped: str, fingerprint: str, deadline: Deadline
) -> tuple[str, StoredResponse | None]:
    """The claim token, or a stored response to replay; waits (bounded) for a running twin.

    ``scoped`` is the caller's key in the caller's scope (:attr:`Identity.idempotency_scope`).
    """
    waited = 0.0
    while True:
        try:
            claim = await rt.stores.idempotency.claim(
                scoped,
                fingerprint,
                # A claim outlives the request it guards by a margin; a replica that died while
                # holding it blocks the key no longer than that.
                lease_s=rt.config.server.request_timeout_s + rt.config.idempotency.lease_margin_s,
            )
        except StoreError:
            rt.metrics.store_errors.labels("idempotency", "fail_closed").inc()
            raise
        if claim.outcome is ClaimOutcome.CLAIMED:
            return claim.token, None
        if claim.outcome is ClaimOutcome.REPLAY:
            assert claim.response is not None
            return "", claim.response
        if claim.outcome is ClaimOutcome.MISMATCH:
            raise IdempotencyMismatch(
                "this Idempotency-Key was already used with a different request body"
            )
        budget = min(rt.config.idempotency.wait_s, deadline.remaining())
        if waited >= budget:
            raise IdempotencyConflict(
                "a request with this Idempotency-Key is still running", retry_after=1.0
            )
        await rt.sleep(IDEMPOTENCY_POLL_S)
        waited += IDEMPOTENCY_POLL_S


def cache_key(identity: Identity, alias: str, body: Mapping[str, Any]) -> str:
    keep = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "user")}
    keep["model"] = alias
    digest = hashlib.sha256(identity.tenant.encode() + b"\0" + canonical(keep)).hexdigest()
    return f"chat:{digest}"


async def chat_completions(
    rt: Runtime, ex: Exchange, headers: Mapping[str, str], body: dict[str, Any], send: Send
) -> None:
    """Answer one chat completion request, streaming or not; every error becomes its 4xx/5xx."""
    settle = Settlement(rt, ex)
    started_stream = False
    started = rt.clock.now() if rt.canaries else 0.0  # a canary's latency (none: not read)
    canary = None
    try:
        identity = ex.identity  # the caller was identified before its body was read
        assert identity is not None
        choices = validate_chat(body)
        alias = body["model"]
        ex.route = alias
        if alias not in rt.routes:
            raise ModelNotFound(f"no model named {alias!r}; GET /v1/models lists them")
        rt.keys.authorize(identity, alias)
        if choices > 1:
            check_choices(rt, rt.routes[alias], alias, choices)
        mode = check_answering(rt.flags)
        deadline = deadline_for(rt, headers)
        with rt.stores.batch():  # one SQLite transaction for the entry decisions
            await apply_rate_limits(rt, identity)
            settle.reservation, alias = await reserve_budget(rt, identity, body, ex, choices)
        try:
            # Decided above, in effect once durable (SQLite commits a round's batches together).
            await rt.stores.committed()
        except StoreError:
            _entry_lost(rt, settle)
            raise
        ex.route = alias
        route = rt.routes[alias]
        canary = rt.canaries.get(alias)
        if canary is not None:
            # The end user (OpenAI's ``user`` field) when the caller names one, else the key's.
            named = body.get("user")
            end_user = named if isinstance(named, str) and named else identity.user
            ex.version, version = canary.version_for(rt.flags, identity.tenant, end_user)
            body = apply_version(body, version)
            route = rt.version_routes.get((alias, ex.version), route)
        stream = bool(body.get("stream"))

        idem_key = headers.get("idempotency-key")
        if idem_key is not None:
            if not idem_key or len(idem_key) > 255:
                raise InvalidRequest("Idempotency-Key must be 1 to 255 characters")
            fingerprint = hashlib.sha256(canonical(body)).hexdigest()
            scoped = identity.idempotency_scope + idem_key
            token, replay = await _claim_idempotency(rt, scoped, fingerprint, deadline)
            if replay is not None:
                ex.cache = "idempotent-replay"
                ex.status = replay.status
                stored = dict(replay.headers)
                # send_bytes writes the Content-Type: kept in the stored headers it came twice.
                content_type = stored.pop("content-type", "application/json")
                await send_bytes(
                    send,
                    replay.status,
                    replay.body,
                    [*ex.answer_headers(), ("idempotent-replayed", "true"), *stored.items()],
                    content_type=content_type,
                )
                return
            settle.idempotency = (scoped, token)

        use_cache = rt.cache_enabled and not stream
        key = cache_key(identity, f"{alias}@{ex.version}", body) if use_cache else ""
        if use_cache:
            cached = await _cache_get(rt, key)
            if cached is not None:
                ex.cache = "hit"
                await _answer_json(rt, ex, send, cached, settle)
                return
            ex.cache = "miss"

        klass = rt.identity_class(identity, headers.get(PRIORITY_HEADER))
        settle.ticket = await rt.admission.enter(
            request_id=ex.request_id, klass=klass, tenant=identity.tenant, deadline=deadline
        )
        try:
            if mode is _DEGRADED_MODE:
                raise Unavailable(
                    "models are switched off (answer.mode=degraded)",
                    policy="flags",
                    retry_after=30.0,
                )
            plan = plan_for(rt, route, identity)
            ex.skipped = plan.skipped
            if not plan.candidates:
                raise no_candidates(rt, plan, identity)
            if stream:
                started_stream = True
                await _stream_answer(rt, ex, route, body, deadline, plan, send, settle, headers)
                return
            if use_cache:
                body_bytes = await _single_flight(rt, ex, key, route, body, deadline, plan)
            else:  # nothing to share: the request leads its own call
                body_bytes = (await _lead(rt, ex, key, route, body, deadline, plan, False))[0]
        except (ProviderError, CircuitOpen, Unavailable) as error:
            # Degraded mode: only when no model can answer, retrying could, and nothing was sent.
            retryable = error.retryable if isinstance(error, ProviderError) else True
            if ex.first_token_s is not None or not retryable:
                raise
            if await answer_degraded(rt, ex, identity, alias, body, stream, send, settle, error):
                return
            raise
        await _answer_json(rt, ex, send, body_bytes, settle)
    except asyncio.CancelledError:
        ex.outcome, ex.status = "client_closed", 499
        raise
    except Exception as error:
        status, err_body, extra = http_error(error)
        ex.outcome, ex.status = str(err_body["error"]["code"]), status
        if status == 500:  # not an error tidegate raised on purpose: a bug worth its traceback
            log.exception("internal_error", request_id=ex.request_id)
        if started_stream and ex.first_token_s is not None:
            # Headers are gone: the only honest signal left is an in-band error event.
            await send(
                {
                    "type": "http.response.body",
                    "body": _sse(orjson.dumps(err_body)),
                    "more_body": False,
                }
            )
        else:
            await send_bytes(
                send, status, orjson.dumps(err_body), [*ex.answer_headers(), *extra.items()]
            )
    finally:
        if canary is not None:
            _record_canary(rt, ex, started)
        await settle_shielded(settle, ex)


async def _cache_get(rt: Runtime, key: str) -> bytes | None:
    try:
        entry = await rt.stores.cache.get(key)
    except StoreError:
        rt.metrics.store_errors.labels("cache", "fail_open").inc()
        return None
    rt.metrics.cache.labels("hit" if entry is not None else "miss").inc()
    return None if entry is None else entry.value


async def _answer_json(
    rt: Runtime, ex: Exchange, send: Send, payload: bytes, settle: Settlement
) -> None:
    headers = ex.raw_answer_headers()
    if settle.idempotency is not None:  # what the key replays
        settle.stored = StoredResponse(200, payload, {"content-type": "application/json"})
    settle.served = True
    ex.status = 200
    # Recorded before it is sent: a replica that dies between the two then leaves a key that
    # replays this answer, not one stuck "in progress" whose answer the caller already holds.
    if settle.stored is not None:
        await settle.complete_idempotency()
    await send_raw(send, 200, payload, headers)


async def _single_flight(
    rt: Runtime,
    ex: Exchange,
    key: str,
    route: Route,
    body: dict[str, Any],
    deadline: Deadline,
    plan: RoutePlan,
) -> bytes:
    """Identical in-flight cacheable requests share one upstream call; the leader fills the cache.

    In this process followers await the leader's future; across replicas (a Redis store) the
    leader holds a lease in Redis and the others read its result from there.
    """
    flights = rt.flights
    if key in flights:
        rt.metrics.single_flight.inc()
        async with asyncio.timeout(deadline.remaining()):
            flight = await asyncio.shield(flights[key])
        _follow(ex, flight)
        return flight[0]
    future: asyncio.Future[Flight] = asyncio.get_running_loop().create_future()
    flights[key] = future
    try:
        led = False

        async def lead() -> Flight:
            nonlocal led
            led = True
            return await _lead(rt, ex, key, route, body, deadline, plan, True)

        if rt.fleet_flight is not None:
            flight = await _fleet_flight(rt, key, lead, deadline)
        else:
            flight = await lead()
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


async def _fleet_flight(
    rt: Runtime, key: str, lead: Callable[[], Awaitable[Flight]], deadline: Deadline
) -> Flight:
    """The cross-replica flight: the result travels through Redis as one small envelope."""
    assert rt.fleet_flight is not None

    async def call() -> bytes:
        payload, served_by, served_model, usage = await lead()
        return orjson.dumps(
            {"body": payload.decode(), "by": served_by, "model": served_model, "usage": usage}
        )

    try:
        envelope = orjson.loads(await rt.fleet_flight.run(key, call, wait_s=deadline.remaining()))
    except StoreError:
        rt.metrics.store_errors.labels("single_flight", "fail_open").inc()
        return await lead()
    return envelope["body"].encode(), envelope["by"], envelope["model"], envelope["usage"]


async def _lead(
    rt: Runtime,
    ex: Exchange,
    key: str,
    route: Route,
    body: dict[str, Any],
    deadline: Deadline,
    plan: RoutePlan,
    cacheable: bool,
) -> Flight:
    """The upstream call itself, its accounting, and (for the primary's answers) the cache."""
    spec, answer = await call_route(rt, ex, route, body, deadline, plan)
    served_model = rt.model_ids[spec.name]
    answer["model"] = served_model
    text_chars = 0  # of the cleaned answers: the completion's size when usage is missing
    clean = rt.output_filter.clean
    for choice in answer.get("choices") or ():
        message = choice.get("message") or {}
        content = message.get("content")
        if isinstance(content, str):
            content = message["content"] = clean(content)
            text_chars += len(content)
    ex.served_by, ex.served_model = spec.name, served_model
    if ex.route in rt.canaries:  # judged for the canary gate only
        choice = (answer.get("choices") or [{}])[0]
        ex.validation_failed = validation_failed(
            body,
            choice.get("finish_reason"),
            str((choice.get("message") or {}).get("content") or ""),
        )
    ex.usage = usage = _usage_of(answer, body, text_chars)
    given = answer.get("usage")
    if given != usage:  # the provider's usage, completed with ours (usually it already is)
        answer["usage"] = {**(given or {}), **usage}
    ex.cost = price(rt, served_model, usage["prompt_tokens"], usage["completion_tokens"])
    _account(rt, ex)
    payload = orjson.dumps(answer)
    if cacheable and spec.name == route.specs[0].name:
        try:
            await rt.stores.cache.put(
                key, payload, ttl_s=rt.config.cache.ttl_s, stale_ttl_s=rt.config.cache.stale_ttl_s
            )
        except StoreError:
            rt.metrics.store_errors.labels("cache", "fail_open").inc()
    return payload, ex.served_by, ex.served_model, ex.usage


def _account(rt: Runtime, ex: Exchange) -> None:
    spend, prompt, completion = rt.metrics.model_children(ex.served_model)
    usage = ex.usage
    spend.inc(ex.cost)
    prompt.inc(usage.get("prompt_tokens", 0))
    completion.inc(usage.get("completion_tokens", 0))


async def _stream_answer(
    rt: Runtime,
    ex: Exchange,
    route: Route,
    body: dict[str, Any],
    deadline: Deadline,
    plan: RoutePlan,
    send: Send,
    settle: Settlement,
    headers: Mapping[str, str],
) -> None:
    from tidegate.gateway.streaming import StreamWriter, relay

    started = rt.clock.now()
    opened = await open_stream(rt, ex, route, body, deadline, plan)
    ex.served_by = opened.spec.name
    ex.served_model = rt.provider_configs[opened.spec.name].model
    writer = StreamWriter(
        send,
        want_usage=bool((body.get("stream_options") or {}).get("include_usage")),
        clean=rt.output_filter.clean,
    )
    await writer.start(ex.answer_headers())
    ex.first_token_s = rt.clock.now() - started
    rt.metrics.ttft.labels(ex.route, ex.served_by).observe(ex.first_token_s)
    settle.served = True  # from here the caller receives (and is billed for) what is streamed
    try:
        await relay(
            rt,
            ex,
            writer,
            opened,
            route=route,
            body=body,
            deadline=deadline,
            plan=plan,
            reset_allowed=headers.get("x-tidegate-stream-reset", "").lower() == "allow",
        )
    finally:
        # Also on a disconnect: the caller is billed for what was streamed to it.
        ex.usage = _usage_of(
            {"usage": writer.usage} if writer.usage else {}, body, len(writer.text)
        )
        ex.cost = price(
            rt, ex.served_model, ex.usage["prompt_tokens"], ex.usage["completion_tokens"]
        )
        _account(rt, ex)
    if writer.finished:
        settle.stored = StoredResponse(
            200, writer.transcript(), {"content-type": "text/event-stream; charset=utf-8"}
        )


async def embeddings(
    rt: Runtime, ex: Exchange, headers: Mapping[str, str], body: dict[str, Any], send: Send
) -> None:
    """``POST /v1/embeddings``: identity, flags, rate limits, deadline, routing with failover."""
    try:
        identity = ex.identity  # the caller was identified before its body was read
        assert identity is not None
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidRequest("'model' must be a non-empty string")
        body["input"] = embeddings_input(body.get("input"))
        ex.route = model
        if model not in rt.routes:
            raise ModelNotFound(f"no model named {model!r}; GET /v1/models lists them")
        rt.keys.authorize(identity, model)
        check_answering(rt.flags)
        await apply_rate_limits(rt, identity)
        deadline = deadline_for(rt, headers)
        route = rt.routes[model]
        plan = plan_for(rt, route, identity)
        ex.skipped = plan.skipped
        if not plan.candidates:
            raise no_candidates(rt, plan, identity)
        last: ProviderError | None = None
        for spec in plan.candidates:
            provider = rt.providers[spec.name]
            upstream = {**body, "model": rt.provider_configs[spec.name].model}
            try:
                answer = await provider.embed(
                    upstream, timeout=deadline.cap(route.per_try_timeout_s)
                )
            except ProviderError as error:
                _record_failure(rt, ex, spec, error)
                last = error
                if not next_candidates(plan, spec, error):
                    break
                continue
            ex.tried.append((spec.name, None))
            ex.served_by = spec.name
            ex.served_model = upstream["model"]
            answer["model"] = ex.served_model
            await send_bytes(send, 200, orjson.dumps(answer), ex.answer_headers())
            return
        assert last is not None
        raise last
    except Exception as error:
        status, err_body, extra = http_error(error)
        ex.outcome, ex.status = str(err_body["error"]["code"]), status
        if status == 500:  # as in chat_completions: a bug, logged with its traceback
            log.exception("internal_error", request_id=ex.request_id)
        await send_bytes(
            send, status, orjson.dumps(err_body), [*ex.answer_headers(), *extra.items()]
        )


def new_request_id(headers: Mapping[str, str]) -> str:
    given = headers.get("x-request-id", "")
    if 0 < len(given) <= 128 and given.isprintable():
        return given
    return new_id()


def completion_chunks(answer: Mapping[str, Any], *, include_usage: bool) -> list[dict[str, Any]]:
    """A stored ``chat.completion`` replayed as ``chat.completion.chunk`` dicts."""
    base = {
        "id": answer.get("id"),
        "object": "chat.completion.chunk",
        "created": answer.get("created"),
        "model": answer.get("model"),
    }
    choice = (answer.get("choices") or [{}])[0]
    content = (choice.get("message") or {}).get("content") or ""
    finish = choice.get("finish_reason") or "stop"
    chunks: list[dict[str, Any]] = [
        {
            **base,
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            ],
        },
        {**base, "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]},
        {
            **base,
            "choices": [{"index": 0, "delta": {}, "finish_reason": finish}],
            "tidegate": answer.get("tidegate"),
        },
    ]
    if include_usage:
        chunks.append({**base, "choices": [], "usage": answer.get("usage")})
    return chunks


async def answer_degraded(
    rt: Runtime,
    ex: Exchange,
    identity: Identity,
    alias: str,
    body: dict[str, Any],
    stream: bool,
    send: Send,
    settle: Settlement,
    cause: Exception,
) -> bool:
    """Answer without a model: a stale cached answer, else cited excerpts; False if neither."""
    from tidegate.gateway.degraded import degraded_answer, degraded_chunks, question_of

    config = rt.config.degraded
    answer: dict[str, Any] | None = None
    source = ""
    if config.stale_cache and rt.config.cache.enabled:
        try:
            key = cache_key(identity, f"{alias}@{ex.version}", body)
            entry = await rt.stores.cache.get(key, allow_stale=True)
        except StoreError:
            rt.metrics.store_errors.labels("cache", "fail_open").inc()
            entry = None
        if entry is not None:
            answer = orjson.loads(entry.value)
            answer["tidegate"] = {
                "degraded": True,
                "source": "stale_cache",
                "stored_at": entry.stored_at,
            }
            source = "stale_cache"
    hits = []
    question = question_of(body)
    if answer is None and rt.corpus is not None:
        hits = rt.corpus.search(question, limit_per_doc=config.limit_per_doc, limit=config.limit)
        if hits:
            source = "corpus"
    if answer is None and not hits:
        return False
    rt.metrics.degraded.labels(source).inc()
    log.warning("degraded_answer", request_id=ex.request_id, source=source, cause=str(cause))
    ex.outcome, ex.status, ex.served_by = f"degraded_{source}", 200, "degraded"
    ex.cache = "stale" if source == "stale_cache" else ""
    settle.served = False  # nothing billable was produced: the reservation is refunded
    settle.stored = None  # and an idempotent retry may still get a real answer
    headers = [*ex.answer_headers(), ("x-tidegate-degraded", "true")]
    want_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    ident, created = f"chatcmpl-{ex.request_id}", int(rt.clock.wall())
    if not stream:
        if answer is None:
            answer = degraded_answer(
                question,
                hits,
                model_alias=alias,
                output_filter=rt.output_filter,
                id=ident,
                created=created,
            )
        await send_bytes(send, 200, orjson.dumps(answer), headers)
        return True
    if answer is None:
        chunks = degraded_chunks(
            question,
            hits,
            model_alias=alias,
            output_filter=rt.output_filter,
            id=ident,
            created=created,
            include_usage=want_usage,
        )
    else:
        chunks = completion_chunks(answer, include_usage=want_usage)
    await start_stream(send, headers)
    payload = b"".join(_sse(orjson.dumps(chunk)) for chunk in chunks) + _sse(b"[DONE]")
    await send({"type": "http.response.body", "body": payload, "more_body": False})
    return True
