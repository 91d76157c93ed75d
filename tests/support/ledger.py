"""Helpers of the ledger script tests (tests/redis/test_ledger*.py)."""

from __future__ import annotations

from typing import Any

import redis

from budget import Admission, CommitOutcome, DatasetLimits, Ledger, Progress
from budget.keys import DatasetKeys, dataset_keys

DS = "ds"
SPEC: dict[str, Any] = {
    "servers": ["http://gen:30000"],
    "sampling": {"temperature": 0.7},
    "max_new_tokens": 64,
}
#: A lease short enough to expire in a test, and a sleep long enough to see it expired (the scripts
#: read Redis's own clock).
SHORT_MS = 50
EXPIRE_S = 0.1


def make(
    ledger: Ledger,
    name: str = DS,
    *,
    token_budget: int | None = None,
    max_samples: int | None = None,
    on_budget: str = "truncate",
    spec: dict[str, Any] | None = None,
) -> str:
    return ledger.register(name, DatasetLimits(token_budget, max_samples, on_budget), spec or SPEC)


def lease(ledger: Ledger, sid: str, attempt: str = "a1", lease_ms: int = 60_000, name: str = DS) -> None:
    result = ledger.admit(name, sid, attempt, lease_ms=lease_ms)
    assert result.admission is Admission.OK, result


def commit_new(ledger: Ledger, sid: str, tokens: int, truncated: bool = False, name: str = DS) -> None:
    """Admit ``sid`` with a fresh attempt and commit ``tokens`` for it."""
    lease(ledger, sid, f"{sid}-a1", name=name)
    assert ledger.commit(name, sid, f"{sid}-a1", tokens, truncated) is CommitOutcome.COMMITTED


def progress(ledger: Ledger, sid: str, attempt: str, n: int, lease_ms: int = 60_000) -> Progress:
    """Report ``n`` new tokens; the action only (the state it returns is tested on its own)."""
    action, _state = ledger.progress(DS, sid, attempt, n, lease_ms=lease_ms)
    return action


def keys(name: str = DS) -> DatasetKeys:
    return dataset_keys(name)


def pending(redis_client: redis.Redis, name: str = DS) -> dict[str, str]:
    return dict(redis_client.hgetall(keys(name).pending_hash))


def queued(redis_client: redis.Redis, name: str = DS) -> set[str]:
    return set(redis_client.zrange(keys(name).queued_zset, 0, -1))


def owner(redis_client: redis.Redis, sid: str, name: str = DS) -> str | None:
    value = redis_client.hget(keys(name).lease_owner_hash, sid)
    return None if value is None else str(value)
