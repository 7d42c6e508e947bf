"""The typed error tree, and the one table that maps each error to an HTTP answer.

::

    TidegateError
    ├── Rejected                    refused by a policy before any provider was called
    │   ├── RateLimited             429  rate_limited           a token bucket is empty
    │   ├── BudgetExceeded          429  budget_exceeded        a daily quota is spent
    │   ├── QueueFull               503  queue_full             the class queue or in-flight slots are full
    │   ├── DeadlineUnmeetable      503  deadline_unmeetable    the work ahead cannot clear before the deadline
    │   ├── BulkheadFull            503  bulkhead_full          the tenant's share of the process is in use
    │   ├── CircuitOpen             503  circuit_open           every candidate provider's breaker is open
    │   ├── Unavailable             503  unavailable            the kill switch or a flag turned answering off
    │   └── DeadlineExceeded        504  deadline_exceeded      the request's deadline passed (queue or call)
    ├── ProviderError               a provider failed; ``kind`` says how (see PROVIDER_ERROR_TABLE)
    ├── RequestError                the caller's request cannot be served as sent
    │   ├── InvalidRequest          400  invalid_request        malformed JSON, a bad field or header
    │   ├── ContextLengthExceeded   400  context_length_exceeded the prompt fits no provider's window
    │   ├── Unauthenticated         401  invalid_api_key        no key, or a key we do not know
    │   │   ├── KeyRevoked          401  key_revoked            the key was revoked
    │   │   └── KeyExpired          401  key_expired            the key expired (or was rotated)
    │   ├── Forbidden               403  forbidden              the key may not use this model or action
    │   ├── ModelNotFound           404  model_not_found        no route for the requested model
    │   ├── NotFound                404  not_found              no such path, or no such admin object
    │   ├── MethodNotAllowed        405  method_not_allowed     the path takes another method (see Allow)
    │   ├── RequestTimeout          408  request_timeout        the head or body did not arrive in time
    │   ├── IdempotencyConflict     409  idempotency_in_progress the same key is still running elsewhere
    │   ├── AlreadyDecided          409  already_decided        a pending action was approved or rejected before
    │   ├── ActionExpired           410  action_expired         a pending action expired undecided
    │   ├── PayloadTooLarge         413  payload_too_large      the body is over the configured limit
    │   ├── UnsupportedMediaType    415  unsupported_media_type the body is not JSON
    │   ├── IdempotencyMismatch     422  idempotency_key_reused the same key came with another body
    │   └── HeadersTooLarge         431  headers_too_large      too many headers, or too many bytes of them
    ├── StoreError                  503  store_unavailable      shared state did not answer (keeps the original)
    └── ShuttingDown                503  shutting_down          the drain time ended before the answer did

``ConfigError`` is not an answer to a request: it stops the process at start-up, naming the key.

Every rejection carries ``retry_after`` (seconds, or ``None`` where waiting does not help) and
the ``policy`` that refused. :func:`http_error` turns any of them into ``(status, body, headers)``
with the body ``{"error": {"type", "code", "message", "retryable"}}``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

__all__ = [
    "ERROR_TABLE",
    "PROVIDER_ERROR_TABLE",
    "ActionExpired",
    "AlreadyDecided",
    "BudgetExceeded",
    "BulkheadFull",
    "CircuitOpen",
    "ConfigError",
    "ContextLengthExceeded",
    "DeadlineExceeded",
    "DeadlineUnmeetable",
    "ErrorSpec",
    "ErrorType",
    "Forbidden",
    "HeadersTooLarge",
    "IdempotencyConflict",
    "IdempotencyMismatch",
    "InvalidRequest",
    "KeyExpired",
    "KeyRevoked",
    "MethodNotAllowed",
    "ModelNotFound",
    "NotFound",
    "PayloadTooLarge",
    "ProviderError",
    "ProviderErrorKind",
    "QueueFull",
    "RateLimited",
    "Rejected",
    "RequestError",
    "RequestTimeout",
    "ShuttingDown",
    "StoreError",
    "TidegateError",
    "Unauthenticated",
    "Unavailable",
    "UnsupportedMediaType",
    "error_body",
    "http_error",
    "spec_for",
]


class ErrorType(StrEnum):
    """The ``error.type`` field: broad families a client can switch on."""

    INVALID_REQUEST = "invalid_request_error"
    AUTHENTICATION = "authentication_error"
    PERMISSION = "permission_error"
    NOT_FOUND = "not_found_error"
    CONFLICT = "conflict_error"
    RATE_LIMIT = "rate_limit_error"
    OVERLOADED = "overloaded_error"
    UNAVAILABLE = "unavailable_error"
    TIMEOUT = "timeout_error"
    UPSTREAM = "upstream_error"
    CANCELLED = "cancelled_error"


@dataclass(frozen=True, slots=True)
class ErrorSpec:
    """How one error code is answered over HTTP."""

    status: int
    type: ErrorType
    retryable: bool
    meaning: str


class TidegateError(Exception):
    """Base of every error tidegate raises on purpose."""

    #: The stable machine-readable code; the key into ``ERROR_TABLE``.
    code: str = "internal_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @property
    def retry_after(self) -> float | None:
        return None


# --------------------------------------------------------------------------- rejections


class Rejected(TidegateError):
    """A policy refused the request; catch this to handle every refusal in one place."""

    def __init__(
        self,
        message: str,
        *,
        policy: str,
        retry_after: float | None = None,
        reason: str = "",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.policy = policy
        self.reason = reason or self.code
        self._retry_after = retry_after
        #: Response headers the refusing policy adds (a rate limit's ``RateLimit`` fields).
        self.headers: dict[str, str] = dict(headers or {})

    @property
    def retry_after(self) -> float | None:
        return self._retry_after

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.message!r}, policy={self.policy!r}, "
            f"retry_after={self._retry_after!r})"
        )


class RateLimited(Rejected):
    code = "rate_limited"


class BudgetExceeded(Rejected):
    code = "budget_exceeded"


class QueueFull(Rejected):
    code = "queue_full"


class DeadlineUnmeetable(Rejected):
    code = "deadline_unmeetable"


class BulkheadFull(Rejected):
    code = "bulkhead_full"


class CircuitOpen(Rejected):
    code = "circuit_open"


class Unavailable(Rejected):
    code = "unavailable"


class DeadlineExceeded(Rejected):
    code = "deadline_exceeded"


# --------------------------------------------------------------------------- providers


class ProviderErrorKind(StrEnum):
    """How a provider call failed, whatever the provider's own status or body said."""

    TIMEOUT = "timeout"
    RATE_LIMITED = "rate_limited"
    OVERLOADED = "overloaded"
    SERVER = "server"
    CONNECTION = "connection"
    NOT_FOUND = "not_found"
    BAD_REQUEST = "bad_request"
    CONTEXT_LENGTH = "context_length"
    CONTENT_FILTER = "content_filter"
    AUTH = "auth"
    CANCELLED = "cancelled"
    MALFORMED = "malformed"


