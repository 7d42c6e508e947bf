"""The in-process fake provider, under a manual clock."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import Any

import pytest

from tidegate.clock import ManualClock
from tidegate.errors import ConfigError, ProviderError, ProviderErrorKind
from tidegate.providers.base import MalformedChunk, StreamEnd, StreamItem
from tidegate.providers.fake import ChunkStep, Delay, FakeProvider, Outcome, Pause
from tidegate.providers.wire import chat_chunk, chat_completion

K = ProviderErrorKind
CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
DONE = chat_completion(id="c", model="m", created=0, content="hello")


def chunk(text: str) -> dict[str, Any]:
    return chat_chunk(id="c", model="m", created=0, delta={"content": text})


async def drain(fake: FakeProvider, **limits: float) -> list[StreamItem]:
    options = {"timeout": 10.0, **limits}
    stream = fake.stream(dict(CHAT), **options)
    async with aclosing(stream):
        return [item async for item in stream]


def text_of(items: list[StreamItem]) -> str:
    return "".join(
        i["choices"][0]["delta"].get("content") or ""
        for i in items
        if isinstance(i, dict) and i["choices"]
    )


@pytest.mark.asyncio
async def test_handler_gets_body_and_attempt_number() -> None:
    """The handler sees the body (with its stream flag) and the attempt number from 1."""
    calls: list[tuple[bool, int]] = []

    def handler(body: dict[str, Any], attempt_no: int) -> Outcome:
        calls.append((body["stream"], attempt_no))
        return DONE

    fake = FakeProvider("f", handler, sleep=ManualClock().asleep)
    assert (await fake.complete(dict(CHAT), timeout=1.0))["choices"][0]["message"][
        "content"
    ] == "hello"
    assert text_of(await drain(fake)) == "hello"
    assert calls == [(False, 1), (True, 2)]


@pytest.mark.asyncio
async def test_a_list_of_outcomes_is_replayed_in_order() -> None:
    """Attempt n gets the n-th outcome and the last one repeats; errors are raised."""
    busy = ProviderError(K.OVERLOADED, "busy", provider="f")
    fake = FakeProvider("f", [busy, DONE], sleep=ManualClock().asleep)
    with pytest.raises(ProviderError) as caught:
        await fake.complete(dict(CHAT), timeout=1.0)
    assert caught.value is busy
    assert (await fake.complete(dict(CHAT), timeout=1.0))["id"] == "c"
    assert (await fake.complete(dict(CHAT), timeout=1.0))["id"] == "c"
    assert [a.outcome for a in fake.attempts] == ["error:overloaded", "ok", "ok"]


@pytest.mark.asyncio
async def test_a_delay_shorter_than_the_timeout_is_waited_exactly() -> None:
    """A Delay below the timeout advances the manual clock by exactly its length."""
    clock = ManualClock()
    fake = FakeProvider("f", lambda body, n: Delay(0.75, DONE), sleep=clock.asleep, clock=clock)
    await fake.complete(dict(CHAT), timeout=1.0)
    assert clock.now() == 0.75
    assert fake.attempts[0].at == 0.0


@pytest.mark.asyncio
async def test_a_delay_past_the_timeout_times_out_at_the_timeout() -> None:
    """A Delay at or past the timeout waits exactly the timeout, then raises timeout."""
    clock = ManualClock()
    fake = FakeProvider("f", lambda body, n: Delay(5.0, DONE), sleep=clock.asleep)
    with pytest.raises(ProviderError) as caught:
        await fake.complete(dict(CHAT), timeout=1.5)
    assert (caught.value.kind, clock.now()) == (K.TIMEOUT, 1.5)


@pytest.mark.asyncio
async def test_stream_limits_apply_to_first_chunk_gaps_and_total() -> None:
    """Pauses count against timeout before the first chunk, chunk_timeout after it, and
    total_timeout throughout."""
    steps: list[ChunkStep] = [
        Pause(0.5),
        chunk("a"),
        Pause(0.5),
        chunk("b"),
        Pause(0.5),
        chunk("c"),
    ]
    clock = ManualClock()
    fake = FakeProvider("f", lambda body, n: steps, sleep=clock.asleep)
    assert text_of(await drain(fake, timeout=0.75, chunk_timeout=0.75)) == "abc"
    assert clock.now() == 1.5
    with pytest.raises(ProviderError, match=r"no answer within 0\.25s"):
        await drain(fake, timeout=0.25)
    assert clock.now() == 1.75
    with pytest.raises(ProviderError, match=r"no chunk for 0\.25s"):
        await drain(fake, timeout=1.0, chunk_timeout=0.25)
    assert clock.now() == 2.5
    with pytest.raises(ProviderError, match=r"ran past 1\.25s"):
        await drain(fake, timeout=1.0, chunk_timeout=1.0, total_timeout=1.25)
    assert clock.now() == 3.75


@pytest.mark.asyncio
async def test_stream_steps_are_acted_out_in_order() -> None:
    """Malformed chunks are yielded, an explicit StreamEnd ends the stream, an error is raised."""
    fake = FakeProvider(
        "f",
        [
            [chunk("a"), MalformedChunk("{"), chunk("b"), StreamEnd(done_seen=False)],
            [chunk("a"), ProviderError(K.CONNECTION, "cut", provider="f")],
        ],
        sleep=ManualClock().asleep,
    )
    items = await drain(fake)
    assert items[1] == MalformedChunk("{")
    assert items[-1] == StreamEnd(done_seen=False)
    with pytest.raises(ProviderError) as caught:
        await drain(fake)
    assert caught.value.kind == K.CONNECTION


@pytest.mark.asyncio
async def test_a_chunk_list_adds_up_for_complete() -> None:
    """complete() on a list of chunks returns the completion they add up to."""
    fake = FakeProvider(
        "f", lambda body, n: [chunk("he"), Pause(0.1), chunk("llo")], sleep=ManualClock().asleep
    )
    answer = await fake.complete(dict(CHAT), timeout=1.0)
    assert answer["choices"][0]["message"]["content"] == "hello"


@pytest.mark.asyncio
async def test_attempts_record_early_close_and_cancellation() -> None:
    """Leaving a stream early is recorded as closed; a cancelled call as cancelled."""

    async def sleep_forever(seconds: float) -> None:
        await asyncio.Event().wait()

    fake = FakeProvider(
        "f",
        lambda body, n: [chunk("a"), chunk("b")] if n == 1 else Delay(9.0, DONE),
        sleep=sleep_forever,
    )
    async with aclosing(fake.stream(dict(CHAT), timeout=1.0)) as stream:
        async for _ in stream:
            break
    task = asyncio.create_task(fake.complete(dict(CHAT), timeout=99.0))
    await ManualClock().asleep(0)  # let the task start and block in the fake's sleep
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [(a.operation, a.outcome) for a in fake.attempts] == [
        ("stream", "closed"),
        ("complete", "cancelled"),
    ]


@pytest.mark.asyncio
async def test_embed_returns_the_dict_and_refuses_chunks() -> None:
    """embed() returns a dict outcome and treats a chunk list as a test bug (TypeError)."""
    vectors = {"object": "list", "data": [{"embedding": [0.0]}]}
    fake = FakeProvider("f", [vectors, [chunk("a")]], sleep=ManualClock().asleep)
    assert await fake.embed({"model": "e", "input": "x"}, timeout=1.0) == vectors
    with pytest.raises(TypeError):
        await fake.embed({"model": "e", "input": "x"}, timeout=1.0)


@pytest.mark.asyncio
async def test_from_script_raises_what_the_http_fake_would() -> None:
    """Scripted faults raise the same kinds as the OpenAI provider against the HTTP fake."""
    script = {
        "text": "a b c",
        "faults": [
            {"on_attempts": [1], "kind": "http", "status": 429, "retry_after": 2},
            {"on_attempts": [2], "kind": "context_length_exceeded"},
            {"on_attempts": [3], "kind": "reset"},
            {"on_attempts": [4], "kind": "cut_after", "tokens": 1},
            {"on_attempts": [5], "kind": "no_response"},
        ],
    }
    clock = ManualClock()
    fake = FakeProvider.from_script(script, sleep=clock.asleep, clock=clock)
    kinds = []
    for _ in range(5):
        with pytest.raises(ProviderError) as caught:
            await drain(fake, timeout=0.5)
        kinds.append((caught.value.kind, caught.value.retry_after))
    assert kinds == [
        (K.RATE_LIMITED, 2.0),
        (K.CONTEXT_LENGTH, None),
        (K.CONNECTION, None),
        (K.CONNECTION, None),
        (K.TIMEOUT, None),
    ]
    assert clock.now() == 0.5
    assert text_of(await drain(fake)) == "a b c"


@pytest.mark.asyncio
async def test_from_script_paces_like_the_script() -> None:
    """Latency, ttft and tokens_per_second become exact waits on the manual clock."""
    clock = ManualClock()
    fake = FakeProvider.from_script(
        {"text": "a b c", "latency": 0.5, "ttft": 1.0, "tokens_per_second": 2}, sleep=clock.asleep
    )
    items = await drain(fake)
    assert (text_of(items), clock.now()) == ("a b c", 2.5)
    assert items[-1] == StreamEnd(done_seen=True)
    await fake.complete(dict(CHAT), timeout=10.0)
    assert clock.now() == 5.0


@pytest.mark.asyncio
async def test_aclose_marks_the_fake_closed() -> None:
    """aclose() sets ``closed`` so a test can check the owner released its providers."""
    fake = FakeProvider("f", [DONE])
    await fake.aclose()
    assert fake.closed


def test_from_script_names_a_bad_key() -> None:
    """A model script with an unknown key raises ConfigError naming it."""
    with pytest.raises(ConfigError, match=r"fake: latncy: unknown key"):
        FakeProvider.from_script({"latncy": 1})


@pytest.mark.asyncio
async def test_from_script_reads_a_raw_body_as_the_openai_provider_would() -> None:
    """A raw 200 that is not an answer raises malformed in-process too; a good one answers."""
    good = chat_completion(id="c", model="m", created=0, content="fine")
    script = {
        "faults": [
            {"on_attempts": [1], "kind": "raw", "body": {"choices": []}},
            {"on_attempts": [2], "kind": "raw", "status": 401, "body": {"error": "no"}},
            {"on_attempts": [3], "kind": "raw", "body": good},
        ],
    }
    clock = ManualClock()
    fake = FakeProvider.from_script(script, sleep=clock.asleep, clock=clock)
    with pytest.raises(ProviderError) as caught:
        await fake.complete(dict(CHAT), timeout=1.0)
    assert caught.value.kind == K.MALFORMED
    with pytest.raises(ProviderError) as caught:
        await fake.complete(dict(CHAT), timeout=1.0)
    assert caught.value.kind == K.AUTH
    assert text_of(await drain(fake)) == "fine"
