"""Output files: one append-only JSONL part file per worker process and dataset.

A record is written with one ``os.write`` of a whole line to an ``O_APPEND`` file, so it reaches the kernel
before the ledger commit (a killed process loses nothing it acknowledged); with ``fsync = "always"`` it also
reaches the disk first (a host crash loses nothing it acknowledged). Each process writes its own file, so
no two writers ever share one. Export and reconcile skip a torn last line.

A write that fails (a full disk, a read-only or vanished folder, a quota, an I/O error) leaves the file as
it was: the part of the line that was written is cut off again (``ftruncate`` to the last whole record),
so a record is whole on disk or absent, and the next one never lands on a torn fragment. The caller gets
``OutputUnwritable`` and must not count the record.
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


class OutputSink:
    """Thread-safe writer of records and failures for every dataset this process works on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: dict[Path, int] = {}
        self._file_locks: dict[Path, threading.Lock] = {}
        #: Where each file's last whole record ends (only this process writes to it).
        self._ends: dict[Path, int] = {}

    def _fd(self, path: Path) -> tuple[int, threading.Lock]:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                except OSError as e:
                    raise OutputUnwritable(_describe(path, e)) from None
                self._fds[path] = fd
                self._file_locks[path] = threading.Lock()
                self._ends[path] = os.fstat(fd).st_size
            return fd, self._file_locks[path]

    def _append(self, path: Path, record: dict[str, Any], fsync: str) -> None:
        line = orjson.dumps(record) + b"\n"
        fd, lock = self._fd(path)
        with lock:
            end = self._ends[path]
            try:
                if os.fstat(fd).st_size != end:  # a failed write left a fragment we could not cut then
                    os.ftruncate(fd, end)
                written = os.write(fd, line)
                while written < len(line):  # a short write on a full disk or a signal: finish the line
                    written += os.write(fd, line[written:])
                if fsync == "always":
                    os.fsync(fd)
            except OSError as e:
                # Not a byte of a record that is not whole may stay: cut back to the last whole one (a
                # file can always be shortened, even on a full disk; if not now, before the next write).
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, end)
                raise OutputUnwritable(_describe(path, e)) from None
            self._ends[path] = end + len(line)

    def check_writable(self, dataset_dir: Path) -> None:
        """Write, flush and remove a small probe file in ``dataset_dir``; raises ``OutputUnwritable``."""
        probe = dataset_dir / f".probe-{_process_tag()}"
        try:
            dataset_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, b"\0" * PROBE_BYTES)
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
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
