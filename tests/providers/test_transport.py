"""The shared HTTP plumbing: error dialects, exception mapping, timeouts around a real socket."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import aiohttp
import pytest
from aiohttp import web

from tidegate.clock import SystemClock
from tidegate.errors import ProviderError, ProviderErrorKind
from tidegate.providers.redact import Redactor
from tidegate.providers.sse import SSELineTooLong
from tidegate.providers.transport import (
    HTTPAnswer,
    error_info,
    error_message,
    exception_to_error,
    post_json,
    retry_after_from,
    stream_events,
)

from .conftest import Serve

K = ProviderErrorKind


def test_error_info_reads_each_dialect() -> None:
    """OpenAI, Anthropic, vLLM, Ollama and plain-text error bodies all yield a message."""
    openai = b'{"error": {"message": "m1", "type": "t1", "code": "c1"}}'
    anthropic = b'{"type": "error", "error": {"type": "overloaded_error", "message": "m2"}}'
    vllm = b'{"object": "error", "message": "m3", "type": "BadRequestError", "code": 400}'
    ollama = b'{"error": "m4"}'
    info = error_info(openai)
    assert (info.message, info.type, info.code) == ("m1", "t1", "c1")
    info = error_info(anthropic)
    assert (info.message, info.type) == ("m2", "overloaded_error")
    info = error_info(vllm)
    assert (info.message, info.status) == ("m3", 400)
    assert error_info(ollama).message == "m4"
    assert error_info(b"upstream exploded").message == "upstream exploded"


def test_error_message_names_status_code_and_request_id_without_the_secret() -> None:
    """The shown message leads with the status and code, ends with the request id, and has the
    secret cut out; an event inside a 200 stream leaves the status out."""
    redactor = Redactor(["tidegate-upstream-secret-7f3a"])
    body = b'{"type": "error", "error": {"type": "authentication_error", "message": '
    body += b'"invalid x-api-key tidegate-upstream-secret-7f3a"}, "request_id": "req_1"}'
    answer = HTTPAnswer(401, {}, body)
    assert error_message(answer, error_info(body), redactor) == (
        "HTTP 401 authentication_error: invalid x-api-key [redacted] (request id req_1)"
    )
    event = HTTPAnswer(200, {}, body)
    assert error_message(event, error_info(body), redactor).startswith("authentication_error:")


def test_error_info_keeps_at_most_the_raw_limit_and_no_half_token() -> None:
    """A huge error text is cut before cleaning, and a token cut in two is dropped whole."""
    text = "word " * 2000 + "sk-unfinished"
    info = error_info(text.encode())
    assert len(info.message) <= 4096
    assert info.message.endswith("word…")


def test_an_exception_text_holding_a_key_is_cleaned() -> None:
    """aiohttp's exception texts can quote the URL; a key in its query is not passed on."""
    exc = aiohttp.ClientConnectionError("cannot reach https://h.example/v1?key=hunter2hunter2")
    error = exception_to_error(exc, provider="p", timeout_message="late")
    assert error is not None
    assert "hunter2" not in error.message
    assert error.message == "cannot reach https://h.example/v1?key=[redacted]"


def test_retry_after_ms_wins_over_retry_after() -> None:
    """OpenAI's millisecond hint is used before the coarser Retry-After header."""
    assert retry_after_from({"retry-after-ms": "1500", "retry-after": "9"}, 0.0) == 1.5
    assert retry_after_from({"retry-after": "9"}, 0.0) == 9.0
    assert retry_after_from({}, 0.0) is None


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (TimeoutError(), K.TIMEOUT),
        (aiohttp.ServerTimeoutError("slow"), K.TIMEOUT),
        (aiohttp.ClientPayloadError("cut"), K.CONNECTION),
        (aiohttp.ServerDisconnectedError(), K.CONNECTION),
        (ConnectionResetError("reset"), K.CONNECTION),
        (SSELineTooLong("long"), K.MALFORMED),
    ],
)
def test_client_failures_become_provider_errors(exc: BaseException, kind: K) -> None:
    """Each client-side failure maps to its kind, carrying the provider name."""
    error = exception_to_error(exc, provider="p", timeout_message="late")
    assert error is not None
    assert (error.kind, error.provider) == (kind, "p")


def test_bugs_and_cancellation_are_not_converted() -> None:
    """A programming error or a cancellation is not a provider error: None says re-raise it."""
    assert exception_to_error(KeyError("x"), provider="p", timeout_message="") is None
    assert exception_to_error(asyncio.CancelledError(), provider="p", timeout_message="") is None


