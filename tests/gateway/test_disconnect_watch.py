"""Disconnect watches: only requests still running after ``after_s`` get a watcher task.

Unit tests of :class:`DisconnectWatches` and :class:`_Watch` on the real loop with a tiny
``after_s`` (the waits are a few tens of milliseconds), and a few through
``DisconnectWatches.run`` as the gateway calls it. The client is a ``receive`` callable that answers
``http.disconnect`` once the test resolves a future.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from pathlib import Path
from typing import Any, cast

import pytest

from tests.gateway.harness import write_config
from tidegate.clock import ManualClock, SystemClock
from tidegate.gateway.app import Gateway
from tidegate.gateway.config import load_config
from tidegate.gateway.pipeline import Exchange
from tidegate.gateway.runtime import Runtime
from tidegate.gateway.watch import DisconnectWatches, _Watch

Message = MutableMapping[str, Any]

AFTER_S = 0.01
#: Yields to the event loop without any time passing.
CLOCK = ManualClock()
REAL = SystemClock()


async def _rounds(n: int = 5) -> None:
    for _ in range(n):
        await CLOCK.asleep(0)


async def _until(condition: Callable[[], bool], within: float = 0.5) -> None:
    """Wait (for real, in small steps) until ``condition()`` holds."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + within
    while not condition():
        assert loop.time() < give_up, "condition not met in time"
        await REAL.asleep(0.001)


class Client:
    """The ASGI ``receive`` side: ``http.disconnect`` once :attr:`gone` is resolved.

    Messages in :attr:`before` are handed out first, one per call. A cancelled ``receive()``
    leaves :attr:`gone` as it was (as a server's would), so it can still be resolved later.
    """

    def __init__(self, before: list[Message] | None = None) -> None:
        self.gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.before = list(before or [])
        self.calls = 0

    async def receive(self) -> Message:
        self.calls += 1
        if self.before:
            return self.before.pop(0)
        await asyncio.shield(self.gone)
        return {"type": "http.disconnect"}

    def disconnect(self) -> None:
        self.gone.set_result(None)


class Request:
    """A request task that registers its watch, waits for :attr:`finish`, then discards it."""

    def __init__(
        self, watches: DisconnectWatches, client: Client | None = None, since: float | None = None
    ) -> None:
        loop = asyncio.get_running_loop()
        self.watches = watches
        self.ex = Exchange(request_id="r")
        self.client = client or Client()
        self.finish: asyncio.Future[str] = loop.create_future()
        self.since = since
        self._watch: _Watch | None = None
        self.task = loop.create_task(self._run())

    @property
    def watch(self) -> _Watch:
        assert self._watch is not None, "the request has not started yet"
        return self._watch

    async def _run(self) -> str:
        this = asyncio.current_task()
        assert this is not None
        since = asyncio.get_running_loop().time() if self.since is None else self.since
        self._watch = _Watch(this, self.ex, self.client.receive, since)
        self.watches.add(self._watch)
        try:
            return await self.finish
        finally:
            self.watches.discard(self._watch)


def _watcher(request: Request) -> asyncio.Task[None]:
    watcher = request.watch.watcher
    assert watcher is not None
    return watcher


# --------------------------------------------------------------------------- DisconnectWatches


@pytest.mark.asyncio
async def test_a_request_ending_before_after_s_never_gets_a_watcher() -> None:
    watches = DisconnectWatches(after_s=0.05)
    request = Request(watches)
    await _rounds()
    assert len(watches) == 1
    request.finish.set_result("fast")
    await _rounds()
    assert request.task.result() == "fast"
    assert len(watches) == 0
    loop = asyncio.get_running_loop()
    await _until(lambda: loop.time() > request.watch.since + 0.06)
    await _rounds()
    assert request.watch.watcher is None
    assert request.client.calls == 0
    assert watches._timer is None  # it fired, found nobody, and stays disarmed
    assert len(watches) == 0


