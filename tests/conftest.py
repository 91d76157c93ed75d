"""Shared fixtures: a real Redis, flushed before each test that asks for it.

Redis is the one on ``TOKENFLEET_TEST_REDIS_URL`` (default db 15 of 127.0.0.1:6379). When none answers the
tests that need it are skipped locally but fail in CI (``CI=true``), where ``.ci/run`` starts one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import redis

from budget import Ledger

TEST_REDIS_URL = os.environ.get("TOKENFLEET_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture
def redis_url() -> str:
    return TEST_REDIS_URL


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        client.ping()
    except redis.ConnectionError as e:
        if IN_CI:
            raise
        pytest.skip(f"no Redis at {redis_url}: {e}")
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture
def ledger(redis_client: redis.Redis) -> Ledger:
    return Ledger(redis_client)
