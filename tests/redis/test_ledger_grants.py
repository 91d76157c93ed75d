"""Budget grants against real Redis (budget/lua/_lib.lua "Reservations (grants)"): truncate's grants at send
time to a common horizon (grant.lua: start, more, end), the clock that says what running generations used,
the tokens committed past a grant (overdrawn_tokens), discard's admission rule and pool, and property-style
runs of random interleavings that must never pass the pool nor lose track of the clock.
"""

from __future__ import annotations

import random
import time

import pytest
import redis

from budget import Admission, CommitOutcome, DatasetState, GrantAsk, GrantKind, Ledger, Progress
from budget.ledger import GRANT_AT_SEND, GRANT_DROPPED, GRANT_NOT_NOW, GRANT_WAIT
from tests.redis.grants import (
    MORE_MIN,
    RATE_WEIGHT,
    SPEED_FIT_MIN,
    clock_agrees,
    clock_state,
    commit_whole,
    field,
    grant_pool,
    horizon,
    overdrawn,
    pool_taken,
    set_clock,
    set_speed,
    start_grant,
)
from tests.support.ledger import (
    DS,
    MAX_NEW,
    SHORT_MS,
    budget_taken,
    commit_new,
    end,
    expire_short_leases,
    keys,
    lease,
    make,
    more,
    pending,
    progress,
    reservations,
    start,
)

pytestmark = pytest.mark.redis


def admitted(ledger: Ledger, *sids: str, attempt: str = "a1") -> None:
    """Admit ``sids`` (a truncate budget's: granted at send time)."""
    for sid in sids:
        result = ledger.admit(DS, sid, attempt)
        assert (result.admission, result.cap) == (Admission.OK, GRANT_AT_SEND), result


# --- truncate: granted at send time, to a common horizon --------------------------------------------------


def test_admit_under_truncate_reserves_nothing_and_leaves_the_grant_to_send_time(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=1000)

    admitted(ledger, "s1", "s2", "s3")

    assert reservations(redis_client) == {}
    assert ledger.snapshot(DS).inflight == 3


def test_a_start_far_from_the_budgets_end_is_granted_its_whole_want(ledger: Ledger) -> None:
    make(ledger, token_budget=100_000)

    assert [lease(ledger, f"s{i}", want=MAX_NEW, slots=8) for i in range(8)] == [MAX_NEW] * 8


def test_the_first_starts_share_the_budget_as_if_every_slot_of_its_servers_ran(ledger: Ledger) -> None:
    make(ledger, token_budget=1000)

    # ten slots: 100 each, and the ones that start later are not left with less (nothing is used yet)
    grants = [lease(ledger, f"s{i}", want=500, slots=10) for i in range(10)]

    assert grants == [100] * 10


def test_without_the_slots_the_first_starts_share_the_budget_among_the_generations_admitted(
    ledger: Ledger,
) -> None:
    make(ledger, token_budget=1000)
    admitted(ledger, *[f"s{i}" for i in range(5)])

    assert start(ledger, "s0", "a1", 500, slots=0) == 200


def test_the_starts_of_one_call_count_each_other_as_coming(ledger: Ledger) -> None:
    make(ledger, token_budget=1000)
    admitted(ledger, "s1", "s2", "s3", "s4")

    asks = [GrantAsk(f"s{i}", "a1", GrantKind.START, 500) for i in (1, 2, 3, 4)]

    # four coming, two slots: each is shared over four
    assert ledger.grant_many(DS, asks, slots=2) == [250, 250, 250, 250]


def test_a_start_follows_the_horizon_rule(ledger: Ledger, redis_client: redis.Redis) -> None:
    make(ledger, token_budget=1000)
    assert [lease(ledger, f"s{i}", want=500, slots=4) for i in range(3)] == [250, 250, 250]
    admitted(ledger, "n")

    # 250 left, 750 unused by three running (no speed known yet): (250 + 750) / 4
    expected = start_grant(left=250, unused=750, running=3, coming=1, expect=4, want=500, pool=1000)
    assert start(ledger, "n", "a1", 500, slots=4) == expected == 250
    assert clock_agrees(redis_client)


def test_what_running_generations_used_at_the_datasets_speed_shortens_the_horizon(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=1000)
    assert [lease(ledger, f"s{i}", want=500, slots=2) for i in range(2)] == [500, 500]
    # s0 has run 2 s at 100 tokens/s: 200 of its grant are used, so 800 are left to generate for two
    set_clock(redis_client, "s0", 2000, 100.0)
    assert end(ledger, "s0", "a1", 200) == 1  # it ended there: its 300 unused go back
    admitted(ledger, "n")

    granted = start(ledger, "n", "a1", 500, slots=2)

    # 300 left, s1's 500 unused (its clock is new): (300 + 500) / 2 = 400, at most the 300 left
    assert granted == min(300, int(horizon(300, 500, 1, 1, 2)[0])) == 300


