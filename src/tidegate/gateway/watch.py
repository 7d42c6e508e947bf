"""Disconnect watches: a client that goes away cancels its request, without a watcher task for
every request.

ASGI tells a request that its client left only through ``receive()``, which the gateway stops
calling once it has read the body. Waiting on ``receive()`` in a task of its own would add a
task to every request, and most are answered well within :data:`WATCH_AFTER_S`; so
:class:`DisconnectWatches` keeps the requests in flight and gives a watcher only to those still
running after it. At the drain's end the same list is what the gateway cancels
(:meth:`DisconnectWatches.end_all`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from tidegate.errors import ShuttingDown
from tidegate.gateway.http import DRAIN_ENDED, Receive, Send, send_error
from tidegate.gateway.pipeline import Exchange

__all__ = ["WATCH_AFTER_S", "DisconnectWatches"]

#: A request still running after this many seconds starts watching for its client to go away.
WATCH_AFTER_S = 0.05


class _Watch:
    """One request that may need watching: its task, its exchange and its ``receive``."""

    __slots__ = (
        "cancelled_here",
        "ex",
        "receive",
        "responded",
        "since",
        "started",
        "task",
        "watcher",
    )

    def __init__(
        self, task: asyncio.Task[Any], ex: Exchange, receive: Receive, since: float
    ) -> None:
        self.task = task
        self.ex = ex
        self.receive = receive
        self.since = since
        self.responded = False
        #: The response's first message went out (its status can no longer change).
        self.started = False
        self.cancelled_here = False
        self.watcher: asyncio.Task[None] | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.watcher = loop.create_task(self._wait_for_disconnect())

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()

    async def _wait_for_disconnect(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        ex = self.ex
        if not self.responded and not ex.settling:
            self.cancelled_here = True
            ex.outcome, ex.status = "client_closed", 499
            self.task.cancel()


async def _send_last(send: Send, message: MutableMapping[str, Any], watch: _Watch) -> None:
    """Send the response's last message; from then on a disconnect is the exchange's end."""
    await send(message)
    watch.responded = True


class _TrackedSend:
    """``send``, noting on ``watch`` when the response starts and when its last message went
    out. A body message with more to come is sent on unchanged: a stream's writer takes
    :attr:`body_send` for those, a call less a chunk."""

    __slots__ = ("body_send", "watch")

    def __init__(self, send: Send, watch: _Watch) -> None:
        self.body_send = send
        self.watch = watch

    def __call__(self, message: MutableMapping[str, Any]) -> Awaitable[None]:
        if message["type"] == "http.response.body":
            if not message.get("more_body"):
                return _send_last(self.body_send, message, self.watch)
        else:
            self.watch.started = True
        return self.body_send(message)


class DisconnectWatches:
    """The requests in flight, and a timer that gives each a watcher once it has run a while.

    Adding and discarding a request is a dictionary operation; the one timer runs only while
    some request is in flight, every :data:`WATCH_AFTER_S` at most. Timing uses the event loop's
    own clock: this is socket plumbing, not a policy, and must not follow a test's manual clock.
    """

    def __init__(self, after_s: float | None = None) -> None:
        self.after_s = WATCH_AFTER_S if after_s is None else after_s
        self._young: dict[_Watch, None] = {}  # oldest first, not yet watched
        self._watched: set[_Watch] = set()
        self._timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._young) + len(self._watched)

    def add(self, watch: _Watch) -> None:
        self._young[watch] = None
        if self._timer is None:
            loop = watch.task.get_loop()
            self._timer = loop.call_at(watch.since + self.after_s, self._promote, loop)

    def discard(self, watch: _Watch) -> None:
        if self._young.pop(watch, 0) is None:
            return
        self._watched.discard(watch)
        watch.stop()

    def _promote(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        due = loop.time() - self.after_s
        young = self._young
        while young:
            watch = next(iter(young))
            if watch.since > due:
                self._timer = loop.call_at(watch.since + self.after_s, self._promote, loop)
                return
            del young[watch]
            self._watched.add(watch)
            watch.start(loop)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def end_all(self) -> int:
        """Cancel every request not yet answered nor settling, with :data:`DRAIN_ENDED`."""
        ended = 0
        for watch in [*self._young, *self._watched]:
            if not watch.responded and not watch.ex.settling:
                watch.task.cancel(DRAIN_ENDED)
                ended += 1
        return ended

    async def run(
        self,
        ex: Exchange,
        receive: Receive,
        send: Send,
        answer: Callable[[Send], Awaitable[None]],
    ) -> None:
        """Run ``answer`` (given the ``send`` to answer through) in this task; a client that
        goes away first cancels it.

        A request still running after :data:`WATCH_AFTER_S` gets a watcher task that waits for
        ``http.disconnect`` (most answers are sent sooner, and never pay for one). A disconnect
        after the last byte was sent, or once the request is settling its bookkeeping, is the
        normal end of the exchange and cancels nothing; the settlement itself is shielded when a
        cancellation does arrive.
        """
        loop = asyncio.get_running_loop()
        this = asyncio.current_task(loop)
        assert this is not None
        ex.task = this
        watch = _Watch(this, ex, receive, loop.time())

        tracked_send = _TrackedSend(send, watch)
        self.add(watch)
        try:
            await answer(tracked_send)
        except asyncio.CancelledError as cancel:
            # Only the watcher's own cancellation and the gateway's at the drain's end stop
            # here; another one requested meanwhile (uvicorn's at the drain deadline) goes on.
            drained = cancel.args == (DRAIN_ENDED,)
            if not (drained or watch.cancelled_here) or this.uncancel() > 0:
                raise
            if drained and not watch.started:
                error = ShuttingDown("the replica shut down before the answer was ready")
                ex.outcome = error.code
                ex.status = await send_error(send, error, ex.answer_headers())
        finally:
            self.discard(watch)
