"""The worker's ledger scripts against real Redis, before the outcome: admit, progress and renew.

Lease expiry uses a lease of 50 ms and a sleep of 100 ms (the scripts read Redis's own clock).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from budget import Admission, CommitOutcome, DatasetState, Ledger, Progress
from budget.ledger import GRANT_AT_SEND, STOP_BUDGET, STOP_MAX_SAMPLES
from tests.support.ledger import (
    DS,
    MAX_NEW,
    SHORT_MS,
    SPEC,
    commit_new,
    expire_short_leases,
    keys,
    lease,
    make,
    owner,
    pending,
    progress,
    report_live,
    reservations,
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
    report_live(ledger, "s1", "dead", 7, lease_ms=SHORT_MS)
    assert ledger.admit(DS, "s2", "a").admission is Admission.LIMIT
    expire_short_leases(ledger.client)

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
    expire_short_leases(ledger.client)

    lease(ledger, "s1", "a2")

    assert owner(redis_client, "s1") == "a2"
    assert ledger.snapshot(DS).reclaimed == 1


# --- admit under a token budget: reservations ---------------------------------------------------------


def test_admit_under_truncate_defers_the_grant_and_says_limit_once_no_new_generation_could_start(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=100)
    assert [lease(ledger, f"s{i}", slots=2) for i in (1, 2)] == [50, 50]  # all of it, to the horizon

    # the two running will give back what they do not use: a third may be admitted, its grant comes later
    third = ledger.admit(DS, "s3", "a1")
    assert (third.admission, third.cap) == (Admission.OK, GRANT_AT_SEND)

    # they have used 45 each (0.45 s at 100 tokens/s): 10 left to generate, for two
    seconds, micros = redis_client.time()
    now = int(seconds) * 1000 + int(micros) // 1000
    k = keys()
    redis_client.hset(k.clock_hash, mapping={"s1": now - 450, "s2": now - 450})
    redis_client.hset(k.ledger_hash, mapping={"clock_sum": 2 * (now - 450), "gen_rate": 100})
    fourth = ledger.admit(DS, "s4", "a1")

    assert (fourth.admission, fourth.cap, fourth.state) == (Admission.LIMIT, 0, DatasetState.ACTIVE)
    assert reservations(redis_client) == {"s1": 50, "s2": 50}
    assert pending(redis_client) == {"s4": "limit"}


def test_a_start_under_truncate_grants_what_is_wanted_when_it_fits(ledger: Ledger) -> None:
    make(ledger, token_budget=1000)

    # a conversation that regenerates three replies may want three times max_new_tokens
    assert lease(ledger, "s1", want=3 * MAX_NEW, slots=2) == 3 * MAX_NEW
    assert lease(ledger, "s2", want=5, slots=2) == 5

    assert ledger.snapshot(DS).reserved_tokens == 3 * MAX_NEW + 5


def test_admit_under_discard_says_limit_once_committed_live_and_the_expected_length_in_flight_pass_the_budget(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=150, on_budget="discard")

    # nothing committed yet: a generation is expected to be max_new_tokens (64) long
    assert lease(ledger, "s1") == 0  # 1 x 64 <= 150; discard reserves nothing
    assert lease(ledger, "s2") == 0  # 2 x 64 <= 150
    # 3 x 64 = 192 > 150: a third is expected to pass the budget
    third = ledger.admit(DS, "s3", "a1", want=5)
    assert (third.admission, third.cap) == (Admission.LIMIT, 0)

    assert reservations(redis_client) == {}
    assert pending(redis_client) == {"s3": "limit"}
    assert ledger.snapshot(DS).reserved_tokens == 0


def test_admit_without_a_token_budget_reserves_nothing(ledger: Ledger, redis_client: redis.Redis) -> None:
    make(ledger, max_samples=10)

    assert lease(ledger, "s1") == 0
    assert lease(ledger, "s2", want=10**6) == 0

    assert reservations(redis_client) == {}
    assert ledger.snapshot(DS).reserved_tokens == 0


def test_discard_expects_the_max_new_tokens_register_stored_before_any_answer_is_committed(
    ledger: Ledger,
) -> None:
    spec = {"servers": ["s"], "sampling": {"max_new_tokens": 300}}
    make(ledger, token_budget=700, on_budget="discard", spec=spec)

    # nothing committed: each generation in flight is expected to be 300 long; 2 x 300 <= 700 < 3 x 300
    assert [ledger.admit(DS, f"s{i}", "a1").admission for i in range(3)] == [
        Admission.OK,
        Admission.OK,
        Admission.LIMIT,
    ]


def test_live_tokens_take_no_part_in_the_grant(ledger: Ledger) -> None:
    make(ledger, token_budget=306)
    assert lease(ledger, "s1", want=50) == 50
    assert report_live(ledger, "s1", "a1", 50)  # status only: the 50 are already reserved

    # 256 left whatever is live: a 1/2 share per generation (2) holds the whole 64
    assert lease(ledger, "s2") == MAX_NEW
    assert ledger.snapshot(DS).live_tokens == 50


def test_admit_under_drain_reserves_nothing_and_says_limit_when_running_ones_are_expected_to_fill_it(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=170, on_budget="drain")
    for sid in ("s0a", "s0b", "s0c"):
        commit_new(ledger, sid, 30)  # 90 committed, mean length 30, three answers to trust it for
    assert lease(ledger, "s1") == 0
    report_live(ledger, "s1", "a1", 5)
    assert lease(ledger, "s2") == 0  # 90 committed + max(5 live, 30 expected of s1) = 120 < 170

    # 90 + 2 running x 30 = 150 < 170: one more fits
    assert lease(ledger, "s3") == 0
    # 90 + 3 x 30 = 180 >= 170: a fourth would pass the budget on average
    result = ledger.admit(DS, "s4", "a1")

    assert (result.admission, result.cap) == (Admission.LIMIT, 0)
    assert pending(redis_client) == {"s4": "limit"}
    assert reservations(redis_client) == {}
    assert ledger.snapshot(DS).reserved_tokens == 0


def test_drain_expects_max_new_tokens_of_each_answer_in_flight_beyond_those_committed(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=200, on_budget="drain")
    # nothing committed: each answer in flight may run to max_new_tokens (64); 4 x 64 = 256 >= 200
    for sid in ("s1", "s2", "s3", "s4"):
        assert lease(ledger, sid) == 0
    assert ledger.admit(DS, "s5", "a1").admission is Admission.LIMIT

    # one answer committed (20 tokens) is trusted for one answer in flight: 20 + 20 + 2 x 64 = 168 < 200
    assert ledger.commit(DS, "s1", "a1", 20) is CommitOutcome.COMMITTED
    assert lease(ledger, "s5") == 0
    # with s5 running, 20 + 20 + 3 x 64 = 232 >= 200
    assert ledger.admit(DS, "s6", "a1").admission is Admission.LIMIT
    assert pending(redis_client) == {"s6": "limit"}


def test_admit_under_drain_says_limit_when_live_tokens_take_the_rest_of_the_budget(ledger: Ledger) -> None:
    make(ledger, token_budget=100, on_budget="drain")
    commit_new(ledger, "s0", 10)  # mean length 10: in-flight s1 is past it, so nothing more is expected
    lease(ledger, "s1")
    report_live(ledger, "s1", "a1", 79)
    lease(ledger, "s2")  # 10 + 79 < 100

    report_live(ledger, "s1", "a1", 90)  # 10 + 90 = 100

    assert ledger.admit(DS, "s3", "a1").admission is Admission.LIMIT


def test_a_group_admit_under_drain_applies_the_expected_rule_to_each_sample_in_turn(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=170, on_budget="drain")
    for sid in ("s0a", "s0b", "s0c"):
        commit_new(ledger, sid, 30)  # 90 committed, mean 30: 90 + 0, + 30, + 60 fit; 90 + 90 does not

    group = ledger.admit_many(DS, [(f"g{i}", "a", 0) for i in range(4)])

    assert group.results == [(Admission.OK, 0)] * 3 + [(Admission.LIMIT, 0)]
    assert pending(redis_client) == {"g3": "limit"}
    assert ledger.snapshot(DS).inflight == 3


# --- admit_many: a group in one call ----------------------------------------------------------------


def test_admit_many_gives_each_sample_its_own_verdict_and_cap_in_one_call(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=120)
    commit_new(ledger, "done", 10)
    ledger.fail(DS, "failed", "x", "HTTP 400")
    assert lease(ledger, "held", "other", want=20, slots=2) == 20

    group = ledger.admit_many(
        DS,
        [
            ("s1", "a1", 0),
            ("done", "a1", 0),
            ("s1", "a2", 0),  # the same sample twice in one group: the second is a duplicate delivery
            ("failed", "a1", 0),
            ("held", "a1", 0),
            ("s2", "a1", 10),
            ("s3", "a1", 0),
            ("s4", "a1", 0),
        ],
    )

    assert group.state == DatasetState.ACTIVE
    assert group.spec == SPEC
    # truncate: each admitted one is granted once it has a server slot
    assert group.results == [
        (Admission.OK, GRANT_AT_SEND),
        (Admission.DONE, 0),
        (Admission.LEASED, 0),
        (Admission.FAILED, 0),
        (Admission.LEASED, 0),
        (Admission.OK, GRANT_AT_SEND),
        (Admission.OK, GRANT_AT_SEND),
        (Admission.OK, GRANT_AT_SEND),
    ]
    assert (owner(redis_client, "s1"), owner(redis_client, "held")) == ("a1", "other")
    assert reservations(redis_client) == {"held": 20}
    assert pending(redis_client) == {}
    snap = ledger.snapshot(DS)
    assert (snap.reserved_tokens, snap.inflight, snap.pending) == (20, 5, 0)


def test_admit_many_takes_every_sample_of_the_group_out_of_the_queue(ledger: Ledger) -> None:
    make(ledger)
    ledger.enqueue(DS, ["s1", "s2", "s3"], window=10)

    ledger.admit_many(DS, [("s1", "a", 0), ("s2", "a", 0)])

    snap = ledger.snapshot(DS)
    assert (snap.queued, snap.inflight) == (1, 2)


def test_admit_many_counts_the_groups_own_admissions_against_max_samples(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, max_samples=3)
    commit_new(ledger, "s0", 1)

    group = ledger.admit_many(DS, [(f"s{i}", "a", 0) for i in range(1, 5)])

    assert [admission for admission, _ in group.results] == [
        Admission.OK,
        Admission.OK,
        Admission.LIMIT,
        Admission.LIMIT,
    ]
    assert pending(redis_client) == {"s3": "limit", "s4": "limit"}
    snap = ledger.snapshot(DS)
    assert snap.samples + snap.inflight == 3


@pytest.mark.parametrize(("action", "verdict"), [("pause", Admission.PAUSED), ("revoke", Admission.REVOKED)])
def test_admit_many_of_a_stopped_dataset_drops_the_whole_group_into_pending_without_the_spec(
    ledger: Ledger, redis_client: redis.Redis, action: str, verdict: Admission
) -> None:
    make(ledger, token_budget=1000)
    ledger.set_state(DS, action)

    group = ledger.admit_many(DS, [("s1", "a", 0), ("s2", "a", 0)])

    assert group.results == [(verdict, 0), (verdict, 0)]
    assert group.spec is None
    assert pending(redis_client) == {"s1": verdict.value, "s2": verdict.value}
    assert ledger.snapshot(DS).reserved_tokens == 0


def test_admit_many_of_an_unknown_dataset_says_unknown_for_each_sample(ledger: Ledger) -> None:
    group = ledger.admit_many("nope", [("s1", "a", 0), ("s2", "a", 0)])

    assert group.state == "unknown"
    assert group.results == [(Admission.UNKNOWN, 0), (Admission.UNKNOWN, 0)]
    assert group.spec is None


# --- progress ---------------------------------------------------------------------------------------


def test_progress_continues_while_the_dataset_runs_and_the_budget_is_not_overdrawn(ledger: Ledger) -> None:
    make(ledger, token_budget=100)
    assert [lease(ledger, f"s{i}", slots=2) for i in range(1, 3)] == [50, 50]

    # the whole budget is granted, and that is no reason to stop
    for i in range(1, 3):
        assert progress(ledger, f"s{i}", "a1") is Progress.CONTINUE
    assert ledger.snapshot(DS).reserved_tokens == 100


@pytest.mark.parametrize(
    ("on_budget", "lowered"),
    [("truncate", Progress.STOP), ("drain", Progress.CONTINUE)],
)
def test_progress_says_stop_once_the_budget_is_lowered_below_committed_plus_reserved_unless_drain(
    ledger: Ledger, on_budget: str, lowered: Progress
) -> None:
    make(ledger, token_budget=200, on_budget=on_budget)
    commit_new(ledger, "s0", 30)
    lease(ledger, "s1", want=50)
    reserved = ledger.snapshot(DS).reserved_tokens  # 50 (0 under drain)

    ledger.set_limits(DS, token_budget=30 + reserved)  # exactly what is committed and reserved
    assert progress(ledger, "s1", "a1") is Progress.CONTINUE
    assert ledger.stop_reasons([DS]) == {DS: ""}

    ledger.set_limits(DS, token_budget=30 + reserved - 1)

    assert progress(ledger, "s1", "a1") is lowered
    assert ledger.stop_reasons([DS]) == {DS: "budget" if lowered is Progress.STOP else ""}


def test_progress_says_stop_under_discard_once_what_is_spent_reaches_the_budget_lowered_or_not(
    ledger: Ledger,
) -> None:
    make(ledger, token_budget=200, on_budget="discard")
    commit_new(ledger, "s0", 30)
    lease(ledger, "s1", want=50)
    assert ledger.snapshot(DS).reserved_tokens == 0  # discard reserves nothing

    ledger.set_limits(DS, token_budget=31)  # one token left: what runs may still be kept
    assert progress(ledger, "s1", "a1") is Progress.CONTINUE
    assert ledger.stop_reasons([DS]) == {DS: ""}

    ledger.set_limits(DS, token_budget=30)  # reached: an answer still running could only pass it

    assert progress(ledger, "s1", "a1") is Progress.STOP
    assert ledger.stop_reasons([DS]) == {DS: "budget"}


def test_a_sample_cap_lowered_to_what_is_committed_stops_what_runs_and_gives_it_back_as_max_samples(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, max_samples=10)
    commit_new(ledger, "s0", 30)
    lease(ledger, "s1")
    lease(ledger, "s2")
    assert progress(ledger, "s1", "a1") is Progress.CONTINUE

    ledger.set_limits(DS, token_budget=None, max_samples=2)  # room for one of the two running: both go on
    assert ledger.progress(DS, "s1", "a1") == (Progress.CONTINUE, DatasetState.ACTIVE)
    assert ledger.stop_reasons([DS]) == {DS: ""}

    assert ledger.commit(DS, "s1", "a1", 40) is CommitOutcome.COMMITTED  # the cap: s2 can no longer be kept
    assert ledger.progress(DS, "s2", "a1") == (Progress.STOP, STOP_MAX_SAMPLES)
    assert ledger.stop_reasons([DS]) == {DS: STOP_MAX_SAMPLES}

    ledger.release(DS, "s2", "a1", STOP_MAX_SAMPLES, 25)  # what the worker does with it
    snap = ledger.snapshot(DS)
    assert (snap.state, snap.samples, snap.inflight, snap.pending) == (DatasetState.EXHAUSTED, 2, 0, 1)
    assert pending(redis_client) == {"s2": STOP_MAX_SAMPLES}  # dropped by the cap, not lost
    assert snap.wasted_tokens == 25


def test_a_commit_past_a_sample_cap_lowered_live_leaves_the_sample_pending_as_max_samples(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, max_samples=10)
    lease(ledger, "s1")
    lease(ledger, "s2")
    ledger.set_limits(DS, token_budget=None, max_samples=1)
    assert ledger.commit(DS, "s1", "a1", 40) is CommitOutcome.COMMITTED

    assert ledger.commit(DS, "s2", "a1", 40) is CommitOutcome.OVER_LIMIT  # ended before its stop landed

    snap = ledger.snapshot(DS)
    assert (snap.samples, snap.inflight, snap.pending) == (1, 0, 1)
    assert pending(redis_client) == {"s2": STOP_MAX_SAMPLES}  # before: in no category at all


def test_the_commit_that_reaches_a_sample_cap_announces_the_stop_only_while_others_run(
    ledger: Ledger,
) -> None:
    make(ledger, "alone", max_samples=1)
    make(ledger, max_samples=10)
    lease(ledger, "s0", name="alone")
    for sid in ("s1", "s2", "s3"):
        lease(ledger, sid)
    stops = ledger.subscribe_stops()
    try:
        # reached with nothing else running (admission keeps to the cap): nothing to stop, no message
        assert ledger.commit("alone", "s0", "a1", 10) is CommitOutcome.COMMITTED
        ledger.set_limits(DS, token_budget=None, max_samples=2)
        drain_messages(stops)  # set_limits announces on its own
        assert ledger.commit(DS, "s1", "a1", 10) is CommitOutcome.COMMITTED  # 1 of 2: not yet
        assert ledger.commit(DS, "s2", "a1", 10) is CommitOutcome.COMMITTED  # 2 of 2, s3 runs
        assert drain_messages(stops) == [DS]
    finally:
        stops.close()


def drain_messages(stops: Any) -> list[str]:
    """The stop messages received within the next half second."""
    messages = []
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        message = stops.get_message(timeout=0.1)
        if message is not None:
            messages.append(message["data"])
    return messages


def test_progress_ignores_live_tokens_past_the_budget(ledger: Ledger) -> None:
    make(ledger, token_budget=100)
    lease(ledger, "s1", want=40)
    report_live(ledger, "s1", "a1", 500)  # a report, not a reservation: the budget is kept by the cap

    assert progress(ledger, "s1", "a1") is Progress.CONTINUE
    assert ledger.stop_reasons([DS]) == {DS: ""}


def test_progress_returns_the_datasets_state_with_the_action(ledger: Ledger) -> None:
    make(ledger, token_budget=100)
    lease(ledger, "s1", want=50)

    assert ledger.progress(DS, "s1", "a1") == (Progress.CONTINUE, DatasetState.ACTIVE)
    ledger.pause(DS)  # a pause stops what runs too (issue 11): the sample goes back to pending
    assert ledger.progress(DS, "s1", "a1") == (Progress.STOP, DatasetState.PAUSED)
    ledger.revoke(DS)
    assert ledger.progress(DS, "s1", "a1") == (Progress.STOP, DatasetState.REVOKED)
    ledger.resume(DS)
    ledger.set_limits(DS, token_budget=40)
    assert ledger.progress(DS, "s1", "a1") == (Progress.STOP, STOP_BUDGET)
    assert ledger.progress(DS, "s1", "nobody") == (Progress.LOST, DatasetState.ACTIVE)
    assert ledger.progress("nope", "s1", "a1") == (Progress.LOST, "unknown")


def test_progress_without_a_budget_always_continues(ledger: Ledger) -> None:
    make(ledger, max_samples=1)
    lease(ledger, "s1")
    report_live(ledger, "s1", "a1", 10**9)

    assert progress(ledger, "s1", "a1") is Progress.CONTINUE


def test_progress_says_stop_when_the_dataset_is_revoked(ledger: Ledger) -> None:
    make(ledger, on_budget="drain")
    lease(ledger, "s1")
    assert progress(ledger, "s1", "a1") is Progress.CONTINUE

    ledger.revoke(DS)

    assert progress(ledger, "s1", "a1") is Progress.STOP


def test_progress_stops_a_generation_once_the_dataset_is_paused(ledger: Ledger) -> None:
    make(ledger)
    lease(ledger, "s1")
    assert progress(ledger, "s1", "a1") is Progress.CONTINUE
    ledger.pause(DS)  # a pause stops what runs (issue 11); the sample goes back to pending

    assert progress(ledger, "s1", "a1") is Progress.STOP


def test_progress_says_lost_after_the_lease_expired_and_was_reclaimed(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    lease(ledger, "s1", lease_ms=SHORT_MS)
    report_live(ledger, "s1", "a1", 5, lease_ms=SHORT_MS)
    expire_short_leases(ledger.client)
    lease(ledger, "other")  # any admit reclaims expired leases

    assert progress(ledger, "s1", "a1") is Progress.LOST

    assert redis_client.hget(ledger.keys_of(DS).live_hash, "s1") is None
    snap = ledger.snapshot(DS)
    assert (snap.live_tokens, snap.wasted_tokens, snap.reclaimed) == (0, 5, 1)


def test_progress_says_lost_to_the_old_attempt_once_a_new_one_holds_the_lease(ledger: Ledger) -> None:
    make(ledger)
    lease(ledger, "s1", "old", lease_ms=SHORT_MS)
    expire_short_leases(ledger.client)
    lease(ledger, "s1", "new")

    assert progress(ledger, "s1", "old") is Progress.LOST
    assert progress(ledger, "s1", "new") is Progress.CONTINUE


def test_progress_says_lost_to_an_attempt_that_never_held_the_lease(ledger: Ledger) -> None:
    make(ledger)

    assert progress(ledger, "s1", "a1") is Progress.LOST
    assert ledger.snapshot(DS).inflight == 0


def test_progress_renews_the_lease(ledger: Ledger) -> None:
    make(ledger)
    lease(ledger, "s1", lease_ms=SHORT_MS)

    progress(ledger, "s1", "a1", lease_ms=60_000)
    expire_short_leases(ledger.client)

    assert ledger.reclaim(DS) == 0
    assert ledger.snapshot(DS).inflight == 1


def test_progress_after_expiry_but_before_any_reclaim_keeps_the_lease(ledger: Ledger) -> None:
    # progress.lua says lost only once the lease was reclaimed; until then the owner renews it
    make(ledger)
    lease(ledger, "s1", lease_ms=SHORT_MS)
    expire_short_leases(ledger.client)

    assert progress(ledger, "s1", "a1", lease_ms=60_000) is Progress.CONTINUE
    assert ledger.reclaim(DS) == 0
    assert ledger.snapshot(DS).inflight == 1


# --- renew ------------------------------------------------------------------------------------------


def test_renew_keeps_a_lease_alive_past_its_first_expiry(ledger: Ledger) -> None:
    make(ledger)
    lease(ledger, "s1", lease_ms=SHORT_MS)

    assert ledger.renew(DS, "s1", "a1", lease_ms=60_000) is True
    expire_short_leases(ledger.client)

    assert ledger.reclaim(DS) == 0
    assert ledger.admit(DS, "s1", "a2").admission is Admission.LEASED
    assert progress(ledger, "s1", "a1") is Progress.CONTINUE


def test_renew_fails_for_an_attempt_that_does_not_hold_the_lease(ledger: Ledger) -> None:
    make(ledger)
    lease(ledger, "s1", "a1", lease_ms=SHORT_MS)
    assert ledger.renew(DS, "s1", "a2") is False

    expire_short_leases(ledger.client)
    assert ledger.reclaim(DS) == 1

    assert ledger.renew(DS, "s1", "a1") is False
    assert ledger.snapshot(DS).inflight == 0


def test_renew_leaves_live_tokens_alone(ledger: Ledger, redis_client: redis.Redis) -> None:
    make(ledger)
    lease(ledger, "s1")
    report_live(ledger, "s1", "a1", 9)

    assert ledger.renew(DS, "s1", "a1") is True

    assert redis_client.hget(ledger.keys_of(DS).live_hash, "s1") == "9"
    assert ledger.snapshot(DS).live_tokens == 9


# --- renew_many: a worker process's leases of one dataset, with their live tokens -------------------


def test_renew_many_sets_each_samples_live_tokens_and_moves_the_datasets_total_by_the_difference(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    lease(ledger, "s1")
    lease(ledger, "s2")

    assert ledger.renew_many(DS, [("s1", "a1", 5), ("s2", "a1", 4)]) == [True, True]
    assert ledger.renew_many(DS, [("s1", "a1", 23), ("s2", "a1", 4)]) == [True, True]

    assert redis_client.hgetall(ledger.keys_of(DS).live_hash) == {"s1": "23", "s2": "4"}
    snap = ledger.snapshot(DS)
    assert (snap.live_tokens, snap.tokens) == (27, 0)

    # a try that failed and is retried starts again from nothing: the total goes down with it
    assert ledger.renew_many(DS, [("s1", "a1", 0)]) == [True]
    assert ledger.snapshot(DS).live_tokens == 4


def test_renew_asks_for_the_live_tokens_again_soon_only_under_discard_while_fewer_are_committed_than_run(
    ledger: Ledger,
) -> None:
    make(ledger, "d", token_budget=10_000, on_budget="discard")
    make(ledger, "t", token_budget=10_000)
    make(ledger, "none")
    for name in ("d", "t", "none"):
        lease(ledger, "s1", name=name)
        lease(ledger, "s2", name=name)
        commit_new(ledger, "c1", 20, name=name)  # 1 committed, 2 running

    renewals = {n: ledger.renew_report(n, [("s1", "a1", 5), ("s2", "a1", 5)]) for n in ("d", "t", "none")}

    assert {n: r.soon for n, r in renewals.items()} == {"d": True, "t": False, "none": False}
    assert all(r.held == [True, True] for r in renewals.values())
    commit_new(ledger, "c2", 20, name="d")  # 2 committed, 2 running: the committed lengths say enough
    assert ledger.renew_report("d", [("s1", "a1", 9)]).soon is False


def test_renew_many_with_live_tokens_unknown_renews_and_leaves_them(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    lease(ledger, "s1", lease_ms=SHORT_MS)
    report_live(ledger, "s1", "a1", 12, lease_ms=SHORT_MS)

    assert ledger.renew_many(DS, [("s1", "a1", None)], lease_ms=60_000) == [True]
    expire_short_leases(ledger.client)

    assert ledger.reclaim(DS) == 0
    assert redis_client.hget(ledger.keys_of(DS).live_hash, "s1") == "12"
    assert ledger.snapshot(DS).live_tokens == 12


def test_renew_many_loses_the_leases_not_held_and_leaves_their_holders_alone(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    lease(ledger, "mine")
    lease(ledger, "theirs", "other")
    report_live(ledger, "theirs", "other", 6)

    held = ledger.renew_many(DS, [("mine", "a1", 3), ("theirs", "a1", 50), ("never", "a1", 7)])

    assert held == [True, False, False]
    assert redis_client.hgetall(ledger.keys_of(DS).live_hash) == {"mine": "3", "theirs": "6"}
    assert owner(redis_client, "theirs") == "other"
    assert owner(redis_client, "never") is None
    snap = ledger.snapshot(DS)
    assert (snap.live_tokens, snap.inflight) == (9, 2)


def test_renew_many_counts_a_sample_listed_twice_from_its_last_report(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger)
    lease(ledger, "s1")

    assert ledger.renew_many(DS, [("s1", "a1", 5), ("s1", "a1", 7)]) == [True, True]

    assert redis_client.hget(ledger.keys_of(DS).live_hash, "s1") == "7"
    assert ledger.snapshot(DS).live_tokens == 7


def test_renew_many_of_no_leases_asks_nothing(ledger: Ledger) -> None:
    make(ledger)

    assert ledger.renew_many(DS, []) == []
