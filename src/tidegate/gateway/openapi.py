"""The OpenAPI description served at ``/openapi.json``: the routes, headers and error body.

The request schemas say what the gateway checks and no more (``validate_chat`` and the
embeddings handler, ``read_json``, the header checks): a request the document accepts is one
the gateway serves or refuses for a reason no schema can know (an unknown alias, a spent
budget), and one it refuses is one the gateway answers with a 4xx. Every status each route can
answer is listed with its body. ``tests/gateway/test_openapi.py`` holds the gateway to it with
schemathesis, on a live server.
"""

from __future__ import annotations

from typing import Any, Final

from tidegate import __version__
from tidegate.gateway.http import MAX_JSON_DEPTH
from tidegate.gateway.pipeline import MAX_CHOICES, MAX_INTEGER

__all__ = ["OPENAPI"]

_JSON = "application/json"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _header(description: str, schema: dict[str, Any], *, required: bool = False) -> dict[str, Any]:
    return {"description": description, "required": required, "schema": schema}


_STRING = {"type": "string"}
_REQUEST_ID = _header("The request id: the caller's X-Request-ID, or one made.", _STRING)
_RETRY_AFTER = _header(
    "Whole seconds to wait before trying again, rounded up.",
    {"type": "string", "pattern": "^[0-9]+$"},
)
#: Headers any answer of a model route may carry, success or error.
_EXCHANGE_HEADERS = {
    "X-Request-ID": {**_REQUEST_ID, "required": True},
    "X-Tidegate-Served-By": _header("The provider that served the answer.", _STRING),
    "X-Tidegate-Tried": _header(
        "Every attempt in order, then every provider skipped: name=outcome, comma-separated.",
        _STRING,
    ),
    "X-Tidegate-Cache": _header(
        "How the cache took part.",
        {"type": "string", "enum": ["miss", "hit", "shared", "stale", "idempotent-replay"]},
    ),
    "X-Tidegate-Budget": _header(
        "Degraded by a budget: a lower max_tokens or a cheaper route.",
        {"type": "string", "enum": ["degraded"]},
    ),
    "X-Tidegate-Version": _header(
        "The canary version that served.", {"type": "string", "enum": ["baseline", "candidate"]}
    ),
}
_ERROR_HEADERS = {
    **_EXCHANGE_HEADERS,
    "Retry-After": _RETRY_AFTER,
    "RateLimit-Policy": _header("The rate limit that refused (IETF structured field).", _STRING),
    "RateLimit": _header("What is left of it, and when it refills.", _STRING),
}

_ERROR_MEANINGS = {
    400: "invalid_request, or the provider refused the request (bad request, context length, "
    "content filter)",
    401: "invalid_api_key: no key, or a key the gateway does not know",
    403: "forbidden: the key may not use this model, or no provider may receive its data class",
    404: "model_not_found: no route for the requested model",
    409: "idempotency_in_progress: a request with this Idempotency-Key is still running",
    413: "payload_too_large: the body is over server.max_body_bytes",
    415: "unsupported_media_type: the Content-Type is not application/json",
    422: "idempotency_key_reused: the Idempotency-Key came with another body",
    429: "rate_limited, budget_exceeded, or the provider is rate limiting",
    500: "internal_error: a bug in tidegate; the log has its traceback",
    502: "the provider failed, could not be reached, or answered what could not be parsed",
    503: "refused by admission, the breakers, the kill switch or the state store; or the "
    "provider is overloaded",
    504: "the request's deadline passed, or the provider did not answer in time",
}


def _errors(*statuses: int, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        str(status): {
            "description": _ERROR_MEANINGS[status],
            "headers": _ERROR_HEADERS if headers is None else headers,
            "content": {_JSON: {"schema": _ref("Error")}},
        }
        for status in statuses
    }


def _json(description: str, schema: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"description": description, "content": {_JSON: {"schema": schema}}, **extra}


def _param(name: str, description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "header", "description": description, "schema": schema}


_X_REQUEST_ID = _param(
    "X-Request-ID",
    "Taken as the request id if 1-128 printable characters, else one is made; returned on "
    "every answer.",
    _STRING,
)
_DEADLINE = _param(
    "X-Tidegate-Deadline-Ms",
    "Shortens (never lengthens) the request's deadline to this many milliseconds: decimal "
    "digits, at least 1.",
    {"type": "integer", "minimum": 1},
)
_CHAT_HEADERS = [
    _X_REQUEST_ID,
    _param(
        "Idempotency-Key",
        "Replays a completed answer to the same caller (tenant and user) with the same body; "
        "another body with the same key is 422, a twin still running 409.",
        {"type": "string", "minLength": 1, "maxLength": 255},
    ),
    _DEADLINE,
    _param(
        "X-Tidegate-Priority",
        "Lowers (never raises) the admission class of the key; an unknown class is ignored.",
        _STRING,
    ),
    _param(
        "X-Tidegate-Stream-Reset",
        "allow: a stream broken mid-answer may restart with an 'event: reset'; else ignored.",
        _STRING,
    ),
]
_EMBEDDINGS_HEADERS = [_X_REQUEST_ID, _DEADLINE]
_BEARER: list[dict[str, list[str]]] = [{"bearer": []}]
_UNAUTHENTICATED = {
    "401": _json(_ERROR_MEANINGS[401], _ref("Error")),
}

