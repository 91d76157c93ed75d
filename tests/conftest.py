"""Shared fixtures: a real Redis, flushed before each test that asks for it, and the fleet's Redis database,
flushed once per session (``tests/support/env.py`` says where each is); the one tokenizer the tests build.

When no Redis answers the tests that need it are skipped locally but fail in CI (``CI=true``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from budget import Ledger
from tests.support.env import FLEET_REDIS_URL, IN_CI, TEST_REDIS_URL
from tests.support.tokenizer import make_chat_tokenizer


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


@pytest.fixture(scope="session")
def fleet_redis_url() -> str:
    """The fleet's database: worker processes and the Celery queue's routing keys live there for the whole
    session, so tests keep apart by unique dataset names instead of flushing."""
    client = redis.Redis.from_url(FLEET_REDIS_URL)
    try:
        client.ping()
    except redis.ConnectionError as e:
        if IN_CI:
            raise
        pytest.skip(f"no Redis at {FLEET_REDIS_URL}: {e}")
    client.flushdb()
    client.close()
    return FLEET_REDIS_URL


@pytest.fixture
def fleet_ledger(fleet_redis_url: str) -> Iterator[Ledger]:
    ledger = Ledger.from_url(fleet_redis_url)
    yield ledger
    ledger.client.close()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local tokenizer folder with a ChatML template (``tests/support/tokenizer.py``), built once."""
    return make_chat_tokenizer(tmp_path_factory.mktemp("tokenizer") / "chatml")
