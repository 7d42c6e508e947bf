"""Every path the app answers is in docs/api.md's endpoint table, and every row there is a path
the app answers (or says it does not serve); ``GET /v1/models/{id}`` behind the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.gateway.harness import fake, in_process_gateway
from tidegate.gateway.app import GET_ROUTES, MODEL_PATH, NOT_SERVED, POST_ROUTES
from tidegate.gateway.auth import Identity

API = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def _documented() -> set[str]:
    text = API.read_text(encoding="utf-8")
    table = text[text.index("## Endpoints") : text.index("## Headers the gateway reads")]
    return set(re.findall(r"^\| `((?:GET|POST) /[^`]*)` \|", table, re.MULTILINE))


def test_every_route_is_documented_and_every_documented_route_exists() -> None:
    served = {f"POST {path}" for path in POST_ROUTES} | {f"GET {path}" for path in GET_ROUTES}
    served |= {f"GET {MODEL_PATH}{{id}}"} | {f"POST {path}" for path in NOT_SERVED}
    assert _documented() == served


@pytest.mark.asyncio
async def test_a_model_the_key_may_not_use_is_404_like_an_unknown_one(tmp_path: Path) -> None:
    config = {
        "providers": {"p": fake()},
        "models": {"chat": {"providers": ["p"]}, "other": {"providers": ["p"]}},
    }
    async with in_process_gateway(tmp_path, config, {}) as (client, rt):
        rt.keys.add(
            "tg-narrow",
            Identity("narrow", "t1", "u9", "standard", "internal", frozenset({"other"})),
        )
        narrow = {"Authorization": "Bearer tg-narrow"}
        allowed = await client.get("/v1/models/other", headers=narrow)
        refused = await client.get("/v1/models/chat", headers=narrow)
        unknown = await client.get("/v1/models/nope", headers=narrow)
        anonymous = await client.get("/v1/models/chat", headers={"Authorization": ""})
        posted = await client.post("/v1/models/chat", json={})
    assert allowed.status_code == 200
    assert allowed.json() == {
        "id": "other",
        "object": "model",
        "created": 0,
        "owned_by": "tidegate",
    }
    assert refused.status_code == unknown.status_code == 404
    assert refused.json()["error"]["code"] == unknown.json()["error"]["code"] == "model_not_found"
    assert "chat" in refused.json()["error"]["message"]
    assert anonymous.status_code == 401
    assert posted.status_code == 405
    assert posted.headers["allow"] == "GET"
