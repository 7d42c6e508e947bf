"""An in-process provider that answers from a plain function, for tests and offline runs.

In the spirit of ``httpx.MockTransport``: ``FakeProvider(name, handler)`` calls
``handler(body, attempt_no)`` for every attempt and acts out what it returns:

- a ``dict``: the ``chat.completion`` (or embeddings response). Streamed, it is split into the
  chunks a server would have sent, ending with ``StreamEnd(done_seen=True)``;
- a :class:`~tidegate.errors.ProviderError`: raised before anything is sent;
- a list of stream steps: chunk dicts, :class:`~tidegate.providers.base.MalformedChunk`,
  :class:`Pause` (a wait between chunks), a ``ProviderError`` (raised at that point, as a
  connection lost mid-stream) and :class:`~tidegate.providers.base.StreamEnd` (the end;
  ``StreamEnd(done_seen=True)`` is added when the list has none). A non-streamed call adds the
  chunks up into one completion;
- :class:`Delay`: wait, then act out another outcome.

``handler`` may also be a list of outcomes: attempt *n* gets item *n* (the last one repeats).
:meth:`FakeProvider.from_script` answers from a model script instead (the format of
:mod:`tidegate.providers.fake_upstream`), so that the in-process fake and the HTTP fake fail in
the same ways.

A scripted ``raw`` fault (a body sent byte for byte) is read in-process as
:class:`~tidegate.providers.openai.OpenAIProvider` reads a non-streamed answer: a body that is not
an answer raises the same ``malformed`` error, and a good one is answered (and, for a stream,
split into chunks). A hand-written event stream is therefore not a stream here but a body that
is not an answer.

Waiting goes through the injected ``sleep`` (``SystemClock().asleep`` unless given;
``ManualClock().asleep`` in tests, where it moves virtual time instead of waiting). The time
limits of the :class:`~tidegate.providers.base.Provider` protocol are enforced on the sum of
those waits: a wait that reaches the limit sleeps exactly until the limit, then raises
``ProviderError(kind="timeout")``. A stream stalled with no ``chunk_timeout`` and no
``total_timeout`` waits forever, as a real one would.
"""

from __future__ import annotations

import asyncio
import copy
import math
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import orjson
from pydantic import ValidationError

from tidegate.clock import Clock, SystemClock
from tidegate.errors import ConfigError, ProviderError, ProviderErrorKind
from tidegate.providers.base import JSONObject, MalformedChunk, StreamEnd, StreamItem
from tidegate.providers.openai import openai_answer, openai_error_for
from tidegate.providers.script import (
    WILDCARD,
    FakeScript,
    ModelScript,
    Pause,
    Plan,
    ScriptRunner,
    format_validation_error,
)
from tidegate.providers.transport import HTTPAnswer
from tidegate.providers.wire import assemble_completion, completion_chunks

__all__ = [
    "ChunkStep",
    "Delay",
    "FakeAttempt",
    "FakeProvider",
    "Handler",
    "Outcome",
    "Pause",
    "outcome_for_plan",
]

K = ProviderErrorKind


@dataclass(frozen=True, slots=True)
class Delay:
    """Wait ``seconds``, then act out ``then``."""

    seconds: float
    then: Outcome


#: One step of a scripted stream.
ChunkStep: TypeAlias = JSONObject | MalformedChunk | StreamEnd | ProviderError | Pause
#: What a handler returns for one attempt.
Outcome: TypeAlias = "JSONObject | ProviderError | Sequence[ChunkStep] | Delay"
#: ``handler(body, attempt_no)``; ``attempt_no`` counts every call on the provider, from 1.
Handler: TypeAlias = Callable[[JSONObject, int], Outcome]
Sleep: TypeAlias = Callable[[float], Awaitable[None]]


@dataclass(slots=True)
class FakeAttempt:
    """One call the fake received, and how it ended.

    ``outcome`` is ``"pending"`` while running, then ``"ok"``, ``"error:<kind>"``,
    ``"cancelled"`` or ``"closed"`` (the caller left a stream early).
    """

    number: int
    operation: Literal["complete", "stream", "embed"]
    body: JSONObject
    at: float | None
    outcome: str = "pending"


class _Timer:
    """The time limits of one attempt, applied to the waits the fake acts out."""

    __slots__ = ("_chunk", "_elapsed", "_first", "_quiet", "_sleep", "_total", "provider")

    def __init__(
        self,
        sleep: Sleep,
        provider: str,
        *,
        first: float,
        chunk: float | None = None,
        total: float | None = None,
    ) -> None:
        self._sleep = sleep
        self.provider = provider
        self._first = first
        self._chunk = chunk
        self._total = total
        self._elapsed = 0.0
        self._quiet: float | None = None  # seconds since the last chunk; None before the first

    def _limit(self) -> tuple[float, str]:
        limits: list[tuple[float, str]] = []
        if self._quiet is None:
            limits.append((self._first - self._elapsed, f"no answer within {self._first:g}s"))
        elif self._chunk is not None:
            limits.append((self._chunk - self._quiet, f"no chunk for {self._chunk:g}s"))
        if self._total is not None:
            limits.append((self._total - self._elapsed, f"the stream ran past {self._total:g}s"))
        return min(limits, default=(math.inf, "the stream stalled with no time limit"))

    async def wait(self, seconds: float) -> None:
        limit, reason = self._limit()
        if seconds >= limit:
            await self._sleep(max(0.0, limit))
            raise ProviderError(K.TIMEOUT, reason, provider=self.provider)
        await self._sleep(seconds)
        self._elapsed += seconds
        if self._quiet is not None:
            self._quiet += seconds

    def chunk_seen(self) -> None:
        self._quiet = 0.0