@pytest.mark.asyncio
async def test_a_long_request_gets_a_watcher_and_a_disconnect_cancels_it() -> None:
    loop = asyncio.get_running_loop()
    watches = DisconnectWatches(after_s=AFTER_S)
    client = Client(before=[{"type": "http.request", "body": b"", "more_body": False}])
    request = Request(watches, client)
    await _rounds()
    since = request.watch.since
    assert request.watch.watcher is None or loop.time() >= since + AFTER_S - 1e-6
    await _until(lambda: request.watch.watcher is not None)
    assert loop.time() >= since + AFTER_S - 1e-6
    await _rounds()
    watcher = _watcher(request)
    assert not watcher.done()
    assert client.calls == 2  # the stray message was skipped; now waiting for the disconnect
    assert not request.task.done()
    assert request.ex.outcome == "ok"
    assert len(watches) == 1

    client.disconnect()
    await _rounds()
    assert request.task.cancelled()
    assert request.ex.outcome == "client_closed"
    assert request.ex.status == 499
    assert request.watch.cancelled_here
    assert watcher.done()
    assert not watcher.cancelled()
    assert len(watches) == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("flag", ["responded", "settling"])
async def test_a_disconnect_after_the_response_or_while_settling_cancels_nothing(
    flag: str,
) -> None:
    watches = DisconnectWatches(after_s=AFTER_S)
    request = Request(watches)
    await _rounds()
    await _until(lambda: request.watch.watcher is not None)
    await _rounds()
    if flag == "responded":
        request.watch.responded = True
    else:
        request.ex.settling = True
    request.client.disconnect()
    await _rounds()
    watcher = _watcher(request)
    assert watcher.done()
    assert not watcher.cancelled()
    assert not request.task.done()
    assert request.task.cancelling() == 0
    assert not request.watch.cancelled_here
    assert (request.ex.outcome, request.ex.status) == ("ok", 200)
    request.finish.set_result("finished")
    await _rounds()
    assert request.task.result() == "finished"
    assert len(watches) == 0


@pytest.mark.asyncio
async def test_discarding_a_watched_request_cancels_its_watcher() -> None:
    watches = DisconnectWatches(after_s=AFTER_S)
    request = Request(watches)
    await _rounds()
    await _until(lambda: request.watch.watcher is not None)
    await _rounds()
    watcher = _watcher(request)
    assert not watcher.done()
    request.finish.set_result("done")
    await _rounds()
    assert request.task.result() == "done"
    assert watcher.cancelled()
    assert len(watches) == 0
    assert not watches._watched
    # A disconnect now reaches nobody.
    request.client.disconnect()
    await _rounds()
    assert request.ex.outcome == "ok"


@pytest.mark.asyncio
async def test_a_watcher_started_just_before_the_request_ends_is_cancelled_unrun() -> None:
    """Promoted in the loop round in which the request finishes: the watcher never calls receive."""
    loop = asyncio.get_running_loop()
    watches = DisconnectWatches(after_s=AFTER_S)
    request = Request(watches, since=loop.time() - AFTER_S)  # due at once
    await _rounds(1)
    request.finish.set_result("done")  # the request's wake-up is queued ...
    watches.close()  # instead of the timer, promote by hand, now:
    watches._promote(loop)  # the watcher's first step is queued after the request's wake-up
    assert request.watch.watcher is not None
    await _rounds()
    assert request.task.result() == "done"
    assert _watcher(request).cancelled()
    assert request.client.calls == 0
    assert len(watches) == 0


@pytest.mark.asyncio
async def test_close_cancels_the_timer() -> None:
    watches = DisconnectWatches(after_s=AFTER_S)
    request = Request(watches)
    await _rounds()
    timer = watches._timer
    assert timer is not None
    watches.close()
    assert timer.cancelled()
    assert watches._timer is None
    watches.close()  # twice is fine
    loop = asyncio.get_running_loop()
    await _until(lambda: loop.time() > request.watch.since + 3 * AFTER_S)
    await _rounds()
    assert request.watch.watcher is None
    request.finish.set_result("done")
    await _rounds()
    assert len(watches) == 0


