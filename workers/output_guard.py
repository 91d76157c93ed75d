"""A worker that cannot write a dataset's output stops taking that dataset's work at once.

Two things block a dataset in a worker process: the storage check (``budget.storage``: the worker's
``output_dir`` must hold the marker submit wrote there, so a worker on a host without the shared storage
refuses instead of writing records nobody exports), and a record that could not be written.

When a record cannot be written (``OutputUnwritable``: a full disk, a read-only or vanished folder, no
permission, a quota), the generation is not counted, the sample goes back to pending (for this worker once
it can write again, or for another), and the dataset is blocked in this process: its next tasks are handed
back without a server call, and the problem is in the ledger for ``status``, the metrics and Flower. Every
``RECHECK_S`` the worker writes a probe file there; once that works, the block and the problem are gone and
the work goes on. Retrying generations instead would burn GPU time on outputs thrown away.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from budget import Ledger, LedgerError
from budget.storage import check_same_storage
from workers.sink import OutputSink, OutputUnwritable

log = logging.getLogger(__name__)

#: How often a blocked dataset's output folder is tried again.
RECHECK_S: Final = 10.0
#: A task of a blocked dataset waits this long before it is handed back, so that a queue of them does not
#: spin through the broker while the disk is full.
HAND_BACK_WAIT_S: Final = 1.0


@dataclass(slots=True)
class _Block:
    folder: Path
    reason: str
    next_check: float
    #: The storage marker's token the ledger names (checked again with the folder), if any.
    storage_token: str | None = None


class OutputGuard:
    """One per worker process, shared by its threads."""

    def __init__(self, ledger: Ledger, sink: OutputSink, *, recheck_s: float = RECHECK_S) -> None:
        self._ledger = ledger
        self._sink = sink
        self._recheck_s = recheck_s
        self._reporter = f"{socket.gethostname()}:{os.getpid()}"
        self._lock = threading.Lock()
        self._blocks: dict[str, _Block] = {}
        self._checked: set[tuple[str, str, str]] = set()  # (dataset, output_dir, token) found right

    def block(
        self, dataset: str, folder: Path, error: OutputUnwritable, storage_token: str | None = None
    ) -> None:
        with self._lock:
            fresh = dataset not in self._blocks
            self._blocks[dataset] = _Block(
                folder, error.reason, time.monotonic() + self._recheck_s, storage_token
            )
        if fresh:
            log.error("%s: output not writable here, taking none of its work until it is: %s", dataset, error)
        self._report(dataset, error.reason)

    def check_storage(self, dataset: str, folder: Path, output_dir: Path, token: str | None) -> str | None:
        """The first time this process meets ``dataset`` (and after a block): is ``output_dir`` the storage
        submit marked? A problem blocks the dataset here, as an unwritable folder does."""
        if token is None:
            return None
        key = (dataset, str(output_dir), token)
        with self._lock:
            if key in self._checked:
                return None
        problem = check_same_storage(output_dir, token)
        if problem is None:
            with self._lock:
                self._checked.add(key)
            return None
        self.block(dataset, folder, OutputUnwritable(problem), token)
        return problem

    def problem(self, dataset: str) -> str | None:
        """Why this process takes no work of ``dataset`` now, or None. Tries the folder again when due."""
        with self._lock:
            block = self._blocks.get(dataset)
            if block is None:
                return None
            if time.monotonic() < block.next_check:
                return block.reason
            block.next_check = time.monotonic() + self._recheck_s  # one thread re-checks at a time
        try:
            if block.storage_token is not None:
                problem = check_same_storage(block.folder.parent, block.storage_token)
                if problem is not None:
                    raise OutputUnwritable(problem)
            self._sink.check_writable(block.folder)
        except OutputUnwritable as e:
            with self._lock:
                block.reason = e.reason
            return e.reason
        with self._lock:
            self._blocks.pop(dataset, None)
        log.warning("%s: output writable again, taking its work again", dataset)
        self._report(dataset, "")
        return None

    def _report(self, dataset: str, problem: str) -> None:
        try:
            self._ledger.report_output_problem(dataset, self._reporter, problem)
        except LedgerError as e:
            log.warning("%s: could not report the output problem: %s", dataset, e)