def test_an_end_gives_back_at_once_and_the_start_after_it_in_the_same_call_gets_it(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=1000)
    assert [lease(ledger, f"s{i}", want=500, slots=10) for i in range(10)] == [100] * 10
    admitted(ledger, "n")
    assert start(ledger, "n", "a1", 500, slots=10) == GRANT_WAIT  # all granted, some will come back

    got = ledger.grant_many(
        DS,
        [GrantAsk("n", "a1", GrantKind.START, 500), GrantAsk("s0", "a1", GrantKind.END, 30)],
        slots=10,
    )

    # the end is answered first: its 70 are what the start gets (the horizon is (70 + 900) / 10)
    assert got == [70, 1]
    assert reservations(redis_client)["s0"] == 30
    assert field(redis_client, DS, "reserved_tokens") == 1000
    assert clock_agrees(redis_client)
    assert ledger.commit(DS, "s0", "a1", 30) is CommitOutcome.COMMITTED
    assert ledger.snapshot(DS).reserved_tokens == 970


def test_a_start_is_turned_away_once_the_horizon_is_below_32_tokens(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=10_000)
    assert [lease(ledger, f"s{i}", want=5000, slots=4) for i in range(4)] == [2500] * 4
    for i in range(3):
        assert ledger.commit(DS, f"s{i}", "a1", 2500) is CommitOutcome.COMMITTED
    admitted(ledger, "n")
    # all of it is granted to s3, which has used none of it yet: wait for what it gives back
    assert start(ledger, "n", "a1", 5000, slots=4) == GRANT_WAIT

    set_clock(redis_client, "s3", 24_500, 100.0)  # it has used 2,450 of its 2,500: 50 left to generate

    assert horizon(0, 50, 1, 1, 4)[0] < 32
    assert start(ledger, "n", "a1", 5000, slots=4) == GRANT_DROPPED


def test_a_start_is_granted_from_what_is_left_where_the_horizon_over_every_slot_is_below_its_least(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=1000)
    assert [lease(ledger, f"s{i}", want=500, slots=10) for i in range(10)] == [100] * 10
    for i in range(9):
        assert ledger.commit(DS, f"s{i}", "a1", 80) is CommitOutcome.COMMITTED
    # 180 left, s9 holds 100: shared by the 10 slots, (180 + 100) / 10 = 28 is below the least of 32, and
    # with s9 running each start used to be turned away (the 180 then went to s9's continuations alone)
    assert horizon(180, 100, 1, 1, 10)[0] < 32
    admitted(ledger, "n1", "n2", "n3", "n4", "n5")

    got = [start(ledger, f"n{i}", "a1", 500, slots=10) for i in range(1, 6)]

    # s9 and as many new ones as 180 gives 32 each: (180 + 100) / (1 + 5) = 46; then (134 + 146) / 6,
    # (88 + 192) / 5 = 56, the last 32; then nothing is left
    assert got == [46, 46, 56, 32, GRANT_DROPPED]
    assert budget_taken(redis_client) == 1000
    assert clock_agrees(redis_client)


def test_with_none_running_the_last_of_the_budget_may_start_one(ledger: Ledger) -> None:
    make(ledger, token_budget=1000)
    commit_new(ledger, "c", 990)
    admitted(ledger, "n", "m")

    assert start(ledger, "n", "a1", 500, slots=64) == 10
    assert start(ledger, "m", "a1", 500, slots=64) == GRANT_DROPPED


def test_a_start_turned_away_at_the_budgets_end_is_given_back_by_the_same_call(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=1000)
    admitted(ledger, "m", "n")  # waiting for a server slot while the budget is spent
    commit_new(ledger, "c", 1000)
    assert ledger.snapshot(DS).state == DatasetState.EXHAUSTED
    leases = keys(DS).lease_zset
    assert redis_client.zcard(leases) == 2

    got = ledger.grant_many(
        DS, [GrantAsk("m", "a1", GrantKind.START, 500), GrantAsk("n", "a1", GrantKind.START, 500)], 8
    )

    assert got == [GRANT_DROPPED, GRANT_DROPPED]
    assert pending(redis_client) == {"m": "limit", "n": "limit"}
    assert progress(ledger, "m", "a1") is Progress.LOST  # the lease is gone: nothing else to release
    assert redis_client.zcard(leases) == 0
    assert clock_agrees(redis_client)


def test_a_budget_too_small_for_its_slots_gives_each_of_them_an_equal_share(ledger: Ledger) -> None:
    make(ledger, token_budget=300)

    # 300 over 20 slots: 15 each, below the usual least of 32 but a share of the whole budget
    assert [lease(ledger, f"s{i}", want=MAX_NEW, slots=20) for i in range(20)] == [15] * 20


def test_a_whole_start_gets_its_whole_want_while_that_much_is_left_and_the_horizon_past_that(
    ledger: Ledger,
) -> None:
    # a text prompt a server cannot tokenize cannot be continued past a grant: cut short at a horizon of
    # 100, it would be a cut answer long before the budget's end
    make(ledger, token_budget=1000)
    admitted(ledger, "text", "s", "last")
    whole = [GrantAsk("text", "a1", GrantKind.WHOLE, 800), GrantAsk("s", "a1", GrantKind.START, 800)]

    assert ledger.grant_many(DS, whole, slots=10) == [800, 100]
    # 100 left, less than its want: as any start, cut at its grant (held for its whole want while others
    # ran, such starts ran one at a time at the budget's end)
    got = ledger.grant_many(DS, [GrantAsk("last", "a1", GrantKind.WHOLE, 800)], slots=10)
    assert got == [min(100, int(horizon(100, 900, 2, 1, 10)[0]))] == [100]


