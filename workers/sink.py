"""Output files: one append-only JSONL part file per worker process and dataset.

A record is written as a whole line to an ``O_APPEND`` file (the lines of threads recording at once go out
in one ``os.write``: group commit, see ``OutputSink``), so it reaches the kernel before the ledger commit (a
killed process loses nothing it acknowledged); with ``fsync = "always"`` it also reaches the disk first (a
host crash loses nothing it acknowledged). Each process writes its own file, so no two writers ever share
one. Export and reconcile skip a torn last line.

A write that fails (a full disk, a read-only or vanished folder, a quota, an I/O error) leaves the file as
it was: the part of the lines that was written is cut off again (``ftruncate`` to the last whole record),
so a record is whole on disk or absent, and the next one never lands on a torn fragment. The caller gets
``OutputUnwritable`` (every caller whose line was in the failed write) and must not count the record.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from pathlib import Path
from typing import Any, Final

import orjson

from budget import defaults

#: File name patterns inside ``<output_dir>/<dataset>/``.
PART_GLOB: Final = "part-*.jsonl"
FAILED_GLOB: Final = "failed-*.jsonl"

FSYNC_POLICIES: Final = ("always", "never")


class OutputUnwritable(Exception):
    """A record could not be written (and nothing of it is left in the file)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class UnsafeDatasetName(ValueError):
    """A dataset name that could write outside the output dir (the ledger is shared: check it here too)."""


def dataset_dir(output_dir: str | Path, dataset: str) -> Path:
    """``output_dir/dataset``, refusing any name that could leave ``output_dir``."""
    if not defaults.DATASET_NAME_RE.fullmatch(dataset) or dataset in (".", ".."):
        raise UnsafeDatasetName(f"dataset name {dataset!r} cannot name a folder under the output dir")
    return Path(output_dir) / dataset


#: Bytes the writability probe writes: about one large record.
PROBE_BYTES: Final = 64 * 1024


def _describe(path: Path, error: OSError) -> str:
    return f"cannot write {path}: {error.strerror or error}"


def _process_tag() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class _Ticket:
    """One line waiting to be written, and how its write went."""

    __slots__ = ("done", "error", "fsync", "lead", "line")

    def __init__(self, line: bytes, fsync: bool) -> None:
        self.line = line
        self.fsync = fsync
        self.done = threading.Event()
        self.error: OutputUnwritable | None = None
        self.lead = False  # woken to write the lines queued behind it, not because its own is written


class _File:
    """One open output file: its descriptor, where its last whole record ends, and its queue."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd
        #: Where the last whole record ends (only this process writes to the file).
        self.end = os.fstat(fd).st_size
        self.mutex = threading.Lock()  # held only to queue or take lines, never across a write
        self.queue: list[_Ticket] = []
        self.writing = False


class OutputSink:
    """Thread-safe writer of records and failures for every dataset this process works on.

    Group commit: the lines that queue while a write (and its fsync) runs go out together, in one write
    and one fsync, by the thread whose line is first in the queue; the others wait for their line's
    outcome. A thousand generations recording at once then cost a few writes, not a thousand: one file
    lock passed from thread to thread held each record's write behind a wait for the GIL, and a 1,024-in-
    flight run spent its time queueing for it. Every caller still returns only once its line is written
    (and flushed, with ``fsync = "always"``), or raises ``OutputUnwritable`` with nothing of it left.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[Path, _File] = {}

    def _file(self, path: Path) -> _File:
        f = self._files.get(path)
        if f is not None:
            return f
        with self._lock:
            f = self._files.get(path)
            if f is None:
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                except OSError as e:
                    raise OutputUnwritable(_describe(path, e)) from None
                f = self._files[path] = _File(path, fd)
            return f

    def _append(self, path: Path, record: dict[str, Any], fsync: str) -> None:
        ticket = _Ticket(orjson.dumps(record) + b"\n", fsync == "always")
        f = self._file(path)
        with f.mutex:
            f.queue.append(ticket)
            lead = not f.writing
            f.writing = True
        if not lead:
            ticket.done.wait()
            if not ticket.lead:  # another thread wrote it, or failed to
                if ticket.error is not None:
                    raise ticket.error
                return
        with f.mutex:
            batch, f.queue = f.queue, []  # its own line first: the queue's head leads
        try:
            self._write(f, batch)
        finally:
            for t in batch:  # an exception out of the write (not an OSError) fails the whole batch
                if not t.done.is_set() or t.lead:
                    t.error = t.error or OutputUnwritable(f"cannot write {f.path}: interrupted")
                    t.lead = False
                    t.done.set()
            with f.mutex:  # the lines queued meanwhile: the first of them writes them
                if f.queue:
                    f.queue[0].lead = True
                    f.queue[0].done.set()
                else:
                    f.writing = False
        if ticket.error is not None:
            raise ticket.error

    @staticmethod
    def _write(f: _File, batch: list[_Ticket]) -> None:
        """Write ``batch``'s lines in one go (and fsync them if one asks it), then wake their threads."""
        data = b"".join(t.line for t in batch)
        end = f.end
        error: OutputUnwritable | None = None
        try:
            if os.fstat(f.fd).st_size != end:  # a failed write left a fragment we could not cut then
                os.ftruncate(f.fd, end)
            written = os.write(f.fd, data)
            while written < len(data):  # a short write on a full disk or a signal: finish the lines
                written += os.write(f.fd, data[written:])
            if any(t.fsync for t in batch):
                os.fsync(f.fd)
            f.end = end + len(data)
        except OSError as e:
            # Not a byte of a record that is not whole may stay: cut back to the last whole one (a file
            # can always be shortened, even on a full disk; if not now, before the next write).
            with contextlib.suppress(OSError):
                os.ftruncate(f.fd, end)
            error = OutputUnwritable(_describe(f.path, e))
        for t in batch:
            t.error = error
            t.lead = False
            t.done.set()

    def check_writable(self, dataset_dir: Path, size: int = PROBE_BYTES) -> None:
        """Write ``size`` bytes (a record's worth), flush and remove a probe file in ``dataset_dir``;
        raises ``OutputUnwritable``."""
        probe = dataset_dir / f".probe-{_process_tag()}"
        try:
            dataset_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                data = b"\0" * size
                written = 0
                while written < len(data):
                    written += os.write(fd, data[written:])
                os.fsync(fd)
            finally:
                os.close(fd)
                probe.unlink(missing_ok=True)
        except OSError as e:
            raise OutputUnwritable(_describe(dataset_dir, e)) from None

    def write_record(self, dataset_dir: Path, record: dict[str, Any], fsync: str = "always") -> None:
        self._append(dataset_dir / f"part-{_process_tag()}.jsonl", record, fsync)

    def write_failure(self, dataset_dir: Path, record: dict[str, Any], fsync: str = "always") -> None:
        self._append(dataset_dir / f"failed-{_process_tag()}.jsonl", record, fsync)

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                os.close(f.fd)
            self._files.clear()
