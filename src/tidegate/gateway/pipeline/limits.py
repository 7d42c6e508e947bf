"""Step 3, rate limit: a token bucket per user and one per tenant (and one per virtual key that
has a limit of its own: :mod:`tidegate.gateway.keys`), in the shared store (taken a
few requests at a time: :mod:`tidegate.state.leases`). A refusal is 429 with ``Retry-After`` and
the IETF ``RateLimit`` / ``RateLimit-Policy`` headers; a store that does not answer fails open to
a bucket in this process, counted and logged."""

from __future__ import annotations

import math

from tidegate.errors import RateLimited, StoreError
from tidegate.gateway.pipeline.request import Request
from tidegate.gateway.pipeline.steps import Outcome
from tidegate.policy.ratelimit import BucketOptions, TakeResult, ratelimit_headers

__all__ = ["rate_limit"]

#: One bucket a request takes from: its options (None: not limited), key and name.
_Level = tuple[BucketOptions | None, str, str]


def rate_limit(request: Request) -> Outcome:
    """Take a token from the key's bucket (a virtual key with a limit of its own), the user's,
    then the tenant's: from this process's leases while they hold one (no store call, no
    coroutine: the usual case), else from the store (in one SQLite batch) for the rest."""
    rt, identity = request.rt, request.identity
    take_now = rt.stores.take_now
    # Level by level, without the levels' tuples (built only when the store is asked).
    per_key, per_user, per_tenant = identity.rate_limit, rt.user_bucket, rt.tenant_bucket
    if per_key is not None and take_now(identity.key_bucket, per_key) is None:
        return _from_store(request, 0)
    if per_user is not None and take_now(identity.user_bucket, per_user) is None:
        return _from_store(request, 1)
    if per_tenant is not None and take_now(identity.tenant_bucket, per_tenant) is None:
        return _from_store(request, 2)
    return False


def _levels(request: Request) -> tuple[_Level, ...]:
    """The buckets the request takes from, in order: options (None: not limited), key, name."""
    rt, identity = request.rt, request.identity
    return (
        (identity.rate_limit, identity.key_bucket, "per-key"),
        (rt.user_bucket, identity.user_bucket, "per-user"),
        (rt.tenant_bucket, identity.tenant_bucket, "per-tenant"),
    )


async def _from_store(request: Request, first: int) -> bool:
    """The takes a lease could not answer, from level ``first`` on, in order; the first refusal
    is the answer."""
    rt = request.rt
    with rt.stores.batch():  # committed with the budget's, before anything acts on them
        for options, key, name in _levels(request)[first:]:
            if options is None:
                continue
            try:
                result = await rt.stores.buckets.take(key, options)
            except StoreError as exc:
                result = await rt.take_failing_open(key, options, exc)
            if not result.allowed:
                raise _rate_limited(options, result, name)
    return False


def _rate_limited(options: BucketOptions, result: TakeResult, name: str) -> RateLimited:
    retry_after = result.retry_after if not math.isinf(result.retry_after) else None
    return RateLimited(
        f"{name} rate limit: {options.burst:g} requests, refilling {options.rate:g}/s",
        policy="ratelimit",
        retry_after=retry_after,
        reason=name,
        headers=ratelimit_headers(options, result, policy_name=name),
    )
