"""Helpers of the grant tests (budget/lua/extend.lua and the grant sizing of admit.lua): ledger fields the
snapshot does not carry, and the grant rule itself, to check the scripts against."""

from __future__ import annotations

import math

import redis

from budget import Admission, CommitOutcome, Ledger
from tests.support.ledger import DS, keys

#: The rule's constants (budget/lua/_lib.lua: GRANT_SHARE, GRANT_MIN, DISCARD_SLACK).
GRANT_SHARE = 2
GRANT_MIN = 16


def field(client: redis.Redis, name: str, ledger_field: str) -> int:
    """One numeric field of the dataset's ledger hash (0 when unset)."""
    return int(client.hget(keys(name).ledger_hash, ledger_field) or 0)


def overdrawn(client: redis.Redis, name: str = DS) -> int:
    """Tokens committed (or thrown away) past their generations' grants."""
    return field(client, name, "overdrawn_tokens")


def grant_pool(mode: str, budget: int) -> int:
    """What a budget may grant in all: discard grants 1% more (whole answers)."""
    return budget + budget // 100 if mode == "discard" else budget


def grant_size(left: int, inflight: int, want: int, mean: float = 0) -> int:
    """The grant the scripts give (grant_size in _lib.lua), ``inflight`` generations holding grants or about
    to (leases and queued samples) and ``mean`` the mean committed length (0: none yet): the whole want where
    a 1/2 share of what is left per generation holds it; else about a mean answer (an eighth of the want
    before any), at most that share, at least 16 where there is that much, never more than wanted or left."""
    if want <= 0 or left <= 0:
        return 0
    share = left // (GRANT_SHARE * max(1, inflight))
    if share >= want:
        return min(want, left)
    step = math.ceil(mean) if mean > 0 else math.ceil(want / 8)
    return min(want, left, max(min(share, step), GRANT_MIN))


def admit_grant(
    left: int, leased: int, queued: int, group: int, before: int, want: int, mean: float = 0
) -> int:
    """The grant admit.lua gives a sample of a group of ``group`` (``before`` of them admitted ahead of it),
    ``leased`` leases held and ``queued`` other samples queued: near the end (a 1/2 share per generation
    coming no longer holds the want) a new one leaves 16 tokens for each one in flight."""
    inflight = leased + queued + group
    room = left
    if left < GRANT_SHARE * inflight * want:
        room = left - GRANT_MIN * (leased + before)
    return grant_size(room, inflight, want, mean)


def pool_taken(client: redis.Redis, name: str = DS) -> int:
    """Spent - overdrawn + reserved, read in one command (one consistent moment): what must never pass the
    grant pool unless the budget was lowered."""
    tokens, discarded, reserved, over = client.hmget(
        keys(name).ledger_hash, ["tokens", "discarded_tokens", "reserved_tokens", "overdrawn_tokens"]
    )
    return int(tokens or 0) + int(discarded or 0) - int(over or 0) + int(reserved or 0)


def extend(ledger: Ledger, sid: str, more: int, attempt: str = "a1", name: str = DS) -> int:
    """Ask ``more`` tokens for one generation; its grant after the call."""
    return ledger.extend_many(name, [(sid, attempt, more)])[0]


def commit_whole(ledger: Ledger, sid: str, tokens: int, name: str = DS) -> None:
    """Admit ``sid`` wanting ``tokens``, ask more (extend) until its grant holds them all, as a worker
    whose stream nears its grant does, and commit them: nothing is overdrawn. The budget must have room."""
    attempt = f"{sid}-a1"
    result = ledger.admit(name, sid, attempt, want=max(1, tokens))
    assert result.admission is Admission.OK, result
    grant = result.cap
    while grant < tokens:
        more = ledger.extend_many(name, [(sid, attempt, tokens - grant)])[0]
        assert more > grant, (sid, tokens, grant)  # the budget had room: every ask gets some
        grant = more
    assert ledger.commit(name, sid, attempt, tokens) is CommitOutcome.COMMITTED