def test_more_grants_up_to_the_horizon_and_at_least_16_where_that_much_is_left(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=1000)
    assert [lease(ledger, f"s{i}", want=500, slots=10) for i in range(10)] == [100] * 10
    set_speed(redis_client, 100.0)  # the running ones have used next to nothing of their grants
    end(ledger, "s9", "a1", 40)  # 60 back

    # s0 reached its 100: (60 + 900 unused) / 10 = 96, at most the 60 left
    assert more(ledger, "s0", "a1", 400) == 160
    # nothing is left now, and eight others run that may give some back: ask again
    assert more(ledger, "s1", "a1", 400) == GRANT_WAIT
    # asked for nothing more: the grant as it stands (its answer is cut there)
    assert more(ledger, "s1", "a1", 0) == 100
    assert clock_agrees(redis_client)


def test_a_generation_that_finds_nothing_left_waits_off_the_clock_for_what_the_few_others_give_back(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=1000)
    assert [lease(ledger, f"s{i}", want=500, slots=10) for i in range(10)] == [100] * 10
    set_speed(redis_client, 100.0)  # the running ones have used next to nothing of their grants

    assert more(ledger, "s0", "a1", 400) == GRANT_WAIT  # all 1,000 granted; nine others run
    # it generates nothing while it waits: off the clock, its grant still reserved
    assert redis_client.hget(keys().clock_hash, "s0") is None
    assert reservations(redis_client)["s0"] == 100
    assert clock_agrees(redis_client)
    end(ledger, "s9", "a1", 40)  # 60 back

    assert more(ledger, "s0", "a1", 400) == 160  # asked again: what s9 gave back
    assert redis_client.hget(keys().clock_hash, "s0") is not None  # running again
    assert clock_agrees(redis_client)


def test_the_last_generation_running_finds_nothing_left_and_ends_at_its_grant_at_once(ledger: Ledger) -> None:
    make(ledger, token_budget=200)
    assert [lease(ledger, f"s{i}", want=500, slots=2) for i in range(2)] == [100, 100]
    assert more(ledger, "s0", "a1", 400) == GRANT_WAIT  # s1 runs, and may end before its grant
    # s1 is the last running (s0 waits, off the clock): nothing can come back
    assert more(ledger, "s1", "a1", 400) == 100
    assert more(ledger, "s0", "a1", 400) == 100  # asked again: none runs now


def test_with_more_than_64_others_running_a_generation_that_finds_nothing_left_ends_at_its_grant(
    ledger: Ledger,
) -> None:
    make(ledger, token_budget=6600)
    assert [lease(ledger, f"s{i}", want=500, slots=66) for i in range(66)] == [100] * 66

    # 65 others run: another of them will ask for whatever they give back
    assert more(ledger, "s0", "a1", 400) == 100
    # 64 others (s0 ended): this one waits
    assert ledger.commit(DS, "s0", "a1", 100) is CommitOutcome.COMMITTED
    assert more(ledger, "s1", "a1", 400) == GRANT_WAIT


def test_more_is_at_least_16_where_the_horizon_is_smaller(ledger: Ledger) -> None:
    make(ledger, token_budget=1000)
    assert [lease(ledger, f"s{i}", want=500, slots=100) for i in range(100)] == [10] * 100
    end(ledger, "s99", "a1", 0)
    end(ledger, "s98", "a1", 0)  # 20 back: the horizon is (20 + 980) / 100 = 10

    assert more(ledger, "s0", "a1", 400) == 10 + MORE_MIN  # a continuation is worth at least 16
    assert more(ledger, "s1", "a1", 400) == 10 + 4  # the last 4


def test_a_continued_generations_clock_goes_back_by_what_its_grant_took_at_the_datasets_speed(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=10_000)
    assert lease(ledger, "s0", want=500, slots=40) == 250
    set_clock(redis_client, "s0", 5000, 50.0)  # its 250 took 5 s: 50 tokens/s, as the dataset's speed

    assert more(ledger, "s0", "a1", 250) == 500
    seconds, micros = redis_client.time()
    now = int(seconds) * 1000 + int(micros) // 1000
    clock = int(redis_client.hget(keys().clock_hash, "s0"))

    assert abs((now - clock) - 250 * 1000 / 50.0) < 1000  # 250 tokens at 50/s: 5 s ago
    assert clock_agrees(redis_client)


def speed_field(client: redis.Redis, ledger_field: str = "gen_rate") -> float:
    """One of the ledger's speed fields (gen_rate, gen_delay_ms, speed_k, ...), 0 when unset."""
    return float(client.hget(keys().ledger_hash, ledger_field) or 0)


def ten_ends_after_a_delay(ledger: Ledger, client: redis.Redis, delay_ms: int) -> None:
    """Ten generations of a 20,000-token budget on 20 slots each end as if they had waited ``delay_ms``
    for their first token, then produced 100 tokens/s: 90, 180, ... 900 tokens (4,950 in all)."""
    make(ledger, token_budget=20_000)
    assert [lease(ledger, f"s{i}", want=1000, slots=20) for i in range(10)] == [1000] * 10
    for i in range(10):
        tokens = 90 * (i + 1)
        set_clock(client, f"s{i}", delay_ms + tokens * 10, None)
        end(ledger, f"s{i}", "a1", tokens)


