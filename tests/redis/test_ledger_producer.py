"""The producer's ledger scripts against real Redis: enqueue and unqueue."""

from __future__ import annotations

import pytest
import redis

from budget import Admission, DatasetState, Ledger
from budget.ledger import (
    ENQUEUE_BUDGET_IN_FLIGHT,
    ENQUEUE_CHUNK,
    ENQUEUE_NOT_ACTIVE,
    ENQUEUE_PUBLISH,
    ENQUEUE_SKIP,
    ENQUEUE_WINDOW_FULL,
)
from tests.redis.grants import set_clock
from tests.support.ledger import DS, MAX_NEW, commit_new, lease, make, queued, report_live

pytestmark = pytest.mark.redis

PUB, SKIP, FULL = ENQUEUE_PUBLISH, ENQUEUE_SKIP, ENQUEUE_WINDOW_FULL

# --- enqueue ----------------------------------------------------------------------------------------


def test_enqueue_publishes_every_new_sample_within_the_window(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)

    assert ledger.enqueue(DS, ["s1", "s2", "s3"], window=10) == [PUB, PUB, PUB]
    assert queued(redis_client) == {"s1", "s2", "s3"}
    assert ledger.snapshot(DS).queued == 3


def test_enqueue_stops_with_window_full_when_the_window_is_reached(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)

    assert ledger.enqueue(DS, ["s1", "s2", "s3", "s4", "s5"], window=3) == [PUB, PUB, PUB, FULL]
    assert queued(redis_client) == {"s1", "s2", "s3"}

    # the window counts what is already queued: the queued ones are skipped, the next new one waits
    assert ledger.enqueue(DS, ["s1", "s2", "s3", "s4"], window=3) == [SKIP, SKIP, SKIP, FULL]
    assert ledger.enqueue(DS, ["s4"], window=4) == [PUB]


def test_enqueue_has_room_again_once_workers_take_queued_samples(ledger: Ledger) -> None:
    make(ledger)
    assert ledger.enqueue(DS, ["s1", "s2"], window=2) == [PUB, PUB]
    assert ledger.enqueue(DS, ["s3"], window=2) == [FULL]

    assert ledger.admit(DS, "s1", "a").admission is Admission.OK

    assert ledger.enqueue(DS, ["s3", "s4"], window=2) == [PUB, FULL]


def test_enqueue_never_publishes_beyond_max_samples(ledger: Ledger) -> None:
    make(ledger, max_samples=4)
    commit_new(ledger, "done1", 5)  # 1 committed
    assert ledger.admit(DS, "flying", "a").admission is Admission.OK  # 1 in flight
    assert ledger.enqueue(DS, ["q1"], window=100) == [PUB]  # 1 queued

    # 4 - 1 committed - 1 in flight - 1 queued = room for one more, whatever the window
    assert ledger.enqueue(DS, ["n1", "n2", "n3"], window=100) == [PUB, FULL]
    assert ledger.snapshot(DS).queued == 2
    assert ledger.enqueue(DS, ["n2"], window=100) == [FULL]


def test_enqueue_skips_done_failed_queued_and_leased_samples(ledger: Ledger) -> None:
    make(ledger)
    commit_new(ledger, "done", 3)
    ledger.fail(DS, "failed", "x", "server said 400")
    assert ledger.enqueue(DS, ["queued"], window=10) == [PUB]
    assert ledger.admit(DS, "leased", "a").admission is Admission.OK

    codes = ledger.enqueue(DS, ["done", "failed", "queued", "leased", "new"], window=10)

    assert codes == [SKIP, SKIP, SKIP, SKIP, PUB]
    assert ledger.snapshot(DS).queued == 2


def test_enqueue_skips_a_sample_listed_twice_in_one_call(ledger: Ledger) -> None:
    make(ledger)

    assert ledger.enqueue(DS, ["s1", "s1", "s2"], window=10) == [PUB, SKIP, PUB]


def test_enqueue_reports_skips_before_window_full(ledger: Ledger) -> None:
    make(ledger)
    commit_new(ledger, "done", 3)

    assert ledger.enqueue(DS, ["s1", "done", "s2"], window=1) == [PUB, SKIP, FULL]


