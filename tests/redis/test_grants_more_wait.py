"""A worker process's asks for more (``Grants.more``) against real Redis: how a generation that reached its
grant when nothing was left waits for what the few others still running give back."""

from __future__ import annotations

import threading
import time

import pytest

from budget import Ledger
from tests.support.ledger import DS, end, lease, make
from workers import continuation
from workers.continuation import Grants

pytestmark = pytest.mark.redis


def test_a_generation_at_its_grant_with_nothing_left_is_granted_what_another_gives_back_as_it_ends(
    ledger: Ledger,
) -> None:
    make(ledger, token_budget=200)
    assert [lease(ledger, f"s{i}", want=500, slots=2) for i in range(2)] == [100, 100]
    # s1 ends 0.2 s from now, 60 tokens before its grant
    later = threading.Timer(0.2, lambda: end(ledger, "s1", "a1", 40))
    later.start()
    try:
        started = time.monotonic()
        after = Grants(ledger).more(DS, "s0", "a1", 400)
        waited = time.monotonic() - started
    finally:
        later.join()

    # not cut at 100: of the 60 s1 gave back, the horizon's share (over the 2 slots)
    assert after == 130
    assert 0.2 <= waited < continuation.MORE_WAIT_MAX_S


def test_a_generation_waiting_for_more_ends_at_its_grant_once_its_wait_is_over(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(continuation, "MORE_WAIT_MAX_S", 0.3)
    make(ledger, token_budget=200)
    assert [lease(ledger, f"s{i}", want=500, slots=2) for i in range(2)] == [100, 100]

    started = time.monotonic()
    after = Grants(ledger).more(DS, "s0", "a1", 400)  # s1 runs on and gives nothing back

    assert after == 100  # cut at its grant
    assert 0.3 <= time.monotonic() - started < 1.0
