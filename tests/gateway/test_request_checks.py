"""What the gateway checks before it serves a request, and what it refuses: hostile or careless
input gets its documented 4xx, never a 500 or another caller's answer."""

from __future__ import annotations

import hashlib
import io
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
import structlog
import yaml

from tests.gateway.conftest import AppFactory
from tests.gateway.harness import KEY, fake
from tidegate.gateway import http, pipeline
from tidegate.gateway.logsink import flush_logs
from tidegate.gateway.pipeline import answer
from tidegate.gateway.runtime import Route
from tidegate.providers.fake import FakeProvider

pytestmark = pytest.mark.asyncio

CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hello"}]}
EMBED = {"model": "chat", "input": "hello"}
JSON = {"Content-Type": "application/json"}
#: A second user of KEY's tenant, in the keys file written by :func:`team_keys`.
TEAMMATE_KEY = "tg-test-teammate-key"


def one_route(**overrides: Any) -> dict[str, Any]:
    return {
        "providers": {"p": fake("answer", model="m-1")},
        "models": {"chat": {"providers": ["p"]}},
        "cache": {"enabled": False},
        **overrides,
    }


def attempts(app: Any, name: str = "p") -> int:
    provider = app.runtime.providers[name]
    assert isinstance(provider, FakeProvider)
    return len(provider.attempts)


def team_keys(tmp_path: Path, *, teammate_models: tuple[str, ...] = ("*",)) -> dict[str, Any]:
    """A keys file with two users of tenant t1 (KEY and TEAMMATE_KEY); its auth section."""

    def entry(key: str, user: str, models: tuple[str, ...]) -> dict[str, Any]:
        return {
            "id": user,
            "sha256": hashlib.sha256(key.encode()).hexdigest(),
            "tenant": "t1",
            "user": user,
            "models": list(models),
        }

    keys = {"keys": [entry(KEY, "u1", ("*",)), entry(TEAMMATE_KEY, "u3", teammate_models)]}
    (tmp_path / "team.yaml").write_text(yaml.safe_dump(keys), encoding="utf-8")
    return {"keys_file": "team.yaml"}


def nested(depth: int) -> bytes:
    """A valid chat body whose deepest value sits ``depth`` levels down (the body is level 1),
    written by hand: neither json nor orjson writes a value this deep."""
    inner = b"[" * (depth - 2) + b"{}" + b"]" * (depth - 2)
    return orjson.dumps(CHAT)[:-1] + b',"metadata":' + inner + b"}"


# --------------------------------------------------------------------------- nesting depth


@pytest.mark.parametrize("depth", [http.MAX_JSON_DEPTH + 1, 300, 1_000])
async def test_a_body_nested_past_the_limit_is_400_not_500(
    gateway_client: AppFactory, depth: int
) -> None:
    """A body nested deeper than MAX_JSON_DEPTH is refused as invalid, before any provider call."""
    async with gateway_client(one_route()) as (client, app):
        response = await client.post("/v1/chat/completions", content=nested(depth), headers=JSON)
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["code"], error["retryable"]) == ("invalid_request", False)
        assert f"deeper than {http.MAX_JSON_DEPTH} levels" in error["message"]
        assert attempts(app) == 0


async def test_a_body_at_the_depth_limit_or_with_many_shallow_containers_is_served(
    gateway_client: AppFactory,
) -> None:
    """Nesting up to the limit is fine, and so are many brackets that nest shallowly."""
    many = {**CHAT, "messages": [{"role": "user", "content": f"{i}"} for i in range(200)]}
    brackets = {**CHAT, "messages": [{"role": "user", "content": "[{" * 100}]}
    async with gateway_client(one_route()) as (client, _):
        for body in (nested(http.MAX_JSON_DEPTH), orjson.dumps(many), orjson.dumps(brackets)):
            response = await client.post("/v1/chat/completions", content=body, headers=JSON)
            assert response.status_code == 200, response.text


