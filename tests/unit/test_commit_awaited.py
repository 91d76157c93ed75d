"""Which commits may linger for others to share their ledger call (``workers.runner.commit_awaited``)."""

from __future__ import annotations

import pytest

from budget.ledger import GRANT_AT_SEND
from budget.spec import DatasetSpec
from tests.support.attempts import attempt_of
from workers.runner import Attempt, commit_awaited


def attempt(on_budget: str, cap: int) -> Attempt:
    return attempt_of(DatasetSpec(servers=("http://sim",), output_dir="", on_budget=on_budget), cap)


@pytest.mark.parametrize("policy", ["discard", "drain"])
def test_a_discard_or_drain_commit_lingers_least_since_admission_reads_the_committed_answers(
    policy: str,
) -> None:
    assert commit_awaited(attempt(policy, 0))


def test_a_truncate_commit_under_a_budget_lingers_least_since_it_gives_back_its_grant() -> None:
    assert commit_awaited(attempt("truncate", GRANT_AT_SEND))


def test_a_commit_with_no_budget_may_linger_to_share_its_call() -> None:
    # truncate is the default policy: with no token budget the admission grants nothing (cap 0)
    assert not commit_awaited(attempt("truncate", 0))
