"""A virtual key made with ``tidegate keys create`` works on every replica within a second, and
once revoked with ``tidegate keys revoke`` is refused by every replica within a second."""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.fleet.harness import ADMIN_KEY, CLOCK, Fleet, Replica, UpstreamServer, chat

pytestmark = pytest.mark.slow

WITHIN_S = 1.0
POLL_S = 0.02


def keys_cli(fleet: Fleet, key_file: Path, *args: str) -> dict[str, object]:
    """``tidegate keys --json ...`` against replica 0's admin API; its JSON answer."""
    done = subprocess.run(
        [
            *(sys.executable, "-m", "tidegate.cli", "keys"),
            *("--url", fleet.replicas[0].url, "--key-file", str(key_file)),
            *args,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    found: dict[str, object] = json.loads(done.stdout)
    return found


async def until(
    client: httpx.AsyncClient, replica: Replica, key: str, status: int, since: float
) -> tuple[float, httpx.Response]:
    """Seconds from ``since`` until ``replica`` answers ``key`` with ``status`` (given up at 3 s)."""
    while True:
        response = await client.post(
            f"{replica.url}/v1/chat/completions",
            json=chat(f"keys {secrets.token_hex(3)}"),
            headers={"Authorization": f"Bearer {key}"},
        )
        elapsed = CLOCK.now() - since
        if response.status_code == status or elapsed > 3.0:
            return elapsed, response
        await CLOCK.asleep(POLL_S)


@pytest.mark.asyncio
async def test_a_cli_key_works_everywhere_and_its_revocation_reaches_everyone(
    fleet: Fleet, upstream: UpstreamServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key_file = tmp_path / "admin.key"
    key_file.write_text(ADMIN_KEY + "\n", encoding="utf-8")
    key_id = f"fleet-{secrets.token_hex(4)}"
    made = keys_cli(
        fleet, key_file, "create", "--id", key_id, "--tenant", "fleet", "--user", key_id
    )
    created = CLOCK.now()
    secret = str(made["key"])
    async with httpx.AsyncClient(timeout=10.0) as client:
        works = await asyncio.gather(
            *(until(client, r, secret, 200, created) for r in fleet.replicas)
        )
        for replica, (elapsed, response) in zip(fleet.replicas, works, strict=True):
            assert response.status_code == 200, (replica.index, response.text)
            assert elapsed <= WITHIN_S, (replica.index, elapsed)

        keys_cli(fleet, key_file, "revoke", key_id, "--why", "fleet test")
        revoked = CLOCK.now()
        refused = await asyncio.gather(
            *(until(client, r, secret, 401, revoked) for r in fleet.replicas)
        )
        for replica, (elapsed, response) in zip(fleet.replicas, refused, strict=True):
            assert response.status_code == 401, (replica.index, response.text)
            assert response.json()["error"]["code"] == "key_revoked"
            assert elapsed <= WITHIN_S, (replica.index, elapsed)

        audit = await client.get(
            f"{fleet.replicas[2].url}/admin/keys/{key_id}/audit",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        )
        assert [(a["action"], a["who"]) for a in audit.json()] == [
            ("revoke", "fleet-operator"),
            ("create", "fleet-operator"),
        ]
    with capsys.disabled():
        print(
            f"\nkey propagation: works after {[round(w[0], 3) for w in works]} s,"
            f" refused after {[round(r[0], 3) for r in refused]} s"
        )