# --------------------------------------------------------------------------- tracebacks


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/chat/completions", CHAT), ("/v1/embeddings", EMBED)]
)
async def test_an_internal_error_logs_its_traceback_in_the_json_line(
    gateway_client: AppFactory, monkeypatch: pytest.MonkeyPatch, path: str, body: dict[str, Any]
) -> None:
    """A 500 writes one JSON log line carrying the exception's frames, without their locals."""
    out = io.TextIOWrapper(io.BytesIO())
    monkeypatch.setattr(sys, "stdout", out)  # where configure_logging, at start-up, writes

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug on the request path")

    monkeypatch.setattr(Route, "plan", broken)
    try:
        async with gateway_client(one_route()) as (client, _):
            # A fresh logger: the module's own may have been bound by an earlier configuration.
            monkeypatch.setattr(answer, "log", structlog.get_logger("tidegate"))
            response = await client.post(path, json=body)
        flush_logs()
    finally:
        structlog.reset_defaults()
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "internal_error"
    raw = out.buffer.getvalue()
    lines = [orjson.loads(line) for line in raw.splitlines() if line]
    (line,) = [line for line in lines if line["event"] == "internal_error"]
    assert line["request_id"] == response.headers["x-request-id"]
    (exception,) = line["exception"]
    assert (exception["exc_type"], exception["exc_value"]) == (
        "RuntimeError",
        "a bug on the request path",
    )
    assert exception["frames"][-1]["name"] == "broken"
    assert all("locals" not in frame for frame in exception["frames"])
    assert KEY.encode() not in raw  # the request's headers were a local of the frames


# --------------------------------------------------------------------------- idempotency scope


async def test_an_idempotency_key_is_scoped_to_the_user_not_only_the_tenant(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """Another user of the tenant with the same key runs its own request: no replay, no 422."""
    other = {**CHAT, "messages": [{"role": "user", "content": "something else"}]}
    teammate = {"Authorization": f"Bearer {TEAMMATE_KEY}"}
    async with gateway_client(one_route(auth=team_keys(tmp_path))) as (client, app):
        first = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"Idempotency-Key": "same-body"}
        )
        theirs = await client.post(
            "/v1/chat/completions",
            json=CHAT,
            headers={**teammate, "Idempotency-Key": "same-body"},
        )
        assert (first.status_code, theirs.status_code) == (200, 200)
        assert "idempotent-replayed" not in theirs.headers
        assert theirs.json()["id"] != first.json()["id"]
        assert attempts(app) == 2

        await client.post(
            "/v1/chat/completions", json=CHAT, headers={"Idempotency-Key": "other-body"}
        )
        reused = await client.post(
            "/v1/chat/completions",
            json=other,
            headers={**teammate, "Idempotency-Key": "other-body"},
        )
        assert reused.status_code == 200, reused.text
        assert attempts(app) == 4

        mine = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"Idempotency-Key": "same-body"}
        )
        assert mine.headers["idempotent-replayed"] == "true"  # the key still replays for u1
        assert mine.content == first.content
        assert attempts(app) == 4


async def test_a_replay_says_its_content_type_once(gateway_client: AppFactory) -> None:
    """A replayed answer carries one Content-Type header, as the first answer did."""
    async with gateway_client(one_route()) as (client, _):
        headers = {"Idempotency-Key": "k"}
        first = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
        again = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
        assert again.headers["idempotent-replayed"] == "true"
        assert again.headers.get_list("content-type") == first.headers.get_list("content-type")
        assert again.headers.get_list("content-type") == ["application/json"]


# --------------------------------------------------------------------------- who, then what


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/embeddings"])
@pytest.mark.parametrize(
    ("content", "content_type"),
    [
        (b'{"model": ""}', "application/json"),
        (b"{not json", "application/json"),
        (b'{"model": "chat"}', "text/plain"),
    ],
)
async def test_a_caller_without_a_valid_key_is_401_whatever_its_body(
    gateway_client: AppFactory, path: str, content: bytes, content_type: str
) -> None:
    """Authentication comes before the body: no key or a wrong key is 401, never 400 or 415."""
    async with gateway_client(one_route()) as (client, _):
        for authorization in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
            response = await client.post(
                path, content=content, headers={**authorization, "Content-Type": content_type}
            )
            assert response.status_code == 401, response.text
            assert response.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"model": "", "messages": []}),
        ("/v1/embeddings", {"model": "chat"}),
    ],
)
async def test_a_valid_key_with_a_bad_body_is_400(
    gateway_client: AppFactory, path: str, body: dict[str, Any]
) -> None:
    """With a valid key, the body's own mistake is what the caller is told (400)."""
    async with gateway_client(one_route()) as (client, _):
        response = await client.post(path, json=body)
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "invalid_request"


