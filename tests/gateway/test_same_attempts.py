"""The gateway and the lab run one combination of retries, breakers, retry budget and failover.

The same scripted provider faults go through the gateway (its ASGI app on a manual clock, with
in-process fake providers) and through the lab (the replay's attempt policy, built from the same
YAML file, driven on the event queue by :func:`~tidegate.lab.calls.run_call`). Both must make
the same attempts: the same providers, at the same virtual times, ending the same way, with the
same answer to each request. The script exercises a jittered retry, a ``Retry-After``, exhausted
retries, a per-try timeout that fails over, a breaker that opens, skips and probes, and an
attempt cut short by the caller's deadline (which must not count against the provider).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.harness import KEY, fake, write_config
from tidegate.clock import ManualClock
from tidegate.errors import ProviderError, ProviderErrorKind
from tidegate.gateway.app import Gateway
from tidegate.gateway.config import load_config
from tidegate.gateway.runtime import build_runtime, close_runtime
from tidegate.lab.calls import run_call
from tidegate.lab.engine import EventQueue
from tidegate.lab.replay import load_replay_config
from tidegate.policy.attempts import Call, Stop
from tidegate.policy.deadline import Deadline
from tidegate.policy.routing import ProviderSpec, RoutePlan
from tidegate.providers.fake import Delay, FakeProvider

K = ProviderErrorKind
SEED = 11
PROVIDERS = ("primary", "backup", "spare")
PER_TRY_S = 2.0


@dataclass(frozen=True)
class Fault:
    """One scripted attempt: how long the provider takes, and the error it ends with (or none)."""

    latency: float
    kind: ProviderErrorKind | None = None
    retry_after: float | None = None

    def error(self, provider: str) -> ProviderError | None:
        if self.kind is None:
            return None
        return ProviderError(self.kind, "scripted", provider=provider, retry_after=self.retry_after)


#: Each provider's attempts in order (the last one repeats).
SCRIPT: dict[str, Sequence[Fault]] = {
    "primary": (
        Fault(0.2, K.SERVER),  # retried after a jittered backoff
        Fault(0.1, K.RATE_LIMITED, retry_after=1.5),  # retried after exactly its Retry-After
        Fault(0.05, K.OVERLOADED),  # attempts exhausted, the third failure opens the breaker
        Fault(0.3),  # the probe after recovery
        Fault(3.0),  # slower than the caller's 1 s deadline: cut short, not evidence
        Fault(0.3),
    ),
    "backup": (Fault(5.0), Fault(0.3)),  # first outlasts its 2 s per-try limit: fail over
    "spare": (Fault(0.4),),
}
#: When each request arrives (virtual seconds) and its deadline header, if any.
REQUESTS: Sequence[tuple[float, int | None]] = (
    (0.0, None),
    (10.0, None),  # the primary's breaker is open: the backup answers
    (40.0, None),  # recovered: a probe closes it
    (50.0, 1000),  # cut short by the caller's deadline: 504
    (60.0, None),  # the primary serves again
)

CONFIG: dict[str, Any] = {
    "providers": {name: {**fake(), "data_classes": ["internal"]} for name in PROVIDERS},
    "models": {"chat": {"providers": list(PROVIDERS), "per_try_timeout_s": PER_TRY_S}},
    "retry": {"attempts": 3, "base_s": 0.5, "cap_s": 2.0, "jitter": "full"},
    "breaker": {"consecutive_failures": 3, "recovery_s": 20.0, "recovery_jitter": 0.2},
    # Admission's deadline test would refuse the 1 s request before the call being compared.
    "admission": {"mode": "queue_cap"},
    "server": {"request_timeout_s": 30.0},
}

#: One attempt as seen by the provider: (provider, virtual start time, how it ended).
Seen = tuple[str, float, str]


def _completion(provider: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{provider}",
        "object": "chat.completion",
        "created": 0,
        "model": provider,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def _fault(provider: str, number: int) -> Fault:
    faults = SCRIPT[provider]
    return faults[min(number, len(faults)) - 1]


def _ended(fault: Fault, timeout: float) -> str:
    """How an attempt given ``timeout`` seconds ends, in the fake's words."""
    if fault.latency >= timeout:
        return "error:timeout"
    return "ok" if fault.kind is None else f"error:{fault.kind.value}"


# --------------------------------------------------------------------------- the gateway