_BODY_NOTE = (
    " The body is a JSON object (415 unless sent as application/json) nested at most "
    f"{MAX_JSON_DEPTH} levels deep. An integer written 2.0 is sent on as 2; true is not one. "
    "Other fields pass to the provider."
)

_CHAT_REQUEST: dict[str, Any] = {
    "type": "object",
    "description": "An OpenAI chat completion request; the gateway checks these fields."
    + _BODY_NOTE,
    "required": ["model", "messages"],
    "properties": {
        "model": {"type": "string", "minLength": 1, "description": "a route alias"},
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role"],
                "properties": {"role": {"type": "string"}},
            },
        },
        "stream": {"type": "boolean"},
        "stream_options": {
            "type": ["object", "null"],
            "properties": {"include_usage": {"type": "boolean"}},
        },
        "max_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_INTEGER},
        "n": {
            "type": ["integer", "null"],
            "minimum": 1,
            "maximum": MAX_CHOICES,
            "description": "completions to return; above 1 is refused on a route whose primary "
            "is an Anthropic provider",
        },
    },
}
_TOKEN = {"type": "integer", "minimum": 0, "maximum": MAX_INTEGER, "description": "a token id"}
_EMBEDDINGS_REQUEST: dict[str, Any] = {
    "type": "object",
    "description": "An OpenAI embeddings request; the gateway checks these fields." + _BODY_NOTE,
    "required": ["model", "input"],
    "properties": {
        "model": {"type": "string", "minLength": 1, "description": "a route alias"},
        "input": {
            "oneOf": [
                {"type": "string"},
                {"type": "array", "minItems": 1, "items": {"type": "string"}},
                {"type": "array", "minItems": 1, "items": _TOKEN},
                {
                    "type": "array",
                    "minItems": 1,
                    "items": {"type": "array", "minItems": 1, "items": _TOKEN},
                },
            ]
        },
        "encoding_format": {
            "enum": ["float", "base64", None],
            "description": "how the vectors are written (the gateway encodes them): float "
            "arrays (the default), or base64 of their float32 values, little-endian",
        },
        "dimensions": {
            "type": ["integer", "null"],
            "minimum": 1,
            "maximum": MAX_INTEGER,
            "description": "passed to the provider (models that can shorten their vectors)",
        },
    },
}
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer", "minimum": 0},
        "completion_tokens": {"type": "integer", "minimum": 0},
        "total_tokens": {"type": "integer", "minimum": 0},
    },
}
_CHAT_COMPLETION = {
    "type": "object",
    "description": "The provider's chat.completion; model is the model id that served it, "
    "and usage is completed by the gateway when the provider left it out.",
    "required": ["model", "usage"],
    "properties": {
        "id": {"type": "string"},
        "object": {"type": "string"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {"type": "array", "items": {"type": "object"}},
        "usage": _USAGE,
    },
}
#: One server-sent event of a streamed answer (each event, as OpenAPI 3.1 reads the schema of
#: text/event-stream); docs/streaming.md shows whole streams.
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "event": {
            "enum": ["message", "reset"],
            "description": "message (the default, unnamed); reset: the answer restarts (asked "
            "for with X-Tidegate-Stream-Reset)",
        },
        "data": {
            "anyOf": [
                {"const": "[DONE]", "description": "the answer is complete"},
                {
                    "type": "string",
                    "contentMediaType": _JSON,
                    "contentSchema": {
                        "type": "object",
                        "description": "a chat.completion.chunk; after event: reset, the "
                        "reason; a stream that breaks ends with an error object (code "
                        "stream_incomplete) and no [DONE]",
                    },
                },
            ]
        },
    },
}
_EMBEDDING_LIST = {
    "type": "object",
    "description": "The provider's embeddings answer; model is the model id that served it.",
    "required": ["model"],
    "properties": {"model": {"type": "string"}, "data": {"type": "array"}},
}
_MODEL = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "model"},
        "created": {"type": "integer"},
        "owned_by": {"type": "string"},
    },
}
_MODEL_LIST = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _MODEL}},
}
_READINESS = {
    "type": "object",
    "required": ["status", "problems", "state_store", "providers", "breakers"],
    "properties": {
        "status": {"enum": ["ready", "not_ready"]},
        "problems": {"type": "array", "items": {"type": "string"}},
        "state_store": {"type": "string"},
        "providers": {"type": "array", "items": {"type": "string"}},
        "breakers": {
            "type": "object",
            "additionalProperties": {"enum": ["closed", "open", "half_open"]},
        },
    },
}

