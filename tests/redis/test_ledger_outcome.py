"""The worker's ledger scripts against real Redis, the outcome: commit, fail, release and reclaim.

Lease expiry uses a lease of 50 ms and a sleep of 100 ms (the scripts read Redis's own clock).
"""

from __future__ import annotations

import time

import pytest
import redis

from budget import CommitOutcome, DatasetState, Ledger, Progress
from tests.support.ledger import DS, EXPIRE_S, SHORT_MS, commit_new, lease, make, owner, pending, progress

pytestmark = pytest.mark.redis


# --- commit -----------------------------------------------------------------------------------------


def test_commit_counts_the_tokens_records_the_attempt_and_drops_the_lease(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    lease(ledger, "s1")
    progress(ledger, "s1", "a1", 30)

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
    progress(ledger, "s1", "a1", 10, lease_ms=SHORT_MS)
    time.sleep(EXPIRE_S)
    lease(ledger, "s1", "a2")  # redelivered after a1's lease expired; a1 is still running
    progress(ledger, "s1", "a2", 12)

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
    time.sleep(EXPIRE_S)
    lease(ledger, "s1", "a2")
    progress(ledger, "s1", "a2", 4)

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
    commit_new(ledger, "s1", 99)
    assert ledger.snapshot(DS).state == DatasetState.ACTIVE

    commit_new(ledger, "s2", 1)

    assert ledger.snapshot(DS).state == DatasetState.EXHAUSTED


def test_commit_past_the_budget_is_still_counted_under_truncate(ledger: Ledger) -> None:
    make(ledger, token_budget=100)
    lease(ledger, "s1")
    lease(ledger, "s2")
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
    progress(ledger, "s2", "a1", 6)

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
    time.sleep(EXPIRE_S)
    assert ledger.reclaim(DS) == 1
    assert pending(redis_client) == {"s1": "lease_expired"}

    # the slow worker finishes anyway: its record counts, and the sample is no longer to be fed again
    assert ledger.commit(DS, "s1", "a1", 3) is CommitOutcome.COMMITTED

    assert pending(redis_client) == {}
    assert ledger.snapshot(DS).samples == 1


# --- fail -------------------------------------------------------------------------------------------


def test_fail_records_the_reason_counts_failed_and_drops_the_lease(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    lease(ledger, "s1")
    progress(ledger, "s1", "a1", 8)

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
    progress(ledger, "s1", "a1", 40)

    assert ledger.release(DS, "s1", "a1", "worker shutdown", thrown_away_tokens=40) == DatasetState.ACTIVE

    assert pending(redis_client) == {"s1": "worker shutdown"}
    snap = ledger.snapshot(DS)
    assert (snap.live_tokens, snap.wasted_tokens, snap.discarded_tokens, snap.inflight) == (0, 40, 0, 0)
    assert owner(redis_client, "s1") is None
    assert ledger.enqueue(DS, ["s1"], window=10) == [1]


def test_release_counting_against_the_budget_adds_discarded_tokens_and_can_exhaust(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=100, on_budget="discard")
    lease(ledger, "s1")
    lease(ledger, "s2")
    commit_new(ledger, "s0", 50)
    progress(ledger, "s1", "a1", 30)
    progress(ledger, "s2", "a1", 25)

    assert ledger.release(DS, "s1", "a1", "discarded", 30, counts_against_budget=True) == DatasetState.ACTIVE
    assert (
        ledger.release(DS, "s2", "a1", "discarded", 25, counts_against_budget=True) == DatasetState.EXHAUSTED
    )

    snap = ledger.snapshot(DS)
    assert (snap.tokens, snap.discarded_tokens, snap.wasted_tokens, snap.live_tokens) == (50, 55, 55, 0)
    assert snap.state == DatasetState.EXHAUSTED
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
    time.sleep(EXPIRE_S)
    lease(ledger, "s1", "new")
    progress(ledger, "s1", "new", 6)

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
    progress(ledger, "dead1", "a1", 10, lease_ms=SHORT_MS)
    progress(ledger, "dead2", "a1", 5, lease_ms=SHORT_MS)
    progress(ledger, "alive", "a1", 7)
    time.sleep(EXPIRE_S)

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
    progress(ledger, "s1", "a1", 3)

    assert ledger.reclaim(DS) == 0

    snap = ledger.snapshot(DS)
    assert (snap.inflight, snap.pending, snap.live_tokens, snap.reclaimed) == (1, 0, 3, 0)


def test_reclaim_gives_back_the_budget_held_by_a_dead_worker(ledger: Ledger) -> None:
    make(ledger, token_budget=100)
    lease(ledger, "s1", lease_ms=SHORT_MS)
    assert progress(ledger, "s1", "a1", 100, lease_ms=SHORT_MS) is Progress.STOP
    assert ledger.enqueue(DS, ["s2"], window=10) == [-3]
    time.sleep(EXPIRE_S)

    assert ledger.reclaim(DS) == 1

    assert ledger.enqueue(DS, ["s2"], window=10) == [1]
    lease(ledger, "s2")


def test_reclaim_does_not_make_a_committed_sample_pending(ledger: Ledger) -> None:
    make(ledger)
    lease(ledger, "s1", "a1", lease_ms=SHORT_MS)
    time.sleep(EXPIRE_S)
    lease(ledger, "s1", "a2", lease_ms=SHORT_MS)  # redelivered; a1 still running
    assert ledger.commit(DS, "s1", "a1", 5) is CommitOutcome.COMMITTED  # a1 finishes first
    time.sleep(EXPIRE_S)  # a2's worker dies

    assert ledger.reclaim(DS) == 1

    assert ledger.pending_ids(DS) == set()
    ledger.set_source(DS, total=1, done=True)
    assert ledger.snapshot(DS).settled is True
