"""The server scripts (``budget/lua/server_*.lua``) each on its own, against real Redis.

Expiry uses leases of 50 ms and sleeps of 100 ms (the scripts read Redis's own clock).
"""

from __future__ import annotations

import threading
import time

import pytest
import redis

from budget.keys import SERVERS_SEEN_ZSET, server_keys
from budget.server_board import RATE_WINDOW_S, ServerLedger, ServerOutcome
from tests.support.ledger import SHORT_MS, expire_short_leases

pytestmark = pytest.mark.redis

A, B, C = "http://a:30000", "http://b:30000", "http://c:30000"
LEASE_MS = 60_000
THRESHOLD = 3
PROBE_MS = 200


@pytest.fixture
def board(redis_client: redis.Redis) -> ServerLedger:
    return ServerLedger(redis_client)


def take(
    board: ServerLedger,
    servers: list[str],
    caps: list[int | None],
    n: int,
    *,
    avoid: str | None = None,
    first: int = 0,
) -> list[str | None]:
    """Pick ``n`` times; the servers picked (None when all were full)."""
    return [
        board.acquire(servers, caps, f"tok-{time.monotonic_ns()}", LEASE_MS, avoid=avoid, first=first).url
        for _ in range(n)
    ]


def fail(board: ServerLedger, url: str, at_ms: int = 0) -> bool:
    """Report one failure; returns whether the server is up after it."""
    return board.report(
        url,
        ServerOutcome.FAIL,
        at_ms=at_ms,
        fail_threshold=THRESHOLD,
        probe_interval_ms=PROBE_MS,
        message="x",
    ).up


def ok(board: ServerLedger, url: str, at_ms: int = 0, outcome: ServerOutcome = ServerOutcome.OK) -> bool:
    return board.report(url, outcome, at_ms=at_ms, fail_threshold=THRESHOLD, probe_interval_ms=PROBE_MS).up


def redis_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


# --- server_acquire -----------------------------------------------------------------------------------


def test_each_pick_takes_a_slot_on_the_server_with_the_fewest_in_flight(board: ServerLedger) -> None:
    board.acquire([A], [None], "held-1", LEASE_MS)
    board.acquire([A], [None], "held-2", LEASE_MS)
    board.acquire([B], [None], "held-3", LEASE_MS)

    assert take(board, [A, B, C], [None] * 3, 4, first=0) == [C, B, C, A]
    assert [s.inflight for s in board.status([A, B, C])] == [3, 2, 2]


def test_ties_start_from_the_given_server_so_callers_spread_evenly(board: ServerLedger) -> None:
    assert board.acquire([A, B, C], [None] * 3, "t1", LEASE_MS, first=1).url == B
    assert board.acquire([A, B, C], [None] * 3, "t2", LEASE_MS, first=2).url == C
    assert board.acquire([A, B, C], [None] * 3, "t3", LEASE_MS, first=2).url == A


def test_a_server_at_its_cap_is_skipped_and_a_pick_finds_nothing_when_all_are_full(
    board: ServerLedger,
) -> None:
    picked = take(board, [A, B], [1, 3], 5, first=0)

    assert sorted(p for p in picked if p) == [A, B, B, B]
    assert picked[-1] is None
    assert [(s.inflight, s.cap) for s in board.status([A, B])] == [(1, 1), (3, 3)]


def test_the_server_to_avoid_is_picked_only_when_it_is_the_only_candidate(board: ServerLedger) -> None:
    assert take(board, [A, B], [None, None], 3, avoid=A) == [B, B, B]
    assert take(board, [A, B], [None, 1], 1, avoid=A) == [None]  # B is full: wait rather than go back to A
    assert take(board, [A], [None], 1, avoid=A) == [A]


def test_an_expired_slot_is_dropped_by_the_next_pick(board: ServerLedger) -> None:
    board.acquire([A], [1], "dead-worker", SHORT_MS)
    assert board.acquire([A], [1], "waiting", LEASE_MS).url is None

    expire_short_leases(board.client)

    assert board.status([A])[0].inflight == 0  # status does not count it either
    got = board.acquire([A], [1], "waiting", LEASE_MS)
    assert (got.url, got.inflight) == (A, 1)