def test_enqueue_takes_a_pending_sample_out_of_pending(ledger: Ledger) -> None:
    make(ledger)
    ledger.pause(DS)
    assert ledger.admit(DS, "s1", "a").admission is Admission.PAUSED
    assert ledger.pending_ids(DS) == {"s1"}
    ledger.resume(DS)

    assert ledger.enqueue(DS, ["s1"], window=10) == [PUB]

    assert ledger.pending_ids(DS) == set()
    snap = ledger.snapshot(DS)
    assert (snap.queued, snap.pending) == (1, 0)


@pytest.mark.parametrize("stop", ["pause", "revoke"])
def test_enqueue_returns_not_active_for_a_paused_or_revoked_dataset(
    ledger: Ledger, redis_client: redis.Redis, stop: str
) -> None:
    make(ledger)
    ledger.set_state(DS, stop)

    assert ledger.enqueue(DS, ["s1", "s2"], window=10) == [ENQUEUE_NOT_ACTIVE]
    assert queued(redis_client) == set()


def test_enqueue_returns_not_active_for_an_exhausted_dataset(ledger: Ledger) -> None:
    make(ledger, max_samples=1)
    commit_new(ledger, "s1", 2)
    assert ledger.snapshot(DS).state == DatasetState.EXHAUSTED

    assert ledger.enqueue(DS, ["s2"], window=10) == [ENQUEUE_NOT_ACTIVE]


def test_enqueue_returns_budget_in_flight_where_admit_would_say_limit_with_the_budget_granted(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=100)
    commit_new(ledger, "c", 10)
    assert [lease(ledger, sid, want=30) for sid in ("s1", "s2", "s3")] == [30, 30, 30]
    assert ledger.admit(DS, "s4", "a1").admission is Admission.LIMIT  # nothing left to grant

    # a sample published now would only be turned away by admit and published again, and again
    assert ledger.enqueue(DS, ["s5"], window=10) == [ENQUEUE_BUDGET_IN_FLIGHT]


def test_enqueue_under_truncate_is_not_blocked_by_live_tokens(ledger: Ledger) -> None:
    make(ledger, token_budget=100)
    assert lease(ledger, "s1", want=50) == 50
    report_live(ledger, "s1", "a1", 50)  # status only: its 50 are reserved already

    assert ledger.enqueue(DS, ["s2"], window=10) == [PUB]


def test_enqueue_under_discard_returns_budget_in_flight_once_the_answers_expected_in_flight_no_longer_fit(
    ledger: Ledger,
) -> None:
    make(ledger, token_budget=1000, on_budget="discard")
    commit_new(ledger, "c", 250)  # the mean committed length: 250
    assert lease(ledger, "l", "a") == 0  # discard reserves nothing
    # one answer committed: one in flight is expected to need its length (250), each past it
    # max_new_tokens (64): 250 + 250 + 64 <= 1000
    assert ledger.enqueue(DS, ["s1"], window=10) == [PUB]
    assert lease(ledger, "s1", "a") == 0
    # 250 + 250 + 2 x 64 <= 1000: one more fits
    assert ledger.enqueue(DS, ["s2"], window=10) == [PUB]

    # what runs has produced more than expected of it: 250 + 751 > 1000, though the pool has room
    report_live(ledger, "l", "a", 751)

    assert ledger.enqueue(DS, ["s3"], window=10) == [ENQUEUE_BUDGET_IN_FLIGHT]
    assert ledger.admit(DS, "s2", "a").admission is Admission.LIMIT
    assert ledger.snapshot(DS).state == DatasetState.ACTIVE


@pytest.mark.parametrize(
    ("policy", "fits"),
    [
        # discard counts the one it starts: 20 for each of the first 10 in flight, max_new_tokens (64)
        # for each past that: 200 + 10 x 20 + 9 x 64 = 976 <= 1000 < 200 + 200 + 10 x 64
        ("discard", 19),
        # drain admits the next one while those before it are expected to fit (it may pass the budget):
        # with 19 before it 200 + 200 + 9 x 64 = 976 < 1000, so a 20th; with 20, 200 + 200 + 640 >= 1000
        ("drain", 20),
    ],
)
def test_enqueue_under_discard_or_drain_publishes_no_more_than_admission_will_take_counting_the_queued_ones(
    ledger: Ledger, policy: str, fits: int
) -> None:
    make(ledger, token_budget=1000, on_budget=policy)
    for i in range(10):
        commit_new(ledger, f"c{i}", 20)  # 200 spent; ten answers of 20 committed
    sids = [f"s{i}" for i in range(30)]

    # the window (100) is not the limit: the budget's room is
    assert ledger.enqueue(DS, sids, window=100) == [PUB] * fits + [FULL]
    assert ledger.enqueue(DS, sids[fits:], window=100) == [ENQUEUE_BUDGET_IN_FLIGHT]

    # every sample published is admitted: none is turned away to wait as pending
    assert [ledger.admit(DS, sid, "a").admission for sid in sids[:fits]] == [Admission.OK] * fits
    assert ledger.snapshot(DS).pending == 0


