"""Fixtures for the fleet tests: services, nginx, the fake upstream and the shared fleet.

Redis and Postgres come from ``TIDEGATE_TEST_REDIS_URL`` and ``TIDEGATE_TEST_POSTGRES_URL``: when a
variable is unset the tests that need it skip and say so; when it is set and the service does
not answer, they fail. nginx missing skips, except under ``CI=true``, where it fails.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
import redis

from tests.fleet.harness import (
    Fleet,
    UpstreamServer,
    base_config,
    find_nginx,
    running_fleet,
    shared_state,
)

REDIS_ENV = "TIDEGATE_TEST_REDIS_URL"
POSTGRES_ENV = "TIDEGATE_TEST_POSTGRES_URL"

#: The shared fleet's per-user limit: ten calls, then (practically) no refill during a test.
PER_USER = {"rate_per_s": 0.001, "burst": 10}


@dataclass(frozen=True)
class Services:
    redis_url: str
    postgres_url: str


@pytest.fixture(scope="session")
def nginx() -> str:
    """The nginx binary; skipped without it, except in CI, where its absence is a failure."""
    found = find_nginx()
    if found is None:
        reason = "nginx is not installed (Debian package nginx; .ci/run installs it)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but {reason}")
        pytest.skip(reason)
    return found


@pytest.fixture(scope="session")
def services() -> Services:
    """The shared Redis and Postgres, checked once: skip when unset, fail when unreachable."""
    missing = [env for env in (REDIS_ENV, POSTGRES_ENV) if not os.environ.get(env)]
    if missing:
        pytest.skip(f"set {' and '.join(missing)} to run the fleet tests that share state")
    redis_url, postgres_url = os.environ[REDIS_ENV], os.environ[POSTGRES_ENV]
    problems = []
    client = redis.Redis.from_url(redis_url, socket_timeout=3, socket_connect_timeout=3)
    try:
        client.ping()
    except redis.RedisError as exc:
        problems.append(f"{REDIS_ENV} is set but Redis does not answer: {exc}")
    finally:
        client.close()
    try:
        with psycopg.connect(postgres_url, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        problems.append(f"{POSTGRES_ENV} is set but Postgres does not answer: {exc}")
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)
    return Services(redis_url, postgres_url)


@pytest.fixture(scope="session")
def upstream_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpstreamServer]:
    """One ``tidegate fake-upstream`` process for the whole session."""
    server = UpstreamServer(tmp_path_factory.mktemp("upstream"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def upstream(upstream_server: UpstreamServer) -> UpstreamServer:
    """The fake upstream with an empty attempt log and instant answers."""
    upstream_server.reset()
    return upstream_server


def shared_config(durable: str, fast: str | None, upstream: str, **sections: Any) -> dict[str, Any]:
    """The shared fleet's config: the base plus a per-user rate limit of ten calls."""
    config = base_config(durable=durable, fast=fast, upstream=upstream)
    config["rate_limits"] = {"per_user": PER_USER}
    config.update(sections)
    return config


@pytest.fixture(scope="session")
def fleet(
    nginx: str,
    services: Services,
    upstream_server: UpstreamServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Fleet]:
    """Three replicas sharing Redis (fast) and Postgres (durable), behind nginx."""
    with shared_state(services.redis_url, services.postgres_url) as state:
        config = shared_config(state.durable_url, state.fast_url, upstream_server.url)
        with running_fleet(tmp_path_factory.mktemp("fleet"), config, nginx=nginx) as started:
            yield started
