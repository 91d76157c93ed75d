"""The worker's ledger scripts against real Redis, before the outcome: admit, progress and renew.

Lease expiry uses a lease of 50 ms and a sleep of 100 ms (the scripts read Redis's own clock).
"""

from __future__ import annotations

import time

import pytest
import redis

from budget import Admission, CommitOutcome, DatasetState, Ledger, Progress
from tests.support.ledger import (
    DS,
    EXPIRE_S,
    SHORT_MS,
    SPEC,
    commit_new,
    lease,
    make,
    owner,
    pending,
    progress,
)

pytestmark = pytest.mark.redis


# --- admit ------------------------------------------------------------------------------------------


def test_admit_takes_the_sample_out_of_the_queue_and_gives_the_spec_and_a_lease(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    ledger.enqueue(DS, ["s1"], window=10)

    result = ledger.admit(DS, "s1", "a1")

    assert result.admission is Admission.OK
    assert result.state == DatasetState.ACTIVE
    assert result.spec == SPEC
    assert owner(redis_client, "s1") == "a1"
    snap = ledger.snapshot(DS)
    assert (snap.queued, snap.inflight, snap.pending, snap.live_tokens) == (0, 1, 0, 0)


def test_admit_of_an_unknown_dataset_says_unknown(ledger: Ledger) -> None:
    result = ledger.admit("nope", "s1", "a1")

    assert result.admission is Admission.UNKNOWN
    assert result.spec is None


@pytest.mark.parametrize(("action", "verdict"), [("pause", Admission.PAUSED), ("revoke", Admission.REVOKED)])
def test_admit_drops_the_sample_into_pending_when_the_dataset_is_paused_or_revoked(
    ledger: Ledger, redis_client: redis.Redis, action: str, verdict: Admission
) -> None:
    make(ledger)
    ledger.enqueue(DS, ["s1"], window=10)
    ledger.set_state(DS, action)

    result = ledger.admit(DS, "s1", "a1")

    assert result.admission is verdict
    assert result.spec is None
    assert pending(redis_client) == {"s1": verdict.value}
    assert owner(redis_client, "s1") is None
    snap = ledger.snapshot(DS)
    assert (snap.queued, snap.inflight, snap.pending) == (0, 0, 1)


def test_admit_drops_the_sample_into_pending_when_the_dataset_is_exhausted(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=10)
    commit_new(ledger, "s0", 10)

    result = ledger.admit(DS, "s1", "a1")

    assert (result.admission, result.state) == (Admission.EXHAUSTED, DatasetState.EXHAUSTED)
    assert pending(redis_client) == {"s1": "exhausted"}


def test_admit_says_limit_when_live_tokens_take_the_rest_of_the_budget(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=100)
    commit_new(ledger, "s0", 10)  # mean length 10: in-flight s1 is past it, so nothing more is expected
    lease(ledger, "s1")
    progress(ledger, "s1", "a1", 79)
    lease(ledger, "s2")  # 10 + 79 < 100

    progress(ledger, "s1", "a1", 11)  # 10 + 90 = 100
    result = ledger.admit(DS, "s3", "a1")

    assert (result.admission, result.state) == (Admission.LIMIT, DatasetState.ACTIVE)
    assert pending(redis_client) == {"s3": "limit"}


def test_admit_says_limit_when_running_generations_are_expected_to_fill_the_budget(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=100)
    commit_new(ledger, "s0", 30)  # mean committed length: 30
    lease(ledger, "s1")
    progress(ledger, "s1", "a1", 5)
    lease(ledger, "s2")  # 30 committed + 5 live + 25 expected of s1 = 60 < 100

    # 30 + 5 live + (2 running x 30 - 5 live) expected = 90 < 100: one more fits
    lease(ledger, "s3")
    # 30 + 5 + (3 x 30 - 5) = 120 >= 100: a fourth would be prefilled only to be cut
    result = ledger.admit(DS, "s4", "a1")

    assert result.admission is Admission.LIMIT
    assert ledger.snapshot(DS).tokens + ledger.snapshot(DS).live_tokens < 100
    assert pending(redis_client) == {"s4": "limit"}


def test_admit_says_limit_when_committed_plus_in_flight_samples_reach_max_samples(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, max_samples=3)
    commit_new(ledger, "s1", 1)
    lease(ledger, "s2")
    lease(ledger, "s3")

    assert ledger.admit(DS, "s4", "a1").admission is Admission.LIMIT
    assert pending(redis_client) == {"s4": "limit"}

    ledger.fail(DS, "s3", "a1", "server error")  # one slot comes free
    lease(ledger, "s4")
    assert ledger.admit(DS, "s5", "a1").admission is Admission.LIMIT


def test_admit_never_lets_committed_plus_in_flight_samples_exceed_max_samples(ledger: Ledger) -> None:
    make(ledger, max_samples=5)
    admitted: list[str] = []
    ok = 0
    for i in range(40):
        sid = f"s{i}"
        if ledger.admit(DS, sid, "a").admission is Admission.OK:
            admitted.append(sid)
            ok += 1
        if i % 3 == 2 and admitted:  # now and then a generation is committed ...
            assert ledger.commit(DS, admitted.pop(0), "a", 1) is CommitOutcome.COMMITTED
        if i % 5 == 4 and admitted:  # ... or fails, which frees its slot
            ledger.fail(DS, admitted.pop(0), "a", "server error")
        snap = ledger.snapshot(DS)
        assert snap.samples + snap.inflight <= 5

    snap = ledger.snapshot(DS)
    assert snap.samples + snap.inflight + snap.failed == ok
    assert snap.failed > 0
    assert ok > 5  # failures freed slots for more


def test_admit_of_a_committed_sample_says_done_and_leaves_no_trace(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    commit_new(ledger, "s1", 5)
    ledger.pause(DS)  # even when paused: a done sample is never pending

    result = ledger.admit(DS, "s1", "a2")

    assert result.admission is Admission.DONE
    assert pending(redis_client) == {}
    assert owner(redis_client, "s1") is None
    assert ledger.done_attempts(DS) == {"s1": "s1-a1"}


def test_admit_of_a_second_delivery_says_leased_and_keeps_the_first_lease(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    lease(ledger, "s1", "a1")

    result = ledger.admit(DS, "s1", "a2")

    assert result.admission is Admission.LEASED
    assert result.spec is None
    assert owner(redis_client, "s1") == "a1"
    assert pending(redis_client) == {}
    assert ledger.snapshot(DS).inflight == 1


def test_admit_reclaims_expired_leases_before_deciding(ledger: Ledger, redis_client: redis.Redis) -> None:
    make(ledger, max_samples=1)
    lease(ledger, "s1", "dead", lease_ms=SHORT_MS)
    progress(ledger, "s1", "dead", 7, lease_ms=SHORT_MS)
    assert ledger.admit(DS, "s2", "a").admission is Admission.LIMIT
    time.sleep(EXPIRE_S)

    # the dead worker's slot is taken back, so s2 fits under max_samples now
    lease(ledger, "s2", "a")

    assert pending(redis_client)["s1"] == "lease_expired"
    snap = ledger.snapshot(DS)
    assert (snap.reclaimed, snap.wasted_tokens, snap.live_tokens, snap.inflight) == (1, 7, 0, 1)


def test_admit_of_a_pending_sample_takes_it_out_of_pending(ledger: Ledger, redis_client: redis.Redis) -> None:
    make(ledger)
    ledger.pause(DS)
    assert ledger.admit(DS, "s1", "a1").admission is Admission.PAUSED
    ledger.resume(DS)

    lease(ledger, "s1", "a2")  # a second delivery of the same task, now that the dataset runs again

    assert pending(redis_client) == {}
    snap = ledger.snapshot(DS)
    assert (snap.pending, snap.inflight) == (0, 1)


def test_a_redelivered_sample_whose_lease_expired_is_admitted_for_the_new_attempt(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    lease(ledger, "s1", "dead", lease_ms=SHORT_MS)
    time.sleep(EXPIRE_S)

    lease(ledger, "s1", "a2")

    assert owner(redis_client, "s1") == "a2"
    assert ledger.snapshot(DS).reclaimed == 1


# --- progress ---------------------------------------------------------------------------------------


def test_progress_accumulates_live_tokens_per_sample_and_for_the_dataset(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    lease(ledger, "s1")
    lease(ledger, "s2")

    for n in (5, 7, 0, 11):
        assert progress(ledger, "s1", "a1", n) is Progress.CONTINUE
    assert progress(ledger, "s2", "a1", 4) is Progress.CONTINUE

    live = redis_client.hgetall(ledger.keys_of(DS).live_hash)
    assert live == {"s1": "23", "s2": "4"}
    snap = ledger.snapshot(DS)
    assert (snap.live_tokens, snap.tokens) == (27, 0)


@pytest.mark.parametrize(
    ("on_budget", "at_budget"),
    [("truncate", Progress.STOP), ("discard", Progress.STOP), ("drain", Progress.CONTINUE)],
)
def test_progress_says_stop_at_the_budget_unless_the_policy_is_drain(
    ledger: Ledger, on_budget: str, at_budget: Progress
) -> None:
    make(ledger, token_budget=100, on_budget=on_budget)
    commit_new(ledger, "s0", 30)
    lease(ledger, "s1")
    lease(ledger, "s2")

    assert progress(ledger, "s1", "a1", 40) is Progress.CONTINUE
    assert progress(ledger, "s2", "a1", 29) is Progress.CONTINUE  # 30 + 69 = 99
    assert progress(ledger, "s2", "a1", 1) is at_budget  # 100
    assert progress(ledger, "s1", "a1", 0) is at_budget
    assert progress(ledger, "s1", "a1", 50) is at_budget
    assert ledger.snapshot(DS).live_tokens == 120


def test_progress_returns_the_datasets_state_with_the_action(ledger: Ledger) -> None:
    make(ledger, token_budget=100)
    lease(ledger, "s1")

    assert ledger.progress(DS, "s1", "a1", 1) == (Progress.CONTINUE, DatasetState.ACTIVE)
    ledger.pause(DS)  # a pause stops what runs too (issue 11): the sample goes back to pending
    assert ledger.progress(DS, "s1", "a1", 1) == (Progress.STOP, DatasetState.PAUSED)
    ledger.revoke(DS)
    assert ledger.progress(DS, "s1", "a1", 1) == (Progress.STOP, DatasetState.REVOKED)
    ledger.resume(DS)
    assert ledger.progress(DS, "s1", "a1", 97) == (Progress.STOP, DatasetState.ACTIVE)
    assert ledger.progress(DS, "s1", "nobody", 1) == (Progress.LOST, DatasetState.ACTIVE)
    assert ledger.progress("nope", "s1", "a1", 1) == (Progress.LOST, "unknown")


def test_progress_with_negative_tokens_takes_back_live_tokens(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=100)
    lease(ledger, "s1")
    assert progress(ledger, "s1", "a1", 100) is Progress.STOP

    # the HTTP call failed and is retried: its tokens are taken back and the budget has room again
    assert progress(ledger, "s1", "a1", -60) is Progress.CONTINUE

    assert redis_client.hget(ledger.keys_of(DS).live_hash, "s1") == "40"
    assert ledger.snapshot(DS).live_tokens == 40
    assert ledger.enqueue(DS, ["s2"], window=10) == [1]


def test_progress_without_a_budget_always_continues(ledger: Ledger) -> None:
    make(ledger, max_samples=1)
    lease(ledger, "s1")

    assert progress(ledger, "s1", "a1", 10**9) is Progress.CONTINUE


def test_progress_says_stop_when_the_dataset_is_revoked(ledger: Ledger) -> None:
    make(ledger, on_budget="drain")
    lease(ledger, "s1")
    assert progress(ledger, "s1", "a1", 3) is Progress.CONTINUE

    ledger.revoke(DS)

    assert progress(ledger, "s1", "a1", 3) is Progress.STOP
    assert ledger.snapshot(DS).live_tokens == 6


def test_progress_stops_a_generation_once_the_dataset_is_paused(ledger: Ledger) -> None:
    make(ledger)
    lease(ledger, "s1")
    assert progress(ledger, "s1", "a1", 3) is Progress.CONTINUE
    ledger.pause(DS)  # a pause stops what runs (issue 11); the sample goes back to pending

    assert progress(ledger, "s1", "a1", 3) is Progress.STOP


def test_progress_says_lost_after_the_lease_expired_and_was_reclaimed(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    lease(ledger, "s1", lease_ms=SHORT_MS)
    progress(ledger, "s1", "a1", 5, lease_ms=SHORT_MS)
    time.sleep(EXPIRE_S)
    lease(ledger, "other")  # any admit reclaims expired leases

    assert progress(ledger, "s1", "a1", 5) is Progress.LOST

    assert redis_client.hget(ledger.keys_of(DS).live_hash, "s1") is None
    snap = ledger.snapshot(DS)
    assert (snap.live_tokens, snap.wasted_tokens, snap.reclaimed) == (0, 5, 1)


def test_progress_says_lost_to_the_old_attempt_once_a_new_one_holds_the_lease(ledger: Ledger) -> None:
    make(ledger)
    lease(ledger, "s1", "old", lease_ms=SHORT_MS)
    time.sleep(EXPIRE_S)
    lease(ledger, "s1", "new")

    assert progress(ledger, "s1", "old", 5) is Progress.LOST
    assert progress(ledger, "s1", "new", 5) is Progress.CONTINUE
    assert ledger.snapshot(DS).live_tokens == 5


def test_progress_says_lost_to_an_attempt_that_never_held_the_lease(ledger: Ledger) -> None:
    make(ledger)

    assert progress(ledger, "s1", "a1", 5) is Progress.LOST
    assert ledger.snapshot(DS).live_tokens == 0


def test_progress_renews_the_lease(ledger: Ledger) -> None:
    make(ledger)
    lease(ledger, "s1", lease_ms=SHORT_MS)

    progress(ledger, "s1", "a1", 1, lease_ms=60_000)
    time.sleep(EXPIRE_S)

    assert ledger.reclaim(DS) == 0
    assert ledger.snapshot(DS).inflight == 1


def test_progress_after_expiry_but_before_any_reclaim_keeps_the_lease(ledger: Ledger) -> None:
    # progress.lua says lost only once the lease was reclaimed; until then the owner renews it
    make(ledger)
    lease(ledger, "s1", lease_ms=SHORT_MS)
    time.sleep(EXPIRE_S)

    assert progress(ledger, "s1", "a1", 2, lease_ms=60_000) is Progress.CONTINUE
    assert ledger.reclaim(DS) == 0
    assert ledger.snapshot(DS).inflight == 1


# --- renew ------------------------------------------------------------------------------------------


def test_renew_keeps_a_lease_alive_past_its_first_expiry(ledger: Ledger) -> None:
    make(ledger)
    lease(ledger, "s1", lease_ms=SHORT_MS)

    assert ledger.renew(DS, "s1", "a1", lease_ms=60_000) is True
    time.sleep(EXPIRE_S)

    assert ledger.reclaim(DS) == 0
    assert ledger.admit(DS, "s1", "a2").admission is Admission.LEASED
    assert progress(ledger, "s1", "a1", 1) is Progress.CONTINUE


def test_renew_fails_for_an_attempt_that_does_not_hold_the_lease(ledger: Ledger) -> None:
    make(ledger)
    lease(ledger, "s1", "a1", lease_ms=SHORT_MS)
    assert ledger.renew(DS, "s1", "a2") is False

    time.sleep(EXPIRE_S)
    assert ledger.reclaim(DS) == 1

    assert ledger.renew(DS, "s1", "a1") is False
    assert ledger.snapshot(DS).inflight == 0
