"""Small real disks for output-failure tests: a tmpfs mounted for the test (root only: CI runs as root)."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.support.env import IN_CI


@contextmanager
def mounted_tmpfs(mount: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of ``size_bytes`` at ``mount`` (created) while in the block; skipped where mounting is not
    allowed, except in CI, where it must work."""
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        if IN_CI:
            raise AssertionError(f"cannot mount a tmpfs: {done.stderr.decode()}")
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> Path:
    """Take every free byte of ``disk`` with one file."""
    filler = disk / "filler.bin"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for size in (65536, 512, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def every_line_is_a_whole_record(folder: Path, pattern: str = "part-*.jsonl") -> list[dict[str, Any]]:
    records = []
    for part in sorted(folder.glob(pattern)):
        data = part.read_bytes()
        assert data.endswith(b"\n") or not data, f"{part.name} ends with a torn record"
        records += [orjson.loads(line) for line in data.splitlines()]
    return records