# --------------------------------------------------------------------------- /v1/models


async def test_the_model_list_needs_a_key_and_shows_only_the_keys_aliases(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """GET /v1/models is 401 without a valid key, and lists the aliases that key may use."""
    config = one_route(
        models={"chat": {"providers": ["p"]}, "other": {"providers": ["p"]}},
        auth=team_keys(tmp_path, teammate_models=("other",)),
    )
    async with gateway_client(config) as (client, _):
        for authorization in ("", "Bearer wrong", "Basic abc"):
            refused = await client.get("/v1/models", headers={"Authorization": authorization})
            assert refused.status_code == 401
            assert refused.json()["error"]["code"] == "invalid_api_key"
        everything = await client.get("/v1/models")
        assert [m["id"] for m in everything.json()["data"]] == ["chat", "other"]
        limited = await client.get(
            "/v1/models", headers={"Authorization": f"Bearer {TEAMMATE_KEY}"}
        )
        assert limited.status_code == 200
        assert [m["id"] for m in limited.json()["data"]] == ["other"]


async def test_the_service_endpoints_stay_open_without_a_key(gateway_client: AppFactory) -> None:
    """Health, readiness, metrics, version and the OpenAPI document answer without a key."""
    async with gateway_client(one_route()) as (client, _):
        for path in ("/healthz", "/readyz", "/metrics", "/version", "/openapi.json"):
            response = await client.get(path, headers={"Authorization": ""})
            assert response.status_code == 200, path


# --------------------------------------------------------------------------- Content-Type


@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        (None, 415),
        ("", 415),
        ("text/plain", 415),
        ("application/x-www-form-urlencoded", 415),  # what curl -d sends
        ("application/json", 200),
        ("application/json; charset=utf-8", 200),
        ("Application/JSON", 200),
        ("application/vnd.tidegate+json", 200),
    ],
)
async def test_the_body_must_be_declared_json(
    gateway_client: AppFactory, content_type: str | None, status: int
) -> None:
    """Only a JSON Content-Type is read; a body without one is 415, as documented."""
    headers = {} if content_type is None else {"Content-Type": content_type}
    async with gateway_client(one_route()) as (client, _):
        response = await client.post(
            "/v1/chat/completions", content=orjson.dumps(CHAT), headers=headers
        )
        assert response.status_code == status, response.text
        if status == 415:
            assert response.json()["error"]["code"] == "unsupported_media_type"


# --------------------------------------------------------------------------- integer fields


@pytest.mark.parametrize(
    "field",
    [
        {"max_tokens": True},
        {"max_tokens": False},
        {"max_tokens": 1.5},
        {"max_tokens": "16"},
        {"max_tokens": 0},
        {"max_tokens": pipeline.MAX_INTEGER + 1},
        {"max_tokens": 1e300},
        {"n": True},
        {"n": False},
        {"n": 0},
        {"n": -1},
        {"n": pipeline.MAX_CHOICES + 1},
        {"n": 2.5},
        {"n": "2"},
        {"n": [2]},
    ],
    ids=repr,
)
async def test_integer_fields_refuse_booleans_and_everything_else(
    gateway_client: AppFactory, field: dict[str, Any]
) -> None:
    """max_tokens and n must be JSON integers in range: true is not 1, nor is 1.5 or "1"."""
    async with gateway_client(one_route()) as (client, app):
        response = await client.post("/v1/chat/completions", json={**CHAT, **field})
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "invalid_request"
        assert attempts(app) == 0


