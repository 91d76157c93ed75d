"""Helpers of the ledger script tests (tests/redis/test_ledger*.py)."""

from __future__ import annotations

from typing import Any

import redis

from budget import Admission, CommitOutcome, DatasetLimits, GrantAsk, GrantKind, Ledger, Progress
from budget.keys import DatasetKeys, dataset_keys, server_keys
from budget.ledger import GRANT_AT_SEND

DS = "ds"
#: The dataset's max_new_tokens (``SPEC["sampling"]``): what admit reserves for a generation that asks
#: for the dataset's default (``want`` 0) under a token budget.
MAX_NEW = 64
SPEC: dict[str, Any] = {
    "servers": ["http://gen:30000"],
    "sampling": {"temperature": 0.7, "max_new_tokens": MAX_NEW},
}
#: A lease a test ends by hand (``expire_short_leases``), long enough that no pause of a loaded machine
#: ends it first: a 50 ms lease a test slept past left a test process paused 50 ms between two calls
#: finding it gone.
SHORT_MS = 5_000


def expire_short_leases(client: redis.Redis) -> int:
    """Make every sample lease and server slot due within twice ``SHORT_MS`` expired a millisecond ago, on
    Redis's clock (the scripts read it); the long ones (60 s) are left alone. Returns how many."""
    seconds, micros = client.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    keys = [
        *client.scan_iter(match=dataset_keys("*").lease_zset),
        *client.scan_iter(match=server_keys("*").slots_zset),
    ]
    expired = 0
    for key in keys:
        due = client.zrangebyscore(key, "-inf", now_ms + 2 * SHORT_MS)
        if due:
            client.zadd(key, dict.fromkeys(due, now_ms - 1))
            expired += len(due)
    return expired


def make(
    ledger: Ledger,
    name: str = DS,
    *,
    token_budget: int | None = None,
    max_samples: int | None = None,
    on_budget: str = "truncate",
    spec: dict[str, Any] | None = None,
) -> str:
    """Register ``name`` with these limits; returns its state."""
    state, _kept = ledger.register(name, DatasetLimits(token_budget, max_samples, on_budget), spec or SPEC)
    return state


def lease(
    ledger: Ledger,
    sid: str,
    attempt: str = "a1",
    lease_ms: int = 60_000,
    name: str = DS,
    want: int = 0,
    slots: int = 0,
) -> int:
    """Admit ``sid`` for ``attempt`` (it must be admitted); returns the tokens reserved for it (its cap). A
    truncate budget's generation is granted as a worker's is once it has a server slot (a start ask, with
    ``slots``), and that grant is returned (``GRANT_NOT_NOW``/``GRANT_WAIT`` where none)."""
    result = ledger.admit(name, sid, attempt, lease_ms=lease_ms, want=want)
    assert result.admission is Admission.OK, result
    if result.cap != GRANT_AT_SEND:
        return result.cap
    return start(ledger, sid, attempt, want or MAX_NEW, name=name, slots=slots)


def start(ledger: Ledger, sid: str, attempt: str, want: int, name: str = DS, slots: int = 0) -> int:
    """A truncate budget's grant of an admitted generation that has its server slot (a start ask)."""
    return ledger.grant_many(name, [GrantAsk(sid, attempt, GrantKind.START, want)], slots)[0]


def more(ledger: Ledger, sid: str, attempt: str, wanted: int, name: str = DS) -> int:
    """The grant in all after a generation that reached its grant asks ``wanted`` more (a more ask)."""
    return ledger.grant_many(name, [GrantAsk(sid, attempt, GrantKind.MORE, wanted)])[0]


def end(ledger: Ledger, sid: str, attempt: str, tokens: int, name: str = DS) -> int:
    """A generation ended with ``tokens``, before its grant: the rest goes back (an end ask)."""
    return ledger.grant_many(name, [GrantAsk(sid, attempt, GrantKind.END, tokens)])[0]


def commit_new(ledger: Ledger, sid: str, tokens: int, truncated: bool = False, name: str = DS) -> None:
    """Admit ``sid`` with a fresh attempt wanting ``tokens``, and commit ``tokens`` for it. Under a token
    budget (truncate, discard) its grant may be less than it wants near the end: it asks for more, as a
    worker whose request reached its grant does, until the grant holds them all, so the commit overdraws
    nothing. The budget must have room for them: an ask that gets nothing fails the test (a test that means
    to commit past a grant does it by hand)."""
    attempt = f"{sid}-a1"
    grant = lease(ledger, sid, attempt, name=name, want=max(1, tokens))
    # cap 0: no grants (no token budget, or drain), nothing to extend
    while 0 < grant < tokens:
        after = more(ledger, sid, attempt, tokens - grant, name=name)
        assert after > grant, f"commit_new({sid!r}, {tokens}): the budget gave no more than {grant}"
        grant = after
    assert ledger.commit(name, sid, attempt, tokens, truncated) is CommitOutcome.COMMITTED


def progress(ledger: Ledger, sid: str, attempt: str, lease_ms: int = 60_000, name: str = DS) -> Progress:
    """Ask whether ``attempt`` may go on; the action only (the state it returns is tested on its own)."""
    action, _state = ledger.progress(name, sid, attempt, lease_ms=lease_ms)
    return action


def report_live(
    ledger: Ledger, sid: str, attempt: str, tokens: int, lease_ms: int = 60_000, name: str = DS
) -> bool:
    """Renew ``attempt``'s lease and report the ``tokens`` its generation has produced so far (absolute,
    as the worker's lease keeper does); whether the lease is still held."""
    return ledger.renew_many(name, [(sid, attempt, tokens)], lease_ms=lease_ms)[0]


def keys(name: str = DS) -> DatasetKeys:
    return dataset_keys(name)


def pending(redis_client: redis.Redis, name: str = DS) -> dict[str, str]:
    return dict(redis_client.hgetall(keys(name).pending_hash))


def queued(redis_client: redis.Redis, name: str = DS) -> set[str]:
    return set(redis_client.zrange(keys(name).queued_zset, 0, -1))


def owner(redis_client: redis.Redis, sid: str, name: str = DS) -> str | None:
    value = redis_client.hget(keys(name).lease_owner_hash, sid)
    return None if value is None else str(value)


def reservations(redis_client: redis.Redis, name: str = DS) -> dict[str, int]:
    """Each in-flight sample's reservation (the reserved hash)."""
    return {str(sid): int(n) for sid, n in redis_client.hgetall(keys(name).reserved_hash).items()}


def budget_taken(redis_client: redis.Redis, name: str = DS) -> int:
    """Committed + discarded + reserved tokens, read in one command (one consistent moment)."""
    tokens, discarded, reserved = redis_client.hmget(
        keys(name).ledger_hash, ["tokens", "discarded_tokens", "reserved_tokens"]
    )
    return int(tokens or 0) + int(discarded or 0) + int(reserved or 0)
