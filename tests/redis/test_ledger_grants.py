"""Budget grants against real Redis (budget/lua/_lib.lua "Reservations (grants)"): how admit sizes them, how
extend.lua grants more, the tokens committed past a grant (overdrawn_tokens), discard's admission rule and
pool, and a property-style run of random interleavings that must never pass the pool.
"""

from __future__ import annotations

import random

import pytest
import redis

from budget import Admission, CommitOutcome, DatasetState, Ledger, Progress
from budget.ledger import ENQUEUE_BUDGET_IN_FLIGHT, ENQUEUE_PUBLISH
from tests.redis.grants import (
    admit_grant,
    commit_whole,
    expected_length,
    extend,
    extend_grant,
    grant_pool,
    is_starved,
    overdrawn,
    pool_taken,
    room_for_new,
)
from tests.support.ledger import (
    DS,
    MAX_NEW,
    SHORT_MS,
    budget_taken,
    commit_new,
    expire_short_leases,
    keys,
    lease,
    make,
    progress,
    reservations,
)

pytestmark = pytest.mark.redis


def fill(ledger: Ledger, prefix: str = "f", want: int = 0, limit: int = 500) -> list[int]:
    """Admit new samples one at a time until admit says limit; their grants."""
    caps: list[int] = []
    for i in range(limit):
        result = ledger.admit(DS, f"{prefix}{i}", "a1", want=want)
        if result.admission is not Admission.OK:
            assert result.admission is Admission.LIMIT, result
            return caps
        caps.append(result.cap)
    raise AssertionError(f"admit never said limit in {limit} admits")


def grant_all(ledger: Ledger, sids: list[str], attempt: str = "a1") -> list[int]:
    """Ask more for ``sids`` (one extend call a round) until a round grants nothing more; their grants."""
    asks = [(sid, attempt, 10**6) for sid in sids]
    grants = ledger.extend_many(DS, asks)
    while (again := ledger.extend_many(DS, asks)) != grants:
        grants = again
    return grants


# --- grant sizing ----------------------------------------------------------------------------------------


def test_first_grants_are_the_whole_want_far_from_the_end(ledger: Ledger) -> None:
    make(ledger, token_budget=100_000)

    caps = [lease(ledger, f"s{i}") for i in range(10)]
    caps.append(lease(ledger, "big", want=5 * MAX_NEW))  # a conversation regenerating five replies

    assert caps == [MAX_NEW] * 10 + [5 * MAX_NEW]
    assert ledger.snapshot(DS).reserved_tokens == 15 * MAX_NEW


def test_grants_shrink_with_what_is_left_and_the_number_in_flight(ledger: Ledger) -> None:
    make(ledger, token_budget=2000)
    commit_whole(ledger, "c", 100)  # the mean committed length: 100

    caps = [lease(ledger, f"s{i}", want=300) for i in range(12)]

    # the whole want while a 1/2 share of what is left per generation holds it; then about a mean answer
    # (100); then a 1/2 share of what is left, less the 16 left to each one running, per generation
    assert caps == [300, 300, 100, 100, 100, 76, 59, 47, 38, 31, 26, 22]
    assert ledger.snapshot(DS).reserved_tokens == 2000 - 100 - 701


def test_the_same_want_gets_a_smaller_grant_with_more_in_flight(ledger: Ledger) -> None:
    make(ledger, "alone", token_budget=2000)
    make(ledger, token_budget=2000)
    assert lease(ledger, "a", name="alone", want=100) == 100
    assert lease(ledger, "a", want=100) == 100

    for i in range(8):
        lease(ledger, f"s{i}", want=1)

    # 1,892 left: alone, the whole 100; with 9 in flight an eighth of the want (13), at least 16
    assert lease(ledger, "b", name="alone", want=100) == 100
    assert lease(ledger, "b", want=100) == 16


