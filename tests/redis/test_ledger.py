"""The ledger's dataset scripts against real Redis: register, set_limits, set_state, set_source, snapshot.

The producer's scripts (enqueue, unqueue) are tested in ``test_ledger_producer.py``; the worker's in
``test_ledger_admit.py`` (admit, progress, renew) and ``test_ledger_outcome.py`` (commit, fail, release,
reclaim); many concurrent workers in ``test_ledger_concurrency.py``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
import redis

from budget import (
    Admission,
    CommitItem,
    DatasetLimits,
    DatasetSnapshot,
    DatasetState,
    Ledger,
    LedgerUnavailable,
    UnknownDataset,
)
from budget.keys import DATASETS_SET, dataset_keys
from tests.redis.grants import commit_whole
from tests.support.ledger import DS, MAX_NEW, SPEC, commit_new, make, start
from tests.support.snapshots import snapshot_of

pytestmark = pytest.mark.redis


# --- register ---------------------------------------------------------------------------------------


def test_register_creates_an_active_dataset_with_zero_counters_and_its_spec(ledger: Ledger) -> None:
    assert make(ledger, token_budget=1000, max_samples=10, on_budget="discard") == DatasetState.ACTIVE

    snap = ledger.snapshot(DS)
    assert snap.state == DatasetState.ACTIVE
    assert (snap.token_budget, snap.max_samples, snap.on_budget) == (1000, 10, "discard")
    assert (snap.tokens, snap.samples, snap.live_tokens, snap.wasted_tokens, snap.reclaimed) == (
        0,
        0,
        0,
        0,
        0,
    )
    assert (snap.queued, snap.inflight, snap.pending, snap.failed, snap.reserved_tokens) == (0, 0, 0, 0, 0)
    assert snap.source_done is False
    assert ledger.spec(DS) == SPEC
    assert ledger.datasets() == [DS]


def test_register_stores_the_specs_max_new_tokens_and_a_new_register_replaces_it(ledger: Ledger) -> None:
    make(ledger, token_budget=1000)
    stored = ledger.keys_of(DS).ledger_hash
    assert int(ledger.client.hget(stored, "max_new_tokens") or 0) == MAX_NEW

    make(ledger, token_budget=1000, spec={"servers": ["s"], "sampling": {"max_new_tokens": 10}})

    assert int(ledger.client.hget(stored, "max_new_tokens") or 0) == 10


def test_register_without_limits_stores_none_for_both(ledger: Ledger) -> None:
    make(ledger)

    snap = ledger.snapshot(DS)
    assert snap.token_budget is None
    assert snap.max_samples is None
    assert snap.on_budget == "truncate"


def test_register_lists_every_dataset_once(ledger: Ledger, redis_client: redis.Redis) -> None:
    make(ledger, "b")
    make(ledger, "a")
    make(ledger, "b")

    assert ledger.datasets() == ["a", "b"]
    assert redis_client.scard(DATASETS_SET) == 2


def test_register_again_keeps_counters_and_the_done_set_and_updates_spec_and_limits(ledger: Ledger) -> None:
    make(ledger, token_budget=1000)
    commit_new(ledger, "s1", 40)
    ledger.fail(DS, "s2", "s2-a1", "bad prompt", wasted_tokens=3)

    state = make(ledger, token_budget=2000, max_samples=50, on_budget="drain", spec={"v": 2})

    assert state == DatasetState.ACTIVE
    snap = ledger.snapshot(DS)
    assert (snap.tokens, snap.samples, snap.wasted_tokens, snap.failed) == (40, 1, 3, 1)
    assert (snap.token_budget, snap.max_samples, snap.on_budget) == (2000, 50, "drain")
    assert ledger.done_attempts(DS) == {"s1": "s1-a1"}
    assert ledger.spec(DS) == {"v": 2}


def test_register_again_resets_source_done_for_the_new_submit(ledger: Ledger) -> None:
    make(ledger)
    ledger.set_source(DS, total=7, done=True, rejected=2)

    make(ledger)

    snap = ledger.snapshot(DS)
    assert snap.source_done is False
    assert (snap.source_total, snap.rejected) == (7, 2)


def test_raising_the_budget_of_an_exhausted_dataset_on_register_makes_it_active_again(ledger: Ledger) -> None:
    make(ledger, token_budget=100)
    commit_whole(ledger, "s1", 100)
    assert ledger.snapshot(DS).state == DatasetState.EXHAUSTED

    assert make(ledger, token_budget=101) == DatasetState.ACTIVE
    assert ledger.snapshot(DS).state == DatasetState.ACTIVE


def test_raising_max_samples_of_an_exhausted_dataset_on_register_makes_it_active_again(
    ledger: Ledger,
) -> None:
    make(ledger, max_samples=1)
    commit_new(ledger, "s1", 5)
    assert ledger.snapshot(DS).state == DatasetState.EXHAUSTED

    assert make(ledger, max_samples=2) == DatasetState.ACTIVE


def test_register_with_a_budget_already_spent_makes_the_dataset_exhausted(ledger: Ledger) -> None:
    make(ledger)
    commit_new(ledger, "s1", 80)

    assert make(ledger, token_budget=80) == DatasetState.EXHAUSTED
    assert make(ledger, max_samples=1) == DatasetState.EXHAUSTED
    assert make(ledger) == DatasetState.ACTIVE


@pytest.mark.parametrize("action", ["pause", "revoke"])
def test_a_paused_or_revoked_dataset_stays_so_on_register(ledger: Ledger, action: str) -> None:
    make(ledger, token_budget=100)
    stopped = ledger.set_state(DS, action)

    assert make(ledger, token_budget=500) == stopped
    assert ledger.snapshot(DS).state == stopped


# --- set_state --------------------------------------------------------------------------------------


def test_pause_resume_and_revoke_change_the_state(ledger: Ledger) -> None:
    make(ledger)

    assert ledger.pause(DS) == DatasetState.PAUSED
    assert ledger.snapshot(DS).state == DatasetState.PAUSED
    assert ledger.resume(DS) == DatasetState.ACTIVE
    assert ledger.revoke(DS) == DatasetState.REVOKED
    assert ledger.snapshot(DS).state == DatasetState.REVOKED
    assert ledger.resume(DS) == DatasetState.ACTIVE


def test_resume_makes_a_dataset_whose_limit_is_reached_exhausted_not_active(ledger: Ledger) -> None:
    make(ledger, token_budget=10)
    commit_new(ledger, "s1", 10)
    ledger.pause(DS)

    assert ledger.resume(DS) == DatasetState.EXHAUSTED


def test_pausing_an_exhausted_dataset_pauses_it(ledger: Ledger) -> None:
    make(ledger, max_samples=1)
    commit_new(ledger, "s1", 1)

    assert ledger.pause(DS) == DatasetState.PAUSED


def test_set_state_of_an_unknown_dataset_raises_unknown_dataset(ledger: Ledger) -> None:
    with pytest.raises(UnknownDataset):
        ledger.pause("nope")
    with pytest.raises(UnknownDataset):
        ledger.resume("nope")


def test_set_state_with_an_unknown_action_is_an_error_and_changes_nothing(ledger: Ledger) -> None:
    make(ledger)

    with pytest.raises(redis.ResponseError, match="unknown action"):
        ledger.set_state(DS, "explode")
    assert ledger.snapshot(DS).state == DatasetState.ACTIVE


# --- set_limits -------------------------------------------------------------------------------------


def test_set_limits_with_dash_leaves_a_limit_unchanged(ledger: Ledger) -> None:
    make(ledger, token_budget=100, max_samples=5)

    assert ledger.set_limits(DS, token_budget=200) == DatasetState.ACTIVE
    snap = ledger.snapshot(DS)
    assert (snap.token_budget, snap.max_samples) == (200, 5)

    ledger.set_limits(DS, max_samples=9)
    snap = ledger.snapshot(DS)
    assert (snap.token_budget, snap.max_samples) == (200, 9)

    ledger.set_limits(DS)
    snap = ledger.snapshot(DS)
    assert (snap.token_budget, snap.max_samples) == (200, 9)


def test_set_limits_with_none_removes_a_limit(ledger: Ledger) -> None:
    make(ledger, token_budget=100, max_samples=5)

    ledger.set_limits(DS, token_budget=None)
    snap = ledger.snapshot(DS)
    assert (snap.token_budget, snap.max_samples) == (None, 5)

    ledger.set_limits(DS, max_samples=None)
    snap = ledger.snapshot(DS)
    assert (snap.token_budget, snap.max_samples) == (None, None)


def test_set_limits_lowering_the_budget_below_spent_tokens_exhausts_the_dataset(ledger: Ledger) -> None:
    make(ledger, token_budget=1000)
    commit_new(ledger, "s1", 300)

    assert ledger.set_limits(DS, token_budget=300) == DatasetState.EXHAUSTED
    assert ledger.snapshot(DS).state == DatasetState.EXHAUSTED


def test_raising_the_budget_of_an_exhausted_dataset_makes_it_active_again(ledger: Ledger) -> None:
    make(ledger, token_budget=300)
    commit_whole(ledger, "s1", 300)
    assert ledger.snapshot(DS).state == DatasetState.EXHAUSTED

    assert ledger.set_limits(DS, token_budget=301) == DatasetState.ACTIVE
    assert ledger.snapshot(DS).state == DatasetState.ACTIVE


def test_removing_the_reached_limit_of_an_exhausted_dataset_makes_it_active_again(ledger: Ledger) -> None:
    make(ledger, max_samples=1)
    commit_new(ledger, "s1", 3)

    assert ledger.set_limits(DS, max_samples=None) == DatasetState.ACTIVE


def test_set_limits_leaves_a_paused_or_revoked_dataset_so(ledger: Ledger) -> None:
    make(ledger, token_budget=10)
    ledger.pause(DS)
    assert ledger.set_limits(DS, token_budget=0) == DatasetState.PAUSED
    ledger.revoke(DS)
    assert ledger.set_limits(DS, token_budget=None) == DatasetState.REVOKED


def test_set_limits_of_an_unknown_dataset_raises_unknown_dataset_and_creates_nothing(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    with pytest.raises(UnknownDataset):
        ledger.set_limits("nope", token_budget=5)
    assert not redis_client.exists(dataset_keys("nope").ledger_hash)


# --- set_source -------------------------------------------------------------------------------------


def test_set_source_records_total_done_and_rejected_and_none_leaves_a_field_unchanged(ledger: Ledger) -> None:
    make(ledger)

    ledger.set_source(DS, rejected=3)
    ledger.set_source(DS, total=120)
    snap = ledger.snapshot(DS)
    assert (snap.source_total, snap.rejected, snap.source_done) == (120, 3, False)

    ledger.set_source(DS, done=True)
    snap = ledger.snapshot(DS)
    assert (snap.source_total, snap.rejected, snap.source_done) == (120, 3, True)

    ledger.set_source(DS, done=False)
    assert ledger.snapshot(DS).source_done is False


# --- snapshot ---------------------------------------------------------------------------------------


def test_snapshot_of_an_unknown_dataset_raises_unknown_dataset(ledger: Ledger) -> None:
    with pytest.raises(UnknownDataset):
        ledger.snapshot("nope")
    with pytest.raises(UnknownDataset):
        ledger.spec("nope")


def test_snapshot_counts_queued_inflight_pending_failed_and_done(ledger: Ledger) -> None:
    make(ledger)
    assert ledger.enqueue(DS, ["q1", "q2", "l1", "d1", "f1"], window=10) == [1, 1, 1, 1, 1]
    assert ledger.admit(DS, "l1", "a").admission is Admission.OK
    commit_new(ledger, "d1", 7)
    assert ledger.admit(DS, "f1", "a").admission is Admission.OK
    ledger.fail(DS, "f1", "a", "rejected by server")
    ledger.unqueue(DS, ["q2"], "publish failed")

    snap = ledger.snapshot(DS)
    assert (snap.queued, snap.inflight, snap.pending, snap.failed, snap.samples) == (1, 1, 1, 1, 1)
    assert snap.as_dict()["settled"] is False
    assert snap.as_dict()["queued"] == 1


def test_snapshot_does_not_count_an_expired_lease_as_inflight(ledger: Ledger) -> None:
    make(ledger)
    ledger.admit(DS, "s1", "a", lease_ms=50)
    assert ledger.snapshot(DS).inflight == 1

    time.sleep(0.1)

    assert ledger.snapshot(DS).inflight == 0


def test_a_dataset_is_not_settled_while_an_expired_lease_waits_to_be_reclaimed(ledger: Ledger) -> None:
    make(ledger)
    ledger.set_source(DS, total=1, done=True)
    assert ledger.admit(DS, "s1", "a", lease_ms=50).admission is Admission.OK
    time.sleep(0.1)

    assert ledger.snapshot(DS).settled is False  # s1 still has to be generated

    assert ledger.reclaim(DS) == 1
    assert ledger.snapshot(DS).settled is False


def test_a_dataset_settles_once_the_source_is_consumed_and_every_sample_is_done(ledger: Ledger) -> None:
    make(ledger)
    assert ledger.enqueue(DS, ["s1", "s2"], window=10) == [1, 1]
    ledger.set_source(DS, total=2, done=True)
    assert ledger.snapshot(DS).settled is False

    commit_new(ledger, "s1", 3)
    assert ledger.snapshot(DS).settled is False
    commit_new(ledger, "s2", 4)

    assert ledger.snapshot(DS).settled is True


def _snap(**changes: Any) -> DatasetSnapshot:
    return snapshot_of(DS, **changes)


@pytest.mark.parametrize(
    ("state", "queued", "inflight", "source_done", "pending", "settled"),
    [
        # something still queued or in flight: never settled, whatever the state
        ("active", 1, 0, True, 0, False),
        ("active", 0, 1, True, 0, False),
        ("exhausted", 1, 0, True, 0, False),
        ("exhausted", 0, 1, False, 0, False),
        ("revoked", 1, 0, False, 0, False),
        ("revoked", 0, 1, False, 0, False),
        # a limit or the operator stopped it: settled, even with the source unread or samples pending
        ("exhausted", 0, 0, False, 0, True),
        ("exhausted", 0, 0, False, 3, True),
        ("revoked", 0, 0, False, 0, True),
        ("revoked", 0, 0, True, 3, True),
        # active: settled only when the source is consumed and nothing is left to feed
        ("active", 0, 0, True, 0, True),
        ("active", 0, 0, False, 0, False),
        ("active", 0, 0, True, 2, False),
        # paused: waits for the operator
        ("paused", 0, 0, True, 0, False),
        ("paused", 0, 0, False, 0, False),
    ],
)
def test_snapshot_settled_truth_table(
    state: str, queued: int, inflight: int, source_done: bool, pending: int, settled: bool
) -> None:
    snap = _snap(state=state, queued=queued, inflight=inflight, source_done=source_done, pending=pending)

    assert snap.settled is settled
    assert snap.as_dict()["settled"] is settled


def test_an_exhausted_dataset_with_pending_samples_is_settled_in_redis(ledger: Ledger) -> None:
    make(ledger, token_budget=10)
    ledger.pause(DS)
    assert ledger.admit(DS, "s2", "a").admission is Admission.PAUSED
    ledger.resume(DS)
    commit_new(ledger, "s1", 10)

    snap = ledger.snapshot(DS)
    assert (snap.state, snap.pending, snap.source_done) == (DatasetState.EXHAUSTED, 1, False)
    assert snap.settled is True


def test_a_revoked_dataset_with_nothing_in_flight_is_settled_in_redis(ledger: Ledger) -> None:
    make(ledger)
    assert ledger.admit(DS, "s1", "a").admission is Admission.OK
    ledger.revoke(DS)
    assert ledger.snapshot(DS).settled is False

    ledger.release(DS, "s1", "a", "revoked")

    snap = ledger.snapshot(DS)
    assert (snap.state, snap.inflight, snap.pending) == (DatasetState.REVOKED, 0, 1)
    assert snap.settled is True


# --- forget -----------------------------------------------------------------------------------------


def test_forget_deletes_every_key_of_the_dataset_and_only_that_one(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=10_000)  # a budget: s3's grant reserves tokens, and puts it on the clock
    make(ledger, "other")
    commit_new(ledger, "s1", 4)
    commit_new(ledger, "s1", 4, name="other")
    ledger.fail(DS, "s2", "a", "bad")
    ledger.enqueue(DS, ["s3", "s4"], window=10)
    ledger.admit(DS, "s3", "a")
    assert start(ledger, "s3", "a", 8) == 8
    ledger.renew_many(DS, [("s3", "a", 2)])
    ledger.unqueue(DS, ["s4"], "publish failed")
    ledger.set_identity(DS, epoch="e1")
    ledger.set_source_digest(DS, "digest")
    ledger.admit(DS, "s5", "a")
    ledger.hold(DS, "s5", "a", b'{"id": "s5"}', 3, max_bytes=1000)  # a record the disk had no room for
    ledger.claim_held_flush(DS, "me", 10_000)
    every_key = set(dataclasses.asdict(ledger.keys_of(DS)).values())
    # all but the (empty) queued set and the strikes hash nothing gave up on
    expected = every_key - {ledger.keys_of(DS).queued_zset, ledger.keys_of(DS).strikes_hash}
    assert set(redis_client.keys(f"tf:{{{DS}}}:*")) == expected

    ledger.forget(DS)

    assert redis_client.keys(f"tf:{{{DS}}}:*") == []
    assert ledger.datasets() == ["other"]
    with pytest.raises(UnknownDataset):
        ledger.snapshot(DS)
    assert ledger.snapshot("other").samples == 1
    assert make(ledger) == DatasetState.ACTIVE
    assert ledger.snapshot(DS).samples == 0


@pytest.mark.parametrize("late_call", ["commit", "fail", "release"])
def test_an_attempt_ending_after_forget_does_not_bring_the_dataset_back(
    ledger: Ledger, redis_client: redis.Redis, late_call: str
) -> None:
    make(ledger)
    assert ledger.admit(DS, "s1", "a").admission is Admission.OK
    ledger.forget(DS)

    if late_call == "commit":
        ledger.commit(DS, "s1", "a", 5)
    elif late_call == "fail":
        ledger.fail(DS, "s1", "a", "server error", wasted_tokens=5)
    else:
        ledger.release(DS, "s1", "a", "worker shutdown", thrown_away_tokens=5)

    assert redis_client.keys(f"tf:{{{DS}}}:*") == []
    with pytest.raises(UnknownDataset):
        ledger.snapshot(DS)


# --- Redis unreachable ------------------------------------------------------------------------------

UNREACHABLE = "redis://127.0.0.1:1/0"


@pytest.mark.parametrize(
    "call",
    [
        lambda lg: lg.ping(),
        lambda lg: lg.register(DS, DatasetLimits(), SPEC),
        lambda lg: lg.datasets(),
        lambda lg: lg.pause(DS),
        lambda lg: lg.set_limits(DS, token_budget=1),
        lambda lg: lg.enqueue(DS, ["s1"], 4),
        lambda lg: lg.admit(DS, "s1", "a"),
        lambda lg: lg.progress(DS, "s1", "a"),
        lambda lg: lg.renew_many(DS, [("s1", "a", 3)]),
        lambda lg: lg.commit(DS, "s1", "a", 3),
        lambda lg: lg.commit_many(DS, [CommitItem("s1", "a", 3)]),
        lambda lg: lg.admit_many(DS, [("s1", "a", 0)]),
        lambda lg: lg.reclaim(DS),
        lambda lg: lg.snapshot(DS),
        lambda lg: lg.done_attempts(DS),
    ],
    ids=[
        "ping",
        "register",
        "datasets",
        "pause",
        "set_limits",
        "enqueue",
        "admit",
        "progress",
        "renew_many",
        "commit",
        "commit_many",
        "admit_many",
        "reclaim",
        "snapshot",
        "done_attempts",
    ],
)
def test_a_ledger_whose_redis_is_unreachable_raises_ledger_unavailable(call: Any) -> None:
    ledger = Ledger.from_url(UNREACHABLE)
    try:
        with pytest.raises(LedgerUnavailable, match="Redis is unreachable"):
            call(ledger)
    finally:
        ledger.client.close()
