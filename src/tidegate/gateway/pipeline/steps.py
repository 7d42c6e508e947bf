"""A pipeline: an ordered tuple of named steps over one :class:`~.request.Request`, and the
settlement that follows whatever happened.

A step returns True once the request is answered (a cache hit, an idempotent replay, a degraded
answer, the call itself), False to go on, or, only when it must wait for something (a store, the
admission queue, a provider), an awaitable of one of those: a step that has nothing to wait for
in the usual case (no ``Idempotency-Key``, the cache off, the kill switch off) costs no coroutine.
A refusal is raised as its typed error and answered with its one status and body. The settle
step runs last, always, shielded from the caller going away.

A step the configuration turns off (no rate limits, the cache off, no canary) is left out of the
runtime's own copy of the pipeline (:meth:`Pipeline.for_runtime`) rather than asked on every
request; the order of the steps that remain is the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeAlias

from tidegate.gateway.pipeline.answer import answer_error
from tidegate.gateway.pipeline.request import Request
from tidegate.gateway.pipeline.settle import record_canary, settle_shielded
from tidegate.gateway.runtime import Runtime

__all__ = ["Outcome", "Pipeline", "Step", "run"]


#: What a step answers: whether the request is answered, now or once awaited.
Outcome: TypeAlias = bool | Awaitable[bool]


@dataclass(frozen=True, slots=True)
class Step:
    """One named step of a pipeline."""

    name: str
    run: Callable[[Request], Outcome]
    #: Whether a runtime needs the step (None: every runtime does). A step left out is one that
    #: would do nothing for any request of that runtime, as its configuration stands.
    needed: Callable[[Runtime], bool] | None = None


@dataclass(frozen=True, slots=True)
class Pipeline:
    """An endpoint's steps in the order a request meets them; settling follows them all."""

    steps: tuple[Step, ...]
    #: The steps' functions, in order (what the loop calls).
    runs: tuple[Callable[[Request], Outcome], ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "runs", tuple(step.run for step in self.steps))

    def names(self) -> tuple[str, ...]:
        """The order, as docs/ARCHITECTURE.md states it."""
        return (*(step.name for step in self.steps), "settle")

    def for_runtime(self, rt: Runtime) -> Pipeline:
        """The steps ``rt`` needs, in the same order (see the module docstring)."""
        return Pipeline(tuple(s for s in self.steps if s.needed is None or s.needed(rt)))


async def run(pipeline: Pipeline, request: Request) -> None:
    """Take ``request`` through the steps, answer a refusal or an error with its typed status and
    body, then settle what it owes (shielded)."""
    try:
        for step in pipeline.runs:
            done = step(request)
            if done and (done is True or await done):
                return
    except asyncio.CancelledError:
        request.ex.outcome, request.ex.status = "client_closed", 499
        raise
    except Exception as error:
        await answer_error(request, error)
    finally:
        if request.canary is not None:
            record_canary(request)
        await settle_shielded(request)