def test_a_grant_is_at_least_16_tokens_where_there_is_that_much(ledger: Ledger) -> None:
    make(ledger, token_budget=200)
    assert [lease(ledger, f"s{i}", want=20) for i in range(3)] == [20, 20, 20]
    # 140 left, 4 in flight with the next: (140 - 3 x 16) // 8 = 11, an eighth of 64 is 8: at least 16

    assert lease(ledger, "next") == 16
    assert lease(ledger, "small", want=3) == 3  # never more than wanted


def test_a_grant_is_never_more_than_is_left(ledger: Ledger, redis_client: redis.Redis) -> None:
    make(ledger, token_budget=10)

    assert lease(ledger, "s1") == 10  # less than the least grant (16): what is left
    result = ledger.admit(DS, "s2", "a1")

    assert (result.admission, result.cap) == (Admission.LIMIT, 0)
    assert budget_taken(redis_client) == 10


def test_admit_leaves_16_for_each_one_running_and_extend_grants_the_rest_to_the_end(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=1000)

    caps = fill(ledger)
    left = 1000 - budget_taken(redis_client)

    assert caps == sorted(caps, reverse=True)  # they only shrink as the budget is granted
    assert min(caps[:-1]) >= 16 and caps[-1] >= 1
    assert 0 < left <= 16 * len(caps)  # what admit would not grant is kept for those running
    grants = grant_all(ledger, [f"f{i}" for i in range(len(caps))])
    assert sum(grants) == 1000 == budget_taken(redis_client)  # the budget is granted to the last token
    assert ledger.snapshot(DS).state == DatasetState.ACTIVE


def test_a_group_admit_and_queued_samples_count_as_coming_for_the_whole_want(ledger: Ledger) -> None:
    for name in ("alone", "queued", DS):
        make(ledger, name, token_budget=510)
        assert lease(ledger, "s0", name=name, want=100) == 100  # 410 left, 1 running

    one_at_a_time = [lease(ledger, f"s{i}", name="alone", want=100) for i in (1, 2)]
    group = ledger.admit_many(DS, [(f"s{i}", "a", 100) for i in (1, 2)])
    assert ledger.enqueue("queued", ["q1"], window=10) == [ENQUEUE_PUBLISH]
    first_of_two = lease(ledger, "s1", name="queued", want=100)

    # alone, 2 coming: 410 holds 2 x 100 twice over, the whole want (though 394 beyond the 16 for s0 would
    # not); with the group's second or the one queued, 3 coming: a share of the 394 per one running with it,
    # 197 // 2 = 98 < 100, so an eighth of the want (13), at least 16
    assert one_at_a_time == [100, 16]
    assert [cap for _, cap in group.results] == [16, 16]
    assert first_of_two == 16


def test_a_share_is_of_what_is_left_per_generation_running_not_per_one_coming(ledger: Ledger) -> None:
    make(ledger, "alone", token_budget=1000)
    make(ledger, "queued", token_budget=1000)
    make(ledger, token_budget=1000)

    one_at_a_time = [lease(ledger, f"s{i}", name="alone", want=300) for i in range(4)]
    group = ledger.admit_many(DS, [(f"s{i}", "a", 300) for i in range(4)])
    ledger.enqueue("queued", ["q1", "q2", "q3"], window=10)
    first_of_four = lease(ledger, "s0", name="queued", want=300)

    # 4 coming: the pool does not hold 4 x 300 twice over, but the first runs alone: a 1/2 share of 1,000
    # holds its 300; the next ones share what is left with those running: an eighth of the want (38) each
    assert one_at_a_time == [300, 38, 38, 38]
    assert [cap for _, cap in group.results] == [300, 38, 38, 38]  # as if admitted one at a time
    assert first_of_four == 300


def test_grants_follow_the_rule_of_a_share_of_what_is_left_per_generation_coming(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=5000)
    rng = random.Random(3)
    for i in range(60):
        left = 5000 - budget_taken(redis_client)
        leased = redis_client.zcard(keys().lease_zset)
        want = rng.choice([1, 10, MAX_NEW, 300, 900])
        result = ledger.admit(DS, f"s{i}", "a1", want=want)
        expected = admit_grant(left, leased, 0, 1, 0, want)
        assert result.cap == expected, (i, left, leased, want)
        assert result.admission is (Admission.OK if expected else Admission.LIMIT)