def test_ids_past_a_chunk_that_filled_the_budgets_room_come_back_as_waiting_not_silently_dropped(
    ledger: Ledger,
) -> None:
    # nothing committed: each answer in flight is expected to need max_new_tokens, so the budget lets
    # exactly one chunk through; the next chunk's call finds no room
    make(ledger, token_budget=ENQUEUE_CHUNK * MAX_NEW, on_budget="discard")
    sids = [f"s{i}" for i in range(ENQUEUE_CHUNK + 10)]

    codes = ledger.enqueue(DS, sids, window=10 * ENQUEUE_CHUNK)

    # the feeder puts back every id from the last code on (as at a full window): none is left unread
    assert codes == [PUB] * ENQUEUE_CHUNK + [FULL]
    assert ledger.snapshot(DS).queued == ENQUEUE_CHUNK


def test_enqueue_under_drain_counts_committed_live_and_expected_tokens_against_the_budget(
    ledger: Ledger,
) -> None:
    make(ledger, token_budget=100, on_budget="drain")
    commit_new(ledger, "c", 1)  # a short mean, so the in-flight sample is expected to add nothing
    assert lease(ledger, "l", "a") == 0
    report_live(ledger, "l", "a", 98)
    assert ledger.enqueue(DS, ["s1"], window=10) == [PUB]

    report_live(ledger, "l", "a", 99)  # 1 + 99 = 100

    assert ledger.enqueue(DS, ["s2"], window=10) == [ENQUEUE_BUDGET_IN_FLIGHT]


def test_enqueue_publishes_again_once_a_grant_is_given_back(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=16)
    assert lease(ledger, "s1", "a") == 16  # the whole budget: none runs, so what is left
    set_clock(redis_client, "s1", 100, 100.0)  # it has used 10 of it: 6 left to generate, all its own
    assert ledger.enqueue(DS, ["s2"], window=10) == [ENQUEUE_BUDGET_IN_FLIGHT]

    ledger.release(DS, "s1", "a", "worker shutdown", thrown_away_tokens=40)

    assert ledger.enqueue(DS, ["s2"], window=10) == [PUB]


# --- unqueue ----------------------------------------------------------------------------------------


def test_unqueue_takes_samples_out_of_the_queue_and_makes_them_pending_with_the_reason(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    assert ledger.enqueue(DS, ["s1", "s2", "s3"], window=10) == [PUB, PUB, PUB]

    assert ledger.unqueue(DS, ["s1", "s2"], "publish failed") == 2

    assert queued(redis_client) == {"s3"}
    assert redis_client.hgetall(ledger.keys_of(DS).pending_hash) == {
        "s1": "publish failed",
        "s2": "publish failed",
    }
    snap = ledger.snapshot(DS)
    assert (snap.queued, snap.pending) == (1, 2)


def test_an_unqueued_sample_can_be_enqueued_again(ledger: Ledger) -> None:
    make(ledger)
    ledger.enqueue(DS, ["s1"], window=10)
    ledger.unqueue(DS, ["s1"], "publish failed")

    assert ledger.enqueue(DS, ["s1"], window=10) == [PUB]
    assert ledger.pending_ids(DS) == set()


def test_unqueue_counts_only_samples_that_were_queued(ledger: Ledger) -> None:
    make(ledger)
    ledger.enqueue(DS, ["s1"], window=10)

    assert ledger.unqueue(DS, ["s1", "never-queued"], "publish failed") == 1


def test_unqueue_does_not_make_a_sample_that_left_the_queue_pending(ledger: Ledger) -> None:
    # The publish looked failed to the producer (a timeout) but the task was delivered and committed.
    make(ledger)
    ledger.enqueue(DS, ["s1"], window=10)
    commit_new(ledger, "s1", 5)
    ledger.set_source(DS, total=1, done=True)

    assert ledger.unqueue(DS, ["s1"], "publish timed out") == 0

    assert ledger.pending_ids(DS) == set()
    assert ledger.snapshot(DS).settled is True
