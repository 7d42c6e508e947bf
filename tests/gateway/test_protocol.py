"""The connection guard (gateway.protocol) over real sockets against `tidegate serve`."""

from __future__ import annotations

import contextlib
import inspect
import json
import socket
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from tests.gateway.harness import KEY, ServedProcess, fake, serving_process
from tidegate.clock import SystemClock
from tidegate.gateway.protocol import GuardedHttpToolsProtocol

#: Socket plumbing timed by the real clock: the server's timers are real ones.
CLOCK = SystemClock()

#: Short enough that a test waits a fraction of a second, long enough for loopback.
TIMEOUT_S = 0.3
CONFIG: dict[str, Any] = {
    "server": {
        "header_timeout_s": TIMEOUT_S,
        "body_timeout_s": TIMEOUT_S,
        "keep_alive_s": TIMEOUT_S,
        "max_header_count": 100,
        "max_header_bytes": 32_768,
    },
    "providers": {"main": fake("hello")},
    "models": {"chat": {"providers": ["main"]}},
}
HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: t\r\n"
#: uvicorn 0.54's HttpToolsProtocol.data_received, which GuardedHttpToolsProtocol.data_received
#: repeats with the limits around it.
UVICORN_DATA_RECEIVED = """\
def data_received(self, data: bytes) -> None:
    self._unset_keepalive_if_required()

    try:
        self.parser.feed_data(data)
    except httptools.HttpParserError:
        msg = "Invalid HTTP request received."
        self.logger.warning(msg)
        self.send_400_response(msg)
        return
    except httptools.HttpParserUpgrade:
        if self._should_upgrade():
            self.handle_websocket_upgrade()
        else:
            self._unsupported_upgrade_warning()
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProcess]:
    with serving_process(tmp_path_factory.mktemp("guard"), CONFIG) as served:
        yield served


def _connect(server: ServedProcess) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    conn.settimeout(5)
    return conn


def _send(conn: socket.socket, data: bytes) -> None:
    """Send what the server still reads; a server that closed mid-way is an answer too."""
    with contextlib.suppress(OSError):
        conn.sendall(data)


def _read_all(conn: socket.socket) -> bytes:
    """What the server sends until it closes (a reset ends it too)."""
    out = b""
    try:
        while chunk := conn.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def _read_response(conn: socket.socket) -> bytes:
    """One response with a Content-Length body, on a connection that stays open."""
    out = b""
    while b"\r\n\r\n" not in out:
        out += conn.recv(65536)
    head, _, body = out.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += conn.recv(65536)
    return head + b"\r\n\r\n" + body


def _status(response: bytes) -> int | None:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else None


def _error_code(response: bytes) -> str:
    return str(json.loads(response.partition(b"\r\n\r\n")[2])["error"]["code"])


def _trickle(conn: socket.socket, data: bytes, *, every_s: float) -> None:
    pause = threading.Event()
    for i in range(len(data)):
        try:
            conn.sendall(data[i : i + 1])
        except OSError:
            return
        pause.wait(every_s)


def _chat_body() -> bytes:
    return json.dumps({"model": "chat", "messages": [{"role": "user", "content": "hi"}]}).encode()


def _chat_head(body: bytes) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
        b"Authorization: Bearer " + KEY.encode() + b"\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )


# --------------------------------------------------------------------------- uvicorn's internals


def test_the_uvicorn_internals_the_guard_builds_on_are_the_ones_it_was_written_for() -> None:
    """uvicorn's data_received (repeated by the guard) and the names it uses are unchanged."""
    upstream = textwrap.dedent(inspect.getsource(HttpToolsProtocol.data_received))
    assert upstream == UVICORN_DATA_RECEIVED, (
        "uvicorn's HttpToolsProtocol.data_received changed: review "
        "GuardedHttpToolsProtocol.data_received, then update UVICORN_DATA_RECEIVED"
    )
    for name in (
        "_unset_keepalive_if_required",
        "_should_upgrade",
        "handle_websocket_upgrade",
        "_unsupported_upgrade_warning",
        "send_400_response",
        "connection_made",
        "connection_lost",
        "shutdown",
        "on_headers_complete",
        "on_message_complete",
    ):
        assert callable(getattr(HttpToolsProtocol, name)), name
    protocol_init = inspect.getsource(HttpToolsProtocol.__init__)
    for attribute in ("parser", "loop", "pipeline", "cycle", "logger", "headers", "server_state"):
        assert f"self.{attribute}" in protocol_init, attribute
    assert "self.url += url" in inspect.getsource(HttpToolsProtocol.on_url)
    assert "self.headers.append((name, value))" in inspect.getsource(HttpToolsProtocol.on_header)
    cycle_init = inspect.getsource(RequestResponseCycle.__init__)
    for attribute in ("disconnected", "message_event", "response_started", "response_complete"):
        assert f"self.{attribute} =" in cycle_init, attribute
    assert issubclass(GuardedHttpToolsProtocol, HttpToolsProtocol)


