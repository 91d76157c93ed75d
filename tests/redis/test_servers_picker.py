"""The worker's ServerPicker in one process, against real Redis; the fleet-wide claims (several worker
processes, killed workers, servers that stop) are in ``tests/integration/test_servers.py``."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from budget.keys import server_keys
from budget.server_board import ServerLedger, ServerOutcome
from tests.support.fleet import wait_until
from tokenfleet.sim import SimConfig, SimServerThread
from workers.server_picker import (
    CANCEL_CHECK_S,
    WAIT_GRANTED_S,
    WAIT_IDLE_MAX_S,
    WAIT_MAX_S,
    ServerPicker,
    SlotWaitCancelled,
    caps_for,
)
from workers.sglang.client import ServerBusy, ServerUnavailable

pytestmark = pytest.mark.redis

A, B = "http://a:30000", "http://b:30000"
LEASE_MS = 400
PROBE_S = 0.2


@pytest.fixture
def make_picker(redis_client: redis.Redis) -> Iterator[Callable[..., ServerPicker]]:
    made: list[ServerPicker] = []

    def make(lease_ms: int = LEASE_MS) -> ServerPicker:
        made.append(ServerPicker(redis_client, lease_ms, probe_interval_s=PROBE_S))
        return made[-1]

    yield make
    for picker in made:
        picker.close()


def inflight(board: ServerLedger, *urls: str) -> list[int]:
    return [s.inflight for s in board.status(list(urls))]


def test_caps_are_one_for_every_server_or_one_per_server_url() -> None:
    assert caps_for([A, B], None) == [None, None]
    assert caps_for([A, B], 4) == [4, 4]
    assert caps_for([A, B], {A: 2}) == [2, None]


def test_use_holds_a_slot_while_the_block_runs_and_gives_it_back_after(
    make_picker: Callable[[], ServerPicker],
) -> None:
    picker = make_picker()

    with picker.use([A, B]) as first, picker.use([A, B]) as second:
        assert {first, second} == {A, B}
        assert inflight(picker.board, A, B) == [1, 1]

    assert inflight(picker.board, A, B) == [0, 0]
    assert sum(s.requests_per_s for s in picker.board.status([A, B])) > 0


def test_a_slot_is_given_back_when_the_block_raises(make_picker: Callable[[], ServerPicker]) -> None:
    picker = make_picker()

    with pytest.raises(RuntimeError), picker.use([A], caps=1):
        raise RuntimeError("a bug in the block")

    assert inflight(picker.board, A) == [0]


def test_a_long_generation_keeps_its_slot_because_the_picker_renews_it(
    make_picker: Callable[..., ServerPicker],
) -> None:
    # a lease long enough that a loaded machine's pause between two renewals (a quarter lease) is no risk
    lease_ms = 1200
    picker, other = make_picker(lease_ms), make_picker(lease_ms)

    with picker.use([A], caps=1):
        time.sleep(2.5 * lease_ms / 1000)
        with pytest.raises(TimeoutError):
            with_timeout(other, [A], caps=1, timeout_s=0.5)


def test_a_picker_that_stops_renewing_loses_its_slots_after_one_lease(
    make_picker: Callable[[], ServerPicker],
) -> None:
    dying, other = make_picker(), make_picker()
    with dying.use([A], caps=1):
        dying.close()  # like a killed worker: nobody renews the slot any more
        started = time.monotonic()
        closed_ms = dying.board.now_ms()
        ((_, expiry_ms),) = dying.board.client.zrange(server_keys(A).slots_zset, 0, -1, withscores=True)
        with other.use([A], caps=1) as server:
            waited_s = time.monotonic() - started

    assert server == A
    # The lease ran at most a lease from its last renewal (renewed every quarter lease), on Redis's clock
    expires_in_s = (expiry_ms - closed_ms) / 1000
    assert LEASE_MS / 1000 * 0.5 < expires_in_s <= LEASE_MS / 1000
    # taken after it expired, at the waiter's next ask (asks that find nothing back off up to
    # WAIT_IDLE_MAX_S), with room for a loaded machine's scheduling
    assert expires_in_s - 0.01 < waited_s < expires_in_s + WAIT_IDLE_MAX_S + 1.0


def with_timeout(picker: ServerPicker, servers: list[str], caps: int, timeout_s: float) -> None:
    """Enter and leave ``picker.use`` in a thread; TimeoutError when it did not get a slot in time."""
    got = threading.Event()

    def run() -> None:
        with picker.use(servers, caps=caps):
            got.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    if not got.wait(timeout_s):
        raise TimeoutError


def wait_for_waiting(picker: ServerPicker, n: int) -> None:
    """Until ``n`` generations of ``picker`` wait for a slot."""
    wait_until(lambda: len(picker._waiting) == n, 5, f"{n} generation(s) waiting for a slot")


def pick_times(picker: ServerPicker) -> list[float]:
    """When ``picker`` asked for slots (its ``acquire_many`` script calls), monotonic seconds."""
    original = picker.board.acquire_many
    times: list[float] = []

    def timed_acquire(*args: object, **kwargs: object) -> object:
        times.append(time.monotonic())
        return original(*args, **kwargs)  # type: ignore[arg-type]

    picker.board.acquire_many = timed_acquire  # type: ignore[method-assign,assignment]
    return times


def test_a_picker_waits_while_every_server_is_at_its_cap_without_spinning_redis(
    make_picker: Callable[[], ServerPicker],
) -> None:
    picker = make_picker()
    picks = pick_times(picker)
    holder = make_picker()
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with holder.use([A, B], caps=1), holder.use([A, B], caps=1):
            holding.set()
            release.wait()

    threading.Thread(target=hold, daemon=True).start()
    holding.wait()
    released_at: list[float] = []

    def give_back() -> None:
        released_at.append(time.monotonic())
        release.set()

    threading.Timer(1.0, give_back).start()
    started = time.monotonic()

    with picker.use([A, B], caps=1):
        got_at = time.monotonic()

    # a slot given back by another process is seen at the next ask: the asks back off from WAIT_MAX_S
    # to WAIT_IDLE_MAX_S while they find none (counted from the give-back, which a late timer delays)
    assert got_at - started > 0.9
    assert got_at - released_at[0] < WAIT_IDLE_MAX_S + 0.5
    assert 1 <= len(picks) <= 8, f"{len(picks)} picks in one second of waiting"


def test_a_slot_wait_ends_within_the_cancel_check_once_its_generation_is_stopped_without_more_picks(
    make_picker: Callable[[], ServerPicker],
) -> None:
    picker = make_picker()
    picks = pick_times(picker)
    holder = make_picker()
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with holder.use([A], caps=1):
            holding.set()
            release.wait()

    holder_thread = threading.Thread(target=hold, daemon=True)
    holder_thread.start()
    holding.wait()
    stopped = threading.Event()
    stopped_at: list[float] = []

    def stop() -> None:
        stopped_at.append(time.monotonic())
        stopped.set()

    # stopped between two checks (every CANCEL_CHECK_S from about the wait's start), not on one
    threading.Timer(2.5 * CANCEL_CHECK_S, stop).start()
    try:
        with pytest.raises(SlotWaitCancelled), picker.use([A], caps=1, cancelled=stopped.is_set):
            pass
        late_s = time.monotonic() - stopped_at[0]  # from the stop itself (a loaded machine's timer is late)
    finally:
        release.set()
        holder_thread.join(timeout=10)  # its slot given back before the fixture closes the client
    assert late_s < CANCEL_CHECK_S + 0.25, f"the wait ended {late_s:.3f} s after the stop"
    # the checks for stops cost no picks: the asks still back off to WAIT_IDLE_MAX_S
    assert 1 <= len(picks) <= 6, f"{len(picks)} picks in about a second of waiting"


def test_a_slot_given_back_in_the_same_process_wakes_a_waiting_thread_at_once(
    make_picker: Callable[[], ServerPicker],
) -> None:
    picker = make_picker()
    picks = pick_times(picker)
    holding, release = threading.Event(), threading.Event()
    released: list[tuple[float, int]] = []  # when the holder's block ended, and the picks by then

    def hold() -> None:
        with picker.use([A], caps=1):
            holding.set()
            release.wait()
            released.append((time.monotonic(), len(picks)))

    threading.Thread(target=hold, daemon=True).start()
    holding.wait()
    threading.Timer(1.0, release.set).start()  # by then the waiter asks every WAIT_IDLE_MAX_S at most

    with picker.use([A], caps=1):
        got_at, picks_then = time.monotonic(), len(picks)

    # handed over, not found by an ask: no pick between the release and the take, and no wait for one
    assert picks_then == released[0][1]
    late_s = got_at - released[0][0]
    assert late_s < 0.1, f"the waiter got the slot {late_s:.3f} s after it was given back"


def test_slots_another_process_gives_back_one_by_one_are_taken_soon_after_the_first(
    make_picker: Callable[[], ServerPicker],
) -> None:
    """At a dataset's end a process with waiting generations takes the slots other processes give back
    (they have none waiting): once asking has found one, it asks again within WAIT_GRANTED_S."""
    holder, taker = make_picker(), make_picker()
    asked_at = pick_times(taker)
    n, every_s = 30, 0.02  # 50 ends a second, as a busy server's
    held, end = threading.Barrier(n + 1), threading.Event()
    go = [threading.Event() for _ in range(n)]
    released_at: dict[int, float] = {}
    got_at: list[float] = []

    def hold(i: int) -> None:
        with holder.use([A], caps=n):
            held.wait()
            go[i].wait()
        released_at[i] = time.monotonic()

    def take() -> None:
        with taker.use([A], caps=n):
            got_at.append(time.monotonic())
            end.wait()

    threads = [threading.Thread(target=hold, args=(i,)) for i in range(n)]
    threads += [threading.Thread(target=take) for _ in range(n)]
    for t in threads[:n]:
        t.start()
    held.wait()
    for t in threads[n:]:
        t.start()
    wait_for_waiting(taker, n)
    time.sleep(1.5)  # asking found nothing for a while: the taker asks once a second now
    go[0].set()
    wait_until(lambda: len(got_at) == 1, 5, "the first slot taken")  # within a second
    for i in range(1, n):
        go[i].set()
        time.sleep(every_s)
    wait_until(lambda: len(got_at) == n, 5, "every slot taken")
    end.set()
    for t in threads:
        t.join(5)

    late = sorted(got - released_at[i] for i, got in enumerate(sorted(got_at)) if i > 0)
    print(f"slots taken {[round(x, 2) for x in late]} s after their release")
    # once the first was found, the next ones are found by asks WAIT_GRANTED_S apart, not WAIT_MAX_S
    # (0.25 s) or more: the asks' own spacing, which a loaded machine's late wake-ups hardly move
    first, last = min(got_at), max(got_at)
    asks = [t for t in asked_at if first - 0.01 <= t <= last]
    gaps = sorted(b - a for a, b in itertools.pairwise(asks))
    assert len(gaps) >= 5 and gaps[len(gaps) // 2] < (WAIT_GRANTED_S + WAIT_MAX_S) / 2, gaps


def test_failures_named_by_retries_mark_a_server_down_and_new_work_goes_to_the_others(
    make_picker: Callable[[], ServerPicker],
) -> None:
    picker = make_picker()
    error = ServerUnavailable("HTTP 503: busy", server=B, status=503)

    for _ in range(3):  # what the runner does: an attempt on B fails, its retry avoids B
        with picker.use([B]):
            picker.failed(B, error)
        with picker.use([A, B], avoid=B) as retried_on:
            assert retried_on == A

    status = {s.url: s for s in picker.board.status([A, B])}
    assert not status[B].up and status[B].failures == 3 and status[B].last_error == "HTTP 503: busy"
    assert status[A].up
    for _ in range(5):
        with picker.use([A, B]) as server:
            assert server == A


def test_a_success_between_failures_resets_the_streak(make_picker: Callable[[], ServerPicker]) -> None:
    picker = make_picker()
    error = ServerUnavailable("connection refused", server=B)
    for _ in range(2):
        with picker.use([B]):
            picker.failed(B, error)
        with picker.use([A, B], avoid=B):
            pass
    with picker.use([B]):
        pass  # answered: the thread's next generation names nobody
    with picker.use([A]):
        pass

    assert picker.board.status([B])[0].fails_in_a_row == 0


def test_a_failure_is_told_at_once_and_not_later_as_a_success(
    make_picker: Callable[[], ServerPicker],
) -> None:
    picker = make_picker()
    error = ServerUnavailable("HTTP 503: down", server=B, status=503)
    for expected in (1, 2):  # two tasks whose only attempt failed on B, then gave up
        with picker.use([B]):
            picker.failed(B, error)
        assert picker.board.status([B])[0].fails_in_a_row == expected  # before any retry asks
    with picker.use([A]):
        pass  # the thread's next generation, elsewhere: it says nothing about B

    status = picker.board.status([B])[0]
    assert status.fails_in_a_row == 2 and status.last_error == "HTTP 503: down"


def test_a_failed_generation_does_not_hand_its_slot_to_a_waiting_one_and_a_busy_one_is_not_counted(
    make_picker: Callable[[], ServerPicker],
) -> None:
    picker = make_picker()
    holding, end_hold = threading.Event(), threading.Event()
    picked: list[str] = []

    def failing_generation() -> None:
        with picker.use([A, B], caps=1) as server:
            holding.set()
            end_hold.wait()
            picker.failed(server, ServerUnavailable("connection refused", server=server))

    def waiting_generation() -> None:
        with picker.use([B], caps=1) as server:
            picked.append(server)

    with picker.use([A], caps=1):  # A is full: the failing generation runs on B
        threads = [threading.Thread(target=failing_generation), threading.Thread(target=waiting_generation)]
        threads[0].start()
        holding.wait()
        threads[1].start()
        wait_for_waiting(picker, 1)
        picks = pick_times(picker)
        end_hold.set()
        threads[1].join(5)
        threads[0].join(5)
    # the waiting generation got B from a pick in Redis, not from the failed generation's hands
    assert picked == [B] and len(picks) >= 1
    with picker.use([B]):
        picker.failed(B, ServerBusy("HTTP 503: queue full", server=B, status=503))
    assert picker.board.status([B])[0].fails_in_a_row == 1


def test_a_success_handed_over_before_a_server_went_down_does_not_mark_it_up_when_reported_after(
    make_picker: Callable[[], ServerPicker],
) -> None:
    """A generation that ends and hands its slot to a waiting one makes no Redis call; its success is
    reported at its thread's next use, after the server may have died. It is ordered by when it ended."""
    picker = make_picker()
    holding, end_hold, reported = threading.Event(), threading.Event(), threading.Event()
    next_use = threading.Event()

    def first_generation() -> None:
        with picker.use([B], caps=1):
            holding.set()
            end_hold.wait()
        next_use.wait()
        with picker.use([A]):  # its next generation: the success on B is reported now
            reported.set()

    def waiting_generation() -> None:
        with picker.use([B], caps=1):
            pass

    threads = [threading.Thread(target=first_generation), threading.Thread(target=waiting_generation)]
    threads[0].start()
    holding.wait()
    threads[1].start()
    wait_for_waiting(picker, 1)
    end_hold.set()  # the slot goes straight to the waiting generation
    threads[1].join(5)
    assert picker.board.status([B])[0].requests_per_s > 0  # both ran on B

    time.sleep(0.01)  # then B dies: its failures come after that success
    picker.board.report(B, ServerOutcome.FAIL, fail_threshold=1, probe_interval_ms=60_000, message="refused")
    with picker.use([A, B]) as server:  # a pick that sees B down
        assert server == A
    next_use.set()
    assert reported.wait(5)
    threads[0].join(5)

    assert not picker.board.status([B])[0].up


@pytest.fixture
def sim() -> Iterator[SimServerThread]:
    with SimServerThread(SimConfig(port=0, step_time_s=0.002)) as server:
        yield server


def test_a_down_server_is_probed_and_marked_up_once_its_health_answers(
    make_picker: Callable[[], ServerPicker], sim: SimServerThread
) -> None:
    picker = make_picker()
    dead = "http://127.0.0.1:1"
    for server in (sim.url, dead):
        for _ in range(3):
            picker.board.report(
                server, ServerOutcome.FAIL, fail_threshold=3, probe_interval_ms=int(PROBE_S * 1000)
            )
    with picker.use([sim.url, dead]):
        pass  # the picker learns of both servers

    deadline = time.monotonic() + 5
    while not picker.board.status([sim.url])[0].up:
        assert time.monotonic() < deadline, "the healthy server was never marked up"
        time.sleep(0.05)

    status = {s.url: s for s in picker.board.status([sim.url, dead])}
    assert status[sim.url].up and not status[dead].up
    assert "/health" in status[dead].last_error