@pytest.mark.parametrize(
    ("field", "sent"),
    [
        ({"n": None}, {"n": None}),
        ({"n": 1}, {"n": 1}),
        ({"n": pipeline.MAX_CHOICES}, {"n": pipeline.MAX_CHOICES}),
        ({"n": 2.0}, {"n": 2}),
        ({"max_tokens": None}, {"max_tokens": None}),
        ({"max_tokens": 16.0}, {"max_tokens": 16}),
        ({"max_tokens": pipeline.MAX_INTEGER}, {"max_tokens": pipeline.MAX_INTEGER}),
    ],
    ids=repr,
)
async def test_integer_fields_in_range_or_null_are_served(
    gateway_client: AppFactory, field: dict[str, Any], sent: dict[str, Any]
) -> None:
    """A null (the default) or an integer in range is served; 2.0 (JSON's 2) is sent on as 2."""
    async with gateway_client(one_route()) as (client, app):
        response = await client.post("/v1/chat/completions", json={**CHAT, **field})
        assert response.status_code == 200, response.text
        (attempt,) = app.runtime.providers["p"].attempts
        (name, value), *_ = sent.items()
        assert attempt.body[name] == value
        assert type(attempt.body[name]) is type(value)


async def test_a_max_tokens_past_the_stores_integers_is_400_not_500(
    gateway_client: AppFactory, tmp_path: Path
) -> None:
    """The largest integer JSON gives Python, as max_tokens under a SQLite budget: 400, not 500."""
    config = one_route(budgets={"calls": 10}, state={"url": f"sqlite:///{tmp_path / 'state.db'}"})
    async with gateway_client(config) as (client, app):
        response = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2**64 - 1})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "invalid_request"
        usage = await app.runtime.stores.quotas.usage("t1:u1")
        assert (usage.calls, usage.reserved_calls) == (0, 0)


@pytest.mark.parametrize(
    "given",
    [None, 5, True, [], [None], ["a", 1], [1, -1], [1.5], [[]], [[1], "a"], {"text": "a"}],
    ids=repr,
)
async def test_an_embeddings_input_of_another_shape_is_400(
    gateway_client: AppFactory, given: Any
) -> None:
    """Embeddings take a string, or a non-empty array of strings, token ids or token id arrays."""
    async with gateway_client(one_route()) as (client, app):
        response = await client.post("/v1/embeddings", json={"model": "chat", "input": given})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "invalid_request"
        assert attempts(app) == 0


@pytest.mark.parametrize(
    ("given", "sent"),
    [
        ("", ""),
        ("hello", "hello"),
        (["a", "b"], ["a", "b"]),
        ([1, 2.0], [1, 2]),
        ([[1], [2.0, 3]], [[1], [2, 3]]),
    ],
    ids=repr,
)
async def test_an_embeddings_input_of_openais_shapes_is_served(
    gateway_client: AppFactory, given: Any, sent: Any
) -> None:
    """The four shapes of input reach the provider, token ids written 2.0 as 2."""
    async with gateway_client(one_route()) as (client, app):
        response = await client.post("/v1/embeddings", json={"model": "chat", "input": given})
        assert response.status_code == 200, response.text
        (attempt,) = app.runtime.providers["p"].attempts
        assert attempt.body["input"] == sent
        assert repr(attempt.body["input"]) == repr(sent)  # ints, not floats


