"""How many generations a worker process runs at once, and the wait for room before it takes more.

A task's samples (one, or a group of ``samples_per_task``) are admitted together and then run in the
process's generation pool on their own: the task returns (its message is acknowledged) once they are
admitted, and a sample that ends frees its room at once for the next message's, whatever the rest of its
group does. The room is sized from the caps of the servers of the datasets the process has run (their sum
and spares, so a sample is ready whenever a server slot frees), and it says when that changes; where a
server has no cap (a router, a server submit could not ask) it is the worker's ``--concurrency``. Within
that, a process takes at most twice the server slots it holds (``FOLLOW_MIN`` at least; more when short
generations end faster than messages are admitted), so each of its samples waits about one generation for a
slot however the fleet's slots are split between processes, and samples start close to their order in the
source.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Final

log = logging.getLogger(__name__)

#: Room before the process has seen any dataset's servers, and when a server has no cap: the worker's
#: ``--concurrency`` replaces it (``ProcessRoom.default``).
DEFAULT_ROOM: Final = 32
#: Room at least, and at most, whatever the servers' caps.
MIN_ROOM: Final = 8
MAX_ROOM: Final = 4096
#: Samples admitted beyond what the servers can run at once: as many again for small caps, at most this
#: many more. A spare sample only needs to be ready when a slot frees; at a cap of 1,024 twice the cap
#: was 2,048 threads a process, and in a 1,024-in-flight run they queued for the GIL and the process's
#: locks while the server sat idle.
SPARE_MAX: Final = 128
#: Within its limit, a process takes at most the server slots it holds and as many again (and at least
#: this many): its samples wait for a slot about one generation, in whichever process they land. A room of
#: caps plus spares in every process let the process holding fewer slots queue several times more samples
#: per slot, and run them after the rest of the source (docs/scaling.md, "Samples started in their order").
FOLLOW_MIN: Final = 32
#: ... and as many as end in this long, when that is more: short generations end faster than a task thread
#: takes the next message and admits it (answers of 7 tokens end 30 times a second per slot).
REFILL_S: Final = 0.25
#: How often the rate of ends is measured.
RATE_EVERY_S: Final = 0.5
#: A task thread waiting for room looks again this often at least (the picker wakes it when it takes slots,
#: and an ended generation when it frees room).
FOLLOW_POLL_S: Final = 0.25


def room_for(caps: Mapping[str, int | None], default: int = DEFAULT_ROOM) -> int:
    """The room for servers with these caps (None: no cap, unknown: ``default``)."""
    if not caps or any(c is None for c in caps.values()):
        return default
    total = sum(c for c in caps.values() if c is not None)
    return max(MIN_ROOM, min(MAX_ROOM, total + min(total, SPARE_MAX)))


class ProcessRoom:
    """A counting semaphore whose size can change: ``take(n)`` waits for room for n generations."""

    def __init__(self, limit: int = DEFAULT_ROOM) -> None:
        self._cond = threading.Condition()
        self._limit = limit
        self._default = limit
        self._used = 0
        self._sized_by: dict[str, int] = {}
        self._turns: deque[object] = deque()  # takes waiting, in the order they came
        self._slots: Callable[[], int] | None = None
        self._ends_per_s = 0.0  # generations that ended a second, over the last RATE_EVERY_S or more
        self._ends = 0
        self._ends_since = time.monotonic()

    def default(self, limit: int) -> None:
        """The room where no dataset's servers tell (the worker's ``--concurrency``)."""
        with self._cond:
            self._default = max(1, limit)
            if not self._sized_by:
                self._limit = self._default
                self._cond.notify_all()

    def follow(self, slots: Callable[[], int]) -> None:
        """Size the room by ``slots()``, the server slots this process holds, too (see ``FOLLOW_MIN``)."""
        with self._cond:
            self._slots = slots

    def wake(self) -> None:
        """The slots held changed: look at the room again."""
        with self._cond:
            self._cond.notify_all()

    @property
    def limit(self) -> int:
        return self._limit

    def room_now(self) -> int:
        """The room at this moment: the limit, or when smaller, the slots held and as many again (or as
        many as end in ``REFILL_S``, when more)."""
        if self._slots is None:
            return self._limit
        held = self._slots()
        return min(self._limit, max(FOLLOW_MIN, held + max(held, int(self._ends_per_s * REFILL_S))))

    @property
    def used(self) -> int:
        with self._cond:
            return self._used

    def fit(self, dataset: str, caps: Mapping[str, int | None]) -> None:
        """Size the room for ``dataset``'s servers (the largest room any dataset asks for)."""
        want = room_for(caps, self._default)
        with self._cond:
            if self._sized_by.get(dataset) == want:
                return
            self._sized_by[dataset] = want
            limit = max(self._sized_by.values())
            if limit != self._limit:
                log.warning(
                    "room for %d generations at once in this process (%s: servers' caps %s, and spares)",
                    limit,
                    dataset,
                    dict(caps),
                )
                self._limit = limit
                self._cond.notify_all()

    def take(self, n: int) -> None:
        """Wait until ``n`` more fit (a group larger than the whole room waits for an empty one). Takes are
        served in the order they came: task threads take messages in the queue's order, and waking them
        all to race for the room (a plain condition) started groups hundreds of places out of order."""
        turn = object()
        with self._cond:
            self._turns.append(turn)
            try:
                while self._turns[0] is not turn or (self._used > 0 and self._used + n > self.room_now()):
                    self._cond.wait(FOLLOW_POLL_S if self._slots is not None else None)
                self._used += n
            finally:
                self._turns.remove(turn)
                self._cond.notify_all()  # the next in line may fit too

    def give(self, n: int = 1, *, ended: bool = True) -> None:
        """Free room for ``n``: generations that ended (counted in the rate of ends), or samples that never
        ran (``ended=False``: dropped at admission, or an admission that failed)."""
        with self._cond:
            self._used = max(0, self._used - n)
            if ended:
                self._ends += n
            now = time.monotonic()
            if now - self._ends_since >= RATE_EVERY_S:
                self._ends_per_s = self._ends / (now - self._ends_since)
                self._ends, self._ends_since = 0, now
            self._cond.notify_all()
