"""The OpenAPI description served at ``/openapi.json``: the routes, headers and error body."""

from __future__ import annotations

from typing import Any, Final

from tidegate import __version__

__all__ = ["OPENAPI"]

_ERROR = {"$ref": "#/components/schemas/Error"}


def _errors(*statuses: int) -> dict[str, Any]:
    return {
        str(s): {"description": "error", "content": {"application/json": {"schema": _ERROR}}}
        for s in statuses
    }


_REQUEST_HEADERS = [
    {
        "name": "Authorization",
        "in": "header",
        "required": True,
        "schema": {"type": "string"},
        "description": "Bearer <API key>",
    },
    {
        "name": "X-Request-ID",
        "in": "header",
        "schema": {"type": "string", "maxLength": 128},
        "description": "Taken if given, made if not; returned on every answer.",
    },
    {
        "name": "Idempotency-Key",
        "in": "header",
        "schema": {"type": "string", "maxLength": 255},
        "description": "Replays a completed answer; another body with the same key is 422.",
    },
    {
        "name": "X-Tidegate-Deadline-Ms",
        "in": "header",
        "schema": {"type": "integer", "minimum": 1},
        "description": "Shortens (never lengthens) the request's deadline.",
    },
    {
        "name": "X-Tidegate-Priority",
        "in": "header",
        "schema": {"type": "string"},
        "description": "Lowers (never raises) the admission class of the key.",
    },
]

OPENAPI: Final[dict[str, Any]] = {
    "openapi": "3.1.0",
    "info": {
        "title": "tidegate",
        "version": __version__,
        "description": "OpenAI-compatible gateway with bounded queues and honest errors.",
    },
    "paths": {
        "/v1/chat/completions": {
            "post": {
                "summary": "Chat completion (JSON, or server-sent events with stream: true)",
                "parameters": _REQUEST_HEADERS,
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "required": ["model", "messages"],
                                "properties": {
                                    "model": {"type": "string"},
                                    "messages": {
                                        "type": "array",
                                        "minItems": 1,
                                        "items": {"type": "object"},
                                    },
                                    "stream": {"type": "boolean"},
                                    "stream_options": {"type": "object"},
                                    "max_tokens": {"type": "integer", "minimum": 1},
                                },
                            }
                        }
                    },
                },
                "responses": {
                    "200": {
                        "description": "the answer; headers X-Tidegate-Served-By and "
                        "X-Tidegate-Tried say who served it and what was tried",
                        "content": {
                            "application/json": {"schema": {"type": "object"}},
                            "text/event-stream": {"schema": {"type": "string"}},
                        },
                    },
                    **_errors(400, 401, 403, 404, 409, 413, 415, 422, 429, 502, 503, 504),
                },
            }
        },
        "/v1/embeddings": {
            "post": {
                "summary": "Embeddings",
                "parameters": _REQUEST_HEADERS,
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {"type": "object", "required": ["model", "input"]}
                        }
                    },
                },
                "responses": {
                    "200": {"description": "embeddings"},
                    **_errors(400, 401, 403, 404, 429, 502, 503, 504),
                },
            }
        },
        "/v1/models": {
            "get": {"summary": "Model aliases", "responses": {"200": {"description": "list"}}}
        },
        "/healthz": {
            "get": {
                "summary": "Liveness: touches nothing",
                "responses": {"200": {"description": "alive"}},
            }
        },
        "/readyz": {
            "get": {
                "summary": "Readiness: state store and providers",
                "responses": {"200": {"description": "ready"}, "503": {"description": "not ready"}},
            }
        },
        "/metrics": {
            "get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "text"}}}
        },
        "/version": {
            "get": {
                "summary": "Version and git sha",
                "responses": {"200": {"description": "version"}},
            }
        },
    },
    "components": {
        "schemas": {
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
            }
        }
    },
}