OPENAPI: Final[dict[str, Any]] = {
    "openapi": "3.1.0",
    "info": {
        "title": "tidegate",
        "version": __version__,
        "description": "OpenAI-compatible gateway with bounded queues and honest errors. "
        "Another method on a known path is 405 with Allow; an unknown path is 404.",
    },
    "paths": {
        "/v1/chat/completions": {
            "post": {
                "summary": "Chat completion (JSON, or server-sent events with stream: true)",
                "security": _BEARER,
                "parameters": _CHAT_HEADERS,
                "requestBody": {
                    "required": True,
                    "content": {_JSON: {"schema": _ref("ChatCompletionRequest")}},
                },
                "responses": {
                    "200": {
                        "description": "the answer; headers X-Tidegate-Served-By and "
                        "X-Tidegate-Tried say who served it and what was tried",
                        "headers": {
                            **_EXCHANGE_HEADERS,
                            "X-Tidegate-Degraded": _header(
                                "No model could answer: a stale cached answer or cited excerpts.",
                                {"type": "string", "enum": ["true"]},
                            ),
                            "Idempotent-Replayed": _header(
                                "The stored answer of an earlier request with this key.",
                                {"type": "string", "enum": ["true"]},
                            ),
                        },
                        "content": {
                            _JSON: {"schema": _ref("ChatCompletion")},
                            "text/event-stream": {"schema": _SSE_EVENT},
                        },
                    },
                    **_errors(400, 401, 403, 404, 409, 413, 415, 422, 429, 500, 502, 503, 504),
                },
            }
        },
        "/v1/embeddings": {
            "post": {
                "summary": "Embeddings",
                "security": _BEARER,
                "parameters": _EMBEDDINGS_HEADERS,
                "requestBody": {
                    "required": True,
                    "content": {_JSON: {"schema": _ref("EmbeddingsRequest")}},
                },
                "responses": {
                    "200": _json("embeddings", _ref("EmbeddingList"), headers=_EXCHANGE_HEADERS),
                    **_errors(400, 401, 403, 404, 413, 415, 429, 500, 502, 503, 504),
                },
            }
        },
        "/v1/models": {
            "get": {
                "summary": "The model aliases the caller's key may use",
                "security": _BEARER,
                "responses": {"200": _json("list", _ref("ModelList")), **_UNAUTHENTICATED},
            }
        },
        "/v1/models/{model}": {
            "get": {
                "summary": "One model alias the caller's key may use (404 for any other)",
                "security": _BEARER,
                "parameters": [
                    {
                        "name": "model",
                        "in": "path",
                        "required": True,
                        "description": "a route alias",
                        "schema": {"type": "string"},
                    }
                ],
                "responses": {
                    "200": _json("the model", _MODEL),
                    **_UNAUTHENTICATED,
                    **_errors(404, headers={}),
                },
            }
        },
        "/healthz": {
            "get": {
                "summary": "Liveness: touches nothing",
                "security": [],
                "responses": {
                    "200": _json(
                        "alive",
                        {
                            "type": "object",
                            "required": ["status"],
                            "properties": {"status": {"const": "ok"}},
                        },
                    )
                },
            }
        },
        "/readyz": {
            "get": {
                "summary": "Readiness: state store and providers",
                "security": [],
                "responses": {
                    "200": _json("ready", _READINESS),
                    "503": _json("not ready: problems says why", _READINESS),
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "security": [],
                "responses": {
                    "200": {
                        "description": "the text exposition format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/version": {
            "get": {
                "summary": "Version and git sha",
                "security": [],
                "responses": {
                    "200": _json(
                        "version",
                        {
                            "type": "object",
                            "required": ["version", "git_sha"],
                            "properties": {"version": _STRING, "git_sha": _STRING},
                        },
                    )
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This document",
                "security": [],
                "responses": {"200": _json("OpenAPI 3.1", {"type": "object"})},
            }
        },
    },
    "components": {
        "securitySchemes": {
            "bearer": {
                "type": "http",
                "scheme": "bearer",
                "description": "A tidegate API key: Authorization: Bearer <key>. Checked "
                "before the body is read.",
            }
        },
        "schemas": {
            "ChatCompletionRequest": _CHAT_REQUEST,
            "ChatCompletion": _CHAT_COMPLETION,
            "EmbeddingsRequest": _EMBEDDINGS_REQUEST,
            "EmbeddingList": _EMBEDDING_LIST,
            "ModelList": _MODEL_LIST,
            "Error": {
                "type": "object",
                "required": ["error"],
                "properties": {
                    "error": {
                        "type": "object",
                        "required": ["type", "code", "message", "retryable"],
                        "properties": {
                            "type": {"type": "string"},
                            "code": {"type": "string"},
                            "message": {"type": "string"},
                            "retryable": {"type": "boolean"},
                        },
                    }
                },
            },
        },
    },
}
