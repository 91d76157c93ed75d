"""A worker process's output guard against a real ledger and real folders: a worker whose output_dir is
not the storage submit marked, or cannot be written, takes none of the dataset's work, says why in the
ledger, and takes it again once the folder is right."""

from __future__ import annotations

from pathlib import Path

import pytest

from budget import Ledger
from budget.storage import STORAGE_MARKER, ensure_storage_marker
from tests.support.ledger import DS, make
from workers.output_guard import OutputGuard
from workers.sink import OutputSink, OutputUnwritable

pytestmark = pytest.mark.redis


def test_an_output_dir_without_submits_marker_blocks_the_dataset_until_it_is_the_right_storage(
    ledger: Ledger, tmp_path: Path
) -> None:
    make(ledger)
    marked = tmp_path / "shared"
    token = ensure_storage_marker(marked)
    here = tmp_path / "local"  # what a worker on a host without the shared storage sees at that path
    here.mkdir()
    guard = OutputGuard(ledger, OutputSink(), recheck_s=0.0)

    problem = guard.check_storage(DS, here / DS, here, token)
    assert problem is not None and STORAGE_MARKER in problem and "not the storage submit" in problem
    assert guard.problem(DS) is not None
    assert "not the storage submit" in ledger.snapshot(DS).output_error

    (here / STORAGE_MARKER).write_text((marked / STORAGE_MARKER).read_text())  # the storage is mounted
    assert guard.problem(DS) is None
    assert ledger.snapshot(DS).output_error == ""
    assert guard.check_storage(DS, here / DS, here, token) is None


def test_another_disk_at_the_same_path_is_refused(ledger: Ledger, tmp_path: Path) -> None:
    make(ledger)
    token = ensure_storage_marker(tmp_path / "a")
    other = tmp_path / "b"
    ensure_storage_marker(other)  # another submit's storage: another token
    guard = OutputGuard(ledger, OutputSink())
    problem = guard.check_storage(DS, other / DS, other, token)
    assert problem is not None and "another token" in problem


def test_a_write_failure_blocks_until_a_probe_write_succeeds_and_the_problem_is_cleared(
    ledger: Ledger, tmp_path: Path
) -> None:
    make(ledger)
    folder = tmp_path / "out" / DS
    guard = OutputGuard(ledger, OutputSink(), recheck_s=0.0)
    guard.block(DS, folder, OutputUnwritable(f"cannot write {folder}: No space left on device"))
    assert "No space left on device" in ledger.snapshot(DS).output_error

    assert guard.problem(DS) is None  # the probe file could be written: blocked no more
    assert ledger.snapshot(DS).output_error == ""
    assert not list(folder.glob(".probe-*"))


def test_another_workers_problem_is_not_cleared_by_this_one(ledger: Ledger, tmp_path: Path) -> None:
    make(ledger)
    ledger.report_output_problem(DS, "other-host:1", "cannot write /x: Read-only file system")
    assert not ledger.report_output_problem(DS, "this-host:2", "")
    assert "other-host:1: cannot write /x" in ledger.snapshot(DS).output_error


def test_the_problem_names_the_held_records_once_the_first_is_held_right_after_the_block(
    ledger: Ledger, tmp_path: Path
) -> None:
    make(ledger)
    folder = tmp_path / "out" / DS
    guard = OutputGuard(ledger, OutputSink())
    guard.block(DS, folder, OutputUnwritable(f"cannot write {folder}: No space left on device"))
    assert "held in the ledger" not in ledger.snapshot(DS).output_error
    assert ledger.admit(DS, "s1", "a1").admission.value == "ok"

    # the same problem a moment later, now with a record held: reported again, not held back as a repeat
    assert guard.hold(DS, "s1", "a1", {"id": "s1", "output_ids": [1, 2]}, 2)
    problem = ledger.snapshot(DS).output_error
    assert "No space left on device" in problem and "1 sample(s) held in the ledger" in problem


def test_a_report_that_lands_after_a_record_was_held_names_it_whoever_read_the_count_before(
    ledger: Ledger, tmp_path: Path
) -> None:
    # Another worker (or thread) saw the full disk before the record below was held and reports last:
    # the problem left in the ledger must still name the held record (nothing reports again while the
    # disk stays full).
    make(ledger)
    folder = tmp_path / "out" / DS
    guard = OutputGuard(ledger, OutputSink())
    guard.block(DS, folder, OutputUnwritable(f"cannot write {folder}: No space left on device"))
    assert ledger.admit(DS, "s1", "a1").admission.value == "ok"
    assert guard.hold(DS, "s1", "a1", {"id": "s1", "output_ids": [1, 2]}, 2)

    ledger.report_output_problem(DS, "other-host:2", "cannot write /y: No space left on device")

    problem = ledger.snapshot(DS).output_error
    assert problem.startswith("other-host:2: cannot write /y") and "1 sample(s) held in the ledger" in problem