# --------------------------------------------------------------------------- header limits


@pytest.mark.slow
def test_twenty_thousand_headers_are_refused_with_431(server: ServedProcess) -> None:
    """A head with 20,000 header fields gets 431 headers_too_large and the connection closes."""
    fields = b"".join(b"x-h%d: v\r\n" % i for i in range(20_000))
    with _connect(server) as conn:
        _send(conn, HEALTHZ + fields + b"\r\n")
        response = _read_all(conn)
    assert _status(response) == 431, response[:200]
    assert _error_code(response) == "headers_too_large"


@pytest.mark.slow
def test_more_header_fields_than_the_limit_are_refused_with_431(server: ServedProcess) -> None:
    """A small head with 150 header fields (over the 100 allowed) gets 431 naming the count."""
    fields = b"".join(b"x-h%d: v\r\n" % i for i in range(150))
    with _connect(server) as conn:
        _send(conn, HEALTHZ + fields + b"\r\n")
        response = _read_all(conn)
    assert _status(response) == 431, response[:200]
    assert b"more than 100 header fields" in response


@pytest.mark.slow
def test_a_head_over_the_byte_limit_in_one_read_is_refused_with_431(
    server: ServedProcess,
) -> None:
    """A 40 KiB head that arrives complete, with its body, in one write still gets 431."""
    body = _chat_body()
    head = _chat_head(body)
    padded = head.replace(b"Host: t\r\n", b"Host: t\r\nx-pad: " + b"p" * 40_000 + b"\r\n")
    with _connect(server) as conn:
        _send(conn, padded + body)
        response = _read_all(conn)
    assert _status(response) == 431, response[:200]
    assert b"over 32768 bytes" in response


@pytest.mark.slow
def test_an_8_mib_header_is_refused_with_431(server: ServedProcess) -> None:
    """One 8 MiB header gets 431 long before the server has read it all."""
    started = CLOCK.now()
    with _connect(server) as conn:
        _send(conn, HEALTHZ + b"x-big: " + b"a" * (8 << 20) + b"\r\n\r\n")
        response = _read_all(conn)
    assert _status(response) in (431, None), response[:200]  # None: reset before it was read
    assert b"200 OK" not in response
    assert CLOCK.now() - started < 3


@pytest.mark.slow
def test_huge_headers_from_several_connections_do_not_grow_the_process(
    server: ServedProcess,
) -> None:
    """Four connections each sending a 64 MiB header leave the server's memory within 8 MiB."""
    header = HEALTHZ + b"x-big: " + b"a" * (64 << 20)
    before = server.rss_kib()
    peak = [before]

    def send_one() -> None:
        with _connect(server) as conn:
            conn.settimeout(10)
            _send(conn, header)
            _read_all(conn)

    senders = [threading.Thread(target=send_one) for _ in range(4)]
    for sender in senders:
        sender.start()
    while any(s.is_alive() for s in senders):
        peak.append(server.rss_kib())
        threading.Event().wait(0.01)
    for sender in senders:
        sender.join(timeout=20)
    peak.append(server.rss_kib())
    assert max(peak) - before < 8 * 1024, (before, max(peak))


