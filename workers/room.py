"""How many generations a worker process runs at once, and the wait for room before it takes more.

A group task's samples are admitted together and then run in the process's generation pool on their own:
the task returns (its message is acknowledged) once they are admitted, and a sample that ends frees its
room at once for the next message's, whatever the rest of its group does. The room is the process's
share of the servers: sized from the caps of the servers of the datasets it has run (their sum and spares,
so a sample is ready whenever a server slot frees), and it says when that changes. Where a server has no cap
(a router, a server submit could not ask) the room is the worker's ``--concurrency``, as when each
generation held a Celery thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
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

    def default(self, limit: int) -> None:
        """The room where no dataset's servers tell (the worker's ``--concurrency``)."""
        with self._cond:
            self._default = max(1, limit)
            if not self._sized_by:
                self._limit = self._default
                self._cond.notify_all()

    @property
    def limit(self) -> int:
        return self._limit

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
        """Wait until ``n`` more fit (a group larger than the whole room waits for an empty one)."""
        with self._cond:
            while self._used > 0 and self._used + n > self._limit:
                self._cond.wait()
            self._used += n

    def give(self, n: int = 1) -> None:
        with self._cond:
            self._used = max(0, self._used - n)
            self._cond.notify_all()