class FakeProvider:
    """A :class:`~tidegate.providers.base.Provider` that acts out what ``handler`` returns.

    ``attempts`` records every call in order. ``clock``, if given, stamps each attempt's ``at``
    with ``clock.now()``.
    """

    def __init__(
        self,
        name: str,
        handler: Handler | Sequence[Outcome],
        *,
        sleep: Sleep | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.name = name
        self._handler = handler if callable(handler) else _replay(list(handler))
        self._sleep: Sleep = sleep if sleep is not None else SystemClock().asleep
        self._clock = clock
        self.attempts: list[FakeAttempt] = []
        self.closed = False

    @classmethod
    def from_script(
        cls,
        model_script: ModelScript | Mapping[str, Any],
        *,
        name: str = "fake",
        seed: int = 0,
        sleep: Sleep | None = None,
        clock: Clock | None = None,
    ) -> FakeProvider:
        """A fake that answers every model as ``model_script`` describes (faults included).

        ``seed`` seeds the probability faults; the attempt number of a fault rule counts the
        calls per model name. A mapping that is not a valid model script raises
        :class:`~tidegate.errors.ConfigError` naming the key.
        """
        if isinstance(model_script, ModelScript):
            model = model_script
        else:
            try:
                model = ModelScript.model_validate(model_script)
            except ValidationError as exc:
                raise ConfigError(f"fake: {format_validation_error(exc)}") from exc
        runner = ScriptRunner(FakeScript(seed=seed, models={WILDCARD: model}))
        wall = clock.wall if clock is not None else None

        def handler(body: JSONObject, attempt_no: int) -> Outcome:
            embeddings = "input" in body and "messages" not in body
            now = wall() if wall is not None else 0.0
            plan = runner.plan(
                body, endpoint="embeddings" if embeddings else "chat", created=int(now)
            )
            return outcome_for_plan(plan, provider=name, now_wall=now)

        return cls(name, handler, sleep=sleep, clock=clock)

    def __repr__(self) -> str:
        return f"FakeProvider(name={self.name!r}, attempts={len(self.attempts)})"

    def _begin(
        self, operation: Literal["complete", "stream", "embed"], body: JSONObject
    ) -> FakeAttempt:
        attempt = FakeAttempt(
            number=len(self.attempts) + 1,
            operation=operation,
            body=copy.deepcopy(body),
            at=None if self._clock is None else self._clock.now(),
        )
        self.attempts.append(attempt)
        return attempt

    async def complete(
        self,
        body: JSONObject,
        *,
        timeout: float,  # noqa: ASYNC109  # the protocol's per-attempt limit
    ) -> JSONObject:
        """Act out the handler's outcome as one ``chat.completion``."""
        attempt = self._begin("complete", body)
        with _Recording(attempt):
            outcome = self._handler({**body, "stream": False}, attempt.number)
            return await self._whole(outcome, _Timer(self._sleep, self.name, first=timeout))

    async def embed(
        self,
        body: JSONObject,
        *,
        timeout: float,  # noqa: ASYNC109  # the protocol's per-attempt limit
    ) -> JSONObject:
        """Act out the handler's outcome as one embeddings response."""
        attempt = self._begin("embed", body)
        with _Recording(attempt):
            outcome = self._handler(dict(body), attempt.number)
            timer = _Timer(self._sleep, self.name, first=timeout)
            outcome = await _settle(outcome, timer)
            if isinstance(outcome, ProviderError):
                raise outcome
            if not isinstance(outcome, dict):
                raise TypeError(f"an embed outcome must be a dict or a ProviderError: {outcome!r}")
            return copy.deepcopy(outcome)

    async def stream(
        self,
        body: JSONObject,
        *,
        timeout: float,  # noqa: ASYNC109  # the protocol's per-attempt limit
        chunk_timeout: float | None = None,
        total_timeout: float | None = None,
    ) -> AsyncGenerator[StreamItem, None]:
        """Act out the handler's outcome as a stream of chunks."""
        attempt = self._begin("stream", body)
        with _Recording(attempt):
            timer = _Timer(
                self._sleep, self.name, first=timeout, chunk=chunk_timeout, total=total_timeout
            )
            outcome = await _settle(self._handler({**body, "stream": True}, attempt.number), timer)
            for step in _steps(outcome):
                if isinstance(step, Pause):
                    await timer.wait(step.seconds)
                elif isinstance(step, ProviderError):
                    raise step
                elif isinstance(step, StreamEnd):
                    yield step
                    return
                else:
                    timer.chunk_seen()
                    yield copy.deepcopy(step)
            yield StreamEnd(done_seen=True)

    async def aclose(self) -> None:
        """Mark the fake closed (it holds nothing)."""
        self.closed = True

    async def _whole(self, outcome: Outcome, timer: _Timer) -> JSONObject:
        outcome = await _settle(outcome, timer)
        if isinstance(outcome, ProviderError):
            raise outcome
        if isinstance(outcome, dict):
            return copy.deepcopy(outcome)
        chunks: list[JSONObject] = []
        for step in _steps(outcome):
            if isinstance(step, Pause):
                await timer.wait(step.seconds)
            elif isinstance(step, ProviderError):
                raise step
            elif isinstance(step, dict):
                chunks.append(step)
        return assemble_completion(chunks)


class _Recording:
    """Write how an attempt ended into its record, whatever way it ends."""

    __slots__ = ("_attempt",)

    def __init__(self, attempt: FakeAttempt) -> None:
        self._attempt = attempt

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, error: BaseException | None, traceback: object) -> None:
        if error is None:
            self._attempt.outcome = "ok"
        elif isinstance(error, ProviderError):
            self._attempt.outcome = f"error:{error.kind.value}"
        elif isinstance(error, GeneratorExit):
            self._attempt.outcome = "closed"
        elif isinstance(error, asyncio.CancelledError):
            self._attempt.outcome = "cancelled"
        else:
            self._attempt.outcome = f"raised:{type(error).__name__}"


