"""The lease keeper's reports against real Redis: how soon the ledger hears a worker's live tokens."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from budget import Ledger
from tests.support.ledger import DS, commit_new, lease, make
from workers.leases import REPORT_S, REPORT_SOON_S, Lease, LeaseKeeper

pytestmark = pytest.mark.redis


def live_after(ledger: Ledger, wait_s: float) -> int:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if ledger.snapshot(DS).live_tokens:
            break
        time.sleep(0.05)
    return ledger.snapshot(DS).live_tokens


@contextmanager
def two_running(ledger: Ledger, on_budget: str) -> Iterator[tuple[LeaseKeeper, list[Lease]]]:
    """A 100k budget under ``on_budget`` with one answer committed, and a keeper holding two running
    generations of it (leased in the ledger, not yet reported)."""
    make(ledger, token_budget=100_000, on_budget=on_budget)
    commit_new(ledger, "c1", 20)
    keeper = LeaseKeeper(ledger, lease_ms=60_000)
    try:
        held = []
        for sid in ("s1", "s2"):
            lease(ledger, sid)
            held.append(keeper.hold(DS, sid, "a1"))
        yield keeper, held
    finally:
        keeper.stop()


@pytest.mark.parametrize(("on_budget", "soon"), [("discard", True), ("truncate", False)])
def test_a_discard_budget_with_fewer_answers_committed_than_run_hears_live_tokens_every_second(
    ledger: Ledger, on_budget: str, soon: bool
) -> None:
    with two_running(ledger, on_budget) as (keeper, held):
        keeper.report()  # the first round: the ledger says whether it wants the next one soon
        for x in held:
            x.live = 7
        started = time.monotonic()

        live = live_after(ledger, REPORT_SOON_S + 1.0)

        if soon:  # the next report came within about a second, not REPORT_S
            assert live == 14, f"no report {time.monotonic() - started:.1f} s after the live tokens changed"
        else:  # the usual pace: nothing yet
            assert live == 0 and REPORT_S > REPORT_SOON_S + 1.0


def test_the_first_lease_of_a_dataset_is_reported_at_the_next_tick_not_after_the_interval(
    ledger: Ledger,
) -> None:
    # the ledger learns at that report whether the dataset wants its live tokens every second: waiting
    # REPORT_S for it left a discard budget's first answers counted as nothing for up to 5 s
    make(ledger, token_budget=100_000, on_budget="truncate")
    keeper = LeaseKeeper(ledger, lease_ms=60_000)
    try:
        lease(ledger, "s1")
        keeper.hold(DS, "s1", "a1").live = 5

        assert live_after(ledger, REPORT_SOON_S + 1.0) == 5
    finally:
        keeper.stop()


@pytest.mark.parametrize(("on_budget", "wanted"), [("discard", True), ("truncate", False)])
def test_the_keeper_says_which_datasets_want_their_live_tokens_read_every_second(
    ledger: Ledger, on_budget: str, wanted: bool
) -> None:
    # the runner counts those datasets' requests at their server's speed between chunks
    # (Lease.reported): a stream paced for the stall timeout brought its tokens only at its end
    with two_running(ledger, on_budget) as (keeper, _):
        assert keeper.live_wanted(DS)  # before any report covered it: the ledger has not said yet

        keeper.report()  # two running, one committed: a discard budget asks for them soon

        assert keeper.live_wanted(DS) is wanted
        assert keeper.live_wanted("another") is True  # not reported yet


def test_a_discard_dataset_stops_wanting_its_live_tokens_once_as_many_answers_are_committed_as_run(
    ledger: Ledger,
) -> None:
    with two_running(ledger, "discard") as (keeper, _):
        keeper.report()
        assert keeper.live_wanted(DS)

        commit_new(ledger, "c2", 20)  # two committed, two running
        keeper.report()

        assert not keeper.live_wanted(DS)
