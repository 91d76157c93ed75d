"""Helpers of the grant tests (budget/lua/extend.lua and the grant sizing of admit.lua): ledger fields the
snapshot does not carry, and the grant rule itself, to check the scripts against."""

from __future__ import annotations

import math

import redis

from budget import Ledger
from tests.support.ledger import DS, commit_new, keys

#: The rule's constants (budget/lua/_lib.lua: GRANT_SHARE, GRANT_MIN, DISCARD_SLACK).
GRANT_SHARE = 2
GRANT_MIN = 16


def field(client: redis.Redis, name: str, ledger_field: str) -> int:
    """One numeric field of the dataset's ledger hash (0 when unset)."""
    return int(client.hget(keys(name).ledger_hash, ledger_field) or 0)


def overdrawn(client: redis.Redis, name: str = DS) -> int:
    """Tokens committed (or thrown away) past their generations' grants."""
    return field(client, name, "overdrawn_tokens")


def is_starved(client: redis.Redis, name: str = DS) -> bool:
    """Whether extend found the budget's end (the ledger's ``starved`` field is 1)."""
    return client.hget(keys(name).ledger_hash, "starved") == "1"


def grant_pool(mode: str, budget: int) -> int:
    """What a budget may grant in all: discard grants 1% more (whole answers)."""
    return budget + budget // 100 if mode == "discard" else budget


def _step(want: int, mean: float) -> int:
    """About an answer's length: the mean committed length, an eighth of the want before any."""
    return math.ceil(mean) if mean > 0 else math.ceil(want / 8)


def grant_size(left: int, inflight: int, want: int, mean: float = 0) -> int:
    """The grant the scripts give (grant_size in _lib.lua), ``inflight`` generations sharing what is left and
    ``mean`` the mean committed length (0: none yet): the whole want where a 1/2 share of what is left per
    generation holds it; else about a mean answer (an eighth of the want before any), at most that share, at
    least 16 where there is that much, never more than wanted or left."""
    if want <= 0 or left <= 0:
        return 0
    share = left // (GRANT_SHARE * max(1, inflight))
    if share >= want:
        return min(want, left)
    return min(want, left, max(min(share, _step(want, mean)), GRANT_MIN))


def room_for_new(left: int, leased: int, want: int, mean: float = 0, starved: bool = False) -> int:
    """What a new generation may take its grant from (room_for_new in _lib.lua), ``leased`` running: all that
    is left with none running; else what is left beyond 16 for each one running, where that is at least a
    mean answer (or the want, if smaller), and 0 otherwise. Starved (extend found the budget's end), the
    room must hold that answer for each one running."""
    if left <= 0:
        return 0
    if leased == 0:
        return left
    room = left - GRANT_MIN * leased
    least = min(want, _step(want, mean))
    if starved:
        least = max(least, leased * _step(want, mean))
    return room if room >= least else 0


def admit_grant(
    left: int,
    leased: int,
    queued: int,
    group: int,
    before: int,
    want: int,
    mean: float = 0,
    starved: bool = False,
) -> int:
    """The grant admit.lua gives a sample of a group of ``group`` (``before`` of them admitted ahead of it),
    ``leased`` leases held and ``queued`` other samples queued: the whole want (or what is left) where the
    pool holds every one coming (leases, queued, the group) twice over and a new one may start; else a
    grant (grant_size) of the room a new one has (room_for_new) shared among those running with it."""
    inflight = leased + queued + group
    running = leased + before
    room = room_for_new(left, running, want, mean, starved)
    if room > 0 and left >= GRANT_SHARE * inflight * want:
        return min(want, left)
    return grant_size(room, inflight, want, mean)


def extend_grant(left: int, inflight: int, more: int, mean: float = 0, least: int = 0) -> tuple[int, bool]:
    """What extend.lua adds to a grant asking ``more`` (at least ``least`` worth granting), ``inflight``
    leases and queued samples sharing ``left``: (the tokens it adds, whether it finds the budget starved).
    A grant_size below ``least`` is raised to ``least`` where that much is left; else all that is left is
    given and the dataset is starved."""
    least = min(more, least)
    extra = grant_size(left, inflight, more, mean)
    if extra >= least:
        return extra, False
    extra = min(least, left)
    return max(0, extra), extra < least


def expected_length(tokens: int, samples: int, tokens_sq: int, max_new: int) -> float:
    """The length discard expects of an answer in flight (discard_figures in _lib.lua): E[L^2] / E[L] of the
    committed lengths where the ledger keeps their squares, their mean else, ``max_new`` before any."""
    if tokens > 0 and tokens_sq > 0:
        return tokens_sq / tokens
    if samples > 0 and tokens > 0:
        return tokens / samples
    return max_new or 128


def pool_taken(client: redis.Redis, name: str = DS) -> int:
    """Spent - overdrawn + reserved, read in one command (one consistent moment): what must never pass the
    grant pool unless the budget was lowered."""
    tokens, discarded, reserved, over = client.hmget(
        keys(name).ledger_hash, ["tokens", "discarded_tokens", "reserved_tokens", "overdrawn_tokens"]
    )
    return int(tokens or 0) + int(discarded or 0) - int(over or 0) + int(reserved or 0)


def extend(ledger: Ledger, sid: str, more: int, attempt: str = "a1", name: str = DS, least: int = 0) -> int:
    """Ask ``more`` tokens (``least`` the fewest worth granting) for one generation; its grant after the
    call."""
    return ledger.extend_many(name, [(sid, attempt, more, least)])[0]


def commit_whole(ledger: Ledger, sid: str, tokens: int, name: str = DS) -> None:
    """Admit ``sid`` wanting ``tokens``, ask more (extend) until its grant holds them all, as a worker
    whose stream nears its grant does, and commit them: nothing is overdrawn. The budget must have room
    (``commit_new`` of tests/support/ledger.py)."""
    commit_new(ledger, sid, tokens, name=name)
