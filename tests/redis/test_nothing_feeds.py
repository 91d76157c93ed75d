"""A dataset with samples left and no producer feeding it says so: in status, and when a resume or a raised
limit makes it active with no submit running (its samples wait for the next one; nothing else feeds them)."""

from __future__ import annotations

import pytest

from budget import DatasetState, Ledger
from budget.keys import dataset_keys
from tests.support.ledger import DS, make
from tokenfleet.cli import main
from tokenfleet.status_view import FED_STALE_S, nothing_feeds, problems_text

pytestmark = pytest.mark.redis


def test_a_producer_saying_it_feeds_a_dataset_shows_in_its_snapshot(ledger: Ledger) -> None:
    make(ledger)
    assert ledger.snapshot(DS).fed_s_ago is None  # no producer ever

    assert ledger.fed(DS)

    fed = ledger.snapshot(DS).fed_s_ago
    assert fed is not None and 0 <= fed < 1
    assert not ledger.fed("never-registered")  # a lost ledger is not brought back by it


def test_an_active_dataset_with_its_source_unread_and_no_producer_is_shown_as_fed_by_none(
    ledger: Ledger,
) -> None:
    make(ledger)
    snap = ledger.snapshot(DS)

    assert nothing_feeds(snap)
    assert "no submit feeding it" in problems_text(snap).plain

    ledger.fed(DS)
    assert not nothing_feeds(ledger.snapshot(DS))


def test_a_stale_producer_is_none_and_a_paused_dataset_is_not_reported(ledger: Ledger) -> None:
    make(ledger)
    ledger.fed(DS)
    ledger.client.hincrby(dataset_keys(DS).ledger_hash, "fed_at_ms", -int((FED_STALE_S + 1) * 1000))
    assert nothing_feeds(ledger.snapshot(DS))

    ledger.pause(DS)
    assert ledger.snapshot(DS).state == DatasetState.PAUSED
    assert not nothing_feeds(ledger.snapshot(DS))


def test_resume_with_no_submit_running_warns_that_the_samples_wait_for_one(
    ledger: Ledger, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    make(ledger)
    ledger.pause(DS)
    capsys.readouterr()

    assert main(["resume", DS, "--redis-url", redis_url]) == 0

    err = capsys.readouterr().err
    assert f"no submit is feeding {DS} now" in err
    ledger.fed(DS)  # a producer is running: nothing to say
    assert main(["resume", DS, "--redis-url", redis_url]) == 0
    assert "no submit" not in capsys.readouterr().err


def test_status_name_says_why_the_samples_to_feed_again_went_back(
    ledger: Ledger, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    make(ledger)
    pending = dataset_keys(DS).pending_hash
    ledger.client.hset(pending, mapping={"a": "servers_down", "b": "servers_down", "c": "paused"})
    ledger.fed(DS)

    assert ledger.pending_reasons(DS) == {"servers_down": 2, "paused": 1}
    assert main(["status", DS, "--redis-url", redis_url]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["servers_down", "2"] in lines and ["paused", "1"] in lines