def _never_called(answer: HTTPAnswer) -> ProviderError:
    raise AssertionError(f"unexpected error answer {answer.status}")


@pytest.mark.slow
@pytest.mark.asyncio
async def test_post_json_reads_status_headers_and_body(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    """A POST returns the status, headers and raw body, whatever the status."""

    async def handler(request: web.Request) -> web.Response:
        assert await request.json() == {"q": 1}
        return web.Response(status=418, body=b"teapot", headers={"X-Why": "tea"})

    app = web.Application()
    app.router.add_post("/x", handler)
    url = await serve(app)
    answer = await post_json(
        session, f"{url}/x", headers={}, payload={"q": 1}, timeout=1.0, provider="p"
    )
    assert (answer.status, answer.body, answer.headers["X-Why"]) == (418, b"teapot", "tea")


def _sse_app(*pieces: tuple[float, bytes], status: int = 200) -> web.Application:
    """An app whose POST /s writes each piece after its delay (real, tiny waits)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        if status != 200:
            return web.Response(status=status, text="nope")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for delay, data in pieces:
                await SystemClock().asleep(delay)
                await response.write(data)
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client gave up, as the timeout tests intend
        return response

    app = web.Application()
    app.router.add_post("/s", handler)
    return app


async def _collect(session: aiohttp.ClientSession, url: str, **limits: float | None) -> list[str]:
    def error_for(answer: HTTPAnswer) -> ProviderError:
        return ProviderError(
            K.SERVER, f"status {answer.status}", provider="p", status=answer.status
        )

    options: dict[str, float | None] = {
        "timeout": 1.0,
        "chunk_timeout": None,
        "total_timeout": None,
    }
    options.update(limits)
    events = stream_events(
        session,
        f"{url}/s",
        headers={},
        payload={},
        provider="p",
        error_for=error_for,
        timeout=options["timeout"] or 1.0,
        chunk_timeout=options["chunk_timeout"],
        total_timeout=options["total_timeout"],
    )
    async with aclosing(events):
        return [event.data async for event in events]


@pytest.mark.slow
@pytest.mark.asyncio
async def test_stream_events_yields_every_event(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    """Events split across writes arrive whole and in order."""
    url = await serve(_sse_app((0, b"data: a\n\nda"), (0.01, b"ta: b\n\n")))
    assert await _collect(session, url) == ["a", "b"]


@pytest.mark.slow
@pytest.mark.asyncio
async def test_no_first_chunk_in_time_is_a_timeout(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    """Silence past ``timeout`` before the first event raises a timeout error."""
    url = await serve(_sse_app((0.2, b"data: late\n\n")))
    with pytest.raises(ProviderError) as caught:
        await _collect(session, url, timeout=0.05)
    assert caught.value.kind == K.TIMEOUT
    assert "first chunk" in caught.value.message


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_stall_after_the_first_chunk_is_a_timeout(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    """A gap between events longer than ``chunk_timeout`` raises a timeout error."""
    url = await serve(_sse_app((0, b"data: a\n\n"), (0.2, b"data: b\n\n")))
    with pytest.raises(ProviderError) as caught:
        await _collect(session, url, chunk_timeout=0.05)
    assert caught.value.kind == K.TIMEOUT
    assert "no chunk for 0.05s" in caught.value.message


@pytest.mark.slow
@pytest.mark.asyncio
async def test_total_timeout_bounds_a_slow_steady_stream(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    """Events that each arrive in time still fail once the whole stream passes total_timeout."""
    pieces = [(0.03, b"data: x\n\n")] * 6
    url = await serve(_sse_app(*pieces))
    with pytest.raises(ProviderError) as caught:
        await _collect(session, url, chunk_timeout=0.1, total_timeout=0.08)
    assert caught.value.kind == K.TIMEOUT
    assert "ran past" in caught.value.message


@pytest.mark.slow
@pytest.mark.asyncio
async def test_an_error_status_goes_to_error_for(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    """A non-2xx answer is read whole and the error built by ``error_for`` is raised."""
    url = await serve(_sse_app(status=502))
    with pytest.raises(ProviderError) as caught:
        await _collect(session, url)
    assert (caught.value.kind, caught.value.status) == (K.SERVER, 502)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_raised_provider_error_is_not_its_own_cause(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    """The error built by ``error_for`` propagates as itself, without a self-referencing cause."""
    url = await serve(_sse_app(status=503))
    with pytest.raises(ProviderError) as caught:
        await _collect(session, url)
    assert caught.value.__cause__ is None
