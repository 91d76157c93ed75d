"""The tasks this process runs: what Celery's threads pool does not do for a task that generates.

- **A revoke stops its generations.** ``revoke`` of a running task (Flower's Revoke button, ``celery
  control revoke ID``) only adds the task's id to ``celery.worker.state.revoked`` in a threads pool:
  a thread cannot be killed, and ``terminate`` fails there (``TaskPool.terminate_job`` is not
  implemented; the id is added first). The watcher looks at that set every ``REVOKE_POLL_S`` for the tasks
  running here and stops a revoked one: its samples' leases are marked lost (so the runner gives the
  samples back instead of retrying what looks like a server's abort) and its requests are aborted by rid
  (``StopWatcher.stop_owner``).
- **The lease, not the broker, decides.** A task's message stays unacknowledged while its samples
  generate (late acks), and kombu's Redis transport delivers a message again once it has been
  unacknowledged for the visibility timeout, however long the task runs. The watcher renews the delivery
  time of each running task's message in the transport's ``unacked_index`` every quarter of the timeout,
  so a running group is never delivered twice. A killed worker renews nothing: its samples' leases expire
  and the ledger feeds them again; its message comes back after the timeout and is dropped as done.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final

import redis

from workers.leases import Lease

log = logging.getLogger(__name__)

#: How often the watcher looks for revoked tasks among those running here: a revoke stops the task's
#: generations within a second (the abort takes a round trip and one decode step after this).
REVOKE_POLL_S: Final = 0.1
#: kombu's Redis transport: the sorted set of unacknowledged deliveries, scored by delivery time (its
#: ``unacked_index_key`` transport option).
UNACKED_INDEX_KEY: Final = "unacked_index"


@dataclass(eq=False, slots=True)
class TaskRun:
    """One task running here: its id, its message's delivery tag, its samples' leases."""

    task_id: str
    delivery_tag: str | None
    leases: list[Lease] = field(default_factory=list)
    #: Set once the task was found revoked (and its generations stopped).
    revoked: threading.Event = field(default_factory=threading.Event)


class RunningTasks:
    """This process's running tasks, and the thread that stops revoked ones and keeps the others'
    messages from being delivered again."""

    def __init__(
        self,
        is_revoked: Callable[[str], bool],
        stop_task: Callable[[str], Any],
        broker: redis.Redis | None,
        visibility_timeout_s: float,
        unacked_index_key: str = UNACKED_INDEX_KEY,
        poll_s: float = REVOKE_POLL_S,
    ) -> None:
        self._is_revoked = is_revoked
        self._stop_task = stop_task
        self._broker = broker
        self._renew_every_s = max(1.0, visibility_timeout_s / 4)
        self._index_key = unacked_index_key
        self._poll_s = poll_s
        self._lock = threading.Lock()
        self._runs: dict[str, TaskRun] = {}
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def running(self, task_id: str, delivery_tag: str | None, leases: list[Lease]) -> Iterator[TaskRun]:
        run = TaskRun(task_id, delivery_tag, leases)
        with self._lock:
            self._runs[task_id] = run
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="tokenfleet-tasks", daemon=True)
                self._thread.start()
        try:
            if self._is_revoked(task_id):  # revoked between its delivery and now
                self._revoke(run)
            yield run
        finally:
            with self._lock:
                self._runs.pop(task_id, None)

    @property
    def count(self) -> int:
        with self._lock:
            return len(self._runs)

    def close(self) -> None:
        self._closed.set()

    def check(self) -> None:
        """Stop the running tasks that were revoked since the last look."""
        with self._lock:
            runs = [r for r in self._runs.values() if not r.revoked.is_set()]
        for run in runs:
            if self._is_revoked(run.task_id):
                self._revoke(run)

    def renew(self) -> None:
        """Mark each running task's message delivered now (``ZADD XX``: never one already acknowledged)."""
        if self._broker is None:
            return
        now = time.time()
        with self._lock:
            tags = {r.delivery_tag: now for r in self._runs.values() if r.delivery_tag}
        if tags:
            self._broker.zadd(self._index_key, tags, xx=True)  # type: ignore[arg-type]

    def _revoke(self, run: TaskRun) -> None:
        run.revoked.set()
        for lease in run.leases:
            lease.lost.set()
        stopped = self._stop_task(run.task_id)
        log.warning("task %s revoked: stopping its generations (%s request(s) aborted)", run.task_id, stopped)

    def _watch(self) -> None:
        next_renew = time.monotonic() + self._renew_every_s
        while not self._closed.wait(self._poll_s):
            try:
                self.check()
                if time.monotonic() >= next_renew:
                    next_renew = time.monotonic() + self._renew_every_s
                    self.renew()
            except redis.RedisError as e:  # the broker away for a moment: renewed at the next round
                log.warning("renewing the running tasks' deliveries failed: %s", e)
            except Exception:  # never let the watcher die: revokes would no longer stop generations
                log.exception("running tasks' watcher: unexpected error")
