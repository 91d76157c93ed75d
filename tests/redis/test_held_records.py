"""Records a full disk had no room for, held in a real ledger: the sample stays leased without expiry (never
fed or generated again, not settled), survives the worker (another process writes it once room comes
back), and its tokens are counted once, at that commit."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from budget import Admission, CommitItem, CommitOutcome, HoldOutcome, Ledger
from tests.support.disks import every_line_is_a_whole_record
from tests.support.ledger import DS, SPEC, expire_short_leases, keys, lease, make
from workers import output_guard
from workers.output_guard import OutputGuard, room_problem
from workers.sink import OutputSink, OutputUnwritable

pytestmark = pytest.mark.redis


class FullDisk(OutputSink):
    """A real sink on a disk with ``room`` bytes left: a record that does not fit fails as ENOSPC does
    (nothing of it written), until ``free`` gives space again."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room

    def write_record(self, dataset_dir: Path, record: dict[str, Any], fsync: str = "always") -> None:
        size = len(orjson.dumps(record)) + 1
        if size > self.room:
            raise OutputUnwritable(f"cannot write {dataset_dir}/part-x.jsonl: No space left on device")
        self.room -= size
        super().write_record(dataset_dir, record, fsync)

    def free(self) -> None:
        self.room = 2**40


def record_of(sid: str, attempt: str, tokens: int) -> dict[str, Any]:
    return {
        "id": sid,
        "dataset": DS,
        "output_ids": list(range(tokens)),
        "completion_tokens": tokens,
        "truncated": False,
        "hit_max_new": False,
        "reasoning_tokens": 0,
        "attempt": attempt,
    }


def test_a_held_sample_stays_leased_without_expiry_and_its_tokens_count_once_at_its_commit(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    make(ledger, token_budget=1_000)
    assert lease(ledger, "s1", "a1") == 64  # its reservation: max_new_tokens
    ledger.renew_many(DS, [("s1", "a1", 20)])

    raw = orjson.dumps(record_of("s1", "a1", 20))
    assert ledger.hold(DS, "s1", "a1", raw, 20, max_bytes=10_000) is HoldOutcome.HELD
    assert ledger.hold(DS, "s1", "a1", raw, 20, max_bytes=10_000) is HoldOutcome.HELD  # a retry: once
    snap = ledger.snapshot(DS)
    assert (snap.held, snap.held_bytes, snap.inflight, snap.pending) == (1, len(raw), 1, 0)
    assert not snap.settled and snap.tokens == 0
    assert snap.reserved_tokens == 20  # what it generated, no more: the rest of the budget is free

    # Never reclaimed, never shortened by a late renewal, never admitted again.
    expire_short_leases(redis_client)
    assert ledger.reclaim(DS) == 0
    ledger.renew_many(DS, [("s1", "a1", 20)])
    assert redis_client.zscore(keys().lease_zset, "s1") == float("inf")
    assert ledger.admit(DS, "s1", "a2").admission is Admission.LEASED
    assert ledger.held_records(DS) == [("s1", raw)]

    assert ledger.commit_many(DS, [CommitItem("s1", "a1", 20)]) == [CommitOutcome.COMMITTED]
    assert ledger.unhold(DS, ["s1"]) == 1
    snap = ledger.snapshot(DS)
    assert (snap.held, snap.held_bytes, snap.inflight, snap.reserved_tokens) == (0, 0, 0, 0)
    assert (snap.tokens, snap.samples, snap.live_tokens) == (20, 1, 0)
    assert ledger.unhold(DS, ["s1"]) == 0


def test_a_record_past_the_cap_or_of_an_attempt_without_its_lease_is_not_held(ledger: Ledger) -> None:
    make(ledger)
    lease(ledger, "s1", "a1")
    lease(ledger, "s2", "a1")
    assert ledger.hold(DS, "s1", "a1", b"x" * 600, 1, max_bytes=1_000) is HoldOutcome.HELD
    assert ledger.hold(DS, "s2", "a1", b"x" * 600, 1, max_bytes=1_000) is HoldOutcome.FULL
    assert ledger.hold(DS, "s2", "other", b"x", 1, max_bytes=1_000) is HoldOutcome.LOST
    assert ledger.snapshot(DS).held == 1


def test_records_a_full_disk_refused_are_written_once_by_a_restarted_worker_when_room_comes_back(
    ledger: Ledger, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(output_guard, "REPORT_EVERY_S", 0.0)  # every report reaches the ledger
    make(ledger, spec={**SPEC, "output_dir": str(tmp_path)})
    folder = tmp_path / DS
    disk = FullDisk(room=0)
    first = OutputGuard(ledger, disk, recheck_s=0.0)
    for i in range(3):  # three generations in flight as the disk fills
        sid = f"s{i}"
        lease(ledger, sid, "a1")
        record = record_of(sid, "a1", 10 + i)
        try:
            disk.write_record(folder, record)
        except OutputUnwritable as e:
            first.block(DS, folder, e)
            assert first.hold(DS, sid, "a1", record, 10 + i)
    first.stop_flusher()
    snap = ledger.snapshot(DS)
    assert snap.held == 3 and snap.samples == 0
    assert (
        "No space left on device" in snap.output_error
        and "3 sample(s) held in the ledger" in snap.output_error
    )
    assert first.problem(DS) is not None  # the disk is still full: the held records do not fit

    # That worker is gone; another (a restart) finds the records once the disk has room.
    disk.free()
    second = OutputGuard(ledger, disk, recheck_s=0.0)
    assert second.flush_held(DS) is None
    assert second.flush_held(DS) is None  # nothing more to write: each was written once

    on_disk = every_line_is_a_whole_record(folder)
    assert sorted(r["id"] for r in on_disk) == ["s0", "s1", "s2"]
    snap = ledger.snapshot(DS)
    assert (snap.samples, snap.tokens, snap.held, snap.inflight) == (3, 10 + 11 + 12, 0, 0)
    assert ledger.done_attempts(DS) == {"s0": "a1", "s1": "a1", "s2": "a1"}


def test_no_room_for_the_records_about_to_be_written_blocks_the_dataset_and_says_what_it_needs(
    ledger: Ledger, tmp_path: Path
) -> None:
    make(ledger)
    folder = tmp_path / "out" / DS
    guard = OutputGuard(ledger, OutputSink(), recheck_s=3600.0)
    assert guard.admit_room(DS, folder, {"s1": 1_000}) == (1, None)  # room for one record
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    # Room for the first of these two, not for the second: the first is admitted, the second handed back.
    fit, why = guard.admit_room(DS, folder, {"s2": 1_000, "s3": free})
    assert fit == 1 and why is not None and f"not enough room in {folder}" in why
    assert guard.problem(DS) is None  # some room left: not blocked
    fit, problem = guard.admit_room(DS, folder, {"s4": 2**60, "s5": 2**60})
    assert fit == 0 and problem is not None
    assert f"not enough room in {folder}" in problem and " free" in problem
    assert "GiB for 4 record(s) in flight" in problem  # s1 and s2 still in flight here, and s4 and s5
    assert guard.problem(DS) == problem and "not enough room" in ledger.snapshot(DS).output_error
    guard.finished(DS, "s1")
    guard.finished(DS, "s2")
    assert room_problem(folder, 0, "one record") is None