async def _through_the_gateway(tmp_path: Path) -> tuple[list[Seen], list[str]]:
    clock = ManualClock(0.0)
    path = write_config(tmp_path, CONFIG)

    def provider(name: str) -> FakeProvider:
        def handler(body: Any, number: int) -> Any:
            fault = _fault(name, number)
            error = fault.error(name)
            return Delay(fault.latency, _completion(name) if error is None else error)

        return FakeProvider(name, handler, sleep=clock.asleep, clock=clock)

    fakes = {name: provider(name) for name in PROVIDERS}
    config = load_config(path, env={})
    rt = await build_runtime(
        config,
        path,
        clock=clock,
        sleep=clock.asleep,
        rng=random.Random(SEED),
        providers=dict(fakes),
    )
    # The app is not started: its flag refresher would sleep on the manual clock too, and so
    # move virtual time under the requests being compared.
    app = Gateway(config, path, runtime=rt)
    answers: list[str] = []
    try:
        transport = httpx.ASGITransport(app=app)
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            for number, (at, deadline_ms) in enumerate(REQUESTS):
                clock.set(at)
                extra = {} if deadline_ms is None else {"X-Tidegate-Deadline-Ms": str(deadline_ms)}
                body = {"model": "chat", "messages": [{"role": "user", "content": f"q{number}"}]}
                reply = await client.post(
                    "/v1/chat/completions", json=body, headers={**headers, **extra}
                )
                answers.append("ok" if reply.status_code == 200 else reply.json()["error"]["code"])
    finally:
        await close_runtime(rt)
    seen = [
        (name, round(attempt.at or 0.0, 9), attempt.outcome)
        for name, fake_provider in fakes.items()
        for attempt in fake_provider.attempts
    ]
    return sorted(seen, key=lambda s: s[1]), answers


# --------------------------------------------------------------------------- the lab


def _through_the_lab(tmp_path: Path) -> tuple[list[Seen], list[str]]:
    config = load_replay_config(write_config(tmp_path, CONFIG))
    queue = EventQueue()
    clock = queue.clock
    policy = config.attempt_policy(clock, PROVIDERS, rng=random.Random(SEED))
    plan = RoutePlan(tuple(ProviderSpec(name, frozenset({"internal"})) for name in PROVIDERS), ())
    seen: list[Seen] = []
    answers: list[str] = [""] * len(REQUESTS)
    calls = dict.fromkeys(PROVIDERS, 0)

    def provider(call: Call) -> tuple[float, ProviderError | None]:
        name = call.spec.name
        calls[name] += 1
        fault = _fault(name, calls[name])
        seen.append((name, round(clock.now(), 9), _ended(fault, call.timeout)))
        return fault.latency, fault.error(name)

    def arrive(number: int, deadline_ms: int | None) -> None:
        budget = config.deadline if deadline_ms is None else deadline_ms / 1000
        attempts = policy.start(
            plan, Deadline.after(clock, budget), lambda spec: config.per_try, []
        )

        def done(stop: Stop | None) -> None:
            answers[number] = "ok" if stop is None else str(getattr(stop.error, "code", "?"))

        run_call(queue, attempts, provider, done)

    for number, (at, deadline_ms) in enumerate(REQUESTS):
        queue.at(at, arrive, number, deadline_ms)
    queue.run()
    return seen, answers


# --------------------------------------------------------------------------- the comparison


@pytest.mark.asyncio
async def test_the_gateway_and_the_lab_make_the_same_attempts(tmp_path: Path) -> None:
    """The same faults through the gateway and through the lab: the same attempts, each at the
    same virtual time and ending the same way, and the same answer to every request."""
    gateway_seen, gateway_answers = await _through_the_gateway(tmp_path)
    lab_seen, lab_answers = _through_the_lab(tmp_path)
    assert gateway_seen == lab_seen
    assert gateway_answers == lab_answers
    # The script did what it says: each mechanism it names was exercised.
    assert gateway_answers == ["ok", "ok", "ok", "deadline_exceeded", "ok"]
    providers = [name for name, _, _ in gateway_seen]
    assert providers == [
        "primary", "primary", "primary", "backup", "spare",  # retries, timeout, failover
        "backup",  # the primary's breaker is open
        "primary",  # the probe
        "primary",  # cut short by the caller's deadline
        "primary",  # and serves again
    ]  # fmt: skip
    _, second, third = (at for _, at, _ in gateway_seen[:3])
    assert 0.2 < second < 0.2 + 0.5  # a full-jitter wait under its 0.5 s ceiling
    assert third == pytest.approx(second + 0.1 + 1.5)  # exactly the Retry-After
