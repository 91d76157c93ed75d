"""Helpers of the grant tests (budget/lua/grant.lua and the grants of admit.lua): ledger fields the snapshot
does not carry, the clock, and the truncate grant rule itself, to check the scripts against."""

from __future__ import annotations

import math

import redis

from budget import Ledger
from tests.support.ledger import DS, commit_new, keys

#: The rule's constants (budget/lua/_lib.lua: NEW_MIN, MORE_MIN, RATE_WEIGHT, SPEED_FIT_MIN).
NEW_MIN = 32
MORE_MIN = 16
RATE_WEIGHT = 0.05
SPEED_FIT_MIN = 8


def field(client: redis.Redis, name: str, ledger_field: str) -> int:
    """One numeric field of the dataset's ledger hash (0 when unset)."""
    return int(float(client.hget(keys(name).ledger_hash, ledger_field) or 0))


def overdrawn(client: redis.Redis, name: str = DS) -> int:
    """Tokens committed (or thrown away) past their generations' grants."""
    return field(client, name, "overdrawn_tokens")


def grant_pool(mode: str, budget: int) -> int:
    """What a budget may grant in all: discard grants 1% more (whole answers)."""
    return budget + budget // 100 if mode == "discard" else budget


def horizon(left: int, unused: float, running: int, coming: int, expect: int) -> tuple[float, int]:
    """The truncate horizon (``horizon`` in _lib.lua) and the count it is shared by: what is left and what
    the ``running`` generations hold unused, over them and the ``coming`` ones, at least ``expect`` (the
    slots, or the generations admitted)."""
    n = max(running + coming, expect, 1)
    return (max(0, left) + unused) / n, n


def start_least(want: int, pool: int, n: int) -> int:
    """The least grant a new generation starts with (``start_least`` in _lib.lua)."""
    return max(1, min(want, NEW_MIN, pool // max(1, n)))


def start_horizon(
    left: int, unused: float, running: int, coming: int, expect: int, pool: int
) -> tuple[float, int, float]:
    """The horizon a start is granted to (``horizon`` in _lib.lua with the budget ``pool``): as ``horizon``,
    but where that is below the least a new one needs and ``left`` gives that much, shared by the
    running ones and as many new ones as ``left`` gives it each. Also the count start_least divides the
    budget by, and the horizon over every slot."""
    h_all, shared = horizon(left, unused, running, coming, expect)
    n = shared
    least = start_least(NEW_MIN, pool, shared)
    if h_all < least and left >= least:
        n = max(1, running + max(coming, min(expect - running, left // least)))
    return (max(0, left) + unused) / n, shared, h_all


def start_grant(
    left: int, unused: float, running: int, coming: int, expect: int, want: int, pool: int
) -> int:
    """The grant a start ask gets (grant.lua): up to the horizon, at least start_least, never more than
    wanted or left; what is left with none running; -1 (not now) or -2 (wait) where none."""
    h, n, h_all = start_horizon(left, unused, running, coming, expect, pool)
    least = start_least(want, pool, n)
    give = 0
    if h >= least:
        give = min(want, left, math.floor(h))
        if give < least:
            give = 0
    if give == 0 and running == 0 and left > 0:
        give = min(want, left)
    if give > 0:
        return give
    return -2 if h_all >= least else -1


def clock_state(client: redis.Redis, name: str = DS) -> dict[str, int]:
    """The clock as the ledger's fields say it, and as its hashes say it (they must agree)."""
    k = keys(name)
    clock = {sid: int(v) for sid, v in client.hgetall(k.clock_hash).items()}
    reserved = {sid: int(v) for sid, v in client.hgetall(k.reserved_hash).items()}
    return {
        "n": field(client, name, "clock_n"),
        "sum": field(client, name, "clock_sum"),
        "grant": field(client, name, "clock_grant"),
        "hash_n": len(clock),
        "hash_sum": sum(clock.values()),
        "hash_grant": sum(reserved.get(sid, 0) for sid in clock),
    }


def clock_agrees(client: redis.Redis, name: str = DS) -> bool:
    c = clock_state(client, name)
    return (c["n"], c["sum"], c["grant"]) == (c["hash_n"], c["hash_sum"], c["hash_grant"])


def set_clock(client: redis.Redis, sid: str, ms_ago: int, rate: float | None, name: str = DS) -> None:
    """Move ``sid``'s clock ``ms_ago`` into the past (as if it had run that long) and set the dataset's
    speed (None: leave it): what the tests of the horizon need without sleeping."""
    k = keys(name)
    seconds, micros = client.time()
    now = int(seconds) * 1000 + int(micros) // 1000
    was = int(client.hget(k.clock_hash, sid))
    client.hset(k.clock_hash, sid, now - ms_ago)
    client.hincrby(k.ledger_hash, "clock_sum", now - ms_ago - was)
    if rate is not None:
        set_speed(client, rate, name=name)


def set_speed(client: redis.Redis, rate: float, delay_ms: float = 0.0, name: str = DS) -> None:
    """Set the dataset's speed as the ledger measures it (``speed_observe`` in _lib.lua): ``rate`` tokens/s
    and ``delay_ms``, as if one generation had produced ``rate`` tokens in 1 s plus the delay. A test's asks,
    milliseconds after their grants, are observations too; each weighs RATE_WEIGHT against it."""
    e = 1000.0 + delay_ms
    client.hset(
        keys(name).ledger_hash,
        mapping={
            "gen_rate": rate,
            "gen_delay_ms": delay_ms,
            "speed_n": 1,
            "speed_k": rate,
            "speed_e": e,
            "speed_kk": rate * rate,
            "speed_ke": rate * e,
        },
    )


def pool_taken(client: redis.Redis, name: str = DS) -> int:
    """Spent - overdrawn + reserved, read in one command (one consistent moment): what must never pass the
    grant pool unless the budget was lowered."""
    tokens, discarded, reserved, over = client.hmget(
        keys(name).ledger_hash, ["tokens", "discarded_tokens", "reserved_tokens", "overdrawn_tokens"]
    )
    return int(tokens or 0) + int(discarded or 0) - int(over or 0) + int(reserved or 0)


def expected_length(tokens: int, samples: int, tokens_sq: int, max_new: int) -> float:
    """The length discard expects of an answer in flight (discard_figures in _lib.lua): E[L^2] / E[L] of the
    committed lengths where the ledger keeps their squares, their mean else, ``max_new`` before any."""
    if tokens > 0 and tokens_sq > 0:
        return tokens_sq / tokens
    if samples > 0 and tokens > 0:
        return tokens / samples
    return max_new or 128


def commit_whole(ledger: Ledger, sid: str, tokens: int, name: str = DS) -> None:
    """Admit ``sid`` wanting ``tokens``, ask more until its grant holds them all, as a worker whose request
    reached its grant does, and commit them: nothing is overdrawn. The budget must have room
    (``commit_new`` of tests/support/ledger.py)."""
    commit_new(ledger, sid, tokens, name=name)
