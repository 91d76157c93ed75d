"""A worker process's heartbeat in the ledger: its version and code, so ``status`` can show who is online
and flag one that runs other code than the submitter, and its facts (its generations in flight).

A beat goes out as soon as the worker turns idle or busy (looked at every ``CHECK_EVERY_S``), for other
changes of its facts at most every ``CHANGE_GAP_S``, and at least every ``HEARTBEAT_EVERY_S``. Beating
only on the timer left the in-flight figure of the last beat standing for up to that long: a job that had
just settled showed a worker with generations in flight while every dataset showed none."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from budget import Ledger, LedgerError
from workers.version import full_version

log = logging.getLogger(__name__)

#: Seconds between heartbeats when nothing changes (status calls a worker online for 30 s after its last).
HEARTBEAT_EVERY_S: Final = 5.0
#: Seconds between looks at the facts: a change is in the ledger at most this much later.
CHECK_EVERY_S: Final = 0.2
#: A changed fact waits at most this long since the last beat (unless the worker just became idle).
CHANGE_GAP_S: Final = 5.0


class Heartbeat:
    def __init__(
        self,
        ledger: Ledger,
        name: str,
        facts: Callable[[], dict[str, Any]],
        every_s: float = HEARTBEAT_EVERY_S,
        check_every_s: float = CHECK_EVERY_S,
    ) -> None:
        self._ledger = ledger
        self._name = name
        self._facts = facts
        self._every_s = every_s
        self._check_every_s = check_every_s
        #: The facts of the last beat that reached the ledger, and when (monotonic) it went out.
        self._sent: dict[str, Any] | None = None
        self._sent_at = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenfleet-heartbeat", daemon=True)

    def start(self) -> None:
        self._beat()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(LedgerError):
            self._ledger.heartbeat(self._name, None)

    def _beat(self, facts: dict[str, Any] | None = None) -> None:
        facts = self._facts() if facts is None else facts
        base = {"version": full_version(), "host": socket.gethostname(), "pid": os.getpid()}
        try:
            self._ledger.heartbeat(self._name, base | facts)
        except LedgerError as e:
            log.warning("heartbeat failed: %s", e)
            return
        self._sent, self._sent_at = facts, time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self._check_every_s):
            facts = self._facts()
            since = time.monotonic() - self._sent_at
            # A change is sent within CHANGE_GAP_S, and at once when the worker becomes idle or busy (a
            # settled job never shows work in flight, a started one shows its worker at work); a busy
            # worker's count changes all the time, and a beat per check would be Redis work per worker
            # that the job does not need.
            was_idle = (self._sent or {}).get("inflight") == 0
            turned = (facts.get("inflight") == 0) != was_idle
            changed = facts != self._sent and (since >= CHANGE_GAP_S or turned)
            if changed or since >= self._every_s:
                self._beat(facts)
