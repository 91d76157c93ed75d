"""A worker process's heartbeat in the ledger: its version and code, so ``status`` can show who is online
and flag one that runs other code than the submitter."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any, Final

from budget import Ledger, LedgerError
from workers.version import full_version

log = logging.getLogger(__name__)

#: Seconds between heartbeats (status calls a worker online for 30 s after its last one).
HEARTBEAT_EVERY_S: Final = 5.0


class Heartbeat:
    def __init__(self, ledger: Ledger, name: str, facts: Callable[[], dict[str, Any]]) -> None:
        self._ledger = ledger
        self._name = name
        self._facts = facts
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenfleet-heartbeat", daemon=True)

    def start(self) -> None:
        self._beat()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(LedgerError):
            self._ledger.heartbeat(self._name, None)

    def _beat(self) -> None:
        base = {"version": full_version(), "host": socket.gethostname(), "pid": os.getpid()}
        try:
            self._ledger.heartbeat(self._name, base | self._facts())
        except LedgerError as e:
            log.warning("heartbeat failed: %s", e)

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_EVERY_S):
            self._beat()
