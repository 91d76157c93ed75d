"""Group calls: many threads' calls of the same kind answered by one Redis round trip.

Each ledger or server-board call a generation makes (commit, a slot's release, a slot's pick) is a Lua
script whose cost is mostly per call, not per item. A ``CallBatcher`` queues the calls of a worker
process's threads and runs those queued together, per key (a dataset, a server), as one batched call: when
the process is idle a call runs at once (a batch of one), and under load every call that arrives while the
previous batch runs joins the next one. The Redis cost per generation then falls as the load rises instead
of growing with it. Each caller gets its own answer, or the batch's error, as if it had called alone.

A batcher may also linger: wait after a batch's first call for more to join it, ``linger_s``, and longer
while fewer than ``target_batch`` calls are queued, up to ``max_linger_s`` (calls that come slowly still
share a call), unless a queued call is in a hurry. It never waits for calls that cannot come: when
``callers()`` (how many calls may still come: the process's generations in flight) says every one of them
is queued, the batch runs at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")
R = TypeVar("R")

#: Items in one batched call at most (one script's arguments stay small).
MAX_BATCH: Final = 256


@dataclass(eq=False, slots=True)
class _Call(Generic[K, T, R]):
    key: K
    item: T
    hurry: bool = False
    #: Queued by ``post``: nobody waits for its answer.
    posted: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    result: R | None = None
    error: BaseException | None = None


class CallBatcher(Generic[K, T, R]):
    """``call(key, item)`` from any thread; ``run(key, items)`` answers a batch, one result per item."""

    def __init__(
        self,
        name: str,
        run: Callable[[K, Sequence[T]], Sequence[R]],
        max_batch: int = MAX_BATCH,
        linger_s: float = 0.0,
        *,
        max_linger_s: float | None = None,
        target_batch: int = 1,
        callers: Callable[[], int] | None = None,
    ) -> None:
        self._name = name
        self._run_batch = run
        self._max_batch = max_batch
        #: How long a batch waits for more calls after its first (0: it runs at once); longer, up to
        #: max_linger_s, while fewer than target_batch are queued.
        self._linger_s = linger_s
        self._max_linger_s = max(linger_s, max_linger_s if max_linger_s is not None else linger_s)
        self._target_batch = max(1, target_batch)
        self._callers = callers

        self._cond = threading.Condition()
        self._queue: list[_Call[K, T, R]] = []
        self._thread: threading.Thread | None = None

    def call(self, key: K, item: T, *, hurry: bool = False) -> R:
        """Answer ``item``; ``hurry``: its batch lingers no longer than ``linger_s`` (others wait on it)."""
        waiting = self._queued(key, item, hurry)
        waiting.done.wait()
        if waiting.error is not None:
            raise waiting.error
        return waiting.result  # type: ignore[return-value]

    def post(self, key: K, item: T, *, hurry: bool = False) -> None:
        """Queue ``item`` without waiting for its answer: it runs in order with the calls queued before and
        after it (a call queued after it is in the same batch or a later one). Its error is logged."""
        self._queued(key, item, hurry, posted=True)

    def _queued(self, key: K, item: T, hurry: bool, *, posted: bool = False) -> _Call[K, T, R]:
        waiting: _Call[K, T, R] = _Call(key, item, hurry, posted=posted)
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name=f"tokenfleet-{self._name}", daemon=True
                )
                self._thread.start()
            self._queue.append(waiting)
            self._cond.notify()
        return waiting

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                if self._linger_s > 0:
                    start = time.monotonic()
                    enough, deadline = start + self._linger_s, start + self._max_linger_s
                    while len(self._queue) < self._max_batch and not self._all_queued():
                        now = time.monotonic()
                        full = len(self._queue) >= self._target_batch or any(c.hurry for c in self._queue)
                        if now >= deadline or (now >= enough and full):
                            break
                        wait = (enough if full else deadline) - now
                        self._cond.wait(min(wait, 0.05) if self._callers is not None else wait)
                batch, self._queue = self._queue[: self._max_batch], self._queue[self._max_batch :]
            by_key: dict[K, list[_Call[K, T, R]]] = {}
            for c in batch:
                by_key.setdefault(c.key, []).append(c)
            for key, calls in by_key.items():
                self._answer(key, calls)

    def _all_queued(self) -> bool:
        """Whether no more calls can come (every caller that may still call is queued)."""
        return self._callers is not None and len(self._queue) >= self._callers()

    def _answer(self, key: K, calls: list[_Call[K, T, R]]) -> None:
        try:
            results = self._run_batch(key, [c.item for c in calls])
            for c, result in zip(calls, results, strict=True):
                c.result = result
        except BaseException as e:  # every caller sees the error, as if its own call had failed
            for c in calls:
                c.error = e
            if any(c.posted for c in calls):
                log.warning("%s: a batched call failed: %s", self._name, e)
        finally:
            for c in calls:
                c.done.set()