@pytest.mark.slow
def test_a_head_just_within_the_limits_is_served(server: ServedProcess) -> None:
    """98 header fields of 30 KiB in all, arriving in one read, are an ordinary request."""
    fields = b"".join(b"x-h%d: %s\r\n" % (i, b"v" * 300) for i in range(97))
    with _connect(server) as conn:
        _send(conn, HEALTHZ + fields + b"Connection: close\r\n\r\n")
        response = _read_all(conn)
    assert _status(response) == 200, response[:200]


# --------------------------------------------------------------------------- timeouts


@pytest.mark.slow
def test_headers_trickled_past_the_header_timeout_get_408(server: ServedProcess) -> None:
    """A head sent a byte every 20 ms is answered 408 request_timeout and closed at 0.3 s."""
    started = CLOCK.now()
    with _connect(server) as conn:
        trickler = threading.Thread(
            target=_trickle,
            args=(conn, HEALTHZ + b"x-slow: " + b"a" * 200 + b"\r\n\r\n"),
            kwargs={"every_s": 0.02},
        )
        trickler.start()
        response = _read_all(conn)
        elapsed = CLOCK.now() - started
        trickler.join(timeout=10)
    assert _status(response) == 408, response[:200]
    assert _error_code(response) == "request_timeout"
    assert TIMEOUT_S * 0.9 <= elapsed < 2


@pytest.mark.slow
def test_a_body_trickled_past_the_body_timeout_gets_408(server: ServedProcess) -> None:
    """A body sent a byte every 20 ms after a prompt head gets 408 and the connection closes."""
    body = _chat_body()
    started = CLOCK.now()
    with _connect(server) as conn:
        conn.sendall(_chat_head(body))
        trickler = threading.Thread(target=_trickle, args=(conn, body), kwargs={"every_s": 0.02})
        trickler.start()
        response = _read_all(conn)
        elapsed = CLOCK.now() - started
        trickler.join(timeout=10)
    assert _status(response) == 408, response[:200]
    assert _error_code(response) == "request_timeout"
    assert b"body" in response
    assert TIMEOUT_S * 0.9 <= elapsed < 2


@pytest.mark.slow
def test_a_body_in_several_reads_within_its_time_is_served(server: ServedProcess) -> None:
    """A body in three parts 50 ms apart is an ordinary request: 200 with the answer."""
    body = _chat_body()
    pause = threading.Event()
    with _connect(server) as conn:
        conn.sendall(_chat_head(body))
        third = len(body) // 3
        for part in (body[:third], body[third : 2 * third], body[2 * third :]):
            pause.wait(0.05)
            conn.sendall(part)
        response = _read_response(conn)
    assert _status(response) == 200, response[:300]
    assert json.loads(response.partition(b"\r\n\r\n")[2])["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(
    server: ServedProcess,
) -> None:
    """A connection that never sends a byte is closed, unanswered, after the header timeout."""
    started = CLOCK.now()
    with _connect(server) as conn:
        response = _read_all(conn)
    assert response == b""
    assert TIMEOUT_S * 0.9 <= CLOCK.now() - started < 2


@pytest.mark.slow
def test_an_idle_keep_alive_connection_is_closed_after_keep_alive_s(
    server: ServedProcess,
) -> None:
    """A kept-alive connection serves a second request at once, then is closed when idle."""
    with _connect(server) as conn:
        conn.sendall(HEALTHZ + b"\r\n")
        assert _status(_read_response(conn)) == 200
        conn.sendall(HEALTHZ + b"\r\n")
        assert _status(_read_response(conn)) == 200
        idle_from = CLOCK.now()
        assert _read_all(conn) == b""
        idle = CLOCK.now() - idle_from
    assert TIMEOUT_S * 0.9 <= idle < 2
