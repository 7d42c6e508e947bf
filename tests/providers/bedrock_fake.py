"""A fake of bedrock-runtime's wire protocol on loopback, for the Bedrock provider's tests.

It speaks what Bedrock speaks: ``POST /model/{modelId}/converse`` answers JSON and
``/converse-stream`` answers AWS event-stream frames; errors carry ``X-Amzn-ErrorType``. Every
request is checked as Bedrock would check it, with botocore's own code:

- the SigV4 signature is computed again from the received request with the test credentials
  (``botocore.auth.SigV4Auth``) and compared; a mismatch is a 403 ``InvalidSignatureException``;
- the body plus ``modelId`` is validated against the operation's input shape in botocore's
  service model (``botocore.validate.ParamValidator``); a body that fails is a 400
  ``ValidationException``, so a test that sent it fails.

botocore ships an event-stream decoder but no encoder, so :func:`frame` encodes one here; the
tests decode its frames with botocore's ``EventStreamBuffer``, which checks both CRCs.
"""

from __future__ import annotations

import binascii
import hmac
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiohttp import web
from botocore.auth import SigV4Auth  # type: ignore[import-untyped]
from botocore.awsrequest import AWSRequest  # type: ignore[import-untyped]
from botocore.credentials import ReadOnlyCredentials  # type: ignore[import-untyped]
from botocore.session import get_session  # type: ignore[import-untyped]
from botocore.validate import ParamValidator  # type: ignore[import-untyped]

ACCESS_KEY = "AKIAIOSFODNN7EXAMPLE"
SECRET_KEY = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
SESSION_TOKEN = "tidegate-test-session-token-0123456789"
REGION = "us-east-1"
MODEL = "anthropic.claude-3-haiku-20240307-v1:0"
REQUEST_ID = "7f0c3a52-1b2d-4e5f-8a9b-0c1d2e3f4a5b"
EVENT_STREAM = "application/vnd.amazon.eventstream"

_AUTH = re.compile(
    r"AWS4-HMAC-SHA256 Credential=(?P<key>[^/]+)/(?P<date>\d{8})/(?P<region>[^/]+)/"
    r"(?P<service>[^/]+)/aws4_request, SignedHeaders=(?P<signed>[^,]+), Signature=(?P<sig>[0-9a-f]+)"
)
_SERVICE = get_session().get_service_model("bedrock-runtime")


def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Any, *, keys: bool = True) -> None:
    """AWS settings for a test: the test credentials in the environment (unless ``keys`` is
    false), and no file, profile, region or instance metadata of the machine ever read."""
    for name in (
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_SECURITY_TOKEN",
        "AWS_BEARER_TOKEN_BEDROCK",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_ROLE_ARN",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    if keys:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        monkeypatch.setenv("AWS_SESSION_TOKEN", SESSION_TOKEN)


# --------------------------------------------------------------------------- event-stream frames


def frame(headers: Mapping[str, str], payload: bytes) -> bytes:
    """One event-stream message: prelude (lengths and their CRC), string headers, payload, CRC."""
    encoded = b""
    for name, value in headers.items():
        raw_name, raw_value = name.encode(), value.encode()
        encoded += struct.pack(">B", len(raw_name)) + raw_name
        encoded += b"\x07" + struct.pack(">H", len(raw_value)) + raw_value  # 7: a string
    total = 12 + len(encoded) + len(payload) + 4
    prelude = struct.pack(">II", total, len(encoded))
    message = prelude + struct.pack(">I", binascii.crc32(prelude)) + encoded + payload
    return message + struct.pack(">I", binascii.crc32(message))


def event(event_type: str, data: Mapping[str, Any]) -> bytes:
    """An ``event`` message as ConverseStream sends it (with its padding field ``p``)."""
    headers = {
        ":event-type": event_type,
        ":content-type": "application/json",
        ":message-type": "event",
    }
    return frame(headers, orjson.dumps({**data, "p": "abcdefgh"}))


def exception(exception_type: str, message: str) -> bytes:
    """An ``exception`` message inside the stream (``throttlingException``, ...)."""
    headers = {
        ":exception-type": exception_type,
        ":content-type": "application/json",
        ":message-type": "exception",
    }
    return frame(headers, orjson.dumps({"message": message}))


def text_stream(*pieces: str, stop: str = "end_turn") -> list[bytes]:
    """The frames of a streamed text answer."""
    return [
        event("messageStart", {"role": "assistant"}),
        *(
            event("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": p}})
            for p in pieces
        ),
        event("contentBlockStop", {"contentBlockIndex": 0}),
        event("messageStop", {"stopReason": stop}),
        event(
            "metadata",
            {
                "usage": {
                    "inputTokens": 9,
                    "outputTokens": len(pieces),
                    "totalTokens": 9 + len(pieces),
                },
                "metrics": {"latencyMs": 12},
            },
        ),
    ]