def test_a_pick_records_the_servers_for_status(board: ServerLedger) -> None:
    board.acquire([B, A], [None, 4], "t", LEASE_MS)

    assert board.known() == [A, B]
    assert board.client.zscore(SERVERS_SEEN_ZSET, A) is not None


def test_many_threads_picking_at_once_never_hold_more_slots_than_the_caps(board: ServerLedger) -> None:
    caps = {A: 2, B: 3}
    holding = {A: 0, B: 0}
    most = {A: 0, B: 0}
    lock = threading.Lock()

    def worker(n: int) -> None:
        for i in range(15):
            token = f"w{n}-{i}"
            got = board.acquire([A, B], [caps[A], caps[B]], token, LEASE_MS, first=n)
            while got.url is None:
                time.sleep(0.001)
                got = board.acquire([A, B], [caps[A], caps[B]], token, LEASE_MS, first=n)
            with lock:
                holding[got.url] += 1
                most[got.url] = max(most[got.url], holding[got.url])
            time.sleep(0.002)
            with lock:
                holding[got.url] -= 1
            board.release(got.url, token)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert most == caps  # every cap reached, none exceeded
    assert [s.inflight for s in board.status([A, B])] == [0, 0]
    assert sum(s.started for s in board.status([A, B])) == 16 * 15


# --- server_release and server_renew ---------------------------------------------------------------


def test_release_gives_the_slot_back_and_counts_the_request_in_the_rate(board: ServerLedger) -> None:
    for i in range(5):
        board.acquire([A], [None], f"t{i}", LEASE_MS)
    before = redis_ms(board.client)

    ended = [board.release(A, f"t{i}") for i in range(4)]

    status = board.status([A])[0]
    assert status.inflight == 1
    assert status.requests_per_s == 4 / RATE_WINDOW_S
    assert all(before <= e <= redis_ms(board.client) for e in ended)


def test_a_slot_given_back_unused_takes_its_start_back_and_counts_no_request(board: ServerLedger) -> None:
    for i in range(3):
        board.acquire([A], [None], f"t{i}", LEASE_MS)
    board.release(A, "t0")
    board.release_unused(A, "t1")
    board.release_many(A, [], handed_over=2)

    status = board.status([A])[0]
    assert status.inflight == 1  # t2
    assert status.started == 3 - 1 + 2  # three taken, one of them unused, two handed over
    assert status.requests_per_s == (1 + 2) / RATE_WINDOW_S


def test_renewing_keeps_a_slot_past_its_lease_and_a_dropped_slot_is_not_taken_again(
    board: ServerLedger,
) -> None:
    board.acquire([A], [2], "renewed", SHORT_MS)
    board.acquire([A], [2], "dropped", SHORT_MS)
    assert board.renew([(A, "renewed")], LEASE_MS) == [True]

    expire_short_leases(board.client)
    board.acquire([A], [2], "newcomer", LEASE_MS)  # drops the expired slot

    assert board.renew([(A, "renewed"), (A, "dropped")], LEASE_MS) == [True, False]
    assert board.status([A])[0].inflight == 2
    assert board.client.zscore(server_keys(A).slots_zset, "dropped") is None


def test_an_expired_slot_that_no_pick_dropped_yet_can_still_be_renewed(board: ServerLedger) -> None:
    board.acquire([A], [1], "slow-renewal", SHORT_MS)
    expire_short_leases(board.client)

    assert board.renew([(A, "slow-renewal")], LEASE_MS) == [True]
    assert board.acquire([A], [1], "other", LEASE_MS).url is None


# --- server_report ------------------------------------------------------------------------------------


def test_failures_in_a_row_mark_a_server_down_and_a_success_between_them_resets_the_streak(
    board: ServerLedger,
) -> None:
    assert fail(board, A) and fail(board, A)
    assert ok(board, A)
    assert fail(board, A) and fail(board, A)

    assert not fail(board, A)

    status = board.status([A])[0]
    assert (status.up, status.downs, status.failures, status.fails_in_a_row) == (False, 1, 5, 3)
    assert status.down_since_ms is not None and status.last_error == "x"