def test_the_datasets_speed_is_what_the_generations_produced_over_the_time_since_their_grants(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=10_000)
    assert [lease(ledger, f"s{i}", want=500, slots=4) for i in range(3)] == [500] * 3

    set_clock(redis_client, "s0", 1000, None)
    end(ledger, "s0", "a1", 100)  # 100 tokens 1 s after its grant
    assert speed_field(redis_client) == pytest.approx(100.0, rel=0.01)
    set_clock(redis_client, "s1", 2000, None)
    end(ledger, "s1", "a1", 400)  # 400 in 2 s: the tokens over the time of both, each new one weighing 5%
    tokens, ms = 100 + RATE_WEIGHT * 300, 1000 + RATE_WEIGHT * 1000
    assert speed_field(redis_client) == pytest.approx(tokens * 1000 / ms, rel=0.01)
    set_clock(redis_client, "s2", 3000, None)
    more(ledger, "s2", "a1", 0)  # it reached its grant of 500 in 3 s
    tokens, ms = tokens + RATE_WEIGHT * (500 - tokens), ms + RATE_WEIGHT * (3000 - ms)
    assert speed_field(redis_client) == pytest.approx(tokens * 1000 / ms, rel=0.01)
    # too few to tell the delay before a request's first token from the speed
    assert speed_field(redis_client, "gen_delay_ms") == 0


