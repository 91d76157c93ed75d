"""A worker process's room (``workers.room``): sized by the servers' caps, and once it is, by the server
slots the process holds, so its samples wait for a slot about one generation whichever process took them."""

from __future__ import annotations

import threading
import time

from workers.room import FOLLOW_MIN, RATE_EVERY_S, SPARE_MAX, ProcessRoom

CAPS = {"http://a:30000": 64}


def room_holding(slots: list[int], caps: dict[str, int | None] | None = None) -> ProcessRoom:
    """A room sized for ``caps`` (default: one server of 64), following ``slots[0]`` slots held."""
    room = ProcessRoom(limit=8)
    room.follow(lambda: slots[0])
    room.fit("d", CAPS if caps is None else caps)
    return room


def taken_in_thread(room: ProcessRoom, n: int) -> threading.Event:
    """``room.take(n)`` in a thread; the event is set once it returned."""
    took = threading.Event()

    def take() -> None:
        room.take(n)
        took.set()

    threading.Thread(target=take, daemon=True).start()
    return took


def test_a_room_sized_by_caps_takes_twice_the_slots_the_process_holds() -> None:
    slots = [40]
    room = room_holding(slots)

    assert room.limit == 64 + 64  # the caps and as many spares
    assert room.room_now() == 80


def test_a_process_holding_few_slots_still_takes_the_minimum_and_never_more_than_caps_and_spares() -> None:
    slots = [0]
    room = room_holding(slots)
    assert room.room_now() == FOLLOW_MIN

    slots[0] = 1_000  # more than it could hold: the caps-and-spares room still bounds it
    assert room.room_now() == 64 + 64

    big = room_holding([5_000], caps={"http://a:30000": 4096})
    assert big.room_now() == big.limit == 4096  # MAX_ROOM
    assert room_holding([1_000], caps={"http://a:30000": 1024}).room_now() == 1024 + SPARE_MAX


def test_a_take_past_the_slots_waits_until_the_process_holds_more_slots() -> None:
    slots = [16]
    room = room_holding(slots)
    room.take(FOLLOW_MIN)  # two per slot held: full

    took = taken_in_thread(room, 4)
    assert not took.wait(0.3)

    slots[0] = 20  # the picker took slots, and says so
    room.wake()
    assert took.wait(2)
    assert room.used == FOLLOW_MIN + 4


def test_a_room_without_caps_grows_to_the_workers_concurrency_as_the_process_holds_slots() -> None:
    # a router or a server without a cap: the room is the worker's --concurrency, reached as slots are held
    slots = [0]
    room = ProcessRoom()
    room.default(128)  # at the worker's start
    room.follow(lambda: slots[0])
    room.fit("d", {"http://a:30000": None})

    assert room.limit == 128 and room.room_now() == FOLLOW_MIN
    slots[0] = 50
    assert room.room_now() == 100
    slots[0] = 120
    assert room.room_now() == 128


def test_an_empty_room_always_takes_a_group_even_larger_than_its_room() -> None:
    room = room_holding([0])

    took = taken_in_thread(room, FOLLOW_MIN + 10)

    assert took.wait(2)  # nothing in flight: a group never waits for room it can never have


def test_generations_ending_fast_widen_the_room_and_samples_dropped_at_admission_do_not() -> None:
    dropped, ended = room_holding([10]), room_holding([10])
    for room in (dropped, ended):
        room.take(400)  # an empty room takes any group
    time.sleep(RATE_EVERY_S)  # the rate of ends is measured over at least this long

    dropped.give(400, ended=False)  # never ran: no generation ended
    ended.give(400)

    assert dropped.room_now() == FOLLOW_MIN  # twice the 10 slots held is less than the minimum
    # about 800 ends a second: room for those that end in REFILL_S on top of the 10 slots held, past the
    # minimum (within the caps-and-spares limit of 128)
    assert FOLLOW_MIN < ended.room_now() <= ended.limit