# --- extend -------------------------------------------------------------------------------------------


def test_extend_grants_more_up_to_a_share_of_what_is_left_per_generation_in_flight(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=1000)
    assert lease(ledger, "s1", want=100) == 100
    assert lease(ledger, "s2", want=100) == 100

    # 800 left, 2 in flight: a 1/2 share (200) holds the whole ask
    assert extend(ledger, "s1", 150) == 250
    assert extend(ledger, "s2", 10) == 110  # no more than asked
    # 640 left: the share (160) does not hold 5,000; an eighth of it does: the share
    assert extend(ledger, "s1", 5000) == 410

    assert reservations(redis_client) == {"s1": 410, "s2": 110}
    assert ledger.snapshot(DS).reserved_tokens == 520


def test_extend_returns_the_same_grant_when_the_budget_is_fully_granted(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=64)
    assert lease(ledger, "s1", want=32) == 32
    assert lease(ledger, "s2", want=16) == 16
    assert ledger.extend_many(DS, [("s1", "a1", 50), ("s2", "a1", 50)]) == [48, 16]  # the last 16 to s1

    assert extend(ledger, "s2", 50) == 16
    assert ledger.extend_many(DS, [("s1", "a1", 50), ("s2", "a1", 50)]) == [48, 16]

    assert reservations(redis_client) == {"s1": 48, "s2": 16}
    assert budget_taken(redis_client) == 64


def test_extend_gives_what_a_commit_gave_back(ledger: Ledger) -> None:
    make(ledger, token_budget=64)
    lease(ledger, "s1", want=32)
    lease(ledger, "s2", want=16)  # 16 left
    assert ledger.commit(DS, "s1", "a1", 6) is CommitOutcome.COMMITTED  # 26 of its grant are free again

    # 42 left: at least 16 an ask, then what is left
    assert [extend(ledger, "s2", 50) for _ in range(4)] == [32, 48, 58, 58]


def test_extend_returns_zero_for_an_attempt_that_lost_its_lease(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=1000)
    lease(ledger, "s1", "old", lease_ms=SHORT_MS, want=50)
    expire_short_leases(ledger.client)
    assert ledger.reclaim(DS) == 1
    assert lease(ledger, "s1", "new", want=50) == 50

    assert ledger.extend_many(DS, [("s1", "old", 100), ("s1", "never", 100), ("s9", "a1", 100)]) == [0, 0, 0]

    assert reservations(redis_client) == {"s1": 50}  # the new attempt's grant is its own
    assert ledger.snapshot(DS).reserved_tokens == 50


@pytest.mark.parametrize("action", ["pause", "revoke"])
def test_extend_gives_nothing_while_the_dataset_is_paused_or_revoked(
    ledger: Ledger, redis_client: redis.Redis, action: str
) -> None:
    make(ledger, token_budget=1000)
    assert lease(ledger, "s1", want=50) == 50
    ledger.set_state(DS, action)

    assert extend(ledger, "s1", 100) == 50

    assert budget_taken(redis_client) == 50


@pytest.mark.parametrize("limits", [{}, {"token_budget": 1000, "on_budget": "drain"}], ids=["none", "drain"])
def test_extend_gives_nothing_where_the_dataset_has_no_grants(
    ledger: Ledger, redis_client: redis.Redis, limits: dict[str, object]
) -> None:
    make(ledger, **limits)  # type: ignore[arg-type]
    assert lease(ledger, "s1") == 0

    assert extend(ledger, "s1", 100) == 0

    assert reservations(redis_client) == {}
    assert ledger.snapshot(DS).reserved_tokens == 0


def test_several_asks_in_one_call_never_grant_more_than_is_left_in_all(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=100)
    assert [lease(ledger, f"s{i}", want=16) for i in range(4)] == [16, 16, 16, 4]  # 48 left

    after = ledger.extend_many(DS, [(f"s{i}", "a1", 100) for i in range(4)])

    # 48 // 8 = 6, at least 16: 16, 16, 16, then nothing
    assert after == [32, 32, 32, 4]
    assert sum(after) == 100 == budget_taken(redis_client)
    assert reservations(redis_client) == {f"s{i}": n for i, n in enumerate(after)}