def converse_answer(
    text: str = "Hello from Bedrock",
    *,
    stop: str = "end_turn",
    tool_use: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A Converse response body."""
    content: list[dict[str, Any]] = [{"text": text}] if text else []
    if tool_use is not None:
        content.append({"toolUse": dict(tool_use)})
    return {
        "output": {"message": {"role": "assistant", "content": content}},
        "stopReason": stop,
        "usage": {"inputTokens": 11, "outputTokens": 4, "totalTokens": 15},
        "metrics": {"latencyMs": 30},
    }


# --------------------------------------------------------------------------- checks


def validation_problems(operation: str, body: Mapping[str, Any], model_id: str) -> str:
    """botocore's report on ``body`` plus ``modelId`` against the operation's input shape
    (``""`` when it is valid)."""
    shape = _SERVICE.operation_model(operation).input_shape
    report = ParamValidator().validate({**body, "modelId": model_id}, shape)
    return str(report.generate_report()) if report.has_errors() else ""


def signature_problem(request: web.Request, body: bytes, secret_key: str = SECRET_KEY) -> str:
    """Why the request's SigV4 signature is not the one the test credentials give (``""``: it
    is), computed again by botocore from what was received."""
    match = _AUTH.fullmatch(request.headers.get("Authorization", ""))
    if match is None:
        return "no SigV4 Authorization header"
    if (match["key"], match["region"], match["service"]) != (ACCESS_KEY, REGION, "bedrock"):
        return f"wrong credential scope {match['key']}/{match['region']}/{match['service']}"
    stamp = request.headers.get("X-Amz-Date", "")
    if not stamp.startswith(match["date"]):
        return "X-Amz-Date does not match the credential scope"
    if request.headers.get("X-Amz-Security-Token") != SESSION_TOKEN:
        return "no session token"
    signed = match["signed"].split(";")
    headers = {name: request.headers[name] for name in signed if name in request.headers}
    again = AWSRequest(
        method=request.method,
        url=f"http://{request.host}{request.raw_path}",
        data=body,
        headers=headers,
    )
    again.context["timestamp"] = stamp
    signer = SigV4Auth(
        ReadOnlyCredentials(ACCESS_KEY, secret_key, SESSION_TOKEN), "bedrock", REGION
    )
    if signer.signed_headers(signer.headers_to_sign(again)) != match["signed"]:
        return "the signed headers differ"
    expected = signer.signature(
        signer.string_to_sign(again, signer.canonical_request(again)), again
    )
    return "" if hmac.compare_digest(expected, match["sig"]) else "the signature does not match"


# --------------------------------------------------------------------------- the fake


@dataclass
class Reply:
    """One scripted answer: a JSON body (``json``) or event-stream frames (``frames``, each
    written in two pieces so that the decoder must join them), with a status and headers."""

    status: int = 200
    json: Any = None
    frames: Sequence[bytes] | None = None
    headers: Mapping[str, str] = field(default_factory=dict)


def error_reply(
    status: int,
    error_type: str,
    message: str,
    *,
    in_body: bool = False,
    headers: Mapping[str, str] | None = None,
) -> Reply:
    """A Bedrock error: the type in ``X-Amzn-ErrorType``, or with ``in_body`` as ``__type``."""
    body: dict[str, Any] = {"message": message}
    sent = dict(headers or {})
    if in_body:
        body["__type"] = f"com.amazon.bedrock#{error_type}"
    else:
        sent["X-Amzn-ErrorType"] = (
            f"{error_type}:http://internal.amazon.com/coral/com.amazon.bedrock/"
        )
    return Reply(status=status, json=body, headers=sent)


@dataclass
class Seen:
    """One request as the fake received it."""

    operation: str
    model_id: str
    raw_path: str
    headers: dict[str, str]
    body: dict[str, Any]
    signature_problem: str
    validation_problems: str


class FakeBedrock:
    """Answers with ``replies`` in order (the last one repeats); ``seen`` records each request.

    ``api_key`` set: requests must carry it as a bearer token instead of a SigV4 signature.
    """

    def __init__(self, replies: Sequence[Reply], *, api_key: str | None = None) -> None:
        self.replies = list(replies)
        self.api_key = api_key
        self.seen: list[Seen] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/model/{model}/converse", self._converse)
        app.router.add_post("/model/{model}/converse-stream", self._converse_stream)
        return app

    async def _converse(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "Converse")

    async def _converse_stream(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "ConverseStream")

    def _check(self, request: web.Request, raw: bytes, operation: str) -> Seen:
        model_id = request.match_info["model"]
        body = orjson.loads(raw)
        if self.api_key is None:
            problem = signature_problem(request, raw)
        elif request.headers.get("Authorization") != f"Bearer {self.api_key}":
            problem = "not the bearer API key"
        else:
            problem = ""
        seen = Seen(
            operation,
            model_id,
            request.raw_path,
            dict(request.headers),
            body,
            problem,
            validation_problems(operation, body, model_id),
        )
        self.seen.append(seen)
        return seen

    async def _handle(self, request: web.Request, operation: str) -> web.StreamResponse:
        raw = await request.read()
        seen = self._check(request, raw, operation)
        if seen.signature_problem:
            return _send(error_reply(403, "InvalidSignatureException", seen.signature_problem))
        if seen.validation_problems:
            return _send(error_reply(400, "ValidationException", seen.validation_problems))
        reply = self.replies[min(len(self.seen), len(self.replies)) - 1]
        if reply.frames is None:
            return _send(reply)
        response = web.StreamResponse(
            status=reply.status,
            headers={"Content-Type": EVENT_STREAM, "x-amzn-RequestId": REQUEST_ID, **reply.headers},
        )
        await response.prepare(request)
        for data in reply.frames:
            await response.write(data[: len(data) // 2])
            await response.write(data[len(data) // 2 :])
        await response.write_eof()
        return response


def _send(reply: Reply) -> web.Response:
    return web.Response(
        status=reply.status,
        body=orjson.dumps(reply.json),
        headers={
            "Content-Type": "application/json",
            "x-amzn-RequestId": REQUEST_ID,
            **reply.headers,
        },
    )