def test_the_delay_before_the_first_token_is_told_from_the_speed_and_the_clocks_count_it(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    ten_ends_after_a_delay(ledger, redis_client, 1000)
    assert SPEED_FIT_MIN <= 10
    assert speed_field(redis_client) == pytest.approx(100.0, rel=0.02)
    delay = speed_field(redis_client, "gen_delay_ms")
    assert delay == pytest.approx(1000, abs=30)

    # one running 2.5 s: 1.5 s since its first token, 150 of its grant used (not 250, as with no delay)
    left = 20_000 - 4950  # the ten hold what they produced until they commit
    assert lease(ledger, "s10", want=5000, slots=20) == int(left / 20) == 752
    set_clock(redis_client, "s10", 2500, None)
    admitted(ledger, "n")
    got = start(ledger, "n", "a1", 5000, slots=20)
    unused = 752 - speed_field(redis_client) * (2500 - delay) / 1000
    # (to a token: a few ms pass between the clock set and the start)
    assert got == pytest.approx(
        start_grant(left=left - 752, unused=unused, running=1, coming=1, expect=20, want=5000, pool=20_000),
        abs=1,
    )
    no_delay = start_grant(
        left=left - 752, unused=752 - 250, running=1, coming=1, expect=20, want=5000, pool=20_000
    )
    assert got >= no_delay + 4  # (14,298 + 602) / 20 = 745, against (14,298 + 502) / 20 = 740
    assert clock_agrees(redis_client)


def test_a_delay_as_long_as_half_the_time_the_generations_took_is_not_told_from_the_speed(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    # the same speed after 5 s: as the fleet sees a ramp whose speed changed under the observations
    ten_ends_after_a_delay(ledger, redis_client, 5000)

    # their tokens over their time, and no delay
    assert speed_field(redis_client, "gen_delay_ms") == 0
    tokens, ms = speed_field(redis_client, "speed_k"), speed_field(redis_client, "speed_e")
    assert speed_field(redis_client) == pytest.approx(tokens * 1000 / ms)
    assert speed_field(redis_client) < 50


def test_asks_of_an_attempt_that_lost_its_lease_get_zero(ledger: Ledger) -> None:
    make(ledger, token_budget=1000)
    assert lease(ledger, "s1", "a1", want=100, slots=2) == 100

    assert more(ledger, "s1", "old", 100) == 0
    assert end(ledger, "s1", "old", 10) == 0
    assert start(ledger, "never", "a1", 100) == 0
    assert reservations(ledger.client) == {"s1": 100}


@pytest.mark.parametrize("action", ["pause", "revoke"])
def test_a_stopped_dataset_starts_nothing_and_grants_no_more(ledger: Ledger, action: str) -> None:
    make(ledger, token_budget=1000)
    assert lease(ledger, "s1", want=100, slots=2) == 100
    admitted(ledger, "s2")

    getattr(ledger, action)(DS)

    assert start(ledger, "s2", "a1", 100, slots=2) == GRANT_NOT_NOW
    assert more(ledger, "s1", "a1", 100) == 100


@pytest.mark.parametrize("on_budget", ["none", "drain"])
def test_a_dataset_without_grants_neither_defers_nor_grants(ledger: Ledger, on_budget: str) -> None:
    if on_budget == "none":
        make(ledger)
    else:
        make(ledger, token_budget=1000, on_budget="drain")

    assert ledger.admit(DS, "s1", "a1").cap == 0
    assert start(ledger, "s1", "a1", 100) == GRANT_NOT_NOW
    assert more(ledger, "s1", "a1", 100) == 0


def test_a_sample_asked_twice_in_one_call_builds_on_its_first_ask(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=1000)
    assert lease(ledger, "s1", want=600, slots=4) == 250
    asks = [GrantAsk("s1", "a1", GrantKind.MORE, 100), GrantAsk("s1", "a1", GrantKind.MORE, 100)]

    assert ledger.grant_many(DS, asks, slots=4) == [350, 450]
    assert reservations(redis_client) == {"s1": 450}
    assert field(redis_client, DS, "reserved_tokens") == 450
    assert clock_agrees(redis_client)


def test_every_end_of_a_generation_takes_it_off_the_clock(ledger: Ledger, redis_client: redis.Redis) -> None:
    make(ledger, token_budget=100_000)
    for i in range(6):
        assert lease(ledger, f"s{i}", lease_ms=SHORT_MS if i == 5 else 60_000, want=100, slots=8) == 100
    assert clock_state(redis_client)["n"] == 6

    assert ledger.commit(DS, "s0", "a1", 50) is CommitOutcome.COMMITTED
    ledger.fail(DS, "s1", "a1", "HTTP 400")
    ledger.release(DS, "s2", "a1", "paused")
    ledger.give_up(DS, "s3", "a1", "HTTP 503")
    assert ledger.hold(DS, "s4", "a1", b"{}", 60, 1 << 20).value == "held"
    expire_short_leases(redis_client)
    assert ledger.reclaim(DS) == 1

    c = clock_state(redis_client)
    assert (c["n"], c["sum"], c["grant"]) == (0, 0, 0)
    assert clock_agrees(redis_client)
    assert reservations(redis_client) == {"s4": 60}  # held: its tokens, counted at its commit


def test_enqueue_under_truncate_waits_once_no_new_generation_could_start(ledger: Ledger) -> None:
    make(ledger, token_budget=1000)
    assert [lease(ledger, f"s{i}", want=500, slots=40) for i in range(40)] == [25] * 40

    # forty running hold all of it: a 41st would get 1000 / 41 < 25 (the least for this budget's share)
    assert ledger.enqueue(DS, ["q"], window=10) == [1]
    for i in range(39):
        assert ledger.commit(DS, f"s{i}", "a1", 25) is CommitOutcome.COMMITTED
    # 25 left, all s39's: a new one would share (0 + 25) / 1 with it, 12 below start_least (25)
    assert ledger.enqueue(DS, ["q2"], window=10) == [-3]


# --- overdrawn tokens ---------------------------------------------------------------------------------


def test_a_commit_past_its_grant_keeps_the_excess_as_overdrawn_tokens(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=1000)
    assert lease(ledger, "s1", want=50, slots=2) == 50
    assert lease(ledger, "s2", want=50, slots=2) == 50

    # s1's abort landed two steps late; s2 ended within its grant
    assert ledger.commit(DS, "s1", "a1", 52, truncated=True) is CommitOutcome.COMMITTED
    assert ledger.commit(DS, "s2", "a1", 50) is CommitOutcome.COMMITTED

    snap = ledger.snapshot(DS)
    assert (snap.tokens, snap.reserved_tokens, overdrawn(redis_client)) == (102, 0, 2)
    assert pool_taken(redis_client) == 100


def test_a_commit_within_its_grant_overdraws_nothing(ledger: Ledger, redis_client: redis.Redis) -> None:
    make(ledger, token_budget=1000)
    lease(ledger, "s1", want=50, slots=2)

    assert ledger.commit(DS, "s1", "a1", 50) is CommitOutcome.COMMITTED

    assert overdrawn(redis_client) == 0


def test_a_commit_past_a_grant_more_raised_overdraws_only_past_the_new_grant(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=1000)
    lease(ledger, "s1", want=50, slots=2)
    assert more(ledger, "s1", "a1", 30) == 80

    assert ledger.commit(DS, "s1", "a1", 81) is CommitOutcome.COMMITTED

    assert overdrawn(redis_client) == 1


@pytest.mark.parametrize(("counts", "expected"), [(True, 3), (False, 0)], ids=["discarded", "not-counted"])
def test_a_release_past_its_grant_overdraws_only_when_it_counts_against_the_budget(
    ledger: Ledger, redis_client: redis.Redis, counts: bool, expected: int
) -> None:
    make(ledger, token_budget=1000)
    assert lease(ledger, "s1", want=40, slots=1) == 40

    ledger.release(DS, "s1", "a1", "discarded", 43, counts_against_budget=counts)

    assert overdrawn(redis_client) == expected
    assert ledger.snapshot(DS).discarded_tokens == (43 if counts else 0)


def _granted_to_the_end_with_an_overdraw(ledger: Ledger, redis_client: redis.Redis) -> None:
    """Budget 100, all of it granted to four generations (25 each), then s0 commits 2 tokens past its
    grant."""
    make(ledger, token_budget=100)
    assert [lease(ledger, f"s{i}", want=MAX_NEW, slots=4) for i in range(4)] == [25] * 4
    assert ledger.commit(DS, "s0", "a1", 27, truncated=True) is CommitOutcome.COMMITTED
    assert overdrawn(redis_client) == 2
    assert budget_taken(redis_client) == 102  # spent + reserved is past the budget by the overdraw
    assert pool_taken(redis_client) == 100


def test_an_overdraw_alone_does_not_make_progress_stop_what_runs(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    _granted_to_the_end_with_an_overdraw(ledger, redis_client)

    assert [progress(ledger, f"s{i}", "a1") for i in range(1, 4)] == [Progress.CONTINUE] * 3


def test_an_overdraw_alone_does_not_make_stop_check_stop_what_runs(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    _granted_to_the_end_with_an_overdraw(ledger, redis_client)

    assert ledger.stop_reasons([DS]) == {DS: ""}


def test_a_lowered_budget_still_stops_what_runs_after_an_overdraw(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    _granted_to_the_end_with_an_overdraw(ledger, redis_client)

    ledger.set_limits(DS, token_budget=99)  # below committed - overdrawn + reserved (100)

    assert progress(ledger, "s1", "a1") is Progress.STOP
    assert ledger.stop_reasons([DS]) == {DS: "budget"}


# --- discard: no reservation; its admission rule, and the pool kept at commit ------------------------------


def fill(ledger: Ledger, prefix: str = "f", want: int = 0, limit: int = 500) -> list[int]:
    """Admit new samples one at a time until admit says limit; their caps."""
    caps: list[int] = []
    for i in range(limit):
        result = ledger.admit(DS, f"{prefix}{i}", "a1", want=want)
        if result.admission is not Admission.OK:
            assert result.admission is Admission.LIMIT, result
            return caps
        caps.append(result.cap)
    raise AssertionError(f"admit never said limit in {limit} admits")


def test_discard_admits_while_committed_live_and_a_mean_answer_per_generation_in_flight_fit(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=300, on_budget="discard")
    for i in range(10):
        commit_new(ledger, f"c{i}", 20)  # the committed length: 20, ten times

    # 200 + n x 20 <= 300 for n = 1..5 in flight; a sixth would be expected to pass the budget
    caps = fill(ledger, "s", want=5)

    assert caps == [0] * 5  # nothing reserved: each is sent with its whole want
    assert ledger.snapshot(DS).reserved_tokens == 0


def test_discard_expects_max_new_tokens_of_each_answer_in_flight_past_the_number_committed(
    ledger: Ledger,
) -> None:
    make(ledger, token_budget=1000, on_budget="discard")
    for i in range(10):
        commit_new(ledger, f"c{i}", 20)

    # 20 each for as many in flight as are committed (10); past that (the first answers to end are the
    # short ones), max_new_tokens (64) each: 200 + 10 x 20 + 9 x 64 = 976 <= 1000 < 200 + 200 + 10 x 64
    assert len(fill(ledger, "s")) == 19


def test_discard_expects_each_answer_in_flight_past_the_number_committed_to_need_the_tokens_so_far_per_answer(
    ledger: Ledger,
) -> None:
    make(ledger, token_budget=1000, on_budget="discard")
    for i in range(10):
        commit_new(ledger, f"c{i}", 20)
    for i in range(10):
        assert ledger.admit(DS, f"r{i}", "a1").admission is Admission.OK
    # nothing reported yet: the answers in flight would count as nothing, so the rule above holds
    assert ledger.renew_many(DS, [(f"r{i}", "a1", None) for i in range(10)]) == [True] * 10
    assert len(fill(ledger, "early")) == 9  # 200 + 10 x 20 + 9 x 64 = 976; its 10 more: 1,040
    for i in range(9):
        ledger.release(DS, f"early{i}", "a1", "test")

    # each of the ten in flight has 10 tokens so far: (200 committed + 100 live) / 10 committed = 30 per
    # answer, less than max_new_tokens (64) for those past the committed count: 200 + 30 n <= 1000 up to
    # n = 26 in flight (the first answers to end are the short ones, and the live tokens say the rest are
    # longer)
    assert ledger.renew_many(DS, [(f"r{i}", "a1", 10) for i in range(10)]) == [True] * 10

    assert len(fill(ledger, "s")) == 16


def test_discard_keeps_those_in_flight_at_the_budget_on_average_and_two_spreads_of_their_sum_in_its_slack(
    ledger: Ledger,
) -> None:
    make(ledger, token_budget=1760, on_budget="discard")
    for i in range(20):
        commit_new(ledger, f"a{i}", 10)
        commit_new(ledger, f"b{i}", 30)  # expected length (20 x 100 + 20 x 900) / 800 = 25; spread 10

    # on average within the budget: 800 + 25 n <= 1760 up to n = 38; with two spreads of the sum within
    # the budget and its 1% (1,777): 800 + 25 n + 2 x 10 x sqrt(n) up to n = 34 (1766.6; 35: 1793.3)
    assert len(fill(ledger, "s")) == 34


def test_discard_counts_live_tokens_in_its_admission_rule_where_they_pass_what_is_expected(
    ledger: Ledger,
) -> None:
    make(ledger, token_budget=100, on_budget="discard")
    for i in range(4):
        commit_new(ledger, f"c{i}", 5)  # 20 committed
    lease(ledger, "s1", want=5)
    # expected of the two in flight: 2 x 5; what s1 has produced counts where it is more (drain's rule)
    assert ledger.renew_many(DS, [("s1", "a1", 40)]) == [True]  # 20 + max(40, 2 x 5) = 60
    assert ledger.admit(DS, "s2", "a1", want=5).admission is Admission.OK
    assert ledger.renew_many(DS, [("s1", "a1", 75), ("s2", "a1", 6)]) == [True, True]  # 20 + 81 > 100

    assert ledger.admit(DS, "s3", "a1", want=5).admission is Admission.LIMIT
    assert ledger.renew_many(DS, [("s1", "a1", 74)]) == [True]  # 20 + max(80, 3 x 5) = 100
    assert ledger.admit(DS, "s3", "a2", want=5).admission is Admission.OK


def test_a_discard_answer_that_would_pass_the_budget_and_its_one_percent_is_thrown_away_whole(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=1000, on_budget="discard")
    commit_new(ledger, "c", 1)  # a mean answer of 1 token: the expected rule never binds here
    for sid in ("s1", "s2", "s3"):
        assert ledger.admit(DS, sid, "a1").admission is Admission.OK

    assert ledger.commit(DS, "s1", "a1", 950) is CommitOutcome.COMMITTED  # 951 of 1,010
    assert ledger.stop_reasons([DS]) == {DS: ""}
    # s3 is stopped only once what is kept reaches the budget: one that ends meanwhile is kept in the slack
    assert ledger.commit(DS, "s3", "a1", 59) is CommitOutcome.COMMITTED  # 1,010: the slack's end
    assert ledger.commit(DS, "s2", "a1", 60) is CommitOutcome.OVER_LIMIT  # 1,070: past the slack

    snap = ledger.snapshot(DS)
    assert (snap.tokens, snap.samples, snap.inflight, snap.truncated) == (1010, 3, 0, 0)  # none cut
    # thrown away whole, and counted against the budget: the dataset is exhausted, and what would still
    # run of it is stopped (each would be thrown away too)
    assert (snap.discarded_tokens, snap.wasted_tokens) == (60, 60)
    assert ledger.stop_reasons([DS]) == {DS: "budget"}
    assert snap.state == DatasetState.EXHAUSTED
    assert pending(redis_client) == {"s2": "discarded"}  # not lost: dropped by the budget


def test_the_commit_that_spends_a_discard_budget_announces_the_stop_of_what_still_runs_once(
    ledger: Ledger,
) -> None:
    make(ledger, token_budget=1000, on_budget="discard")
    commit_new(ledger, "c", 1)
    for sid in ("s1", "s2", "s3", "s4"):
        assert ledger.admit(DS, sid, "a1").admission is Admission.OK
    stops = ledger.subscribe_stops()
    try:
        assert ledger.commit(DS, "s1", "a1", 900) is CommitOutcome.COMMITTED  # 901: not yet
        assert ledger.stop_reasons([DS]) == {DS: ""}
        assert ledger.commit(DS, "s2", "a1", 99) is CommitOutcome.COMMITTED  # 1,000: the budget
        assert ledger.stop_reasons([DS]) == {DS: "budget"}
        assert ledger.commit(DS, "s3", "a1", 5) is CommitOutcome.COMMITTED  # kept in the slack

        messages = []
        deadline = time.monotonic() + 1
        while time.monotonic() < deadline:
            message = stops.get_message(timeout=0.2)
            if message is not None:
                messages.append(message["data"])
        assert messages == [DS]  # the crossing only
    finally:
        stops.close()


def test_discard_is_exhausted_once_less_than_one_answer_needs_is_left_and_truncate_once_nothing_is(
    ledger: Ledger,
) -> None:
    make(ledger, "d", token_budget=100, on_budget="discard")
    make(ledger, "t", token_budget=100)
    for name in ("d", "t"):
        commit_whole(ledger, "a", 30, name=name)  # 70 left: the expected answer (30) fits
        assert ledger.snapshot(name).state == DatasetState.ACTIVE
        commit_whole(ledger, "b", 60, name=name)  # 10 left: less than (30^2 + 60^2) / 90 = 50 (+ 2 x 15)

    assert ledger.snapshot("d").state == DatasetState.EXHAUSTED
    assert ledger.snapshot("t").state == DatasetState.ACTIVE
    commit_whole(ledger, "c", 10, name="t")
    assert ledger.snapshot("t").state == DatasetState.EXHAUSTED
    assert (overdrawn(ledger.client, "d"), overdrawn(ledger.client, "t")) == (0, 0)


@pytest.mark.parametrize("seed", range(4))
def test_a_discard_dataset_with_nothing_in_flight_is_either_exhausted_or_admits_the_next_answer(
    ledger: Ledger, seed: int
) -> None:
    # discard's exhaustion and its admission rule read the same expected length (E[L^2] / E[L] of the
    # committed lengths, longer than their mean): with none in flight they must never disagree, or the
    # dataset would wait forever, neither settled nor fed.
    rnd = random.Random(seed)
    make(ledger, token_budget=5000, on_budget="discard")
    for i in range(200):
        snap = ledger.snapshot(DS)
        if snap.state == DatasetState.EXHAUSTED:
            break
        assert snap.inflight == 0
        result = ledger.admit(DS, f"s{i}", "a", want=MAX_NEW)
        assert result.admission is Admission.OK, (i, snap.tokens, result)
        tokens = rnd.choice([5, 20, 80, 300])
        # an answer past the pool is thrown away whole; the next one is admitted or the dataset ends
        assert ledger.commit(DS, f"s{i}", "a", tokens) in (CommitOutcome.COMMITTED, CommitOutcome.OVER_LIMIT)
    assert ledger.snapshot(DS).state == DatasetState.EXHAUSTED
    assert ledger.snapshot(DS).tokens <= grant_pool("discard", 5000)


# --- property: random interleavings never pass the pool, and the clock stays true ---------------------


def _fields(client: redis.Redis) -> dict[str, int]:
    names = ["tokens", "discarded_tokens", "reserved_tokens", "overdrawn_tokens", "samples"]
    values = client.hmget(keys().ledger_hash, names)
    return {n: int(v or 0) for n, v in zip(names, values, strict=True)}


@pytest.mark.parametrize("seed", range(8))
def test_random_interleavings_of_starts_mores_ends_commits_and_releases_never_pass_the_budget(
    ledger: Ledger, redis_client: redis.Redis, seed: int
) -> None:
    rng = random.Random(seed)
    budget = rng.choice([3000, 8000, 20_000])
    slots = rng.choice([0, 4, 16])
    make(ledger, token_budget=budget)
    running: dict[str, tuple[str, int]] = {}  # sid -> (attempt, grant)
    waiting: list[str] = []  # admitted, not granted yet
    counts = {"start": 0, "wait": 0, "dropped": 0, "more": 0, "cut": 0, "end": 0, "overdraw": 0}
    for step in range(500):
        roll = rng.random()
        if roll < 0.2 or not (running or waiting):
            sid = f"s{step}"
            if ledger.admit(DS, sid, "a1").admission is Admission.OK:
                waiting.append(sid)
        elif roll < 0.45 and waiting:
            batch = [waiting.pop(0) for _ in range(min(len(waiting), rng.randint(1, 3)))]
            got = ledger.grant_many(
                DS, [GrantAsk(sid, "a1", GrantKind.START, rng.choice([8, 40, 200])) for sid in batch], slots
            )
            for sid, g in zip(batch, got, strict=True):
                if g > 0:
                    running[sid] = ("a1", g)
                    counts["start"] += 1
                elif g == GRANT_WAIT:
                    waiting.append(sid)
                    counts["wait"] += 1
                else:  # the budget's end: the grant call gave the sample back
                    assert g == GRANT_DROPPED, g
                    assert pending(redis_client).get(sid) == "limit"
                    counts["dropped"] += 1
        elif roll < 0.6 and running:
            sid = rng.choice(sorted(running))
            attempt, grant = running[sid]
            after = more(ledger, sid, attempt, rng.randint(1, 300))
            if after == GRANT_WAIT:  # none now; a few others run: it waits, off the clock, at its grant
                counts["wait more"] = counts.get("wait more", 0) + 1
                after = grant
            assert after >= grant
            counts["more" if after > grant else "cut"] += 1
            running[sid] = (attempt, after)
        elif roll < 0.7 and running:
            sid = rng.choice(sorted(running))
            attempt, grant = running[sid]
            tokens = rng.randint(0, grant)
            assert end(ledger, sid, attempt, tokens) == 1
            running[sid] = (attempt, tokens)
            counts["end"] += 1
        elif roll < 0.72:
            # an attempt that lost its lease (or never held one) finishes anyway: counted only with room
            ledger.commit(DS, f"ghost{step}", "zombie", rng.randint(1, 100))
        elif running:
            sid = rng.choice(sorted(running))
            attempt, grant = running.pop(sid)
            late = rng.choice([0, 0, 0, 1, 2])  # the step or two an abort takes to land
            tokens = grant + late if rng.random() < 0.5 else rng.randint(0, grant)
            counts["overdraw"] += tokens > grant
            if roll < 0.92:
                outcome = ledger.commit(DS, sid, attempt, tokens, truncated=tokens >= grant)
                assert outcome is CommitOutcome.COMMITTED
            else:
                ledger.release(DS, sid, attempt, "stopped", tokens)
        assert pool_taken(redis_client) <= budget, step
        f = _fields(redis_client)
        assert (
            f["reserved_tokens"]
            == sum(reservations(redis_client).values())
            == sum(g for _, g in running.values())
        ), step
        assert clock_agrees(redis_client), step

    for sid, (attempt, grant) in running.items():
        assert ledger.commit(DS, sid, attempt, grant) is CommitOutcome.COMMITTED
    for sid in waiting:
        ledger.release(DS, sid, "a1", "limit")
    f = _fields(redis_client)
    assert f["reserved_tokens"] == 0
    assert f["tokens"] + f["discarded_tokens"] - f["overdrawn_tokens"] <= budget
    c = clock_state(redis_client)
    assert (c["n"], c["sum"], c["grant"]) == (0, 0, 0)
    # the run did exercise every path
    assert counts["start"] >= 10 and counts["more"] > 0 and counts["end"] > 0 and counts["overdraw"] > 0