def test_a_failure_that_ended_before_the_latest_success_is_not_in_the_streak(board: ServerLedger) -> None:
    t = redis_ms(board.client)
    ok(board, A, at_ms=t)
    for late in (t - 30, t - 20, t - 10):  # reported after the success, but they ended before it
        assert fail(board, A, at_ms=late)
    assert board.status([A])[0].fails_in_a_row == 0

    fail(board, A, at_ms=t + 1)
    fail(board, A, at_ms=t + 2)
    ok(board, A, at_ms=t)  # reported late too: it does not reset the newer failures

    status = board.status([A])[0]
    assert (status.fails_in_a_row, status.failures, status.up) == (2, 5, True)


def test_a_down_server_gets_no_pick_while_another_is_up_and_is_still_picked_when_none_is(
    board: ServerLedger,
) -> None:
    for _ in range(THRESHOLD):
        fail(board, A)

    got = board.acquire([A, B], [None, None], "t1", LEASE_MS, first=0)
    assert (got.url, got.dirty) == (B, frozenset({A}))
    assert take(board, [A, B], [None, None], 3, first=0) == [B, B, B]

    for _ in range(THRESHOLD):
        fail(board, B)
    assert take(board, [A, B], [None, None], 2, first=0) == [A, A]  # all down: better than nothing


# --- server_probe -------------------------------------------------------------------------------------


def test_a_down_server_is_probed_once_per_interval_fleet_wide_starting_one_interval_after(
    board: ServerLedger,
) -> None:
    for _ in range(THRESHOLD):
        fail(board, A)

    assert board.probes_due([A, B], PROBE_MS) == []  # just marked down: give it an interval first
    time.sleep(PROBE_MS / 1000 + 0.05)
    assert board.probes_due([A, B], PROBE_MS) == [A]
    assert board.probes_due([A, B], PROBE_MS) == []  # another worker asking now: already claimed
    time.sleep(PROBE_MS / 1000 + 0.05)
    assert board.probes_due([A, B], PROBE_MS) == [A]


def test_a_failed_probe_keeps_a_server_down_and_a_good_one_marks_it_up(board: ServerLedger) -> None:
    for _ in range(THRESHOLD):
        fail(board, A)

    assert not ok(board, A, outcome=ServerOutcome.PROBE_FAIL)
    health = board.report(A, ServerOutcome.PROBE_OK, fail_threshold=THRESHOLD, probe_interval_ms=PROBE_MS)

    assert health.up and health.changed and health.fails == 0
    assert board.probes_due([A], PROBE_MS) == []
    assert board.acquire([A, B], [None, None], "t", LEASE_MS, first=0).url == A


def test_a_generation_that_ends_after_the_server_was_marked_down_marks_it_up(board: ServerLedger) -> None:
    before = redis_ms(board.client)
    for _ in range(THRESHOLD):
        fail(board, A)

    assert not ok(board, A, at_ms=before - 1)  # it ended before the server went down: proves nothing
    assert ok(board, A, at_ms=redis_ms(board.client) + 1)


def test_forget_removes_every_key_of_a_server(board: ServerLedger) -> None:
    board.acquire([A], [None], "t", LEASE_MS)
    fail(board, A)
    board.release(A, "t")

    board.forget(A)

    k = server_keys(A)
    assert board.client.exists(k.slots_zset, k.health_hash, k.rate_hash, k.probe_str) == 0
    assert board.known() == []


def test_status_says_how_long_ago_a_server_last_answered(board: ServerLedger) -> None:
    assert board.status([A])[0].last_ok_s_ago is None  # never answered
    now = redis_ms(board.client)
    ok(board, A, at_ms=now - 90_000)

    (status,) = board.status([A])

    assert status.up and 89 <= (status.last_ok_s_ago or 0) <= 95