class ProviderError(TidegateError):
    """A provider call failed. ``retryable`` defaults from the kind; a provider may override it."""

    def __init__(
        self,
        kind: ProviderErrorKind | str,
        message: str,
        *,
        provider: str = "",
        retryable: bool | None = None,
        retry_after: float | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = ProviderErrorKind(kind)
        self.provider = provider
        self.retryable = (
            PROVIDER_ERROR_TABLE[self.kind].retryable if retryable is None else retryable
        )
        self._retry_after = retry_after
        self.status = status
        self.code = f"provider_{self.kind.value}"

    @property
    def retry_after(self) -> float | None:
        return self._retry_after

    def __repr__(self) -> str:
        return (
            f"ProviderError({self.kind.value!r}, {self.message!r}, provider={self.provider!r}, "
            f"retryable={self.retryable!r}, retry_after={self._retry_after!r})"
        )


# --------------------------------------------------------------------------- the caller's request


class RequestError(TidegateError):
    """The request cannot be served as sent; retrying it unchanged will not help."""


class InvalidRequest(RequestError):
    code = "invalid_request"


class ContextLengthExceeded(RequestError):
    """The prompt and ``max_tokens`` exceed every route provider's known context window."""

    code = "context_length_exceeded"


class Unauthenticated(RequestError):
    code = "invalid_api_key"


class KeyRevoked(Unauthenticated):
    """A known key that an operator revoked."""

    code = "key_revoked"


class KeyExpired(Unauthenticated):
    """A known key past its expiry, or a rotated key past its grace period."""

    code = "key_expired"


class Forbidden(RequestError):
    code = "forbidden"


class ModelNotFound(RequestError):
    code = "model_not_found"


class NotFound(RequestError):
    code = "not_found"


class MethodNotAllowed(RequestError):
    """The path exists, with other methods; ``allow`` lists them for the ``Allow`` header."""

    code = "method_not_allowed"

    def __init__(self, message: str, *, allow: str) -> None:
        super().__init__(message)
        self.allow = allow


class AlreadyDecided(RequestError):
    code = "already_decided"


class ActionExpired(RequestError):
    code = "action_expired"


class IdempotencyConflict(RequestError):
    code = "idempotency_in_progress"

    def __init__(self, message: str, *, retry_after: float | None = 1.0) -> None:
        super().__init__(message)
        self._retry_after = retry_after

    @property
    def retry_after(self) -> float | None:
        return self._retry_after


class RequestTimeout(RequestError):
    """The request's head or body did not arrive in time (answered by the connection itself)."""

    code = "request_timeout"


class PayloadTooLarge(RequestError):
    code = "payload_too_large"


class HeadersTooLarge(RequestError):
    """Too many header fields, or the request line and headers are over the byte limit."""

    code = "headers_too_large"


class UnsupportedMediaType(RequestError):
    code = "unsupported_media_type"


class IdempotencyMismatch(RequestError):
    code = "idempotency_key_reused"


# --------------------------------------------------------------------------- infrastructure


class StoreError(TidegateError):
    """Shared state did not answer in time or failed; ``original`` keeps the driver's exception."""

    code = "store_unavailable"

    def __init__(
        self, message: str, *, original: BaseException | None = None, retry_after: float = 1.0
    ) -> None:
        super().__init__(message)
        self.original = original
        self._retry_after = retry_after

    @property
    def retry_after(self) -> float | None:
        return self._retry_after


class ShuttingDown(TidegateError):
    """The replica's drain time ended before the request's answer did; another replica can."""

    code = "shutting_down"

    @property
    def retry_after(self) -> float | None:
        return 1.0


class ConfigError(TidegateError):
    """The configuration cannot be used; raised at start-up, never while serving."""

    code = "config_error"


# --------------------------------------------------------------------------- the table

T = ErrorType

ERROR_TABLE: Final[Mapping[str, ErrorSpec]] = {
    # rejections by a policy
    "rate_limited": ErrorSpec(429, T.RATE_LIMIT, True, "a rate limit's token bucket is empty"),
    "budget_exceeded": ErrorSpec(429, T.RATE_LIMIT, True, "a daily budget is spent"),
    "queue_full": ErrorSpec(503, T.OVERLOADED, True, "the class queue or in-flight slots are full"),
    "deadline_unmeetable": ErrorSpec(
        503, T.OVERLOADED, True, "the work ahead cannot clear before the request's deadline"
    ),
    "bulkhead_full": ErrorSpec(
        503, T.OVERLOADED, True, "the tenant's share of the process is in use"
    ),
    "circuit_open": ErrorSpec(
        503, T.UNAVAILABLE, True, "every candidate provider's breaker is open"
    ),
    "unavailable": ErrorSpec(503, T.UNAVAILABLE, True, "answering is switched off (kill switch)"),
    "deadline_exceeded": ErrorSpec(504, T.TIMEOUT, True, "the request's deadline passed"),
    # the caller's request
    "invalid_request": ErrorSpec(
        400, T.INVALID_REQUEST, False, "malformed JSON, a bad field or header"
    ),
    "context_length_exceeded": ErrorSpec(
        400, T.INVALID_REQUEST, False, "the prompt and max_tokens fit no provider's context window"
    ),
    "invalid_api_key": ErrorSpec(401, T.AUTHENTICATION, False, "missing or unknown API key"),
    "key_revoked": ErrorSpec(401, T.AUTHENTICATION, False, "the API key was revoked"),
    "key_expired": ErrorSpec(
        401, T.AUTHENTICATION, False, "the API key expired, or was rotated and its grace ended"
    ),
    "forbidden": ErrorSpec(403, T.PERMISSION, False, "the key may not use this model or action"),
    "model_not_found": ErrorSpec(404, T.NOT_FOUND, False, "no route for the requested model"),
    "not_found": ErrorSpec(404, T.NOT_FOUND, False, "no such path, or no such admin object"),
    "method_not_allowed": ErrorSpec(
        405, T.INVALID_REQUEST, False, "the path takes another method (the Allow header names it)"
    ),
    "already_decided": ErrorSpec(
        409, T.CONFLICT, False, "the pending action was approved or rejected before"
    ),
    "action_expired": ErrorSpec(
        410, T.INVALID_REQUEST, False, "the pending action expired undecided"
    ),
    "idempotency_in_progress": ErrorSpec(
        409, T.CONFLICT, True, "a request with this Idempotency-Key is still running"
    ),
    "request_timeout": ErrorSpec(
        408, T.TIMEOUT, True, "the request's head or body did not arrive in time"
    ),
    "payload_too_large": ErrorSpec(
        413, T.INVALID_REQUEST, False, "the body is over the size limit"
    ),
    "unsupported_media_type": ErrorSpec(415, T.INVALID_REQUEST, False, "the body is not JSON"),
    "idempotency_key_reused": ErrorSpec(
        422, T.INVALID_REQUEST, False, "the Idempotency-Key was used with another request body"
    ),
    "headers_too_large": ErrorSpec(
        431, T.INVALID_REQUEST, False, "too many headers, or the request head is too large"
    ),
    # infrastructure
    "store_unavailable": ErrorSpec(503, T.UNAVAILABLE, True, "shared state did not answer"),
    "shutting_down": ErrorSpec(
        503, T.UNAVAILABLE, True, "the replica's drain time ended before the answer was ready"
    ),
    "internal_error": ErrorSpec(
        500, T.UPSTREAM, True, "a bug in tidegate; the log has the details"
    ),
}

K = ProviderErrorKind

#: Provider failures, by kind: the status the caller sees and whether retrying can help.
PROVIDER_ERROR_TABLE: Final[Mapping[ProviderErrorKind, ErrorSpec]] = {
    K.TIMEOUT: ErrorSpec(504, T.TIMEOUT, True, "the provider did not answer in time"),
    K.RATE_LIMITED: ErrorSpec(429, T.RATE_LIMIT, True, "the provider is rate limiting us"),
    K.OVERLOADED: ErrorSpec(503, T.OVERLOADED, True, "the provider says it is overloaded"),
    K.SERVER: ErrorSpec(502, T.UPSTREAM, True, "the provider failed (5xx)"),
    K.CONNECTION: ErrorSpec(502, T.UPSTREAM, True, "the connection to the provider failed"),
    K.NOT_FOUND: ErrorSpec(502, T.UPSTREAM, False, "the provider does not know the model"),
    K.BAD_REQUEST: ErrorSpec(400, T.INVALID_REQUEST, False, "the provider rejected the request"),
    K.CONTEXT_LENGTH: ErrorSpec(
        400, T.INVALID_REQUEST, False, "the prompt is longer than the model's context window"
    ),
    K.CONTENT_FILTER: ErrorSpec(
        400, T.INVALID_REQUEST, False, "the provider's content filter refused the request"
    ),
    K.AUTH: ErrorSpec(
        502, T.UPSTREAM, False, "tidegate's credentials for the provider were refused"
    ),
    K.CANCELLED: ErrorSpec(499, T.CANCELLED, False, "the caller went away; the call was cancelled"),
    K.MALFORMED: ErrorSpec(
        502, T.UPSTREAM, True, "the provider's 2xx could not be parsed or was not an answer"
    ),
}


def spec_for(error: BaseException) -> ErrorSpec:
    """The one table row that answers ``error``; anything unknown is an internal error (500)."""
    if isinstance(error, ProviderError):
        return PROVIDER_ERROR_TABLE[error.kind]
    if isinstance(error, TidegateError):
        return ERROR_TABLE.get(error.code, ERROR_TABLE["internal_error"])
    return ERROR_TABLE["internal_error"]


def _code(error: BaseException) -> str:
    return error.code if isinstance(error, TidegateError) else "internal_error"


def error_body(error: BaseException) -> dict[str, dict[str, object]]:
    """The JSON body for ``error``: ``{"error": {"type", "code", "message", "retryable"}}``."""
    spec = spec_for(error)
    retryable = error.retryable if isinstance(error, ProviderError) else spec.retryable
    message = error.message if isinstance(error, TidegateError) else "internal error"
    return {
        "error": {
            "type": spec.type.value,
            "code": _code(error),
            "message": message,
            "retryable": retryable,
        }
    }


def http_error(error: BaseException) -> tuple[int, dict[str, dict[str, object]], dict[str, str]]:
    """``(status, body, headers)`` for ``error``: ``Retry-After`` in whole seconds, rounded up,
    and any headers a refusing policy attached."""
    spec = spec_for(error)
    headers: dict[str, str] = {}
    retry_after = error.retry_after if isinstance(error, TidegateError) else None
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    if isinstance(error, Rejected):
        headers.update(error.headers)
    elif isinstance(error, MethodNotAllowed):
        headers["Allow"] = error.allow
    return spec.status, error_body(error), headers