async def _settle(outcome: Outcome, timer: _Timer) -> Outcome:
    while isinstance(outcome, Delay):
        await timer.wait(outcome.seconds)
        outcome = outcome.then
    return outcome


def _steps(outcome: Outcome) -> Sequence[ChunkStep]:
    if isinstance(outcome, ProviderError):
        raise outcome
    if isinstance(outcome, dict):
        return [*completion_chunks(outcome), StreamEnd(done_seen=True)]
    if isinstance(outcome, list | tuple):
        return outcome
    raise TypeError(f"a fake outcome must be a dict, a ProviderError or a list: {outcome!r}")


def _replay(outcomes: list[Outcome]) -> Handler:
    if not outcomes:
        raise ValueError("a list of outcomes needs at least one")

    def handler(body: JSONObject, attempt_no: int) -> Outcome:
        return outcomes[min(attempt_no, len(outcomes)) - 1]

    return handler


def outcome_for_plan(plan: Plan, *, provider: str, now_wall: float = 0.0) -> Outcome:
    """The in-process equivalent of what the fake upstream would do for ``plan``.

    HTTP refusals are mapped with the OpenAI provider's own table, so a scripted fault raises
    exactly the error that :class:`~tidegate.providers.openai.OpenAIProvider` would raise
    against the HTTP fake.
    """
    if plan.action == "reset":
        return Delay(
            plan.latency, ProviderError(K.CONNECTION, "connection reset", provider=provider)
        )
    if plan.action == "no_response":
        return Delay(math.inf, ProviderError(K.TIMEOUT, "no response", provider=provider))
    if plan.action == "error":
        headers = {name.lower(): value for name, value in plan.headers.items()}  # as aiohttp's
        answer = HTTPAnswer(plan.status, headers, orjson.dumps(plan.body or {}))
        return Delay(plan.latency, openai_error_for(answer, provider=provider, now_wall=now_wall))
    if plan.action == "raw":
        headers = {name.lower(): value for name, value in plan.headers.items()}
        answer = HTTPAnswer(plan.status, headers, plan.raw)
        try:
            result: Outcome = openai_answer(
                answer, endpoint=plan.endpoint, provider=provider, now_wall=now_wall
            )
        except ProviderError as error:
            result = error
        return Delay(plan.latency, result)
    if plan.action == "answer":
        body = plan.body or {}
        if plan.body_fault == "cut":
            return Delay(
                plan.latency,
                ProviderError(K.CONNECTION, "the response was cut off", provider=provider),
            )
        if plan.body_fault == "stall":
            return Delay(math.inf, body)
        if plan.body_fault == "malformed":
            return Delay(
                plan.latency, ProviderError(K.MALFORMED, "the body is not JSON", provider=provider)
            )
        return Delay(plan.latency, body)
    steps: list[ChunkStep] = list(plan.steps)
    if plan.ending == "done":
        steps.append(StreamEnd(done_seen=True))
    elif plan.ending == "missing_done":
        steps.append(StreamEnd(done_seen=False))
    elif plan.ending == "cut":
        steps.append(ProviderError(K.CONNECTION, "the response was cut off", provider=provider))
    else:
        steps.append(Pause(math.inf))
    return Delay(plan.latency, steps)