@pytest.mark.parametrize("value", ["1_000", "+5", "1.5", " ", "\u00b2", "0", "000"])
async def test_the_deadline_header_takes_decimal_digits_only(
    gateway_client: AppFactory, value: str
) -> None:
    """X-Tidegate-Deadline-Ms is positive decimal digits; anything else is 400."""
    async with gateway_client(one_route()) as (client, _):
        response = await client.post(
            "/v1/chat/completions",
            json=CHAT,
            headers={"X-Tidegate-Deadline-Ms": value.encode("latin-1")},
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "invalid_request"


async def test_a_deadline_header_too_long_for_a_float_lengthens_nothing(
    gateway_client: AppFactory,
) -> None:
    """A deadline of hundreds of digits is longer than any timeout: served, not a 500."""
    async with gateway_client(one_route()) as (client, _):
        for value in ("9" * 400, "0" * 20 + "5000"):
            response = await client.post(
                "/v1/chat/completions", json=CHAT, headers={"X-Tidegate-Deadline-Ms": value}
            )
            assert response.status_code == 200, response.text


# --------------------------------------------------------------------------- n completions


@pytest.mark.parametrize(
    "budget",
    [
        {"budgets": {"tokens": 1_000, "degrade_at": 1.0}},
        {
            "budgets": {"cost_usd": 0.01, "degrade_at": 1.0},
            "prices": {"m-1": {"output_per_1k": 0.01}},
        },
    ],
    ids=["tokens", "cost"],
)
async def test_n_completions_are_budgeted_as_n_times_max_tokens(
    gateway_client: AppFactory, budget: dict[str, Any]
) -> None:
    """n=4 with max_tokens=300 reserves 1,200 completion tokens: over a quota that fits one."""
    async with gateway_client(one_route(**budget)) as (client, app):
        four = await client.post("/v1/chat/completions", json={**CHAT, "n": 4, "max_tokens": 300})
        assert four.status_code == 429, four.text
        assert four.json()["error"]["code"] == "budget_exceeded"
        assert attempts(app) == 0
        one = await client.post("/v1/chat/completions", json={**CHAT, "n": 1, "max_tokens": 300})
        assert one.status_code == 200, one.text


async def test_n_above_one_on_an_anthropic_route_is_refused_before_any_attempt(
    gateway_client: AppFactory,
) -> None:
    """Anthropic answers with one choice: n=2 on its route is 400 at once, naming why."""
    config = {
        "providers": {
            # Never called: the refusal comes first (nothing listens on the discard port).
            "claude": {"type": "anthropic", "model": "c-1", "base_url": "http://127.0.0.1:9"},
            "p": fake("answer", model="m-1"),
        },
        "models": {"sonnet": {"providers": ["claude", "p"]}, "chat": {"providers": ["p"]}},
        "budgets": {"calls": 10},
    }
    async with gateway_client(config) as (client, app):
        response = await client.post(
            "/v1/chat/completions", json={**CHAT, "model": "sonnet", "n": 2}
        )
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "invalid_request"
        assert "'n' is 2" in error["message"]
        assert "of type 'anthropic'" in error["message"]
        assert "x-tidegate-tried" not in response.headers  # no provider was tried
        usage = await app.runtime.stores.quotas.usage("t1:u1")
        assert (usage.calls, usage.reserved_calls) == (0, 0)
        served = await client.post("/v1/chat/completions", json={**CHAT, "n": 2})
        assert served.status_code == 200, served.text


# --------------------------------------------------------------------------- 405


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/embeddings", "POST"),
        ("POST", "/v1/models", "GET"),
        ("DELETE", "/healthz", "GET"),
        ("PATCH", "/openapi.json", "GET"),
    ],
)
async def test_a_wrong_method_is_405_with_allow(
    gateway_client: AppFactory, method: str, path: str, allow: str
) -> None:
    """A known path asked with another method answers 405 and names its method in Allow."""
    async with gateway_client(one_route()) as (client, _):
        response = await client.request(method, path)
        assert response.status_code == 405
        assert response.headers["allow"] == allow
        assert response.json()["error"]["code"] == "method_not_allowed"


async def test_unknown_model_names_make_no_metric_series(gateway_client: AppFactory) -> None:
    """The model a caller names is its own text: a 404 for it counts under route "-", so no
    number of made-up names adds series to /metrics."""
    config = {"providers": {"p": fake()}, "models": {"chat": {"providers": ["p"]}}}
    async with gateway_client(config) as (client, _):
        first = await client.post("/v1/chat/completions", json={**CHAT, "model": "made-up-0"})
        before = (await client.get("/metrics")).text
        for i in range(1, 6):
            reply = await client.post(
                "/v1/chat/completions", json={**CHAT, "model": f"made-up-{i}"}
            )
            assert reply.status_code == 404
        after = (await client.get("/metrics")).text
    assert first.status_code == 404
    assert "made-up" not in after
    series = [line for line in after.splitlines() if line and not line.startswith("#")]
    assert len(series) == len(
        [line for line in before.splitlines() if line and not line.startswith("#")]
    )