def test_extend_under_discard_grants_from_the_pool(ledger: Ledger, redis_client: redis.Redis) -> None:
    make(ledger, token_budget=100, on_budget="discard")
    assert lease(ledger, "s1", want=50) == 50

    # 51 left of the pool (101): 16 an ask, then what is left, less than the least grant
    assert [extend(ledger, "s1", 100) for _ in range(5)] == [66, 82, 98, 101, 101]
    assert budget_taken(redis_client) == 101 == grant_pool("discard", 100)


def test_extend_of_a_sample_asked_twice_in_one_call_keeps_reserved_tokens_the_sum_of_the_grants(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=1000)
    assert lease(ledger, "s1", want=50) == 50

    after = ledger.extend_many(DS, [("s1", "a1", 100), ("s1", "a1", 100)])

    assert ledger.snapshot(DS).reserved_tokens == sum(reservations(redis_client).values()) == after[-1]
    assert ledger.commit(DS, "s1", "a1", 10) is CommitOutcome.COMMITTED
    assert ledger.snapshot(DS).reserved_tokens == 0  # nothing in flight holds any of the budget


# --- least and starved (the budget's end) ---------------------------------------------------------------


def _two_running(ledger: Ledger, name: str = DS) -> None:
    """Budget 100: s1 and s2 running with 16 each (68 left)."""
    make(ledger, name, token_budget=100)
    assert [lease(ledger, sid, name=name) for sid in ("s1", "s2")] == [16, 16]


