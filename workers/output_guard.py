"""A worker that cannot write a dataset's output stops taking that dataset's work at once, and a sample
generated whose record cannot be written is held, not generated again.

Three things block a dataset in a worker process: the storage check (``budget.storage``: the worker's
``output_dir`` must hold the marker submit wrote there, so a worker on a host without the shared storage
refuses instead of writing records nobody exports), too little room for the records it is about to write,
and a record that could not be written.

Room is proven before a generation is admitted, not after: ``admit_room`` compares the folder's free
space and inodes (``statvfs``) with the worst-case size of every record this process has in flight plus
those it is about to admit (``worst_record_bytes``: the prompt and ``max_new_tokens`` at
``BYTES_PER_TOKEN``), and a read-only remount shows there too. Not enough room blocks the dataset: no
server call. So per outage, only generations already in flight when the disk filled (another process,
another program) are at risk, and none of them is lost: a record that cannot be written (``OutputUnwritable``:
a full disk, a quota, a read-only remount, an I/O error) is held in the ledger (``budget/lua/hold.lua``,
at most ``HELD_MAX_BYTES`` a dataset; its lease kept without expiry, so it survives a worker restart and
is never fed again), and written and committed once room comes back, by whichever worker process finds it
first (``flush_held``; a background thread of each process looks every ``FLUSH_EVERY_S``). Its tokens are
counted once, at that commit. Only past the cap is a sample given back to be generated again.

A blocked dataset's next tasks are handed back without a server call, and the problem is in the ledger
for ``status``, the metrics and Flower, with the folder, its free space and what it needs. Every
``RECHECK_S`` the worker tries again: the room for the records it may have in flight, then the held
records themselves (a real record must fit), else a probe of one worst-case record's size, written and
flushed. Only then is the block lifted.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import orjson

from budget import CommitItem, HoldOutcome, Ledger, LedgerError
from budget.spec import DatasetSpec
from budget.storage import check_same_storage
from workers.sink import OutputSink, OutputUnwritable, dataset_dir

log = logging.getLogger(__name__)

#: How often a blocked dataset's output folder is tried again.
RECHECK_S: Final = 10.0
#: A task of a blocked dataset waits this long before it is handed back, so that a queue of them does not
#: spin through the broker while the disk is full.
HAND_BACK_WAIT_S: Final = 1.0
#: The most bytes one dataset's held records may take in the ledger (Redis memory); past it, a sample
#: whose record cannot be written goes back to pending, to be generated again.
HELD_MAX_BYTES: Final = 64 * 2**20
#: How often each worker process looks for held records to write (any dataset).
FLUSH_EVERY_S: Final = 2.0
#: Held records written per ledger read.
FLUSH_BATCH: Final = 64
#: How long one process may write a dataset's held records before another may take over.
FLUSH_CLAIM_MS: Final = 60_000
#: The same problem of a dataset goes to the ledger at most this often (its held count with it).
REPORT_EVERY_S: Final = 2.0
#: ``flush_held``'s answer while another process writes the dataset's held records.
ANOTHER_FLUSHES: Final = "another worker is writing the held records"
#: The most one output token takes in a record: its id (at most 10 digits and a comma) and its text (a
#: token's UTF-8 bytes, or JSON escapes), generously.
BYTES_PER_TOKEN: Final = 48
#: A record's fields beyond its prompt and tokens (ids, finish reason, server, times), generously.
RECORD_OVERHEAD_BYTES: Final = 2048
#: Free space kept beyond the records in flight (the filesystem's own blocks and metadata).
ROOM_MARGIN_BYTES: Final = 64 * 1024
#: Free inodes needed (a new part file and a failures file).
ROOM_INODES: Final = 4
#: The largest probe written to prove that a record fits again.
PROBE_MAX_BYTES: Final = 4 * 2**20


def worst_record_bytes(sample: Mapping[str, Any], out_tokens: int) -> int:
    """The most bytes the record of ``sample`` can take with ``out_tokens`` generated: its prompt (and
    meta, conversation) twice over, the tokens at ``BYTES_PER_TOKEN`` and the fixed fields."""
    return RECORD_OVERHEAD_BYTES + 2 * len(orjson.dumps(sample)) + BYTES_PER_TOKEN * max(out_tokens, 0)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} GiB"


def _existing(folder: Path) -> Path:
    """``folder``, or its nearest ancestor that exists (a dataset folder not made yet)."""
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    return folder


def room_problem(folder: Path, need_bytes: int, what: str) -> str | None:
    """Why ``folder`` cannot take ``need_bytes`` more (``what`` they are for), or None: its free space and
    inodes as ``statvfs`` tells them, and whether it is mounted read-only."""
    try:
        st = os.statvfs(_existing(folder))
    except OSError as e:
        return f"cannot look at {folder}: {e.strerror or e}"
    if st.f_flag & os.ST_RDONLY:
        return f"cannot write {folder}: Read-only file system"
    free = st.f_bavail * st.f_frsize
    need = need_bytes + ROOM_MARGIN_BYTES
    inodes_short = st.f_files > 0 and st.f_favail < ROOM_INODES  # some filesystems count none
    if free >= need and not inodes_short:
        return None
    inodes = f", {st.f_favail:,} inode(s) free" if st.f_files > 0 else ""
    return f"not enough room in {folder}: {_size(free)} free{inodes}, needs {_size(need)} for {what}"


@dataclass(slots=True)
class _Block:
    folder: Path
    reason: str
    next_check: float
    #: The storage marker's token the ledger names (checked again with the folder), if any.
    storage_token: str | None = None
    #: The worst-case size of one of the dataset's records: what must fit before the block lifts.
    record_bytes: int = RECORD_OVERHEAD_BYTES


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
        #: Room set aside for the records in flight here: (dataset, sample id) -> (folder, worst bytes).
        self._writing: dict[tuple[str, str], tuple[str, int]] = {}
        #: The worst-case record size each dataset was last admitted with.
        self._record_bytes: dict[str, int] = {}
        self._flusher: threading.Thread | None = None
        #: The problem last reported for each dataset, when (monotonic), and whether it named held records.
        self._reported: dict[str, tuple[str, float, bool]] = {}
        self._stop = threading.Event()

    def block(
        self, dataset: str, folder: Path, error: OutputUnwritable, storage_token: str | None = None
    ) -> None:
        with self._lock:
            fresh = dataset not in self._blocks
            old = self._blocks.get(dataset)
            self._blocks[dataset] = _Block(
                folder,
                error.reason,
                time.monotonic() + self._recheck_s,
                storage_token or (old.storage_token if old else None),
                self._record_bytes.get(dataset, RECORD_OVERHEAD_BYTES),
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

    # --- room for the records about to be written -----------------------------------------------------

    def admit_room(self, dataset: str, folder: Path, worst: Mapping[str, int]) -> tuple[int, str | None]:
        """Before samples are admitted: set aside room for their records (``worst``: sample id -> worst-case
        bytes, in order), proven against ``folder``'s free space with what this process has in flight
        there. Returns how many of them (the first ones) have room, and why not the others. None having
        room blocks the dataset here and says why; each sample set aside is ended by ``finished``."""
        if not worst:
            return 0, None
        with self._lock:
            here = str(folder.parent)
            flying = [b for (ds, sid), (f, b) in self._writing.items() if f == here and sid not in worst]
            largest = max(worst.values())
            self._record_bytes[dataset] = max(largest, self._record_bytes.get(dataset, 0))
        sizes = list(worst.values())
        fit, problem, first_problem = len(sizes), None, ""
        while fit > 0:
            problem = room_problem(
                folder,
                sum(flying) + sum(sizes[:fit]),
                f"{len(flying) + fit} record(s) in flight ({_size(largest)} each at most)",
            )
            if problem is None:
                break
            first_problem = first_problem or problem
            fit = fit - 1 if problem.startswith("not enough room") else 0
        if fit == 0:
            problem = first_problem
            self.block(dataset, folder, OutputUnwritable(problem))
            return 0, problem
        with self._lock:
            for sid, size in list(worst.items())[:fit]:
                self._writing[(dataset, sid)] = (here, size)
        return fit, (first_problem if fit < len(sizes) else None)

    def finished(self, dataset: str, sample_id: str) -> None:
        """The record of ``sample_id`` is written, held, or will not be: its room is free again."""
        with self._lock:
            self._writing.pop((dataset, sample_id), None)

    def _in_flight_bytes(self, folder: Path) -> tuple[int, int]:
        here = str(folder.parent)
        with self._lock:
            sizes = [b for f, b in self._writing.values() if f == here]
        return len(sizes), sum(sizes)

    # --- held records ---------------------------------------------------------------------------------

    def hold(
        self, dataset: str, sample_id: str, attempt: str, record: Mapping[str, Any], tokens: int
    ) -> bool:
        """Keep the record that could not be written in the ledger, to be written once room comes back.
        False when it cannot be held (past ``HELD_MAX_BYTES``, or no longer this attempt's): the caller
        gives the sample back."""
        raw = orjson.dumps(record)
        try:
            outcome = self._ledger.hold(dataset, sample_id, attempt, raw, tokens, HELD_MAX_BYTES)
        except LedgerError as e:
            log.warning("%s/%s: could not hold the record: %s", dataset, sample_id, e)
            return False
        if outcome is not HoldOutcome.HELD:
            log.warning("%s/%s: record not held (%s): the sample is given back", dataset, sample_id, outcome)
            return False
        with self._lock:
            block = self._blocks.get(dataset)
        if block is not None:
            self._report(dataset, block.reason, held=True)  # with the held count
        self.start_flusher()
        return True

    def flush_held(self, dataset: str) -> str | None:
        """Write and commit ``dataset``'s held records here, when this process may (one at a time,
        fleet-wide). Returns why not all of them are written, or None once none is held."""
        if not self._ledger.claim_held_flush(dataset, self._reporter, FLUSH_CLAIM_MS):
            return ANOTHER_FLUSHES
        try:
            spec = DatasetSpec.from_json(self._ledger.spec(dataset))
            output_dir = Path(spec.output_dir)
            folder = dataset_dir(output_dir, dataset)
            if spec.storage_token is not None:
                problem = check_same_storage(output_dir, spec.storage_token)
                if problem is not None:
                    return problem
            while True:
                batch = self._ledger.held_records(dataset, FLUSH_BATCH)
                if not batch:
                    return None
                problem = self._write_held(dataset, folder, spec, batch)
                if problem is not None:
                    return problem
        finally:
            self._ledger.end_held_flush(dataset, self._reporter)

    def _write_held(
        self, dataset: str, folder: Path, spec: DatasetSpec, batch: list[tuple[str, bytes]]
    ) -> str | None:
        done = self._ledger.is_done(dataset, [sid for sid, _ in batch])
        items: list[CommitItem] = []
        gone = [sid for (sid, _), is_done in zip(batch, done, strict=True) if is_done]
        problem: str | None = None
        for (sid, raw), is_done in zip(batch, done, strict=True):
            if is_done:  # committed by an earlier flush that ended before taking it out
                continue
            record = orjson.loads(raw)
            problem = room_problem(folder, len(raw), "a held record")
            if problem is None:
                try:
                    self._sink.write_record(folder, record, spec.fsync)
                except OutputUnwritable as e:
                    problem = e.reason
            if problem is not None:
                break
            tokens = int(record.get("completion_tokens") or 0)
            items.append(
                CommitItem(
                    sid,
                    str(record["attempt"]),
                    tokens,
                    bool(record.get("truncated")),
                    reasoning_tokens=int(record.get("reasoning_tokens") or 0),
                    hit_max_new=bool(record.get("hit_max_new")),
                )
            )
        if items:
            outcomes = self._ledger.commit_many(dataset, items)
            log.warning("%s: wrote %d held record(s): %s", dataset, len(items), sorted(set(outcomes)))
        self._ledger.unhold(dataset, gone + [it.sample_id for it in items])
        return problem

    def start_flusher(self) -> None:
        """Start this process's thread that writes held records (any dataset) once they fit."""
        with self._lock:
            if self._flusher is not None:
                return
            self._flusher = threading.Thread(target=self._flush_loop, name="tf-held", daemon=True)
        self._flusher.start()

    def stop_flusher(self) -> None:
        self._stop.set()

    def _flush_loop(self) -> None:
        while not self._stop.wait(FLUSH_EVERY_S):
            try:
                with self._lock:
                    blocked = set(self._blocks)
                for dataset in blocked:  # tried again when due (held records first), tasks or not
                    self.problem(dataset)
                for dataset in self._ledger.datasets():
                    if dataset not in blocked and self._ledger.held_count(dataset) > 0:
                        self._flush_unblocked(dataset)
            except Exception:  # a Redis restart, a forgotten dataset: try again next round
                log.exception("writing held records")

    def _flush_unblocked(self, dataset: str) -> None:
        problem = self.flush_held(dataset)
        if problem is not None and problem != ANOTHER_FLUSHES:
            spec = DatasetSpec.from_json(self._ledger.spec(dataset))
            self.block(dataset, dataset_dir(spec.output_dir, dataset), OutputUnwritable(problem))

    # --- the block --------------------------------------------------------------------------------------

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
            count, flying = self._in_flight_bytes(block.folder)
            problem = room_problem(
                block.folder,
                max(flying, block.record_bytes),
                f"{max(count, 1)} record(s) in flight ({_size(block.record_bytes)} each at most)",
            )
            if problem is not None:
                raise OutputUnwritable(problem)
            problem = None
            if self._ledger.held_count(dataset) > 0:  # the held records first: real ones must fit
                problem = self.flush_held(dataset)
                if problem is not None and problem != ANOTHER_FLUSHES:
                    raise OutputUnwritable(problem)
            if problem is not None or self._ledger.held_count(dataset) == 0:
                self._sink.check_writable(block.folder, min(block.record_bytes, PROBE_MAX_BYTES))
        except (OutputUnwritable, LedgerError) as e:
            reason = e.reason if isinstance(e, OutputUnwritable) else f"cannot read the ledger: {e}"
            with self._lock:
                block.reason = reason
            self._report(dataset, reason)
            return reason
        with self._lock:
            self._blocks.pop(dataset, None)
        log.warning("%s: output writable again, taking its work again", dataset)
        self._report(dataset, "")
        return None

    def _report(self, dataset: str, problem: str, *, held: bool = False) -> None:
        """Tell the ledger (and so ``status``) why ``dataset``'s output cannot be written here; ``held``: a
        record was just held, so a report that named no held record yet is made again with their count."""
        # Hundreds of generations may meet a full disk at once (a group write fails for all its lines):
        # the same problem goes to the ledger at most every REPORT_EVERY_S, not once for each.
        now = time.monotonic()
        with self._lock:
            last = self._reported.get(dataset)
            if (
                problem
                and last is not None
                and last[0] == problem
                and now - last[1] < REPORT_EVERY_S
                and (last[2] or not held)
            ):
                return
            self._reported[dataset] = (problem, now, held)
        try:
            # the ledger names the records held with the problem (output_problem.lua), from its count as
            # the report lands: whichever report lands last names them all
            self._ledger.report_output_problem(dataset, self._reporter, problem)
        except LedgerError as e:
            log.warning("%s: could not report the output problem: %s", dataset, e)
