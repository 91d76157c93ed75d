"""The worker's ledger scripts against real Redis, the outcome: commit, fail, release and reclaim.

Lease expiry uses a lease of 50 ms and a sleep of 100 ms (the scripts read Redis's own clock).
"""

from __future__ import annotations

import pytest
import redis

from budget import Admission, CommitItem, CommitOutcome, DatasetState, Ledger
from budget.ledger import GRANT_WAIT
from tests.redis.grants import clock_agrees, commit_whole, overdrawn
from tests.support.ledger import (
    DS,
    MAX_NEW,
    SHORT_MS,
    commit_new,
    expire_short_leases,
    lease,
    make,
    more,
    owner,
    pending,
    report_live,
    reservations,
    start,
)

pytestmark = pytest.mark.redis


# --- commit -----------------------------------------------------------------------------------------


def test_commit_counts_the_tokens_records_the_attempt_and_drops_the_lease(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    lease(ledger, "s1")
    report_live(ledger, "s1", "a1", 30)

    assert ledger.commit(DS, "s1", "a1", 32) is CommitOutcome.COMMITTED

    snap = ledger.snapshot(DS)
    assert (snap.tokens, snap.samples, snap.truncated, snap.live_tokens, snap.inflight) == (32, 1, 0, 0, 0)
    assert snap.wasted_tokens == 0
    assert ledger.done_attempts(DS) == {"s1": "a1"}
    assert ledger.is_done(DS, ["s1", "s2"]) == [True, False]
    assert owner(redis_client, "s1") is None
    assert redis_client.hget(ledger.keys_of(DS).live_hash, "s1") is None


def test_commit_is_exactly_once_when_two_attempts_commit_the_same_sample(ledger: Ledger) -> None:
    make(ledger)
    lease(ledger, "s1", "a1", lease_ms=SHORT_MS)
    report_live(ledger, "s1", "a1", 10, lease_ms=SHORT_MS)
    expire_short_leases(ledger.client)
    lease(ledger, "s1", "a2")  # redelivered after a1's lease expired; a1 is still running
    report_live(ledger, "s1", "a2", 12)

    assert ledger.commit(DS, "s1", "a2", 12) is CommitOutcome.COMMITTED
    assert ledger.commit(DS, "s1", "a1", 10) is CommitOutcome.DUPLICATE
    assert ledger.commit(DS, "s1", "a2", 12) is CommitOutcome.DUPLICATE

    snap = ledger.snapshot(DS)
    assert (snap.tokens, snap.samples, snap.live_tokens, snap.inflight) == (12, 1, 0, 0)
    assert snap.wasted_tokens == 10 + 10 + 12  # a1's live tokens reclaimed, then both duplicates
    assert ledger.done_attempts(DS) == {"s1": "a2"}


def test_a_duplicate_commit_by_the_lease_holder_drops_its_lease(ledger: Ledger) -> None:
    make(ledger)
    lease(ledger, "s1", "a1", lease_ms=SHORT_MS)
    expire_short_leases(ledger.client)
    lease(ledger, "s1", "a2")
    report_live(ledger, "s1", "a2", 4)

    assert ledger.commit(DS, "s1", "a1", 9) is CommitOutcome.COMMITTED  # a1 finished first
    assert ledger.commit(DS, "s1", "a2", 8) is CommitOutcome.DUPLICATE

    snap = ledger.snapshot(DS)
    assert (snap.tokens, snap.samples, snap.live_tokens, snap.inflight, snap.pending) == (9, 1, 0, 0, 0)
    assert ledger.done_attempts(DS) == {"s1": "a1"}


def test_commit_marks_a_truncated_generation(ledger: Ledger) -> None:
    make(ledger, token_budget=1000)
    commit_new(ledger, "s1", 10, truncated=True)
    commit_new(ledger, "s2", 10)

    assert ledger.snapshot(DS).truncated == 1


def test_commit_sets_exhausted_when_the_budget_is_reached(ledger: Ledger) -> None:
    make(ledger, token_budget=100)
    commit_whole(ledger, "s1", 99)
    assert ledger.snapshot(DS).state == DatasetState.ACTIVE

    commit_whole(ledger, "s2", 1)

    assert ledger.snapshot(DS).state == DatasetState.EXHAUSTED


def test_commit_past_the_budget_is_still_counted_under_truncate(ledger: Ledger) -> None:
    make(ledger, token_budget=1000)
    assert lease(ledger, "s1", want=100) == 100  # far from the end: the whole want
    assert lease(ledger, "s2", want=100) == 100
    ledger.set_limits(DS, token_budget=100)  # lowered while both run: s2 is cut, its part still counts
    ledger.commit(DS, "s1", "a1", 100)

    assert ledger.commit(DS, "s2", "a1", 20, truncated=True) is CommitOutcome.COMMITTED

    snap = ledger.snapshot(DS)
    assert (snap.state, snap.tokens, snap.samples, snap.truncated) == (DatasetState.EXHAUSTED, 120, 2, 1)


def test_commit_sets_exhausted_when_max_samples_is_reached(ledger: Ledger) -> None:
    make(ledger, max_samples=2)
    commit_new(ledger, "s1", 1)
    assert ledger.snapshot(DS).state == DatasetState.ACTIVE

    commit_new(ledger, "s2", 1)

    assert ledger.snapshot(DS).state == DatasetState.EXHAUSTED


def test_commit_past_max_samples_is_over_limit_and_not_counted(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, max_samples=2)
    lease(ledger, "s1")
    lease(ledger, "s2")
    ledger.set_limits(DS, max_samples=1)  # the operator lowered the cap mid-flight
    report_live(ledger, "s2", "a1", 6)

    assert ledger.commit(DS, "s1", "a1", 5) is CommitOutcome.COMMITTED
    assert ledger.commit(DS, "s2", "a1", 7) is CommitOutcome.OVER_LIMIT
    assert ledger.commit(DS, "s3", "a1", 4) is CommitOutcome.OVER_LIMIT  # no lease at all

    snap = ledger.snapshot(DS)
    assert (snap.state, snap.tokens, snap.samples) == (DatasetState.EXHAUSTED, 5, 1)
    assert (snap.wasted_tokens, snap.live_tokens, snap.inflight) == (11, 0, 0)
    assert ledger.done_attempts(DS) == {"s1": "a1"}
    assert owner(redis_client, "s2") is None


def test_commit_clears_the_sample_from_pending(ledger: Ledger, redis_client: redis.Redis) -> None:
    make(ledger)
    lease(ledger, "s1", "a1", lease_ms=SHORT_MS)
    expire_short_leases(ledger.client)
    assert ledger.reclaim(DS) == 1
    assert pending(redis_client) == {"s1": "lease_expired"}

    # the slow worker finishes anyway: its record counts, and the sample is no longer to be fed again
    assert ledger.commit(DS, "s1", "a1", 3) is CommitOutcome.COMMITTED

    assert pending(redis_client) == {}
    assert ledger.snapshot(DS).samples == 1


def test_commit_gives_back_the_grant_it_did_not_use(ledger: Ledger, redis_client: redis.Redis) -> None:
    make(ledger, token_budget=100)
    # three slots: each generation is granted a third of the budget (its horizon), 1 token is left
    assert [lease(ledger, f"s{i}", slots=3) for i in (1, 2, 3)] == [33, 33, 33]
    assert ledger.admit(DS, "s4", "a1").admission is Admission.OK
    assert start(ledger, "s4", "a1", MAX_NEW, slots=3) == GRANT_WAIT  # granted away to running ones

    assert ledger.commit(DS, "s1", "a1", 20) is CommitOutcome.COMMITTED

    assert reservations(redis_client) == {"s2": 33, "s3": 33}
    snap = ledger.snapshot(DS)
    assert (snap.tokens, snap.reserved_tokens, snap.state) == (20, 66, DatasetState.ACTIVE)
    # the 13 s1 did not use are free again, and go to the next generation that asks
    assert more(ledger, "s2", "a1", 100) == 33 + 14
    assert clock_agrees(redis_client)


def test_commit_under_discard_exhausts_once_less_than_the_expected_answer_is_left(
    ledger: Ledger,
) -> None:
    make(ledger, token_budget=100, on_budget="discard")
    commit_new(ledger, "s1", 30)
    commit_new(ledger, "s2", 30)  # 40 left: more than the expected answer (30), less than max_new_tokens
    assert ledger.snapshot(DS).state == DatasetState.ACTIVE

    # 25 left < what one answer needs: the expected length, (30^2 + 30^2 + 15^2) / 75 = 27, and two
    # spreads of the lengths (7.1 each)
    commit_new(ledger, "s3", 15)

    snap = ledger.snapshot(DS)
    assert (snap.state, snap.tokens, overdrawn(ledger.client)) == (DatasetState.EXHAUSTED, 75, 0)
    assert ledger.enqueue(DS, ["s4"], window=10) == [-2]


# --- commit_many: a batch in one call ---------------------------------------------------------------


def test_commit_many_counts_each_generation_and_gives_back_each_reservation(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=1000)
    for sid in ("s1", "s2", "s3"):
        lease(ledger, sid)
    report_live(ledger, "s2", "a1", 5)

    outcomes = ledger.commit_many(
        DS,
        [CommitItem("s1", "a1", 10), CommitItem("s2", "a1", 20, truncated=True), CommitItem("s3", "a1", 30)],
    )

    assert outcomes == [CommitOutcome.COMMITTED] * 3
    assert ledger.done_attempts(DS) == {"s1": "a1", "s2": "a1", "s3": "a1"}
    assert reservations(redis_client) == {}
    snap = ledger.snapshot(DS)
    assert (snap.tokens, snap.samples, snap.truncated) == (60, 3, 1)
    assert (snap.reserved_tokens, snap.live_tokens, snap.inflight, snap.wasted_tokens) == (0, 0, 0, 0)


def test_commit_many_counts_a_sample_listed_twice_in_one_batch_once(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=1000)
    lease(ledger, "s1")
    lease(ledger, "s2")
    report_live(ledger, "s1", "a1", 4)

    outcomes = ledger.commit_many(
        DS, [CommitItem("s1", "a1", 10), CommitItem("s2", "a1", 7), CommitItem("s1", "a1", 10)]
    )

    assert outcomes == [CommitOutcome.COMMITTED, CommitOutcome.COMMITTED, CommitOutcome.DUPLICATE]
    snap = ledger.snapshot(DS)
    assert (snap.tokens, snap.samples, snap.wasted_tokens) == (17, 2, 10)
    # its reservation and live tokens are given back once, not twice
    assert (snap.reserved_tokens, snap.live_tokens, snap.inflight) == (0, 0, 0)
    assert lease(ledger, "s3", want=491) == 491  # the 983 left hold a 1/2 share of it whole, alone


def test_commit_many_says_over_limit_once_max_samples_is_crossed_mid_batch(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, max_samples=3)
    commit_new(ledger, "s0", 1)
    lease(ledger, "s1")
    lease(ledger, "s2")
    ledger.set_limits(DS, max_samples=2)  # lowered while both run

    outcomes = ledger.commit_many(DS, [CommitItem("s1", "a1", 5), CommitItem("s2", "a1", 6)])

    assert outcomes == [CommitOutcome.COMMITTED, CommitOutcome.OVER_LIMIT]
    snap = ledger.snapshot(DS)
    assert (snap.state, snap.samples, snap.tokens, snap.wasted_tokens) == (DatasetState.EXHAUSTED, 2, 6, 6)
    assert (snap.inflight, snap.reserved_tokens) == (0, 0)
    assert ledger.done_attempts(DS) == {"s0": "s0-a1", "s1": "a1"}


def test_commit_many_after_revoke_counts_nothing_and_makes_every_sample_pending(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=1000)
    lease(ledger, "s1")
    lease(ledger, "s2")
    ledger.revoke(DS)

    outcomes = ledger.commit_many(DS, [CommitItem("s1", "a1", 5), CommitItem("s2", "a1", 6)])

    assert outcomes == [CommitOutcome.REVOKED, CommitOutcome.REVOKED]
    assert pending(redis_client) == {"s1": "revoked", "s2": "revoked"}
    snap = ledger.snapshot(DS)
    assert (snap.samples, snap.tokens, snap.wasted_tokens, snap.reserved_tokens, snap.inflight) == (
        0,
        0,
        11,
        0,
        0,
    )


def test_commit_many_mixes_committed_duplicate_and_lost_lease_outcomes(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=1000)
    commit_new(ledger, "done", 3)
    lease(ledger, "mine")
    lease(ledger, "theirs", "other")  # held by another attempt: a late commit of ours still counts

    outcomes = ledger.commit_many(
        DS, [CommitItem("done", "late", 4), CommitItem("mine", "a1", 5), CommitItem("theirs", "a1", 6)]
    )

    assert outcomes == [CommitOutcome.DUPLICATE, CommitOutcome.COMMITTED, CommitOutcome.COMMITTED]
    assert owner(redis_client, "theirs") == "other"  # its holder's lease and reservation are its own
    assert reservations(redis_client) == {"theirs": MAX_NEW}
    snap = ledger.snapshot(DS)
    assert (snap.tokens, snap.samples, snap.wasted_tokens, snap.reserved_tokens) == (14, 3, 4, MAX_NEW)


def test_commit_many_of_a_forgotten_dataset_says_unknown_for_each(ledger: Ledger) -> None:
    assert ledger.commit_many("nope", [CommitItem("s1", "a", 1), CommitItem("s2", "a", 2)]) == [
        CommitOutcome.UNKNOWN,
        CommitOutcome.UNKNOWN,
    ]


def test_commit_many_of_no_generations_asks_nothing(ledger: Ledger) -> None:
    make(ledger)

    assert ledger.commit_many(DS, []) == []


# --- every end of an attempt gives its reservation back ---------------------------------------------


@pytest.mark.parametrize("end", ["commit", "fail", "release", "give_up", "reclaim"])
def test_every_end_of_an_attempt_gives_its_grant_back_to_the_budget(
    ledger: Ledger, redis_client: redis.Redis, end: str
) -> None:
    make(ledger, token_budget=64)
    assert lease(ledger, "s1", lease_ms=SHORT_MS if end == "reclaim" else 60_000, want=32, slots=2) == 32
    assert lease(ledger, "s2", want=16, slots=2) == 16
    assert more(ledger, "s2", "a1", 100) == 32  # the last of the budget

    if end == "commit":
        assert ledger.commit(DS, "s1", "a1", 0) is CommitOutcome.COMMITTED  # an empty answer
    elif end == "fail":
        ledger.fail(DS, "s1", "a1", "HTTP 400", wasted_tokens=9)
    elif end == "release":
        ledger.release(DS, "s1", "a1", "worker shutdown", thrown_away_tokens=9)
    elif end == "give_up":
        ledger.give_up(DS, "s1", "a1", "HTTP 503", wasted_tokens=9)
    else:
        expire_short_leases(ledger.client)
        assert ledger.reclaim(DS) == 1

    assert reservations(redis_client) == {"s2": 32}
    assert ledger.snapshot(DS).reserved_tokens == 32
    assert clock_agrees(redis_client)  # s1 is off the clock
    assert lease(ledger, "s3", want=16, slots=2) == 16  # the budget is free again


# --- fail -------------------------------------------------------------------------------------------


def test_fail_records_the_reason_counts_failed_and_drops_the_lease(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    lease(ledger, "s1")
    report_live(ledger, "s1", "a1", 8)

    assert ledger.fail(DS, "s1", "a1", "prompt too long", wasted_tokens=8) == "failed"

    assert ledger.failures(DS) == {"s1": "prompt too long"}
    snap = ledger.snapshot(DS)
    assert (snap.failed, snap.samples, snap.live_tokens, snap.wasted_tokens, snap.inflight) == (1, 0, 0, 8, 0)
    assert owner(redis_client, "s1") is None


def test_fail_clears_the_sample_from_pending(ledger: Ledger, redis_client: redis.Redis) -> None:
    make(ledger)
    ledger.pause(DS)
    ledger.admit(DS, "s1", "a1")
    assert pending(redis_client) == {"s1": "paused"}

    assert ledger.fail(DS, "s1", "a1", "retries exhausted") == "failed"

    assert pending(redis_client) == {}
    assert ledger.snapshot(DS).failed == 1


def test_fail_of_a_committed_sample_says_duplicate_and_records_nothing(ledger: Ledger) -> None:
    make(ledger)
    commit_new(ledger, "s1", 4)

    assert ledger.fail(DS, "s1", "a2", "timeout", wasted_tokens=2) == "duplicate"

    assert ledger.failures(DS) == {}
    snap = ledger.snapshot(DS)
    assert (snap.failed, snap.samples, snap.wasted_tokens) == (0, 1, 2)


# --- release ----------------------------------------------------------------------------------------


def test_release_makes_the_sample_pending_with_the_reason_and_counts_wasted_tokens(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=100)
    lease(ledger, "s1")
    report_live(ledger, "s1", "a1", 40)

    assert ledger.release(DS, "s1", "a1", "worker shutdown", thrown_away_tokens=40) == DatasetState.ACTIVE

    assert pending(redis_client) == {"s1": "worker shutdown"}
    snap = ledger.snapshot(DS)
    assert (snap.live_tokens, snap.wasted_tokens, snap.discarded_tokens, snap.inflight) == (0, 40, 0, 0)
    assert owner(redis_client, "s1") is None
    assert ledger.enqueue(DS, ["s1"], window=10) == [1]


def test_release_counting_against_the_budget_adds_discarded_tokens_and_can_exhaust(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=150, on_budget="discard")
    commit_new(ledger, "s0", 50)  # the mean committed length: 50
    assert lease(ledger, "s1", want=30) == 0  # discard reserves nothing
    report_live(ledger, "s1", "a1", 30)

    assert ledger.release(DS, "s1", "a1", "discarded", 30, counts_against_budget=True) == DatasetState.ACTIVE
    assert lease(ledger, "s2", want=25) == 0  # 80 spent + a mean answer fit
    report_live(ledger, "s2", "a1", 25)
    assert (
        ledger.release(DS, "s2", "a1", "discarded", 25, counts_against_budget=True) == DatasetState.EXHAUSTED
    )

    snap = ledger.snapshot(DS)
    assert (snap.tokens, snap.discarded_tokens, snap.wasted_tokens, snap.live_tokens) == (50, 55, 55, 0)
    assert (snap.reserved_tokens, overdrawn(ledger.client)) == (0, 0)
    assert snap.state == DatasetState.EXHAUSTED  # 150 - 105 spent < a mean answer (50)
    assert pending(redis_client) == {"s1": "discarded", "s2": "discarded"}


def test_release_of_a_committed_sample_does_not_make_it_pending(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    commit_new(ledger, "s1", 4)

    ledger.release(DS, "s1", "a2", "revoked", thrown_away_tokens=3)

    assert pending(redis_client) == {}
    assert ledger.snapshot(DS).wasted_tokens == 3


def test_release_by_an_attempt_that_lost_the_lease_keeps_the_new_holders_lease(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    lease(ledger, "s1", "old", lease_ms=SHORT_MS)
    expire_short_leases(ledger.client)
    lease(ledger, "s1", "new")
    report_live(ledger, "s1", "new", 6)

    ledger.release(DS, "s1", "old", "lost lease")

    assert owner(redis_client, "s1") == "new"
    assert ledger.snapshot(DS).live_tokens == 6


# --- reclaim ----------------------------------------------------------------------------------------


def test_reclaim_returns_expired_leases_to_pending_and_counts_their_live_tokens_as_wasted(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    lease(ledger, "dead1", lease_ms=SHORT_MS)
    lease(ledger, "dead2", lease_ms=SHORT_MS)
    lease(ledger, "alive")
    report_live(ledger, "dead1", "a1", 10, lease_ms=SHORT_MS)
    report_live(ledger, "dead2", "a1", 5, lease_ms=SHORT_MS)
    report_live(ledger, "alive", "a1", 7)
    expire_short_leases(ledger.client)

    assert ledger.reclaim(DS) == 2

    assert pending(redis_client) == {"dead1": "lease_expired", "dead2": "lease_expired"}
    assert owner(redis_client, "dead1") is None
    assert owner(redis_client, "alive") == "a1"
    snap = ledger.snapshot(DS)
    assert (snap.live_tokens, snap.wasted_tokens, snap.reclaimed, snap.inflight) == (7, 15, 2, 1)
    assert snap.tokens == 0

    assert ledger.reclaim(DS) == 0
    assert ledger.snapshot(DS).reclaimed == 2


def test_reclaim_with_no_lease_expired_changes_nothing(ledger: Ledger) -> None:
    make(ledger)
    lease(ledger, "s1")
    report_live(ledger, "s1", "a1", 3)

    assert ledger.reclaim(DS) == 0

    snap = ledger.snapshot(DS)
    assert (snap.inflight, snap.pending, snap.live_tokens, snap.reclaimed) == (1, 0, 3, 0)


def test_reclaim_gives_back_the_budget_granted_to_a_dead_worker(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=16)
    assert lease(ledger, "s1", lease_ms=SHORT_MS) == 16  # the whole budget
    assert ledger.admit(DS, "s2", "a1").admission is Admission.OK
    assert start(ledger, "s2", "a1", MAX_NEW) == GRANT_WAIT  # all of it granted to s1
    expire_short_leases(ledger.client)

    assert ledger.reclaim(DS) == 1

    assert reservations(redis_client) == {}
    assert ledger.snapshot(DS).reserved_tokens == 0
    assert start(ledger, "s2", "a1", MAX_NEW) == 16
    assert clock_agrees(redis_client)


def test_reclaim_does_not_make_a_committed_sample_pending(ledger: Ledger) -> None:
    make(ledger)
    lease(ledger, "s1", "a1", lease_ms=SHORT_MS)
    expire_short_leases(ledger.client)
    lease(ledger, "s1", "a2", lease_ms=SHORT_MS)  # redelivered; a1 still running
    assert ledger.commit(DS, "s1", "a1", 5) is CommitOutcome.COMMITTED  # a1 finishes first
    expire_short_leases(ledger.client)  # a2's worker dies

    assert ledger.reclaim(DS) == 1

    assert ledger.pending_ids(DS) == set()
    ledger.set_source(DS, total=1, done=True)
    assert ledger.snapshot(DS).settled is True


def test_a_commit_without_the_lease_is_refused_where_the_budget_has_no_room_for_it(ledger: Ledger) -> None:
    # An attempt whose lease expired holds no grant: its late commit must not push committed + reserved
    # past the budget (truncate, discard). Where there is room it still counts.
    make(ledger, token_budget=40)
    assert lease(ledger, "s1", "new", want=20) == 20  # the sample's new attempt is granted 20
    assert lease(ledger, "s2", "a1", want=4) == 4  # 20 left: all it wants

    outcomes = ledger.commit_many(DS, [CommitItem("s1", "old", 17), CommitItem("s3", "old", 16)])

    # s1: 0 committed + 24 reserved + 17 > 40: refused; s3: 24 + 16 fits
    assert outcomes == [CommitOutcome.OVER_LIMIT, CommitOutcome.COMMITTED]
    snap = ledger.snapshot(DS)
    assert (snap.tokens, snap.reserved_tokens, snap.wasted_tokens) == (16, 24, 17)
    assert snap.tokens + snap.reserved_tokens <= 40
