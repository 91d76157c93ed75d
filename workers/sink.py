"""Output files: one append-only JSONL part file per worker process and dataset.

A record is written with one ``os.write`` of a whole line to an ``O_APPEND`` file, so it reaches the kernel
before the ledger commit (a killed process loses nothing it acknowledged); with ``fsync = "always"`` it also
reaches the disk first (a host crash loses nothing it acknowledged). Each process writes its own file, so
no two writers ever share one. Export and reconcile skip a torn last line.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from pathlib import Path
from typing import Any, Final

import orjson

#: File name patterns inside ``<output_dir>/<dataset>/``.
PART_GLOB: Final = "part-*.jsonl"
FAILED_GLOB: Final = "failed-*.jsonl"

FSYNC_POLICIES: Final = ("always", "never")


#: What a dataset name may be (the config checks it too): it names a folder under the output dir.
DATASET_NAME_RE: Final = re.compile(r"[A-Za-z0-9_.-]+")


class UnsafeDatasetName(ValueError):
    """A dataset name that could write outside the output dir (the ledger is shared: check it here too)."""


def dataset_dir(output_dir: str | Path, dataset: str) -> Path:
    """``output_dir/dataset``, refusing any name that could leave ``output_dir``."""
    if not DATASET_NAME_RE.fullmatch(dataset) or dataset in (".", ".."):
        raise UnsafeDatasetName(f"dataset name {dataset!r} cannot name a folder under the output dir")
    return Path(output_dir) / dataset


def _process_tag() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class OutputSink:
    """Thread-safe writer of records and failures for every dataset this process works on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: dict[Path, int] = {}
        self._file_locks: dict[Path, threading.Lock] = {}

    def _fd(self, path: Path) -> tuple[int, threading.Lock]:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                self._fds[path] = fd
                self._file_locks[path] = threading.Lock()
            return fd, self._file_locks[path]

    def _append(self, path: Path, record: dict[str, Any], fsync: str) -> None:
        line = orjson.dumps(record) + b"\n"
        fd, lock = self._fd(path)
        with lock:
            written = os.write(fd, line)
            while written < len(line):  # a short write on a full disk or a signal: finish the line
                written += os.write(fd, line[written:])
            if fsync == "always":
                os.fsync(fd)

    def write_record(self, dataset_dir: Path, record: dict[str, Any], fsync: str = "always") -> None:
        self._append(dataset_dir / f"part-{_process_tag()}.jsonl", record, fsync)

    def write_failure(self, dataset_dir: Path, record: dict[str, Any], fsync: str = "always") -> None:
        self._append(dataset_dir / f"failed-{_process_tag()}.jsonl", record, fsync)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