@pytest.mark.asyncio
async def test_one_timer_for_all_requests_promoting_each_in_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = asyncio.get_running_loop()
    armed: list[float] = []
    real_call_at = loop.call_at

    def counting_call_at(
        when: float, callback: Any, *args: Any, **kwargs: Any
    ) -> asyncio.TimerHandle:
        if getattr(callback, "__self__", None) is watches:
            armed.append(when)
        return real_call_at(when, callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_at", counting_call_at)
    watches = DisconnectWatches(after_s=AFTER_S)
    now = loop.time()
    old = [Request(watches, since=now - AFTER_S) for _ in range(50)]
    young = Request(watches, since=now + 10.0)  # "started" far in the future: not due for long
    await _rounds(1)
    assert armed == [now]  # the first add armed the one timer; the others did not
    await _until(lambda: all(r.watch.watcher is not None for r in old))
    assert young.watch.watcher is None
    # Re-armed once, for the oldest request still young.
    assert armed == [now, now + 10.0 + AFTER_S]
    timer = watches._timer
    assert timer is not None
    assert timer.when() == now + 10.0 + AFTER_S
    assert len(watches) == 51

    for request in old:
        request.finish.set_result("ok")
    young.finish.set_result("ok")
    await _rounds()
    assert all(_watcher(r).cancelled() for r in old)
    assert len(watches) == 0
    watches.close()
    assert timer.cancelled()


@pytest.mark.asyncio
async def test_a_request_added_after_the_timer_went_idle_arms_it_again() -> None:
    loop = asyncio.get_running_loop()
    watches = DisconnectWatches(after_s=AFTER_S)
    first = Request(watches, since=loop.time() - AFTER_S)
    await _rounds()
    assert first.watch.watcher is not None
    assert watches._timer is None  # nobody young left: idle
    second = Request(watches, since=loop.time() - AFTER_S)
    await _rounds()
    assert watches._timer is None
    assert second.watch.watcher is not None
    second.client.disconnect()
    await _rounds()
    assert second.task.cancelled()
    assert (second.ex.outcome, second.ex.status) == ("client_closed", 499)
    assert not first.task.done()
    first.finish.set_result("ok")
    await _rounds()
    assert first.task.result() == "ok"
    assert len(watches) == 0


# --------------------------------------------------------------------------- end to end


@pytest.fixture
def app(tmp_path: Path) -> Gateway:
    config = {
        "providers": {"p": {"type": "fake", "model": "m-2026-01"}},
        "models": {"chat": {"providers": ["p"]}},
    }
    path = write_config(tmp_path, config)
    gateway = Gateway(load_config(path, env={}), path)
    gateway._watches = DisconnectWatches(after_s=AFTER_S)
    return gateway


#: What a model endpoint is called as (here a plain function stands in for one).
Handler = Callable[[Runtime, Exchange, dict[str, str], dict[str, Any], Any], Awaitable[None]]

#: The handler never touches the runtime in these tests.
NO_RUNTIME = cast(Runtime, None)


async def _sent(message: Message) -> None:
    return None


def _run(app: Gateway, handler: Handler, ex: Exchange, client: Client) -> Coroutine[Any, Any, None]:
    """``handler`` run by the app's watches, as the gateway runs a model call."""
    answer = functools.partial(handler, NO_RUNTIME, ex, {}, {})
    return app._watches.run(ex, client.receive, _sent, answer)


def _start(app: Gateway, handler: Handler) -> tuple[asyncio.Task[None], Client, Exchange]:
    """``handler`` run by the app's watches in a task of its own, for a new client."""
    client = Client()
    ex = Exchange(request_id="r")
    task = asyncio.get_running_loop().create_task(_run(app, handler, ex, client))
    return task, client, ex


@pytest.mark.asyncio
async def test_run_watching_disconnect_a_fast_handler_never_reads_receive(app: Gateway) -> None:
    client = Client()
    ex = Exchange(request_id="r")

    async def handler(
        rt: Runtime, ex: Exchange, headers: dict[str, str], body: dict[str, Any], send: Any
    ) -> None:
        await _rounds(2)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    await _run(app, handler, ex, client)
    assert len(app._watches) == 0
    loop = asyncio.get_running_loop()
    now = loop.time()
    await _until(lambda: loop.time() > now + 2 * AFTER_S)
    assert client.calls == 0
    assert (ex.outcome, ex.status) == ("ok", 200)


@pytest.mark.asyncio
async def test_run_watching_disconnect_a_disconnect_cancels_a_slow_handler(app: Gateway) -> None:
    handler_saw: list[str] = []
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def handler(
        rt: Runtime, ex: Exchange, headers: dict[str, str], body: dict[str, Any], send: Any
    ) -> None:
        try:
            await never
        except asyncio.CancelledError:
            handler_saw.append("cancelled")
            raise

    task, client, ex = _start(app, handler)
    await _until(lambda: client.calls == 1)
    assert not task.done()
    client.disconnect()
    await _rounds()
    assert task.done()
    assert task.result() is None  # the disconnect's own cancellation does not escape
    assert task.cancelling() == 0
    assert handler_saw == ["cancelled"]
    assert (ex.outcome, ex.status) == ("client_closed", 499)
    assert len(app._watches) == 0


@pytest.mark.asyncio
async def test_run_watching_disconnect_a_disconnect_after_the_last_byte_cancels_nothing(
    app: Gateway,
) -> None:
    loop = asyncio.get_running_loop()
    linger: asyncio.Future[None] = loop.create_future()

    async def handler(
        rt: Runtime, ex: Exchange, headers: dict[str, str], body: dict[str, Any], send: Any
    ) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{", "more_body": True})
        await send({"type": "http.response.body", "body": b"}"})
        await linger  # e.g. bookkeeping after the answer

    task, client, ex = _start(app, handler)
    await _until(lambda: client.calls == 1)
    client.disconnect()
    await _rounds()
    assert not task.done()
    linger.set_result(None)
    await _rounds()
    assert task.result() is None
    assert (ex.outcome, ex.status) == ("ok", 200)
    assert len(app._watches) == 0


@pytest.mark.asyncio
async def test_run_watching_disconnect_a_cancellation_from_elsewhere_propagates(
    app: Gateway,
) -> None:
    loop = asyncio.get_running_loop()
    never: asyncio.Future[None] = loop.create_future()

    async def handler(
        rt: Runtime, ex: Exchange, headers: dict[str, str], body: dict[str, Any], send: Any
    ) -> None:
        await never

    task, client, ex = _start(app, handler)
    await _until(lambda: client.calls == 1)
    task.cancel()
    await _rounds()
    assert task.cancelled()
    assert (ex.outcome, ex.status) == ("ok", 200)
    assert len(app._watches) == 0


@pytest.mark.asyncio
async def test_run_watching_disconnect_a_later_cancellation_from_elsewhere_still_propagates(
    app: Gateway,
) -> None:
    """The disconnect cancels the handler, which settles (shielded); then the server's drain
    deadline cancels the request task too. As with ``asyncio.timeout``, the second, foreign
    cancellation must propagate: the task ends cancelled, not normally with ``cancelling() == 1``.
    """
    loop = asyncio.get_running_loop()
    never: asyncio.Future[None] = loop.create_future()
    settlement: asyncio.Future[None] = loop.create_future()

    async def handler(
        rt: Runtime, ex: Exchange, headers: dict[str, str], body: dict[str, Any], send: Any
    ) -> None:
        try:
            await never
        except asyncio.CancelledError:
            await asyncio.shield(settlement)  # as settle_shielded does
            raise

    task, client, ex = _start(app, handler)
    await _until(lambda: client.calls == 1)
    client.disconnect()
    await _rounds()
    assert not task.done()  # settling, shielded
    assert task.cancelling() == 1
    task.cancel()  # the drain deadline
    await _rounds()
    assert task.done()
    assert (ex.outcome, ex.status) == ("client_closed", 499)
    assert task.cancelled()
