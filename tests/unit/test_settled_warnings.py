"""What a settled submit says it left out: exit 0 means every sample has an end, and these lines say which
ends were not records."""

from __future__ import annotations

from pathlib import Path

from budget import DatasetState
from tests.support.snapshots import snapshot_of
from tokenfleet.submit import settled_warnings


def test_a_run_that_generated_everything_has_nothing_to_say() -> None:
    assert settled_warnings([snapshot_of("a", samples=40, state=DatasetState.EXHAUSTED)], Path("out")) == []


def test_failed_samples_rejected_lines_and_an_empty_result_each_get_a_line_naming_where_to_look() -> None:
    snaps = [
        snapshot_of("a", samples=0, failed=20),
        snapshot_of("b", samples=3, rejected=2),
    ]

    lines = settled_warnings(snaps, Path("out"))

    assert lines == [
        "a: 20 sample(s) failed; `tokenfleet status a` says why",
        "a: no sample was generated",
        f"b: 2 source line(s) rejected, each with its reason in {Path('out') / 'b' / 'rejected.jsonl'}",
    ]


def test_a_revoked_dataset_that_generated_nothing_is_not_reported_as_empty() -> None:
    assert settled_warnings([snapshot_of("a", samples=0, state=DatasetState.REVOKED)], Path("out")) == []
