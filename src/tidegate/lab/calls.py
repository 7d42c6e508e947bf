"""One model call in virtual time, driven through the gateway's own combination of policies.

The gateway drives :class:`~tidegate.policy.attempts.Attempts` from asyncio; :func:`run_call`
drives the very same object from the lab's event queue: a :class:`~tidegate.policy.attempts.Call`
is answered by a simulated provider after its latency (or cut off at the attempt's timeout, as
the gateway's own timer would), a :class:`~tidegate.policy.attempts.Wait` is a scheduled event,
and a :class:`~tidegate.policy.attempts.Stop` ends the call. So a simulated retry storm or a
replayed log runs exactly the gateway's retries, breaker verdicts (and releases), retry budget
and failover, not a model of them.
"""

from __future__ import annotations

from collections.abc import Callable

from tidegate.errors import ProviderError, ProviderErrorKind
from tidegate.lab.engine import EventQueue
from tidegate.policy.attempts import Attempts, Call, Step, Stop, Wait

__all__ = ["Provider", "run_call"]

#: A simulated provider: for a call, how long it takes and how it fails (None: it answers).
Provider = Callable[[Call], tuple[float, ProviderError | None]]


def run_call(
    queue: EventQueue,
    attempts: Attempts,
    provider: Provider,
    done: Callable[[Stop | None], None],
) -> None:
    """Start the call now; ``done`` hears its end: None for an answer, else the Stop."""
    _CallRun(queue, attempts, provider, done).step(attempts.begin())


class _CallRun:
    __slots__ = ("attempts", "done", "provider", "queue")

    def __init__(
        self,
        queue: EventQueue,
        attempts: Attempts,
        provider: Provider,
        done: Callable[[Stop | None], None],
    ) -> None:
        self.queue = queue
        self.attempts = attempts
        self.provider = provider
        self.done = done

    def step(self, step: Step) -> None:
        if isinstance(step, Stop):
            self.done(step)
        elif isinstance(step, Wait):
            self.queue.after(step.delay, self.resume)
        else:
            latency, error = self.provider(step)
            if latency > step.timeout:  # the attempt's own timer ends it first
                latency = step.timeout
                error = ProviderError(
                    ProviderErrorKind.TIMEOUT, "attempt timed out", provider=step.spec.name
                )
            self.queue.after(latency, self.ended, error)

    def resume(self) -> None:
        self.step(self.attempts.resume())

    def ended(self, error: ProviderError | None) -> None:
        if error is None:
            self.attempts.succeeded()
            self.done(None)
        else:
            self.step(self.attempts.failed(error))