def test_least_makes_extend_give_at_least_that_much_where_what_is_left_allows(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    _two_running(ledger, "any")
    _two_running(ledger)

    # 68 left, 2 in flight: a share of 17, an eighth of the ask (13), at least 16
    assert extend(ledger, "s1", 100, name="any") == 32
    assert extend(ledger, "s1", 100, least=40) == 56  # raised to the least worth granting
    assert extend(ledger, "s2", 100, least=10) == 32  # a least below the grant's size changes nothing
    assert extend(ledger, "s2", 5, least=40) == 37  # never more than asked: the least is at most the ask

    assert reservations(redis_client) == {"s1": 56, "s2": 37}
    assert not is_starved(redis_client) and not is_starved(redis_client, "any")


def test_several_asks_with_a_least_in_one_call_never_grant_more_than_is_left(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    _two_running(ledger)

    # 68 left: s1 takes its least (40); 28 are left for s2's 40: all of them, and the budget's end is found
    assert ledger.extend_many(DS, [("s1", "a1", 100, 40), ("s2", "a1", 100, 40)]) == [56, 44]

    assert budget_taken(redis_client) == 100
    assert is_starved(redis_client)


def test_extend_that_cannot_give_the_least_marks_the_dataset_starved(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    _two_running(ledger)
    assert extend(ledger, "s1", 100, least=60) == 76  # 68 left: 60 of them
    assert not is_starved(redis_client)

    assert extend(ledger, "s2", 100, least=16) == 24  # 8 left: all of them, less than its least
    assert is_starved(redis_client)
    assert extend(ledger, "s2", 100, least=16) == 24  # nothing left; starved it stays
    assert is_starved(redis_client)
    assert budget_taken(redis_client) == 100


def test_extend_with_no_least_never_marks_the_dataset_starved(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    _two_running(ledger)

    grants = grant_all(ledger, ["s1", "s2"])  # asks of any size until nothing is left

    assert sum(grants) == 100 and not is_starved(redis_client)


def _starved_with_two_running(ledger: Ledger, redis_client: redis.Redis) -> None:
    """Budget 124: s1, s2 and s3 running with 16 each; s1's ask of at least 1000 finds the budget's end (all
    of the 76 left, starved); s1 then ends at 30, giving 62 back while s2 and s3 run."""
    make(ledger, token_budget=124)
    assert [lease(ledger, sid) for sid in ("s1", "s2", "s3")] == [16, 16, 16]
    assert extend(ledger, "s1", 1000, least=1000) == 16 + 76  # less than its least: all that is left
    assert is_starved(redis_client)
    assert ledger.commit(DS, "s1", "a1", 30) is CommitOutcome.COMMITTED
    assert 124 - budget_taken(redis_client) == 62


def test_starved_admit_says_limit_for_new_samples_while_some_run_and_admits_with_none_running(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    _starved_with_two_running(ledger, redis_client)
    # not starved, 62 left with two running would start one: 30 beyond their 16 each, a mean answer (30);
    # starved, it needs a mean answer for each of the two running
    assert room_for_new(62, 2, MAX_NEW, 30, starved=False) == 30
    assert room_for_new(62, 2, MAX_NEW, 30, starved=True) == 0

    result = ledger.admit(DS, "s4", "a1")
    assert (result.admission, result.cap) == (Admission.LIMIT, 0)  # the budget's end: s2, s3 get what is left
    assert ledger.enqueue(DS, ["s5"], window=10) == [ENQUEUE_BUDGET_IN_FLIGHT]  # enqueue agrees
    assert ledger.admit_many(DS, [("s4", "a1", 0), ("s5", "a1", 0)]).results == [(Admission.LIMIT, 0)] * 2
    # a running one is extended: a share of the 62 left per 2 in flight (15), at least 16
    assert extend(ledger, "s2", 50, least=16) == 16 + 16

    for sid in ("s2", "s3"):
        assert ledger.commit(DS, sid, "a1", 10) is CommitOutcome.COMMITTED  # none running now
    assert ledger.enqueue(DS, ["s5"], window=10) == [ENQUEUE_PUBLISH]
    assert lease(ledger, "s5") > 0  # with none running, what is left may start one
    assert is_starved(redis_client)  # only the limits changing clear it


def test_starved_admit_says_limit_while_some_run_even_where_the_pool_holds_every_one_coming_twice_over(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    _two_running(ledger)
    assert extend(ledger, "s1", 100, least=100) == 84  # starved
    assert ledger.commit(DS, "s1", "a1", 64) is CommitOutcome.COMMITTED  # 20 back, s2 runs
    assert ledger.enqueue(DS, ["s3"], window=10) == [ENQUEUE_BUDGET_IN_FLIGHT]  # enqueue: no room for new
    assert room_for_new(20, 1, 1, 64, starved=True) == 0

    # 20 left holds 2 coming x a want of 1 twice over: admit's whole-want branch does not look at starved
    result = ledger.admit(DS, "s3", "a1", want=1)

    assert (result.admission, result.cap) == (Admission.LIMIT, 0)


def test_set_limits_raising_the_budget_clears_starved_and_admits_again_while_some_run(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    _two_running(ledger)
    assert extend(ledger, "s1", 100, least=100) == 84  # starved
    ledger.set_limits(DS, max_samples=50)  # the budget unchanged: still its end
    assert is_starved(redis_client)

    ledger.set_limits(DS, token_budget=150)

    # 50 left with 2 running: 18 beyond their 16 each, more than an eighth of 64
    assert not is_starved(redis_client)
    assert room_for_new(50, 2, MAX_NEW, starved=False) == 18
    assert ledger.enqueue(DS, ["s3"], window=10) == [ENQUEUE_PUBLISH]
    assert lease(ledger, "s3") == 16  # a share of 18 per 3 running is 3: an eighth of 64, at least 16
    assert extend(ledger, "s2", 100, least=16) == 32  # the starved one's next ask is granted


def test_register_again_clears_starved(ledger: Ledger, redis_client: redis.Redis) -> None:
    _two_running(ledger)
    assert extend(ledger, "s1", 100, least=100) == 84
    assert is_starved(redis_client)

    make(ledger, token_budget=100)  # a new submit of the same dataset

    assert not is_starved(redis_client)


# --- overdrawn tokens ---------------------------------------------------------------------------------


def test_a_commit_past_its_grant_keeps_the_excess_as_overdrawn_tokens(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=1000)
    assert lease(ledger, "s1", want=50) == 50
    assert lease(ledger, "s2", want=50) == 50

    # s1's abort landed two steps late; s2 ended within its grant
    assert ledger.commit(DS, "s1", "a1", 52, truncated=True) is CommitOutcome.COMMITTED
    assert ledger.commit(DS, "s2", "a1", 50) is CommitOutcome.COMMITTED

    snap = ledger.snapshot(DS)
    assert (snap.tokens, snap.reserved_tokens, overdrawn(redis_client)) == (102, 0, 2)
    assert pool_taken(redis_client) == 100


def test_a_commit_within_its_grant_overdraws_nothing(ledger: Ledger, redis_client: redis.Redis) -> None:
    make(ledger, token_budget=1000)
    lease(ledger, "s1", want=50)

    assert ledger.commit(DS, "s1", "a1", 50) is CommitOutcome.COMMITTED

    assert overdrawn(redis_client) == 0


def test_a_commit_past_a_grant_extend_raised_overdraws_only_past_the_new_grant(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=1000)
    lease(ledger, "s1", want=50)
    assert extend(ledger, "s1", 30) == 80

    assert ledger.commit(DS, "s1", "a1", 81) is CommitOutcome.COMMITTED

    assert overdrawn(redis_client) == 1


@pytest.mark.parametrize(("counts", "expected"), [(True, 3), (False, 0)], ids=["discarded", "not-counted"])
def test_a_release_past_its_grant_overdraws_only_when_it_counts_against_the_budget(
    ledger: Ledger, redis_client: redis.Redis, counts: bool, expected: int
) -> None:
    make(ledger, token_budget=1000, on_budget="discard")
    assert lease(ledger, "s1", want=40) == 40

    ledger.release(DS, "s1", "a1", "discarded", 43, counts_against_budget=counts)

    assert overdrawn(redis_client) == expected
    assert ledger.snapshot(DS).discarded_tokens == (43 if counts else 0)


def _granted_to_the_end_with_an_overdraw(ledger: Ledger, redis_client: redis.Redis) -> None:
    """Budget 100, all of it granted (admit, then extend), then s0 commits 2 tokens past its grant."""
    make(ledger, token_budget=100)
    sids = [f"s{i}" for i in range(len(fill(ledger, "s", want=16)))]  # 16, 16, 16, then 4 (an eighth: 2)
    grants = grant_all(ledger, sids)
    assert sum(grants) == 100 and len(sids) >= 4
    assert ledger.commit(DS, "s0", "a1", grants[0] + 2, truncated=True) is CommitOutcome.COMMITTED
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


# --- discard: admission rule and pool -----------------------------------------------------------------


def test_discard_admits_while_committed_live_and_a_mean_answer_per_generation_in_flight_fit(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=100, on_budget="discard")
    commit_new(ledger, "c", 20)  # the mean committed length: 20

    # 20 + n x 20 <= 100 for n = 1..4 in flight; a fifth would be expected to pass the budget
    caps = fill(ledger, "s", want=5)

    assert caps == [5] * 4
    assert sum(caps) < grant_pool("discard", 100) - 20  # the pool had more: the expected rule said limit


def test_discard_counts_live_tokens_in_its_admission_rule_where_they_pass_what_is_expected(
    ledger: Ledger,
) -> None:
    make(ledger, token_budget=100, on_budget="discard")
    commit_new(ledger, "c", 20)
    lease(ledger, "s1", want=5)
    # expected of the two in flight: 2 x 20; what s1 has produced counts where it is more (drain's rule)
    assert ledger.renew_many(DS, [("s1", "a1", 40)]) == [True]  # 20 + max(40, 2 x 20) = 60
    assert lease(ledger, "s2", want=5) == 5
    assert ledger.renew_many(DS, [("s1", "a1", 75), ("s2", "a1", 6)]) == [True, True]  # 20 + 81 > 100

    assert ledger.admit(DS, "s3", "a1", want=5).admission is Admission.LIMIT
    assert ledger.renew_many(DS, [("s1", "a1", 74)]) == [True]  # 20 + max(80, 3 x 20) = 100
    assert lease(ledger, "s3", want=5) == 5


def test_discard_grants_from_the_budget_plus_one_percent(ledger: Ledger, redis_client: redis.Redis) -> None:
    make(ledger, token_budget=1000, on_budget="discard")
    commit_new(ledger, "c", 1)  # a mean answer of 1 token: the expected rule never binds here

    caps = fill(ledger, "s")
    grants = grant_all(ledger, [f"s{i}" for i in range(len(caps))])

    assert sum(grants) == 1009  # 1000 + 10 of slack - 1 committed: past the budget itself
    assert budget_taken(redis_client) == grant_pool("discard", 1000) == 1010
    assert [progress(ledger, f"s{i}", "a1") for i in range(3)] == [Progress.CONTINUE] * 3


def test_stop_check_lets_discard_generations_holding_the_pools_slack_run(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=1000, on_budget="discard")
    commit_new(ledger, "c", 1)
    grant_all(ledger, [f"s{i}" for i in range(len(fill(ledger, "s")))])
    assert budget_taken(redis_client) == 1010  # nothing was lowered: the pool is granted

    assert ledger.stop_reasons([DS]) == {DS: ""}


def test_discard_is_exhausted_once_less_than_a_mean_answer_is_left_and_truncate_once_nothing_is(
    ledger: Ledger,
) -> None:
    make(ledger, "d", token_budget=100, on_budget="discard")
    make(ledger, "t", token_budget=100)
    for name in ("d", "t"):
        commit_whole(ledger, "a", 45, name=name)
        commit_whole(ledger, "b", 45, name=name)  # 10 left: less than the mean (45), at least a token

    assert ledger.snapshot("d").state == DatasetState.EXHAUSTED
    assert ledger.snapshot("t").state == DatasetState.ACTIVE
    commit_whole(ledger, "c", 10, name="t")
    assert ledger.snapshot("t").state == DatasetState.EXHAUSTED
    assert (overdrawn(ledger.client, "d"), overdrawn(ledger.client, "t")) == (0, 0)


# --- property: random interleavings never pass the pool ----------------------------------------------


def _fields(client: redis.Redis) -> dict[str, int]:
    names = [
        "tokens",
        "discarded_tokens",
        "reserved_tokens",
        "overdrawn_tokens",
        "live_tokens",
        "samples",
        "tokens_sq",
        "starved",
    ]
    values = client.hmget(keys().ledger_hash, names)
    return {n: int(v or 0) for n, v in zip(names, values, strict=True)}


def _expected_caps(client: redis.Redis, mode: str, budget: int, wants: list[int]) -> list[int]:
    """What admit must grant each sample of a group wanting ``wants``, from the ledger now (nothing queued):
    each admitted before it in the group counts running, and its grant is no longer left."""
    f = _fields(client)
    spent = f["tokens"] + f["discarded_tokens"]
    mean = f["tokens"] / f["samples"] if f["samples"] else 0
    length = expected_length(f["tokens"], f["samples"], f["tokens_sq"], MAX_NEW)
    left = grant_pool(mode, budget) - spent - f["reserved_tokens"]
    leased = client.zcard(keys().lease_zset)
    caps: list[int] = []
    for want in wants:
        ok = sum(c > 0 for c in caps)
        if mode == "discard" and spent + max(f["live_tokens"], (leased + ok + 1) * length) > budget:
            caps.append(0)
            continue
        cap = admit_grant(left, leased, 0, len(wants), ok, want, mean, starved=f["starved"] == 1)
        left -= cap
        caps.append(cap)
    return caps


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", ["truncate", "discard"])
def test_random_interleavings_of_admit_extend_commit_and_release_never_pass_the_pool(
    ledger: Ledger, redis_client: redis.Redis, mode: str, seed: int
) -> None:
    rng = random.Random(seed)
    budget = rng.choice([3000, 8000, 20_000])
    make(ledger, token_budget=budget, on_budget=mode)
    pool = grant_pool(mode, budget)
    running: dict[str, tuple[str, int, int]] = {}  # sid -> (attempt, grant, want)
    admitted = extended = overdraws = starvations = 0
    for step in range(400):
        roll = rng.random()
        if roll < 0.35 or not running:
            group = [
                (f"s{step}-{j}", f"a{step}", rng.choice([0, 8, 40, 200])) for j in range(rng.randint(1, 3))
            ]
            expected = _expected_caps(redis_client, mode, budget, [want or MAX_NEW for _, _, want in group])
            result = ledger.admit_many(DS, group)
            for (sid, attempt, want), (verdict, cap), exp in zip(
                group, result.results, expected, strict=True
            ):
                assert verdict in (Admission.OK, Admission.LIMIT, Admission.EXHAUSTED), verdict
                if result.state == DatasetState.ACTIVE:  # the exact rule
                    assert cap == exp, (step, sid, want)
                if verdict is Admission.OK:
                    assert 1 <= cap <= (want or MAX_NEW)
                    running[sid] = (attempt, cap, want or MAX_NEW)
                    admitted += 1
                else:
                    assert cap == 0
        elif roll < 0.6:
            asks = [
                (sid, running[sid][0], more, rng.choice([0, 0, 16, 40, more]))
                for sid in rng.sample(sorted(running), rng.randint(1, min(3, len(running))))
                for more in [rng.randint(1, 300)]
            ]
            f = _fields(redis_client)
            left = pool - f["tokens"] - f["discarded_tokens"] - f["reserved_tokens"]
            starved = f["starved"] == 1
            after = ledger.extend_many(DS, asks)
            for (sid, attempt, more, least), grant in zip(asks, after, strict=True):
                _, old, want = running[sid]
                mean = f["tokens"] / f["samples"] if f["samples"] else 0
                # each ask sized as a grant, raised to its least where that much is left
                extra, starves = extend_grant(left, len(running), more, mean, least)
                assert grant == old + extra, (step, sid, old, more, least, left)
                assert grant - old >= min(least, more) or left < min(least, more), (step, sid)
                left -= extra
                extended += extra > 0
                starved = starved or starves
                running[sid] = (attempt, grant, want)
            assert (_fields(redis_client)["starved"] == 1) is starved, step
            starvations += starved and f["starved"] != 1
        elif roll < 0.64:
            # an attempt that lost its lease (or never held one) finishes anyway: counted only with room
            ledger.commit(DS, f"ghost{step}", "zombie", rng.randint(1, 100))
        else:
            sid = rng.choice(sorted(running))
            attempt, grant, _want = running.pop(sid)
            late = rng.choice([0, 0, 0, 1, 2])  # the step or two an abort takes to land
            tokens = rng.randint(1, grant + late) if rng.random() < 0.5 else grant + late
            overdraws += tokens > grant
            if roll < 0.88:
                outcome = ledger.commit(DS, sid, attempt, tokens, truncated=tokens >= grant)
                assert outcome is CommitOutcome.COMMITTED
            else:
                ledger.release(DS, sid, attempt, "discarded", tokens, counts_against_budget=mode == "discard")
        assert pool_taken(redis_client) <= pool, step
        f = _fields(redis_client)
        assert (
            f["reserved_tokens"]
            == sum(reservations(redis_client).values())
            == sum(g for _, g, _ in running.values())
        )

    for sid, (attempt, grant, _want) in running.items():
        assert ledger.commit(DS, sid, attempt, grant) is CommitOutcome.COMMITTED
    f = _fields(redis_client)
    assert f["reserved_tokens"] == 0
    assert f["tokens"] + f["discarded_tokens"] - f["overdrawn_tokens"] <= pool
    assert admitted >= 10 and extended > 0 and overdraws > 0  # the run did exercise every path
    assert starvations <= 1  # the end is declared once: nothing here clears it


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
        tokens = min(result.cap, rnd.choice([5, 20, 80, 300]))
        assert ledger.commit(DS, f"s{i}", "a", tokens) is CommitOutcome.COMMITTED
    assert ledger.snapshot(DS).state == DatasetState.EXHAUSTED
